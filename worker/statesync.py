"""Serve a cell's committed state to joiners, and fetch it from a donor, over hivemind P2P.

A worker that joins a cell (or must resync) gets `ORDER_SYNC` naming a live donor member
and the committed (round, hash). It opens `/bagel/dataplane/v1/state` to the donor, asks
for exactly that (cell, round, hash), and the donor streams its committed state as a
safetensors file (weights "w.*" and outer momentum "m.*") in bounded chunks
(`protocol/dataplane.proto`: StateRequest, StateInfo, then data frames).

The joiner trusts nothing it receives: the announced size must fit `max_nbytes` before a
byte is read, every chunk must fit the announced chunk size, the sha256 is computed while
streaming and compared at the end, the file is parsed by safetensors (never pickle), and the
state hash (`protocol/statehash.py`) must equal the committed hash the coordinator gave.
A donor that lies about its state therefore fails the sync instead of corrupting the joiner.
The donor keeps its last few committed states per cell, so a joiner one round behind can
still be served. A joiner can also be a moment ahead: the coordinator names a donor as soon
as a round commits, but the donor adopts that round only when it hears the verdict, so a
request for a round newer than any the donor holds waits briefly for it (`ROUND_WAIT_S`).
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError
from hivemind.utils.multiaddr import Multiaddr

from bagel.protocol import dataplane_pb2 as dp
from bagel.worker.diloco import CellState, StateFormatError
from bagel.worker.framing import FrameError, read_frame, read_message, write_frame, write_message

log = logging.getLogger(__name__)

STATE_PROTOCOL = "/bagel/dataplane/v1/state"
DEFAULT_CHUNK_NBYTES = 1 << 20
MAX_CHUNK_NBYTES = 16 << 20
ROUND_WAIT_S = 3.0
"""How long a request for a round newer than any the donor holds waits for `publish` to deliver it.

