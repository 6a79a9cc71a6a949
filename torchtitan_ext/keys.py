"""The checks ``gift-train`` runs on every key before anything starts: TOML keys and
``--section.key`` overrides against the config object torchtitan's config function returns.

A key must name a leaf field of the config tree; a value must have the field's annotated type
(``gift.error_feedback = 1`` fails naming the key, the file, the value and ``bool``); the merged
values (config function < TOML < command line) must be in range (``training.steps >= 1``, the
``[gift]`` section through ``GiftConfig``). Split out of :mod:`.launcher`, which reads the TOML
file, merges these results into torchtitan's command line and runs it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import types
import typing
from collections.abc import Iterator, Sequence
from typing import Any, Literal

from gift_compile.config import GiftConfigError

from .section import GiftSection

__all__ = ["CLI", "check_ranges", "cli_key", "cli_settings", "expand_argv_recipe", "split_recipe_flag", "toml_settings",
           "toml_to_args"]

logger = logging.getLogger("gift_compile")

CLI = "command line"  # the source an override's errors name
# Integer fields that torchtitan accepts at parse time but that cannot run: checked on the
# merged values (config function < TOML < command line) before anything starts.
_MINIMUMS = {"training.steps": 1, "training.local_batch_size": 1, "training.seq_len": 1}


def _flatten(table: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for key, value in table.items():
        path = f"{prefix}{key}"
        if isinstance(value, dict):
            yield from _flatten(value, f"{path}.")
        else:
            yield path, value


def _describe(obj: Any) -> str:
    return ", ".join(f.name for f in dataclasses.fields(obj) if not f.name.startswith("_"))


@functools.cache
def _annotations(cls: type) -> dict[str, Any]:
    """Resolved field annotations of a config dataclass (strings where they do not resolve)."""
    hints = {f.name: f.type for f in dataclasses.fields(cls)}
    try:
        hints.update(typing.get_type_hints(cls))
    except Exception:  # noqa: BLE001 - an unresolvable annotation only means "not checked here"
        pass
    return hints


def _check_key(config: Any, key: str, source: str) -> Any:
    """The annotation of the leaf field ``key`` (dotted) of ``config``; ValueError if none."""
    node, walked = config, []
    parts = key.split(".")
    annotation: Any = None
    for i, part in enumerate(parts):
        field_names = {f.name for f in dataclasses.fields(node)} if dataclasses.is_dataclass(node) else set()
        where = f"[{'.'.join(walked)}]" if walked else "the top level"
        if part not in field_names or part == "model_spec":
            known = _describe(node) if dataclasses.is_dataclass(node) else "none (not a config section)"
            raise ValueError(f"{source}: unknown key '{key}': no field '{part}' in {where}; known: {known}")
        annotation = _annotations(type(node))[part]
        node = getattr(node, part)
        walked.append(part)
        if i < len(parts) - 1 and not dataclasses.is_dataclass(node):
            raise ValueError(f"{source}: unknown key '{key}': '{'.'.join(walked)}' is a value, not a section")
    if dataclasses.is_dataclass(node):
        raise ValueError(f"{source}: key '{key}' is a section; set its fields in a [{key}] table")
    return annotation


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_union(tp: Any) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def _all_fit(results: list[bool | None]) -> bool | None:
    """Combine per-part verdicts: False if any part is wrong, None if any cannot be judged."""
    if any(r is False for r in results):
        return False
    return None if any(r is None for r in results) else True


def _matches(value: Any, tp: Any) -> bool | None:
    """Whether a TOML value fits annotation ``tp``; None where this launcher cannot judge it
    (sections chosen by subcommand, callables, dicts), which leaves the verdict to tyro."""
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return _is_int(value)
    if tp is float:  # TOML ints are floats too
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if tp is str:
        return isinstance(value, str)
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:  # `type(...) is` so that True does not pass for Literal[1]
        return any(type(value) is type(a) and value == a for a in args)
    if _is_union(tp):  # TOML has no null: a value must fit one of the other members
        results = [_matches(value, a) for a in args if a is not type(None)]
        if any(r is True for r in results):
            return True
        return False if all(r is False for r in results) else None
    if origin is list or tp is list:
        if not isinstance(value, list):
            return False
        return _all_fit([_matches(v, args[0]) for v in value]) if args else True
    return None


def _type_name(tp: Any) -> str:
    """``tp`` in words for an error message."""
    if tp is bool:
        return "bool (true or false)"
    if tp in (int, float, str):
        return tp.__name__
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        return "one of " + ", ".join(repr(a) for a in args)
    if _is_union(tp):
        return " or ".join(_type_name(a) for a in args if a is not type(None))
    if origin is list:
        return f"a list of {_type_name(args[0])}" if args else "a list"
    return getattr(tp, "__name__", str(tp))


def _check_toml_value(key: str, value: Any, annotation: Any, source: str) -> None:
    if isinstance(value, float) and math.isnan(value):  # TOML `nan` is never a meaningful setting
        raise ValueError(f"{source}: key '{key}' = nan is not a number; expected {_type_name(annotation)}")
    if _matches(value, annotation) is False:
        problem = "is not allowed" if typing.get_origin(annotation) is Literal else "has the wrong type"
        raise ValueError(
            f"{source}: key '{key}' = {value!r} ({type(value).__name__}) {problem}; expected {_type_name(annotation)}"
        )


def _flag(key: str) -> str:
    return "--" + key.replace("_", "-")


def _value_args(key: str, value: Any, source: str) -> list[str]:
    """``key = value`` as tyro arguments (bools are flags, lists of str comma-joined)."""
    if isinstance(value, bool):
        head, _, leaf = key.rpartition(".")
        return [_flag(key) if value else _flag(f"{head}.no_{leaf}" if head else f"no_{leaf}")]
    if isinstance(value, (int, float, str)):
        return [_flag(key), str(value)]
    if isinstance(value, list) and all(isinstance(v, str) for v in value):
        # torchtitan registers a tyro rule that parses list[str] from "a,b,c", so an element
        # holding a comma would silently become two.
        if any("," in v for v in value):
            raise ValueError(f"{source}: key '{key}' = {value!r}: list elements cannot contain ','")
        return [_flag(key), ",".join(value)]
    if isinstance(value, list) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in value):
        return [_flag(key), *(str(v) for v in value)]
    raise ValueError(f"{source}: key '{key}': unsupported TOML value {value!r} (use a scalar or a list of scalars)")


def cli_key(arg: str, config: Any) -> tuple[str, bool] | None:
    """``(dotted key, negated)`` an override such as ``--gift.no-enable`` sets (None if not a flag)."""
    if not arg.startswith("--"):
        return None
    key = arg[2:].split("=", 1)[0].replace("-", "_")
    head, _, leaf = key.rpartition(".")
    if leaf.startswith("no_"):
        positive = f"{head}.{leaf[3:]}" if head else leaf[3:]
        try:
            _check_key(config, key, CLI)
        except ValueError:
            return positive, True
    return key, False


def _parse_cli_value(text: str, tp: Any) -> tuple[bool | None, Any]:
    """``(verdict, value)``: ``text`` parsed as tyro will parse it for annotation ``tp``.

    The verdict is None where this launcher cannot judge the annotation (tyro will)."""
    if tp is int:
        try:
            return True, int(text)
        except ValueError:
            return False, None
    if tp is float:
        try:
            value = float(text)
        except ValueError:
            return False, None
        return not math.isnan(value), value  # "nan" parses but is never a meaningful setting
    if tp is str:
        return True, text
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is Literal:
        for a in args:
            if str(a) == text:
                return True, a
        return False, None
    if _is_union(tp):
        if type(None) in args and text == "None":
            return True, None
        verdicts = []
        for a in args:
            if a is type(None):
                continue
            ok, value = _parse_cli_value(text, a)
            if ok:
                return True, value
            verdicts.append(ok)
        return (False if all(v is False for v in verdicts) else None), None
    if tp == list[str]:  # torchtitan's tyro rule: one "a,b,c" token
        return True, text.split(",")
    return None, None


def cli_settings(overrides: Sequence[str], config: Any) -> dict[str, Any]:
    """Check ``--section.key value`` overrides; ``{key: parsed value}`` for the range checks.

    Flags that are not leaf fields of ``config`` (``--help``, options of a section chosen by
    a subcommand) are left to tyro, which names them."""
    settings: dict[str, Any] = {}
    i = 0
    while i < len(overrides):
        arg = overrides[i]
        j = i + 1
        found = cli_key(arg, config)
        if found is None:
            i = j
            continue
        name, eq, inline = arg.partition("=")
        values = [inline] if eq else []
        while not eq and j < len(overrides) and not overrides[j].startswith("--"):
            values.append(overrides[j])
            j += 1
        i = j
        key, negated = found
        try:
            annotation = _check_key(config, key, CLI)
        except ValueError:
            continue
        if annotation is bool:
            # tyro's bools are flags: `--x` / `--x.no-y`; a value after one is a typo that
            # tyro would report as an unrecognized token, not naming the key. (A token with
            # ':' is a subcommand such as `activation-checkpoint:full`.)
            if eq or (values and ":" not in values[0]):
                given = inline if eq else values[0]
                head, _, leaf = key.rpartition(".")
                negative = _flag(f"{head}.no_{leaf}" if head else f"no_{leaf}")
                raise ValueError(
                    f"{CLI}: key '{key}' ({name} {given!r}) is a bool flag and takes no value; "
                    f"use {_flag(key)} for true or {negative} for false"
                )
            settings[key] = not negated
            continue
        if negated:
            raise ValueError(f"{CLI}: {name}: key '{key}' is not a bool flag (it expects {_type_name(annotation)})")
        if not values:
            raise ValueError(f"{CLI}: key '{key}' ({name}) expects a value: {_type_name(annotation)}")
        ok, value = _parse_cli_value(values[0], annotation)
        if ok is False:
            raise ValueError(
                f"{CLI}: key '{key}' = {values[0]!r} ({name}) is not a valid value; expected {_type_name(annotation)}"
            )
        if ok:
            settings[key] = value
    return settings


def toml_settings(table: dict[str, Any], config: Any, source: str) -> dict[str, tuple[Any, list[str]]]:
    """Checked TOML values without ``[job]``: ``{dotted key: (value, tyro arguments)}``.

    Order of the checks: the key, then the value's shape (scalar or list of scalars), then its
    type against the field's annotation."""
    settings: dict[str, tuple[Any, list[str]]] = {}
    for key, value in _flatten({k: v for k, v in table.items() if k != "job"}):
        annotation = _check_key(config, key, source)
        args = _value_args(key, value, source)
        _check_toml_value(key, value, annotation, source)
        settings[key] = (value, args)
    return settings


