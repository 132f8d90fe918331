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

# The closed form's counts (`bagel.models.experts.cell_memory_bytes` and `cell_host_bytes`;
# torch-free here, so the simulator sizes its cells by the same figures):
# float32 copies of the parameters on the training device: the weights, their gradients
# and AdamW's two moments (on a CPU worker the device is the host).
DEVICE_COPIES = 4
# What a worker holds on the host besides, counted from the worker's code and measured
# (`bench/worker_memory.py`, `bench/exchange_memory.py`; README, "What a worker really holds"):
# - committed states, each its weights and outer momentum (and average with `[ema]`) in the
#   run's `[sync] state_dtype`: the committed one, the new one the outer step builds until
#   the round's verdict, and the previous one, kept for joiners one round behind for
#   `worker.statesync.SUPERSEDED_S` after a commit;
HOST_STATES = 3
# - float32 working copies: the reducers' loss-audit model (1); the pseudo-gradient, the
#   error-feedback residual and the averaged update (3); the reduction of a part, its
#   decoded inputs with a block at a time in float64 (`bench/exchange_memory.py`: 5 in a
#   group of two, 4 in a group of three; a larger group's parts are smaller but more).
HOST_WORK_COPIES = 9


def host_bytes_per_param(state_dtype_nbytes: int, ema: bool) -> int:
    """Host bytes per parameter of a cell: HOST_STATES states of 2 tensors (3 with `[ema]`)
    of `state_dtype_nbytes` each, and HOST_WORK_COPIES float32 copies."""
    return HOST_STATES * (3 if ema else 2) * state_dtype_nbytes + HOST_WORK_COPIES * 4


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


__all__ = [
    "DEVICE_COPIES",
    "HOST_STATES",
    "HOST_WORK_COPIES",
    "MemoryBudget",
    "fits",
    "host_bytes_per_param",
    "micro_batch_cap",
]
