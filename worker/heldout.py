"""Loss measurements of a cell state: the commit guard's probe and the reducers' loss audit.

`HeldoutProbe` is the commit guard's measurement: the held-out loss of a cell state on the
cell's guard batch. `SliceLossAudit` is the loss audit a reducer runs on its part (below).

After the outer step a member reports, with its state hash, the held-out loss of the new
state and of the round's base state (`[guard]` in the run spec; the coordinator's
`coordinator/core/guard.py` judges them). So that every honest member reports the same
number for the same state, the measurement is fixed in every respect:

- the batch: the first `guard.eval_samples` samples of the cell's held-out split
  (`models/data.py` orders it deterministically);
- the noise and t draws: `CellTask.eval_loss` with a generator seeded by
  (run seed, cell id), no label dropout;
- the device: a CPU copy of the cell's model, whatever the worker trains on, so a GPU's
  kernels do not change the number.

A non-finite loss (a state that blew up) is reported as `MAX_LOSS`, the largest value
validation accepts: the guard then refuses it like any jump. Results are cached by state
hash (a round's new state is the next round's base), so a round costs one evaluation.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from bagel.models.data import derive_seed, shard
from bagel.protocol.validation import MAX_LOSS

_CACHE = 8  # states remembered (the committed one and a few candidates)


class HeldoutProbe:
    """Measures held-out losses of one cell's states; thread-safe (one CPU model, one lock)."""

    def __init__(self, spec: Any, cell_id: str) -> None:
        from bagel.models.experts import cell_task

        self.cell_id = cell_id
        self.task = cell_task(spec, cell_id)
        x, y = self.task.heldout_data()
        n = int(spec.guard.eval_samples)
        self.x, self.y = x[:n].clone(), y[:n].clone()
        self.seed = derive_seed("guard", spec.run.seed, cell_id)
        self.model = self.task.build_model()  # on the CPU
        self._lock = threading.Lock()
        self._cache: OrderedDict[str, float] = OrderedDict()

    def loss(self, state: Any, state_hash: str) -> float | None:
        """The held-out loss of `state` (a `diloco.CellState` whose hash is `state_hash`);
        None when the cell has no held-out sample to measure on."""
        if len(self.x) == 0:
            return None
        with self._lock:
            hit = self._cache.get(state_hash)
            if hit is not None:
                self._cache.move_to_end(state_hash)
                return hit
            state.load_into(self.model)
            v = float(self.task.eval_loss(self.model, self.x, self.y, seed=self.seed))
            v = min(max(v, 0.0), MAX_LOSS) if math.isfinite(v) else MAX_LOSS
            self._cache[state_hash] = v
            while len(self._cache) > _CACHE:
                self._cache.popitem(last=False)
            return v


