"""The import layering of the tree, and the purity of its pure cores, read with `ast`.

Every module under the six package folders is read (imports inside functions and under
`if TYPE_CHECKING:` count too: the rule is about what a module may know, not about what
it happens to execute). A module's folder gives its layer and the layer the `bagel.*`
modules it may import; a pure core may also import nothing that reads a clock, touches a
file, socket or process, schedules, logs, or draws from a module-global random state.
docs/ARCHITECTURE.md states the same rules in prose.
"""

from __future__ import annotations

import ast
import fnmatch
import re
import textwrap
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("coordinator", "worker", "protocol", "compression", "models", "robust", "sim")

ANY = ("bagel",)


@dataclass(frozen=True)
class Layer:
    name: str
    may_import: tuple[str, ...]  # bagel module prefixes (whole dotted components)
    never: tuple[str, ...] = ()  # exceptions to may_import


# First match wins: the most specific path first. Paths are relative to the repo root.
LAYERS: tuple[tuple[str, Layer], ...] = (
    ("protocol/", Layer("protocol", ("bagel.protocol",))),
    ("compression/", Layer("compression", ("bagel.protocol", "bagel.compression"))),
    ("models/", Layer("models", ("bagel.protocol", "bagel.compression", "bagel.models"))),
    ("robust/", Layer("robust", ("bagel.protocol", "bagel.compression", "bagel.robust"))),
    ("coordinator/core/", Layer("coordinator core", ("bagel.protocol", "bagel.coordinator.core"))),
    (
        "coordinator/",
        Layer(
            "coordinator shell",
            ("bagel.coordinator", "bagel.protocol", "bagel.compression", "bagel.models", "bagel.robust"),
        ),
    ),
    ("worker/reconciler.py", Layer("worker reconciler", ("bagel.protocol.messages", "bagel.protocol.fastinit"))),
    (
        "worker/",
        Layer("worker", ("bagel.worker", "bagel.protocol", "bagel.compression", "bagel.models", "bagel.robust")),
    ),
    (
        "sim/discrete/",
        Layer(
            "discrete simulator",
            (
                "bagel.sim.discrete",
                "bagel.sim.faults",
                "bagel.coordinator.core",
                "bagel.worker.reconciler",
                "bagel.protocol",
                "bagel.compression",
            ),
        ),
    ),
    ("sim/chaos/", Layer("chaos harness", ANY, never=("bagel.sim.discrete",))),
    ("sim/netlab/", Layer("network test bed", ("bagel.sim.netlab",))),
    ("sim/", Layer("sim", ANY)),
)

# The pure cores; the Makefile's PURE_CORES (checked with mypy --strict) must be this list.
PURE_CORES = (
    "coordinator/core/*.py",
    "worker/reconciler.py",
    "sim/discrete/engine.py",
    "models/flow.py",
    "compression/base.py",
    "compression/blockwise.py",
    "compression/floats.py",
    "compression/topk.py",
    "compression/wire.py",
    "compression/feedback.py",
    "compression/choice.py",
)

# Top-level modules a pure core may not import: clocks, files, sockets, processes, threads,
# event loops, logging, dynamic imports, and the I/O-bound libraries we use.
IMPURE = frozenset(
    {
        "time", "datetime", "socket", "ssl", "select", "selectors", "asyncio", "uvloop", "logging",
        "threading", "_thread", "concurrent", "multiprocessing", "subprocess", "signal", "os", "pathlib",
        "io", "shutil", "tempfile", "glob", "sqlite3", "urllib", "http", "importlib", "grpc", "hivemind",
        "prometheus_client", "rich",
    }
)  # fmt: skip
IMPURE_CALLS = frozenset({"open", "print", "input", "breakpoint", "__import__"})
# `random.Random(seed)` is an explicit generator; anything else of the module is its global state.
RANDOM_OK = frozenset({"Random"})
NUMPY_RANDOM_OK = frozenset(
    {"default_rng", "Generator", "SeedSequence", "BitGenerator", "PCG64", "PCG64DXSM", "Philox", "SFC64", "MT19937"}
)

# Deliberate, reviewed exceptions: (path, imported top-level module) -> why it is harmless.
# Each must still be needed (test_exceptions_are_still_needed).
ALLOWED_IMPURE = {
    ("compression/wire.py", "threading"): (
        "crc32() sums a large buffer's halves on two threads (zlib releases the GIL) and joins "
        "before returning: the result is zlib.crc32's, and no thread outlives the call"
    ),
}


@dataclass(frozen=True, order=True)
class Violation:
    path: str
    line: int
    message: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.message}"


def module_name(rel: str) -> str:
    """`coordinator/core/state.py` -> `bagel.coordinator.core.state` (a package's __init__ is the package)."""
    parts = rel.removesuffix(".py").split("/")
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(["bagel", *parts])


def within(module: str, prefix: str) -> bool:
    return module == prefix or module.startswith(prefix + ".")


