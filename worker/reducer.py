"""The reducer's side of one group exchange: collect, validate, aggregate, answer.

`averaging.DataPlane` creates one `Reduction` per part it reduces in an exchange (keyed by
cell, round, round_attempt, reduce_attempt, then the part). Incoming contribution streams
for that part are handed to `Reduction.serve`; `Reduction.reduce_own` waits until every
contributor is accounted for (received, or excluded with a reason), then calls
`bagel.robust.reduction.reduce_one_part` (decode, validate, aggregate in sorted-sender
order, encode once), and every waiting stream gets those same bytes. Only identity
problems (not a contributor, impostor peer id, wrong part, a bad signature, conflicting
duplicate, a payload that is not the one the header signs) refuse a stream outright
(`Refused`); a contributor whose part is merely bad (inconsistent header, oversized,
undecodable, non-finite, weight <= 0, a norm the group screen finds far outside the
others': `Reducer.screen`) is *excluded* from the aggregate and still receives the result,
so the exchange completes for everyone else without waiting for a timeout.

In a verified exchange (the plane has an identity; see `bagel.robust.evidence`) a part has
two reductions: the PRIMARY one answers with the result bytes and a signed receipt, the
SHADOW one with its signed receipt only (the digest of the same result), and both keep the
signed inputs, from which the data plane builds evidence when the two disagree.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace

import torch
from hivemind.p2p import PeerID

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol import dataplane_pb2 as dp
from bagel.protocol.identity import Identity
from bagel.protocol.messages import PartAudit
from bagel.protocol.validation import MAX_LOSS
from bagel.robust.aggregation import Reducer
from bagel.robust.audit import part_audit
from bagel.robust.evidence import contribution_problem, contribution_statement, sign_receipt
from bagel.robust.reduction import (
    NoValidContribution,
    PartInput,
    PartResult,
    decode_part,
    header_problem,
    reduce_one_part,
    result_generator,
)
from bagel.worker.framing import LEN_NBYTES, discard_frame, read_frame, write_frame, write_message
from bagel.worker.parts import Codec, Contributor, Layout

log = logging.getLogger(__name__)

# A payload we answer without reading (a refusal, an excluded contribution) is still read
# and dropped before the stream closes (`framing.discard_frame`), within these bounds; past
# them the sender may see a cut reply and retries.
DISCARD_MAX_NBYTES = 256 << 20
DISCARD_TIMEOUT_S = 5.0

# ---------------------------------------------------------------- errors


class ExchangeError(Exception):
    """The exchange did not produce an averaged delta; report the round as failed."""


class ExchangeTimeout(ExchangeError):
    """The deadline passed before every contribution and averaged part arrived."""

    def __init__(self, missing: Iterable[str], detail: str = ""):
        self.missing = tuple(sorted(missing))
        super().__init__(f"exchange timed out waiting for {list(self.missing)}" + (f": {detail}" if detail else ""))


class ContributionRejected(ExchangeError):
    """A reducer refused our contribution outright (not a contributor, stale, wrong part, ...)."""

    def __init__(self, reducer: str, reason: str):
        self.reducer, self.reason = reducer, reason
        super().__init__(f"reducer {reducer} rejected our contribution: {reason}")


class ExchangeFailed(ExchangeError):
    """A reducer reported failure, or sent an averaged part we cannot accept."""


class ReducersDisagree(ExchangeFailed):
    """The two reducers of a part signed different results: nothing of the round is applied.

    `evidence`: accusations to send to the coordinator (`Accuse`), built where we are the
    other reducer of a disagreeing part; empty when we are not.
    """

    def __init__(self, message: str, evidence: tuple[pb.EvidenceRequest, ...] = ()):
        super().__init__(message)
        self.evidence = evidence


class Refused(Exception):
    """Refuse an incoming stream; `retry`: the sender may try again (we are not ready yet)."""

    def __init__(self, reason: str, *, retry: bool = False, payload_read: bool = False):
        super().__init__(reason)
        self.reason, self.retry, self.payload_read = reason, retry, payload_read


def _per_share(gain: float, share: float) -> float:
    """A gain measured at `share` of the mean, per unit of share, within what validation accepts."""
    return max(-MAX_LOSS, min(MAX_LOSS, gain / share))


@dataclass
class Reduction:
    """One part this peer reduces in one exchange (as primary or shadow), and the byte counters."""

    tag: dp.ExchangeTag
    me: str
    contributors: tuple[Contributor, ...]
    index: int  # the part we reduce
    bounds: list[tuple[int, int]]
    codec: Codec
    reducer: Reducer
    layout: Layout
    deadline: float  # event-loop time: the caller's deadline
    reduce_deadline: float  # a little earlier: the verdict on missing contributions reaches everyone in time
    role: int = dp.EVIDENCE_ROLE_UNSPECIFIED  # PRIMARY / SHADOW in a verified exchange
    identity: Identity | None = None  # signs our receipt (verified exchanges)
    doctor: float = 0.0  # fault injection (--byzantine bad-reducer): scale our result by this, and sign it
    # the worker's one slot for computing a reduction (`DataPlane`): a part's float64
    # temporaries are several times its size, so a primary and a shadow take turns
    compute_slot: asyncio.Semaphore | None = None
    accepted: dict[str, PartInput] = field(default_factory=dict)
    headers: dict[str, dp.ContributionHeader] = field(default_factory=dict)  # the signed header of each sender
    digests: dict[str, bytes] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)
    complete: asyncio.Event = field(default_factory=asyncio.Event)
    result: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    streams: dict[str, int] = field(default_factory=dict)
    replies_pending: int = 0
    replies_done: asyncio.Event = field(default_factory=asyncio.Event)
    bytes_sent: int = 0
    bytes_received: int = 0
    # sender -> (payload bytes, ms from its header to the payload's last byte) of its latest
    # contribution received here: what the coordinator's uplink estimates come from
    # (`ExchangeResult.peer_rates`); a stream that waited for our exchange to start measures nothing
    rates: dict[str, tuple[int, int]] = field(default_factory=dict)
    # the audit of our part for the coordinator (robust/audit.py): computed when
    # `audit_blocks` (the run's audit.sketch_blocks) is set, once the part is reduced
    audit_blocks: int = 0
    audit: PartAudit | None = None
    # the loss audit of our part (`worker.heldout.SliceLossAudit`, through `roundwork.loss_probe`):
    # (our part's first flat index, sender -> its decoded slice) -> sender -> (gain, gain on random)
    loss_probe: Callable[[int, Mapping[str, torch.Tensor]], Mapping[str, tuple[float, float]]] | None = None

    @property
    def numel(self) -> int:
        s, e = self.bounds[self.index]
        return e - s

    @property
    def verified(self) -> bool:
        return self.identity is not None

    @property
    def by_worker(self) -> dict[str, Contributor]:
        return {c.worker_id: c for c in self.contributors}

    def missing(self) -> list[str]:
        return [
            c.worker_id
            for c in self.contributors
            if c.worker_id not in self.accepted and c.worker_id not in self.excluded
        ]

    def exclude(self, sender: str, reason: str, header: dp.ContributionHeader | None = None) -> None:
        if sender not in self.accepted and sender not in self.excluded:
            log.warning(
                "exchange %s/%d: excluding %s from part %d: %s",
                self.tag.cell_id,
                self.tag.round,
                sender,
                self.index,
                reason,
            )
            self.excluded[sender] = reason
            if header is not None:
                self.headers[sender] = header
            self._check_complete()

    def accept(self, sender: str, weight: float, payload: bytes, header: dp.ContributionHeader | None = None) -> None:
        """A contribution's payload arrived (decoded and validated at reduction time)."""
        if sender in self.accepted or sender in self.excluded:
            return
        self.accepted[sender] = PartInput(sender, float(weight), self.by_worker[sender].max_samples, payload)
        if header is not None:
            self.headers[sender] = header
        self._check_complete()

    def _check_complete(self) -> None:
        if not self.missing():
            self.complete.set()

    def header_problem(self, h: dp.ContributionHeader) -> str:
        """Why a contributor's header is inconsistent with ours ('' when it is fine)."""
        return header_problem(
            h,
            num_parts=len(self.contributors),
            total_numel=self.layout.total,
            part_numel=self.numel,
            layout_digest=self.layout.digest,
            codec=self.codec,
        )

    def fail(self, reason: str, missing: Sequence[str] = ()) -> None:
        if not self.result.done():
            header = dp.ReducedHeader(
                status=dp.STATUS_FAILED, reason=reason, tag=self.tag, part=self.index, missing=sorted(missing)
            )
            self.result.set_result((header, b""))

    def release(self) -> None:
        """Drop the received payloads once the exchange is over (the reply bytes stay for re-attaching senders)."""
        for sender, inp in self.accepted.items():
            self.accepted[sender] = PartInput(sender, inp.weight, inp.max_samples, b"")

    def inputs(self) -> list[PartInput]:
        """Every contribution accounted for, as `reduce_one_part` takes them."""
        ms = {c.worker_id: c.max_samples for c in self.contributors}
        out = list(self.accepted.values())
        out += [PartInput(s, 0.0, ms[s], None, reason) for s, reason in self.excluded.items()]
        return out

    def _compute(self) -> PartResult:
        t = self.tag
        gen = result_generator(t.run_id, t.cell_id, t.round, t.round_attempt, t.reduce_attempt, self.index)
        res = reduce_one_part(self.codec, self.reducer, self.numel, self.inputs(), gen)
        if self.doctor:  # a hostile reducer: a finite, well-formed, wrong part
            gen = result_generator(t.run_id, t.cell_id, t.round, t.round_attempt, t.reduce_attempt, self.index)
            doctored = decode_part(self.codec, res.payload, self.numel) * self.doctor
            res = PartResult(self.codec.encode(doctored, generator=gen), res.included, res.excluded, res.total_weight)
        return res

    def _signed(self, header: dp.ReducedHeader, res: PartResult) -> None:
        assert self.identity is not None
        receipt = dp.EvidenceReceipt(
            tag=self.tag,
            part=self.index,
            reducer=self.me,
            role=self.role,  # type: ignore[arg-type]
            result_sha256=res.digest,
            inputs=[self.headers[s] for s in sorted(self.headers)],
            excluded=[dp.Exclusion(sender=k, reason=v) for k, v in res.excluded],
            reducer_rule=self.reducer.spec(),
            codec=self.codec.name,
            total_numel=self.layout.total,
            layout_digest=self.layout.digest,
        )
        header.receipt, header.receipt_signature = sign_receipt(self.identity, receipt)
        header.reducer_public_key = self.identity.public_key

    def _with_loss(
        self, audit: PartAudit, parts: Mapping[str, torch.Tensor], weights: Mapping[str, float]
    ) -> PartAudit:
        """The audit with each included sender's loss gains (a failed measurement leaves it out).

        Each slice is measured at its share of the part's weighted mean (its weight over the
        included total), the step it actually contributes, and the gain is reported per unit of
        that share (divided by it), so senders of any weight are judged on one scale. Taken
        whole, a slow member's slice (the same number of AdamW steps as a fast one's, on a third
        of the batch) overshot and raised the loss on its own samples often enough to get honest
        members charged; at its share it does not, and a flipped slice is still charged
        whatever budget its sender claims (bench/loss_audit_mixed_speeds.py)."""
        assert self.loss_probe is not None
        total = sum(weights.get(s, 0.0) for s in parts)
        share = {s: weights.get(s, 0.0) / total for s in parts} if total > 0 else {}
        scaled = {s: p * share[s] for s, p in parts.items() if share.get(s, 0.0) > 0}
        try:
            measured = self.loss_probe(self.bounds[self.index][0], scaled) if scaled else {}
            gains = {s: (_per_share(g, share[s]), _per_share(r, share[s])) for s, (g, r) in measured.items()}
        except Exception:  # noqa: BLE001  (the audit is advisory: the exchange goes on without it)
            log.exception("loss audit of part %d failed", self.index)
            return audit
        senders = tuple(
            replace(s, loss_gain=gains[s.sender][0], loss_gain_random=gains[s.sender][1], loss_measured=True)
            if s.sender in gains and not s.excluded
            else s
            for s in audit.senders
        )
        return replace(audit, senders=senders)

    async def reduce_own(self) -> tuple[bytes, dp.ReducedHeader]:
        """Wait for every contribution to our part, reduce it once; (result bytes, our reply header).

        A shadow's reply carries no payload (only its signed receipt), but the bytes are returned here.
        """
        if self.numel == 0:
            return b"", dp.ReducedHeader(status=dp.STATUS_OK, tag=self.tag, part=self.index)
        try:
            await asyncio.wait_for(
                self.complete.wait(), max(0.0, self.reduce_deadline - asyncio.get_running_loop().time())
            )
        except TimeoutError:
            missing = self.missing()
            self.fail(f"no contribution to part {self.index} from {missing}", missing)
            raise ExchangeTimeout(missing, f"at our part {self.index}") from None
        payload = b""
        try:
            if self.compute_slot is None:
                res = await asyncio.to_thread(self._compute)
            else:
                async with self.compute_slot:
                    res = await asyncio.to_thread(self._compute)
        except NoValidContribution:
            self.fail(f"no valid contribution to part {self.index}: {self.excluded}")
        else:
            payload = res.payload
            shadow = self.role == dp.EVIDENCE_ROLE_SHADOW
            if self.audit_blocks:
                t = self.tag
                self.audit = await asyncio.to_thread(
                    part_audit,
                    t.run_id,
                    self.index,
                    self.bounds[self.index][0],
                    self.layout.total,
                    self.audit_blocks,
                    res.parts,
                    dict(self.excluded) | dict(res.excluded),
                )
            header = dp.ReducedHeader(
                status=dp.STATUS_OK,
                tag=self.tag,
                part=self.index,
                payload_nbytes=0 if shadow else len(payload),
                included=res.included,
                excluded=[dp.Exclusion(sender=k, reason=v) for k, v in res.excluded],
                total_weight=res.total_weight,
                reducer_rule=self.reducer.spec(),
            )
            if self.verified:
                self._signed(header, res)
            if not self.result.done():
                self.result.set_result((header, b"" if shadow else payload))
            if self.audit is not None and self.loss_probe is not None and res.parts:
                # after the result went out: the other contributors do not wait for the measurement
                self.audit = await asyncio.to_thread(self._with_loss, self.audit, res.parts, res.weights)
        header, sent = await self.result
        if header.status != dp.STATUS_OK:
            raise ExchangeFailed(f"part {self.index} (ours): {header.reason}")
        return payload or sent, header

    async def serve(
        self,
        h: dp.ContributionHeader,
        nbytes: int,
        remote: PeerID,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        header_at: float | None = None,
    ) -> None:
        """Serve one contributor's stream; `header_at` (event-loop time its header arrived,
        None when the stream waited for our exchange to start) times its payload."""
        c = self.by_worker.get(h.sender)
        if c is None or h.sender == self.me:
            raise Refused(f"{h.sender!r} is not a contributor of this exchange")
        if remote.to_base58() != c.peer_id:
            raise Refused(f"peer {remote} is not {h.sender}'s peer")
        if h.part != self.index:
            raise Refused(f"part {h.part} is reduced by another contributor (we reduce {self.index})")
        if self.verified and (problem := contribution_problem(h)):
            raise Refused(f"contribution from {h.sender}: {problem}")
        if self.streams.get(h.sender, 0) >= 2:
            raise Refused("too many concurrent streams from this sender")
        self.streams[h.sender] = self.streams.get(h.sender, 0) + 1
        self.replies_pending += 1
        self.replies_done.clear()
        unread = 0
        try:
            self.bytes_received += nbytes
            # a little past the deadline, so a FAILED verdict still reaches the sender
            async with asyncio.timeout_at(self.deadline + 1.0):
                problem = self.header_problem(h)
                if problem:
                    self.exclude(h.sender, problem, h)
                    unread = h.payload_nbytes
                else:
                    buf = await read_frame(reader, h.payload_nbytes)
                    self.bytes_received += LEN_NBYTES + len(buf)
                    if header_at is not None and buf:
                        ms = int((asyncio.get_running_loop().time() - header_at) * 1000)
                        self.rates[h.sender] = (len(buf), max(1, ms))
                    if self.verified and hashlib.sha256(buf).digest() != h.payload_sha256:
                        # never an exclusion: the other reducer of this part may get the right
                        # bytes under the same signed header, and then the two must still agree
                        raise Refused("the payload is not the one the header signs", payload_read=True)
                    stmt = contribution_statement(h) if self.verified else repr(h.weight).encode()
                    digest = hashlib.sha256(stmt + buf).digest()
                    if h.sender in self.digests:
                        if self.digests[h.sender] != digest:
                            raise Refused(
                                "a different contribution from this sender was already received", payload_read=True
                            )
                    elif h.sender not in self.excluded and h.sender not in self.accepted and not self.result.done():
                        self.digests[h.sender] = digest
                        if len(buf) != h.payload_nbytes:
                            self.exclude(h.sender, "payload shorter than announced", h)
                        else:
                            self.accept(h.sender, h.weight, buf, h)
                reply, payload = await asyncio.shield(self.result)
            self.bytes_sent += LEN_NBYTES + reply.ByteSize() + (LEN_NBYTES + len(payload) if payload else 0)
            await write_message(writer, reply)
            if payload:
                await write_frame(writer, payload)
            if unread:  # the payload we did not read; read it before the stream closes
                await discard_frame(reader, min(unread, DISCARD_MAX_NBYTES), DISCARD_TIMEOUT_S)
        finally:
            self.streams[h.sender] -= 1
            self.replies_pending -= 1
            if self.replies_pending == 0:
                self.replies_done.set()
