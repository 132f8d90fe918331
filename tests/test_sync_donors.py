"""The coordinator core names several donors for a sync: by expected bandwidth and load,
deterministically, sticky, released when the joiner is synced; the run-spec key and the
instruction's wire form."""

from __future__ import annotations

from dataclasses import replace

import pytest

from bagel.coordinator.core.events import Leave
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.convert import instruction_from_pb, instruction_to_pb
from bagel.protocol.messages import Donor, DonorRate, Instruction, LocalState, Order, PeerAddress, Phase
from bagel.protocol.runspec import MAX_SYNC_DONORS, SpecError, SyncSection, parse_spec

from test_state_harness import Harness, h, make_spec

MB = 1e6
# uplinks of the four holders of round 1, bytes/s
UPLINKS = {"a": 10 * MB, "b": 40 * MB, "c": 20 * MB, "d": 30 * MB}


def cell_of_four(max_donors: int = 3) -> Harness:
    """a..d (uplinks UPLINKS) commit round 1 of the one cell; nobody else is registered."""
    hz = Harness(replace(make_spec(), sync=SyncSection(max_donors=max_donors)))
    for w, bw in UPLINKS.items():
        hz.reg(w, bw=bw)
    hz.hb("a")
    for w in UPLINKS:
        hz.ready(w)
    for w in UPLINKS:
        hz.report(w, h(1), round=1, reduce_attempt=1)
    assert hz.cell().committed_round == 1
    return hz


def named(hz: Harness, wid: str) -> list[tuple[str, float]]:
    ins = hz.st.instruction_for(wid)
    assert ins.order is Order.SYNC and ins.donor is not None
    assert ins.donors and ins.donors[0] == ins.donor  # the single field is the best donor
    return [(d.worker_id, d.expected_bytes_per_s) for d in ins.donors]


def test_k_donors_by_bandwidth_then_load() -> None:
    hz = cell_of_four()
    hz.reg("x")
    # the three fastest, fastest first, each expected to give its whole uplink
    assert named(hz, "x") == [("b", 40 * MB), ("d", 30 * MB), ("c", 20 * MB)]
    assert named(hz, "x") == named(hz, "x")  # sticky: every heartbeat sees the same list
    hz.reg("y")
    # b, d and c now serve x: b 40/2 = 20, d 30/2 = 15, c 20/2 = 10 against a's free 10 (a
    # and c tie at 10 MB/s; the pair hash orders them); x's figures are shared now too
    y = named(hz, "y")
    assert y[:2] == [("b", 20 * MB), ("d", 15 * MB)]
    assert sorted(y[2:]) in ([("a", 10 * MB)], [("c", 10 * MB)])
    assert named(hz, "x")[0] == ("b", 20 * MB)
    assert y[2] == ("a", 10 * MB)  # (what the pair hash says here)
    # x syncs: its load is released, and it is a holder itself (50 MB/s, the harness default):
    # z gets x, then b (40/2, shared with y) and c (20/1, free again) before d (30/2)
    hz.sync("x")
    assert hz.st.instruction_for("x").order is not Order.SYNC
    hz.reg("z")
    z = named(hz, "z")
    assert z[0] == ("x", 50 * MB) and sorted(z[1:]) == [("b", 20 * MB), ("c", 20 * MB)]
    # the same events give the same choices: nothing but the events decides
    again = cell_of_four()
    again.reg("x")
    again.reg("y")
    assert named(again, "y") == y


def test_a_donor_that_leaves_is_replaced_and_its_load_released() -> None:
    hz = cell_of_four(max_donors=2)
    hz.reg("x")
    assert [d for d, _ in named(hz, "x")] == ["b", "d"]
    hz.apply(Leave("b"))
    assert [d for d, _ in named(hz, "x")] == ["d", "c"]  # re-chosen among the holders left
    c = hz.st.roster.cells[hz.spec.cell_ids[0]]
    assert c.donor_load == {"d": 1, "c": 1}


def test_fewer_holders_than_max_donors_and_none_at_all() -> None:
    hz = cell_of_four(max_donors=MAX_SYNC_DONORS)
    hz.reg("x")
    assert [d for d, _ in named(hz, "x")] == ["b", "d", "c", "a"]  # every holder, none twice, not x
    # one donor: the single-donor path, the same list of one
    one = cell_of_four(max_donors=1)
    one.reg("x")
    assert named(one, "x") == [("b", 40 * MB)]
    # (no live holder: the checkpoint, worker id "" and no list; tests/test_state.py's orphan tests)


def test_max_donors_is_validated() -> None:
    base = "[run]\nid = 'r'\n"
    assert parse_spec(base).sync.max_donors == 4
    assert parse_spec(base + "[sync]\nmax_donors = 1\n").sync.max_donors == 1
    for bad in ("0", "-1", str(MAX_SYNC_DONORS + 1)):
        with pytest.raises(SpecError, match="sync.max_donors"):
            parse_spec(base + f"[sync]\nmax_donors = {bad}\n")
    with pytest.raises(SpecError):
        parse_spec(base + "[sync]\nmax_donor = 2\n")  # unknown key


def test_donors_on_the_wire() -> None:
    ds = tuple(Donor(f"w{i}", PeerAddress(f"p{i}", ("/ip4/10.0.0.1/tcp/1",)), 3, 1e6 * (i + 1)) for i in range(3))
    ins = Instruction(Order.SYNC, "k0.r0", 5, 4, h(4), donor=ds[0], donors=ds)
    assert instruction_from_pb(instruction_to_pb(ins)) == ins
    # an old coordinator sends only `donor`: no list; a hostile one: at most MAX_SYNC_DONORS
    # are read, and a figure that is not a positive finite number reads as unknown
    old = instruction_to_pb(replace(ins, donors=()))
    assert instruction_from_pb(old).donors == ()
    p = pb.Instruction()
    p.CopyFrom(old)
    for i in range(MAX_SYNC_DONORS + 5):
        p.donors.add(worker_id=f"w{i}", expected_bytes_per_s=float("nan") if i % 2 else -1.0)
    got = instruction_from_pb(p).donors
    assert len(got) == MAX_SYNC_DONORS and {d.expected_bytes_per_s for d in got} == {0.0}