The coordinator names the donor of round N once N commits there, but the donor publishes N
only when it hears the verdict (its ReportRound answer, or the instruction on its next
heartbeat, every 250 ms while it waits): a joiner can ask in between. Refused then, a joiner
with no checkpoint to fall back to (`test_e2e`'s SIGKILLed worker) missed its sync and rejoined
rounds late. A few heartbeats cover the gap; a donor that never gets there is refused after it.
"""
MAX_WAITING = 16  # requests waiting at once; more are refused at once (a peer cannot pile them up)


class StateSyncError(Exception):
    """Fetching a cell's state failed; fall back to another donor or the checkpoint."""


class StateNotAvailable(StateSyncError):
    """The donor does not hold the requested (cell, round, hash), or is busy."""


class StateIntegrityError(StateSyncError):
    """The received state is oversized, truncated, corrupted, malformed or not the committed one."""


@dataclass(frozen=True)
class SyncedState:
    cell_id: str
    committed_round: int
    state_hash: str
    state: CellState
    nbytes: int  # of the safetensors file received


@dataclass(frozen=True)
class _Entry:
    committed_round: int
    state_hash: str
    data: bytes
    sha256: str


_NO_STATES: Mapping[int, _Entry] = {}  # what a cell with no state held reads as


def verify_state_bytes(data: bytes, expected_hash: str) -> CellState:
    """Parse a safetensors cell state and check its state hash; for donor and checkpoint bytes alike."""
    try:
        state = CellState.from_safetensors(data)
    except StateFormatError as e:
        raise StateIntegrityError(f"malformed state: {e}") from e
    got = state.state_hash()
    if got != expected_hash:
        raise StateIntegrityError(f"state hash {got[:16]}... is not the committed {expected_hash[:16]}...")
    return state


class StateServer:
    """Serves this worker's committed cell states to joiners. One per worker process.

    round_wait_s: how long a request for a round newer than any held for its cell waits for
    `publish` to deliver it (`ROUND_WAIT_S` says why); 0 refuses it at once. `publish` and
    `withdraw` must be called on the event loop's thread (the agent calls them from its
    coroutines): they change what the waiting requests look up, and wake them, unlocked.
    """

    def __init__(
        self,
        p2p: P2P,
        run_id: str,
        *,
        chunk_nbytes: int = DEFAULT_CHUNK_NBYTES,
        keep: int = 2,
        max_concurrent: int = 4,
        round_wait_s: float = ROUND_WAIT_S,
        max_waiting: int = MAX_WAITING,
    ):
        if not 0 < chunk_nbytes <= MAX_CHUNK_NBYTES:
            raise ValueError(f"chunk_nbytes must be in (0, {MAX_CHUNK_NBYTES}]")
        if round_wait_s < 0 or max_waiting < 0:
            raise ValueError("round_wait_s and max_waiting must be >= 0")
        self.p2p, self.run_id = p2p, run_id
        self.chunk_nbytes, self.keep, self.round_wait_s = chunk_nbytes, keep, round_wait_s
        self.max_waiting = max_waiting
        self._states: dict[str, OrderedDict[int, _Entry]] = {}
        self._changed = asyncio.Event()  # set (and replaced) whenever _states changes
        self._slots = asyncio.Semaphore(max_concurrent)
        self._started = False
        self.bytes_served = 0
        self.waiting = 0  # requests now waiting for a round to be published

    async def start(self) -> None:
        if not self._started:
            await self.p2p.add_binary_stream_handler(STATE_PROTOCOL, self._on_stream)
            self._started = True

    async def close(self) -> None:
        if self._started:
            self._started = False
            self._wake_waiters()  # they are refused: nothing will be published for them now
            try:
                await self.p2p.remove_binary_stream_handler(STATE_PROTOCOL)
            except Exception as e:  # the daemon may be gone already at shutdown
                log.debug("removing the state handler failed: %s", e)

    def publish(self, cell_id: str, committed_round: int, state: CellState) -> str:
        """Offer `state` as the committed state of (cell, round); returns its state hash."""
        data = state.to_safetensors()
        entry = _Entry(committed_round, state.state_hash(), data, hashlib.sha256(data).hexdigest())
        per_cell = self._states.setdefault(cell_id, OrderedDict())
        per_cell[committed_round] = entry
        while len(per_cell) > self.keep:
            per_cell.popitem(last=False)
        self._wake_waiters()
        return entry.state_hash

    def withdraw(self, cell_id: str | None = None) -> None:
        """Stop serving a cell (or every cell), e.g. after leaving it or before a resync."""
        if cell_id is None:
            self._states.clear()
        else:
            self._states.pop(cell_id, None)
        self._wake_waiters()  # a withdrawn cell's waiting requests are refused now

    def _wake_waiters(self) -> None:
        """Wake every request waiting in `_lookup`; each looks again at what is held now."""
        # replaced before it is set, so a woken request that must wait on waits for the next change
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _awaited(self, cell_id: str, committed_round: int) -> bool:
        """Whether (cell, round) is worth waiting for: the cell is held, and the round newer than any held.

        Such a round is probably about to be published (see `ROUND_WAIT_S`). An older round
        that is not held was evicted or skipped, and a cell not held is not ours: both are
        refused at once. So is everything once the server is closed (it publishes no
        more), and any request while `max_waiting` others already wait.
        """
        per_cell = self._states.get(cell_id)
        if not self._started or not per_cell or self.waiting >= self.max_waiting:
            return False
        return committed_round > max(per_cell)

    async def _lookup(self, cell_id: str, committed_round: int) -> _Entry | None:
        """The held state of (cell, round), after waiting up to `round_wait_s` if `_awaited`; else None."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        waited = False
        while (entry := self._states.get(cell_id, _NO_STATES).get(committed_round)) is None:
            remaining = start + self.round_wait_s - loop.time()
            if remaining <= 0 or not self._awaited(cell_id, committed_round):
                if waited:
                    log.info(
                        "%s round %d: not published within %.1fs of the request; refused",
                        cell_id,
                        committed_round,
                        loop.time() - start,
                    )
                return None
            waited = True
            self.waiting += 1
            try:
                await asyncio.wait_for(self._changed.wait(), remaining)
            except TimeoutError:
                pass  # the loop looks once more, then refuses: the wait is over
            finally:
                self.waiting -= 1
        if waited:
            log.info(
                "%s round %d: asked for before it was published here; served after %.2fs",
                cell_id,
                committed_round,
                loop.time() - start,
            )
        return entry

    async def _on_stream(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            req, _ = await asyncio.wait_for(read_message(reader, dp.StateRequest), 10.0)
            # the run first: another run's request must not wait for one of our rounds
            entry = await self._lookup(req.cell_id, req.committed_round) if req.run_id == self.run_id else None
            if req.run_id != self.run_id:
                reason = f"wrong run {req.run_id!r}"
            elif entry is None:
                reason = f"{req.cell_id} round {req.committed_round} is not held here"
            elif req.state_hash and req.state_hash != entry.state_hash:
                reason = "our state of that round has a different hash"
            elif self._slots.locked():
                reason = "busy serving other joiners"
            else:
                reason = ""
            if reason:
                await write_message(
                    writer, dp.StateInfo(status=dp.STATUS_NOT_AVAILABLE, reason=reason, cell_id=req.cell_id)
                )
                return
            assert entry is not None
            async with self._slots:
                await write_message(
                    writer,
                    dp.StateInfo(
                        status=dp.STATUS_OK,
                        cell_id=req.cell_id,
                        committed_round=entry.committed_round,
                        state_hash=entry.state_hash,
                        total_nbytes=len(entry.data),
                        sha256=entry.sha256,
                        chunk_nbytes=self.chunk_nbytes,
                    ),
                )
                view = memoryview(entry.data)
                for start in range(0, len(view), self.chunk_nbytes):
                    n = await write_frame(writer, view[start : start + self.chunk_nbytes])
                    self.bytes_served += n  # not `+= await`: concurrent streams would lose counts
        except (FrameError, ConnectionError, OSError, asyncio.IncompleteReadError, TimeoutError) as e:
            log.debug("state stream from %s ended: %s", info.peer_id, e)
        finally:
            writer.close()


async def fetch_state(
    p2p: P2P,
    donor_peer_id: str,
    *,
    run_id: str,
    cell_id: str,
    committed_round: int,
    state_hash: str,
    max_nbytes: int,
    donor_maddrs: Sequence[str] = (),
    timeout_s: float = 120.0,
) -> SyncedState:
    """Fetch and verify (cell, committed_round) from the donor; raises a StateSyncError on failure.

    max_nbytes: the largest state accepted (spec.checkpoint.max_bytes). state_hash: the
    committed hash from the coordinator (must be non-empty: round 0 needs no sync).
    """
    if not state_hash:
        raise ValueError("a committed state hash is required (round 0 is built locally, not synced)")
    try:
        async with asyncio.timeout(timeout_s):
            return await _fetch(
                p2p, donor_peer_id, run_id, cell_id, committed_round, state_hash, max_nbytes, donor_maddrs
            )
    except TimeoutError:
        raise StateSyncError(f"state sync from {donor_peer_id} timed out after {timeout_s}s") from None
    except (P2PDaemonError, ConnectionError, OSError) as e:
        raise StateSyncError(f"cannot reach donor {donor_peer_id}: {e}") from e
    except FrameError as e:
        raise StateIntegrityError(f"donor stream broken: {e}") from e


async def _fetch(
    p2p: P2P,
    donor: str,
    run_id: str,
    cell_id: str,
    committed_round: int,
    state_hash: str,
    max_nbytes: int,
    maddrs: Sequence[str],
) -> SyncedState:
    pid = PeerID.from_base58(donor)
    if maddrs:
        try:
            bare = [
                Multiaddr(a).decapsulate(Multiaddr(f"/p2p/{donor}")) if "/p2p/" in a else Multiaddr(a) for a in maddrs
            ]
            await p2p._client.connect(pid, bare)  # no public connect in P2P; see averaging._dial_all
        except Exception as e:
            log.debug("dialing donor %s failed: %s", donor, e)
    _, reader, writer = await p2p.call_binary_stream_handler(pid, STATE_PROTOCOL)
    try:
        await write_message(
            writer,
            dp.StateRequest(run_id=run_id, cell_id=cell_id, committed_round=committed_round, state_hash=state_hash),
        )
        info, _ = await read_message(reader, dp.StateInfo)
        if info.status != dp.STATUS_OK:
            raise StateNotAvailable(f"donor {donor}: {info.reason or dp.Status.Name(info.status)}")
        if (info.cell_id, info.committed_round, info.state_hash) != (cell_id, committed_round, state_hash):
            raise StateIntegrityError(
                f"donor offers {info.cell_id} round {info.committed_round}, not the requested state"
            )
        if not 0 < info.total_nbytes <= max_nbytes:
            raise StateIntegrityError(f"donor announces {info.total_nbytes} bytes, limit {max_nbytes}")
        if not 0 < info.chunk_nbytes <= MAX_CHUNK_NBYTES:
            raise StateIntegrityError(f"donor announces {info.chunk_nbytes}-byte chunks, limit {MAX_CHUNK_NBYTES}")
        digest = hashlib.sha256()
        buf = bytearray()
        while len(buf) < info.total_nbytes:
            chunk = await read_frame(reader, min(info.chunk_nbytes, info.total_nbytes - len(buf)))
            if not chunk:
                raise StateIntegrityError("donor sent an empty chunk")
            digest.update(chunk)
            buf += chunk
        if digest.hexdigest() != info.sha256:
            raise StateIntegrityError("sha256 of the received bytes does not match the donor's")
    finally:
        writer.close()
    state = await asyncio.to_thread(verify_state_bytes, bytes(buf), state_hash)
    return SyncedState(cell_id, committed_round, state_hash, state, len(buf))
