"""The audit of contributions: reducers' findings about senders, agreed on before anyone pays.

Every contributor of a group exchange reduces one part, and its ReportRound carries what it
saw there (`protocol.messages.PartAudit`, computed by `robust/audit.py`): per sender, the
norm of its slice, its nearest other sender by cosine, a sketch of the slice, and whether
the reducer excluded it. From one reporter's part the coordinator reads *flags* about a
sender X (never about the reporter itself, and never about a catch-up contributor, which
trains nothing):

- `excluded`: the reducer left X's contribution out (an abstention of a non-finite delta is
  not a flag: it contributed nothing and claims nothing; an exclusion the group screen
  gives as a "zero update" is the `zero` flag);
- `zero`: X's norm is at most `audit.zero_rel` times the median norm of the part's other
  contributions (or exactly 0);
- `copy`: X's slice has a cosine of at least `audit.copy_cosine` with another sender's;
- `replay`: most of X's sketch blocks in the part are within `audit.replay_bits` bits of
  X's own sketch of the same block in an earlier committed round (`audit.replay_history`
  rounds are kept per block);
- `loss` (the loss audit, Templar's Gauntlet idea; `worker/heldout.py` `SliceLossAudit`
  measures it): X's slice, applied alone to the committed state at X's share of the part's
  weighted mean (the step X contributes), *raises* the loss on X's
  own assigned samples by more than `audit.loss_rel` times the median gain of the part's
  other measured senders (only when that median is a gain). An update that was trained on
  its assignment lowers the loss there; a sign-flipped, inverted (IPM) or stale update
  raises it. The gain on a random batch is reported alongside and counted
  (`loss_assigned_above_random`), not judged.

A single reducer may be hostile, so a flag alone costs nothing. A finding against X is
*confirmed* once at least `audit.min_agreeing` distinct other reporters, and more than half
of the round's other contributors, flag X (any flag). Each part is a different slice of
X's update, so a real freeloader is flagged by every honest reducer, while a lying reducer
controls only its own part's report. A confirmed finding charges X `audit.rep_finding`
reputation once per round (the roster bans past `schedule.ban_reputation`). In a pair (one
other reducer) nothing can be confirmed with the default `min_agreeing = 2`: there a
reducer's word would be all the evidence.

Sketches enter X's history only from committed rounds, and only from reporters other than
X, so a re-run of an aborted attempt (which re-sends the same delta) is never a replay and
X cannot plant its own history. State is volatile (lost on a restart: the history starts
again), bounded by `MAX_WORKERS_WITH_HISTORY` workers, least recently audited dropped first.

Pure: no I/O, no clock.
"""

from __future__ import annotations

from collections import Counter, OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from bagel.protocol.messages import PartAudit, SenderAudit
from bagel.protocol.runspec import AuditSection

MAX_WORKERS_WITH_HISTORY = 20_000
MAX_FINDINGS_KEPT = 1_000
EXCHANGES_KEPT = 4  # per cell
FLAGS = ("excluded", "zero", "copy", "replay", "loss")


