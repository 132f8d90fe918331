"""The commit guard: a round whose new state's held-out loss jumps is not committed.

Pure parts (the median, the bound) and the core's behaviour through the harness: the
median of the agreeing reports is compared with the cell's last committed held-out loss
(or, with none, the reported base-state loss); a refused attempt aborts with the guard's
reason, charges nobody, and is re-run; a hostile minority of the agreeing reports can
neither force a refusal nor hide a jump; the reference survives a restart. The worker's
side (a real outer step and held-out evaluation) is in tests/test_guard_worker.py.
"""

from __future__ import annotations

import math

import pytest

from bagel.coordinator.core.errors import InvalidEvent
from bagel.coordinator.core.events import ReportRound
from bagel.coordinator.core.guard import CommitGuard, median
from bagel.coordinator.core.records import RoundState
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.runspec import GuardSection, SpecError, parse_spec
from bagel.protocol.validation import ValidationError, validate_report_round

from test_state_harness import Harness, h, make_spec, restored

CELL = "k0.r0"


def test_median_and_the_bound() -> None:
    assert median([]) == -1.0
    assert median([3.0, 1.0, 2.0]) == 2.0
    assert median([4.0, 1.0, 3.0, 2.0]) == 2.5
    g = CommitGuard(GuardSection(max_loss_ratio=2.0, abs_slack=0.05))
    assert g.judge(1.0, [2.05], []).ok  # exactly at the bound: committed
    refused = g.judge(1.0, [2.06], [])
    assert not refused.ok and "commit guard" in refused.reason and refused.reference == 1.0
    assert g.judge(0.001, [0.04], []).ok  # a tiny loss: the slack, not the ratio, decides
    # no reference yet: the base-state loss the same reports give is the reference
    assert not g.judge(-1.0, [3.0], [1.0]).ok and g.judge(-1.0, [1.5], [1.0]).ok
    # nothing measured, or no reference at all: not guarded
    assert g.judge(1.0, [], []).ok and g.judge(1.0, [-1.0], [-1.0]).loss == -1.0
    assert g.judge(-1.0, [9.0], []).ok
    assert CommitGuard(GuardSection(enabled=False)).judge(1.0, [1e9], []).ok


def test_median_resists_a_minority() -> None:
    """With f < n/2 of n values hostile the median stays between honest values."""
    g = CommitGuard(GuardSection())
    honest = [1.1, 1.1, 1.1]
    assert g.judge(1.0, honest + [1e12, 1e12], []).ok  # 2 of 5 scream: still committed
    assert not g.judge(1.0, [5.0, 5.0, 5.0, 0.0, 0.0], []).ok  # 2 of 5 hide a jump: refused


def three_members(**schedule: object) -> Harness:
    hz = Harness(spec=make_spec(quorum=0.5, **schedule))  # type: ignore[arg-type]
    for w in "abc":
        hz.reg(w)
    hz.hb("a")
    return hz


def play(hz: Harness, losses: dict[str, float], n: int, base: float | None = None) -> None:
    """Every member of the open round ready, then every contributor reports round n with its
    held-out loss (`losses[w]`, in that order first; others get the first value). Reports
    after the quorum or a refusal are late ones."""
    rnd = hz.round()
    assert rnd is not None and rnd.round == n
    for m in rnd.members:
        hz.ready(m.worker_id)
    rnd = hz.round()
    assert rnd is not None and rnd.state is RoundState.REDUCING and rnd.round == n
    ra, default = rnd.reduce_attempt, next(iter(losses.values()))
    order = [w for w in losses if w in rnd.contributors] + [w for w in rnd.contributors if w not in losses]
    for w in order:
        loss = losses.get(w, default)
        hz.report(w, h(n), round=n, reduce_attempt=ra, heldout_loss=loss, heldout_loss_base=base)


def test_a_jump_is_refused_and_charges_nobody() -> None:
    hz = three_members()
    play(hz, {"a": 1.0, "b": 1.0, "c": 1.0}, 1, base=1.5)
    assert hz.cell().committed_round == 1 and hz.cell().heldout_loss == 1.0
    assert hz.store.commits[-1].heldout_loss == 1.0
    reps = {w: hz.store.workers[w].reputation for w in "abc"}
    play(hz, {"a": 3.1, "b": 3.1, "c": 3.1}, 2, base=1.0)  # 3.1 > 2 x 1.0 + 0.05
    cell = hz.cell()
    assert cell.committed_round == 1 and cell.guard_refusals == 1
    aborted = hz.store.rounds[(CELL, 2, 1)]
    assert aborted.state is RoundState.ABORTED and aborted.reason.startswith("commit guard: held-out loss 3.1")
    assert {w: hz.store.workers[w].reputation for w in "abc"} == reps
    nxt = hz.round()
    assert nxt is not None and (nxt.round, nxt.attempt) == (2, 2)  # re-run at once
    # a re-run that does not jump commits, and becomes the next reference
    play(hz, {"a": 1.9, "b": 1.9, "c": 1.9}, 2, base=1.0)
    assert hz.cell().committed_round == 2 and hz.cell().heldout_loss == 1.9


