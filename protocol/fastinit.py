"""Faster construction of frozen, slotted dataclasses.

`@dataclass(frozen=True, slots=True)` generates an `__init__` that stores every field with
`object.__setattr__(self, name, value)`: the class's own `__setattr__` refuses (that is what
frozen means), so each store goes through a generic attribute lookup by name. The messages
and records that the coordinator core, the worker's reconciler and the simulator pass
around are built by the million in a simulated day (an instruction, a heartbeat and a view
per event), and those lookups were about a tenth of `bagel-sim`'s time.

`fast_init(cls)` replaces that generated `__init__` with one that stores each field through
its slot's own descriptor (`cls.__dict__[name].__set__`), looked up once when the class is
decorated. Nothing else changes: the same parameters in the same order, the same defaults
and default factories, the same stored values; the instance is still frozen (assigning a
field still raises), and equality, hashing, ordering and repr are the dataclass's own. It
refuses a class it cannot rebuild faithfully (not a frozen slotted dataclass, or one with
`__post_init__`, init-only, keyword-only or `init=False` fields) when the class is defined,
so a later change to such a class fails at import, not silently.

    @fast_init
    @dataclass(frozen=True, slots=True)
    class LocalState: ...
"""

from __future__ import annotations

import dataclasses
import inspect
from typing import Any, TypeVar, cast

T = TypeVar("T")

_MISSING = object()  # the default of a field with a default factory: "not given"


def fast_init(cls: type[T]) -> type[T]:
    """Give the frozen, slotted dataclass `cls` a faster `__init__` with the same behaviour."""
    params = getattr(cls, "__dataclass_params__", None)
    if params is None or not params.frozen or "__slots__" not in cls.__dict__:
        raise TypeError(f"fast_init: {cls.__name__} is not a frozen, slotted dataclass")
    if hasattr(cls, "__post_init__"):
        raise TypeError(f"fast_init: {cls.__name__} has __post_init__")
    ns: dict[str, Any] = {"_MISSING": _MISSING}
    args: list[str] = []
    body: list[str] = []
    for f in dataclasses.fields(cast(Any, cls)):
        if not f.init or f.kw_only:
            raise TypeError(f"fast_init: {cls.__name__}.{f.name} is init=False or keyword-only")
        name = f.name
        ns[f"_set_{name}"] = cls.__dict__[name].__set__  # the slot's member descriptor
        if f.default is not dataclasses.MISSING:
            ns[f"_default_{name}"] = f.default
            args.append(f"{name}=_default_{name}")
        elif f.default_factory is not dataclasses.MISSING:
            ns[f"_factory_{name}"] = f.default_factory
            args.append(f"{name}=_MISSING")
            body.append(f"    if {name} is _MISSING:\n        {name} = _factory_{name}()\n")
        else:
            args.append(name)
        body.append(f"    _set_{name}(self, {name})\n")
    # the dataclass's own __init__ must take exactly these parameters (an InitVar would be one
    # more), each positional or keyword
    own = list(inspect.signature(cls.__init__).parameters.values())[1:]
    if [p.name for p in own] != [a.split("=")[0] for a in args] or any(
        p.kind is not inspect.Parameter.POSITIONAL_OR_KEYWORD for p in own
    ):
        raise TypeError(f"fast_init: {cls.__name__}.__init__ takes other parameters than its fields")
    src = f"def __init__(self, {', '.join(args)}):\n" + ("".join(body) or "    pass\n")
    exec(src, ns)  # noqa: S102 (source built above from the class's own field names)
    init = ns["__init__"]
    init.__qualname__ = f"{cls.__qualname__}.__init__"
    init.__module__ = cls.__module__
    init.__doc__ = cls.__init__.__doc__
    type.__setattr__(cls, "__init__", init)
    return cls


__all__ = ["fast_init"]
