"""Exchange parts sized by measured uplinks: the weighted split, the uplink estimate the core
keeps from what the other contributors measured, the part weights of a frozen round (on the
wire, in the evidence check, through a restart), and the bounds on what a report may say.
All in-process and pure: milliseconds."""

from __future__ import annotations

import hashlib

import pytest
import torch

from bagel.compression import get_codec
from bagel.coordinator.core.errors import InvalidEvent
from bagel.coordinator.core.scheduler import PART_WEIGHT_CLAMP, part_weights
from bagel.coordinator.translate import report_event
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol import dataplane_pb2 as dp
from bagel.protocol.convert import member_from_pb, member_to_pb
from bagel.protocol.identity import Identity
from bagel.protocol.messages import Member, PeerAddress, PeerRate, PeerRates
from bagel.protocol.validation import ValidationError, validate_report_round
from bagel.robust.aggregation import get_reducer
from bagel.robust.evidence import (
    EvidenceRefuted,
    ForeignEvidence,
    adjudicate,
    parse_evidence,
    shadow_of,
    shadow_offset,
    sign_contribution,
    sign_receipt,
)
from bagel.robust.reduction import PartInput, group_digest_of, part_bounds, reduce_one_part, result_generator
from bagel.worker.parts import Contributor, group_digest, split_of

from test_state import CELL, freeze_all, start
from test_state_harness import Harness, h, restored

MB = 1 << 20


def equal_split(total: int, parts: int, skip: set[int]) -> list[tuple[int, int]]:
    """The split as it was before part weights (the first total % active parts one longer)."""
    skipped = skip if len(skip) < parts else set()
    active = parts - len(skipped)
    base, extra = divmod(total, active)
    out, start_, n = [], 0, 0
    for i in range(parts):
        if i in skipped:
            out.append((start_, start_))
            continue
        end = start_ + base + (1 if n < extra else 0)
        out.append((start_, end))
        start_, n = end, n + 1
    return out


def test_equal_weights_give_exactly_the_equal_split_and_unequal_ones_move_the_cuts() -> None:
    for total in (0, 1, 2, 7, 10, 1000, 12_345_679):
        for parts in range(1, 7):
            for skip in (set(), {0}, {parts - 1}, set(range(parts))):
                old = equal_split(total, parts, skip)
                assert part_bounds(total, parts, skip) == old
                assert part_bounds(total, parts, skip, [1] * parts) == old
                assert part_bounds(total, parts, skip, [5] * parts) == old  # only ratios matter
                assert part_bounds(total, parts, skip, [0] * parts) == old  # unset proto fields
    # unequal weights: largest remainder, contiguous, covering, ties to the lower position
    assert part_bounds(10, 3, (), [1, 2, 2]) == [(0, 2), (2, 6), (6, 10)]
    assert part_bounds(11, 3, (), [1, 2, 2]) == [(0, 2), (2, 7), (7, 11)]  # 2.2, 4.4, 4.4: one to position 1
    assert part_bounds(100, 4, {1}, [4, 9, 1, 1]) == [(0, 67), (67, 67), (67, 84), (84, 100)]
    b = part_bounds(1_000_003, 5, (), [64, 4, 16, 16, 3])
    assert b != equal_split(1_000_003, 5, set())
    assert b[0][0] == 0 and b[-1][1] == 1_000_003 and all(b[i][1] == b[i + 1][0] for i in range(4))
    sizes = [e - s for s, e in b]
    assert sizes[0] > sizes[2] == sizes[3] > sizes[1] > sizes[4] > 0
    with pytest.raises(ValueError, match="part weights"):
        part_bounds(10, 3, (), [1, 2])


def test_the_group_digest_binds_weights_and_leaves_weight_one_sets_as_they_were() -> None:
    plain = [Contributor("a", "pa", (), 5), Contributor("b", "pb", (), 5, True)]
    assert group_digest(plain) == group_digest_of([("a", "pa", 5), ("b", "pb", 5, True)])
    weighted = [Contributor("a", "pa", (), 5, False, 3), plain[1]]
    assert group_digest(weighted) != group_digest(plain)
    assert group_digest(weighted) == group_digest_of([("a", "pa", 5, False, 3), ("b", "pb", 5, True)])
    assert split_of(weighted, 100) == part_bounds(100, 2, {1}, [3, 1])
    assert split_of([Contributor("a", "pa", (), 5, False, 3), Contributor("b", "pb", (), 5, False, 1)], 8) == [
        (0, 6),
        (6, 8),
    ]
    # on the wire: 1 is written as unset (so an equal split's wire is unchanged), 0 reads as 1
    m = Member("a", PeerAddress("pa"), 5, part_weight=3)
    assert member_to_pb(m).part_weight == 3 and member_from_pb(member_to_pb(m)) == m
    assert member_to_pb(Member("a", PeerAddress("pa"), 5)).part_weight == 0
    assert member_from_pb(pb.Member(worker_id="a", part_weight=-7)).part_weight == 1
    assert member_from_pb(pb.Member(worker_id="a", part_weight=1 << 30)).part_weight == 1 << 16


