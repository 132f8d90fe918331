"""What a cell's training asks of a worker's memory: one rule for the coordinator and the worker.

A cell's memory is sized by the coordinator's shell (`coordinator/sizing.py`, from the
models' closed form) in two parts:
- on the training device: what it needs with a micro-batch of one sample, plus what each
  further sample adds;
- on the host: the committed states, the exchange's and the reducers' working copies,
  whatever the micro-batch.

A worker declares its memory as a `MemoryBudget`: the device's (a CUDA card's, or on a CPU
the RAM it may use), and the host's RAM beside a card. The coordinator's scheduler gives a
worker only cells that `fits` its budget, and plans each member at the `micro_batch_cap`
of its own budget; the worker measures its speed at that same micro-batch, so it neither
runs out of memory while it measures nor reports the speed of a batch shape it will never
be given.
"""

from __future__ import annotations

from typing import NamedTuple


class MemoryBudget(NamedTuple):
    """A worker's memory, as the fit rule reads it.

    device_bytes: the training device's memory (a CPU worker: its usable RAM);
    host_bytes: the host's RAM beside a separate device; 0: not declared (a worker of an
    earlier version), and then not checked;
    shared: the device is the host (a CPU worker), so a cell's device and host needs add up
    in `device_bytes`.

    A tuple, so the scheduler's memos keyed by it hash and compare in C: a population has
    few distinct budgets."""

    device_bytes: int
    host_bytes: int = 0
    shared: bool = False

    @classmethod
    def of(cls, device_kind: str, vram_bytes: int, host_memory_bytes: int) -> MemoryBudget:
        """The budget a worker's profile declares: a "cpu" device shares the host's memory."""
        if device_kind == "cpu":
            return cls(vram_bytes, 0, True)
        return cls(vram_bytes, host_memory_bytes, False)


def fits(budget: MemoryBudget, memory_bytes: int, host_bytes: int, headroom: float) -> bool:
    """A cell fits a worker when, with a micro-batch of one, its device memory needs at most
    (1 - headroom) of the device's, and its host memory at most (1 - headroom) of the
    host's (where declared); on a CPU worker both together at most (1 - headroom) of its RAM."""
    room = 1.0 - headroom
    if budget.shared:
        return memory_bytes + host_bytes <= budget.device_bytes * room
    if memory_bytes > budget.device_bytes * room:
        return False
    return budget.host_bytes <= 0 or host_bytes <= budget.host_bytes * room


def micro_batch_cap(
    budget: MemoryBudget,
    memory_bytes: int,
    sample_bytes: int,
    host_bytes: int,
    headroom: float,
    max_micro_batch: int,
) -> int:
    """The largest micro-batch a worker's memory holds in a cell it fits: `memory_bytes`
    holds one sample's activations, each further sample adds `sample_bytes` on the device,
    and the whole stays within (1 - headroom) of the device's memory, as `fits` asks (on a
    CPU worker, with the host's share beside it); at most `max_micro_batch`, at least 1.
    With `sample_bytes` 0 (the cell's memory was sized at `max_micro_batch`) it is
    `max_micro_batch`. The per-step batch is unchanged: the rest is accumulated."""
    if sample_bytes <= 0:
        return max_micro_batch
    room = budget.device_bytes * (1.0 - headroom) - memory_bytes - (host_bytes if budget.shared else 0)
    return max(1, min(max_micro_batch, 1 + int(room // sample_bytes)))


__all__ = ["MemoryBudget", "fits", "micro_batch_cap"]
