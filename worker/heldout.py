"""The commit guard's measurement: the held-out loss of a cell state on the cell's guard batch.

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
from typing import Any

from bagel.models.data import derive_seed
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


__all__ = ["HeldoutProbe"]