def test_part_weights_follow_uplinks_clamped_around_the_median() -> None:
    ids = ("a", "b", "c", "d")
    assert part_weights(ids, {}) == dict.fromkeys(ids, 1)  # nothing measured: the equal split
    assert part_weights(ids, dict.fromkeys(ids, 7e6)) == dict.fromkeys(ids, 1)  # all alike: the same
    w = part_weights(ids, {"a": 10e6, "b": 10e6, "c": 1e6, "d": 1e9})
    assert w["a"] == w["b"] and w["d"] == PART_WEIGHT_CLAMP**2 * w["c"]  # clamped to [1/4, 4] x median
    w = part_weights(ids, {"a": 10e6, "b": 20e6, "c": 0.0})  # c and d unmeasured: the median, 15e6
    assert (w["a"], w["b"], w["c"], w["d"]) == (11, 21, 16, 16)  # 16 x (2/3, 4/3, 1, 1), rounded
    w = part_weights(ids, {"a": 10e6, "b": 1e6, "c": 10e6, "d": 10e6}, no_reduce={"a"})
    assert (w["a"], w["b"], w["c"], w["d"]) == (1, 1, 4, 4)  # relayed a: 1; b clamped to 1/4, then / gcd


def rates(**kw: float) -> PeerRates:
    """Peer rates of an 8 MiB contribution, each taking the given seconds."""
    return PeerRates.of((x, 8 * MB, int(s * 1000)) for x, s in kw.items())


def four(hz: Harness) -> None:
    start(hz, "a", "b", "c", "d")
    freeze_all(hz, "a", "b", "c", "d")


def test_the_uplink_estimate_comes_from_the_others_and_one_liar_cannot_move_it() -> None:
    hz = Harness()
    four(hz)
    roster = hz.st.roster
    # d is slow as a, b, c see it (8 MiB in 8 s per stream, 3 streams: 3 MiB/s); d itself
    # claims to be fast (its own claim never counts), and says a, b, c are slow (one liar)
    hz.report("a", h(1), round=1, reduce_attempt=1, peer_rates=rates(b=1, c=1, d=8))
    hz.report("b", h(1), round=1, reduce_attempt=1, peer_rates=rates(a=1, c=1, d=8))
    hz.report("c", h(1), round=1, reduce_attempt=1, peer_rates=rates(a=1, b=1, d=8, nobody=1))
    hz.report(
        "d",
        h(1),
        round=1,
        reduce_attempt=1,
        peer_rates=PeerRates.of((*rates(a=100, b=100, c=100), PeerRate("d", 8 * MB, 1))),
    )
    up = {x: roster.exchange_uplink(roster.workers[x]) for x in "abcd"}
    assert up["d"] == pytest.approx(3 * MB)  # the three honest observers
    assert up["a"] == up["b"] == up["c"] == pytest.approx(24 * MB)  # d's lie lies outside the median
    assert set(roster.workers["d"].uplink_seen) == {"a", "b", "c"}  # not its own claim
    assert "nobody" not in roster.workers
    # on a fresh start for b: a liar that inflates is bounded by the two honest figures, and
    # an observer whose own downlink bounded its stream (a home observer of a fast sender)
    # does not drag the estimate down while two others saw the sender's uplink
    quad = ("a", "b", "c", "d")
    for liar in (PeerRate("b", 1 << 40, 1000), PeerRate("b", 8 * MB, 100_000)):
        roster.workers["b"].uplink_seen.clear()
        roster.observe_peer_rates(roster.workers["a"], quad, rates(b=1))
        roster.observe_peer_rates(roster.workers["c"], quad, rates(b=1))
        roster.observe_peer_rates(roster.workers["d"], quad, PeerRates.of((liar,)))
        assert roster.exchange_uplink(roster.workers["b"]) == pytest.approx(24 * MB)
    roster.workers["b"].uplink_seen.pop("c")  # two observers: a liar can only lower it
    assert roster.exchange_uplink(roster.workers["b"]) < 24 * MB
    # an observer that reports again replaces its own figure: it cannot outvote the others
    for _ in range(3):
        roster.observe_peer_rates(roster.workers["d"], ("a", "b", "c", "d"), rates(a=1000))
    assert roster.exchange_uplink(roster.workers["a"]) == pytest.approx(24 * MB)
    # too short to be a bandwidth (latency): skipped
    roster.observe_peer_rates(roster.workers["a"], quad, PeerRates.of((("b", 1000, 5000), ("c", 8 * MB, 50))))
    assert roster.workers["b"].uplink_seen["a"] == roster.workers["c"].uplink_seen["a"] == pytest.approx(24 * MB)
    # a worker that is not a contributor of the exchange speaks of nobody
    roster.observe_peer_rates(roster.workers["a"], ("b", "c"), rates(b=1000))
    assert roster.workers["b"].uplink_seen["a"] == pytest.approx(24 * MB)