def test_round_one_is_guarded_by_the_base_loss() -> None:
    hz = three_members()
    play(hz, {"a": 9.0, "b": 9.0, "c": 9.0}, 1, base=1.0)
    assert hz.cell().committed_round == 0 and hz.cell().guard_refusals == 1


def test_no_measurement_commits_unguarded() -> None:
    """Reports without held-out losses (an old worker, a simulator): committed; the
    reference becomes unknown, so the next round is judged by its base losses."""
    hz = three_members()
    for w in "abc":
        hz.ready(w)
    for w in "ab":
        hz.report(w, h(1))
    assert hz.cell().committed_round == 1 and hz.cell().heldout_loss == -1.0


def test_a_hostile_minority_cannot_hide_or_fake_a_jump() -> None:
    hz = Harness(spec=make_spec(quorum=0.5))
    for w in "abcde":
        hz.reg(w)
    hz.hb("a")
    play(hz, dict.fromkeys("abcde", 1.0), 1, base=1.0)
    assert hz.cell().heldout_loss == 1.0
    # d and e scream (a huge loss) about an honest round: it commits with the honest median
    play(hz, {"a": 1.1, "d": 1e12, "e": 1e12, "b": 1.1, "c": 1.1}, 2, base=1.0)
    assert hz.cell().committed_round == 2 and hz.cell().heldout_loss == 1.1
    # d and e claim all is well about a real jump: refused (the quorum is reached at the 3rd)
    play(hz, {"d": 0.0, "e": 0.0, "a": 7.0, "b": 7.0, "c": 7.0}, 3, base=1.1)
    assert hz.cell().committed_round == 2 and hz.cell().guard_refusals == 1


def test_a_single_member_cell_is_guarded_by_its_own_report() -> None:
    hz = Harness(spec=make_spec(quorum=0.5))
    hz.reg("solo")
    hz.hb("solo")
    play(hz, {"solo": 0.326}, 1, base=0.4)
    assert hz.cell().committed_round == 1
    play(hz, {"solo": 3.089}, 2, base=0.326)  # the jump of the 2-worker trial
    assert hz.cell().committed_round == 1 and hz.cell().guard_refusals == 1


def test_the_reference_survives_a_restart_and_a_rollback_forgets_it() -> None:
    hz = three_members(every_rounds=1)
    play(hz, dict.fromkeys("abc", 1.0), 1, base=1.0)
    hz.st = restored(hz)
    assert hz.st.cell_view(CELL)[0].heldout_loss == 1.0
    play(hz, dict.fromkeys("abc", 2.5), 2, base=1.0)
    assert hz.cell().committed_round == 1 and hz.cell().guard_refusals == 1


def test_a_guard_key_changes_the_spec_hash_and_bad_values_are_refused() -> None:
    base = '[run]\nid = "g"\n'
    a = parse_spec(base)
    b = parse_spec(base + "[guard]\nmax_loss_ratio = 3.0\nabs_slack = 0.1\neval_samples = 32\n")
    assert a.guard == GuardSection() and b.guard == GuardSection(True, 3.0, 0.1, 32)
    assert a.spec_hash != b.spec_hash
    for bad in ("max_loss_ratio = 0.5", "abs_slack = -1.0", "eval_samples = 0", "bogus = 1", "max_loss_ratio = nan"):
        with pytest.raises(SpecError):
            parse_spec(base + "[guard]\n" + bad + "\n")


@pytest.mark.parametrize("value", [math.nan, math.inf, -0.5])
def test_a_bad_heldout_loss_is_refused_by_validation_and_by_the_core(value: float) -> None:
    spec = make_spec()
    for field in ("heldout_loss", "heldout_loss_base"):
        req = pb.ReportRoundRequest(cell_id=CELL, round=1, state_hash=h(1), **{field: value})
        with pytest.raises(ValidationError) as e:
            validate_report_round(req, spec)
        assert e.value.field == field
    validate_report_round(pb.ReportRoundRequest(cell_id=CELL, round=1, state_hash=h(1), heldout_loss=0.0), spec)
    hz = three_members()
    for w in "abc":
        hz.ready(w)
    before = hz.st.snapshot()
    with pytest.raises(InvalidEvent):
        hz.apply(ReportRound("a", CELL, 1, state_hash=h(1), heldout_loss=value))
    assert hz.st.snapshot() == before


def test_the_guard_waits_for_every_report_then_the_deadline_judges() -> None:
    """With measurements, a quorum waits for the last live contributor (a minority that
    reports first must not decide the median); at the reduce deadline the reports there
    are decide."""
    hz = three_members()
    for w in "abc":
        hz.ready(w)
    rnd = hz.round()
    assert rnd is not None
    for w in "ab":
        hz.report(w, h(1), heldout_loss=1.0, heldout_loss_base=1.2)
    assert hz.cell().committed_round == 0 and hz.round().state is RoundState.REDUCING  # type: ignore[union-attr]
    hz.keepalive(rnd.reduce_deadline_ms + 1 if rnd.reduce_deadline_ms else hz.now + 60_000, "a", "b", "c")
    assert hz.cell().committed_round == 1 and hz.cell().heldout_loss == 1.0
