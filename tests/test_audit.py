"""Audited contributions in the coordinator core: budgets and weights from what the
coordinator observed, self-signed lies, and reducers' findings (zero, copied, replayed,
excluded updates) that cost reputation only when most of the other reducers agree.

The part audits are computed by the real `robust/audit.py` from tensors, and the Byzantine
figures and deltas by the real worker functions (`roundwork.corrupt`, `roundwork.claimed`).
"""

from __future__ import annotations

import torch

from bagel.coordinator.core.audit import Auditor
from bagel.coordinator.core.records import WorkerState
from bagel.coordinator.core.scheduler import plausible_speeds
from bagel.protocol.messages import Order, PartAudit, SenderAudit
from bagel.protocol.runspec import AuditSection
from bagel.robust.audit import hamming, part_audit
from bagel.worker.roundwork import LIAR_SAMPLES_PER_S, claimed, corrupt

from test_state_harness import Harness, h, make_spec

CELL = "k0.r0"
TOTAL = 4096
BLOCKS = 32


# ---------------------------------------------------------------- budgets


def test_plausible_speeds_bound_a_liar_by_the_others_median() -> None:
    out = plausible_speeds([100.0, 120.0, 80.0, 1e9], max_speedup=8.0, cap=5000.0)
    assert out[:3] == [100.0, 120.0, 80.0]
    assert out[3] == 8.0 * 100.0  # 8 x the median of the other three
    assert plausible_speeds([1e9], 8.0, 5000.0) == [5000.0]  # alone: only the run's bound


def test_a_claimed_1e9_samples_per_s_does_not_take_the_rounds_budget() -> None:
    hz = Harness()
    for w in ("a", "b", "c"):
        hz.reg(w, speed=100.0)
    hz.reg("liar", speed=LIAR_SAMPLES_PER_S)
    assert hz.store.workers["liar"].profile.samples_per_s[CELL] == hz.spec.audit.max_samples_per_s
    hz.hb("a")
    r = hz.round()
    assert r is not None
    caps = {m.worker_id: m.max_samples for m in r.members}
    share = caps["liar"] / sum(caps.values())
    # unclamped it took 1e9 / (1e9 + 300) of the batch; now at most 8x an honest member
    assert share < 0.75 and caps["liar"] <= 8 * min(caps[w] for w in "abc") + 16, caps


def test_credit_comes_from_the_time_the_coordinator_saw() -> None:
    """A lone member that says READY 100 ms after its TRAIN is credited what the run's bound
    allows in 100 ms, whatever it claims, and earns no reputation: nobody audited it."""
    hz = Harness()
    hz.reg("solo", speed=100.0)
    out = hz.hb("solo")
    assert out.instruction is not None and out.instruction.order is Order.TRAIN
    budget = out.instruction.plan.micro_batch * out.instruction.plan.grad_accum * out.instruction.plan.inner_steps
    hz.advance(50)  # + 50 ms in Harness.ready
    hz.ready("solo", samples=budget)
    ins = hz.st.instruction_for("solo")
    assert ins.order is Order.REDUCE
    credited = {m.worker_id: m.max_samples for m in ins.contributors}["solo"]
    assert credited == int(hz.spec.audit.max_samples_per_s * 0.1) < budget
    assert hz.report("solo", h(1)).verdict.name == "COMMITTED"
    assert hz.store.commits[-1].samples == credited
    assert hz.store.workers["solo"].reputation == 0.0  # an unaudited commit earns nothing


def test_the_throughput_estimate_is_the_span_the_coordinator_saw_clamped_by_the_others() -> None:
    """Three members at 100 samples/s; after a 6 s span each is credited its budget and its
    estimate moves towards budget / 6 s; one that claims a READY after 3 s (not training)
    is credited half the span's worth at most and can never be estimated above 8x the median."""
    hz = Harness()
    _cell_of_three_and(hz, "fast")
    caps = {m.worker_id: m.max_samples for m in hz.round().members}
    hz.advance(2_950)  # + 50 ms in Harness.ready: a 3 s span for "fast"
    hz.ready("fast")
    hz.advance(2_950)
    for w in ("a", "b"):
        hz.ready(w)
    budgets = {m.worker_id: m.max_samples for m in hz.st.instruction_for("a").contributors}
    assert budgets == caps  # 5000 samples/s x 3 s covers every budget
    est = {w: hz.store.workers[w].throughput[CELL] for w in ("a", "b", "fast")}
    a = hz.st.policy.throughput_ema
    assert abs(est["a"] - ((1 - a) * 100 + a * caps["a"] / 6.0)) < 1e-6  # TRAIN at the open, READY 6 s on
    assert est["fast"] > est["a"]
    assert est["fast"] <= (1 - a) * 100 + a * 8 * 100  # the others' median bounds what is believed


