"""The typer application object every command module registers on."""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption


class _HelpOption(TyperOption):
    """``--help``, left unconverted when it is not given: typer would build a pydantic type adapter (and import
    pydantic, about 60 ms) on every command only to turn the unset value into ``None``."""

    def process_value(self, ctx: Any, value: Any) -> Any:
        if value is None:
            return None if self.callback is None else self.callback(ctx, self, value)
        return super().process_value(ctx, value)


class _LightHelp:
    """A command or group whose ``--help`` is a :class:`_HelpOption`."""

    def get_help_option(self, ctx: Any) -> TyperOption | None:
        option = super().get_help_option(ctx)  # type: ignore[misc]
        if option is not None and type(option) is TyperOption:
            option.__class__ = _HelpOption  # the same object (typer caches it), with the unset value left alone
        return option


class _Group(_LightHelp, TyperGroup):
    pass


class _Command(_LightHelp, TyperCommand):
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