def layer_of(rel: str) -> Layer:
    for prefix, layer in LAYERS:
        if rel == prefix or (prefix.endswith("/") and rel.startswith(prefix)):
            return layer
    raise AssertionError(f"{rel}: in no layer of LAYERS")


def allows(layer: Layer, module: str) -> bool:
    return any(within(module, p) for p in layer.may_import) and not any(within(module, p) for p in layer.never)


def is_pure(rel: str) -> bool:
    return any(fnmatch.fnmatchcase(rel, pat) for pat in PURE_CORES)


def python_files(root: Path) -> list[str]:
    return sorted(
        p.relative_to(root).as_posix()
        for pkg in PACKAGES
        if (root / pkg).is_dir()
        for p in (root / pkg).rglob("*.py")
        if "__pycache__" not in p.parts
    )


@dataclass(frozen=True)
class Import:
    line: int
    module: str  # absolute, dotted


def imports_of(tree: ast.Module, rel: str, known: frozenset[str]) -> Iterator[Import]:
    """Every import in the module, anywhere in it, as absolute module names. `from P import n`
    names the module P.n when that is one of ours, else P."""
    me = module_name(rel)
    package = me if rel.endswith("__init__.py") else me.rpartition(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for alias in node.names:
                yield Import(node.lineno, alias.name)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - (node.level - 1)]
                source = ".".join(base + ([node.module] if node.module else []))
            else:
                source = node.module or ""
            for alias in node.names:
                sub = f"{source}.{alias.name}"
                yield Import(node.lineno, sub if sub in known else source)


