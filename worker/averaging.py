"""Group all-reduce of a cell's pseudo-gradient over hivemind's libp2p streams.

Why not hivemind's `DecentralizedAverager`: its reducer keeps its own part unencoded while
the others receive it encoded, so with a lossy codec replicas end up different (design §11),
and it does not validate what peers send. This module is our own butterfly all-reduce
(reduce-scatter then all-gather, as in hivemind's `averaging/allreduce.py` and Horovod),
written so that every contributor applies the *same decoded bytes*:

1. The delta tensors are flattened in sorted-name order into one float32 vector (`Layout`)
   and split into |C| contiguous parts (`part_bounds`); contributor i reduces part i.
2. Reduce-scatter: each contributor adds its error-feedback residual, encodes every part
   with the run's codec and sends part j to contributor j (`/bagel/dataplane/v1/part`).
   The reducer decodes every contribution, its own included (it encodes and decodes its own
   part too), so the result never depends on who reduces.
3. The reducer validates each part and aggregates the kept ones with a pluggable rule
   (`reducers.py`; weights = samples clamped to the member's max_samples, sorted-sender
   order), encodes the result once and sends those bytes back on every stream; every
   contributor, the reducer too, applies `decode(those bytes)`. Result: a bit-identical
   averaged delta on every contributor.

The contributor set is frozen by the coordinator (sorted worker ids, peer addresses and
budgets, with `reduce_attempt`); we exchange with exactly that set. A contributor that
dies or hangs makes `all_reduce` raise `ExchangeTimeout` (naming it) by the caller's
deadline, never hang; the caller reports `failed=True` and the coordinator re-freezes or
aborts. A member whose own delta is not finite abstains (weight 0, no payload), so the
others finish without waiting for it, and it still receives the average.

Wire format: `protocol/dataplane.proto`; framing with size limits: `framing.py`.
Bytes per member per round (n elements, k = |C| contributors, enc(m) = codec bytes for m
elements, h ~ 0.2 KiB of headers per stream):
sent = sum_{j != i} enc(n_j) + (k-1) enc(n_i) + 2(k-1)h, received the same with i and j
swapped; with equal parts that is about 2 (k-1)/k enc(n) each way.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

from bagel.compression import decode, get_codec
from bagel.protocol import dataplane_pb2 as dp
from bagel.worker.framing import LEN_NBYTES, FrameError, read_frame, read_message, write_frame, write_message
from bagel.worker.reducers import PartRejected, Reducer, get_reducer

log = logging.getLogger(__name__)

PART_PROTOCOL = "/bagel/dataplane/v1/part"
# A peer that is down, restarting or whose stream broke: retried until the deadline.
_RETRYABLE = (ConnectionError, OSError, FrameError, asyncio.IncompleteReadError, P2PDaemonError)
_FINISHED_KEPT = 16  # finished exchanges kept so a contributor whose stream broke can re-attach


# ---------------------------------------------------------------- errors


class ExchangeError(Exception):
    """The exchange did not produce an averaged delta; report the round as failed."""


class ExchangeTimeout(ExchangeError):
    """The deadline passed before every contribution and averaged part arrived."""

    def __init__(self, missing: Sequence[str], detail: str = ""):
        self.missing = tuple(sorted(missing))
        super().__init__(f"exchange timed out waiting for {list(self.missing)}" + (f": {detail}" if detail else ""))


class ContributionRejected(ExchangeError):
    """A reducer refused our contribution outright (not a contributor, stale, wrong part, ...)."""

    def __init__(self, reducer: str, reason: str):
        self.reducer, self.reason = reducer, reason
        super().__init__(f"reducer {reducer} rejected our contribution: {reason}")


class ExchangeFailed(ExchangeError):
    """A reducer reported failure, or sent an averaged part we cannot accept."""


# ---------------------------------------------------------------- codecs


class Codec(Protocol):
    """The slice of `bagel.compression.Codec` the data plane uses."""

    @property
    def name(self) -> str: ...

    def encode(self, t: torch.Tensor, *, generator: torch.Generator | None = None) -> bytes: ...

    def encoded_nbytes(self, numel: int) -> int: ...


def resolve_codec(codec: str | Codec) -> Codec:
    """A codec object from its name (`bagel.compression.get_codec`), or the object itself."""
    return get_codec(codec) if isinstance(codec, str) else codec


def _decode(codec: Codec, buf: bytes, numel: int) -> torch.Tensor:
    """Decode with the codec's own `decode` if it has one (test stand-ins), else the module's."""
    dec = getattr(codec, "decode", None)
    try:
        t = dec(buf, max_elements=numel) if dec is not None else decode(buf, max_elements=numel)
    except (ValueError, RuntimeError, TypeError) as e:  # CodecError is a ValueError; stand-ins may differ
        raise PartRejected(f"undecodable payload: {e}") from e
    return t.reshape(-1).clone()  # decode may return a view of the immutable buffer


def _generator(*key: object) -> torch.Generator:
    """A generator seeded from the exchange coordinates, so stochastic codecs are reproducible."""
    seed = int.from_bytes(hashlib.sha256("|".join(map(str, key)).encode()).digest()[:8], "big") >> 1
    return torch.Generator().manual_seed(seed)


# ---------------------------------------------------------------- layout


@dataclass(frozen=True)
class Layout:
    """Names and shapes of the delta tensors, in the flattening order (sorted names)."""

    names: tuple[str, ...]
    shapes: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, tensors: Mapping[str, torch.Tensor]) -> Layout:
        names = tuple(sorted(tensors))
        return cls(names, tuple(tuple(tensors[n].shape) for n in names))

    @property
    def numels(self) -> tuple[int, ...]:
        return tuple(math.prod(s) for s in self.shapes)

    @property
    def total(self) -> int:
        return sum(self.numels)

    @property
    def digest(self) -> str:
        text = ";".join(f"{n}:{','.join(map(str, s))}" for n, s in zip(self.names, self.shapes))
        return hashlib.sha256(text.encode()).hexdigest()

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if set(tensors) != set(self.names):
            raise ValueError(f"tensor names differ from the layout: {sorted(set(tensors) ^ set(self.names))}")
        return torch.cat([tensors[n].detach().to("cpu", torch.float32).reshape(-1) for n in self.names])

    def unflatten(self, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        if flat.numel() != self.total:
            raise ValueError(f"flat vector has {flat.numel()} elements, layout has {self.total}")
        out, start = {}, 0
        for name, shape, n in zip(self.names, self.shapes, self.numels):
            out[name] = flat[start : start + n].reshape(shape).clone()
            start += n
        return out


def part_bounds(total: int, parts: int) -> list[tuple[int, int]]:
    """Split [0, total) into `parts` contiguous ranges; the first total % parts get one more."""
    if parts < 1:
        raise ValueError("at least one part")
    base, extra = divmod(total, parts)
    bounds, start = [], 0
    for i in range(parts):
        end = start + base + (1 if i < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


# ---------------------------------------------------------------- public types


@dataclass(frozen=True)
class Contributor:
    """One member of the frozen contributor set (from the coordinator's `Member`)."""

    worker_id: str
    peer_id: str  # base58 libp2p peer id
    maddrs: tuple[str, ...] = ()
    max_samples: int = 1

    @classmethod
    def from_member(cls, member: Any) -> Contributor:
        """From a `bagel_pb2.Member`."""
        return cls(member.worker_id, member.peer.peer_id, tuple(member.peer.maddrs), int(member.max_samples))


@dataclass(frozen=True)
class Exclusion:
    part: int
    sender: str
    reason: str


@dataclass
class ExchangeResult:
    averaged: dict[str, torch.Tensor]  # the averaged delta, bit-identical on every contributor
    residual: dict[str, torch.Tensor]  # compensated - decode(encode(compensated)) of our contribution
    bytes_sent: int
    bytes_received: int
    excluded: tuple[Exclusion, ...] = ()  # contributions some reducer left out, and why
    total_weights: tuple[float, ...] = ()  # per part: sum of the clamped weights aggregated
    abstained: str = ""  # non-empty: our delta was not finite, we contributed nothing (the reason)
    comm_s: float = 0.0


def group_digest(contributors: Sequence[Contributor]) -> str:
    """Binds an exchange to one frozen contributor set: every member must see the same one."""
    text = "|".join(f"{c.worker_id},{c.peer_id},{c.max_samples}" for c in contributors)
    return hashlib.sha256(text.encode()).hexdigest()[:32]


# ---------------------------------------------------------------- the reducer's side of one exchange


class _Reject(Exception):
    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


@dataclass
class _Session:
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

    @property
    def numel(self) -> int:
        s, e = self.bounds[self.index]
        return e - s

    @property
    def by_worker(self) -> dict[str, Contributor]:
        return {c.worker_id: c for c in self.contributors}

    def missing(self) -> list[str]:
        return [c.worker_id for c in self.contributors if c.worker_id not in self.accepted and c.worker_id not in self.excluded]

    def exclude(self, sender: str, reason: str) -> None:
        if sender not in self.accepted and sender not in self.excluded:
            log.warning("exchange %s/%d: excluding %s from part %d: %s", self.tag.cell_id, self.tag.round, sender, self.index, reason)
            self.excluded[sender] = reason
            self._check_complete()

    def accept(self, sender: str, weight: float, part: torch.Tensor) -> None:
        try:
            self.reducer.validate(part, self.numel)
        except PartRejected as e:
            self.exclude(sender, e.reason)
            return
        self.accepted[sender] = (min(weight, float(self.by_worker[sender].max_samples)), part)
        self._check_complete()

    def _check_complete(self) -> None:
        if not self.missing():
            self.complete.set()

    def header_problem(self, h: dp.ContributionHeader) -> str:
        """Why a contributor's header is inconsistent with ours ('' when it is fine)."""
        c = self.codec
        if h.num_parts != len(self.contributors) or h.total_numel != self.layout.total:
            return f"sender has {h.num_parts} parts of {h.total_numel} elements, we have {len(self.contributors)} of {self.layout.total}"
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
            header = dp.ReducedHeader(status=dp.STATUS_FAILED, reason=reason, tag=self.tag, part=self.index, missing=sorted(missing))
            self.result.set_result((header, b""))


# ---------------------------------------------------------------- the data plane


class DataPlane:
    """Serves and runs group exchanges of pseudo-gradients on one hivemind P2P instance.

    Create one per worker process (on `await dht.replicate_p2p()`), `await start()`, then
    call `all_reduce` for each ORDER_REDUCE; `await close()` on shutdown.
    """

    def __init__(
        self,
        p2p: P2P,
        run_id: str,
        *,
        reducer: str | Reducer = "mean",
        pending_wait_s: float = 30.0,
        max_pending_streams: int = 64,
        header_timeout_s: float = 10.0,
        reply_grace_s: float = 5.0,
    ):
        self.p2p = p2p
        self.run_id = run_id
        self.reducer = get_reducer(reducer) if isinstance(reducer, str) else reducer
        self.pending_wait_s = pending_wait_s
        self.max_pending_streams = max_pending_streams
        self.header_timeout_s = header_timeout_s
        self.reply_grace_s = reply_grace_s
        self._sessions: dict[tuple[str, int, int, int], _Session] = {}
        self._finished: OrderedDict[tuple[str, int, int, int], _Session] = OrderedDict()
        self._latest: dict[str, tuple[int, int, int]] = {}  # cell -> newest (round, round_attempt, reduce_attempt)
        self._session_added = asyncio.Condition()
        self._pending = 0
        self._started = False
        self._closed = False

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58()

    async def start(self) -> None:
        if not self._started:
            await self.p2p.add_binary_stream_handler(PART_PROTOCOL, self._on_part_stream)
            self._started = True

    async def close(self) -> None:
        self._closed = True
        for s in list(self._sessions.values()):
            s.fail("the reducer is shutting down")
        async with self._session_added:  # wake streams waiting for an exchange: they are refused
            self._session_added.notify_all()
        if self._started:
            self._started = False
            try:
                await self.p2p.remove_binary_stream_handler(PART_PROTOCOL)
            except Exception as e:  # the daemon may already be gone at shutdown
                log.debug("removing the part handler failed: %s", e)

    async def __aenter__(self) -> DataPlane:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ------------------------------------------------------------ caller side

    async def all_reduce(
        self,
        *,
        worker_id: str,
        cell_id: str,
        round: int,
        round_attempt: int,
        reduce_attempt: int,
        contributors: Sequence[Contributor],
        delta: Mapping[str, torch.Tensor],
        weight: float,
        codec: str | Codec,
        timeout_s: float,
        error_feedback: Any = None,
    ) -> ExchangeResult:
        """Average `delta` over exactly `contributors`; every one of them gets the same bits.

        weight: samples processed (clamped by each reducer to our max_samples).
        error_feedback: a `bagel.compression.ErrorFeedback` (or None); we encode
        delta + residual, and on success store the new residual per tensor name.
        round_attempt / reduce_attempt: from the Instruction; together with (cell, round)
        they name the exchange, so a re-run or re-frozen round never mixes with an old one.
        Raises ExchangeTimeout, ContributionRejected or ExchangeFailed (all ExchangeError)
        on failure, ValueError on bad arguments; never hangs past timeout_s.
        """
        if not self._started:
            raise RuntimeError("DataPlane.start() was not awaited")
        members = tuple(sorted(contributors, key=lambda c: c.worker_id))
        ids = [c.worker_id for c in members]
        if len(set(ids)) != len(ids):
            raise ValueError(f"duplicate contributors: {ids}")
        if worker_id not in ids:
            raise ValueError(f"{worker_id} is not among the contributors {ids}")
        if not delta:
            raise ValueError("empty delta")
        if timeout_s <= 0:
            raise ExchangeTimeout(ids, "no time left before the reduce deadline")
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + timeout_s
        codec_obj = resolve_codec(codec)
        layout = Layout.of(delta)
        bounds = part_bounds(layout.total, len(members))
        index = ids.index(worker_id)
        tag = dp.ExchangeTag(
            run_id=self.run_id, cell_id=cell_id, round=round, round_attempt=round_attempt,
            reduce_attempt=reduce_attempt, group_digest=group_digest(members),
        )
        compensated = {n: (error_feedback.compensate(n, t) if error_feedback is not None else t) for n, t in delta.items()}
        flat = layout.flatten(compensated)
        abstained = "" if bool(torch.isfinite(flat).all()) and weight > 0 else "non-finite delta or no samples"
        gen_key = (self.run_id, cell_id, round, round_attempt, reduce_attempt, worker_id)
        payloads, own_decoded = await asyncio.to_thread(_encode_parts, codec_obj, flat, bounds, gen_key, abstained)

        key = (cell_id, round, round_attempt, reduce_attempt)
        # Reducers give up on missing contributions a little before the caller's deadline, so
        # every contributor learns *who* was missing instead of just timing out on each other.
        reduce_deadline = deadline - min(1.0, 0.2 * timeout_s)
        session = _Session(tag, worker_id, members, index, bounds, codec_obj, self.reducer, layout, deadline, reduce_deadline)
        self._sessions[key] = session
        self._finished.pop(key, None)
        self._latest[cell_id] = max(self._latest.get(cell_id, key[1:]), key[1:])
        async with self._session_added:
            self._session_added.notify_all()
        dial = asyncio.create_task(_dial_all(self.p2p, members, worker_id))

        if abstained:
            session.exclude(worker_id, abstained)
        elif session.numel:
            session.accept(worker_id, float(weight), own_decoded[index])
        client_bytes = [0, 0]
        await asyncio.wait({dial}, timeout=min(2.0, timeout_s / 4))  # then exchange anyway: streams retry
        tasks: dict[int, asyncio.Task] = {index: asyncio.create_task(self._reduce_own(session))}
        for j, c in enumerate(members):
            if j != index and bounds[j][0] != bounds[j][1]:
                header = dp.ContributionHeader(
                    tag=tag, sender=worker_id, part=j, num_parts=len(members), total_numel=layout.total,
                    part_numel=bounds[j][1] - bounds[j][0], layout_digest=layout.digest, codec=codec_obj.name,
                    weight=0.0 if abstained else float(weight), payload_nbytes=len(payloads[j]),
                )
                tasks[j] = asyncio.create_task(self._exchange_part(c, header, payloads[j], codec_obj, client_bytes))
        try:
            await asyncio.wait(tasks.values(), timeout=max(0.0, deadline - loop.time()), return_when=asyncio.FIRST_EXCEPTION)
            for t in tasks.values():  # a definite failure (rejection, reducer failure) wins over a timeout
                if t.done() and t.exception() is not None:
                    raise t.exception()  # type: ignore[misc]
            late = [members[j].worker_id for j, t in tasks.items() if not t.done() and j != index]
            if late or not tasks[index].done():
                raise ExchangeTimeout(set(late) | (set(session.missing()) - {worker_id}))
            done = [t.result() for t in tasks.values()]
        finally:
            for t in (*tasks.values(), dial):
                t.cancel()
            session.fail("the exchange ended at this reducer before its part was reduced")
            self._sessions.pop(key, None)
            self._finished[key] = session
            while len(self._finished) > _FINISHED_KEPT:
                self._finished.popitem(last=False)

        parts: dict[int, torch.Tensor] = {}
        excluded: list[Exclusion] = []
        weights: dict[int, float] = {}
        for j, (part, reply) in zip(tasks, done):
            parts[j] = part
            weights[j] = reply.total_weight
            excluded += [Exclusion(j, e.sender, e.reason) for e in reply.excluded]
        pieces = [parts[j] if j in parts else torch.zeros(0) for j in range(len(members))]
        averaged = layout.unflatten(torch.cat(pieces))
        if session.replies_pending:
            try:
                await asyncio.wait_for(session.replies_done.wait(), min(self.reply_grace_s, max(0.0, deadline - loop.time())))
            except TimeoutError:
                log.debug("some contributors did not take their averaged part in time")
        if abstained:
            residual = {n: torch.zeros(s) for n, s in zip(layout.names, layout.shapes)}
            if error_feedback is not None:
                for n in layout.names:
                    error_feedback.update(n, residual[n], residual[n])
        else:
            decoded_flat = torch.cat(own_decoded)
            residual = layout.unflatten(flat - decoded_flat)
            if error_feedback is not None:
                decoded = layout.unflatten(decoded_flat)
                for n in layout.names:
                    error_feedback.update(n, compensated[n].detach().to("cpu", torch.float32), decoded[n])
        return ExchangeResult(
            averaged=averaged,
            residual=residual,
            bytes_sent=client_bytes[0] + session.bytes_sent,
            bytes_received=client_bytes[1] + session.bytes_received,
            excluded=tuple(sorted(excluded, key=lambda e: (e.part, e.sender))),
            total_weights=tuple(weights.get(j, 0.0) for j in range(len(members))),
            abstained=abstained,
            comm_s=loop.time() - started,
        )

    async def _reduce_own(self, s: _Session) -> tuple[torch.Tensor, dp.ReducedHeader]:
        """Wait for every contribution to our part, aggregate, encode once, decode what we send."""
        if s.numel == 0:
            return torch.zeros(0), dp.ReducedHeader(status=dp.STATUS_OK, tag=s.tag, part=s.index)
        try:
            await asyncio.wait_for(s.complete.wait(), max(0.0, s.reduce_deadline - asyncio.get_running_loop().time()))
        except TimeoutError:
            missing = s.missing()
            s.fail(f"no contribution to part {s.index} from {missing}", missing)
            raise ExchangeTimeout(missing, f"at our part {s.index}") from None
        names = sorted(s.accepted)
        if not names:
            s.fail(f"no valid contribution to part {s.index}: {s.excluded}")
        else:
            parts = [s.accepted[n][1] for n in names]
            weights = [s.accepted[n][0] for n in names]
            t = s.tag
            gen = _generator(t.run_id, t.cell_id, t.round, t.round_attempt, t.reduce_attempt, "result", s.index)
            payload = await asyncio.to_thread(lambda: s.codec.encode(s.reducer.aggregate(parts, weights), generator=gen))
            header = dp.ReducedHeader(
                status=dp.STATUS_OK, tag=s.tag, part=s.index, payload_nbytes=len(payload), included=names,
                excluded=[dp.Exclusion(sender=k, reason=v) for k, v in sorted(s.excluded.items())],
                total_weight=sum(weights), reducer_rule=s.reducer.spec(),
            )
            if not s.result.done():
                s.result.set_result((header, payload))
        header, payload = await s.result
        if header.status != dp.STATUS_OK:
            raise ExchangeFailed(f"part {s.index} (ours): {header.reason}")
        return await asyncio.to_thread(_decode, s.codec, payload, s.numel), header

    async def _exchange_part(
        self, c: Contributor, header: dp.ContributionHeader, payload: bytes, codec: Codec, counters: list[int]
    ) -> tuple[torch.Tensor, dp.ReducedHeader]:
        """Send our contribution to reducer c and receive its averaged part; retry broken streams."""
        delay = 0.05
        while True:
            try:
                return await self._try_exchange_part(c, header, payload, codec, counters)
            except _RETRYABLE as e:
                log.debug("part %d to %s: %s; retrying", header.part, c.worker_id, e)
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _try_exchange_part(
        self, c: Contributor, header: dp.ContributionHeader, payload: bytes, codec: Codec, counters: list[int]
    ) -> tuple[torch.Tensor, dp.ReducedHeader]:
        _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(c.peer_id), PART_PROTOCOL)
        try:
            counters[0] += await write_message(writer, header)
            if payload:
                counters[0] += await write_frame(writer, payload)
            reply, n = await read_message(reader, dp.ReducedHeader)
            counters[1] += n
            if reply.status == dp.STATUS_REJECTED:
                raise ContributionRejected(c.worker_id, reply.reason)
            if reply.status == dp.STATUS_FAILED and reply.missing:
                raise ExchangeTimeout(reply.missing, f"reported by reducer {c.worker_id} of part {header.part}")
            if reply.status != dp.STATUS_OK:
                raise ExchangeFailed(f"reducer {c.worker_id} (part {header.part}) failed: {reply.reason}")
            limit = codec.encoded_nbytes(header.part_numel)
            if reply.part != header.part or not 0 < reply.payload_nbytes <= limit:
                raise ExchangeFailed(f"reducer {c.worker_id} sent a bad reply header (part {reply.part}, {reply.payload_nbytes} bytes)")
            buf = await read_frame(reader, reply.payload_nbytes)
            counters[1] += LEN_NBYTES + len(buf)
            if len(buf) != reply.payload_nbytes:
                raise ExchangeFailed(f"reducer {c.worker_id} sent {len(buf)} bytes, announced {reply.payload_nbytes}")
            try:
                part = await asyncio.to_thread(_decode, codec, buf, header.part_numel)
                self.reducer.validate(part, header.part_numel)
            except PartRejected as e:
                raise ExchangeFailed(f"reducer {c.worker_id} sent an unusable averaged part: {e.reason}") from e
            return part, reply
        finally:
            writer.close()

    # ------------------------------------------------------------ reducer side (incoming streams)

    async def _on_part_stream(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        header = None
        try:
            header, nbytes = await asyncio.wait_for(read_message(reader, dp.ContributionHeader), self.header_timeout_s)
            session = await self._session_for(header.tag)
            await self._serve(session, header, nbytes, info.peer_id, reader, writer)
        except _Reject as e:
            log.info("rejected a contribution from %s: %s", info.peer_id, e.reason)
            reply = dp.ReducedHeader(status=dp.STATUS_REJECTED, reason=e.reason)
            if header is not None:
                reply.tag.CopyFrom(header.tag)
                reply.part = header.part
            try:
                await write_message(writer, reply)
            except _RETRYABLE:
                pass
        except (*_RETRYABLE, TimeoutError) as e:
            log.debug("part stream from %s ended: %s", info.peer_id, e)
        except asyncio.CancelledError:
            # the P2P client is closing under us: end this stream's task quietly (it is the top
            # of its task, so nothing above waits for the cancellation)
            log.debug("part stream from %s cancelled at shutdown", info.peer_id)
        finally:
            writer.close()

    async def _session_for(self, tag: dp.ExchangeTag) -> _Session:
        if tag.run_id != self.run_id:
            raise _Reject(f"wrong run {tag.run_id!r}")
        key = (tag.cell_id, tag.round, tag.round_attempt, tag.reduce_attempt)

        def lookup() -> _Session | None:
            return self._sessions.get(key) or self._finished.get(key)

        s = lookup()
        if s is None:
            latest = self._latest.get(tag.cell_id)
            if latest is not None and key[1:] < latest:
                raise _Reject(f"stale exchange (round, round_attempt, reduce_attempt) = {key[1:]}, we are at {latest}")
            if self._pending >= self.max_pending_streams:
                raise _Reject("too many contributions waiting for exchanges not started here")
            # The reducer may get ORDER_REDUCE a heartbeat later than the sender: hold the
            # stream (only its small header is read) until our exchange starts, briefly.
            self._pending += 1
            try:
                async with self._session_added:
                    await asyncio.wait_for(
                        self._session_added.wait_for(lambda: self._closed or lookup() is not None), self.pending_wait_s
                    )
            except TimeoutError:
                raise _Reject(f"unknown exchange {key}: not started here within {self.pending_wait_s}s") from None
            finally:
                self._pending -= 1
            s = lookup()
            if s is None:
                raise _Reject("this peer is shutting down")
        if tag.group_digest != s.tag.group_digest:
            raise _Reject("a different contributor set for this exchange")
        return s

    async def _serve(
        self, s: _Session, h: dp.ContributionHeader, nbytes: int, remote: PeerID, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        c = s.by_worker.get(h.sender)
        if c is None or h.sender == s.me:
            raise _Reject(f"{h.sender!r} is not a contributor of this exchange")
        if remote.to_base58() != c.peer_id:
            raise _Reject(f"peer {remote} is not {h.sender}'s peer")
        if h.part != s.index:
            raise _Reject(f"part {h.part} is reduced by another contributor (we reduce {s.index})")
        if s.streams.get(h.sender, 0) >= 2:
            raise _Reject("too many concurrent streams from this sender")
        s.streams[h.sender] = s.streams.get(h.sender, 0) + 1
        s.replies_pending += 1
        s.replies_done.clear()
        try:
            s.bytes_received += nbytes
            # a little past the deadline, so a FAILED verdict still reaches the sender
            async with asyncio.timeout_at(s.deadline + 1.0):
                problem = s.header_problem(h)
                if problem:
                    if h.weight == 0 and h.payload_nbytes == 0:
                        problem = "abstained (non-finite delta or no samples)"
                    s.exclude(h.sender, problem)
                else:
                    buf = await read_frame(reader, h.payload_nbytes)
                    s.bytes_received += LEN_NBYTES + len(buf)
                    digest = hashlib.sha256(repr(h.weight).encode() + buf).digest()
                    if h.sender in s.digests:
                        if s.digests[h.sender] != digest:
                            raise _Reject("a different contribution from this sender was already received")
                    elif h.sender not in s.excluded and h.sender not in s.accepted:
                        s.digests[h.sender] = digest
                        try:
                            if len(buf) != h.payload_nbytes:
                                raise PartRejected("payload shorter than announced")
                            part = await asyncio.to_thread(_decode, s.codec, buf, s.numel)
                        except PartRejected as e:
                            s.exclude(h.sender, e.reason)
                        else:
                            s.accept(h.sender, h.weight, part)
                reply, payload = await asyncio.shield(s.result)
            s.bytes_sent += LEN_NBYTES + reply.ByteSize() + (LEN_NBYTES + len(payload) if payload else 0)
            await write_message(writer, reply)
            if payload:
                await write_frame(writer, payload)
        finally:
            s.streams[h.sender] -= 1
            s.replies_pending -= 1
            if s.replies_pending == 0:
                s.replies_done.set()


def _encode_parts(
    codec: Codec, flat: torch.Tensor, bounds: list[tuple[int, int]], gen_key: tuple, abstained: str
) -> tuple[list[bytes], list[torch.Tensor]]:
    """Encode every part of our (compensated) delta and decode it back, as the reducers will."""
    payloads: list[bytes] = []
    decoded: list[torch.Tensor] = []
    for j, (s, e) in enumerate(bounds):
        if abstained or s == e:
            payloads.append(b"")
            decoded.append(torch.zeros(e - s))
            continue
        buf = codec.encode(flat[s:e], generator=_generator(*gen_key, j))
        payloads.append(buf)
        decoded.append(_decode(codec, buf, e - s))
    return payloads, decoded


def _dial_addrs(c: Contributor) -> list[Multiaddr]:
    """The contributor's multiaddrs without their trailing /p2p/<id> (the daemon wants bare ones)."""
    out = []
    for a in c.maddrs:
        m = Multiaddr(a)
        if "p2p" in [p.name for p in m.protocols()]:
            m = m.decapsulate(Multiaddr(f"/p2p/{c.peer_id}"))
        out.append(m)
    return out


async def _dial_all(p2p: P2P, members: Sequence[Contributor], me: str) -> None:
    """Ask the daemon to dial every contributor's announced addresses (best effort).

    Peers that met through the DHT usually reach each other already; dialing the addresses
    the coordinator handed out makes a fresh peer reachable at once. `P2P` has no public
    connect, so this uses its daemon client, as hivemind's own `P2P.is_identity_taken` does.
    """

    async def dial(c: Contributor) -> None:
        try:
            await p2p._client.connect(PeerID.from_base58(c.peer_id), _dial_addrs(c))
        except Exception as e:  # the exchange's own retries report a peer that stays unreachable
            log.debug("dialing %s failed: %s", c.worker_id, e)

    await asyncio.gather(*(dial(c) for c in members if c.worker_id != me and c.maddrs))