def _cell_of_three_and(hz: Harness, other: str) -> None:
    for w in ("a", "b", other):
        hz.reg(w, speed=100.0)
    hz.hb("a")


def test_a_budget_liars_own_signed_figures_get_it_banned() -> None:
    """budget-liar reports the samples and time `roundwork.claimed` makes up: more samples
    than its budget is a lie it signed itself; it is banned by its second round."""
    hz = Harness()
    _cell_of_three_and(hz, "liar")
    for n in (1, 2, 3):
        ids = [w for w in ("liar", "a", "b") if hz.store.workers[w].state is WorkerState.ACTIVE]
        for w in ids:  # members of this round
            if hz.st.instruction_for(w).order is Order.TRAIN:
                hz.ready(w)
        frozen = {w: hz.st.instruction_for(w) for w in ids}
        for w in ids:  # the liar reports first: counted before the quorum commits
            ins = hz.st.instruction_for(w)
            if ins.order is not Order.REDUCE:
                ins = frozen[w]  # one that reports after the quorum: the next round waits for it
                if ins.order is not Order.REDUCE or hz.cell().committed_round != ins.round:
                    continue
            p = ins.plan
            honest = p.micro_batch * p.grad_accum * p.inner_steps
            samples, compute_ms = claimed("budget-liar" if w == "liar" else "", honest, 6_400)
            kw = {"round": ins.round, "reduce_attempt": ins.reduce_attempt}
            hz.report(w, h(n), samples=samples, compute_ms=compute_ms, **kw)
        if hz.store.workers["liar"].state is WorkerState.BANNED:
            break
    liar = hz.store.workers["liar"]
    assert liar.state is WorkerState.BANNED and n <= 2, (n, liar)
    assert "budget" in liar.reason
    assert all(hz.store.workers[w].state is WorkerState.ACTIVE for w in "ab")
    assert hz.st.auditor.counts["lies"] == 2


def test_a_claimed_compute_time_is_not_judged() -> None:
    """compute_ms feeds nothing: budgets come from the span the core saw, so a report of 1 ms
    costs nothing (and an honest first round, mostly model building, is never charged)."""
    hz = Harness()
    _cell_of_three_and(hz, "c")
    hz.advance(20_000)
    for w in ("a", "b", "c"):
        hz.ready(w)
    est = hz.store.workers["a"].throughput[CELL]
    hz.report("a", h(1), compute_ms=1)
    hz.report("b", h(1), compute_ms=19_000)
    assert hz.store.workers["a"].reputation == hz.store.workers["b"].reputation >= 0
    assert hz.store.workers["a"].throughput[CELL] == est  # not 1e5 samples/s
    assert hz.st.auditor.counts["lies"] == 0


# ---------------------------------------------------------------- the auditor alone


def _audits(contribs: dict[str, torch.Tensor], excluded: dict[str, str] | None = None) -> dict[str, PartAudit]:
    """What each contributor reports as the reducer of its part (real robust/audit.py)."""
    names = sorted(contribs)
    n = len(names)
    out = {}
    for j, reducer in enumerate(names):
        s, e = j * TOTAL // n, (j + 1) * TOTAL // n
        acc = {x: contribs[x][s:e] for x in names if x not in (excluded or {})}
        out[reducer] = part_audit("run", j, s, TOTAL, BLOCKS, acc, excluded or {})
    return out


def _honest(seed: int, n: int = 5) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(TOTAL, generator=g)
    return {f"w{i}": 0.7 * common + torch.randn(TOTAL, generator=g) for i in range(n)}


