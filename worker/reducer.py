"""The reducer's side of one group exchange: collect, validate, aggregate, answer.

`averaging.DataPlane` creates one `Reduction` per exchange it takes part in (keyed by
cell, round, round_attempt, reduce_attempt). Incoming contribution streams for our part
are handed to `Reduction.serve`; `Reduction.reduce_own` waits until every contributor is
accounted for (accepted, or excluded with a reason), aggregates the kept parts with the
pluggable rule in sorted-sender order, encodes the result once, and every waiting stream
gets those same bytes. Only identity problems (not a contributor, impostor peer id, wrong
part, conflicting duplicate) refuse a stream outright (`Refused`); a contributor whose
part is merely bad (inconsistent header, oversized, undecodable, non-finite, weight <= 0,
a norm the group screen finds far outside the others': `Reducer.screen`) is *excluded*
from the aggregate and still receives the result, so the exchange completes for everyone
else without waiting for a timeout.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

import torch
from hivemind.p2p import PeerID

from bagel.protocol import dataplane_pb2 as dp
from bagel.protocol.messages import PartAudit
from bagel.robust.aggregation import PartRejected, Reducer, clamp_weight
from bagel.robust.audit import part_audit
from bagel.worker.framing import LEN_NBYTES, discard_frame, read_frame, write_frame, write_message
from bagel.worker.parts import Codec, Contributor, Layout, decode_part, part_generator, reduce_part

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


class Refused(Exception):
    """Refuse an incoming stream; `retry`: the sender may try again (we are not ready yet)."""

    def __init__(self, reason: str, *, retry: bool = False, payload_read: bool = False):
        super().__init__(reason)
        self.reason, self.retry, self.payload_read = reason, retry, payload_read


@dataclass
class Reduction:
    """One exchange as seen by this peer: its own part's reduction and the byte counters."""

    tag: dp.ExchangeTag
    me: str
    contributors: tuple[Contributor, ...]
    index: int  # our position = the part we reduce
    bounds: list[tuple[int, int]]
    codec: Codec
    reducer: Reducer
    layout: Layout
    deadline: float  # event-loop time: the caller's deadline
    reduce_deadline: float  # a little earlier: the verdict on missing contributions reaches everyone in time
    accepted: dict[str, tuple[float, torch.Tensor]] = field(default_factory=dict)
    digests: dict[str, bytes] = field(default_factory=dict)
    excluded: dict[str, str] = field(default_factory=dict)
    complete: asyncio.Event = field(default_factory=asyncio.Event)
    result: asyncio.Future = field(default_factory=lambda: asyncio.get_running_loop().create_future())
    streams: dict[str, int] = field(default_factory=dict)
    replies_pending: int = 0
    replies_done: asyncio.Event = field(default_factory=asyncio.Event)
    bytes_sent: int = 0
    bytes_received: int = 0
    # the audit of our part for the coordinator (robust/audit.py): computed when
    # `audit_blocks` (the run's audit.sketch_blocks) is set, once the part is reduced
    audit_blocks: int = 0
    audit: PartAudit | None = None

    @property
    def numel(self) -> int:
        s, e = self.bounds[self.index]
        return e - s

    @property
    def by_worker(self) -> dict[str, Contributor]:
        return {c.worker_id: c for c in self.contributors}

    def missing(self) -> list[str]:
        return [
            c.worker_id
            for c in self.contributors
            if c.worker_id not in self.accepted and c.worker_id not in self.excluded
        ]

    def exclude(self, sender: str, reason: str) -> None:
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
            self._check_complete()

    def accept(self, sender: str, weight: float, part: torch.Tensor) -> None:
        try:
            self.reducer.validate(part, self.numel)
        except PartRejected as e:
            self.exclude(sender, e.reason)
            return
        self.accepted[sender] = (clamp_weight(weight, self.by_worker[sender].max_samples), part)
        self._check_complete()

    def _check_complete(self) -> None:
        if not self.missing():
            self.complete.set()

    def header_problem(self, h: dp.ContributionHeader) -> str:
        """Why a contributor's header is inconsistent with ours ('' when it is fine)."""
        c = self.codec
        if h.num_parts != len(self.contributors) or h.total_numel != self.layout.total:
            ours = f"{len(self.contributors)} parts of {self.layout.total}"
            return f"sender has {h.num_parts} parts of {h.total_numel} elements, we have {ours}"
        if h.part_numel != self.numel:
            return f"part has {h.part_numel} elements, expected {self.numel}"
        if h.layout_digest != self.layout.digest:
            return "different tensor layout (model)"
        if h.codec != c.name:
            return f"codec {h.codec!r}, the run uses {c.name!r}"
        if not (math.isfinite(h.weight) and h.weight > 0):
            return f"weight {h.weight} is not positive"
        if not 0 < h.payload_nbytes <= c.encoded_nbytes(self.numel):
            return f"payload of {h.payload_nbytes} bytes, limit {c.encoded_nbytes(self.numel)}"
        return ""

    def fail(self, reason: str, missing: Sequence[str] = ()) -> None:
        if not self.result.done():
            header = dp.ReducedHeader(
                status=dp.STATUS_FAILED, reason=reason, tag=self.tag, part=self.index, missing=sorted(missing)
            )
            self.result.set_result((header, b""))

    def release(self) -> None:
        """Drop the decoded parts once the exchange is over (the reply bytes stay for re-attaching senders)."""
        for sender, (weight, _) in self.accepted.items():
            self.accepted[sender] = (weight, torch.empty(0))

    async def reduce_own(self) -> tuple[torch.Tensor, dp.ReducedHeader]:
        """Wait for every contribution to our part, aggregate, encode once, decode what we send."""
        if self.numel == 0:
            return torch.zeros(0), dp.ReducedHeader(status=dp.STATUS_OK, tag=self.tag, part=self.index)
        try:
            await asyncio.wait_for(
                self.complete.wait(), max(0.0, self.reduce_deadline - asyncio.get_running_loop().time())
            )
        except TimeoutError:
            missing = self.missing()
            self.fail(f"no contribution to part {self.index} from {missing}", missing)
            raise ExchangeTimeout(missing, f"at our part {self.index}") from None
        names = sorted(self.accepted)
        screening = await asyncio.to_thread(self.reducer.screen, [self.accepted[n][1] for n in names])
        for i, reason in screening.excluded:  # norm far outside the group's: out, like a bad part
            del self.accepted[names[i]]
            self.exclude(names[i], reason)
        names = [names[i] for i in screening.kept]
        if not names:
            self.fail(f"no valid contribution to part {self.index}: {self.excluded}")
        else:
            parts = [self.accepted[n][1] for n in names]
            weights = [self.accepted[n][0] for n in names]
            t = self.tag
            gen = part_generator(t.run_id, t.cell_id, t.round, t.round_attempt, t.reduce_attempt, "result", self.index)
            payload = await asyncio.to_thread(reduce_part, self.codec, self.reducer, parts, weights, gen)
            if self.audit_blocks:
                self.audit = await asyncio.to_thread(
                    part_audit,
                    t.run_id,
                    self.index,
                    self.bounds[self.index][0],
                    self.layout.total,
                    self.audit_blocks,
                    {n: self.accepted[n][1] for n in names},
                    dict(self.excluded),
                )
            header = dp.ReducedHeader(
                status=dp.STATUS_OK,
                tag=self.tag,
                part=self.index,
                payload_nbytes=len(payload),
                included=names,
                excluded=[dp.Exclusion(sender=k, reason=v) for k, v in sorted(self.excluded.items())],
                total_weight=sum(weights),
                reducer_rule=self.reducer.spec(),
            )
            if not self.result.done():
                self.result.set_result((header, payload))
        header, payload = await self.result
        if header.status != dp.STATUS_OK:
            raise ExchangeFailed(f"part {self.index} (ours): {header.reason}")
        return await asyncio.to_thread(decode_part, self.codec, payload, self.numel), header

    async def serve(
        self,
        h: dp.ContributionHeader,
        nbytes: int,
        remote: PeerID,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
    ) -> None:
        c = self.by_worker.get(h.sender)
        if c is None or h.sender == self.me:
            raise Refused(f"{h.sender!r} is not a contributor of this exchange")
        if remote.to_base58() != c.peer_id:
            raise Refused(f"peer {remote} is not {h.sender}'s peer")
        if h.part != self.index:
            raise Refused(f"part {h.part} is reduced by another contributor (we reduce {self.index})")
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
                    if h.weight == 0 and h.payload_nbytes == 0:
                        problem = "abstained (non-finite delta or no samples)"
                    self.exclude(h.sender, problem)
                    unread = h.payload_nbytes
                else:
                    buf = await read_frame(reader, h.payload_nbytes)
                    self.bytes_received += LEN_NBYTES + len(buf)
                    digest = hashlib.sha256(repr(h.weight).encode() + buf).digest()
                    if h.sender in self.digests:
                        if self.digests[h.sender] != digest:
                            raise Refused(
                                "a different contribution from this sender was already received", payload_read=True
                            )
                    elif h.sender not in self.excluded and h.sender not in self.accepted and not self.result.done():
                        self.digests[h.sender] = digest
                        try:
                            if len(buf) != h.payload_nbytes:
                                raise PartRejected("payload shorter than announced")
                            part = await asyncio.to_thread(decode_part, self.codec, buf, self.numel)
                        except PartRejected as e:
                            self.exclude(h.sender, e.reason)
                        else:
                            self.accept(h.sender, h.weight, part)
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
