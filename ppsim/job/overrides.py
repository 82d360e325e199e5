"""The one reader of ``--SECTION.KEY VALUE`` job overrides without torchtitan (a TOML job, or before torchtitan is
imported), with torchtitan's (tyro's) command-line rules; where torchtitan is installed a config function's overrides
are parsed by tyro itself (``ppsim.calibrate.torchtitan.config``), after :func:`check_override_names`. Also the
command line's extra arguments (:func:`extra_overrides`) and the plan's split of the overrides it chooses
(:func:`split_overrides`)."""

from __future__ import annotations

import difflib
import math
import re
import types
import typing
from collections.abc import Mapping, Sequence
from typing import Any

from ppsim.errors import TorchtitanConfigError

OVERRIDE_SECTIONS = ("parallelism", "training")



# --- overrides -------------------------------------------------------------------------------------------------
def parse_overrides(args: Sequence[str], fields: Mapping[str, Any], *, source: str = "") -> dict[str, Any]:
    """``--SECTION.KEY VALUE`` tokens -> ``{"SECTION.KEY": typed value}``, with torchtitan's (tyro's) command-line
    rules: ``--k VALUE`` or ``--k=VALUE``; ``-`` and ``_`` alike in names; a bool is a flag (``--k`` sets it,
    ``--SECTION.no_KEY`` clears it); ``None`` for an optional; a ``list[str]`` is one comma-separated value, a
    ``list[list[str]]`` several (``--parallelism.module_fqns_per_model_part tok_embeddings,layers.0 layers.1,norm``).
    ``fields`` maps ``SECTION.KEY`` to its type annotation. Unknown keys (with close matches), a missing or
    mistyped value and a key given twice are one :class:`TorchtitanConfigError` line each (ppsim refuses the repeat
    that tyro would resolve by keeping the last)."""
    out: dict[str, Any] = {}
    i = 0
    while i < len(args):
        token = args[i]
        i += 1
        name, annotation, negated = _override_name(token, fields, source)
        has_value, value = "=" in token, token.partition("=")[2]
        section, _, key = name.partition(".")
        if name in out:
            raise TorchtitanConfigError(f"--{name} given twice; give it once")
        if _is_bool(annotation):
            if has_value:
                raise TorchtitanConfigError(f"--{token[2:]}: --{name} is a flag and takes no value (torchtitan's "
                                            f"command line): pass --{name} to set it, --{section}.no_{key} to clear it")
            out[name] = not negated
            continue
        if _is_nested_list(annotation):
            values = [value] if has_value else []
            while not has_value and i < len(args) and not args[i].startswith("-"):
                values.append(args[i])
                i += 1
            if not values:
                raise TorchtitanConfigError(f"--{name} needs a value: module names per part, each part "
                                            f"comma-separated, e.g. --{name} tok_embeddings,layers.0 layers.1,norm")
            out[name] = _convert(name, values, annotation)
            continue
        if not has_value:
            if i >= len(args) or (args[i].startswith("--") and not _is_number(args[i])):
                raise TorchtitanConfigError(f"--{name} needs a value ({_type_name(annotation)}); e.g. "
                                            f"--{name} {_example(annotation)}")
            value = args[i]
            i += 1
        out[name] = _convert(name, [value], annotation)
    return out


def check_override_names(args: Sequence[str], fields: Mapping[str, Any], *, source: str = "") -> None:
    """ppsim's rules on the override names, before tyro reads the values: only ``--parallelism.KEY`` and
    ``--training.KEY``, known keys (else the close ones), each once, no stray value first."""
    seen: set[str] = set()
    for i, token in enumerate(args):
        if not token.startswith("--") and i > 0:
            continue  # a value: tyro reads it
        name = _override_name(token, fields, source)[0]
        if name in seen:
            raise TorchtitanConfigError(f"--{name} given twice; give it once")
        seen.add(name)


