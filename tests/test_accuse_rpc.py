"""The `Accuse` RPC of a real coordinator: evidence that proves nothing gets a precise status
and changes nothing (every SQLite row, the core's snapshot and GetStatus are compared, as
in tests/test_bad_input.py). What a valid accusation does is tested end to end in
tests/test_e2e_bad_reducer.py, and the adjudication itself in tests/test_verified_reducers.py.
"""

from __future__ import annotations

import grpc
import pytest

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol import dataplane_pb2 as dp
from bagel.protocol.envelope import sign_request, wall_clock_ms
from bagel.protocol.identity import Identity
from bagel.robust.evidence import sign_contribution, sign_receipt

from test_bad_input import coordinator, expect, fingerprint  # noqa: F401 (fixture)


def evidence(run_id: str, *, reducer: Identity, signer: Identity | None = None) -> pb.EvidenceRequest:
    """A well-formed accusation of `reducer` about an exchange nobody froze; the receipt is
    signed by `signer` (default: the reducer itself)."""
    tag = dp.ExchangeTag(
        run_id=run_id, cell_id="k0.r0", round=1, round_attempt=1, reduce_attempt=1, group_digest="0" * 32
    )
    h = dp.ContributionHeader(tag=tag, sender=reducer.worker_id, part=0, num_parts=2, weight=1.0)
    sign_contribution(reducer, h)
    receipt = dp.EvidenceReceipt(
        tag=tag, part=0, reducer=reducer.worker_id, role=dp.EVIDENCE_ROLE_PRIMARY, result_sha256=b"\1" * 32, inputs=[h]
    )
    blob, sig = sign_receipt(signer or reducer, receipt)
    return pb.EvidenceRequest(
        receipt=blob,
        receipt_signature=sig,
        reducer_public_key=reducer.public_key,
        inputs=[pb.EvidenceInput(contribution_header=h.SerializeToString(), payload=b"")],
    )


@pytest.mark.timeout(60)
async def test_accusations_that_prove_nothing_get_precise_statuses_and_change_nothing(coordinator) -> None:  # noqa: F811
    h, caller, me = coordinator
    run = h.app.spec.run.id
    # each request its own clock reading, 1.5 s apart: the per-worker rate limit stays out of the way
    now = [wall_clock_ms()]

    def clock() -> int:
        now[0] += 1500
        return now[0]

    h.app.clock = clock
    before = await fingerprint(h, caller)

    def send(req: pb.EvidenceRequest, who: Identity = me):  # noqa: ANN202
        return lambda: caller.stub.Accuse(
            sign_request(who, req, run_id=run, method="Accuse", now_ms=now[0]), timeout=10
        )

    reducer = Identity.generate()
    good = evidence(run, reducer=reducer)
    empty = pb.EvidenceRequest()
    empty.CopyFrom(good)
    empty.ClearField("receipt")
    assert "receipt" in await expect(grpc.StatusCode.INVALID_ARGUMENT, send(empty))
    detail = await expect(
        grpc.StatusCode.UNAUTHENTICATED, send(evidence(run, reducer=reducer, signer=Identity.generate()))
    )
    assert "receipt signature" in detail
    wrong_key = pb.EvidenceRequest()
    wrong_key.CopyFrom(good)
    wrong_key.reducer_public_key = Identity.generate().public_key
    assert "not the reducer" in await expect(grpc.StatusCode.UNAUTHENTICATED, send(wrong_key))
    assert "no frozen contributor set" in await expect(grpc.StatusCode.NOT_FOUND, send(good))
    assert "unknown worker" in await expect(grpc.StatusCode.NOT_FOUND, send(good, Identity.generate()))
    # past the burst while the clock stands still: refused before any work
    h.app.clock = lambda: now[0]
    limited = ""
    for _ in range(3):
        try:
            await send(good)()
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:
                limited = e.details() or ""
                break
            assert e.code() == grpc.StatusCode.NOT_FOUND
    assert "per worker" in limited
    h.app.clock = clock
    assert await fingerprint(h, caller) == before
