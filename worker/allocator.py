"""How many malloc arenas a worker's process may use (glibc only).

glibc gives a thread that finds the arena it would use locked an arena of its own, up to
eight per core, and memory freed into an arena serves only later allocations from that
arena: it is not returned to the system while other chunks of the same heap are live. A
worker allocates in phases on different threads: training on one (activations, the
pseudo-gradient), the exchange on others (decoded parts, the reduction's blocks, the new
state), state sync on yet others. Each arena then keeps the high-water mark of its own
phase, and the process's resident memory is about their sum rather than the largest
phase. Two arenas let each phase reuse what the others freed.

Measured with `bench/worker_memory.py --workers 2 --image-size 16 --rounds 4` (two CPU
workers on one DiT-S/2 cell): without the limit the workers' peaks were 26.4 to 31.6
float32 copies of the parameters in two runs, with it 24.0 to 27.6 in two runs (and 23.4
and 26.7 in a third, with `MALLOC_ARENA_MAX=2` set instead); neither a training step nor an
exchange (`bench/exchange_memory.py`) was slower. (A fixed 128 KiB mmap threshold,
`MALLOC_MMAP_THRESHOLD_`, cut the peak further, to about 20 copies, but made a CPU worker's
training step 27% slower: every activation became a fresh mapping.)

An operator's own `MALLOC_ARENA_MAX` wins: glibc reads it at start, and this leaves it.
"""

from __future__ import annotations

import ctypes
import os

M_ARENA_MAX = -8  # mallopt's parameter number in glibc's malloc.h
WORKER_ARENAS = 2


def limit_arenas(arenas: int = WORKER_ARENAS) -> bool:
    """Ask glibc to create at most `arenas` arenas from now on; True if it took the limit.

    False, and nothing changed, where `MALLOC_ARENA_MAX` is set or the C library has no
    `mallopt` that accepts it (not glibc). Call it before the worker starts its threads:
    arenas made before stay."""
    if arenas < 1:
        raise ValueError(f"arenas must be at least 1, got {arenas}")
    if "MALLOC_ARENA_MAX" in os.environ:
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = (ctypes.c_int, ctypes.c_int)
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_ARENA_MAX, arenas))


__all__ = ["WORKER_ARENAS", "limit_arenas"]