def _override_name(token: str, fields: Mapping[str, Any], source: str) -> tuple[str, Any, bool]:
    """``(SECTION.KEY, its type, negated)`` of an override token (``--parallelism.no_KEY`` negates a flag)."""
    if not token.startswith("--") or "." not in token.split("=", 1)[0]:
        raise TorchtitanConfigError(_stray(token))
    name = token[2:].partition("=")[0].replace("-", "_")
    section, _, key = name.partition(".")
    if section not in OVERRIDE_SECTIONS:
        raise TorchtitanConfigError(
            f"--{name}: ppsim reads only --parallelism.KEY and --training.KEY overrides (the settings that shape "
            "the pipeline); drop it")
    annotation = fields.get(name)
    if annotation is None and key.startswith("no_") and _is_bool(fields.get(f"{section}.{key[3:]}")):
        return f"{section}.{key[3:]}", fields[f"{section}.{key[3:]}"], True
    if annotation is None:
        raise TorchtitanConfigError(_unknown(name, fields, source))
    return name, annotation, False


def extra_overrides(args: Sequence[str], *, job_given: bool, option_names: Sequence[str],
                    command: str) -> list[str]:
    """The extra arguments of a command that takes --torchtitan-config (``args``; ``job_given``: whether it was
    passed): job config overrides, which need the config; anything else is a mistyped option (with the close names
    of ``option_names``) or a stray value, refused in one line (click would have, without the extra arguments)."""
    args = list(args)
    if not args:
        return []
    first = args[0]
    if first.startswith("--") and "." in first.split("=", 1)[0]:
        if not job_given:
            raise TorchtitanConfigError(f"{first.split('=', 1)[0]} overrides a torchtitan job config key: pass "
                                        "--torchtitan-config MODULE:CONFIG (or job.toml) with it")
        return args
    if first.startswith("-"):
        close = difflib.get_close_matches(first.split("=", 1)[0], list(option_names), n=2, cutoff=0.6)
        hint = f"; did you mean {' or '.join(close)}?" if close else f"; see `{command} --help`"
        raise TorchtitanConfigError(f"no such option: {first}{hint}")
    raise TorchtitanConfigError(f"unexpected argument {first!r}: this command takes options only; see "
                                f"`{command} --help`")


def override_fields_of(section: str, annotations: Mapping[str, Any]) -> dict[str, Any]:
    """``{"SECTION.KEY": annotation}`` for :func:`parse_overrides`, from a dataclass's resolved annotations."""
    return {f"{section}.{key}": value for key, value in annotations.items()}


def _stray(token: str) -> str:
    shown = shown_value(token).strip("'\"")
    if token.startswith("-"):
        return (f"no such option: {shown}; see --help (job config keys are overridden as --parallelism.KEY VALUE or "
                "--training.KEY VALUE)")
    return f"unexpected argument {shown_value(token)}: options take the form --name VALUE; see --help"


def close_matches(word: str, options: Sequence[str]) -> list[str]:
    """The options a typo of ``word`` most likely meant: the very close ones if any, else up to three close ones."""
    return (difflib.get_close_matches(word, options, n=3, cutoff=0.9)
            or difflib.get_close_matches(word, options, n=3, cutoff=0.6))


def _unknown(name: str, fields: Mapping[str, Any], source: str) -> str:
    section = name.split(".", 1)[0]
    same = [k for k in fields if k.startswith(section + ".")]
    close = close_matches(name, same)
    where = f" in --torchtitan-config {source}" if source else ""
    hint = (f"did you mean {' or '.join('--' + c for c in close)}?" if close
            else f"the {section} keys are listed by torchtitan's --help")
    return f"--{name}: no such key{where}; {hint}"


def _origin(annotation: Any) -> tuple[Any, tuple[Any, ...]]:
    return typing.get_origin(annotation), typing.get_args(annotation)


def _strip_optional(annotation: Any) -> tuple[Any, bool]:
    origin, args = _origin(annotation)
    if origin in (typing.Union, types.UnionType) and type(None) in args:
        rest = tuple(a for a in args if a is not type(None))
        return (rest[0] if len(rest) == 1 else typing.Union[rest]), True  # noqa: UP007
    return annotation, False


