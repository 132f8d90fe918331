"""The shared typed-TOML builder: types, defaults, nesting, hooks; errors name the key."""

from __future__ import annotations

import ast
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import pytest

from bagel.protocol.typedtoml import TomlTableError, from_table, toml_field


class MyError(TomlTableError):
    pass


@dataclass(frozen=True)
class Inner:
    rate: float = 1.0
    mode: Literal["a", "b"] = "a"


def _even(where: str, v: int) -> None:
    if v % 2:
        raise ValueError(f"{where}: must be even")


def _upper(where: str, v: object) -> str:
    if not isinstance(v, str):
        raise MyError(f"{where}: a word")
    return v.upper()


@dataclass(frozen=True)
class Outer:
    name: str = toml_field(required="give it a name")
    count: int = toml_field(2, check=_even)
    word: str = toml_field("", parse=_upper)
    flag: bool = False
    tags: tuple[str, ...] = ()
    sizes: tuple[int, ...] = ()
    mix: tuple[tuple[str, float], ...] = ()
    inner: Inner = field(default_factory=Inner)

    def __post_init__(self) -> None:
        if self.flag and not self.tags:
            raise ValueError("outer.flag: needs tags")


def parse(text: str) -> Outer:
    return from_table(Outer, tomllib.loads(text), "outer", error=MyError)


def test_builds_with_types_defaults_and_nesting() -> None:
    o = parse(
        'name = "n"\ncount = 4\nword = "hi"\ntags = ["x", "y"]\nsizes = [1, 2]\n'
        'mix = { b = 1, a = 0.5 }\n[inner]\nrate = 3\nmode = "b"\n'
    )
    assert o == Outer("n", 4, "HI", False, ("x", "y"), (1, 2), (("b", 1.0), ("a", 0.5)), Inner(3.0, "b"))
    assert isinstance(o.inner.rate, float) and isinstance(o.mix[0][1], float)
    assert parse('name = "n"') == Outer("n")


@pytest.mark.parametrize(
    "text, message",
    [
        ('name = "n"\nbogus = 1', "unknown key outer.bogus"),
        ('name = "n"\n[inner]\nbogus = 1', "unknown key outer.inner.bogus"),
        ('name = "n"\ninner = 1', "[outer.inner] must be a table"),
        ('name = "n"\ncount = 1.0', "outer.count: expected an integer, got float"),
        ('name = "n"\ncount = true', "outer.count: expected an integer, got bool"),
        ('name = "n"\nflag = 1', "outer.flag: expected true or false, got int"),
        ("name = 3", "outer.name: expected a string, got int"),
        ('name = "n"\n[inner]\nrate = "x"', "outer.inner.rate: expected a number, got str"),
        ('name = "n"\n[inner]\nrate = false', "outer.inner.rate: expected a number, got bool"),
        ('name = "n"\n[inner]\nmode = "c"', "outer.inner.mode: 'c' is not one of ['a', 'b']"),
        ('name = "n"\ntags = "x"', "outer.tags: expected a list of strings"),
        ('name = "n"\ntags = ["x", 1]', "outer.tags: expected a list of strings"),
        ('name = "n"\nsizes = [1, 2.5]', "outer.sizes: expected a list of integers"),
        ('name = "n"\nmix = [1]', "outer.mix: expected a table of name = number"),
        ('name = "n"\nmix = { a = "x" }', "outer.mix.a: expected a number, got str"),
        ("count = 2", "outer.name: give it a name"),
        ('name = "n"\ncount = 3', "outer.count: must be even"),
        ('name = "n"\nword = 1', "outer.word: a word"),
        ('name = "n"\nflag = true', "outer.flag: needs tags"),
    ],
)
def test_errors_name_the_key_and_use_the_callers_class(text: str, message: str) -> None:
    with pytest.raises(MyError) as info:
        parse(text)
    assert str(info.value) == message


def test_a_missing_field_without_a_message_is_the_dataclass_error() -> None:
    @dataclass(frozen=True)
    class Needs:
        id: str

    with pytest.raises(TomlTableError, match=r"^\[run\]: .*missing 1 required .*'id'"):
        from_table(Needs, {}, "run")
    with pytest.raises(TomlTableError, match=r"^\[run\] must be a table$"):
        from_table(Needs, [], "run")


def test_protocol_imports_no_other_bagel_package() -> None:
    """protocol/ is the bottom layer: every package may import it, it imports none of them."""
    root = Path(__file__).resolve().parent.parent / "protocol"
    for path in sorted(root.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            for name in names:
                if name.startswith("bagel"):
                    assert name.startswith("bagel.protocol"), f"{path.name} imports {name}"