def test_measured_rates_rank_donors_and_a_claim_never_buys_a_rank() -> None:
    hz = cell_of_four(max_donors=2)
    roster = hz.st.roster
    hz.reg("x", bw=200 * MB)  # its own link is fast: its donors bound what it got
    assert [d for d, _ in named(hz, "x")] == ["b", "d"]
    ins = hz.st.instruction_for("x")
    synced = LocalState(ins.cell_id, ins.committed_round, ins.committed_hash)
    rates = (
        DonorRate("b", 8_000_000, 2000),  # b declared 40 MB/s and gave 4 MB/s
        DonorRate("d", 200_000_000, 2000),  # d claims 100 MB/s through x, above the 30 it declared
        DonorRate("c", 80_000_000, 2000),  # c was not x's donor: not read
        DonorRate("nobody", 80_000_000, 2000),
    )
    hz.hb("x", Phase.IDLE, local=synced, donor_rates=rates)
    assert roster.workers["b"].uplink_measured == 4 * MB
    assert roster.workers["d"].uplink_measured == 100 * MB
    assert roster.workers["c"].uplink_measured == 0.0
    assert roster.donor_bandwidth(roster.workers["b"]) == 4 * MB
    assert roster.donor_bandwidth(roster.workers["d"]) == 30 * MB  # never above the declared figure
    assert roster.workers["x"].donors == ()  # the report ended x's download
    # a repeated report is not read again: its donors are released
    hz.hb("x", Phase.IDLE, local=synced, donor_rates=(DonorRate("b", 80_000_000, 2000),))
    assert roster.workers["b"].uplink_measured == 4 * MB
    # the next joiner: b, the fastest by its claim, now ranks last
    hz.reg("z", bw=0.0)  # declares nothing
    assert [d for d, _ in named(hz, "z")] == ["x", "d"]  # x holds it now, at its 200 MB/s
    hz.apply(Leave("x"))
    hz.apply(Leave("d"))
    assert [d for d, _ in named(hz, "z")] == ["c", "a"]  # b (4 MB/s measured) below a (10 declared)


def test_short_transfers_are_not_measurements_and_the_ema_moves_part_way() -> None:
    hz = cell_of_four(max_donors=1)
    roster = hz.st.roster

    def sync_from_b(joiner: str, rate: DonorRate, link: float = 100 * MB) -> None:
        hz.reg(joiner, bw=link)
        assert [d for d, _ in named(hz, joiner)] == ["b"]
        ins = hz.st.instruction_for(joiner)
        hz.hb(joiner, Phase.IDLE, local=LocalState(ins.cell_id, 1, ins.committed_hash), donor_rates=(rate,))
        hz.apply(Leave(joiner))  # the next joiner finds b the fastest holder again

    sync_from_b("x", DonorRate("b", 1 << 30, 100))  # 100 ms: latency, not bandwidth
    sync_from_b("y", DonorRate("b", 1000, 5000))  # 1 kB: the same
    sync_from_b("v", DonorRate("b", 36_000_000, 1000), link=40 * MB)  # its own 40 MB/s link bounded it
    sync_from_b("s", DonorRate("b", 36_000_000, 1000), link=0.0)  # a link it did not declare: unknown
    assert roster.workers["b"].uplink_measured == 0.0
    sync_from_b("p", DonorRate("b", 35_000_000, 1000))  # 35 MB/s: still above d's 30
    assert roster.workers["b"].uplink_measured == 35 * MB
    sync_from_b("q", DonorRate("b", 45_000_000, 1000))  # 45 MB/s
    a = roster.policy.throughput_ema
    assert 0 < a < 1
    assert roster.workers["b"].uplink_measured == pytest.approx((1 - a) * 35 * MB + a * 45 * MB)
    assert roster.donor_bandwidth(roster.workers["b"]) == roster.workers["b"].uplink_measured  # below its 40


def test_donor_rates_on_the_wire_are_bounded() -> None:
    from bagel.protocol.validation import ValidationError, validate_heartbeat

    spec = make_spec()
    ok = pb.HeartbeatRequest(phase=pb.PHASE_IDLE)
    ok.donor_rates.add(worker_id="b", nbytes=8_000_000, ms=2000)
    validate_heartbeat(ok, spec)
    from bagel.coordinator.translate import heartbeat_event

    assert heartbeat_event("x", ok).donor_rates == (DonorRate("b", 8_000_000, 2000),)
    bad: list[pb.HeartbeatRequest] = []
    for kw in (
        {"worker_id": "", "nbytes": 1, "ms": 1},
        {"worker_id": "b", "nbytes": -1, "ms": 1},
        {"worker_id": "b", "nbytes": 1, "ms": -5},
        {"worker_id": "b" * 65, "nbytes": 1, "ms": 1},
    ):
        req = pb.HeartbeatRequest(phase=pb.PHASE_IDLE)
        req.donor_rates.add(**kw)
        bad.append(req)
    many = pb.HeartbeatRequest(phase=pb.PHASE_IDLE)
    for i in range(MAX_SYNC_DONORS + 1):
        many.donor_rates.add(worker_id=f"d{i}", nbytes=1, ms=1)
    bad.append(many)
    for req in bad:
        with pytest.raises(ValidationError, match="donor_rates"):
            validate_heartbeat(req, spec)