def _feed(
    au: Auditor, rnd: int, audits: dict[str, PartAudit], catch_up: tuple[str, ...] = (), attempt: int = 1
) -> list:
    ra = au.exchange(CELL, rnd, attempt, sorted(audits), catch_up)
    out = []
    for reporter in sorted(audits):
        out += au.report(ra, reporter, audits[reporter])
    return out


def test_honest_rounds_confirm_nothing() -> None:
    au = Auditor(AuditSection())
    for rnd in range(1, 21):
        assert _feed(au, rnd, _audits(_honest(rnd))) == []
    assert au.counts["confirmed"] == 0 and au.counts["audits"] == 100
    assert not any(k.startswith("flag_") and v for k, v in au.counts.items()), au.counts


def test_zero_replayed_and_copied_updates_are_confirmed_by_the_other_reducers() -> None:
    au = Auditor(AuditSection())
    first = _honest(100)
    _feed(au, 1, _audits(first))
    d = _honest(101)
    d["w1"] = corrupt({"x": d["w1"]}, "freeload-zero", None)["x"]
    d["w2"] = corrupt({"x": d["w2"]}, "freeload-replay", None, {"x": first["w2"]})["x"]
    d["w3"] = d["w0"].clone()  # a copy (both ends of the pair are flagged)
    found = {f.worker_id: f.kinds for f in _feed(au, 2, _audits(d))}
    assert "zero" in found["w1"] and "replay" in found["w2"] and "copy" in found["w3"], found
    assert found["w0"] == ("copy",)
    assert "w4" not in found


def test_one_hostile_reducer_cannot_get_an_honest_sender_charged() -> None:
    """The reducer w0 reports every other sender as zero, excluded and a copy, every round."""
    for n in (3, 4, 5, 8):
        au = Auditor(AuditSection())
        for rnd in range(1, 6):
            audits = _audits(_honest(rnd, n))
            senders = tuple(
                SenderAudit(s.sender, 0.0, 1.0, "w1" if s.sender != "w1" else "w2", "zero norm", s.sketch)
                for s in audits["w0"].senders
            )
            audits["w0"] = PartAudit(0, audits["w0"].first_block, senders)
            assert _feed(au, rnd, audits) == [], n
        assert au.counts["flag_excluded"] > 0  # its flags were read, and agreed with by nobody


def test_a_pair_confirms_nothing_and_abstentions_and_catch_up_are_no_findings() -> None:
    au = Auditor(AuditSection())
    d = _honest(7, 2)
    d["w1"] = torch.zeros(TOTAL)
    assert _feed(au, 1, _audits(d)) == []  # only w0 saw it: one reducer's word is not enough
    d = _honest(8, 4)
    assert _feed(au, 2, _audits(d, excluded={"w3": "abstained (non-finite delta or no samples)"})) == []
    d = _honest(9, 4)
    d["w2"] = torch.zeros(TOTAL)
    assert _feed(au, 3, _audits(d), catch_up=("w2",)) == []


def test_a_rerun_of_the_same_delta_after_an_abort_is_not_a_replay() -> None:
    au = Auditor(AuditSection())
    d = _honest(11)
    ra = au.exchange(CELL, 1, 1, sorted(d), ())
    for r, a in _audits(d).items():
        au.report(ra, r, a)
    # aborted: attempt 2 of the same round re-sends the kept deltas
    assert _feed(au, 1, _audits(d), attempt=2) == []
    assert au.counts["audits"] == 10 and au.counts["audits_ignored"] == 0
    assert _feed(au, 2, _audits(_honest(12))) == []
    assert au.counts.get("flag_replay", 0) == 0
    # while a replay of that round's delta in the next round is one
    assert {f.worker_id for f in _feed(au, 3, _audits(d))} == set(d)


def test_a_reporter_naming_another_part_or_reporting_twice_is_ignored() -> None:
    au = Auditor(AuditSection())
    audits = _audits(_honest(13, 3))
    ra = au.exchange(CELL, 1, 1, sorted(audits), ())
    wrong = PartAudit(2, audits["w0"].first_block, audits["w0"].senders)
    assert au.report(ra, "w0", wrong) == [] and au.counts["audits_ignored"] == 1
    au.report(ra, "w1", audits["w1"])
    au.report(ra, "w1", audits["w1"])
    assert au.counts["audits_ignored"] == 2


