"""The typer application object every command module registers on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption, _click


class _UnsetOption(TyperOption):
    """An option whose unset value (``None``) is not converted: typer would build a pydantic type adapter for each
    option of the command (and import pydantic, about 60 ms, even for ``--help``'s unset value) only to turn
    ``None`` into ``None`` (or ``()`` for a multiple option). Given values are converted as typer does."""

    def process_value(self, ctx: Any, value: Any) -> Any:
        if value is not None:
            return super().process_value(ctx, value)
        value = () if self.multiple or self.nargs == -1 else None
        if self.required and self.value_is_missing(value):
            raise _click.exceptions.MissingParameter(ctx=ctx, param=self)
        return value if self.callback is None else self.callback(ctx, self, value)


class _LightOptions:
    """A command or group whose options (``--help`` among them) are :class:`_UnsetOption`: the same objects, the
    class swapped where typer made a plain ``TyperOption``."""

    def get_params(self, ctx: Any) -> list[Any]:
        params = super().get_params(ctx)  # type: ignore[misc]
        for param in params:
            if type(param) is TyperOption:
                param.__class__ = _UnsetOption
        return params


class _Group(_LightOptions, TyperGroup):
    pass


class _Command(_LightOptions, TyperCommand):
    pass


class _Typer(typer.Typer):
    """``typer.Typer`` whose commands are :class:`_Command` unless told otherwise."""

    def command(self, *args: Any, cls: type[TyperCommand] | None = None, **kwargs: Any) -> Callable[[Any], Any]:
        return super().command(*args, cls=cls or _Command, **kwargs)


app = _Typer(
    cls=_Group,
    name="ppsim",
    help="Generate, simulate, draw, calibrate and execute pipeline-parallel training schedules.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)


def _print_version(value: bool) -> None:
    if value:
        import ppsim

        typer.echo(f"ppsim {ppsim.__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", help="Print the ppsim version and exit.", is_eager=True, callback=_print_version),
    ] = False,
) -> None:
    """Generate, simulate, draw, calibrate and execute pipeline-parallel training schedules."""
