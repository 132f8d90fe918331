"""The scheduler: which worker trains which cell, and how a round's batch is split.

Pure code (no I/O, no clock, no randomness), used unchanged by the daemon, through
`CoordinatorState`, and by the simulator. What it decides:

- **Fit.** A worker may train a cell only if the cell's memory fits its declared budget
  with `schedule.vram_headroom` to spare (`bagel.protocol.cellmemory.fits`): on the device
  the weights, gradients, optimizer and the smallest micro-batch, on the host the
  committed states and the exchange's working copies (computed by the shell; on a CPU
  worker both in its RAM); each member's micro-batch is then the largest its memory holds
  (`micro_batch_cap`), up to `diloco.max_micro_batch`.
- **Balance.** Each cell has a target share of total compute. A worker's compute in cell c
  is its throughput there divided by the cell's reference throughput (the mean over known
  workers), so a 4090 counts the same on a big expert and on the small router; it is
  weighted by reputation. Workers go where the (relative) shortfall is largest: the
  imbalance minimised is Phi = sum_c (s_c - T_c)^2 / T_c (shares s, targets T), a
  chi-square distance, so a small cell such as the router is balanced in relative terms.
- **Redundancy.** Before balance, every cell with a target keeps min_replicas members when
  there are enough workers (a convex penalty on each cell's deficit, so a move never
  orphans one cell to fill another); no cell takes more than max_replicas.
- **Stickiness.** Moving a worker that holds state costs a full download, so it moves
  only when that cuts the worse relative deviation of the two cells involved by more
  than `schedule.stickiness` (and lowers Phi). Workers that hold nothing yet move
  freely (fresh joiners, and everyone while the run is at round 0).
- **Bounded work.** `Balance` keeps per-cell sums, so placing a joiner is O(cells) and one
  repair step is O(candidates x cells); the state repairs with at most
  `Policy.max_moves_per_event` moves at a cell's round boundary (balance and redundancy)
  and on join/leave (redundancy; balance only while the joiner's cell is untrained, see
  `Roster.rebalance`), which keeps a transition cheap with 10,000 workers. `assign`
  runs the same steps over a whole population.

`plan_round` splits `diloco.group_batch` across a round's members in proportion to their
throughput, so H inner steps take about the same wall time on a fast card and a slow one
(SWARM parallelism, Ryabinin et al. 2023, balances by measured throughput the same way),
and sets the deadline from the predicted compute and communication times.
"""

from __future__ import annotations

import itertools
import math
import statistics
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from bagel.coordinator.core.policy import Policy
from bagel.coordinator.core.records import MemberPlan
from bagel.protocol.cellmemory import MemoryBudget, fits
from bagel.protocol.fastinit import fast_init
from bagel.protocol.messages import PeerAddress
from bagel.protocol.runspec import RunSpec, parse_cell

_EPS = 1e-12
_DESTINATIONS = 4  # destination cells a candidate tries per repair step
# distinct memory budgets whose eligible cells `Balance` keeps at once: a fleet has few
# (cards come in a few sizes), but a CPU worker declares its free RAM and any worker may
# declare what it likes, so the memo starts afresh past this many instead of growing
_BUDGETS_KEPT = 4096
# (cell, ratio, count >= m, reference, deficit change of one more member, n, 2 * n, target, count == 0)
_DestRow = tuple[str, float, bool, float, int, float, float, float, bool]


@fast_init
@dataclass(frozen=True, slots=True)
class WorkerView:
    """What the scheduler knows of a worker."""

    worker_id: str
    budget: MemoryBudget  # its declared memory (`bagel.protocol.cellmemory`)
    throughput: Mapping[str, float]  # samples/s estimate by cell id
    reputation: float = 0.0
    cell_id: str = ""  # current cell ("" = none)
    movable: bool = True  # False: stays where it is now (mid-round)
    sticky: bool = True  # moving it costs a state download


@dataclass(frozen=True, slots=True)
class Knobs:
    """Scheduler settings: the spec's [schedule] plus the policy's bounds."""

    min_replicas: int = 2
    max_replicas: int = 8
    vram_headroom: float = 0.2
    stickiness: float = 0.1
    ban_reputation: float = -5.0
    max_moves: int = 4  # moves per repair call
    candidates: int = 32  # workers examined per repair step

    @classmethod
    def from_spec(cls, spec: RunSpec, policy: Policy) -> Knobs:
        s = spec.schedule
        return cls(
            min_replicas=s.min_replicas,
            max_replicas=s.max_replicas,
            vram_headroom=s.vram_headroom,
            stickiness=s.stickiness,
            ban_reputation=s.ban_reputation,
            max_moves=policy.max_moves_per_event,
            candidates=policy.repair_candidates,
        )


def reduce_nothing(contributors: Sequence[str], relayed: Iterable[str]) -> frozenset[str]:
    """The contributors that reduce no part of the exchange: those reached only through a
    relay, as long as someone else reduces. A reducer sends its averaged part to every other
    member, the largest upload of the exchange; over a relay it crosses two links and the
    relay's own, so it goes to the directly reachable members instead. If every member is
    relayed, all reduce (equal parts), since someone must. The split stays a function of the
    frozen set (its digest binds the flags), so every replica still applies the same bytes."""
    members = set(contributors)
    skip = frozenset(x for x in relayed if x in members)
    return skip if len(skip) < len(members) else frozenset()


PART_WEIGHT_UNIT = 16  # the part weight of a contributor whose uplink is the group's median
PART_WEIGHT_CLAMP = 4.0  # a part is at most this many times the median's, at least its inverse