def test_sketches_tell_a_replay_from_a_fresh_update() -> None:
    g = torch.Generator().manual_seed(3)
    x = torch.randn(TOTAL, generator=g)
    noisy = x + 0.01 * x.abs().max() * (torch.rand(TOTAL, generator=g) - 0.5)  # int8-like codec noise
    a = part_audit("run", 0, 0, TOTAL, BLOCKS, {"s": x}, {}).senders[0].sketch
    b = part_audit("run", 0, 0, TOTAL, BLOCKS, {"s": noisy}, {}).senders[0].sketch
    c = part_audit("run", 0, 0, TOTAL, BLOCKS, {"s": 0.7 * x + torch.randn(TOTAL, generator=g)}, {}).senders[0].sketch
    assert len(a) == BLOCKS
    assert max(hamming(p, q) for p, q in zip(a, b, strict=True)) <= AuditSection().replay_bits
    assert sum(hamming(p, q) for p, q in zip(a, c, strict=True)) / BLOCKS > 8


# ---------------------------------------------------------------- through the state


def test_a_zero_freeloader_is_banned_through_reports_and_honest_members_are_not() -> None:
    """Four members; `fz` sends zeros. Every report carries its reducer's audit of the part
    it reduced; the state charges fz once per round and bans it by its second round."""
    hz = Harness(make_spec())
    ids = ["a", "b", "c", "fz"]
    for w in ids:
        hz.reg(w, speed=100.0)
    hz.hb("a")
    banned_at = 0
    for rnd in range(1, 6):
        live = [w for w in ids if hz.store.workers[w].state is WorkerState.ACTIVE]
        for w in live:  # this round's members (a late reporter of the last one joins the next)
            if hz.st.instruction_for(w).order is Order.SYNC:
                hz.sync(w)
            if hz.st.instruction_for(w).order is Order.TRAIN:
                hz.ready(w)
        reducing = [w for w in live if hz.st.instruction_for(w).order is Order.REDUCE]
        contributors = [m.worker_id for m in hz.st.instruction_for(reducing[0]).contributors]
        d = _honest(rnd, len(contributors))
        d = {w: d[f"w{i}"] for i, w in enumerate(contributors)}
        if "fz" in d:
            d["fz"] = corrupt({"x": d["fz"]}, "freeload-zero", None)["x"]
        audits = _audits(d)
        attempt = hz.st.instruction_for(reducing[0]).reduce_attempt
        for w in sorted(contributors, key=lambda x: x != "fz"):  # fz first: in the quorum, not a straggler
            if hz.store.workers[w].state is WorkerState.ACTIVE:
                hz.report(w, h(rnd), audit=audits[w], round=rnd, reduce_attempt=attempt)
        if hz.store.workers["fz"].state is WorkerState.BANNED and not banned_at:
            banned_at = rnd
    assert banned_at == 2, hz.store.workers["fz"]
    assert "zero" in hz.store.workers["fz"].reason
    assert all(hz.store.workers[w].state is WorkerState.ACTIVE for w in "abc")
    assert all(hz.store.workers[w].reputation >= 0 for w in "abc")
    assert hz.st.auditor.counts["confirmed"] == 2
    assert not any(f.worker_id in ("a", "b", "c") for f in hz.st.auditor.findings)


def test_the_freeloader_scenarios_parse() -> None:
    from pathlib import Path

    from bagel.sim.chaos.scenario import load_chaos_scenario

    root = Path(__file__).resolve().parent.parent / "sim" / "scenarios"
    fl = load_chaos_scenario(root / "freeloaders.toml")
    assert sorted(fl.byzantine.values()) == ["budget-liar", "freeload-replay", "freeload-zero"]
    honest = load_chaos_scenario(root / "audit-honest.toml")
    assert not honest.byzantine and honest.settle_commits == 50
    mixed = load_chaos_scenario(root / "audit-honest-mixed.toml")
    assert not mixed.byzantine and mixed.settle_commits == 50
    assert [mixed.throttle_of(i) for i in range(4)] == [1.0, 1.5, 2.0, 3.0]
    for sc in (fl, honest, mixed):
        assert len(sc.spec.cell_ids) == 1  # one shared cell: everyone audits everyone


