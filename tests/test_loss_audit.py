"""The loss audit (Templar's Gauntlet idea): does a sender's slice of its update lower the loss
on the samples it was assigned?

The measurement runs on the real tiny DiT cell of `sim/scenarios/chaos-robust-8.toml`
(`worker.heldout.SliceLossAudit`, the worker's real inner round and `--byzantine` deltas), its
plumbing through a real `worker.reducer.Reduction`, the wire (convert, validation), and the
coordinator core's `Auditor`, which charges a sender only when most other reducers agree.
"""

from __future__ import annotations

import asyncio
import math
import tomllib
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from bagel.compression import get_codec
from bagel.coordinator.core.audit import Auditor, loss_flagged
from bagel.models.data import shard
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol import dataplane_pb2 as dp
from bagel.protocol.convert import audit_from_pb, audit_to_pb
from bagel.protocol.messages import Member, PartAudit, PeerAddress, RoundPlan, SenderAudit
from bagel.protocol.runspec import AuditSection, parse_spec
from bagel.protocol.validation import ValidationError, validate
from bagel.robust.aggregation import get_reducer
from bagel.robust.audit import part_audit
from bagel.worker import ddp
from bagel.worker.diloco import CellState
from bagel.worker.heldout import SliceLossAudit
from bagel.worker.parts import Contributor, Layout
from bagel.worker.reducer import Reduction
from bagel.worker.roundwork import RoundWork, corrupt, loss_probe, train_round
from bagel.worker.trainer import InnerPlan, build_runtime

CELL = "k0.r0"
TOTAL, BLOCKS = 4096, 32
SCENARIO = Path(__file__).resolve().parent.parent / "sim" / "scenarios" / "chaos-robust-8.toml"


def _spec(extra: str = ""):
    text = tomllib.loads(SCENARIO.read_text())["chaos"]["run_spec"]
    return parse_spec(text + extra)


# ---------------------------------------------------------------- the measurement


@pytest.fixture(scope="module")
def trained():
    """One member of eight trains rounds 1 and 2 of the cell; (spec, committed state of round 2's
    base, honest delta of round 2, member index)."""
    torch.set_num_threads(1)
    spec = _spec()
    cell = spec.cell_ids[0]
    rt = build_runtime(spec, cell, torch.device("cpu"))
    state = CellState.from_model(rt.task.build_model())
    plan = InnerPlan(spec.diloco.inner_steps, 8, 1)
    delta = {}
    for rnd in (1, 2):
        w = RoundWork(cell, rnd, 1, 3, 8, plan, 0)
        _, delta = train_round(spec.run.id, rt, state, w, ddp.DistContext(), rnd == 1, None)
        if rnd == 1:  # round 2 starts from round 1 with this member's update alone (a real, moved state)
            state = CellState({k: v - delta[k] for k, v in state.weights.items()})
    return spec, state, delta, 3, plan