def part_weights(
    contributors: Sequence[str], uplinks: Mapping[str, float], no_reduce: Iterable[str] = ()
) -> dict[str, int]:
    """Each contributor's integer part weight in the split (`robust.reduction.part_bounds`),
    from its measured exchange uplink (bytes/s; 0 or absent = unmeasured).

    Contributor i uploads about (n - n_i) + (k - 1) n_i bytes of an n-element exchange (its
    contributions to the other parts, then its averaged part to every other member), so one
    slow uplink with an equal part bounds the whole group; a part proportional to the
    uplink lets every member finish its (k - 1) n_i share in about the same time. The idea
    is hivemind's load balancing (hivemind/averaging/load_balancing.py), which solves a
    linear program for the part sizes from the peers' bandwidths; this is the simpler rule
    of parts in proportion to the uplinks, clamped so a part stays within
    [1/PART_WEIGHT_CLAMP, PART_WEIGHT_CLAMP] x the median's: no part empty, none everything,
    and one mismeasured peer moves the split only so far. Unmeasured contributors count as
    the median of the measured ones; relayed ones (`no_reduce`) reduce nothing anyway and
    get 1. The weights are divided by their greatest common divisor, so with nobody
    measured (or everybody alike) every weight is 1: exactly the equal split.
    """
    skip = set(no_reduce)
    active = [x for x in contributors if x not in skip]
    measured = sorted(v for x in active if (v := uplinks.get(x, 0.0)) > 0 and math.isfinite(v))
    out = dict.fromkeys(contributors, 1)
    if not measured or len(active) < 2:
        return out
    mid = len(measured) // 2
    median = measured[mid] if len(measured) % 2 else (measured[mid - 1] + measured[mid]) / 2
    for x in active:
        v = uplinks.get(x, 0.0)
        ratio = v / median if v > 0 and math.isfinite(v) else 1.0
        ratio = min(PART_WEIGHT_CLAMP, max(1.0 / PART_WEIGHT_CLAMP, ratio))
        out[x] = max(1, round(PART_WEIGHT_UNIT * ratio))
    g = math.gcd(*(out[x] for x in active))
    for x in active:
        out[x] //= g
    return out


def throughput_for(throughput: Mapping[str, float], cell_id: str) -> float:
    """samples/s of a worker on a cell; a cell it did not measure gets the mean of those
    it did (1.0 if it measured none), so a partial profile still schedules."""
    v = throughput.get(cell_id)
    if v is not None and v > 0:
        return float(v)
    known = [x for x in throughput.values() if x > 0]
    return sum(known) / len(known) if known else 1.0


def reputation_weight(reputation: float, ban_reputation: float) -> float:
    """1 for a non-negative reputation, falling linearly to 0.1 at the ban threshold."""
    if reputation >= 0 or ban_reputation >= 0:
        return 1.0
    return max(0.1, 1.0 - 0.9 * min(1.0, reputation / ban_reputation))


Move = tuple[str, str, str]  # (worker_id, from_cell, to_cell)


ROUTER_SHARE = 0.1  # of total compute, when the run trains a router


def cell_targets(spec: RunSpec, cluster_sizes: Sequence[int] | None) -> dict[str, float]:
    """Target compute shares (sum 1): cluster size x range mass; the router gets ROUTER_SHARE.

    `cluster_sizes` None means equal clusters (the simulator; the shell counts the real ones)."""
    k, r = spec.data.clusters, spec.cells.timestep_ranges
    sizes = list(cluster_sizes) if cluster_sizes is not None else [1] * k
    if len(sizes) != k or sum(sizes) <= 0 or min(sizes) < 0:
        raise ValueError(f"cluster sizes {sizes} do not fit data.clusters={k}")
    expert_total = 1.0 - (ROUTER_SHARE if spec.cells.router else 0.0)
    total = float(sum(sizes))
    out: dict[str, float] = {}
    for cell in spec.cell_ids:
        parsed = parse_cell(cell)
        if parsed is None:
            out[cell] = ROUTER_SHARE
        else:
            cluster, _range = parsed
            out[cell] = expert_total * (sizes[cluster] / total) / r
    return out


