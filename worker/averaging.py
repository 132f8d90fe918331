"""Group all-reduce of a cell's pseudo-gradient over hivemind's libp2p streams.

Why not hivemind's `DecentralizedAverager`: its reducer keeps its own part unencoded while
the others receive it encoded, so with a lossy codec replicas end up different (design §11),
and it does not validate what peers send. This module is our own butterfly all-reduce
(reduce-scatter then all-gather, as in hivemind's `averaging/allreduce.py` and Horovod),
written so that every contributor applies the *same decoded bytes*:

1. The delta tensors are flattened in sorted-name order into one float32 vector (`Layout`)
   and split into |C| contiguous parts (`part_bounds`); contributor i reduces part i. The
   parts' sizes follow the coordinator's part weights (`Contributor.part_weight`, from the
   uplinks the peers measured, `PeerRates`): a slow uplink reduces a smaller part, so it
   sends less of the averaged result; all weights 1 is the equal split.
2. Reduce-scatter: each contributor adds its error-feedback residual, encodes every part
   with the run's codec and sends part j to contributor j (`/bagel/dataplane/v1/part`).
   The reducer decodes every contribution, its own included (it encodes and decodes its own
   part too), so the result never depends on who reduces.
3. The reducer validates each part and aggregates the kept ones with a pluggable rule
   (`aggregation.py`, the spec's `diloco.aggregation`; weights = samples clamped to the
   member's max_samples, sorted-sender order), encodes the result once and sends those
   bytes back on every stream; every contributor, the reducer too, applies
   `decode(those bytes)`. Result: a bit-identical averaged delta on every contributor.

Verified reducers (every worker process: the plane has the worker's identity). A reducer
could otherwise return anything finite and of the right size, and since every member
applies the same bytes the round would commit with them. So each part j is reduced twice,
by its primary (contributor j) and by its shadow (contributor j+d mod k, d drawn per
exchange: `bagel.robust.evidence.shadow_offset`), with the same
deterministic `bagel.robust.reduction.reduce_one_part`; every contribution header is
signed by its sender, and both reducers answer with a signed receipt (result digest, the
signed inputs). A contributor applies nothing unless sha256(primary bytes) equals the
shadow's digest for every part; otherwise `all_reduce` raises `ReducersDisagree` (naming
the part and both reducers), and where we are the other reducer of the disagreeing part it
carries the evidence the worker sends to the coordinator (`bagel.robust.evidence`). Cost:
the reduce-scatter upload doubles (each part goes to two reducers), each part is reduced
twice, the all-gather gains a ~150-byte receipt per input and part; with k = 1 there is
nothing to verify. A plane without an identity (tests of the exchange mechanics) runs
the unverified exchange: one reducer per part, no signatures; a verified reducer refuses
unsigned contributions, so the two never mix.

The contributor set is frozen by the coordinator (sorted worker ids, peer addresses and
budgets, with `reduce_attempt`); we exchange with exactly that set. A contributor that
dies or hangs makes `all_reduce` raise `ExchangeTimeout` (naming it) by the caller's
deadline, never hang; the caller reports `failed=True` and the coordinator re-freezes or
aborts. A member whose own delta is not finite abstains (weight 0, no payload), so the
others finish without waiting for it, and it still receives the average.

Wire format: `protocol/dataplane.proto`; framing with size limits: `framing.py`; layout,
split and codec calls: `parts.py`.
Bytes per member i per round (n elements, k = |C| contributors, n_j = size of part j,
enc(m) = `codec.encoded_nbytes(m)`, h ~ 130 bytes per message: two 4-byte frame prefixes and
a protobuf header, a little more when a reply lists exclusions):
sent_i = sum_{j != i} (enc(n_j) + h) + (k-1) (enc(n_i) + h), received_i the same;
with equal parts that is about 2 (k-1)/k enc(n) each way (the butterfly optimum).
Verified, each contributor also sends its k-1 parts whose shadow is not itself to those
shadows, and receives the k-1 contributions to the part it shadows: about (k-1)/k enc(n)
more each way, plus per message ~100 bytes of key and signature and a receipt of ~250
bytes per input (measured by bench/verified_reducers.py): about 3 (k-1)/k enc(n) each way,
1.5x the butterfly in all, 2x on the reduce-scatter half.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Self

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol import dataplane_pb2 as dp
from bagel.protocol.identity import Identity
from bagel.protocol.messages import PartAudit
from bagel.protocol.relay import WireMultiaddr, dial_addrs, is_circuit
from bagel.robust.aggregation import PartRejected, Reducer, get_reducer
from bagel.robust.evidence import EvidenceError, open_receipt, shadow_of, shadow_offset, sign_contribution
from bagel.worker.framing import (
    LEN_NBYTES,
    FrameError,
    discard_frame,
    read_frame,
    read_message,
    write_frame,
    write_message,
)
from bagel.worker.parts import (
    Codec,
    Contributor,
    Layout,
    decode_part,
    group_digest,
    part_bounds,
    prepare_contribution,
    resolve_codec,
)
from bagel.worker.reducer import (
    DISCARD_MAX_NBYTES,
    DISCARD_TIMEOUT_S,
    ContributionRejected,
    ExchangeError,
    ExchangeFailed,
    ExchangeTimeout,
    ReducersDisagree,
    Reduction,
    Refused,
)

__all__ = [
    "PART_PROTOCOL",
    "Codec",
    "ContributionRejected",
    "Contributor",
    "DataPlane",
    "ExchangeError",
    "ExchangeFailed",
    "ExchangeResult",
    "ExchangeTimeout",
    "Exclusion",
    "ReducersDisagree",
    "Layout",
    "group_digest",
    "part_bounds",
]

log = logging.getLogger(__name__)

PART_PROTOCOL = "/bagel/dataplane/v1/part"


class _NotReady(Exception):
    """The reducer has not started this exchange yet (or is busy): retry until the deadline."""


# A peer that is down, restarting or whose stream broke: retried until the deadline.
_RETRYABLE = (ConnectionError, OSError, FrameError, asyncio.IncompleteReadError, P2PDaemonError, _NotReady)
_FINISHED_KEPT = 4  # finished exchanges kept so a contributor whose stream broke can re-attach


# ---------------------------------------------------------------- public types


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
    audit: PartAudit | None = None  # what we saw of the part we reduced (all_reduce's audit_blocks)
    encode_s: float = 0.0  # of comm_s: our contribution split, compensated and encoded
    # part streams we sent again after a broken stream or a reducer not ready yet: each one
    # sent its header and payload again, and bytes_sent counts them
    resends: int = 0
    # The averaged delta as it was applied, in its wire form: each part's encoded bytes as
    # its reducer sent them (b"" for an empty part), in part order, the codec's canonical
    # name and each part's element count. `averaged` is Layout.unflatten(cat(decode(part)))
    # of these in the sorted parameter order, so a holder of the same committed state can
    # apply the round from them alone (worker/catchup.py).
    parts: tuple[bytes, ...] = ()
    part_numels: tuple[int, ...] = ()
    codec: str = ""
    # what we measured, as a reducer, of each sender's contribution: (sender, payload bytes,
    # ms from its header to the payload's last byte), the larger of our two parts' streams
    # when we reduce two; the worker reports them (ReportRound.peer_rates), and the
    # coordinator sizes the senders' parts of later exchanges by them
    peer_rates: tuple[tuple[str, int, int], ...] = ()


# ---------------------------------------------------------------- the data plane


class DataPlane:
    """Serves and runs group exchanges of pseudo-gradients on one hivemind P2P instance.

    Create one per worker process (on `await dht.replicate_p2p()`), `await start()`, then
    call `all_reduce` for each ORDER_REDUCE; `await close()` on shutdown.

    reducer: the aggregation rule for the parts this peer reduces ("mean", "trimmed_mean:0.2",
    "centered_clip:rel=1,iters=10"; see aggregation.py) when an exchange names none (the
    worker names the spec's `diloco.aggregation` in `all_reduce(reducer=...)`).
    pending_wait_s: how long an incoming contribution for an exchange we have not started
    yet is held before the sender is told NOT_READY (it retries until its deadline).
    max_pending_streams: cap on such held streams. reply_grace_s: after our result is
    complete, how long we wait for the other contributors to take their averaged part (only
    so the byte counts are complete).
    """

    def __init__(
        self,
        p2p: P2P,
        run_id: str,
        *,
        reducer: str | Reducer = "mean",
        pending_wait_s: float = 5.0,
        max_pending_streams: int = 64,
        header_timeout_s: float = 10.0,
        reply_grace_s: float = 5.0,
        identity: Identity | None = None,
        doctor: float = 0.0,
    ):
        self.p2p = p2p
        self.identity = identity
        self.doctor = doctor
        self.run_id = run_id
        self.reducer = get_reducer(reducer) if isinstance(reducer, str) else reducer
        self.pending_wait_s = pending_wait_s
        self.max_pending_streams = max_pending_streams
        self.header_timeout_s = header_timeout_s
        self.reply_grace_s = reply_grace_s
        self._sessions: dict[tuple[str, int, int, int], dict[int, Reduction]] = {}  # exchange -> part -> ours
        self._finished: OrderedDict[tuple[str, int, int, int], dict[int, Reduction]] = OrderedDict()
        self._latest: dict[str, tuple[int, int, int]] = {}  # cell -> newest (round, round_attempt, reduce_attempt)
        self._session_added = asyncio.Condition()
        self._pending = 0
        # One reduction computed at a time (a verified exchange gives each worker two parts,
        # its primary and a shadow): each holds its contributions in float64 and the rule's
        # vectors, several times the part, and two at once doubled a worker's peak memory.
        self._compute_slot = asyncio.Semaphore(1)
        # Whether to dial peers' circuit-relay addresses. A directly reachable worker leaves them
        # out: a relayed peer dials it directly, and the daemon does not replace a relayed
        # connection with a direct one once it has one (go-libp2p's Connect is a no-op then).
        self.dial_circuits = True
        self._started = False
        self._closed = False

    @property
    def peer_id(self) -> str:
        return self.p2p.peer_id.to_base58()

    async def paths(self, peers: Mapping[str, str]) -> dict[str, str]:
        """How the daemon is connected to each peer (worker id -> peer id) right now: "relay"
        (a circuit through a relay), "direct", or "none"; for the logs, never for a decision."""
        try:
            conns = {p.peer_id.to_base58(): [str(a) for a in p.addrs] for p in await self.p2p._client.list_peers()}
        except Exception:  # noqa: BLE001 - an answer for the logs only
            return {}
        out = {}
        for worker_id, peer_id in peers.items():
            addrs = conns.get(peer_id)
            if peer_id == self.peer_id:
                continue
            out[worker_id] = "none" if not addrs else ("direct" if any(not is_circuit(a) for a in addrs) else "relay")
        return out

    async def start(self) -> None:
        if not self._started:
            await self.p2p.add_binary_stream_handler(PART_PROTOCOL, self._on_part_stream)
            self._started = True

    async def close(self) -> None:
        self._closed = True
        for sessions in list(self._sessions.values()):
            for s in sessions.values():
                s.fail("the reducer is shutting down")
        async with self._session_added:  # wake streams waiting for an exchange: they are refused
            self._session_added.notify_all()
        if self._started:
            self._started = False
            try:
                await self.p2p.remove_binary_stream_handler(PART_PROTOCOL)
            except Exception as e:  # noqa: BLE001 - the daemon may already be gone at shutdown
                log.debug("removing the part handler failed: %s", e)

    async def __aenter__(self) -> Self:
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
        reducer: str | Reducer | None = None,
        audit_blocks: int = 0,
        loss_probe: Any = None,
    ) -> ExchangeResult:
        """Average `delta` over exactly `contributors`; every one of them gets the same bits.

        weight: samples processed (clamped by each reducer to our max_samples).
        reducer: the aggregation rule of the part we reduce in this exchange (the run spec's
        `diloco.aggregation`); None = the plane's own (`DataPlane(reducer=...)`).
        error_feedback: a `bagel.compression.ErrorFeedback` (or None); we encode
        delta + residual, and on success store the new residual per tensor name.
        round_attempt / reduce_attempt: from the Instruction; together with (cell, round)
        they name the exchange, so a re-run or re-frozen round never mixes with an old one.
        audit_blocks: the run's audit.sketch_blocks; when set, the result carries the audit
        of the part we reduced (`robust/audit.py`), for our report to the coordinator.
        loss_probe: with audit_blocks, the loss audit of that part (`Reduction.loss_probe`).
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
        if any(c.max_samples <= 0 for c in members):
            raise ValueError(
                f"every contributor needs max_samples > 0: {[(c.worker_id, c.max_samples) for c in members]}"
            )
        if timeout_s <= 0:
            raise ExchangeTimeout(ids, "no time left before the reduce deadline")
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + timeout_s
        codec_obj = resolve_codec(codec)
        rule = self.reducer if reducer is None else reducer
        if isinstance(rule, str):
            rule = get_reducer(rule)
        index = ids.index(worker_id)
        tag = dp.ExchangeTag(
            run_id=self.run_id,
            cell_id=cell_id,
            round=round,
            round_attempt=round_attempt,
            reduce_attempt=reduce_attempt,
            group_digest=group_digest(members),
        )
        gen_key = (self.run_id, cell_id, round, round_attempt, reduce_attempt, worker_id)
        encode_started = loop.time()
        own = await asyncio.to_thread(
            prepare_contribution,
            delta,
            codec_obj,
            len(members),
            gen_key,
            weight=weight,
            error_feedback=error_feedback,
            skip=[i for i, c in enumerate(members) if c.no_reduce],
            weights=[c.part_weight for c in members],
        )
        layout, bounds, abstained, payloads = own.layout, own.bounds, own.abstained, own.payloads
        encode_s = loop.time() - encode_started

        key = (cell_id, round, round_attempt, reduce_attempt)
        # Reducers give up on missing contributions a little before the caller's deadline, so
        # every contributor learns *who* was missing instead of just timing out on each other.
        reduce_deadline = deadline - min(1.0, 0.2 * timeout_s)
        k = len(members)
        verified = self.identity is not None and k >= 2
        ident = self.identity if verified else None
        offset = shadow_offset(tag, k)
        shadowed = (index - offset) % k  # the part we reduce a second time, as its shadow (verified)
        sessions = {
            index: Reduction(
                tag,
                worker_id,
                members,
                index,
                bounds,
                codec_obj,
                rule,
                layout,
                deadline,
                reduce_deadline,
                role=dp.EVIDENCE_ROLE_PRIMARY if verified else dp.EVIDENCE_ROLE_UNSPECIFIED,
                identity=ident,
                doctor=self.doctor,
                compute_slot=self._compute_slot,
            )
        }
        if verified:
            sessions[shadowed] = Reduction(
                tag,
                worker_id,
                members,
                shadowed,
                bounds,
                codec_obj,
                rule,
                layout,
                deadline,
                reduce_deadline,
                role=dp.EVIDENCE_ROLE_SHADOW,
                identity=ident,
                compute_slot=self._compute_slot,
            )
        sessions[index].audit_blocks = audit_blocks  # the audit of the part we reduce as its primary
        sessions[index].loss_probe = loss_probe
        self._sessions[key] = sessions
        self._finished.pop(key, None)
        self._latest[cell_id] = max(self._latest.get(cell_id, key[1:]), key[1:])
        async with self._session_added:
            self._session_added.notify_all()
        dial = asyncio.create_task(_dial_all(self.p2p, members, worker_id, circuits=self.dial_circuits))
        headers = [
            self._header(tag, worker_id, j, layout, bounds, codec_obj, abstained, weight, payloads[j]) for j in range(k)
        ]
        own_tasks: dict[int, asyncio.Task] = {}
        sends: dict[tuple[int, int], asyncio.Task] = {}  # (part, position of the reducer) -> its reply
        client_bytes = [0, 0, 0]  # sent, received, part streams retried
        cancelled = False
        try:  # from here on, the finally unregisters the sessions even if the caller cancels us
            for p, session in sessions.items():
                if abstained:
                    session.exclude(worker_id, abstained, headers[p])
                elif session.numel:
                    session.accept(worker_id, float(weight), payloads[p], headers[p])
            await asyncio.wait({dial}, timeout=min(2.0, timeout_s / 4))  # then exchange anyway: streams retry
            for p, session in sessions.items():
                own_tasks[p] = asyncio.create_task(session.reduce_own())
            for j in range(k):
                if bounds[j][0] == bounds[j][1]:
                    continue
                for pos in (j, shadow_of(j, k, offset)) if verified else (j,):
                    if pos != index:
                        sends[(j, pos)] = asyncio.create_task(
                            self._exchange_part(
                                members[pos], headers[j], payloads[j], codec_obj, client_bytes, with_payload=pos == j
                            )
                        )
            every = [*own_tasks.values(), *sends.values()]
            await asyncio.wait(every, timeout=max(0.0, deadline - loop.time()), return_when=asyncio.FIRST_EXCEPTION)
            for t in every:  # a definite failure (rejection, reducer failure) wins over a timeout
                if t.done() and (exc := t.exception()) is not None:
                    raise exc
            late = {members[pos].worker_id for (_, pos), t in sends.items() if not t.done()}
            if late or not all(t.done() for t in own_tasks.values()):
                missing = {m for s in sessions.values() for m in s.missing()}
                raise ExchangeTimeout(late | (missing - {worker_id}))
            own_done = {p: t.result() for p, t in own_tasks.items()}
            sent_done = {jp: t.result() for jp, t in sends.items()}
        except asyncio.CancelledError:
            # Abandoned, not ended: keep no finished record, so a rerun of this same exchange
            # (the agent may be told it again) meets its new session, not this dead one.
            cancelled = True
            raise
        finally:
            for t in (*own_tasks.values(), *sends.values(), dial):
                t.cancel()
                if t.done() and not t.cancelled():
                    t.exception()  # retrieved: one failure is reported, the others are consequences
            for session in sessions.values():
                session.fail("the exchange ended at this reducer before its part was reduced")
            self._sessions.pop(key, None)
            if not cancelled:
                # kept only so a contributor whose stream broke can fetch our result: the
                # loss audit's closure holds the round's committed state and our delta (four
                # copies of the parameters), which four kept exchanges would hold on to
                for session in sessions.values():
                    session.loss_probe = None
                self._finished[key] = sessions
            while len(self._finished) > _FINISHED_KEPT:
                self._finished.popitem(last=False)

        try:
            replies: dict[int, tuple[bytes, dp.ReducedHeader]] = {}  # part -> the primary's bytes and reply
            shadows: dict[int, dp.ReducedHeader] = {}
            for j in range(k):
                if bounds[j][0] == bounds[j][1]:
                    replies[j] = (b"", dp.ReducedHeader(status=dp.STATUS_OK, part=j))
                    continue
                replies[j] = own_done[j] if j == index else sent_done[(j, j)]
                if verified:
                    sh = shadow_of(j, k, offset)
                    shadows[j] = own_done[j][1] if sh == index else sent_done[(j, sh)][1]
            if verified:
                self._check_agreement(tag, worker_id, members, sessions, replies, shadows, own_done)
            parts: dict[int, torch.Tensor] = {}
            for j, (buf, _reply) in replies.items():
                numel = bounds[j][1] - bounds[j][0]
                if not numel:
                    parts[j] = torch.zeros(0)
                    continue
                try:
                    part = await asyncio.to_thread(decode_part, codec_obj, buf, numel)
                    rule.validate(part, numel)
                except PartRejected as e:
                    who = members[j].worker_id
                    raise ExchangeFailed(f"reducer {who} sent an unusable averaged part: {e.reason}") from e
                parts[j] = part
        finally:
            for session in sessions.values():
                session.release()

        excluded: list[Exclusion] = []
        weights: dict[int, float] = {}
        for j, (_, reply) in replies.items():
            weights[j] = reply.total_weight
            excluded += [Exclusion(j, e.sender, e.reason) for e in reply.excluded]
        # views of the one averaged vector (the outer step only reads them)
        averaged = layout.unflatten(torch.cat([parts[j] for j in range(k)]), copy=False)
        pending = [s for s in sessions.values() if s.replies_pending]
        if pending:
            try:
                await asyncio.wait_for(
                    asyncio.gather(*(s.replies_done.wait() for s in pending)),
                    min(self.reply_grace_s, max(0.0, deadline - loop.time())),
                )
            except TimeoutError:
                log.debug("some contributors did not take their averaged part in time")
        if error_feedback is not None:
            own.commit_error_feedback(error_feedback)
        return ExchangeResult(
            averaged=averaged,
            residual=own.residual(),
            bytes_sent=client_bytes[0] + sum(s.bytes_sent for s in sessions.values()),
            bytes_received=client_bytes[1] + sum(s.bytes_received for s in sessions.values()),
            excluded=tuple(sorted(excluded, key=lambda e: (e.part, e.sender))),
            total_weights=tuple(weights.get(j, 0.0) for j in range(k)),
            abstained=abstained,
            comm_s=loop.time() - started,
            audit=sessions[index].audit,
            encode_s=encode_s,
            resends=client_bytes[2],
            parts=tuple(replies[j][0] for j in range(k)),
            part_numels=tuple(e - s for s, e in bounds),
            codec=codec_obj.name,
            peer_rates=_peer_rates(sessions.values()),
        )

    def _header(
        self,
        tag: dp.ExchangeTag,
        worker_id: str,
        j: int,
        layout: Layout,
        bounds: list[tuple[int, int]],
        codec: Codec,
        abstained: str,
        weight: float,
        payload: bytes,
    ) -> dp.ContributionHeader:
        """Our contribution header for part j, signed in a verified exchange."""
        h = dp.ContributionHeader(
            tag=tag,
            sender=worker_id,
            part=j,
            num_parts=len(bounds),
            total_numel=layout.total,
            part_numel=bounds[j][1] - bounds[j][0],
            layout_digest=layout.digest,
            codec=codec.name,
            weight=0.0 if abstained else float(weight),
            payload_nbytes=len(payload),
            payload_sha256=hashlib.sha256(payload).digest() if payload else b"",
        )
        if self.identity is not None:
            sign_contribution(self.identity, h)
        return h

    def _check_agreement(
        self,
        tag: dp.ExchangeTag,
        me: str,
        members: Sequence[Contributor],
        sessions: Mapping[int, Reduction],
        replies: Mapping[int, tuple[bytes, dp.ReducedHeader]],
        shadows: Mapping[int, dp.ReducedHeader],
        own: Mapping[int, tuple[bytes, dp.ReducedHeader]],
    ) -> None:
        """Apply nothing unless every part's primary bytes hash to its shadow's signed digest.

        Where we are the other reducer of a part that disagrees, we hold its signed inputs
        and the disagreeing reducer's signed receipt: that is evidence for the coordinator.
        """
        k = len(members)
        problems: list[str] = []
        evidence: list[pb.EvidenceRequest] = []
        for j, sh_reply in shadows.items():
            buf, reply = replies[j]
            primary, shadow = members[j].worker_id, members[shadow_of(j, k, shadow_offset(tag, k))].worker_id
            digest = hashlib.sha256(buf).digest()
            claims: dict[int, dp.EvidenceReceipt | None] = {}
            for role, who, rep in (
                (dp.EVIDENCE_ROLE_PRIMARY, primary, reply),
                (dp.EVIDENCE_ROLE_SHADOW, shadow, sh_reply),
            ):
                try:
                    r = open_receipt(rep.receipt, rep.receipt_signature, rep.reducer_public_key)
                except EvidenceError:
                    r = None
                if r is not None and (r.reducer != who or r.role != role or r.part != j or r.tag != tag):
                    r = None
                claims[role] = r
            p_claim, s_claim = claims[dp.EVIDENCE_ROLE_PRIMARY], claims[dp.EVIDENCE_ROLE_SHADOW]
            if p_claim is not None and s_claim is not None and p_claim.result_sha256 == s_claim.result_sha256 == digest:
                continue
            problems.append(
                f"part {j}: primary {primary} sent "
                + (f"sha256 {digest.hex()[:16]}" if p_claim is not None else "no valid receipt")
                + f", shadow {shadow} signed "
                + (s_claim.result_sha256.hex()[:16] if s_claim is not None else "no valid receipt")
            )
            # evidence: we reduced part j too, and the other reducer signed a different digest
            mine = sessions.get(j)
            if mine is None or j not in own:
                continue
            ours = hashlib.sha256(own[j][0]).digest()
            primary_here = mine.role == dp.EVIDENCE_ROLE_PRIMARY
            other, other_reply = (s_claim, sh_reply) if primary_here else (p_claim, reply)
            if other is not None and other.result_sha256 != ours:
                evidence.append(
                    pb.EvidenceRequest(
                        receipt=other_reply.receipt,
                        receipt_signature=other_reply.receipt_signature,
                        reducer_public_key=other_reply.reducer_public_key,
                        inputs=[
                            pb.EvidenceInput(
                                contribution_header=h.SerializeToString(deterministic=True),
                                payload=(mine.accepted[s].payload or b"") if s in mine.accepted else b"",
                            )
                            for s, h in sorted(mine.headers.items())
                        ],
                    )
                )
        if problems:
            raise ReducersDisagree("; ".join(problems) + ": the round is not applied", tuple(evidence))

    async def _exchange_part(
        self,
        c: Contributor,
        header: dp.ContributionHeader,
        payload: bytes,
        codec: Codec,
        counters: list[int],
        *,
        with_payload: bool = True,
    ) -> tuple[bytes, dp.ReducedHeader]:
        """Send our contribution to reducer c and receive its reply; retry broken streams.

        with_payload: c is the part's primary (its reply carries the averaged bytes); False:
        c is its shadow, whose reply is a signed receipt only.
        """
        delay = 0.05
        while True:
            try:
                return await self._try_exchange_part(c, header, payload, codec, counters, with_payload)
            except P2PDaemonError as e:
                # no connection to c any more (a relayed one reset, or closed as idle), and the
                # daemon may know no address for it: the addresses the coordinator handed out
                # were dialed once, at the exchange's start; dial them again before retrying
                log.debug("part %d to %s: %s; dialing it again", header.part, c.worker_id, e)
                await _dial(self.p2p, c, circuits=self.dial_circuits, timeout_s=REDIAL_TIMEOUT_S)
            except _RETRYABLE as e:
                log.debug("part %d to %s: %s; retrying", header.part, c.worker_id, e)
            counters[2] += 1
            await asyncio.sleep(delay)
            delay = min(delay * 2, 1.0)

    async def _try_exchange_part(
        self,
        c: Contributor,
        header: dp.ContributionHeader,
        payload: bytes,
        codec: Codec,
        counters: list[int],
        with_payload: bool,
    ) -> tuple[bytes, dp.ReducedHeader]:
        _, reader, writer = await self.p2p.call_binary_stream_handler(PeerID.from_base58(c.peer_id), PART_PROTOCOL)
        try:
            # (never `counters[0] += await ...`: the read happens before the await, and the
            # concurrent sends to the other reducers would overwrite each other's counts)
            n = await write_message(writer, header)
            counters[0] += n
            if payload:
                n = await write_frame(writer, payload)
                counters[0] += n
            reply, n = await read_message(reader, dp.ReducedHeader)
            counters[1] += n
            if reply.status == dp.STATUS_NOT_READY:
                raise _NotReady(reply.reason)
            if reply.status == dp.STATUS_REJECTED:
                raise ContributionRejected(c.worker_id, reply.reason)
            if reply.status == dp.STATUS_FAILED and reply.missing:
                raise ExchangeTimeout(reply.missing, f"reported by reducer {c.worker_id} of part {header.part}")
            if reply.status != dp.STATUS_OK:
                raise ExchangeFailed(f"reducer {c.worker_id} (part {header.part}) failed: {reply.reason}")
            if not with_payload:
                if reply.part != header.part or reply.payload_nbytes != 0:
                    raise ExchangeFailed(f"shadow reducer {c.worker_id} sent a bad reply header (part {reply.part})")
                return b"", reply
            limit = codec.encoded_nbytes(header.part_numel)
            if reply.part != header.part or not 0 < reply.payload_nbytes <= limit:
                raise ExchangeFailed(
                    f"reducer {c.worker_id} sent a bad reply header (part {reply.part}, {reply.payload_nbytes} bytes)"
                )
            buf = await read_frame(reader, reply.payload_nbytes)
            counters[1] += LEN_NBYTES + len(buf)
            if len(buf) != reply.payload_nbytes:
                raise ExchangeFailed(f"reducer {c.worker_id} sent {len(buf)} bytes, announced {reply.payload_nbytes}")
            return buf, reply
        finally:
            writer.close()

    # ------------------------------------------------------------ reducer side (incoming streams)

    async def _on_part_stream(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        header = None
        try:
            header, nbytes = await asyncio.wait_for(read_message(reader, dp.ContributionHeader), self.header_timeout_s)
            header_at = asyncio.get_running_loop().time()
            sessions = await self._session_for(header.tag)
            session = sessions.get(header.part)
            if session is None:
                raise Refused(f"we do not reduce part {header.part} of this exchange (we reduce {sorted(sessions)})")
            # a stream held until our exchange started buffered its payload meanwhile: untimed
            waited = asyncio.get_running_loop().time() - header_at > 0.05
            await session.serve(header, nbytes, info.peer_id, reader, writer, None if waited else header_at)
        except Refused as e:
            log.log(logging.DEBUG if e.retry else logging.INFO, "refused a stream from %s: %s", info.peer_id, e.reason)
            reply = dp.ReducedHeader(status=dp.STATUS_NOT_READY if e.retry else dp.STATUS_REJECTED, reason=e.reason)
            if header is not None:
                reply.tag.CopyFrom(header.tag)
                reply.part = header.part
            try:
                await write_message(writer, reply)
                if header is not None and header.payload_nbytes and not e.payload_read:
                    await discard_frame(reader, min(header.payload_nbytes, DISCARD_MAX_NBYTES), DISCARD_TIMEOUT_S)
            except _RETRYABLE:
                pass
        except (*_RETRYABLE, TimeoutError) as e:
            log.debug("part stream from %s ended: %s", info.peer_id, e)
        except asyncio.CancelledError:
            # the P2P client is closing under us: end this stream's task quietly (it is the top
            # of its task, so nothing above waits for the cancellation)
            log.debug("part stream from %s cancelled at shutdown", info.peer_id)
        except Exception:  # a bug or a surprise from a hostile peer must cost one stream, nothing more
            log.exception("part stream from %s failed", info.peer_id)
        finally:
            writer.close()

    async def _session_for(self, tag: dp.ExchangeTag) -> dict[int, Reduction]:
        if tag.run_id != self.run_id:
            raise Refused(f"wrong run {tag.run_id!r}")
        key = (tag.cell_id, tag.round, tag.round_attempt, tag.reduce_attempt)

        def lookup() -> dict[int, Reduction] | None:
            return self._sessions.get(key) or self._finished.get(key)

        s = lookup()
        if s is None:
            latest = self._latest.get(tag.cell_id)
            if latest is not None and key[1:] < latest:
                raise Refused(f"stale exchange (round, round_attempt, reduce_attempt) = {key[1:]}, we are at {latest}")
            if self._pending >= self.max_pending_streams:
                raise Refused("too many contributions waiting for exchanges not started here", retry=True)
            # The reducer may get ORDER_REDUCE a heartbeat later than the sender: hold the
            # stream (only its small header is read) until our exchange starts, briefly.
            self._pending += 1
            try:
                async with self._session_added:
                    await asyncio.wait_for(
                        self._session_added.wait_for(lambda: self._closed or lookup() is not None), self.pending_wait_s
                    )
            except TimeoutError:
                raise Refused(f"exchange {key} not started here within {self.pending_wait_s}s", retry=True) from None
            finally:
                self._pending -= 1
            s = lookup()
            if s is None:
                raise Refused("this peer is shutting down")
        if tag.group_digest != next(iter(s.values())).tag.group_digest:
            raise Refused("a different contributor set for this exchange")
        return s


def _peer_rates(sessions: Iterable[Reduction]) -> tuple[tuple[str, int, int], ...]:
    """Per sender, the measure of its contribution with the most bytes among our parts."""
    best: dict[str, tuple[int, int]] = {}
    for s in sessions:
        for sender, (nbytes, ms) in s.rates.items():
            if sender != s.me and nbytes > best.get(sender, (0, 0))[0]:
                best[sender] = (nbytes, ms)
    return tuple((x, n, ms) for x, (n, ms) in sorted(best.items()))


def _dial_addrs(c: Contributor) -> list[WireMultiaddr]:
    """The contributor's multiaddrs without their trailing /p2p/<id> (the daemon wants bare ones),
    circuit-relay addresses included, in the binary form the Go daemon parses."""
    return dial_addrs(c.peer_id, c.maddrs)


REDIAL_TIMEOUT_S = 5.0  # one re-dial of a contributor the exchange lost its connection to


async def _dial(p2p: P2P, c: Contributor, *, circuits: bool = True, timeout_s: float | None = None) -> None:
    """Ask the daemon to dial the contributor's announced addresses (best effort).

    `P2P` has no public connect, so this uses its daemon client, as hivemind's own
    `P2P.is_identity_taken` does."""
    try:
        addrs = [a for a in _dial_addrs(c) if circuits or not is_circuit(str(a))]
        if addrs:
            await asyncio.wait_for(p2p._client.connect(PeerID.from_base58(c.peer_id), addrs), timeout_s)
    except Exception as e:  # noqa: BLE001 - the exchange's own retries report a peer that stays unreachable
        log.debug("dialing %s failed: %s", c.worker_id, e)


async def _dial_all(p2p: P2P, members: Sequence[Contributor], me: str, *, circuits: bool = True) -> None:
    """Dial every other contributor's announced addresses (best effort): peers that met
    through the DHT usually reach each other already; dialing the addresses the coordinator
    handed out makes a fresh peer reachable at once."""
    await asyncio.gather(*(_dial(p2p, c, circuits=circuits) for c in members if c.worker_id != me and c.maddrs))
