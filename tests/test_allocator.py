"""The worker's malloc arena limit (`bagel.worker.allocator`), in fresh processes: glibc's
own statistics count the arenas that threads allocating at once end up with."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from bagel.worker.allocator import limit_arenas


def _glibc() -> bool:
    try:
        return bool(os.confstr("CS_GNU_LIBC_VERSION"))
    except (ValueError, OSError, AttributeError):
        return False


pytestmark = [
    pytest.mark.timeout(60),
    pytest.mark.skipif(not _glibc(), reason="malloc arenas and malloc_stats() are glibc's"),
]

# eight threads allocate at once and hold what they took until all have; then glibc's
# malloc_stats() prints one "Arena N:" block per arena to stderr
SCRIPT = """
import ctypes, sys, threading
from bagel.worker.allocator import limit_arenas
print(limit_arenas() if sys.argv[1] == "limit" else None, flush=True)
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = (ctypes.c_void_p,)
barrier = threading.Barrier(8)
def work():
    held = [libc.malloc(4096) for _ in range(64)]
    barrier.wait()
    for p in held:
        libc.free(p)
threads = [threading.Thread(target=work) for _ in range(8)]
for t in threads:
    t.start()
for t in threads:
    t.join()
libc.malloc_stats()
"""


def arenas(mode: str, **env: str) -> tuple[str, int]:
    out = subprocess.run(
        [sys.executable, "-c", SCRIPT, mode],
        capture_output=True,
        text=True,
        timeout=30,
        env={k: v for k, v in os.environ.items() if k != "MALLOC_ARENA_MAX"} | env,
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip(), sum(1 for line in out.stderr.splitlines() if line.startswith("Arena "))


def test_two_arenas_where_threads_would_otherwise_take_one_each():
    took, limited = arenas("limit")
    assert took == "True" and 1 <= limited <= 2
    _, free = arenas("none")
    assert free > 2  # without the limit the eight threads spread over more arenas


def test_an_operators_malloc_arena_max_stands():
    took, n = arenas("limit", MALLOC_ARENA_MAX="4")
    assert took == "False" and n <= 4
    with pytest.raises(ValueError):
        limit_arenas(0)