class Balance:
    """Per-cell compute sums for incremental placement and repair.

    Holds, for every cell, the count of assigned workers and the sum of their weighted
    raw throughput (samples/s x reputation weight), plus the running mean of the known
    workers' throughput per cell (the reference that turns samples/s into compute).
    Callers keep it in step with their assignment via `add_reference`/`add`/`remove`.

    Derived figures (references, normalised compute, shares, the chi-square sum, the
    replica floor, the destination order) are computed once per change of those sums and
    cached until the next `add`/`remove`/`add_reference`: a repair asks for them several
    times per transition, and recomputing them each time made a repair O(cells^2).
    """

    def __init__(
        self,
        cell_memory: Mapping[str, int],
        cell_targets: Mapping[str, float],
        knobs: Knobs,
        cell_host: Mapping[str, int] | None = None,
    ) -> None:
        """`cell_memory`: each cell's device memory with a micro-batch of one, `cell_host`
        its host memory (absent: 0), as `bagel.protocol.cellmemory.fits` reads them."""
        for c in cell_targets:
            if c not in cell_memory:
                raise ValueError(f"target for unknown cell {c!r}")
        total = sum(max(0.0, cell_targets.get(c, 0.0)) for c in cell_memory)
        if total <= 0:
            raise ValueError("cell_targets: at least one cell needs a positive target")
        self.knobs = knobs
        self.memory = dict(cell_memory)
        self.host = {c: int((cell_host or {}).get(c, 0)) for c in cell_memory}
        self.cells = tuple(cell_memory)
        self.target = {c: max(0.0, cell_targets.get(c, 0.0)) / total for c in self.cells}
        self.active = tuple(c for c in self.cells if self.target[c] > 0)
        self.count = {c: 0 for c in self.cells}
        self.raw = {c: 0.0 for c in self.cells}
        # per cell, in cell order: the sum and count of the known workers' rates (references)
        self._ref_sum = np.zeros(len(self.cells), dtype=np.float64)
        self._ref_n = np.zeros(len(self.cells), dtype=np.int64)
        # eligible cells by memory budget, memoised: populations have few distinct budgets.
        self._eligible: dict[MemoryBudget, tuple[str, ...]] = {}
        self._eligible_set: dict[MemoryBudget, frozenset[str]] = {}
        self._eligible_idx: dict[MemoryBudget, np.ndarray] = {}  # positions of eligible(budget) in self.cells
        self._fit_mask: dict[MemoryBudget, np.ndarray] = {}  # eligible(budget) as a mask over self.active
        self._index = {c: i for i, c in enumerate(self.cells)}
        self._target_arr = np.array([self.target[c] for c in self.cells], dtype=np.float64)
        # the same over the active cells (a view when every cell is active), and their ids
        self._active_idx = np.array([self._index[c] for c in self.active], dtype=np.intp)
        self._all_active = len(self.active) == len(self.cells)
        self._target_active = self._target_arr if self._all_active else self._target_arr[self._active_idx]
        self._active_ids = np.array(self.active, dtype=object)
        self._refs: dict[str, float] = {}  # references as of the last _stats()
        self._refs_arr: np.ndarray | None = None  # _refs_now as an array in cell order
        self.placed = 0  # sum of count (kept, not summed: min_replicas_now is on hot paths)
        # thin[k]: active cells with exactly k < min_replicas members, so short_of_replicas
        # is O(min_replicas) without the derived figures (a join or leave asks it first)
        self._thin = [0] * max(0, knobs.min_replicas)
        if self._thin:
            self._thin[0] = len(self.active)
        self._cache: _Derived | None = None  # derived figures; None = stale
        self._refs_now: dict[str, float] | None = None  # ref(c) of every cell; None = stale

    # ---- bookkeeping

    def add_reference(self, throughput: Mapping[str, float], sign: int = 1) -> None:
        """Count (sign=+1) or forget (-1) a known worker's profile in the references.

        Each cell's sum on its own, so the order is free: as arrays, one element-wise add
        of the positive rates (the same IEEE additions as the loop per cell). A rate that
        is not a plain number takes the loop."""
        rs, rn = self._ref_sum, self._ref_n
        try:
            v = np.fromiter(map(throughput.get, self.cells, itertools.repeat(0.0)), np.float64, len(self.cells))
        except (TypeError, ValueError):
            for c, x in throughput.items():
                i = self._index.get(c)
                if i is not None and x is not None and x > 0:
                    rs[i] += sign * x
                    rn[i] += sign
        else:
            ok = v > 0  # missing (0.0), zero, negative or NaN: not counted
            np.add(rs, v if sign == 1 else sign * v, out=rs, where=ok)
            np.add(rn, sign, out=rn, where=ok)
        self._cache = None
        self._refs_now = None

    def ref(self, c: str) -> float:
        i = self._index[c]
        n, s = int(self._ref_n[i]), float(self._ref_sum[i])
        return s / n if n > 0 and s > 0 else 1.0

    def raw_power(self, throughput: Mapping[str, float], reputation: float, c: str) -> float:
        return throughput_for(throughput, c) * reputation_weight(reputation, self.knobs.ban_reputation)

    def _power_fn(self, throughput: Mapping[str, float], reputation: float) -> Callable[[str], float]:
        """c -> normalised compute of one worker in cell c, with the reputation weight and
        the references looked up once per candidate rather than once per cell tried."""
        rw = reputation_weight(reputation, self.knobs.ban_reputation)
        refs = self._refs

        def power(c: str) -> float:
            v = throughput.get(c)
            if v is None or v <= 0:
                v = throughput_for(throughput, c)  # rare: a cell the worker did not measure
            return v * rw / refs[c]

        return power

    def add(self, c: str, raw: float) -> None:
        k = self.count[c]
        if k < len(self._thin) and self.target[c] > 0:
            self._thin[k] -= 1
            if k + 1 < len(self._thin):
                self._thin[k + 1] += 1
        self.count[c] = k + 1
        self.raw[c] += raw
        self.placed += 1
        self._cache = None

    def remove(self, c: str, raw: float) -> None:
        k = self.count[c] - 1
        if 0 <= k < len(self._thin) and self.target[c] > 0:
            self._thin[k] += 1
            if k + 1 < len(self._thin):
                self._thin[k + 1] -= 1
        self.count[c] = k
        self.raw[c] = self.raw[c] - raw if self.count[c] > 0 else 0.0  # no float drift to 0
        self.placed -= 1
        self._cache = None

    def eligible_set(self, budget: MemoryBudget) -> frozenset[str]:
        got = self._eligible_set.get(budget)
        if got is None:
            got = self._eligible_set[budget] = frozenset(self.eligible(budget))
        return got

    def _fit_active(self, budget: MemoryBudget) -> np.ndarray:
        """Boolean mask over `active`: does the cell fit `budget`? (memoised)"""
        got = self._fit_mask.get(budget)
        if got is None:
            fit = self.eligible_set(budget)
            got = self._fit_mask[budget] = np.array([c in fit for c in self.active], dtype=bool)
        return got

    def eligible(self, budget: MemoryBudget) -> tuple[str, ...]:
        got = self._eligible.get(budget)
        if got is None:
            if len(self._eligible) >= _BUDGETS_KEPT:
                # every memo keyed by budget holds only budgets of this one (see eligible_set)
                for memo in (self._eligible, self._eligible_idx, self._eligible_set, self._fit_mask):
                    memo.clear()
            h = self.knobs.vram_headroom
            got = tuple(c for c in self.active if fits(budget, self.memory[c], self.host[c], h))
            self._eligible[budget] = got
            self._eligible_idx[budget] = np.array([self._index[c] for c in got], dtype=np.intp)
        return got

    # ---- measures

    def _derived(self) -> _Derived:
        d = self._cache
        if d is None:
            d = self._cache = _Derived(self)
        self._refs = d.refs
        return d

    def compute(self) -> dict[str, float]:
        """Normalised compute per cell (raw / reference)."""
        return dict(self._derived().n)

    def shares(self) -> dict[str, float]:
        d = self._derived()
        total = d.total
        return {c: (v / total if total > 0 else 0.0) for c, v in d.n.items()}

    def ratios(self) -> dict[str, float]:
        """share / target of each active cell (1.0 = on target)."""
        return dict(self._derived().ratio)

    def ratio_view(self) -> Mapping[str, float]:
        """`ratios()` without the copy: read-only, valid until the next change."""
        return self._derived().ratio

    def cells_by_ratio_desc(self) -> tuple[str, ...]:
        """Active cells from the most over target down (ties in cell order)."""
        return self._derived().by_ratio_desc()

    def max_deviation(self) -> float:
        """max |share/target - 1| over the active cells (0.0 with none)."""
        return self._derived().max_dev

    def short_of_replicas(self) -> bool:
        """Is some active cell below `min_replicas_now()`? (The same answer as the derived
        deficit sum being positive, read off the per-count tally.)"""
        return any(self._thin[: self.min_replicas_now()])

    def _deficit_sum(self, m: int) -> int:
        """Sum of the active cells' replica deficits (m - count)^2 under a floor m <=
        min_replicas, from the per-count tally: O(m), exact (integers)."""
        thin = self._thin
        return sum([thin[k] * (m - k) * (m - k) for k in range(m)])

    def min_replicas_now(self) -> int:
        """min_replicas, lowered while there are too few workers for every active cell."""
        return min(self.knobs.min_replicas, self.placed // max(1, len(self.active)))

    def _stats(self) -> tuple[dict[str, float], float, float, int]:
        d = self._derived()
        return d.n, d.total, d.s_sum, d.m

    @staticmethod
    def _phi(s_sum: float, total: float) -> float:
        return s_sum / (total * total) - 1.0 if total > 0 else 0.0

    # ---- decisions

    def best_cell(self, budget: MemoryBudget, throughput: Mapping[str, float], reputation: float) -> str:
        """The cell a newcomer should join ("" = none fits or all are full): the least
        (replica deficit, Phi) after it joins, ties to the first eligible cell.

        O(eligible cells), and called on every join, so the per-cell arithmetic runs as
        numpy element-wise operations: the same IEEE operations in the same order as the
        scalar expressions (`_power_fn`, a cell's deficit max(0, m - count)^2, `_phi`), so the same choice.
        """
        _, total, s_sum, _ = self._stats()
        d = self._derived()
        el = self.eligible(budget)
        if not el:
            return ""
        idx = self._eligible_idx[budget]
        rw = reputation_weight(reputation, self.knobs.ban_reputation)
        max_r = self.knobs.max_replicas
        m_after = min(self.knobs.min_replicas, (self.placed + 1) // max(1, len(self.active)))
        base = d.deficit_sum(m_after)
        v = np.fromiter(map(throughput.get, el, itertools.repeat(-1.0)), np.float64, len(el))
        bad = ~(v > 0)  # missing, zero or not a number: the worker's mean rate (rare)
        if bad.any():
            v[bad] = [throughput_for(throughput, el[i]) for i in np.flatnonzero(bad)]
        refs, na, count = d.arrays()
        k = count[idx]
        p = v * rw / refs[idx]
        s_new = s_sum + (2 * na[idx] * p + p * p) / self._target_arr[idx]
        t = total + p
        if (t > 0).all():  # (always, with any compute placed) the same values as below
            phi = s_new / (t * t) - 1.0
        else:
            with np.errstate(divide="ignore", invalid="ignore"):
                phi = np.where(t > 0, s_new / (t * t) - 1.0, 0.0)
        ok = k < max_r
        if not ok.any():
            return ""
        if np.isnan(phi[ok]).any():  # the scalar loop's order-dependent answer to a NaN
            return self._best_cell_loop(el, throughput, rw, m_after, base)
        if m_after <= 0 or k.min() >= m_after:
            cand = ok  # no cell below the floor: every deficit is `base`
        else:
            dd = m_after - k
            deficit = base - np.where(dd > 0, dd * dd, 0) + np.where(dd > 1, (dd - 1) * (dd - 1), 0)
            dmin = deficit[ok].min()
            cand = ok & (deficit == dmin)
        ph = np.where(cand, phi, np.inf)
        i = int(np.argmin(ph))
        if not cand[i]:  # every candidate's Phi is inf: the first candidate, as the loop
            i = int(np.flatnonzero(cand)[0])
        return el[i]

    def _best_cell_loop(
        self, el: tuple[str, ...], throughput: Mapping[str, float], rw: float, m_after: int, base: int
    ) -> str:
        """`best_cell`'s scalar loop (kept for the NaN corner, where order decides)."""
        n, total, s_sum, _ = self._stats()
        refs, count, target = self._refs, self.count, self.target
        max_r = self.knobs.max_replicas
        best, best_d, best_phi = "", math.inf, math.inf
        for c in el:  # eligible cells are active: target > 0
            k = count[c]
            if k >= max_r:
                continue
            v = throughput.get(c)
            if v is None or v <= 0:
                v = throughput_for(throughput, c)
            p = v * rw / refs[c]
            s_new = s_sum + (2 * n[c] * p + p * p) / target[c]
            d = m_after - k
            deficit = base - (d * d if d > 0 else 0) + ((d - 1) * (d - 1) if d > 1 else 0)
            t = total + p
            phi = s_new / (t * t) - 1.0 if t > 0 else 0.0
            if deficit < best_d or (deficit == best_d and phi < best_phi):
                best, best_d, best_phi = c, deficit, phi
        return best

    def _worth_it(
        self, a: str, b: str, na: float, nb: float, total: float, ratio: Mapping[str, float], downloads: int
    ) -> bool:
        """Stickiness: a change that costs `downloads` state downloads must cut the worse
        relative deviation |share/target - 1| of the two cells it touches by more than
        `stickiness` per download. Scale-free (a 10,000-worker run and a 12-worker one
        read it the same way) and it never robs one cell to pay another: a move that
        leaves its source as far off as the destination was does not qualify."""
        before = max(abs(ratio[a] - 1.0), abs(ratio[b] - 1.0))
        after = max(abs(na / total / self.target[a] - 1.0), abs(nb / total / self.target[b] - 1.0))
        return before - after > self.knobs.stickiness * downloads

    def best_move(self, candidates: Iterable[WorkerView]) -> tuple[Move, float] | None:
        """The single move of a candidate that lowers (replica deficit, Phi) the most.

        A sticky candidate (one whose move costs a download) only moves when that is worth
        it (`_worth_it`, written out below). Returns ((worker, from, to), gain in Phi) or None.

        This loop runs candidates x destinations times on every repair step, so what does
        not depend on the candidate comes precomputed per destination (`_Derived.dest_info`)
        and what does not depend on the destination is hoisted out of the inner loop; every
        float expression keeps its operations and their order (noted where rewritten).
        """
        dv = self._derived()
        n, total, s_sum, m = dv.n, dv.total, dv.s_sum, dv.m
        if total <= 0:
            return None
        phi0 = self._phi(s_sum, total)
        def0 = dv.def0
        ratio = dv.ratio
        target, count = self.target, self.count
        stick = self.knobs.stickiness
        ban, refs = self.knobs.ban_reputation, dv.refs
        best: tuple[Move, float] | None = None
        best_d, best_p = 0, -_EPS  # must strictly improve (deficit, then Phi)
        for w in candidates:
            a = w.cell_id
            if not a or not w.movable:
                continue
            ta = target.get(a, 0.0)
            # power(c) of `_power_fn`, written out: this loop runs candidates x destinations times
            thr = w.throughput
            rep = w.reputation
            rw = 1.0 if rep >= 0 or ban >= 0 else reputation_weight(rep, ban)
            v = thr.get(a)
            if v is None or v <= 0:
                v = throughput_for(thr, a)
            pa = v * rw / refs[a]
            n_a = n[a]
            na = max(0.0, n_a - pa)
            s_wo = s_sum - ((n_a * n_a - na * na) / ta if ta > 0 else 0.0)
            if ta > 0:  # a's deficit max(0, m - count)^2: count[a] -> count[a] - 1
                d = m - count[a]
                def_wo = def0 - (d * d if d > 0 else 0) + ((d + 1) * (d + 1) if d > -1 else 0)
            else:
                def_wo = def0
            ra = ratio.get(a, math.inf)
            sticky = w.sticky
            if sticky:
                dev_a = abs(ratio[a] - 1.0)
                if def0 == 0:
                    # nothing to fill, so it moves only if worth it, and `before` is at most
                    # max(dev_a, |lowest destination ratio - 1|): a destination above 1 is
                    # below ra (uphill ends the scan). With that bound <= stickiness no
                    # destination qualifies (after >= 0): skip the candidate unevaluated.
                    dests = dv.destinations(w.budget)
                    if not dests or max(dev_a, abs(ratio[dests[0]] - 1.0)) <= stick:
                        continue
            tried = 0
            tp = total - pa  # total_b = total - pa + pb, evaluated left to right
            # destinations: cells short of replicas first, then the most under target, that
            # fit the worker and have room; it tries the first few, so a step is O(candidates)
            for b, rb, full_b, ref_b, delta_b, n_b, two_n_b, tb, empty_b in dv.dest_info(w.budget):
                if b == a:
                    continue
                if tried >= _DESTINATIONS:
                    break
                if rb >= ra and full_b:
                    break  # compute moving "uphill" cannot lower Phi; only a deficit justifies it
                tried += 1
                v = thr.get(b)
                if v is None or v <= 0:
                    v = throughput_for(thr, b)
                pb = v * rw / ref_b
                d_new = def_wo + delta_b  # b is active: its deficit, count[b] -> count[b] + 1
                total_b = tp + pb
                if sticky:
                    # redundancy comes first: restoring min_replicas is worth a download, by a
                    # worker that does not push the cell past twice its target (an empty cell
                    # takes anyone; otherwise a better-sized worker comes idle soon enough)
                    nb = n_b + pb
                    fills = d_new < def0 and (empty_b or nb / total_b / tb <= 2.0)
                    if not fills:
                        # _worth_it(a, b, na, nb, total_b, ratio, 1)
                        before = max(dev_a, abs(rb - 1.0))
                        after = max(abs(na / total_b / ta - 1.0), abs(nb / total_b / tb - 1.0))
                        if not before - after > stick:
                            continue
                s_new = s_wo + (two_n_b * pb + pb * pb) / tb  # (2 * n[b] * pb + pb * pb) / target[b]
                dd = d_new - def0
                pd = (s_new / (total_b * total_b) - 1.0 if total_b > 0 else 0.0) - phi0  # _phi(s_new, total_b)
                if dd < best_d or (dd == best_d and pd < best_p):
                    best, best_d, best_p = ((w.worker_id, a, b), -pd), dd, pd
        return best

    def best_swap(
        self, candidates: Iterable[WorkerView], *, allow_two_downloads: bool = True
    ) -> tuple[Move, Move, float] | None:
        """The exchange of two candidates' cells that lowers Phi the most (counts, and so
        the replica deficit, do not change). Tried when no single move helps: with few,
        uneven workers a swap often fixes what no move can. Each sticky worker of the pair
        is a download the swap must be worth. O(len(candidates)^2)."""
        n, total, s_sum, _ = self._stats()
        if total <= 0:
            return None
        phi0 = self._phi(s_sum, total)
        ratio = self._derived().ratio
        cands = [w for w in candidates if w.cell_id in ratio and w.movable]
        best: tuple[Move, Move, float] | None = None
        best_phi = phi0 - _EPS
        # a pair reads each candidate's power in the candidates' own cells only: computed
        # once per (candidate, cell), not four times per pair (power is a pure function)
        cells = dict.fromkeys(w.cell_id for w in cands)
        powers = []
        for w in cands:
            pf = self._power_fn(w.throughput, w.reputation)
            powers.append({c: pf(c) for c in cells})
        fits = [self.eligible_set(w.budget) for w in cands]
        for i, w in enumerate(cands):
            a = w.cell_id
            for j, v in enumerate(cands[i + 1 :]):
                b = v.cell_id
                if a == b or b not in fits[i] or a not in fits[i + 1 + j]:
                    continue
                downloads = int(w.sticky) + int(v.sticky)
                if downloads == 2 and not allow_two_downloads:
                    continue  # (checked before the powers: most pairs end here)
                pw, pv = powers[i], powers[i + 1 + j]
                pwa, pwb, pva, pvb = pw[a], pw[b], pv[a], pv[b]
                na, nb = n[a] - pwa + pva, n[b] - pvb + pwb
                ta, tb = self.target[a], self.target[b]
                total2 = total - pwa - pvb + pwb + pva
                if downloads and not self._worth_it(a, b, na, nb, total2, ratio, downloads):
                    continue
                s_new = s_sum + (na * na - n[a] * n[a]) / ta + (nb * nb - n[b] * n[b]) / tb
                phi = self._phi(s_new, total2)
                if phi < best_phi:
                    best, best_phi = ((w.worker_id, a, b), (v.worker_id, b, a), phi0 - phi), phi
        return best


class _Derived:
    """Figures derived from a `Balance`'s sums, valid until its next change (see there).

    Each is computed exactly as the scalar expression it replaces (kept in the comments):
    numpy element-wise operations are the same IEEE operations in the same order, every
    sum over cells is still Python's left-to-right `sum` of the same terms, and the
    orders are stable sorts by the same keys. So the cache and the arrays change no
    decision, only the cost of a rebuild, which the cold start pays on every join and
    move. A NaN ratio (never seen: rates are validated finite) takes the scalar path,
    whose answers with NaN depend on order.
    """

    __slots__ = (
        "bal",
        "refs",
        "n",
        "total",
        "s_sum",
        "m",
        "ratio",
        "max_dev",
        "short",
        "def0",
        "_order",
        "_dests",
        "_desc",
        "_open",
        "_arrays",
        "_n_arr",
        "_r_arr",
        "_count_arr",
        "_order_idx",
        "_nan",
        "_info",
        "_refs_arr",
    )

    def __init__(self, bal: Balance) -> None:
        self.bal = bal
        cells, active = bal.cells, bal.active
        k = len(cells)
        refs, refs_arr = bal._refs_now, bal._refs_arr
        if refs is None or refs_arr is None:  # references change only with add_reference
            # = {c: bal.ref(c) for c in cells}
            rs, rn = bal._ref_sum, bal._ref_n.astype(np.float64)
            with np.errstate(divide="ignore", invalid="ignore"):
                refs_arr = bal._refs_arr = np.where((rn > 0) & (rs > 0), rs / rn, 1.0)
            refs = bal._refs_now = dict(zip(cells, refs_arr.tolist(), strict=True))
        self.refs = refs
        self._refs_arr = refs_arr
        # n = {c: raw[c] / refs[c]}; total = sum(n.values()) (in cell order)
        n_arr = self._n_arr = np.fromiter(bal.raw.values(), np.float64, k) / refs_arr
        n_list = n_arr.tolist()
        self.n = dict(zip(cells, n_list, strict=True))
        self.total = total = sum(n_list)
        n_act = n_arr if bal._all_active else n_arr[bal._active_idx]
        t_act = bal._target_active
        # s_sum = sum([n[c] * n[c] / target[c] for c in active])
        self.s_sum = sum((n_act * n_act / t_act).tolist())
        self.m = m = bal.min_replicas_now()
        # ratio = {c: (n[c] / total) / target[c] for c in active}, or 0.0 with no compute
        r_arr = self._r_arr = n_act / total / t_act if total > 0 else np.zeros(len(active))
        self.ratio = dict(zip(active, r_arr.tolist(), strict=True))
        self._nan = bool(np.isnan(r_arr).any())
        if self._nan:
            self.max_dev = max([abs(x - 1.0) for x in self.ratio.values()], default=0.0)
        else:  # = max(|ratio - 1|), 0.0 with no active cell
            self.max_dev = float(np.abs(r_arr - 1.0).max()) if len(active) else 0.0
        # the sum of the active cells' deficits; some cell is short iff it is positive
        self.def0 = bal._deficit_sum(m)
        self.short = self.def0 > 0
        self._order: tuple[str, ...] | None = None
        self._order_idx: np.ndarray | None = None  # positions of order() in bal.active
        self._dests: dict[MemoryBudget, tuple[str, ...]] = {}
        self._open: np.ndarray | None = None  # _order_idx less the full cells
        self._desc: tuple[str, ...] | None = None
        self._arrays: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._count_arr: np.ndarray | None = None
        self._info: dict[MemoryBudget, tuple[_DestRow, ...]] = {}

    def _counts(self) -> np.ndarray:
        if self._count_arr is None:
            self._count_arr = np.fromiter(self.bal.count.values(), np.int64, len(self.bal.cells))
        return self._count_arr

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(references, normalised compute, counts) as arrays in cell order, for `best_cell`."""
        if self._arrays is None:
            self._arrays = (self._refs_arr, self._n_arr, self._counts())
        return self._arrays

    def destinations(self, budget: MemoryBudget) -> tuple[str, ...]:
        """`order()` less the cells that are full or do not fit `budget` (memoised per
        memory budget; populations have few)."""
        got = self._dests.get(budget)
        if got is None:
            bal = self.bal
            if self._nan:
                count, max_r = bal.count, bal.knobs.max_replicas
                fit = bal.eligible_set(budget)
                got = tuple(b for b in self.order() if count[b] < max_r and b in fit)
            else:
                o = self._open
                if o is None:
                    self.order()
                    counts = self._counts()
                    oi = self._order_idx
                    assert oi is not None  # order() sets it when no ratio is NaN
                    cells_i = oi if bal._all_active else bal._active_idx[oi]
                    o = self._open = oi[counts[cells_i] < bal.knobs.max_replicas]
                fit_mask = bal._fit_active(budget)
                got = tuple(bal._active_ids[o[fit_mask[o]]].tolist())
            self._dests[budget] = got
        return got

    def dest_info(self, budget: MemoryBudget) -> tuple[_DestRow, ...]:
        """What `best_move` reads of each destination it may try (the first
        _DESTINATIONS + 1 of `destinations`: one may be the candidate's own cell):
        (cell, ratio, count >= m, reference, deficit change of one more member, n,
        2 * n, target, count == 0). Memoised per memory budget."""
        got = self._info.get(budget)
        if got is None:
            bal, m = self.bal, self.m
            count, target, n, ratio, refs = bal.count, bal.target, self.n, self.ratio, self.refs
            rows: list[_DestRow] = []
            for b in self.destinations(budget)[: _DESTINATIONS + 1]:
                k = count[b]
                d = m - k
                # def_wo - (d * d if d > 0 else 0) + ((d - 1) * (d - 1) if d > 1 else 0): integers
                delta = ((d - 1) * (d - 1) if d > 1 else 0) - (d * d if d > 0 else 0)
                rows.append((b, ratio[b], k >= m, refs[b], delta, n[b], 2 * n[b], target[b], k == 0))
            got = self._info[budget] = tuple(rows)
        return got

    def by_ratio_desc(self) -> tuple[str, ...]:
        """Active cells from the most over target down (stable for ties)."""
        if self._desc is None:
            if self._nan:
                self._desc = tuple(sorted(self.ratio, key=self.ratio.__getitem__, reverse=True))
            else:
                # = sorted(ratio, key=ratio.get, reverse=True): a stable sort in reverse keeps
                # ties in cell order, as the stable ascending sort of -ratio does
                self._desc = tuple(self.bal._active_ids[np.argsort(-self._r_arr, kind="stable")].tolist())
        return self._desc

    def order(self) -> tuple[str, ...]:
        """Active cells, those short of replicas first, then by share/target ascending."""
        if self._order is None:
            bal = self.bal
            count, m = bal.count, self.m
            if self._nan:
                key = self.ratio.__getitem__
                short = [c for c in bal.active if count[c] < m]
                rest = [c for c in bal.active if count[c] >= m] if short else bal.active
                self._order = tuple(sorted(short, key=key)) + tuple(sorted(rest, key=key))
            else:
                # = sorted(active, key=(count >= m, ratio)), stable: the stable sort by ratio,
                # the short cells taken out first (a stable sort of a subsequence is the
                # subsequence of the stable sort)
                by_r = np.argsort(self._r_arr, kind="stable")
                counts = self._counts()
                c_act = counts if bal._all_active else counts[bal._active_idx]
                thin = c_act[by_r] < m
                oi = self._order_idx = np.concatenate((by_r[thin], by_r[~thin])) if thin.any() else by_r
                self._order = tuple(bal._active_ids[oi].tolist())
        return self._order

    def deficit_sum(self, m: int) -> int:
        """Sum of the active cells' replica deficits under floor m (<= min_replicas)."""
        return self.bal._deficit_sum(m)


def assign(
    workers: Sequence[WorkerView],
    cell_memory: Mapping[str, int],
    cell_targets: Mapping[str, float],
    knobs: Knobs,
    *,
    max_moves: int | None = None,
    cell_host: Mapping[str, int] | None = None,
) -> dict[str, str]:
    """New assignment worker_id -> cell_id ("" = standby: nothing fits or all cells full).

    Keeps every current assignment that still fits (and is not over max_replicas), places
    the rest one by one (most constrained first, then fastest), then applies up to
    `max_moves` (default: one per worker) improving moves or swaps under the stickiness
    rule, each looking at `knobs.candidates` workers from the most over-target cells
    down (the same bounded repair the state runs on every join, leave and boundary).
    A worker placed by this call holds nothing yet, so it is never sticky.
    """
    bal = Balance(cell_memory, cell_targets, knobs, cell_host)
    by_id = {w.worker_id: w for w in workers}
    if len(by_id) != len(workers):
        raise ValueError("duplicate worker ids")
    for w in workers:
        bal.add_reference(w.throughput)
    cur: dict[str, str] = {}
    # keep what fits, fastest first so a full cell keeps its best members
    for w in sorted(workers, key=lambda w: (-throughput_for(w.throughput, w.cell_id), w.worker_id)):
        c = w.cell_id
        keep = c in bal.target and bal.target[c] > 0 and c in bal.eligible(w.budget)
        if c and (not w.movable or (keep and bal.count[c] < knobs.max_replicas)):
            cur[w.worker_id] = c
            bal.add(c, bal.raw_power(w.throughput, w.reputation, c))
    pending = [w for w in workers if w.worker_id not in cur and w.movable]

    def constrained_then_fast(w: WorkerView) -> tuple[int, float, str]:
        el = bal.eligible(w.budget)
        return len(el), -max((throughput_for(w.throughput, c) / bal.ref(c) for c in el), default=0.0), w.worker_id

    for w in sorted(pending, key=constrained_then_fast):
        c = bal.best_cell(w.budget, w.throughput, w.reputation)
        cur[w.worker_id] = c
        if c:
            bal.add(c, bal.raw_power(w.throughput, w.reputation, c))
    for w in workers:
        cur.setdefault(w.worker_id, "")
    by_cell: dict[str, dict[str, WorkerView]] = {c: {} for c in bal.cells}

    def view(w: WorkerView) -> WorkerView:
        c = cur[w.worker_id]
        return WorkerView(w.worker_id, w.budget, w.throughput, w.reputation, c, w.movable, w.sticky and c == w.cell_id)

    for w in workers:
        if cur[w.worker_id]:
            by_cell[cur[w.worker_id]][w.worker_id] = view(w)
    for _ in range(len(workers) if max_moves is None else max_moves):
        ratios = bal.ratios()
        cands: list[WorkerView] = []
        for c in sorted(ratios, key=lambda x: -ratios[x]):
            cands.extend(itertools.islice(by_cell[c].values(), knobs.candidates - len(cands)))
        move = bal.best_move(cands)
        if move is not None:
            moves: tuple[Move, ...] = (move[0],)
        else:
            swap = bal.best_swap(cands)
            if swap is None:
                break
            moves = swap[:2]
        for wid, a, b in moves:
            w = by_id[wid]
            bal.remove(a, bal.raw_power(w.throughput, w.reputation, a))
            bal.add(b, bal.raw_power(w.throughput, w.reputation, b))
            cur[wid] = b
            del by_cell[a][wid]
            by_cell[b][wid] = view(w)
    return cur


def compute_shares(
    workers: Sequence[WorkerView],
    assignment: Mapping[str, str],
    cell_memory: Mapping[str, int],
    cell_targets: Mapping[str, float],
    knobs: Knobs,
    cell_host: Mapping[str, int] | None = None,
) -> dict[str, float]:
    """Each cell's share of total compute under an assignment (the measure `assign` balances)."""
    bal = Balance(cell_memory, cell_targets, knobs, cell_host)
    for w in workers:
        bal.add_reference(w.throughput)
        c = assignment.get(w.worker_id, "")
        if c:
            bal.add(c, bal.raw_power(w.throughput, w.reputation, c))
    return bal.shares()


# ---------------------------------------------------------------- round planning


@fast_init
@dataclass(frozen=True, slots=True)
class PlanMember:
    worker_id: str
    peer: PeerAddress
    samples_per_s: float
    bandwidth_bytes_per_s: float = 0.0  # 0 = unknown
    # with overlap: the share of this round the member is expected to have trained already,
    # ahead, during the last exchange (0 for a member that took no part in it)
    head_start: float = 0.0
    # the largest micro-batch its memory holds in this cell (`micro_batch_cap`); 0: the run's
    max_micro_batch: int = 0


MAX_HEAD_START = 0.9
"""The most of a round the planner counts as trained ahead, so a newcomer still gets a tenth
of its throughput share rather than nothing."""


@dataclass(frozen=True, slots=True)
class Planning:
    inner_steps: int
    members: tuple[MemberPlan, ...]  # sorted by worker_id
    deadline_ms: int
    predicted_compute_ms: int
    predicted_comm_ms: int
    # when the members are expected to be ready: the slowest one's time left after its
    # head start (= predicted_compute_ms without overlap)
    ready_in_ms: int = 0


def split_batch(total: int, weights: Sequence[float]) -> list[int]:
    """Integers proportional to weights that sum to `total` (largest remainder, ties to
    the earlier member); everyone gets at least 1, so the sum exceeds `total` only when
    it is too small for that."""
    n = len(weights)
    if n == 0:
        return []
    wsum = sum(weights)
    exact = [total * w / wsum for w in weights] if wsum > 0 else [total / n] * n
    base = [int(x) for x in exact]
    left = total - sum(base)
    order = sorted(range(n), key=lambda i: (-(exact[i] - base[i]), i))
    for i in order[:left]:
        base[i] += 1
    return [max(1, b) for b in base]


def batch_shape(batch: int, max_micro_batch: int) -> tuple[int, int]:
    """(micro_batch, grad_accum) with micro_batch <= max and product >= batch, closest."""
    accum = -(-batch // max_micro_batch)
    micro = -(-batch // accum)
    return micro, accum


def _micro_limit(member_cap: int, spec: RunSpec) -> int:
    """A member's micro-batch limit: its memory's cap (0: none known), within the run's."""
    top = spec.diloco.max_micro_batch
    return min(member_cap, top) if member_cap > 0 else top


def predict_comm_ms(payload_bytes: int, bandwidths: Sequence[float], policy: Policy) -> int:
    """Butterfly all-reduce (reduce-scatter + all-gather): each member moves about
    2 (n-1)/n payloads each way, limited by the slowest link, plus a fixed overhead."""
    n = len(bandwidths)
    slowest = min((b if b > 0 else policy.default_bandwidth_bytes_per_s) for b in bandwidths) if n else 1.0
    volume = 2.0 * payload_bytes * (n - 1) / n if n > 1 else 0.0
    return int(1000.0 * (policy.comm_overhead_s + volume / slowest))


def plausible_speeds(speeds: Sequence[float], max_speedup: float, cap: float) -> list[float]:
    """Each speed clamped to `cap` and to `max_speedup` times the median of the others.

    A worker's throughput estimate starts as its own claim (the profile it registers with),
    so a liar claiming 1e9 samples/s would take almost the whole round's batch and, through
    the sample weights, the average. The median of the *other* members is what a single
    liar cannot move; a member alone is only bounded by `cap`."""
    out: list[float] = []
    capped = [min(max(s, 0.0), cap) for s in speeds]
    for i, s in enumerate(capped):
        others = sorted(capped[:i] + capped[i + 1 :])
        if others:
            n = len(others)
            med = others[n // 2] if n % 2 else 0.5 * (others[n // 2 - 1] + others[n // 2])
            s = min(s, max_speedup * med)
        out.append(s)
    return out


def plan_round(
    members: Sequence[PlanMember],
    spec: RunSpec,
    now_ms: int,
    policy: Policy,
    payload_bytes: int,
) -> Planning:
    """Per-member micro_batch/grad_accum and the round's deadline.

    The group's per-step batch (`diloco.group_batch`) is split in proportion to throughput
    (each member's clamped by `plausible_speeds` first)
    (or equally under `batch_split="equal"`); each member's step batch becomes
    micro_batch x grad_accum with micro_batch <= the member's `max_micro_batch` (the
    largest its memory holds) and <= `diloco.max_micro_batch`. Its sample budget
    (`max_samples`) is that times H. Deadline = now + max(min_round_s, predicted compute
    (the slowest member) x slack + predicted communication).

    With overlap, a member of the last exchange has already trained a share f of this round
    ahead (`PlanMember.head_start`) and needs only (1 - f) of its time; a newcomer needs all
    of it. Splitting by throughput alone, every head-started member would then wait at the
    freeze for the newcomers' whole round, so each weight is speed / (1 - f) (f at most
    `MAX_HEAD_START`), which makes everyone's remaining time about equal. The deadline stays
    that of a whole round (a cut-off only: the freeze comes when all are ready), so a member
    that hears of the round a heartbeat late is not cut for it.
    """
    if not members:
        raise ValueError("a round needs members")
    ms = sorted(members, key=lambda m: m.worker_id)
    h = policy.inner_steps or spec.diloco.inner_steps
    a = spec.audit
    speeds = [max(s, 1e-9) for s in plausible_speeds([m.samples_per_s for m in ms], a.max_speedup, a.max_samples_per_s)]
    left = [1.0 - min(max(m.head_start, 0.0), MAX_HEAD_START) for m in ms]
    weights = (
        [s / f for s, f in zip(speeds, left, strict=True)] if policy.batch_split == "proportional" else [1.0] * len(ms)
    )
    batches = split_batch(spec.diloco.group_batch, weights)
    plans: list[MemberPlan] = []
    compute_s = ready_s = 0.0
    for m, b, s, f in zip(ms, batches, speeds, left, strict=True):
        micro, accum = batch_shape(b, _micro_limit(m.max_micro_batch, spec))
        samples = micro * accum * h
        plans.append(MemberPlan(m.worker_id, m.peer, micro, accum, samples))
        compute_s = max(compute_s, samples / s)
        ready_s = max(ready_s, samples * f / s)
    comm_ms = predict_comm_ms(payload_bytes, [m.bandwidth_bytes_per_s for m in ms], policy)
    slack = policy.deadline_slack or spec.schedule.deadline_slack
    span = max(spec.schedule.min_round_s * 1000.0, compute_s * 1000.0 * slack + comm_ms)
    return Planning(h, tuple(plans), now_ms + int(span), int(compute_s * 1000.0), comm_ms, int(ready_s * 1000.0))


LATE_JOIN_MARGIN = 0.8
"""A late joiner is given this share of what its speed trains by the expected freeze, so a
speed estimate a little high does not make the others wait for it."""


def plan_late_member(
    speed: float,
    member_speeds: Sequence[float],
    inner_steps: int,
    left_ms: int,
    round_ms: int,
    worker_id: str,
    peer: PeerAddress,
    spec: RunSpec,
    policy: Policy,
    max_micro_batch: int = 0,
) -> MemberPlan | None:
    """The plan of a worker that came to hold a round's base state while the round trains
    (`Rounds.admit_late`): the same H inner steps with a per-step batch sized to what it
    trains in the `left_ms` until the members are expected ready (a `LATE_JOIN_MARGIN`
    of it, its speed clamped as the members' are), so it contributes a sample-weighted
    partial round instead of idling until the next one. None when it does not pay: late
    join off (`Policy.late_join`), less than `late_join_min_share` of the round's
    `round_ms` left, or less than one sample per inner step. Its micro-batch is at most
    `max_micro_batch` (its memory's, `micro_batch_cap`; 0: the run's)."""
    if not policy.late_join or policy.batch_split != "proportional" or left_ms <= 0 or round_ms <= 0:
        return None
    if left_ms < policy.late_join_min_share * round_ms:
        return None
    a = spec.audit
    # as `plausible_speeds` clamps a member: the cap, and max_speedup x the others' median
    clamped = min(max(speed, 0.0), a.max_samples_per_s)
    if member_speeds:
        med = statistics.median(min(max(x, 0.0), a.max_samples_per_s) for x in member_speeds)
        clamped = min(clamped, a.max_speedup * med)
    batch = int(clamped * left_ms / 1000.0 * LATE_JOIN_MARGIN / inner_steps)
    if batch < 1:
        return None
    micro, accum = batch_shape(batch, _micro_limit(max_micro_batch, spec))
    return MemberPlan(worker_id, peer, micro, accum, micro * accum * inner_steps)
