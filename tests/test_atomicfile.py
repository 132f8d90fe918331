"""Atomic writes: a file is either the old one or the new one, whatever happens during the write."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from bagel.protocol.atomicfile import atomic_write, atomic_write_with

pytestmark = pytest.mark.timeout(60)


def test_a_writer_that_fails_leaves_the_old_file_and_no_temp(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "f.bin"
    atomic_write(path, b"old")

    def half_then_fail(tmp: str) -> None:
        Path(tmp).write_bytes(b"half of the new")
        raise OSError("disk full")

    with pytest.raises(OSError, match="disk full"):
        atomic_write_with(path, half_then_fail)
    assert path.read_bytes() == b"old"
    assert sorted(p.name for p in path.parent.iterdir()) == ["f.bin"]
    atomic_write_with(path, lambda tmp: save_file({"x": torch.arange(4.0)}, tmp, metadata={"k": "v"}))
    assert load_file(path)["x"].tolist() == [0.0, 1.0, 2.0, 3.0]


# numpy's safetensors writer, not torch's: the child's start (three of them) then takes a
# fraction of a second instead of torch's import, and the file is the same format
_CHILD = """
import sys
import numpy as np
from pathlib import Path
from safetensors.numpy import save_file
from bagel.protocol.atomicfile import atomic_write_with
path = Path(sys.argv[1])
states = [{"x": np.full((1 << 20,), float(v), dtype=np.float32)} for v in (1, 2)]
i = 0
print("ready", flush=True)
while True:
    t = states[i % 2]
    atomic_write_with(path, lambda tmp: save_file(t, tmp))
    i += 1
"""


def test_a_process_killed_while_writing_leaves_a_whole_file(tmp_path: Path) -> None:
    """SIGKILL a process that rewrites a 4 MB safetensors file in a loop through
    `atomic_write_with`, at three instants: the file is always one whole version."""
    path = tmp_path / "state.safetensors"
    seen = set()
    for delay in (0.07, 0.23, 0.41):
        child = subprocess.Popen([sys.executable, "-c", _CHILD, str(path)], stdout=subprocess.PIPE, text=True)
        try:
            assert child.stdout is not None and child.stdout.readline().strip() == "ready"
            time.sleep(delay)
            os.kill(child.pid, signal.SIGKILL)
        finally:
            child.wait(timeout=30)
        if not path.exists():  # killed before the first write finished
            continue
        x = load_file(path)["x"]
        assert x.numel() == 1 << 20 and bool((x == x[0]).all()) and float(x[0]) in (1.0, 2.0)
        seen.add(float(x[0]))
    assert seen, "no write finished before any kill: the test checked nothing"