def toml_to_args(table: dict[str, Any], config: Any, source: str) -> dict[str, list[str]]:
    """Checked TOML tables (without ``[job]``) -> ``{key: tyro arguments}``."""
    return {key: args for key, (_, args) in toml_settings(table, config, source).items()}


def _lookup(config: Any, key: str) -> Any:
    node = config
    for part in key.split("."):
        node = getattr(node, part)
    return node


def check_ranges(config: Any, settings: dict[str, tuple[Any, str]], defaults_source: str) -> None:
    """Range checks on the merged values; errors name the key, the value and where it came from.

    ``settings`` maps a key to ``(value, source)`` for every key set by the TOML file or the
    command line; other keys keep the config function's value."""

    def merged(key: str) -> tuple[Any, str]:
        return settings[key] if key in settings else (_lookup(config, key), defaults_source)

    for key, minimum in _MINIMUMS.items():
        try:
            value, source = merged(key)
        except AttributeError:  # a config tree without this field
            continue
        if not _is_int(value) or value < minimum:
            raise ValueError(f"{source}: key '{key}' = {value!r} is invalid; allowed: an integer >= {minimum}")
    section = getattr(config, "gift", None)
    if not isinstance(section, GiftSection):
        return
    values = {f.name: merged(f"gift.{f.name}")[0] for f in dataclasses.fields(GiftSection)}
    try:
        GiftSection(**values)
    except GiftConfigError as err:
        key = f"gift.{err.field}"
        value, source = merged(key)
        raise ValueError(f"{source}: key '{key}' = {value!r}: {err}") from err