def random_state_uses(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """Uses of module-global random state: `random.<f>` / `from random import <f>` for any f
    but Random, and `np.random.<f>` / `from numpy.random import <f>` but for the explicit
    generators. Aliases are followed (`import numpy as np`, `import random as rnd`)."""
    random_names, numpy_names = set(), set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            for a in node.names:
                if a.name == "random":
                    random_names.add(a.asname or a.name)
                elif a.name in ("numpy", "numpy.random"):
                    numpy_names.add(a.asname or "numpy")
        elif isinstance(node, ast.ImportFrom) and not node.level:
            for a in node.names:
                if node.module == "random" and a.name not in RANDOM_OK:
                    yield node.lineno, f"from random import {a.name}"
                elif node.module == "numpy.random" and a.name not in NUMPY_RANDOM_OK:
                    yield node.lineno, f"from numpy.random import {a.name}"
    for node in ast.walk(tree):
        if not isinstance(node, ast.Attribute):
            continue
        v = node.value
        if isinstance(v, ast.Name) and v.id in random_names and node.attr not in RANDOM_OK:
            yield node.lineno, f"{v.id}.{node.attr}"
        elif (
            isinstance(v, ast.Attribute)
            and v.attr == "random"
            and isinstance(v.value, ast.Name)
            and v.value.id in numpy_names
            and node.attr not in NUMPY_RANDOM_OK
        ):
            yield node.lineno, f"{v.value.id}.random.{node.attr}"


def impure_calls(tree: ast.Module) -> Iterator[tuple[int, str]]:
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in IMPURE_CALLS:
            yield node.lineno, f"{node.func.id}()"


def package_rules(files: Iterable[str]) -> dict[str, tuple[list[Layer], bool]]:
    """An `__init__.py` runs whenever any module beneath it is imported, so it follows the
    rules of every layer beneath it (an import must be allowed by all of them), and is pure
    when any module beneath it is."""
    files = list(files)
    out: dict[str, tuple[list[Layer], bool]] = {}
    for rel in files:
        if not rel.endswith("__init__.py"):
            continue
        folder = rel.removesuffix("__init__.py")
        below = [f for f in files if f.startswith(folder)]
        out[rel] = ([layer_of(f) for f in below], any(is_pure(f) for f in below))
    return out


def check(root: Path) -> list[Violation]:
    files = python_files(root)
    known = frozenset(module_name(f) for f in files)
    inits = package_rules(files)
    found: list[Violation] = []
    for rel in files:
        tree = ast.parse((root / rel).read_text(encoding="utf-8"), filename=rel)
        layers, pure = inits.get(rel, ([layer_of(rel)], is_pure(rel)))
        for imp in imports_of(tree, rel, known):
            if within(imp.module, "bagel"):
                refused = [layer.name for layer in layers if not allows(layer, imp.module)]
                if refused:
                    found.append(
                        Violation(rel, imp.line, f"{' / '.join(sorted(set(refused)))} may not import {imp.module}")
                    )
            elif pure:
                top = imp.module.partition(".")[0]
                if top in IMPURE and (rel, top) not in ALLOWED_IMPURE:
                    found.append(Violation(rel, imp.line, f"pure core imports {imp.module}"))
        if pure:
            for line, what in random_state_uses(tree):
                found.append(Violation(rel, line, f"pure core uses module-global random state: {what}"))
            for line, what in impure_calls(tree):
                found.append(Violation(rel, line, f"pure core calls {what}"))
    return sorted(set(found))


# ---------------------------------------------------------------------------- the tree


def test_tree_keeps_its_layers_and_its_cores_pure() -> None:
    found = check(ROOT)
    assert not found, "layering or purity broken:\n" + "\n".join(map(str, found))


def test_every_module_has_a_layer() -> None:
    for rel in python_files(ROOT):
        layer_of(rel)


def test_exceptions_are_still_needed() -> None:
    for (rel, top), why in ALLOWED_IMPURE.items():
        assert is_pure(rel), f"{rel} is no pure core: drop its exception ({why})"
        tree = ast.parse((ROOT / rel).read_text(encoding="utf-8"))
        tops = {i.module.partition(".")[0] for i in imports_of(tree, rel, frozenset())}
        assert top in tops, f"{rel} no longer imports {top}: drop its exception"


def makefile_pure_cores() -> list[str]:
    text = (ROOT / "Makefile").read_text(encoding="utf-8").replace("\\\n", " ")
    m = re.search(r"^PURE_CORES\s*:?=(.*)$", text, re.MULTILINE)
    assert m, "Makefile has no PURE_CORES"
    return m.group(1).split()


def test_makefile_checks_the_same_pure_cores() -> None:
    assert sorted(makefile_pure_cores()) == sorted(PURE_CORES)


# ---------------------------------------------------------------------------- the checker can fail


def write(root: Path, rel: str, text: str = "") -> None:
    path = root / rel
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(textwrap.dedent(text), encoding="utf-8")


@pytest.fixture
def fake_tree(tmp_path: Path) -> Path:
    for pkg in ("protocol", "coordinator", "coordinator/core", "compression", "worker", "sim", "sim/discrete"):
        write(tmp_path, f"{pkg}/__init__.py")
    write(tmp_path, "protocol/messages.py", "import json\n")
    write(tmp_path, "coordinator/server.py", "import asyncio\nfrom bagel.coordinator.core import state\n")
    write(tmp_path, "compression/base.py", "import math\n")
    write(tmp_path, "compression/topk.py", "from .base import math\nfrom . import base\n")
    return tmp_path


def test_checker_passes_a_clean_tree(fake_tree: Path) -> None:
    write(fake_tree, "coordinator/core/state.py", "import random\nrng = random.Random(1)\n")
    assert check(fake_tree) == []


def test_checker_reports_an_upward_import_and_an_impure_core(fake_tree: Path) -> None:
    write(fake_tree, "protocol/bad.py", "from bagel.coordinator import server\n")
    write(
        fake_tree,
        "coordinator/core/state.py",
        """\
        from typing import TYPE_CHECKING

        if TYPE_CHECKING:
            import socket

        def now():
            import time
            return time.monotonic()
        """,
    )
    got = {(v.path, v.line): v.message for v in check(fake_tree)}
    assert got == {
        ("protocol/bad.py", 1): "protocol may not import bagel.coordinator.server",
        ("coordinator/core/state.py", 4): "pure core imports socket",
        ("coordinator/core/state.py", 7): "pure core imports time",
    }


def test_checker_reports_global_random_open_and_relative_escapes(fake_tree: Path) -> None:
    write(
        fake_tree,
        "coordinator/core/rounds.py",
        """\
        import random
        import numpy as np
        from random import shuffle
        from .. import server

        x = random.random()
        g = np.random.default_rng(0)
        y = np.random.rand(3)
        text = open("spec.toml").read()
        """,
    )
    write(
        fake_tree, "worker/reconciler.py", "from bagel.protocol import messages\nfrom bagel.compression import base\n"
    )
    write(fake_tree, "sim/discrete/engine.py", "from bagel.coordinator import server\n")
    got = {(v.path, v.line): v.message for v in check(fake_tree)}
    assert got == {
        ("coordinator/core/rounds.py", 3): "pure core uses module-global random state: from random import shuffle",
        ("coordinator/core/rounds.py", 4): "coordinator core may not import bagel.coordinator.server",
        ("coordinator/core/rounds.py", 6): "pure core uses module-global random state: random.random",
        ("coordinator/core/rounds.py", 8): "pure core uses module-global random state: np.random.rand",
        ("coordinator/core/rounds.py", 9): "pure core calls open()",
        ("worker/reconciler.py", 2): "worker reconciler may not import bagel.compression.base",
        ("sim/discrete/engine.py", 1): "discrete simulator may not import bagel.coordinator.server",
    }


def test_a_package_init_follows_the_layers_beneath_it(fake_tree: Path) -> None:
    write(fake_tree, "coordinator/__init__.py", "from bagel.coordinator import server\nimport logging\n")
    got = {(v.path, v.line): v.message for v in check(fake_tree)}
    assert got == {
        ("coordinator/__init__.py", 1): "coordinator core may not import bagel.coordinator.server",
        ("coordinator/__init__.py", 2): "pure core imports logging",
    }
