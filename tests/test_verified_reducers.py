"""Verified reducers over real hivemind P2P peers, and the adjudication of the evidence.

Each part is reduced by its primary and its shadow (`bagel.robust.evidence`); the peers
here have Ed25519 identities, so every contribution and receipt is signed. A hostile
primary (its data plane scales its averaged part x1000 and signs a receipt for exactly
those bytes, so the receipt is consistent and the part finite) is caught by the digest
comparison: no honest peer applies the round, and the shadow of that part holds evidence
that `adjudicate` turns into a conviction. Forged or misdirected evidence convicts nobody.
"""

from __future__ import annotations

import asyncio
import hashlib

import pytest
import torch

from bagel.compression import get_codec
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol import dataplane_pb2 as dp
from bagel.protocol.identity import Identity
from bagel.robust.aggregation import exact_norm, exact_sum, get_reducer
from bagel.robust.evidence import (
    EvidenceRefuted,
    ForeignEvidence,
    ForgedEvidence,
    IncompleteEvidence,
    UnknownExchange,
    adjudicate,
    contribution_statement,
    parse_evidence,
    shadow_of,
    shadow_offset,
    sign_contribution,
)
from bagel.robust.reduction import PartInput, decode_part, reduce_one_part, result_generator
from bagel.worker.averaging import ExchangeResult, ReducersDisagree
from bagel.worker.parts import Layout, group_digest, part_bounds, prepare_contribution

from dataplane_peers import RUN_ID, Peer, peers, torch_shm_manager  # noqa: F401 (autouse fixture)

CELL = "k0.r0"
CODEC = "int8"


def make_delta(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"a.weight": torch.randn(17, 9, generator=g), "b.bias": torch.randn(40, generator=g)}


async def run_exchange(ps: list[Peer], *, round: int = 1) -> list[ExchangeResult | BaseException]:
    cs = [p.contributor() for p in ps]
    coros = [
        p.plane.all_reduce(
            worker_id=p.worker_id,
            cell_id=CELL,
            round=round,
            round_attempt=1,
            reduce_attempt=1,
            contributors=cs,
            delta=make_delta(i),
            weight=10.0,
            codec=CODEC,
            timeout_s=30.0,
        )
        for i, p in enumerate(ps)
    ]
    return list(await asyncio.wait_for(asyncio.gather(*coros, return_exceptions=True), 60))


def offset_of(ps: list[Peer], round: int = 1) -> int:
    """The exchange's shadow offset, as every member and the coordinator compute it."""
    tag = dp.ExchangeTag(
        run_id=RUN_ID,
        cell_id=CELL,
        round=round,
        round_attempt=1,
        reduce_attempt=1,
        group_digest=group_digest([p.contributor() for p in ps]),
    )
    return shadow_offset(tag, len(ps))


def frozen(ps: list[Peer]) -> list[tuple[str, str, int]]:
    return [(c.worker_id, c.peer_id, c.max_samples) for c in (p.contributor() for p in ps)]


@pytest.mark.timeout(120)
async def test_signed_exchange_agrees_and_is_bit_identical_with_the_pure_reduction() -> None:
    async with peers(3, signed=True) as ps:
        results = await run_exchange(ps)
        assert all(isinstance(r, ExchangeResult) for r in results), results
        first = results[0].averaged  # type: ignore[union-attr]
        for r in results:
            for k in first:
                assert torch.equal(r.averaged[k], first[k])  # type: ignore[union-attr]
        # the result is exactly reduce_one_part over the decoded contributions, part by part
        layout = Layout.of(make_delta(0))
        codec = get_codec(CODEC)
        got = layout.flatten(first)
        contribs = [
            prepare_contribution(make_delta(i), codec, 3, (RUN_ID, CELL, 1, 1, 1, p.worker_id), weight=10.0)
            for i, p in enumerate(ps)
        ]
        for j, (s, e) in enumerate(part_bounds(layout.total, 3)):
            inputs = [PartInput(p.worker_id, 10.0, 1000, c.payloads[j]) for p, c in zip(ps, contribs, strict=True)]
            res = reduce_one_part(codec, get_reducer("mean"), e - s, inputs, result_generator(RUN_ID, CELL, 1, 1, 1, j))
            assert torch.equal(got[s:e], decode_part(codec, res.payload, e - s))