def test_the_next_freeze_sizes_parts_by_the_estimates_and_a_restart_gives_the_same_reduce() -> None:
    hz = Harness()
    four(hz)
    plain = hz.st.instruction_for("a")
    assert {m.part_weight for m in plain.contributors} == {1}  # nothing measured yet: equal parts
    assert [len(m) for m in hz.st.frozen_set(CELL, 1, 1, 1) or ()] == [3, 3, 3, 3]
    hz.report("a", h(1), round=1, reduce_attempt=1, peer_rates=rates(b=1, c=1, d=8))
    hz.report("b", h(1), round=1, reduce_attempt=1, peer_rates=rates(a=1, c=1, d=8))
    hz.report("c", h(1), round=1, reduce_attempt=1, peer_rates=rates(a=1, b=1, d=8))
    hz.report("d", h(1), round=1, reduce_attempt=1, peer_rates=rates(a=1, b=1, c=1))
    assert hz.cell().committed_round == 1
    freeze_all(hz, "a", "b", "c", "d")
    ins = hz.st.instruction_for("a")
    weights = {m.worker_id: m.part_weight for m in ins.contributors}
    assert weights == {"a": 4, "b": 4, "c": 4, "d": 1}  # d's uplink is 1/8 of the median: clamped to 1/4
    r = hz.round()
    assert r is not None and r.part_weights == {"a": 4, "b": 4, "c": 4}  # durable; a weight of 1 is not written
    frozen = hz.st.frozen_set(CELL, r.round, r.attempt, r.reduce_attempt)
    assert frozen is not None and [m[4] if len(m) > 4 else 1 for m in frozen] == [4, 4, 4, 1]  # type: ignore[misc]
    cs = [
        Contributor(m.worker_id, m.peer.peer_id, (), max(1, m.max_samples), m.no_reduce, m.part_weight)
        for m in ins.contributors
    ]
    assert group_digest(cs) == group_digest_of(frozen)  # what workers and the evidence check bind
    # a restarted coordinator answers the same REDUCE (soft estimates are gone, the plan is not)
    st2 = restored(hz)
    again = st2.instruction_for("a")
    assert again.order is ins.order and again.contributors == ins.contributors
    assert all(not w.uplink_seen for w in st2.roster.workers.values())


