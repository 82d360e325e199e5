"""The typer application object every command module registers on."""

from __future__ import annotations

from collections.abc import Callable
from enum import Enum
from typing import Annotated, Any

import typer
from typer.core import TyperCommand, TyperGroup, TyperOption, _click

_PYDANTIC = object()
"""What :func:`plain_value` returns for a value only typer's pydantic adapter can convert."""


def plain_value(param: Any, value: Any) -> Any:
    """``value`` converted as typer's pydantic adapter for ``param`` would, for the plain cases (a ``str``, a whole
    number in digits, a list of ``str``, a default already of the option's type), or :data:`_PYDANTIC`: building
    the adapter imports pydantic (about 60 ms), more than a short command takes."""
    descriptor = getattr(param, "type_descriptor", None)
    if descriptor is None or descriptor.parameter_info.parser is not None:
        return _PYDANTIC
    info, kind = descriptor.parameter_info, descriptor.annotation
    if kind is str and isinstance(value, str):
        return value
    if kind == list[str] and isinstance(value, (list, tuple)) and all(isinstance(v, str) for v in value):
        return list(value)
    if isinstance(kind, type) and issubclass(kind, Enum) and isinstance(value, kind):
        return value
    if kind is int and not info.clamp:
        if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 18:
            value = int(value)
        if type(value) is int and (info.min is None or value >= info.min) and (info.max is None or value <= info.max):
            return value
    return _PYDANTIC


class _UnsetOption(TyperOption):
    """An option whose unset value (``None``) is not converted: typer would build a pydantic type adapter for each
    option of the command (and import pydantic, about 60 ms, even for ``--help``'s unset value) only to turn
    ``None`` into ``None`` (or ``()`` for a multiple option). Plain given values are converted without pydantic
    (:func:`plain_value`), the others as typer does."""

    def process_value(self, ctx: Any, value: Any) -> Any:
        if value is not None:
            plain = plain_value(self, value)
            if plain is _PYDANTIC:
                return super().process_value(ctx, value)
            value = plain
        else:
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