def _is_bool(annotation: Any) -> bool:
    return annotation is bool


def _is_nested_list(annotation: Any) -> bool:
    inner, _ = _strip_optional(annotation)
    origin, args = _origin(inner)
    return origin is list and bool(args) and typing.get_origin(args[0]) is list


def _is_number(text: str) -> bool:
    return re.fullmatch(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?", text) is not None


def _convert(name: str, values: list[str], annotation: Any) -> Any:
    """``values`` (the command-line tokens) as ``annotation``; one line naming the key and type otherwise."""
    inner, optional = _strip_optional(annotation)
    if optional and values == ["None"]:
        return None
    bad = TorchtitanConfigError(f"--{name} {shown_value(' '.join(values))}: not {_type_name(annotation)}; e.g. "
                                f"--{name} {_example(annotation)}")
    origin, args = _origin(inner)
    if origin is list:
        item = args[0] if args else str
        if typing.get_origin(item) is list:
            return [[s for s in v.split(",") if s] for v in values]
        if len(values) != 1 or item is not str:
            raise bad
        return [s for s in values[0].split(",") if s]
    if origin in (typing.Union, types.UnionType):
        for option in args:  # e.g. float | int: the first that takes the value
            try:
                return _convert(name, values, option)
            except TorchtitanConfigError:
                continue
        raise bad
    text = values[0]
    if inner is int:
        if re.fullmatch(r"[+-]?\d{1,18}", text.strip()) is None:
            raise bad
        return int(text)
    if inner is float:
        try:
            number = float(text)
        except ValueError:
            raise bad from None
        if not math.isfinite(number):
            raise bad
        return number
    if inner is str:
        return text
    raise TorchtitanConfigError(f"--{name}: a {_type_name(annotation)} setting ppsim cannot take from the command "
                                "line; set it in the config")


def _type_name(annotation: Any) -> str:
    inner, optional = _strip_optional(annotation)
    origin, args = _origin(inner)
    if _is_nested_list(inner):
        text = "module-name lists"
    elif origin is list:
        text = "a comma-separated list"
    elif origin in (typing.Union, types.UnionType):
        text = " or ".join(_type_name(a) for a in args)
    else:
        text = {int: "an integer", float: "a number", str: "a string", bool: "a flag"}.get(inner, str(inner))
    return f"{text} or None" if optional else text


def _example(annotation: Any) -> str:
    inner, _ = _strip_optional(annotation)
    origin, args = _origin(inner)
    if origin is list:
        return "a,b"
    if origin in (typing.Union, types.UnionType):
        return _example(args[0])
    return {int: "2", float: "1.0", str: "NAME"}.get(inner, "VALUE")


def shown_value(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def override_groups(args: Sequence[str]) -> list[tuple[str, list[str]]]:
    """The override tokens grouped per key, ``[("SECTION.KEY", tokens)]``, by the same reading as
    :func:`parse_overrides` (``--k VALUE``, ``--k=VALUE``, a flag alone, a module-list key's several values), without
    typing the values: for a caller that sets some keys itself (``ppsim plan``) and passes the rest on."""
    groups: list[tuple[str, list[str]]] = []
    for token in args:
        if token.startswith("--") and (not groups or "." in token.split("=", 1)[0]) and not _is_number(token):
            groups.append((token[2:].partition("=")[0].replace("-", "_"), [token]))
        elif groups:
            groups[-1][1].append(token)
        else:
            raise TorchtitanConfigError(_stray(token))
    return groups


def split_overrides(args: Sequence[str], chosen: Sequence[str]) -> tuple[dict[str, str], list[str]]:
    """``(given, kept)``: the value given for each override (``{"SECTION.KEY": text}``), and the tokens of the keys
    not in ``chosen`` (key names without their section), in order."""
    given: dict[str, str] = {}
    kept: list[str] = []
    for name, tokens in override_groups(args):
        head = tokens[0]
        given[name] = head.partition("=")[2] if "=" in head else " ".join(tokens[1:])
        if name.split(".")[-1] not in chosen:
            kept += tokens
    return given, kept
