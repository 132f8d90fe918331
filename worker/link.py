"""The worker's link to the coordinator: every call, registration, and the heartbeat loop.

`CoordinatorLink` is one object the agent composes (`Agent.link`). It owns the gRPC
client and what talking to the coordinator needs to remember: the RPC lock, whether the
coordinator is down (and since when), how often it came back, the heartbeat interval it
asked for. What a request carries and what an answer means belong to the worker it
serves, a `LinkOwner` (the agent): the link asks it for the Register contents and the
heartbeat request, and hands it every instruction that comes back.

- `rpc`: every call goes through one lock, so answers are processed in the order the
  requests were made (an old heartbeat answer can never overtake a newer ReportRound
  answer); UNAVAILABLE / DEADLINE_EXCEEDED mark the coordinator down (the caller retries
  with full-jitter backoff, and after a few seconds the DHT record is looked up again in
  case the coordinator moved, and after `REDIAL_AFTER_S` a new connection is dialed to
  it: one stuck after a network cut is otherwise noticed only by keepalive, in 40 s);
  `epoch` counts the returns, so a report answered before an outage can be sent again
  after it. NOT_FOUND means "register again" (with our LocalState).
- `register`: retried while the coordinator is down. The owner may ask for another
  Register right away (the first contact with a run: the profile needs the run spec the
  coordinator sends in its answer, see `Agent.registered`). While it measures its speed
  for that second Register, the link heartbeats IDLE, so the coordinator holds it by the
  run's lease, not by the longer one of a worker that sends nothing meanwhile.
- the heartbeat loop: its own task, every `heartbeat_interval`, and at once when woken (a
  phase change). While the worker waits on the coordinator (IDLE, READY, REDUCING: for a
  round to open, for the freeze, for the verdict), it holds a `WatchInstruction` long poll
  with the tag of the last instruction it was answered: the coordinator answers it as soon
  as that instruction changes, so the worker hears of a freeze, a commit or an abort about
  one network latency after it happens instead of at its next heartbeat, and heartbeats at
  once. The watch lives across heartbeats: it is sent again only when it was answered (the
  coordinator holds one at most a lease) or when an answer brought another instruction, so
  a waiting worker adds about one signed request per lease, not one per heartbeat. While it
  trains or downloads it holds none: a change then can wait for the next heartbeat, and
  10,000 trainers holding watches would add to the signed requests the coordinator checks.
  The watch is a read, and its answer is taken only if it is the newest the worker has: it
  is dropped when it came while another call was in flight, or when another answer was
  handled after it came (answers on one connection arrive in the order the coordinator
  wrote them, so an answer that came before the watch's is older than it). A coordinator
  without the RPC is polled every 250 ms instead while READY or REDUCING.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import grpc

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.client import CoordinatorClient, backoff_delay_s, is_retryable
from bagel.protocol.discovery import CoordinatorRecord, lookup_coordinator
from bagel.protocol.identity import Identity
from bagel.protocol.joinstring import JoinInfo
from bagel.protocol.tls import TLSError
from bagel.worker.display import Display

log = logging.getLogger(__name__)

FAST_HEARTBEAT_S = 0.25  # without a watch, while READY/REDUCING: the freeze and the verdict come sooner
MIN_HEARTBEAT_GAP_S = 0.05  # heartbeats never follow each other faster (a watch answered at once, twice)
WATCH_HOLD_S = 60.0  # how long a watch asks to be held (the coordinator holds it at most a lease)
WATCH_RESENDS = 2  # watches sent again between two heartbeats, at most (a lease is longer than an interval)
WATCH_PHASES = (pb.PHASE_IDLE, pb.PHASE_READY, pb.PHASE_REDUCING)  # waiting on the coordinator
RPC_TIMEOUT_S = 10.0
RERESOLVE_AFTER_S = 3.0  # look the coordinator's DHT record up again after this long without it
REDIAL_AFTER_S = 8.0  # a new connection to the same endpoint after this long without it, and as often
TLS_REFUSALS_BEFORE_GIVING_UP = 5  # answers of a server that is not the pinned one before giving up


_Hello = tuple[pb.WorkerProfile, pb.PeerAddress, pb.LocalState]  # what a Register carries (`LinkOwner.hello`)


class LinkOwner(Protocol):
    """What the link needs from the worker it serves."""

    async def hello(self) -> _Hello:
        """The profile, peer address and LocalState a Register carries now."""
        ...

    async def registered(self, resp: pb.RegisterResponse) -> bool:
        """Take a Register answer; False to register again at once."""
        ...

    def heartbeat_request(self) -> pb.HeartbeatRequest: ...

    def on_instruction(self, instr: pb.Instruction) -> None: ...

    def request_stop(self, reason: str = "signal") -> None:
        """Stop the worker (it leaves)."""
        ...


class CoordinatorLink:
    """The coordinator, as the worker reaches it (see the module docstring)."""

    def __init__(
        self, owner: LinkOwner, join: JoinInfo, identity: Identity, display: Display, stop: asyncio.Event
    ) -> None:
        self.owner = owner
        self.join = join
        self.identity = identity
        self.display = display
        self.stop = stop  # set when the worker leaves: registration stops retrying
        self.dht: Any = None  # the worker's DHT node (re-resolving the coordinator's record)
        self.client: CoordinatorClient | None = None
        self.lock = asyncio.Lock()  # one call at a time: answers in request order
        self.hb_interval_s = 2.0
        self.epoch = 0  # bumps whenever the coordinator answers again after failing
        self.down_since: float | None = None
        self._redialed = 0.0  # when the client last dialed a new connection (`maybe_redial`)
        self._old_channels: dict[asyncio.Task[None], Any] = {}  # closing, once their calls are over
        self._hb_wake = asyncio.Event()
        self._hb_task: asyncio.Task[None] | None = None
        self.answers = 0  # calls answered so far (a watch's answer is dropped if this moved after it came)
        self.known_tag = 0  # the tag of the last instruction an answer carried
        self.watching = True  # False once the coordinator says it has no WatchInstruction
        self._watch: asyncio.Task[pb.WatchInstructionResponse] | None = None  # the held watch
        self._watch_tag = 0  # the tag it was sent with
        self._watch_came: int | None = None  # `answers` when its answer came (None: a call was in flight)
        self.join_token = b""  # sent with every Register (permissioned runs)

    async def connect(self, dht: Any, record: CoordinatorRecord) -> bool:
        """The client for the record's endpoint, pinned to the record's TLS certificate.

        Retried (with a fresh look at the DHT record) while the coordinator cannot be
        reached; False if the worker is stopped meanwhile. A server presenting another
        certificate than the record's, or not speaking TLS, is never sent anything; after
        `TLS_REFUSALS_BEFORE_GIVING_UP` such answers (the record did not change to one
        that works) the `TLSError` (`FingerprintMismatch`) is raised.
        """
        self.dht = dht
        attempt = refusals = 0
        while not self.stop.is_set():
            try:
                self.client = await self._client(record)
                return True
            except (OSError, TLSError) as e:  # refused, reset, timed out: restarting or moving?
                attempt += 1
                if isinstance(e, TLSError):
                    refusals += 1
                    if refusals >= TLS_REFUSALS_BEFORE_GIVING_UP:
                        raise
                self.display.event("coordinator-unreachable", level="warning", message=f"{record.endpoint}: {e}")
                await self._sleep(backoff_delay_s(attempt, max_s=5.0))
                try:
                    fresh, _ = await lookup_coordinator(self.dht, self.join)
                except Exception as err:  # noqa: BLE001  (the DHT may be unreachable too; keep the record)
                    log.debug("re-resolving the coordinator failed: %s", err)
                    fresh = None
                record = fresh or record
        return False

    async def _client(self, record: CoordinatorRecord) -> CoordinatorClient:
        return await CoordinatorClient.connect(
            record.endpoint,
            self.identity,
            self.join.run_id,
            tls_fingerprint=record.tls_sha256,
            spec_hash=record.spec_hash,
            timeout_s=RPC_TIMEOUT_S,
        )

    async def close(self) -> None:
        old = dict(self._old_channels)  # channels left by a redial: closed now, not later
        for task in old:
            task.cancel()
        await asyncio.gather(*old, return_exceptions=True)
        for channel in old.values():
            await channel.close()
        if self.client is not None:
            await self.client.close()

    # ------------------------------------------------------------------ calls

    async def rpc(self, fn: Callable[[], Awaitable[Any]]) -> Any:
        """One coordinator call under the RPC lock. Returns None (after noting the outage)
        if it is unavailable; raises other errors (NOT_FOUND included: the caller
        re-registers). Any answer ends an outage, a refusal too: the coordinator is back."""
        assert self.client is not None
        async with self.lock:
            try:
                resp = await fn()
            except grpc.aio.AioRpcError as e:
                if is_retryable(e):
                    if self.down_since is None:
                        self.down_since = time.monotonic()
                        self.display.event("coordinator-unreachable", level="warning", message=str(e.code().name))
                    return None
                self._back()
                raise
            self.answers += 1
            if isinstance(getattr(resp, "instruction", None), pb.Instruction):
                self.known_tag = resp.instruction.tag
        self._back()
        return resp

    def _back(self) -> None:
        """The coordinator answered: if it had been unreachable, that outage is over."""
        if self.down_since is not None:
            self.down_since = None
            self.epoch += 1
            self.display.event("coordinator-back")

    async def maybe_reresolve(self) -> None:
        """After a few seconds without the coordinator, look its record up again (new endpoint?);
        after a few more, dial a new connection to it (`maybe_redial`)."""
        if self.down_since is None or time.monotonic() - self.down_since < RERESOLVE_AFTER_S or self.client is None:
            return
        self.maybe_redial(time.monotonic())
        try:
            record, _ = await lookup_coordinator(self.dht, self.join)
        except Exception as e:  # noqa: BLE001  (the DHT may be unreachable too; try later)
            log.debug("re-resolving the coordinator failed: %s", e)
            return
        current = (self.client.target, self.client.tls_fingerprint)
        if record is not None and (record.endpoint, record.tls_sha256) != current:
            try:
                client = await self._client(record)
            except (OSError, TLSError) as e:  # keep the old client; the next re-resolve tries again
                self.display.event("coordinator-moved-unreachable", level="warning", message=str(e))
                return
            self.display.event("coordinator-moved", endpoint=record.endpoint)
            old = self.client
            self.client = client
            await old.close()

    def maybe_redial(self, now: float) -> bool:
        """While the coordinator has not answered for `REDIAL_AFTER_S`, move the client to a
        new connection, at most once per `REDIAL_AFTER_S` (`CoordinatorClient.redial`: a
        connection stuck after a network cut is otherwise noticed only by keepalive, 40 s).
        The old channel is closed once the calls still on it have had their deadline."""
        if self.down_since is None or self.client is None:
            return False
        if now - self.down_since < REDIAL_AFTER_S or now - self._redialed < REDIAL_AFTER_S:
            return False
        self._redialed = now
        old = self.client.redial()
        task = asyncio.ensure_future(old.close(grace=RPC_TIMEOUT_S + 1.0))
        self._old_channels[task] = old
        task.add_done_callback(lambda t: self._old_channels.pop(t, None))
        self.display.event("coordinator-redial", level="warning", message="a new connection to the coordinator")
        return True

    async def _sleep(self, s: float) -> None:
        try:
            await asyncio.wait_for(self.stop.wait(), s)
        except TimeoutError:
            pass

    # ------------------------------------------------------------------ registration

    async def reregister(self, e: grpc.aio.AioRpcError) -> bool:
        """The coordinator does not know this worker (its lease ran out, or it restarted
        without it): say so, and register again with what the worker holds."""
        self.display.event("re-register", level="warning", message=e.details() or "unknown worker")
        return await self.register()

    async def register(self) -> bool:
        """Register (retrying while the coordinator is down); False if stopped meanwhile."""
        assert self.client is not None
        attempt = 0
        known = False  # the coordinator holds this worker (answered a Register that asked for another)
        while not self.stop.is_set():
            hello = self.owner.hello()
            profile, peer, local = await (self._keeping_alive(hello) if known else hello)
            try:
                resp = await self.rpc(functools.partial(self._register_call, profile, peer, local))
            except grpc.aio.AioRpcError as e:
                self.display.event("register-refused", level="error", message=f"{e.code().name}: {e.details()}")
                resp = None
            if resp is None:
                attempt += 1
                await self._sleep(backoff_delay_s(attempt, max_s=self.hb_interval_s * 2))
                await self.maybe_reresolve()
                continue
            self.hb_interval_s = max(0.05, resp.heartbeat_interval_ms / 1000.0) if resp.heartbeat_interval_ms else 2.0
            if await self.owner.registered(resp):
                return True
            known = True
        return False

    async def _keeping_alive(self, hello: Awaitable[_Hello]) -> _Hello:
        """Await `hello` (measuring the worker's speed: seconds to minutes) while
        heartbeating IDLE at the coordinator's interval. The coordinator then holds the
        worker by the run's lease instead of the longer lease of a worker that sends
        nothing while it measures, so one that dies while measuring is lost as soon as
        any other. Its answers are not taken: the Register that follows brings the
        instruction, and says what is wrong if anything is."""
        beat = asyncio.create_task(self._idle_heartbeats(), name="measuring-heartbeat")
        try:
            return await hello
        finally:
            beat.cancel()
            await asyncio.gather(beat, return_exceptions=True)

    async def _idle_heartbeats(self) -> None:
        while True:  # the first at once: from then on the run's lease holds
            req = pb.HeartbeatRequest(phase=pb.PHASE_IDLE, local=self.owner.heartbeat_request().local)
            try:
                await self.rpc(functools.partial(self._heartbeat_call, req))
            except grpc.aio.AioRpcError as e:  # e.g. NOT_FOUND: the Register after measuring fixes it
                log.debug("heartbeat while measuring refused: %s", e.code().name)
            await asyncio.sleep(self.hb_interval_s)

    def _current(self) -> CoordinatorClient:
        assert self.client is not None
        return self.client

    # (the client is looked up when the call is made: a re-resolve may have replaced it)
    def _register_call(self, profile: pb.WorkerProfile, peer: pb.PeerAddress, local: pb.LocalState) -> Awaitable[Any]:
        return self._current().register(profile, peer, local, join_token=self.join_token)

    def _heartbeat_call(self, req: pb.HeartbeatRequest) -> Awaitable[Any]:
        return self._current().call("Heartbeat", req)

    # ------------------------------------------------------------------ heartbeats

    def start_heartbeats(self) -> None:
        self._hb_task = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")

    async def stop_heartbeats(self) -> None:
        if self._hb_task is not None:
            self._hb_task.cancel()
            await asyncio.gather(self._hb_task, return_exceptions=True)
            self._hb_task = None
        w, self._watch = self._watch, None
        if w is not None:
            w.cancel()
            await asyncio.gather(w, return_exceptions=True)

    def wake_heartbeat(self) -> None:
        """Heartbeat now (the phase changed)."""
        self._hb_wake.set()

    async def _heartbeat_loop(self) -> None:
        failures = 0
        loop = asyncio.get_running_loop()
        last = -MIN_HEARTBEAT_GAP_S
        while True:
            gap = last + MIN_HEARTBEAT_GAP_S - loop.time()
            if gap > 0:
                await asyncio.sleep(gap)
            last = loop.time()
            # Cleared before the request is built, never after the answer: a phase change
            # while this heartbeat is in flight (or while its answer is handled, when an
            # instruction completes at once, e.g. a round trained ahead) wakes the next one
            # at once instead of being lost until the interval runs out.
            self._hb_wake.clear()
            req = self.owner.heartbeat_request()
            try:
                resp = await self.rpc(functools.partial(self._heartbeat_call, req))
            except grpc.aio.AioRpcError as e:
                resp = None
                if e.code() == grpc.StatusCode.NOT_FOUND:
                    await self.reregister(e)
                elif e.code() == grpc.StatusCode.PERMISSION_DENIED:
                    # banned (final): e.g. convicted on another worker's evidence, so no
                    # instruction ever said LEAVE; retrying would only be refused again
                    self.display.event("banned", level="error", message=e.details() or "banned")
                    self.owner.request_stop(f"banned: {e.details()}")
                    return
                else:
                    self.display.event("heartbeat-refused", level="warning", message=f"{e.code().name}: {e.details()}")
            if resp is not None:
                failures = 0
                self.owner.on_instruction(resp.instruction)
                if self.watching and req.phase in WATCH_PHASES:
                    await self._watch_until_next(self.hb_interval_s)
                    continue
                delay = FAST_HEARTBEAT_S if req.phase in (pb.PHASE_READY, pb.PHASE_REDUCING) else self.hb_interval_s
            else:
                failures += 1
                self._hb_wake.clear()  # a failed call backs off, whatever changed meanwhile
                await self.maybe_reresolve()
                delay = min(self.hb_interval_s, backoff_delay_s(failures, base_s=0.2, max_s=self.hb_interval_s) + 0.1)
            self._drop_watch()  # training, downloading, or no answer: no watch
            try:
                await asyncio.wait_for(self._hb_wake.wait(), delay)
            except TimeoutError:
                pass

    def _arm_watch(self) -> None:
        """Hold a watch of the instruction the worker follows now, unless one is held already."""
        w = self._watch
        if w is not None and not w.done() and self._watch_tag == self.known_tag:
            return
        self._drop_watch()
        tag = self.known_tag
        w = self._watch = asyncio.create_task(self._watch_call(tag, WATCH_HOLD_S), name="watch-instruction")
        self._watch_tag, self._watch_came = tag, None
        w.add_done_callback(self._watch_done)

    def _watch_done(self, task: asyncio.Task[pb.WatchInstructionResponse]) -> None:
        if task is self._watch:  # its answer is usable only if no call was in flight when it came
            self._watch_came = None if self.lock.locked() else self.answers

    def _drop_watch(self) -> None:
        w, self._watch = self._watch, None
        if w is not None:
            if w.done():
                self._watch_answer(w)  # (retrieves its error, if any)
            else:
                w.cancel()

    async def _watch_until_next(self, hold_s: float) -> None:
        """Until the next heartbeat is due: `hold_s`, a wake (phase change), or a changed
        instruction from the held watch, taken here if it is the newest answer the worker
        has (see the module docstring). A watch answered without a usable change (its hold
        ran out, or its answer was not the newest) is sent again at once, at most
        `WATCH_RESENDS` times until the next heartbeat; one that failed is sent again after
        the next heartbeat."""
        loop = asyncio.get_running_loop()
        due = loop.time() + hold_s
        self._arm_watch()
        resends = 0
        wake = asyncio.create_task(self._hb_wake.wait(), name="heartbeat-wake")
        try:
            while not wake.done():
                left = due - loop.time()
                w = self._watch
                if left <= 0:
                    return
                if w is None:  # it failed, or was sent again too often: the heartbeat's own cadence
                    await asyncio.wait({wake}, timeout=left)
                    return
                if not w.done():
                    await asyncio.wait({wake, w}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                    continue
                came, self._watch = self._watch_came, None
                resp = self._watch_answer(w)
                if resp is None:
                    continue
                if resp.changed and resp.instruction.tag != self.known_tag and came == self.answers:
                    self.known_tag = resp.instruction.tag
                    self.owner.on_instruction(resp.instruction)
                    return  # and heartbeat at once
                if self.watching and resends < WATCH_RESENDS:
                    resends += 1
                    if self.lock.locked():  # a call is in flight: watch what its answer brings
                        async with self.lock:
                            pass
                    self._arm_watch()
        finally:
            wake.cancel()
            await asyncio.gather(wake, return_exceptions=True)

    def _watch_answer(self, task: asyncio.Task[pb.WatchInstructionResponse]) -> pb.WatchInstructionResponse | None:
        """The finished watch's answer, or None; UNIMPLEMENTED turns watching off."""
        if task.cancelled():
            return None
        e = task.exception()
        if e is None:
            return task.result()
        if isinstance(e, grpc.aio.AioRpcError) and e.code() == grpc.StatusCode.UNIMPLEMENTED:
            self.watching = False  # an older coordinator: poll instead
        elif not isinstance(e, grpc.aio.AioRpcError):
            log.debug("instruction watch failed: %r", e)
        return None

    async def _watch_call(self, tag: int, hold_s: float) -> pb.WatchInstructionResponse:
        return await self._current().watch_instruction(tag, int(hold_s * 1000))