def test_an_honest_slice_lowers_the_loss_and_a_flipped_one_raises_it(trained) -> None:
    spec, state, delta, member, plan = trained
    audit = SliceLossAudit(spec, CELL)
    names = Layout.of(delta).names
    flat = Layout.of(delta).flatten(delta)
    # the samples audited are the first ones the member's trainer drew in round 2
    own = audit.assigned(2, member, 8, plan.batch * plan.inner_steps)
    drawn = shard(spec.run.id, CELL, 2, member, 8, audit.num_train, plan.batch * plan.inner_steps)
    assert own.tolist() == list(drawn[: spec.audit.loss_samples])
    before = {k: v.clone() for k, v in state.weights.items()}
    # the whole vector as one slice, and a slice in the middle that cuts tensors
    for start, end in ((0, flat.numel()), (flat.numel() // 3, 2 * flat.numel() // 3)):
        slices = {
            "honest": flat[start:end],
            "flipped": -flat[start:end],
            "ipm": corrupt({"x": flat[start:end]}, "ipm", None)["x"],
        }
        gains = audit.gains(state, names, start, slices, dict.fromkeys(slices, own), 2)
        assert gains["honest"][0] > 0, gains
        assert gains["flipped"][0] < -0.25 * gains["honest"][0], gains  # flagged at the default loss_rel
        assert gains["ipm"][0] < 0, gains
        assert all(math.isfinite(g) for pair in gains.values() for g in pair)
        # the measurement is repeatable and leaves the committed state as it was
        assert audit.gains(state, names, start, slices, dict.fromkeys(slices, own), 2) == gains
    assert all(torch.equal(before[k], state.weights[k]) for k in before)


def test_the_probe_follows_the_round_plan_and_can_be_turned_off(trained) -> None:
    spec, state, delta, member, plan = trained
    names = Layout.of(delta).names
    members = tuple(Member(f"w{k}", PeerAddress(f"p{k}"), 40) for k in range(8))
    i = SimpleNamespace(plan=RoundPlan(1, 1, 1, 0, members))
    w = RoundWork(CELL, 2, 1, 0, 8, plan, 0)
    probe = loss_probe(spec, state, w, i, names)
    assert probe is not None
    flat = Layout.of(delta).flatten(delta)[:5000]
    gains = probe(0, {"w3": flat, "w5": -flat, "stranger": flat})
    assert set(gains) == {"w3", "w5"}  # only the plan's members have assigned samples
    assert gains["w3"][0] > 0 > gains["w5"][0]
    assert loss_probe(_spec("\n[audit]\nloss_samples = 0\n"), state, w, i, names) is None
    assert loss_probe(spec, state, w, SimpleNamespace(plan=None), names) is None


async def test_a_slice_is_judged_at_its_share_so_an_overshooting_honest_one_is_not_charged(trained) -> None:
    """A slow member's update (the same AdamW steps on a small batch) can overshoot when taken
    whole: its full step raises the loss on its own samples though its direction lowers it.
    Here the overshoot is made exact (5 x the honest step, within the norm screen's 10 x) for a
    member holding 1/9 of the part's weight: judged whole, as the audit did before, it is
    flagged; judged at its share it is not, while a sign-flipped slice at the same small weight
    is flagged either way."""
    spec, state, delta, member, plan = trained
    audit = SliceLossAudit(spec, CELL)
    layout = Layout.of(delta)
    flat = layout.flatten(delta)
    own = audit.assigned(2, member, 8, plan.batch * plan.inner_steps)
    vectors = {"m0": flat, "m1": flat, "m2": flat, "slow": 5.0 * flat, "flip": -flat}
    weights = {"m0": 26.0, "m1": 17.0, "m2": 13.0, "slow": 8.0, "flip": 8.0}
    names = sorted(vectors)
    loop = asyncio.get_running_loop()
    red = Reduction(
        dp.ExchangeTag(run_id=spec.run.id, cell_id=CELL, round=2, reduce_attempt=1, round_attempt=1),
        "m0",
        tuple(Contributor(n, f"peer-{n}", (), 10_000) for n in names),
        0,
        [(0, flat.numel())] + [(flat.numel(), flat.numel())] * (len(names) - 1),
        get_codec("fp32"),
        get_reducer(),
        layout,
        loop.time() + 30.0,
        loop.time() + 20.0,
        loss_probe=lambda start, parts: audit.gains(state, layout.names, start, parts, dict.fromkeys(parts, own), 2),
    )
    blank = PartAudit(0, 0, tuple(SenderAudit(n, 1.0, 0.0, "", "", (), 0.0, 0.0, False) for n in names))

    def flagged(gains: dict[str, float]) -> set[str]:
        """The coordinator's rule per sender, against the honest senders' gains (not the attacker's)."""
        honest = {n: gains[n] for n in names if n != "flip"}
        return {
            n for n in names if loss_flagged(gains[n], [g for k, g in honest.items() if k != n], spec.audit.loss_rel)
        }

    whole = {n: g[0] for n, g in audit.gains(state, layout.names, 0, vectors, dict.fromkeys(names, own), 2).items()}
    assert whole["slow"] < 0 < whole["m0"], whole  # the overshoot, taken whole
    assert flagged(whole) == {"slow", "flip"}, whole
    at_share = {s.sender: s.loss_gain for s in red._with_loss(blank, vectors, weights).senders}
    assert at_share["slow"] > 0 and at_share["flip"] < 0, at_share
    assert flagged(at_share) == {"flip"}, at_share


async def test_the_reducer_adds_the_gains_to_its_part_audit_after_answering() -> None:
    names = ["w0", "w1", "w2"]
    contributors = tuple(Contributor(n, f"peer-{n}", (), 100) for n in names)
    loop = asyncio.get_running_loop()
    codec = get_codec("fp32")
    seen: list[tuple[int, list[str]]] = []
    slices: dict[str, torch.Tensor] = {}

    def probe(start: int, parts):
        seen.append((start, sorted(parts)))
        slices.update(parts)
        return {s: (float(k + 1), 0.5) for k, s in enumerate(sorted(parts))}

    red = Reduction(
        dp.ExchangeTag(run_id="r", cell_id=CELL, round=1, reduce_attempt=1, round_attempt=1),
        "w0",
        contributors,
        1,
        [(0, 64), (64, 128), (128, 192)],
        codec,
        get_reducer(),
        Layout(("x",), ((192,),)),
        loop.time() + 30.0,
        loop.time() + 20.0,
        audit_blocks=4,
        loss_probe=probe,
    )
    g = torch.Generator().manual_seed(0)
    common = torch.randn(64, generator=g)
    sent = {n: common + 0.1 * torch.randn(64, generator=g) for n in names[:2]}
    for n, weight in (("w0", 10.0), ("w1", 30.0)):
        red.accept(n, weight, codec.encode(sent[n]))
    red.exclude("w2", "abstained (non-finite delta or no samples)")
    await red.reduce_own()
    assert red.result.done() and seen == [(64, ["w0", "w1"])]
    # each slice is measured at its share of the part's weighted mean (10/40 and 30/40) ...
    assert torch.allclose(slices["w0"], 0.25 * sent["w0"]) and torch.allclose(slices["w1"], 0.75 * sent["w1"])
    assert red.audit is not None
    by = {s.sender: s for s in red.audit.senders}
    # ... and its gains are reported per unit of that share
    assert (by["w0"].loss_gain, by["w1"].loss_gain, by["w1"].loss_gain_random) == (4.0, 2.0 / 0.75, 0.5 / 0.75)
    assert by["w0"].loss_measured and not by["w2"].loss_measured  # an excluded sender is not measured


# ---------------------------------------------------------------- the wire and the core


def _audits(gains: dict[str, float], seed: int) -> dict[str, PartAudit]:
    """Every contributor's part audit (real robust/audit.py, fresh updates per seed) with the
    given gain for each sender."""
    g = torch.Generator().manual_seed(seed)
    common = torch.randn(TOTAL, generator=g)
    contribs = {x: 0.7 * common + torch.randn(TOTAL, generator=g) for x in sorted(gains)}
    names = sorted(contribs)
    out = {}
    for j, reducer in enumerate(names):
        s, e = j * TOTAL // len(names), (j + 1) * TOTAL // len(names)
        a = part_audit("run", j, s, TOTAL, BLOCKS, {x: contribs[x][s:e] for x in names}, {})
        senders = tuple(
            replace(x, loss_gain=gains[x.sender], loss_gain_random=0.9 * gains[x.sender], loss_measured=True)
            for x in a.senders
        )
        out[reducer] = replace(a, senders=senders)
    return out


def _feed(au: Auditor, rnd: int, audits: dict[str, PartAudit]) -> list:
    ra = au.exchange(CELL, rnd, 1, sorted(audits), ())
    return [f for r in sorted(audits) for f in au.report(ra, r, audits[r])]


def test_a_slice_that_raises_its_own_loss_is_charged_once_most_reducers_agree() -> None:
    au = Auditor(AuditSection())
    honest = {f"w{k}": 0.01 * (1.0 + 0.3 * k) for k in range(6)}
    # honest gains of different sizes, one barely negative (noise): nothing
    assert _feed(au, 1, _audits(honest | {"w5": -0.002}, 1)) == []
    found = _feed(au, 2, _audits(honest | {"w4": -0.012}, 2))
    assert [(f.worker_id, f.kinds) for f in found] == [("w4", ("loss",))]
    assert au.counts["confirmed_loss"] == 1 and au.counts["loss_measured"] > 0
    # one hostile reducer's word is not enough
    audits = _audits(honest, 3)
    lie = tuple(replace(s, loss_gain=-1.0) if s.sender == "w1" else s for s in audits["w0"].senders)
    audits["w0"] = replace(audits["w0"], senders=lie)
    assert _feed(au, 3, audits) == []
    # when the others gain nothing there is no scale to judge by
    assert _feed(au, 4, _audits(dict.fromkeys(honest, 0.0) | {"w2": -0.5}, 4)) == []


def test_the_loss_fields_cross_the_wire_and_are_validated() -> None:
    from test_state_harness import h, make_spec

    spec = make_spec()
    good = PartAudit(0, 0, (SenderAudit("wa", 1.0, 0.2, "wb", "", (), 0.01, -0.02, True),))

    def req(a: PartAudit) -> pb.ReportRoundRequest:
        r = pb.ReportRoundRequest(cell_id=CELL, round=3, state_hash=h(3), samples=10)
        r.audit.CopyFrom(audit_to_pb(a))
        return r

    validate("ReportRound", req(good), spec)
    assert audit_from_pb(req(good).audit) == good
    for field, value in (("loss_gain", math.nan), ("loss_gain_random", math.inf), ("loss_gain", -2e12)):
        bad = PartAudit(0, 0, (replace(good.senders[0], **{field: value}),))
        with pytest.raises(ValidationError) as e:
            validate("ReportRound", req(bad), spec)
        assert e.value.field == f"audit.senders[0].{field}"