@pytest.mark.timeout(180)
@pytest.mark.parametrize("k", [2, 3, 4])
async def test_a_doctored_part_is_applied_by_nobody_and_the_evidence_convicts_its_reducer(k: int) -> None:
    bad = 1
    async with peers(k, signed=True, doctors={bad: 1e3}) as ps:
        results = await run_exchange(ps)
        ids = [p.worker_id for p in ps]
        for i, r in enumerate(results):
            assert isinstance(r, ReducersDisagree), f"{ids[i]} applied the round: {r!r}"
            assert f"part {bad}: primary {ids[bad]}" in str(r)
        shadow = shadow_of(bad, k, offset_of(ps))
        evidence = results[shadow].evidence  # type: ignore[union-attr]
        assert len(evidence) == 1
        assert all(not results[i].evidence for i in range(k) if i not in (shadow, bad))  # type: ignore[union-attr]
        ev = parse_evidence(evidence[0])
        assert ev.receipt.reducer == ids[bad] and ev.receipt.role == dp.EVIDENCE_ROLE_PRIMARY
        conviction = adjudicate(
            ev,
            run_id=RUN_ID,
            accuser=ids[shadow],
            members=frozen(ps),
            codec=get_codec(CODEC),
            reducer=get_reducer("mean"),
        )
        assert conviction.worker_id == ids[bad] and conviction.kind == "reducer"
        assert conviction.reason.startswith("verified evidence: primary reducer of k0.r0 round 1")

        # ---- the same evidence, misused or forged, convicts nobody
        judge = {"run_id": RUN_ID, "codec": get_codec(CODEC), "reducer": get_reducer("mean")}
        base = evidence[0]

        def variant(**changes: object) -> pb.EvidenceRequest:
            e = pb.EvidenceRequest()
            e.CopyFrom(base)
            for k, v in changes.items():
                setattr(e, k, v)
            return e

        with pytest.raises(ForgedEvidence, match="receipt signature"):  # a bit of the receipt flipped
            parse_evidence(
                variant(receipt_signature=bytes([base.receipt_signature[0] ^ 1]) + base.receipt_signature[1:])
            )
        with pytest.raises(ForgedEvidence, match="not the reducer"):  # another key than the reducer's
            parse_evidence(variant(reducer_public_key=Identity.generate().public_key))
        with pytest.raises(UnknownExchange):
            adjudicate(ev, accuser=ids[shadow], members=None, **judge)  # type: ignore[arg-type]
        other = Identity.generate()
        with pytest.raises(ForeignEvidence, match="contributor set"):  # not the set frozen for that exchange
            members = frozen(ps)
            members[0] = (other.worker_id, members[0][1], members[0][2])
            adjudicate(ev, accuser=ids[shadow], members=sorted(members), **judge)  # type: ignore[arg-type]
        with pytest.raises(ForeignEvidence, match="accuser"):
            adjudicate(ev, accuser=other.worker_id, members=frozen(ps), **judge)  # type: ignore[arg-type]
        # an input signed by a stranger to the exchange, in place of a contributor's
        h0 = dp.ContributionHeader.FromString(base.inputs[0].contribution_header)
        stranger = dp.ContributionHeader()
        stranger.CopyFrom(h0)
        stranger.sender = other.worker_id
        sign_contribution(other, stranger)
        forged = variant()
        forged.inputs[0].contribution_header = stranger.SerializeToString()
        with pytest.raises(ForeignEvidence, match="not a contributor"):
            adjudicate(parse_evidence(forged), accuser=ids[shadow], members=frozen(ps), **judge)  # type: ignore[arg-type]
        # a contributor's input with its weight changed after signing
        tampered = dp.ContributionHeader()
        tampered.CopyFrom(h0)
        tampered.weight = 1e9
        forged = variant()
        forged.inputs[0].contribution_header = tampered.SerializeToString()
        with pytest.raises(ForgedEvidence, match="signature does not verify"):
            adjudicate(parse_evidence(forged), accuser=ids[shadow], members=frozen(ps), **judge)  # type: ignore[arg-type]
        # an input left out
        short = variant()
        del short.inputs[k - 1]
        with pytest.raises(IncompleteEvidence):
            adjudicate(parse_evidence(short), accuser=ids[shadow], members=frozen(ps), **judge)  # type: ignore[arg-type]


