"""Typed TOML tables: build a frozen dataclass from a parsed TOML table by its field types.

The run spec (`runspec.py`), the simulator's scenarios (`bagel.sim.discrete.scenario`) and
the chaos scenarios (`bagel.sim.chaos.scenario`) are all TOML files validated into frozen
dataclasses; this is the one builder they share. Parsing is strict, like nanoGPT's
configurator: an unknown key, a wrong type or a value a field refuses is an error whose
message names the key by its dotted path, so a typo never silently falls back to a default.

A field's annotation says what the TOML value must be:

| annotation                  | TOML value                         | error                         |
| --------------------------- | ---------------------------------- | ----------------------------- |
| `str`, `int`, `bool`        | that type (a bool is not an int)   | `k: expected an integer, ...` |
| `float`                     | an integer or a float, as a float  | `k: expected a number, ...`   |
| `Literal["a", "b"]`         | one of the values                  | `k: 'c' is not one of [...]`  |
| a dataclass                 | a table, built the same way        | `[k] must be a table`         |
| `tuple[T, ...]`             | an array of T                      | `k: expected a list of ...`   |
| `tuple[tuple[str, T], ...]` | a table of name = T, in file order | `k: expected a table of ...`  |

A field missing from the table takes its default (no default: the dataclass's own
TypeError, as `[k]: ...`, unless the field gives a `required` message). `toml_field` adds
per-field hooks: `parse(where, raw)` replaces the type check, `check(where, value)` runs
after it; both raise ValueError with the whole message. A `__post_init__` that raises
ValueError validates across fields. Every error is raised as the caller's `error` class.

No dependency outside the standard library: `protocol/` is the bottom layer.
"""

from __future__ import annotations

import dataclasses
import functools
import tomllib
import typing
from collections.abc import Callable, Collection
from typing import Any, Literal

_PARSE = "typedtoml.parse"
_CHECK = "typedtoml.check"
_REQUIRED = "typedtoml.required"

# what a scalar annotation expects, as the error messages say it: (singular, plural)
_NAMES: dict[Any, tuple[str, str]] = {
    float: ("a number", "numbers"),
    int: ("an integer", "integers"),
    bool: ("true or false", "booleans"),
    str: ("a string", "strings"),
}


class TomlTableError(ValueError):
    """A TOML table does not fit its dataclass; the message names the key."""


def toml_field(
    default: Any = dataclasses.MISSING,
    *,
    default_factory: Any = dataclasses.MISSING,
    parse: Callable[[str, Any], Any] | None = None,
    check: Callable[[str, Any], None] | None = None,
    required: str | None = None,
    **kwargs: Any,
) -> Any:
    """A dataclass field with builder hooks (see the module docstring); `where` is the key's
    dotted path. `required`: the message (after `key: `) when a field without a default is
    missing. Other keyword arguments go to `dataclasses.field`."""
    meta: dict[str, Any] = dict(kwargs.pop("metadata", None) or {})
    if parse is not None:
        meta[_PARSE] = parse
    if check is not None:
        meta[_CHECK] = check
    if required is not None:
        meta[_REQUIRED] = required
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta, **kwargs)


def key_path(where: str, key: str) -> str:
    return f"{where}.{key}" if where else key


@functools.cache
def _hints(cls: type) -> dict[str, Any]:
    return typing.get_type_hints(cls)


def convert(where: str, value: Any, annotation: Any, *, error: type[ValueError] = TomlTableError) -> Any:
    """Check a TOML value against an annotation (the table above); return it converted."""
    if typing.get_origin(annotation) is Literal:
        allowed = typing.get_args(annotation)
        if value not in allowed:
            raise error(f"{where}: {value!r} is not one of {list(allowed)}")
        return value
    if dataclasses.is_dataclass(annotation) and isinstance(annotation, type):
        return from_table(annotation, value, where, error=error)
    if annotation in _NAMES:
        if annotation is bool:
            ok = isinstance(value, bool)
        else:  # TOML's true is not a number, an integer or a string here
            ok = isinstance(value, (int, float) if annotation is float else annotation) and not isinstance(value, bool)
        if not ok:
            raise error(f"{where}: expected {_NAMES[annotation][0]}, got {type(value).__name__}")
        return float(value) if annotation is float else value
    if typing.get_origin(annotation) is tuple:
        args = typing.get_args(annotation)
        if len(args) == 2 and args[1] is Ellipsis:
            item = args[0]
            pair = typing.get_args(item) if typing.get_origin(item) is tuple else ()
            if len(pair) == 2 and pair[0] is str and pair[1] in _NAMES:
                # a table of name -> value, kept in file order
                if not isinstance(value, dict):
                    name = _NAMES[pair[1]][0].split(" ", 1)[1]
                    raise error(f"{where}: expected a table of name = {name}")
                return tuple((str(k), convert(f"{where}.{k}", v, pair[1], error=error)) for k, v in value.items())
            if item in _NAMES:
                if not isinstance(value, list):
                    raise error(f"{where}: expected a list of {_NAMES[item][1]}")
                try:
                    return tuple(convert(where, v, item, error=error) for v in value)
                except error:
                    raise error(f"{where}: expected a list of {_NAMES[item][1]}") from None
    raise error(f"{where}: unsupported type {annotation!r}")


def from_table(cls: type, table: Any, where: str, *, error: type[ValueError] = TomlTableError) -> Any:
    """The dataclass `cls` from a TOML table found at dotted path `where`."""
    if not isinstance(table, dict):
        raise error(f"[{where}] must be a table")
    fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    hints = _hints(cls)
    kwargs: dict[str, Any] = {}
    try:
        for key, value in table.items():
            f = fields.get(key)
            if f is None:
                raise error(f"unknown key {key_path(where, key)}")
            at = key_path(where, key)
            parse = f.metadata.get(_PARSE)
            kwargs[key] = parse(at, value) if parse else convert(at, value, hints[key], error=error)
            check = f.metadata.get(_CHECK)
            if check:
                check(at, kwargs[key])
        for name, f in fields.items():
            no_default = f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING
            if name not in kwargs and no_default and _REQUIRED in f.metadata:
                raise error(f"{key_path(where, name)}: {f.metadata[_REQUIRED]}")
        try:
            return cls(**kwargs)
        except TypeError as e:
            raise error(f"[{where}]: {e}") from None
    except error:
        raise
    except ValueError as e:  # a hook's or __post_init__'s message, raised as the caller's class
        raise error(str(e)) from None


def load_document(
    text: str,
    *,
    allowed: Collection[str],
    unknown: Callable[[str], str],
    error: type[ValueError] = TomlTableError,
) -> dict[str, Any]:
    """Parse a whole TOML document and refuse a top-level key not in `allowed`, with the
    message `unknown(key)` (each file format words it its own way)."""
    try:
        data = tomllib.loads(text)
    except tomllib.TOMLDecodeError as e:
        raise error(f"not valid TOML: {e}") from None
    for key in data:
        if key not in allowed:
            raise error(unknown(key))
    return data


__all__ = ["TomlTableError", "convert", "from_table", "key_path", "load_document", "toml_field"]