def split_recipe_flag(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """``(NAME, the other arguments)`` of a command line holding ``--gift.recipe NAME`` (or
    ``--gift.recipe=NAME``; the last one given counts), ``(None, args)`` without one. The one
    reading of that flag for gift-train (`launcher.expand_recipe`) and the trainer's entry point
    (`expand_argv_recipe`)."""
    name, rest, i = None, [], 0
    while i < len(args):
        flag, eq, inline = args[i].partition("=")
        if flag == "--gift.recipe":
            if not eq and i + 1 >= len(args):
                raise ValueError("--gift.recipe requires a value")
            name = inline if eq else args[i + 1]
            i += 1 if eq else 2
            continue
        rest.append(args[i])
        i += 1
    return name, rest


def expand_argv_recipe(argv: Sequence[str]) -> list[str]:
    """`argv` of the trainer's entry point (`gift_compile.torchtitan_ext.train`, started without
    gift-train) with a ``--gift.recipe NAME`` expanded as gift-train expands a command line's
    recipe: each field of the recipe that no ``--gift.*`` flag sets gets its flag (a flag the
    user typed beats the recipe), logged once. Without this a direct launch recorded the recipe's
    name while its fields kept the config function's values. gift-train passes every field of
    its recipe as a flag, so its command lines come back unchanged."""
    from gift_compile.recipes import recipe_fields

    name, rest = split_recipe_flag(argv)
    typed = set()
    for arg in rest:
        flag = arg.partition("=")[0]
        if flag.startswith("--gift."):
            leaf = flag.removeprefix("--gift.").replace("-", "_")
            typed.add(leaf.removeprefix("no_"))
    if not name:
        return list(argv)
    try:
        fields = recipe_fields(name)
    except ValueError as err:
        raise ValueError(f"{CLI}: {err}") from None
    missing = {k: v for k, v in fields.items() if k not in typed}
    if not missing:
        return list(argv)
    added = [a for k, v in missing.items() for a in _value_args(f"gift.{k}", list(v) if isinstance(v, tuple) else v, CLI)]
    logger.warning("GIFT: --gift.recipe %r on the trainer's command line sets %s (the --gift.* flags typed beside it "
                   "win)", name, ", ".join(f"{k}={v!r}" for k, v in missing.items()))
    return [*argv, *added]