@pytest.mark.timeout(120)
async def test_an_honest_reducer_falsely_accused_is_not_convicted() -> None:
    """What a hostile shadow would send against an honest primary: the primary's signed
    receipt and every signed input of its part. The re-run agrees with the receipt."""
    # an honest exchange: the shadow of part 0 accuses the honest primary (peer 0)
    async with peers(3, signed=True) as ps:
        ids = [p.worker_id for p in ps]
        judge = {"run_id": RUN_ID, "codec": get_codec(CODEC), "reducer": get_reducer("mean"), "members": frozen(ps)}
        receipts: dict[str, pb.EvidenceRequest] = {}
        accuser = shadow_of(0, 3, offset_of(ps))  # the shadow of part 0 holds its signed inputs
        plane = ps[accuser].plane
        original = plane._check_agreement

        def spy(tag, me, members, sessions, replies, shadows, own):  # noqa: ANN001, ANN202
            inputs = [
                pb.EvidenceInput(
                    contribution_header=h.SerializeToString(), payload=sessions[0].accepted[s].payload or b""
                )
                for s, h in sorted(sessions[0].headers.items())
            ]
            receipts["evidence"] = pb.EvidenceRequest(
                receipt=replies[0][1].receipt,
                receipt_signature=replies[0][1].receipt_signature,
                reducer_public_key=replies[0][1].reducer_public_key,
                inputs=inputs,
            )
            return original(tag, me, members, sessions, replies, shadows, own)

        plane._check_agreement = spy  # type: ignore[method-assign]
        results = await run_exchange(ps)
        assert all(isinstance(r, ExchangeResult) for r in results)
        false = receipts["evidence"]
        with pytest.raises(EvidenceRefuted, match="verifies"):
            adjudicate(parse_evidence(false), accuser=ids[accuser], **judge)  # type: ignore[arg-type]


@pytest.mark.timeout(120)
async def test_an_equivocating_sender_is_convicted() -> None:
    """A sender that signs two different contributions to one part (one to the primary, one to
    the shadow) is convicted on the two signatures alone."""
    async with peers(3, signed=True) as ps:
        ids = [p.worker_id for p in ps]
        captured: dict[str, pb.EvidenceRequest] = {}
        accuser = shadow_of(0, 3, offset_of(ps))  # the shadow of part 0
        plane = ps[accuser].plane
        original = plane._check_agreement

        def spy(tag, me, members, sessions, replies, shadows, own):  # noqa: ANN001, ANN202
            primary = replies[0][1]
            inputs = [
                pb.EvidenceInput(
                    contribution_header=h.SerializeToString(), payload=sessions[0].accepted[s].payload or b""
                )
                for s, h in sorted(sessions[0].headers.items())
            ]
            captured["evidence"] = pb.EvidenceRequest(
                receipt=primary.receipt,
                receipt_signature=primary.receipt_signature,
                reducer_public_key=primary.reducer_public_key,
                inputs=inputs,
            )
            return original(tag, me, members, sessions, replies, shadows, own)

        plane._check_agreement = spy  # type: ignore[method-assign]
        results = await run_exchange(ps)
        assert all(isinstance(r, ExchangeResult) for r in results)
        ev = captured["evidence"]
        eq = ({0, 1, 2} - {0, accuser}).pop()  # neither the primary of part 0 nor the accuser
        # it also signs a second, different contribution to part 0 (what it would have
        # sent the shadow had it equivocated): with its own key, for the same exchange and part
        ident2 = ps[eq].plane.identity
        assert ident2 is not None
        headers = [dp.ContributionHeader.FromString(e.contribution_header) for e in ev.inputs]
        n = [h.sender for h in headers].index(ids[eq])
        other_payload = get_codec(CODEC).encode(torch.ones(headers[n].part_numel))
        h2 = dp.ContributionHeader()
        h2.CopyFrom(headers[n])
        h2.payload_sha256 = hashlib.sha256(other_payload).digest()
        h2.payload_nbytes = len(other_payload)
        sign_contribution(ident2, h2)
        assert contribution_statement(h2) != contribution_statement(headers[n])
        ev.inputs[n].contribution_header = h2.SerializeToString()
        ev.inputs[n].payload = other_payload
        judge = {"run_id": RUN_ID, "codec": get_codec(CODEC), "reducer": get_reducer("mean"), "members": frozen(ps)}
        conviction = adjudicate(parse_evidence(ev), accuser=ids[accuser], **judge)  # type: ignore[arg-type]
        assert conviction.worker_id == ids[eq] and conviction.kind == "equivocation"
        assert "signed two different contributions" in conviction.reason


