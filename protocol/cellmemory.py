"""What a cell's training asks of a worker's memory: one rule for the coordinator and the worker.

A cell's memory is sized by the coordinator's shell (`coordinator/sizing.py`, from the
models' closed form) as what it needs with a micro-batch of one sample, plus what each
further sample adds. The coordinator's scheduler gives a worker only cells that `fits` its
memory, and plans each member at the `micro_batch_cap` of its own memory; the worker
measures its speed at that same micro-batch, so it neither runs out of memory while it
measures nor reports the speed of a batch shape it will never be given.
"""

from __future__ import annotations


def fits(vram_bytes: int, memory_bytes: int, headroom: float) -> bool:
    """A cell fits a worker when its memory needs at most (1 - headroom) of the VRAM."""
    return memory_bytes <= vram_bytes * (1.0 - headroom)


def micro_batch_cap(
    vram_bytes: int, memory_bytes: int, sample_bytes: int, headroom: float, max_micro_batch: int
) -> int:
    """The largest micro-batch a worker's memory holds in a cell it fits: `memory_bytes`
    holds one sample's activations, each further sample adds `sample_bytes`, and the whole
    stays within (1 - headroom) of the VRAM, as `fits` asks; at most `max_micro_batch`, at
    least 1. With `sample_bytes` 0 (the cell's memory was sized at `max_micro_batch`)
    it is `max_micro_batch`. The per-step batch is unchanged: the rest is accumulated."""
    if sample_bytes <= 0:
        return max_micro_batch
    room = vram_bytes * (1.0 - headroom) - memory_bytes
    return max(1, min(max_micro_batch, 1 + int(room // sample_bytes)))


__all__ = ["fits", "micro_batch_cap"]