class SliceLossAudit:
    """The loss audit of one part: does each sender's slice of its update lower the loss?

    Templar's Gauntlet scores a miner by the loss its update removes on the data it was
    assigned, against the loss it removes on random data (Templar, "Incentivizing
    permissionless distributed learning of LLMs", 2025): an update that was really trained on
    its assignment lowers the loss there at least as much. A reducer here sees one slice
    [start, start + numel) of every sender's pseudo-gradient Δ = θ_committed - θ_local, so it
    measures each slice alone: the state θ_committed with only that slice applied at the
    sender's share of the part's weighted mean (θ - (w / Σw) Δ on the slice, the rest
    untouched: the reducer scales the slices and divides the gains by the share,
    `Reduction._with_loss`), its loss on the sender's first `audit.loss_samples` assigned
    samples (the same `models.data.shard` the sender's trainer drew, from the round plan's
    member order and budgets) and on as many random training samples of the round,
    against the committed state's loss on the same samples. Noise and t draws are fixed by
    (run seed, cell, round), so the two sides of each difference see the same draws.

    Gains (committed loss minus patched loss) are reported in the part's audit
    (`SenderAudit.loss_gain`, `loss_gain_random`); the coordinator's `Auditor` flags a sender
    whose slice *raises* the loss on its own samples by more than `audit.loss_rel` times the
    median gain of the part's other senders ("loss"), and charges it once most other
    reducers agree. Measured in the 8-member cell of `sim/scenarios/chaos-robust-8.toml`:
    every honest slice lowers the loss, a sign-flipped, IPM or (later in the run) replayed
    slice raises it by about as much; an ALIE slice and a copy lower it like an honest one.
    Taken whole rather than at its share, the slice of a slow member (its step batch a third
    of a fast one's, the same number of AdamW steps) raised the loss in 20% of its parts over
    24 rounds of the demo's mixed speeds, and got it charged (`bench/loss_audit_mixed_speeds.py`);
    at its share, 2% and never charged, while sign-flipped and IPM slices still are.
    The assigned-versus-random comparison is reported too, but at this model size, with 40
    samples over 5 inner steps, it does not separate an honest update from a copied one
    (their differences are within +-0.001 of each other), so nothing is charged on it.

    CPU, one model, thread-safe (one lock); the cost is about 3 x senders evaluations of
    `loss_samples` samples per reduced part.
    """

    def __init__(self, spec: Any, cell_id: str) -> None:
        from bagel.models.experts import cell_task

        self.run_id, self.cell_id = spec.run.id, cell_id
        self.run_seed = spec.run.seed
        self.samples = int(spec.audit.loss_samples)
        self.task = cell_task(spec, cell_id)
        self.x, self.y = self.task.train_data()
        self.model = self.task.build_model()  # on the CPU
        self._lock = threading.Lock()

    @property
    def num_train(self) -> int:
        return int(self.x.shape[0])

    def assigned(self, round: int, member: int, members: int, max_samples: int) -> torch.Tensor:
        """The first `loss_samples` sample indices member `member` of `members` trained on in `round`."""
        idx = shard(self.run_id, self.cell_id, round, member, members, self.num_train, max(1, max_samples))
        return torch.as_tensor(idx[: self.samples], dtype=torch.long)

    def random_batch(self, round: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(derive_seed("loss-audit-batch", self.run_seed, self.cell_id, round))
        return torch.randperm(self.num_train, generator=g)[: self.samples]

    def gains(
        self,
        committed: Any,
        names: Sequence[str],
        start: int,
        slices: Mapping[str, torch.Tensor],
        assigned: Mapping[str, torch.Tensor],
        round: int,
    ) -> dict[str, tuple[float, float]]:
        """sender -> (gain on its assigned samples, gain on the round's random batch) of its
        slice starting at flat index `start` of the delta laid out as `names` (sorted, the
        data plane's `Layout`), applied to `committed` (a `diloco.CellState`). Senders
        without assigned samples are skipped."""
        seed = derive_seed("loss-audit-noise", self.run_seed, self.cell_id, round)
        rnd = self.random_batch(round)
        with self._lock:
            committed.load_into(self.model)
            params = dict(self.model.named_parameters())
            spans = self._spans(committed, names, start, max((s.numel() for s in slices.values()), default=0))

            def loss(idx: torch.Tensor) -> float:
                v = float(self.task.eval_loss(self.model, self.x[idx], self.y[idx], seed=seed))
                return min(max(v, -MAX_LOSS), MAX_LOSS) if math.isfinite(v) else MAX_LOSS

            base_r = loss(rnd)
            out: dict[str, tuple[float, float]] = {}
            for sender in sorted(slices):
                idx = assigned.get(sender)
                if idx is None or idx.numel() == 0:
                    continue
                flat = slices[sender].reshape(-1).to(torch.float32)
                base_a = loss(idx)
                with torch.no_grad():
                    for name, a, b, o in spans:
                        params[name].view(-1)[a:b] -= flat[o : o + b - a].to(params[name].dtype)
                try:
                    out[sender] = (base_a - loss(idx), base_r - loss(rnd))
                finally:
                    with torch.no_grad():
                        for name, a, b, _ in spans:
                            params[name].view(-1)[a:b] = committed.weights[name].reshape(-1)[a:b]
            return out

    @staticmethod
    def _spans(committed: Any, names: Sequence[str], start: int, numel: int) -> list[tuple[str, int, int, int]]:
        """(tensor name, first, end, offset in the slice) of every tensor the slice [start, start + numel) covers."""
        spans, pos, end = [], 0, start + numel
        for name in names:
            n = int(committed.weights[name].numel())
            a, b = max(start, pos), min(end, pos + n)
            if a < b:
                spans.append((name, a - pos, b - pos, a - start))
            pos += n
        return spans


__all__ = ["HeldoutProbe", "SliceLossAudit"]