def test_exact_sum_is_a_fixed_pairwise_tree_and_exact_norm_agrees_with_torch() -> None:
    """The rules' sums are a fixed tree of elementwise adds (the same bits on every CPU): equal,
    bit for bit, to the same tree in plain Python floats, and close to torch's own norm."""

    def tree(vals: list[float]) -> float:
        while len(vals) > 1:
            if len(vals) % 2:
                vals = [*vals, 0.0]
            vals = [vals[i] + vals[i + 1] for i in range(0, len(vals), 2)]
        return vals[0] if vals else 0.0

    g = torch.Generator().manual_seed(3)
    for n in (0, 1, 2, 7, 1000, 4097):
        x = torch.randn(n, generator=g, dtype=torch.float64) * 1e3
        assert exact_sum(x) == tree(x.tolist())
        assert abs(exact_norm(x) - float(torch.linalg.vector_norm(x))) <= 1e-12 * (1 + exact_norm(x))


@pytest.mark.timeout(120)
async def test_a_lying_shadow_is_convicted_on_the_primarys_evidence(monkeypatch: pytest.MonkeyPatch) -> None:
    """The shadow signs a wrong digest (the primary is honest): nobody applies the part, and the
    primary, which holds the same signed inputs, proves the shadow lied."""
    from bagel.worker import reducer as reducer_mod

    async with peers(3, signed=True) as ps:
        ids = [p.worker_id for p in ps]
        liar = 2
        honest_compute = reducer_mod.Reduction._compute

        def compute(self: reducer_mod.Reduction):  # noqa: ANN202
            res = honest_compute(self)
            if self.me == ids[liar] and self.role == dp.EVIDENCE_ROLE_SHADOW:
                return reducer_mod.PartResult(b"\0" + res.payload[1:], res.included, res.excluded, res.total_weight)
            return res

        monkeypatch.setattr(reducer_mod.Reduction, "_compute", compute)
        results = await run_exchange(ps)
        part = (liar - offset_of(ps)) % 3  # the part the liar shadows
        for i, r in enumerate(results):
            assert isinstance(r, ReducersDisagree), f"{ids[i]} applied the round: {r!r}"
            assert f"part {part}: primary {ids[part]}" in str(r) and f"shadow {ids[liar]}" in str(r)
        evidence = results[part].evidence  # type: ignore[union-attr]
        assert len(evidence) == 1
        judge = {"run_id": RUN_ID, "codec": get_codec(CODEC), "reducer": get_reducer("mean"), "members": frozen(ps)}
        conviction = adjudicate(parse_evidence(evidence[0]), accuser=ids[part], **judge)  # type: ignore[arg-type]
        assert conviction.worker_id == ids[liar]
        assert conviction.reason.startswith("verified evidence: shadow reducer of")