def test_malformed_peer_rates_are_refused_and_change_nothing() -> None:
    hz = Harness()
    four(hz)
    before = hz.st.snapshot()
    for bad in (
        (PeerRate("b", -1, 100),),
        (PeerRate("b", 1, -5),),
        (PeerRate("b", 1.5, 100),),  # type: ignore[arg-type]
        (PeerRate("", 1, 1),),
        (PeerRate("b", 1, 1), PeerRate("b", 2, 2)),
        tuple(PeerRate(f"x{i}", 1, 1) for i in range(257)),
    ):
        with pytest.raises(InvalidEvent, match="peer_rates"):
            hz.report("a", h(1), round=1, reduce_attempt=1, peer_rates=PeerRates.of(bad))
    with pytest.raises(InvalidEvent, match="peer_rates: columns"):  # ragged columns
        hz.report("a", h(1), round=1, reduce_attempt=1, peer_rates=PeerRates(("b", "c"), (1, 1), (1,)))
    assert hz.st.snapshot() == before
    assert not hz.st.roster.workers["b"].uplink_seen
    # the wire's own validation, with precise field names
    spec = hz.spec
    ok = pb.ReportRoundRequest(cell_id=CELL, round=1, state_hash=h(1))
    ok.peer_rates.add(worker_id="b", nbytes=8 * MB, ms=1000)
    validate_report_round(ok, spec)
    assert report_event("a", ok).peer_rates == PeerRates.of([("b", 8 * MB, 1000)])
    cases = {
        "peer_rates[0].nbytes": {"worker_id": "b", "nbytes": -1, "ms": 1},
        "peer_rates[0].ms": {"worker_id": "b", "nbytes": 1, "ms": 1 << 62},
        "peer_rates[0].worker_id": {"worker_id": "", "nbytes": 1, "ms": 1},
    }
    for field, kw in cases.items():
        req = pb.ReportRoundRequest(cell_id=CELL, round=1, state_hash=h(1))
        req.peer_rates.add(**kw)
        with pytest.raises(ValidationError) as e:
            validate_report_round(req, spec)
        assert e.value.field == field
    twice = pb.ReportRoundRequest(cell_id=CELL, round=1, state_hash=h(1))
    twice.peer_rates.add(worker_id="b", nbytes=1, ms=1)
    twice.peer_rates.add(worker_id="b", nbytes=1, ms=1)
    with pytest.raises(ValidationError, match="named twice"):
        validate_report_round(twice, spec)
    many = pb.ReportRoundRequest(cell_id=CELL, round=1, state_hash=h(1))
    for i in range(300):
        many.peer_rates.add(worker_id=f"w{i}", nbytes=1, ms=1)
    with pytest.raises(ValidationError, match="peer_rates"):
        validate_report_round(many, spec)


def test_the_evidence_check_cuts_the_weighted_split() -> None:
    """An honest reducer's receipt over a weighted split verifies (EvidenceRefuted): the check
    re-runs the part with the frozen set's weights. Were it to cut equal parts, every signed
    header's part_numel would disagree with it and an honest reducer would be convicted."""
    ids = sorted((Identity.generate() for _ in range(3)), key=lambda i: i.worker_id)
    weights = [1, 5, 2]
    members = [(x.worker_id, f"peer-{x.worker_id}", 10, False, w) for x, w in zip(ids, weights, strict=True)]
    total, codec, rule = 997, get_codec("fp32"), get_reducer("mean")
    bounds = part_bounds(total, 3, (), weights)
    assert bounds != part_bounds(total, 3)
    tag = dp.ExchangeTag(
        run_id="run", cell_id=CELL, round=1, round_attempt=1, reduce_attempt=1, group_digest=group_digest_of(members)
    )
    part = 1
    s, e = bounds[part]
    g = torch.Generator().manual_seed(0)
    headers, payloads = [], []
    for x in ids:
        payload = codec.encode(torch.randn(e - s, generator=g))
        hd = dp.ContributionHeader(
            tag=tag, sender=x.worker_id, part=part, num_parts=3, total_numel=total, part_numel=e - s,
            layout_digest="L", codec=codec.name, weight=10.0, payload_nbytes=len(payload),
            payload_sha256=hashlib.sha256(payload).digest(),
        )  # fmt: skip
        sign_contribution(x, hd)
        headers.append(hd)
        payloads.append(payload)
    inputs = [PartInput(x.worker_id, 10.0, 10, p) for x, p in zip(ids, payloads, strict=True)]
    digest = reduce_one_part(codec, rule, e - s, inputs, result_generator("run", CELL, 1, 1, 1, part)).digest
    primary = ids[part]
    receipt = dp.EvidenceReceipt(
        tag=tag, part=part, reducer=primary.worker_id, role=dp.EVIDENCE_ROLE_PRIMARY, result_sha256=digest,
        inputs=headers, reducer_rule=rule.spec(), codec=codec.name, total_numel=total, layout_digest="L",
    )  # fmt: skip
    blob, sig = sign_receipt(primary, receipt)
    req = pb.EvidenceRequest(
        receipt=blob,
        receipt_signature=sig,
        reducer_public_key=primary.public_key,
        inputs=[
            pb.EvidenceInput(contribution_header=hd.SerializeToString(deterministic=True), payload=p)
            for hd, p in zip(headers, payloads, strict=True)
        ],
    )
    accuser = ids[shadow_of(part, 3, shadow_offset(tag, 3))].worker_id
    judge = {"run_id": "run", "accuser": accuser, "codec": codec, "reducer": rule}
    with pytest.raises(EvidenceRefuted):
        adjudicate(parse_evidence(req), members=members, **judge)  # type: ignore[arg-type]
    with pytest.raises(ForeignEvidence):  # the same exchange without its weights is another set
        adjudicate(parse_evidence(req), members=[m[:3] for m in members], **judge)  # type: ignore[arg-type]