def test_a_report_audit_is_validated_field_by_field() -> None:
    import pytest

    from bagel.protocol import bagel_pb2 as pb
    from bagel.protocol.convert import audit_from_pb, audit_to_pb
    from bagel.protocol.validation import ValidationError, validate

    spec = make_spec()  # 32 sketch blocks
    good = PartAudit(1, 30, (SenderAudit("wa", 1.5, 0.2, "wb", "", (1, 2)), SenderAudit("wb", excluded="zero norm")))

    def req(a: PartAudit) -> pb.ReportRoundRequest:
        r = pb.ReportRoundRequest(cell_id=CELL, round=3, state_hash=h(3), samples=10)
        r.audit.CopyFrom(audit_to_pb(a))
        return r

    validate("ReportRound", req(good), spec)
    assert audit_from_pb(req(good).audit) == good
    s0 = good.senders[0]
    bad = {
        "audit.part": PartAudit(256, 0, ()),
        "audit.first_block": PartAudit(0, 32, ()),
        "audit.senders": PartAudit(0, 0, tuple(SenderAudit(f"w{i}") for i in range(257))),
        "audit.senders[1].sender": PartAudit(0, 0, (s0, s0)),
        "audit.senders[0].norm": PartAudit(0, 0, (SenderAudit("wa", float("nan")),)),
        "audit.senders[0].max_cosine": PartAudit(0, 0, (SenderAudit("wa", 1.0, 1.5),)),
        "audit.senders[0].sketch": PartAudit(0, 31, (SenderAudit("wa", 1.0, sketch=(1, 2)),)),
        "audit.senders[0].excluded": PartAudit(0, 0, (SenderAudit("wa", excluded="x" * 600),)),
    }
    for field, a in bad.items():
        with pytest.raises(ValidationError) as e:
            validate("ReportRound", req(a), spec)
        assert e.value.field == field, (field, e.value)


def _credit_after_an_overlapped_exchange(overlap: str) -> tuple[int, int, int]:
    """A lone member trains round 1, exchanges for 200 ms, and says READY in round 2 100 ms
    after its TRAIN (its first steps were trained during the exchange): what round 2
    credits it, its budget, and what 100 ms alone would allow."""
    from dataclasses import replace

    from bagel.protocol.messages import Phase

    spec = make_spec()
    spec = replace(spec, diloco=replace(spec.diloco, overlap=overlap))
    hz = Harness(spec)
    hz.reg("solo", speed=100.0)
    hz.hb("solo")
    hz.advance(2_000)
    hz.ready("solo")
    assert hz.st.instruction_for("solo").order is Order.REDUCE
    hz.advance(200)  # the exchange, while the GPU trains round 2 ahead
    assert hz.report("solo", h(1)).verdict.name == "COMMITTED"
    hz.hb("solo", Phase.IDLE)
    out = hz.hb("solo", Phase.IDLE)
    assert out.instruction is not None and out.instruction.order is Order.TRAIN and out.instruction.round == 2
    p = out.instruction.plan
    budget = p.micro_batch * p.grad_accum * p.inner_steps
    hz.advance(50)  # + 50 ms in Harness.ready
    hz.ready("solo", samples=budget)
    ins = hz.st.instruction_for("solo")
    assert ins.order is Order.REDUCE
    credited = {m.worker_id: m.max_samples for m in ins.contributors}["solo"]
    return credited, budget, int(hz.spec.audit.max_samples_per_s * 0.1)


def test_with_overlap_the_credit_span_starts_at_the_freeze_of_the_round_before() -> None:
    """With overlap the steps of round n + 1 begin at round n's freeze, so an honest member
    that is READY moments after the TRAIN is credited for the time since that freeze (here
    its whole budget), and without overlap by the 100 ms span alone, as before."""
    credited, budget, by_100ms = _credit_after_an_overlapped_exchange("delayed")
    assert credited == budget > by_100ms
    credited, budget, by_100ms = _credit_after_an_overlapped_exchange("off")
    assert credited == by_100ms < budget