def _hamming(a: int, b: int) -> int:
    return (a ^ b).bit_count()


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else 0.5 * (s[n // 2 - 1] + s[n // 2])


@dataclass(frozen=True, slots=True)
class Finding:
    """A confirmed finding: who, in which round, and which flags from how many reporters."""

    cell_id: str
    round: int
    worker_id: str
    kinds: tuple[str, ...]
    reporters: int


@dataclass
class RoundAudit:
    """The flags of one exchange (cell, round, reduce_attempt), as its reports arrive."""

    cell_id: str
    round: int
    reduce_attempt: int
    contributors: tuple[str, ...]  # sorted: a reporter's part is its index here
    catch_up: frozenset[str]
    remembered: bool = False  # its sketches went into the history
    reporters: set[str] = field(default_factory=set)
    flags: dict[str, dict[str, set[str]]] = field(default_factory=dict)  # accused -> kind -> reporters
    sketches: dict[str, dict[int, int]] = field(default_factory=dict)  # sender -> block -> bits


def loss_flagged(gain: float, others: Sequence[float], loss_rel: float) -> bool:
    """The loss audit's rule: a slice whose gain (loss removed on the sender's own samples) is
    below -loss_rel x the median gain of the part's other measured senders, when that is positive."""
    if not others:
        return False
    med = _median(list(others))
    return med > 0 and gain < -loss_rel * med


class Auditor:
    """Reads each report's part audit, confirms findings on agreement, keeps the history."""

    def __init__(self, audit: AuditSection) -> None:
        self.a = audit
        # cell -> its last few exchanges audited, oldest first (a straggler's report of
        # the round before may come after the next round's first report)
        self.exchanges: dict[str, OrderedDict[tuple[int, int], RoundAudit]] = {}
        self.charged: dict[str, tuple[int, set[str]]] = {}  # cell -> (round, workers charged in it)
        self.history: OrderedDict[str, dict[int, deque[tuple[int, int]]]] = OrderedDict()
        self.counts: Counter[str] = Counter()
        self.findings: deque[Finding] = deque(maxlen=MAX_FINDINGS_KEPT)

    # ---------------------------------------------------------------- exchanges

    def exchange(
        self,
        cell_id: str,
        round: int,
        reduce_attempt: int,
        contributors: Iterable[str],
        catch_up: Iterable[str],
    ) -> RoundAudit:
        """The audit of this exchange, started if it is new. A cell moves past a round
        number only by committing it, so the first exchange of a later round makes the
        sketches of the earlier ones history (a commit the core made without a report in
        between, after a lost contributor say, counts too)."""
        ex = self.exchanges.setdefault(cell_id, OrderedDict())
        ra = ex.get((round, reduce_attempt))
        if ra is not None:
            return ra
        for old in ex.values():
            if old.round < round and not old.remembered:
                old.remembered = True
                self._remember(old)
        ra = RoundAudit(cell_id, round, reduce_attempt, tuple(sorted(contributors)), frozenset(catch_up))
        ex[(round, reduce_attempt)] = ra
        while len(ex) > EXCHANGES_KEPT:
            ex.popitem(last=False)
        return ra

    def latest(self, cell_id: str, round: int) -> RoundAudit | None:
        """The newest exchange audited of (cell, round), if any is still kept."""
        for ra in reversed(self.exchanges.get(cell_id, {}).values()):
            if ra.round == round:
                return ra
        return None

    def _remember(self, ra: RoundAudit) -> None:
        keep = self.a.replay_history
        for sender, blocks in ra.sketches.items():
            h = self.history.pop(sender, None)
            if h is None:
                h = {}
            for b, bits in blocks.items():
                q = h.get(b)
                if q is None:
                    q = h[b] = deque(maxlen=keep)
                q.append((ra.round, bits))
            self.history[sender] = h  # most recently audited last
        while len(self.history) > MAX_WORKERS_WITH_HISTORY:
            self.history.popitem(last=False)

    # ---------------------------------------------------------------- reports

    def report(self, ra: RoundAudit, reporter: str, audit: PartAudit) -> list[Finding]:
        """Take one reporter's part audit; the findings it newly confirms (each to charge once)."""
        self.counts["audits"] += 1
        if reporter in ra.reporters or reporter not in ra.contributors:
            self.counts["audits_ignored"] += 1  # a duplicate, or not a contributor of this exchange
            return []
        if ra.contributors.index(reporter) != audit.part:
            self.counts["audits_ignored"] += 1  # not the part it reduced
            return []
        ra.reporters.add(reporter)
        members = set(ra.contributors)
        entries = [s for s in audit.senders if s.sender in members]
        norms = {s.sender: s.norm for s in entries if not s.excluded}
        gains = {s.sender: s.loss_gain for s in entries if not s.excluded and s.loss_measured}
        out: list[Finding] = []
        for s in entries:
            x = s.sender
            if x == reporter or x in ra.catch_up:
                continue
            if s.sketch and not s.excluded:
                ra.sketches.setdefault(x, {}).update((audit.first_block + i, bits) for i, bits in enumerate(s.sketch))
            kinds = self._flags(ra, s, norms, audit.first_block, members) + self._loss_flags(s, gains)
            if not kinds:
                continue
            per = ra.flags.setdefault(x, {})
            for k in kinds:
                per.setdefault(k, set()).add(reporter)
                self.counts[f"flag_{k}"] += 1
            f = self._confirm(ra, x)
            if f is not None:
                out.append(f)
        return out

    def _flags(
        self, ra: RoundAudit, s: SenderAudit, norms: dict[str, float], first_block: int, members: set[str]
    ) -> list[str]:
        a = self.a
        if s.excluded:
            if s.excluded.startswith("abstained"):
                return []
            # the reducer's group screen names a near-zero part (robust/aggregation.py): a zero
            return ["zero"] if s.excluded.startswith("zero update") else ["excluded"]
        kinds = []
        others = [v for k, v in norms.items() if k != s.sender]
        if s.norm == 0.0 or (others and s.norm <= a.zero_rel * _median(others)):
            kinds.append("zero")
        if s.max_cosine >= a.copy_cosine and s.nearest in members and s.nearest != s.sender:
            kinds.append("copy")
        h = self.history.get(s.sender)
        if h and s.sketch:
            hits = 0
            for i, bits in enumerate(s.sketch):
                q = h.get(first_block + i)
                if q and any(rnd < ra.round and _hamming(bits, old) <= a.replay_bits for rnd, old in q):
                    hits += 1
            if 2 * hits > len(s.sketch):
                kinds.append("replay")
        return kinds

    def _loss_flags(self, s: SenderAudit, gains: dict[str, float]) -> list[str]:
        """The loss audit's flag: X's slice raises the loss on its own samples by more than
        loss_rel x the median gain of the other measured senders of the part."""
        if s.excluded or not s.loss_measured:
            return []
        self.counts["loss_measured"] += 1
        if s.loss_gain > s.loss_gain_random:
            self.counts["loss_assigned_above_random"] += 1
        others = [g for k, g in gains.items() if k != s.sender]
        return ["loss"] if loss_flagged(s.loss_gain, others, self.a.loss_rel) else []

    def _confirm(self, ra: RoundAudit, x: str) -> Finding | None:
        per = ra.flags.get(x, {})
        reporters = set().union(*per.values()) if per else set()
        voters = len(ra.contributors) - 1
        need = max(self.a.min_agreeing, voters // 2 + 1)
        if len(reporters) < need:
            return None
        rnd, done = self.charged.get(ra.cell_id, (-1, set()))
        if rnd != ra.round:
            rnd, done = ra.round, set()
            self.charged[ra.cell_id] = (rnd, done)
        if x in done:
            return None
        done.add(x)
        f = Finding(ra.cell_id, ra.round, x, tuple(k for k in FLAGS if k in per), len(reporters))
        self.counts["confirmed"] += 1
        for k in f.kinds:
            self.counts[f"confirmed_{k}"] += 1
        self.findings.append(f)
        return f


__all__ = ["FLAGS", "Auditor", "Finding", "RoundAudit", "loss_flagged"]
