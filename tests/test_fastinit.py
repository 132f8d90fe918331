"""`fast_init` gives a frozen, slotted dataclass the same constructor, only faster."""

from __future__ import annotations

import dataclasses
from dataclasses import InitVar, dataclass, field

import pytest

from bagel.protocol.fastinit import fast_init
from bagel.protocol.messages import Instruction, LocalState, Order


def _pair() -> tuple[type, type]:
    def make() -> type:
        @dataclass(frozen=True, slots=True)
        class Msg:
            a: int
            b: str = "x"
            c: tuple[int, ...] = ()
            d: frozenset[int] = field(default_factory=frozenset)
            e: list[int] = field(default_factory=list)

        return Msg

    return make(), fast_init(make())


def test_same_construction_equality_hash_and_repr() -> None:
    plain, fast = _pair()
    for args, kw in (((1,), {}), ((1, "y"), {"e": [3]}), ((), {"a": 2, "d": frozenset({4})}), ((5, "z", (1, 2)), {})):
        p, f = plain(*args, **kw), fast(*args, **kw)
        assert dataclasses.astuple(p) == dataclasses.astuple(f)
        assert repr(p).replace("Msg", "") == repr(f).replace("Msg", "")
        assert f == fast(*args, **kw)
    # a default factory is called per instance, not shared
    f1, f2 = fast(1), fast(1)
    assert f1.e == [] and f1.e is not f2.e


def test_still_frozen_and_still_checks_its_arguments() -> None:
    _, fast = _pair()
    m = fast(1)
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.a = 2  # type: ignore[misc]
    with pytest.raises(TypeError):
        fast()  # a required field missing
    with pytest.raises(TypeError):
        fast(1, nope=3)  # an unknown field
    with pytest.raises(TypeError):
        fast(1, "x", (), frozenset(), [], 7)  # too many


def test_the_protocol_messages_build_as_before() -> None:
    i = Instruction(Order.TRAIN, "k0.r0", 3, committed_round=2, round_attempt=1)
    assert (i.order, i.cell_id, i.round, i.committed_round, i.round_attempt, i.contributors) == (
        Order.TRAIN,
        "k0.r0",
        3,
        2,
        1,
        (),
    )
    assert LocalState() == LocalState("", 0, "") and LocalState("c", 1, "h") != LocalState("c", 1, "g")
    assert hash(LocalState("c", 1, "h")) == hash(LocalState("c", 1, "h"))


def test_refuses_what_it_cannot_rebuild_faithfully() -> None:
    @dataclass(frozen=True)
    class NoSlots:
        a: int

    @dataclass(slots=True)
    class NotFrozen:
        a: int

    @dataclass(frozen=True, slots=True)
    class PostInit:
        a: int

        def __post_init__(self) -> None:
            pass

    @dataclass(frozen=True, slots=True)
    class KwOnly:
        a: int = field(kw_only=True)

    @dataclass(frozen=True, slots=True)
    class WithInitVar:
        a: int
        b: InitVar[int] = 0

    for cls in (NoSlots, NotFrozen, PostInit, KwOnly, WithInitVar):
        with pytest.raises(TypeError):
            fast_init(cls)
