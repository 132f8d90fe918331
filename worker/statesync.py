"""Serve a cell's committed state to joiners, and fetch it from one or several donors, over hivemind P2P.

A worker that joins a cell (or must resync) gets `ORDER_SYNC` naming up to `[sync]
max_donors` live donor members (`Instruction.donors`, best first; `donor` is the first, for
a worker that reads only it) and the committed (round, hash). It opens
`/bagel/dataplane/v1/state` to a donor, asks for exactly that (cell, round, hash), and the
donor streams its committed state as a safetensors file (weights "w.*", outer momentum "m.*"
and, where the run keeps one, the average of the committed weights "ema.*") in bounded chunks
(`protocol/dataplane.proto`: StateRequest, StateInfo, then data frames). The file holds the
state in the run's state dtype (`[sync] state_dtype`: fp32, or bf16/fp16 at half the bytes),
the exact bytes every member holds and hashes, so the joiner applies what it verified. The
donor reads the file straight from its committed tensors (`worker/statefile.py`), so a
state it serves costs it no serialised copy.

With several donors (`fetch_state_from_donors`) the joiner downloads byte ranges of the one
file from all of them at once. Every donor serializes the same committed state to the same
bytes (safetensors of the same names, dtypes, shapes and values, no metadata;
tests/test_statesync_multi.py proves it across a sync and a rebuild), so a range from one
donor fits a range from another. First each donor announces its file (`pieces_only`): size,
sha256, and the sha256 of every piece (`piece_nbytes_for`: at most `MAX_PIECES`). The
donors that announce the same file are used together (the others get `STALL_S` after the
first announcement to make theirs); its pieces start split among them in
ranges proportional to the coordinator's expected bandwidth of each, each donor is asked
for bounded ranges (`StateRequest.offset/length`) from the front of its share, one that is
done takes the back half of the largest share not yet asked for (work stealing), and at
the end the slowest request in flight is asked for again from an idle donor. Each piece is
checked against its digest as it completes: a donor that sends a wrong byte is caught at
that piece (a proven liar), dropped, and what it had not delivered is fetched from the
others; so is a donor that fails or sends nothing for `STALL_S`. One donor, or donors that
serve no ranges (older workers): the single stream, `fetch_state`.

The joiner trusts nothing it receives: the announced size must fit `max_nbytes` before a
byte is read (the buffer is allocated only then), every chunk must fit the announced chunk
size and the requested range, the sha256 is compared at the end, the file is parsed by
safetensors (never pickle), and the state hash (`protocol/statehash.py`) must equal the
committed hash the coordinator gave. Donors that lie together about their file (its sha256
and pieces) fail that check, and the next group of donors (if any announced another file)
is tried; a sync that no group completes fails, and the caller falls back to the
coordinator's checkpoint, so a liar never corrupts the joiner.
The donor keeps its last few committed states per cell, so a joiner one round behind can
still be served; a state that a newer round has superseded is dropped once nobody has asked
for it for `SUPERSEDED_S` (each is several copies of the parameters, held through the next
exchange otherwise). A joiner can also be a moment ahead: the coordinator names a donor as soon
as a round commits, but the donor adopts that round only when it hears the verdict, so a
request for a round newer than any the donor holds waits briefly for it (`ROUND_WAIT_S`).

Catching up by updates (`[sync] catch_up_rounds`, `worker/catchup.py`): the donor also keeps
the committed updates of its cell's last few rounds (the encoded averaged parts every member
applied; a member's own, or those it caught up by) and serves them on
`/bagel/dataplane/v1/updates` (UpdatesRequest, UpdatesInfo, then the parts' bytes). A joiner
that holds the same cell's state of round j, told to sync to round R a few rounds on, asks its
donors for the updates of rounds j+1..R in order (`catch_up_from_donors`), applies them to its
own state and keeps the result only if it has the committed hash; a donor that does not hold
every one of them refuses, and a joiner that none serves downloads the whole state instead.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import torch
from hivemind.p2p import P2P, PeerID
from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError

from bagel.protocol import dataplane_pb2 as dp
from bagel.protocol.relay import dial_addrs
from bagel.protocol.runspec import MAX_CATCH_UP_ROUNDS, MAX_SYNC_DONORS, SyncSection
from bagel.worker.catchup import (
    CatchUpError,
    CommittedUpdate,
    catch_up,
    chain_for,
    check_info,
    header_fits,
    read_updates,
    request_refusal,
    updates_info,
    write_updates,
)
from bagel.worker.diloco import CellState, OuterConfig, StateFormatError
from bagel.worker.framing import FrameError, read_frame, read_message, write_frame, write_message
from bagel.worker.parts import Codec, Layout
from bagel.worker.statefile import StateFile

log = logging.getLogger(__name__)
_T = TypeVar("_T")

STATE_PROTOCOL = "/bagel/dataplane/v1/state"
UPDATES_PROTOCOL = "/bagel/dataplane/v1/updates"
DEFAULT_CHUNK_NBYTES = 1 << 20
MAX_CHUNK_NBYTES = 16 << 20
ROUND_WAIT_S = 3.0
"""How long a request for a round newer than any the donor holds waits for `publish` to deliver it.

The coordinator names the donor of round N once N commits there, but the donor publishes N
only when it hears the verdict (its ReportRound answer, or the changed instruction its held
watch answers, see worker/link.py): a joiner can ask in between. Refused then, a joiner
with no checkpoint to fall back to (`test_e2e`'s SIGKILLed worker) missed its sync and rejoined
rounds late. A few heartbeats cover the gap; a donor that never gets there is refused after it.
"""
MAX_WAITING = 16  # requests waiting at once; more are refused at once (a peer cannot pile them up)
MIN_PIECE_NBYTES = 64 << 10
MAX_PIECES = 1024  # so a StateInfo's piece digests (32 bytes each) fit the 64 KiB header limit
DEFAULT_REQUEST_NBYTES = 8 << 20  # a multi-donor fetch asks for at most this much per request
STALL_S = 15.0  # a donor that sends nothing for this long is dropped from a multi-donor fetch
# Catching up by updates: a donor that does not answer, or sends nothing for this long, is
# given up for the next one (above ROUND_WAIT_S, which a donor may wait before it answers)...
CATCH_UP_STALL_S = 8.0
# ...and all of them together get this long by default; the worker gives a catch-up the budget
# of the download it would replace (`--sync-timeout-s`), as it fetches fewer bytes than that
CATCH_UP_TIMEOUT_S = 120.0
DEFAULT_KEEP_UPDATES = SyncSection().catch_up_rounds  # the run spec's default
SUPERSEDED_S = 2 * STALL_S
"""How long a donor keeps a committed state after a newer round of its cell is published,
counted from then and from the start and end of every request for it since.

A joiner asks for the round the coordinator named, which a moment later may no longer be
the donor's newest: kept this long, such a request, and every range request of a download
in progress (each comes well within `STALL_S` of the last, or the joiner drops the donor),
is still served. Kept longer, the state costs the donor its weights, momentum and average
until its next commit, its exchange's peak included, for nobody."""


LINGER_S = 15.0
LINGER_MAX_NBYTES = 64 << 10


async def linger(reader: asyncio.StreamReader, timeout_s: float = LINGER_S) -> None:
    """After the last byte of an answer: wait until the peer closes its side (it has read
    everything then), at most `timeout_s`, dropping at most `LINGER_MAX_NBYTES` it sends.

    Closing our side at once can lose the answer's tail: the libp2p daemon, seeing our end
    of its socket close, may reset the stream before what it still buffers has left, and the
    peer then reads a truncated last frame. Measured on loopback, one donor and one joiner in
    one process, the tiny DiT's state (8.7 MB) fetched again and again: without this wait 10
    of 900 fetches lost 25 to 210 KB of their last frame, with it none of 900."""
    try:
        async with asyncio.timeout(timeout_s):
            left = LINGER_MAX_NBYTES
            while left > 0 and (got := await reader.read(left)):
                left -= len(got)
    except (TimeoutError, ConnectionError, OSError):
        pass


def piece_nbytes_for(total_nbytes: int) -> int:
    """The piece size of a `total_nbytes`-byte state file: the smallest power of two from
    `MIN_PIECE_NBYTES` up that cuts it into at most `MAX_PIECES` pieces. A fixed function of
    the size, so every donor of the same file announces the same pieces."""
    need = -(-total_nbytes // MAX_PIECES)
    size = MIN_PIECE_NBYTES
    while size < need:
        size <<= 1
    return size


def piece_digests(data: bytes | memoryview, piece_nbytes: int) -> bytes:
    """The concatenated sha256 of every `piece_nbytes` piece of `data` (the last one shorter)."""
    view = memoryview(data)
    return b"".join(hashlib.sha256(view[i : i + piece_nbytes]).digest() for i in range(0, len(view), piece_nbytes))


def split_pieces(n_pieces: int, weights: Sequence[float]) -> list[tuple[int, int]]:
    """Cut pieces [0, n_pieces) into one contiguous [start, end) range per weight, each as
    long as its share of the weights (largest remainder; a weight that is not a positive
    number counts as the mean of the others, or 1 if none is)."""
    if not weights:
        return []
    known = [w for w in weights if math.isfinite(w) and w > 0]
    fill = sum(known) / len(known) if known else 1.0
    ws = [w if math.isfinite(w) and w > 0 else fill for w in weights]
    total = sum(ws)
    exact = [n_pieces * w / total for w in ws]
    counts = [math.floor(x) for x in exact]
    by_remainder = sorted(range(len(ws)), key=lambda i: (counts[i] - exact[i], i))
    for i in by_remainder[: n_pieces - sum(counts)]:
        counts[i] += 1
    out, start = [], 0
    for c in counts:
        out.append((start, start + c))
        start += c
    return out


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
    file: StateFile  # read from the committed state's own tensors, never serialised whole


_NO_STATES: Mapping[int, _Entry] = {}  # what a cell with no state held reads as
_NO_UPDATES: Mapping[int, CommittedUpdate] = {}  # ... and one with no update held


def verify_state_bytes(data: bytes, expected_hash: str, dtype: torch.dtype = torch.float32) -> CellState:
    """Parse a safetensors cell state of the run's state dtype (`[sync] state_dtype`; a file
    in another dtype is refused, never cast) and check its state hash; for donor and
    checkpoint bytes alike."""
    try:
        state = CellState.from_safetensors(data, dtype=dtype)
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

    At most `keep` states per cell are held, and one superseded by a newer round only for
    `superseded_s` after that round's publication and after every request for it (None: as
    long as `keep` allows; `SUPERSEDED_S` says why).

    Committed updates (`publish(..., updates=)`) are kept per cell for the last
    `keep_updates` rounds, and in bytes at most the size of the newest state's file (so
    they never cost more memory than one more copy of the state); the oldest go first.
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
        superseded_s: float | None = SUPERSEDED_S,
        clock: Callable[[], float] = time.monotonic,
    ):
        if not 0 < chunk_nbytes <= MAX_CHUNK_NBYTES:
            raise ValueError(f"chunk_nbytes must be in (0, {MAX_CHUNK_NBYTES}]")
        if round_wait_s < 0 or max_waiting < 0 or (superseded_s is not None and superseded_s < 0):
            raise ValueError("round_wait_s, max_waiting and superseded_s must be >= 0")
        self.p2p, self.run_id = p2p, run_id
        self.chunk_nbytes, self.keep, self.round_wait_s = chunk_nbytes, keep, round_wait_s
        self.max_waiting, self.superseded_s, self.clock = max_waiting, superseded_s, clock
        self._states: dict[str, OrderedDict[int, _Entry]] = {}
        # (cell, round) of a superseded state -> monotonic time from which it may be dropped
        self._drop_after: dict[tuple[str, int], float] = {}
        self._sweep: asyncio.TimerHandle | None = None
        self._updates: dict[str, OrderedDict[int, CommittedUpdate]] = {}  # by round, oldest first
        # (sha256, piece digests) of a held state's file, computed off the loop on its first request
        self._digests: dict[tuple[str, int, str], asyncio.Future[tuple[str, bytes]]] = {}
        self._changed = asyncio.Event()  # set (and replaced) whenever _states changes
        self._slots = asyncio.Semaphore(max_concurrent)
        self._started = False
        self.bytes_served = 0
        self.update_bytes_served = 0  # of those, the bytes of committed updates
        self.waiting = 0  # requests now waiting for a round to be published

    async def start(self) -> None:
        if not self._started:
            await self.p2p.add_binary_stream_handler(STATE_PROTOCOL, self._on_stream)
            await self.p2p.add_binary_stream_handler(UPDATES_PROTOCOL, self._on_updates_stream)
            self._started = True

    async def close(self) -> None:
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        if self._started:
            self._started = False
            self._wake_waiters()  # they are refused: nothing will be published for them now
            for protocol in (STATE_PROTOCOL, UPDATES_PROTOCOL):
                try:
                    await self.p2p.remove_binary_stream_handler(protocol)
                except Exception as e:  # the daemon may be gone already at shutdown
                    log.debug("removing the %s handler failed: %s", protocol, e)

    def publish(
        self,
        cell_id: str,
        committed_round: int,
        state: CellState,
        *,
        updates: Sequence[CommittedUpdate] = (),
        keep_updates: int = DEFAULT_KEEP_UPDATES,
        state_hash: str | None = None,
    ) -> str:
        """Offer `state` as the committed state of (cell, round); returns its state hash.

        The state is held, not copied: it must not be changed in place afterwards (a
        committed state never is). Its file's sha256 and piece digests are computed in a
        thread on the first request for it, so publishing costs no pass over the tensors
        when the caller gives `state_hash` (the hash it already computed of this state).

        updates: committed updates of this cell to serve too (the one that gave this state,
        and any before it that the caller applied), of rounds up to this one; the cell's
        last `keep_updates` (0 to MAX_CATCH_UP_ROUNDS; 0 keeps none) are kept."""
        file = StateFile(state)
        entry = _Entry(committed_round, state_hash or state.state_hash(), file)
        per_cell = self._states.setdefault(cell_id, OrderedDict())
        per_cell[committed_round] = entry
        while len(per_cell) > self.keep:
            per_cell.popitem(last=False)
        if self.superseded_s is not None:
            newest = max(per_cell)
            for held in per_cell:
                if held != newest:
                    self._drop_after.setdefault((cell_id, held), self.clock() + self.superseded_s)
        self._keep_updates(cell_id, committed_round, updates, keep_updates, file.nbytes)
        self.drop_superseded()
        return entry.state_hash

    def _asked(self, cell_id: str, committed_round: int) -> None:
        """A request for (cell, round) starts or ends: a superseded state is kept `superseded_s` more."""
        key = (cell_id, committed_round)
        if key in self._drop_after and self.superseded_s is not None:
            self._drop_after[key] = max(self._drop_after[key], self.clock() + self.superseded_s)

    def held_rounds(self, cell_id: str) -> tuple[int, ...]:
        """The rounds of `cell_id` whose committed state is held, oldest first."""
        return tuple(self._states.get(cell_id, _NO_STATES))

    def drop_superseded(self) -> None:
        """Drop the superseded states nobody asked for within `superseded_s`, and look again
        when the next of the others is due (a timer on the running loop, if there is one;
        else at the next publication)."""
        self._sweep_due()
        self._wake_waiters()  # forget the dropped states' piece digests

    def _sweep_due(self) -> None:
        now = self.clock()
        for key, due in list(self._drop_after.items()):
            per_cell = self._states.get(key[0])
            if per_cell is None or key[1] not in per_cell:
                del self._drop_after[key]  # evicted by `keep`, or withdrawn
            elif due <= now:
                del per_cell[key[1]]
                del self._drop_after[key]
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        if not self._drop_after:
            return
        try:
            loop = asyncio.get_running_loop()
        except RuntimeError:  # published outside a loop (a unit test): swept at the next publication
            return
        wait = max(0.0, min(self._drop_after.values()) - now)
        self._sweep = loop.call_later(wait, self.drop_superseded)

    def _keep_updates(
        self, cell_id: str, committed_round: int, updates: Sequence[CommittedUpdate], keep: int, max_nbytes: int
    ) -> None:
        keep = max(0, min(keep, MAX_CATCH_UP_ROUNDS))
        held = dict(self._updates.get(cell_id, _NO_UPDATES))
        held.update({u.round: u for u in updates if 0 < u.round <= committed_round})
        rounds = sorted(held)[-keep:] if keep else []
        while rounds and sum(held[r].nbytes for r in rounds) > max_nbytes:
            rounds.pop(0)
        if rounds:
            self._updates[cell_id] = OrderedDict((r, held[r]) for r in rounds)
        else:
            self._updates.pop(cell_id, None)

    def held_updates(self, cell_id: str) -> tuple[int, ...]:
        """The rounds of `cell_id` whose committed update is held, oldest first."""
        return tuple(self._updates.get(cell_id, _NO_UPDATES))

    def withdraw(self, cell_id: str | None = None) -> None:
        """Stop serving a cell (or every cell), e.g. after leaving it or before a resync;
        its committed updates go too."""
        if cell_id is None:
            self._states.clear()
            self._updates.clear()
        else:
            self._states.pop(cell_id, None)
            self._updates.pop(cell_id, None)
        self.drop_superseded()  # forgets what was withdrawn; its waiting requests are refused now

    def _wake_waiters(self) -> None:
        """Wake every request waiting in `_lookup`; each looks again at what is held now
        (and forget the piece digests of states no longer held)."""
        for key in [k for k in self._digests if self._states.get(k[0], _NO_STATES).get(k[1]) is None]:
            del self._digests[key]
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
        return await self._held(
            cell_id, committed_round, lambda: self._states.get(cell_id, _NO_STATES).get(committed_round)
        )

    async def _held(self, cell_id: str, committed_round: int, get: Callable[[], _T | None]) -> _T | None:
        """`get()` (what is held of (cell, round): its state, or its update), after waiting
        up to `round_wait_s` for it to be published if `_awaited`; else None."""
        loop = asyncio.get_running_loop()
        start = loop.time()
        waited = False
        while (entry := get()) is None:
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

    async def _digest(self, cell_id: str, entry: _Entry) -> tuple[str, bytes]:
        """(sha256, piece digests) of a held state's file, computed once (in a thread) and shared."""
        key = (cell_id, entry.committed_round, entry.state_hash)
        fut = self._digests.get(key)
        if fut is None:
            fut = asyncio.ensure_future(asyncio.to_thread(entry.file.digests, piece_nbytes_for(entry.file.nbytes)))
            self._digests[key] = fut
        return await asyncio.shield(fut)  # a request that ends does not cancel it for the others

    @staticmethod
    def _range_refusal(req: dp.StateRequest, total: int) -> str:
        """Why a ranged request's range is refused ('' if it is served)."""
        if req.pieces_only:
            return "" if req.offset == req.length == 0 else "a pieces_only request takes no range"
        if not 0 <= req.offset < total:
            return f"offset {req.offset} is outside the {total}-byte state"
        if req.length <= 0:
            return f"length {req.length} must be positive"
        return ""

    async def _on_stream(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        entry: _Entry | None = None
        try:
            req, _ = await asyncio.wait_for(read_message(reader, dp.StateRequest), 10.0)
            ranged = bool(req.offset or req.length or req.pieces_only)
            # the run first: another run's request must not wait for one of our rounds
            entry = await self._lookup(req.cell_id, req.committed_round) if req.run_id == self.run_id else None
            if entry is not None:
                self._asked(req.cell_id, entry.committed_round)
            status = dp.STATUS_NOT_AVAILABLE
            if req.run_id != self.run_id:
                reason = f"wrong run {req.run_id!r}"
            elif entry is None:
                reason = f"{req.cell_id} round {req.committed_round} is not held here"
            elif req.state_hash and req.state_hash != entry.state_hash:
                reason = "our state of that round has a different hash"
            elif ranged and (reason := self._range_refusal(req, entry.file.nbytes)):
                status = dp.STATUS_REJECTED
            elif self._slots.locked():
                reason = "busy serving other joiners"
            else:
                reason = ""
            if reason:
                await write_message(writer, dp.StateInfo(status=status, reason=reason, cell_id=req.cell_id))
                return
            assert entry is not None
            async with self._slots:
                total = entry.file.nbytes
                start, end = 0, total
                sha256, pieces = await self._digest(req.cell_id, entry)
                out = dp.StateInfo(
                    status=dp.STATUS_OK,
                    cell_id=req.cell_id,
                    committed_round=entry.committed_round,
                    state_hash=entry.state_hash,
                    total_nbytes=total,
                    sha256=sha256,
                    chunk_nbytes=self.chunk_nbytes,
                )
                if ranged:
                    out.piece_nbytes = piece_nbytes_for(total)
                    if req.pieces_only:
                        out.piece_sha256 = pieces
                        start = end = 0
                    else:
                        start, end = req.offset, min(total, req.offset + req.length)
                    out.range_offset, out.range_nbytes = start, end - start
                await write_message(writer, out)
                for chunk in entry.file.chunks(start, end, self.chunk_nbytes):
                    n = await write_frame(writer, chunk)
                    self.bytes_served += n  # not `+= await`: concurrent streams would lose counts
            await linger(reader)
        except (FrameError, ConnectionError, OSError, asyncio.IncompleteReadError, TimeoutError) as e:
            log.debug("state stream from %s ended: %s", info.peer_id, e)
        finally:
            if entry is not None:  # the joiner's next range request comes after this one
                self._asked(req.cell_id, entry.committed_round)
            writer.close()

    async def _on_updates_stream(self, info: Any, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """Serve the committed updates of rounds held_round + 1 .. committed_round, all of
        them or none (`catchup.chain_for` says precisely why not)."""
        try:
            req, _ = await asyncio.wait_for(read_message(reader, dp.UpdatesRequest), 10.0)
            status = dp.STATUS_NOT_AVAILABLE
            chain: list[CommittedUpdate] = []
            if req.run_id != self.run_id:
                reason = f"wrong run {req.run_id!r}"
            elif reason := request_refusal(req):
                status = dp.STATUS_REJECTED
            else:
                cell, last = req.cell_id, req.committed_round
                await self._held(cell, last, lambda: self._updates.get(cell, _NO_UPDATES).get(last))
                chain, reason = chain_for(req, self._updates.get(cell, _NO_UPDATES))
            head = None if reason else updates_info(req, chain, self.chunk_nbytes)
            if head is not None and not header_fits(head):
                reason = "the header of these updates is over the frame limit"
            elif head is not None and self._slots.locked():
                reason = "busy serving other joiners"
            if reason or head is None:
                refusal = dp.UpdatesInfo(
                    status=status,
                    reason=reason,
                    cell_id=req.cell_id,
                    held_round=req.held_round,
                    committed_round=req.committed_round,
                )
                await write_message(writer, refusal)
                return
            async with self._slots:
                await write_message(writer, head)

                def sent(n: int) -> None:
                    self.bytes_served += n
                    self.update_bytes_served += n

                await write_updates(writer, chain, self.chunk_nbytes, on_frame=sent)
            await linger(reader)
        except (FrameError, ConnectionError, OSError, asyncio.IncompleteReadError, TimeoutError) as e:
            log.debug("updates stream from %s ended: %s", info.peer_id, e)
        except asyncio.CancelledError:
            log.debug("updates stream from %s cancelled at shutdown", info.peer_id)
        except Exception:  # a surprise from a hostile peer must cost one stream, nothing more
            log.exception("updates stream from %s failed", info.peer_id)
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
    dtype: torch.dtype = torch.float32,
) -> SyncedState:
    """Fetch and verify (cell, committed_round) from the donor; raises a StateSyncError on failure.

    max_nbytes: the largest state accepted (spec.checkpoint.max_bytes). state_hash: the
    committed hash from the coordinator (must be non-empty: round 0 needs no sync). dtype:
    the run's state dtype, which every tensor of the file must have.
    """
    if not state_hash:
        raise ValueError("a committed state hash is required (round 0 is built locally, not synced)")
    try:
        async with asyncio.timeout(timeout_s):
            return await _fetch(
                p2p, donor_peer_id, run_id, cell_id, committed_round, state_hash, max_nbytes, donor_maddrs, dtype
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
    dtype: torch.dtype,
) -> SyncedState:
    pid = await _dial(p2p, donor, maddrs)
    _, reader, writer = await p2p.call_binary_stream_handler(pid, STATE_PROTOCOL)
    try:
        await write_message(
            writer,
            dp.StateRequest(run_id=run_id, cell_id=cell_id, committed_round=committed_round, state_hash=state_hash),
        )
        info, _ = await read_message(reader, dp.StateInfo)
        _check_info(info, cell_id, committed_round, state_hash, donor)
        if not 0 < info.total_nbytes <= max_nbytes:
            raise StateIntegrityError(f"donor announces {info.total_nbytes} bytes, limit {max_nbytes}")
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
    state = await asyncio.to_thread(verify_state_bytes, bytes(buf), state_hash, dtype)
    return SyncedState(cell_id, committed_round, state_hash, state, len(buf))


# ---------------------------------------------------------------------- several donors


@dataclass(frozen=True)
class DonorRef:
    """One donor of a multi-donor fetch: its peer, addresses, the coordinator's expected
    bandwidth for it (0 = unknown) and a name for messages (its worker id)."""

    peer_id: str
    maddrs: tuple[str, ...] = ()
    expected_bytes_per_s: float = 0.0
    name: str = ""

    @property
    def label(self) -> str:
        return self.name or self.peer_id[-8:]


@dataclass(frozen=True)
class MultiSynced:
    """A multi-donor fetch's result: the state, and what each donor did."""

    synced: SyncedState
    nbytes_by_donor: dict[str, int]  # verified piece bytes adopted from each donor (label)
    failed: dict[str, str]  # donors dropped on the way (label -> why)
    liars: tuple[str, ...]  # donors proven to have sent bytes that are not the committed state's
    # seconds each donor had a request in flight (label); with nbytes_by_donor, what the
    # joiner measured of its uplink (reported to the coordinator, which ranks donors by it)
    seconds_by_donor: dict[str, float] = field(default_factory=dict)


class _DonorFailed(Exception):
    """One donor of a multi-donor fetch failed; the others carry on without it."""

    def __init__(self, why: str, *, lied: bool = False) -> None:
        super().__init__(why)
        self.lied = lied


_DONOR_ERRORS = (
    StateSyncError,
    FrameError,
    P2PDaemonError,
    P2PHandlerError,
    ConnectionError,
    OSError,
    asyncio.IncompleteReadError,
)


@dataclass(frozen=True)
class _Offer:
    """What one donor announced: the file of the committed state it would serve."""

    donor: DonorRef
    total_nbytes: int
    sha256: str
    digests: bytes

    @property
    def key(self) -> tuple[int, str, bytes]:
        return (self.total_nbytes, self.sha256, self.digests)


class _Legacy(Exception):
    """The donor answered a pieces_only request with the whole file: it serves no ranges."""


async def _dial(p2p: P2P, donor: str, maddrs: Sequence[str]) -> PeerID:
    pid = PeerID.from_base58(donor)
    if maddrs:
        try:
            # no public connect in P2P; see averaging._dial_all
            await p2p._client.connect(pid, dial_addrs(donor, maddrs))
        except Exception as e:
            log.debug("dialing donor %s failed: %s", donor, e)
    return pid


def _check_info(info: dp.StateInfo, cell_id: str, committed_round: int, state_hash: str, label: str) -> None:
    if info.status != dp.STATUS_OK:
        raise StateNotAvailable(f"donor {label}: {info.reason or dp.Status.Name(info.status)}")
    if (info.cell_id, info.committed_round, info.state_hash) != (cell_id, committed_round, state_hash):
        raise StateIntegrityError(
            f"donor {label} offers {info.cell_id} round {info.committed_round}, not the requested state"
        )
    if not 0 < info.chunk_nbytes <= MAX_CHUNK_NBYTES:
        raise StateIntegrityError(f"donor {label} announces {info.chunk_nbytes}-byte chunks, limit {MAX_CHUNK_NBYTES}")


class _RangedFetch:
    """One attempt to assemble a file from the donors that announced it (one `_Offer` key).

    The file's pieces start split among the donors in contiguous ranges proportional to
    their expected bandwidth. Each donor's task asks for up to `request_nbytes` at a time
    from the front of its own range; one whose range is done takes the back half of the
    largest range another donor has not asked for yet (work stealing), and once nothing is
    left to ask for, it asks again for the rest of the slowest request in flight (the
    endgame: the first copy of a piece to arrive is kept). Every piece is checked against the
    announced digests as it completes, so a donor that sends a wrong byte is caught at that
    piece and dropped, and what it had not delivered goes back to the others; so is a donor
    that fails, or sends nothing for `stall_s`. Memory: the file, plus one piece per donor.
    """

    def __init__(
        self,
        p2p: P2P,
        offers: Sequence[_Offer],
        req: dp.StateRequest,
        *,
        stall_s: float,
        request_nbytes: int,
    ) -> None:
        self.p2p, self.offers, self.req, self.stall_s = p2p, list(offers), req, stall_s
        first = offers[0]
        self.total, self.sha256, self.digests = first.total_nbytes, first.sha256, first.digests
        self.piece = piece_nbytes_for(self.total)
        self.n = -(-self.total // self.piece)
        self.batch = max(1, request_nbytes // self.piece)
        self.buf = bytearray(self.total)
        self.done = bytearray(self.n)
        self.remaining = self.n
        # unrequested work: [start, end) piece ranges, each owned by a donor index (None: anyone's)
        self.claims: list[list[Any]] = [
            [i, a, b] for i, (a, b) in enumerate(split_pieces(self.n, [o.donor.expected_bytes_per_s for o in offers]))
        ]
        self.inflight: dict[int, tuple[int, int]] = {}  # donor -> the piece range it is fetching
        self.duplicated: set[tuple[int, int]] = set()  # in-flight ranges a second donor asked for too
        self.alive = set(range(len(offers)))
        self.failed: dict[str, str] = {}
        self.liars: list[str] = []
        self.nbytes_by_donor = {o.donor.label: 0 for o in offers}
        self.seconds_by_donor = {o.donor.label: 0.0 for o in offers}
        self._changed = asyncio.Event()
        self.finished = asyncio.Event()

    def _piece_len(self, p: int) -> int:
        return min(self.piece, self.total - p * self.piece)

    def _signal(self) -> None:
        changed, self._changed = self._changed, asyncio.Event()
        changed.set()

    def _take_from(self, claim: list[Any]) -> tuple[int, int] | None:
        while claim[1] < claim[2] and self.done[claim[1]]:
            claim[1] += 1  # fetched already (an endgame copy, or returned work done since)
        if claim[1] >= claim[2]:
            return None
        a = claim[1]
        b = min(claim[2], a + self.batch)
        claim[1] = b
        return a, b

    def _take(self, i: int) -> tuple[int, int] | None:
        """The next piece range donor i should ask for, or None if nothing is left for it now."""
        for owner in (i, None):
            for c in self.claims:
                if c[0] == owner and (got := self._take_from(c)) is not None:
                    return got
        # steal the back half of the largest range another live donor has not asked for yet
        victims = [c for c in self.claims if c[0] is not None and c[0] != i and c[2] > c[1]]
        if victims:
            v = max(victims, key=lambda c: (c[2] - c[1], -c[1]))
            mid = v[1] + (v[2] - v[1]) // 2
            mine = [i, mid, v[2]]
            v[2] = mid
            self.claims.append(mine)
            got = self._take_from(mine)
            if got is not None:
                return got
        # endgame: the rest of the in-flight request with the most pieces still missing
        best: tuple[int, int] | None = None
        copied: tuple[int, int] | None = None
        for j, (a, b) in self.inflight.items():
            if j == i or (a, b) in self.duplicated:
                continue
            rest = [p for p in range(a, b) if not self.done[p]]
            if rest and (best is None or len(rest) > best[1] - best[0]):
                best, copied = (rest[0], b), (a, b)
        if copied is not None:
            self.duplicated.add(copied)
        return best

    def _give_back(self, i: int, a: int, b: int) -> None:
        """Donor i is gone: its unrequested ranges and what it had not delivered become anyone's."""
        for c in self.claims:
            if c[0] == i:
                c[0] = None
        if a < b:
            self.claims.append([None, a, b])

    async def run(self) -> None:
        tasks: list[asyncio.Task[Any]] = [asyncio.create_task(self._donor(i)) for i in range(len(self.offers))]
        done_wait: asyncio.Task[Any] = asyncio.create_task(self.finished.wait())
        try:
            pending: set[asyncio.Task[Any]] = {*tasks}
            while pending and not self.finished.is_set():
                _, pending = await asyncio.wait(pending | {done_wait}, return_when=asyncio.FIRST_COMPLETED)
                pending.discard(done_wait)
                for t in tasks:
                    if t.done() and not t.cancelled() and (bug := t.exception()) is not None:
                        raise bug  # not a donor's failure (those are caught in _donor)
        finally:
            for t in (*tasks, done_wait):
                t.cancel()
            await asyncio.gather(*tasks, done_wait, return_exceptions=True)
        if self.remaining:
            why = "; ".join(f"{d}: {r}" for d, r in self.failed.items()) or "no donor left"
            raise StateSyncError(f"{self.remaining} of {self.n} pieces missing after every donor failed ({why})")

    async def _donor(self, i: int) -> None:
        label = self.offers[i].donor.label
        while self.remaining and i in self.alive:
            got = self._take(i)
            if got is None:
                if not self.inflight:
                    return  # nothing in flight anywhere: nothing will come back to take
                changed = self._changed
                await changed.wait()
                continue
            a, b = got
            self.inflight[i] = got
            t0 = time.monotonic()
            try:
                await self._fetch(i, a, b)
            except (_DonorFailed, *_DONOR_ERRORS, TimeoutError) as e:
                self.alive.discard(i)
                self.failed[label] = str(e) if isinstance(e, _DonorFailed) else f"{type(e).__name__}: {e}"
                if isinstance(e, _DonorFailed) and e.lied:
                    self.liars.append(label)
                log.info("state sync: donor %s dropped: %s", label, self.failed[label])
                self._give_back(i, a, b)  # the pieces it delivered are skipped when taken again
                return
            finally:
                self.seconds_by_donor[label] += time.monotonic() - t0
                self.inflight.pop(i, None)
                self._signal()

    async def _fetch(self, i: int, a: int, b: int) -> None:
        """Fetch pieces [a, b) from donor i (it stops early once another donor has delivered
        every piece it had left)."""
        o = self.offers[i]
        off, length = a * self.piece, min(b * self.piece, self.total) - a * self.piece
        pid = PeerID.from_base58(o.donor.peer_id)
        opening = self.p2p.call_binary_stream_handler(pid, STATE_PROTOCOL)
        _, reader, writer = await asyncio.wait_for(opening, self.stall_s)
        try:
            req = dp.StateRequest()
            req.CopyFrom(self.req)
            req.offset, req.length = off, length
            await write_message(writer, req)
            info, _ = await asyncio.wait_for(read_message(reader, dp.StateInfo), self.stall_s)
            _check_info(info, req.cell_id, req.committed_round, req.state_hash, o.donor.label)
            if (info.total_nbytes, info.sha256) != (self.total, self.sha256):
                raise _DonorFailed("announced another file than before", lied=True)
            if (info.range_offset, info.range_nbytes) != (off, length):
                got_range = (info.range_offset, info.range_nbytes)
                raise _DonorFailed(f"served the range {got_range}, not ({off}, {length})")
            p, acc, got = a, bytearray(), 0
            while got < length:
                if all(self.done[q] for q in range(p, b)):
                    return  # another donor delivered the rest first
                chunk = await asyncio.wait_for(read_frame(reader, min(info.chunk_nbytes, length - got)), self.stall_s)
                if not chunk:
                    raise _DonorFailed("sent an empty chunk")
                got += len(chunk)
                view = memoryview(chunk)
                while view:
                    need = self._piece_len(p) - len(acc)
                    acc += view[:need]
                    view = view[need:]
                    if len(acc) == self._piece_len(p):
                        if hashlib.sha256(acc).digest() != self.digests[32 * p : 32 * p + 32]:
                            raise _DonorFailed(f"piece {p} does not match the announced digest", lied=True)
                        if not self.done[p]:
                            self.buf[p * self.piece : p * self.piece + len(acc)] = acc
                            self.done[p] = 1
                            self.remaining -= 1
                            self.nbytes_by_donor[o.donor.label] += len(acc)
                            if not self.remaining:
                                self.finished.set()
                        p += 1
                        acc = bytearray()
        finally:
            writer.close()


async def _announce(p2p: P2P, donor: DonorRef, req: dp.StateRequest, max_nbytes: int, stall_s: float) -> _Offer:
    """Ask one donor what it would serve (pieces_only), and check the answer's bounds. The
    answer itself has no deadline here: a donor hashes its pieces on the first such request,
    which takes a while for a large state; `_announce_all` bounds the wait."""
    pid = await _dial(p2p, donor.peer_id, donor.maddrs)
    _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(pid, STATE_PROTOCOL), stall_s)
    try:
        ask = dp.StateRequest()
        ask.CopyFrom(req)
        ask.pieces_only = True
        await write_message(writer, ask)
        info, _ = await read_message(reader, dp.StateInfo)
    finally:
        writer.close()
    _check_info(info, req.cell_id, req.committed_round, req.state_hash, donor.label)
    if not 0 < info.total_nbytes <= max_nbytes:
        raise StateIntegrityError(f"donor {donor.label} announces {info.total_nbytes} bytes, limit {max_nbytes}")
    if info.piece_nbytes == 0:
        raise _Legacy(donor.label)
    piece = piece_nbytes_for(info.total_nbytes)
    if info.piece_nbytes != piece or len(info.piece_sha256) != 32 * -(-info.total_nbytes // piece):
        raise StateIntegrityError(f"donor {donor.label} announces pieces that do not cut its file")
    if (info.range_offset, info.range_nbytes) != (0, 0):
        raise StateIntegrityError(f"donor {donor.label} answers a pieces_only request with data")
    return _Offer(donor, info.total_nbytes, info.sha256, info.piece_sha256)


def _verify_assembled(buf: bytearray, sha256: str, state_hash: str, dtype: torch.dtype) -> CellState:
    """The assembled file's sha256 (the donors' announced one), then its dtype and state hash."""
    data = bytes(buf)
    if hashlib.sha256(data).hexdigest() != sha256:
        raise StateIntegrityError("sha256 of the assembled bytes does not match the donors'")
    return verify_state_bytes(data, state_hash, dtype)


async def _announce_all(
    p2p: P2P, refs: Sequence[DonorRef], req: dp.StateRequest, max_nbytes: int, stall_s: float
) -> list[BaseException | _Offer]:
    """Every donor's announcement (or its failure), in order. The wait ends `stall_s` after
    the first good one arrives (the others are refused as too slow then; honest donors hash
    the same file at about the same speed), or once every donor has answered."""
    tasks = [asyncio.create_task(_announce(p2p, d, req, max_nbytes, stall_s)) for d in refs]
    try:
        pending: set[asyncio.Task[_Offer]] = set(tasks)
        while pending and not any(t.done() and not t.cancelled() and t.exception() is None for t in tasks):
            _, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
        if pending:
            await asyncio.wait(pending, timeout=stall_s)
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    out: list[BaseException | _Offer] = []
    for t in tasks:
        if t.cancelled():
            out.append(TimeoutError(f"announced nothing within {stall_s}s of the first donor"))
        else:
            out.append(t.exception() or t.result())
    return out


async def fetch_state_from_donors(
    p2p: P2P,
    donors: Sequence[DonorRef],
    *,
    run_id: str,
    cell_id: str,
    committed_round: int,
    state_hash: str,
    max_nbytes: int,
    timeout_s: float = 120.0,
    stall_s: float = STALL_S,
    request_nbytes: int = DEFAULT_REQUEST_NBYTES,
    dtype: torch.dtype = torch.float32,
) -> MultiSynced:
    """Fetch and verify (cell, committed_round) from several donors at once; raises a
    StateSyncError on failure (the caller falls back, as for one donor).

    One donor (or none that serves ranges): `fetch_state`, the single-stream path. Otherwise
    every donor first announces its file (size, sha256, piece digests, `pieces_only`); the
    donors that announce the same file form a group, the largest first (ties: the one
    holding the coordinator's earliest donor), and the group's pieces are fetched in
    parallel (`_RangedFetch`). The assembled file must then hash to the announced sha256 and
    parse into the committed state hash; if it does not, every donor of the group lied
    together, and the next group is tried. The donors are the coordinator's, at most
    `MAX_SYNC_DONORS` of them, duplicates dropped. dtype: the run's state dtype, which every
    tensor of the file must have."""
    if not state_hash:
        raise ValueError("a committed state hash is required (round 0 is built locally, not synced)")
    if not 0 < request_nbytes <= 1 << 30 or stall_s <= 0:
        raise ValueError("request_nbytes must be in (0, 1 GiB] and stall_s positive")
    seen: dict[str, DonorRef] = {}
    for d in donors:
        if d.peer_id and d.peer_id not in seen and len(seen) < MAX_SYNC_DONORS:
            seen[d.peer_id] = d
    refs = list(seen.values())
    if not refs:
        raise StateNotAvailable("no donor to fetch from")

    def single(d: DonorRef) -> Any:
        return fetch_state(
            p2p,
            d.peer_id,
            run_id=run_id,
            cell_id=cell_id,
            committed_round=committed_round,
            state_hash=state_hash,
            max_nbytes=max_nbytes,
            donor_maddrs=d.maddrs,
            timeout_s=timeout_s,
            dtype=dtype,
        )

    if len(refs) == 1:
        t0 = time.monotonic()
        got = await single(refs[0])
        return MultiSynced(got, {refs[0].label: got.nbytes}, {}, (), {refs[0].label: time.monotonic() - t0})
    req = dp.StateRequest(run_id=run_id, cell_id=cell_id, committed_round=committed_round, state_hash=state_hash)
    failed: dict[str, str] = {}
    liars: list[str] = []
    legacy: list[DonorRef] = []
    try:
        async with asyncio.timeout(timeout_s):
            answers = await _announce_all(p2p, refs, req, max_nbytes, stall_s)
            offers: list[_Offer] = []
            for d, ans in zip(refs, answers, strict=True):
                if isinstance(ans, _Offer):
                    offers.append(ans)
                elif isinstance(ans, _Legacy):
                    legacy.append(d)
                elif isinstance(ans, (*_DONOR_ERRORS, TimeoutError)):
                    failed[d.label] = f"{type(ans).__name__}: {ans}"
                else:
                    raise ans  # a bug
            if not offers:
                if legacy:
                    t0 = time.monotonic()
                    got = await single(legacy[0])
                    took = {legacy[0].label: time.monotonic() - t0}
                    return MultiSynced(got, {legacy[0].label: got.nbytes}, failed, (), took)
                why = "; ".join(f"{k}: {v}" for k, v in failed.items())
                raise StateNotAvailable(f"no donor serves the state: {why}")
            groups: dict[tuple[int, str, bytes], list[_Offer]] = {}
            for o in offers:
                groups.setdefault(o.key, []).append(o)
            order = sorted(groups.values(), key=lambda g: (-len(g), offers.index(g[0])))
            last: StateSyncError | None = None
            for g in order:
                fetch = _RangedFetch(p2p, g, req, stall_s=stall_s, request_nbytes=request_nbytes)
                try:
                    await fetch.run()
                except StateSyncError as e:
                    failed.update(fetch.failed)
                    liars.extend(fetch.liars)
                    last = e
                    continue
                failed.update(fetch.failed)
                liars.extend(fetch.liars)
                try:
                    # off the event loop: hashing and parsing gigabytes takes seconds
                    state = await asyncio.to_thread(_verify_assembled, fetch.buf, fetch.sha256, state_hash, dtype)
                except StateIntegrityError as e:
                    group = [o.donor.label for o in g]
                    liars.extend(x for x in group if x not in liars)
                    for x in group:
                        failed[x] = f"announced a file that is not the committed state: {e}"
                    last = e
                    continue
                for o in offers:  # another file than the one that verified: maybe a lie, maybe not ours
                    if o.key != g[0].key:
                        failed.setdefault(o.donor.label, "announced another file than the donors whose file verified")
                synced = SyncedState(cell_id, committed_round, state_hash, state, len(fetch.buf))
                return MultiSynced(synced, fetch.nbytes_by_donor, failed, tuple(liars), fetch.seconds_by_donor)
            assert last is not None
            raise last
    except TimeoutError:
        raise StateSyncError(f"state sync from {len(refs)} donors timed out after {timeout_s}s") from None


# ---------------------------------------------------------------------- catching up by updates


@dataclass(frozen=True)
class CaughtUp:
    """A catch-up by committed updates that verified: the state of the target round, the
    updates it applied (to serve in turn), and what each donor asked did."""

    state: CellState
    updates: tuple[CommittedUpdate, ...]
    donor: str  # the label of the donor whose updates verified
    nbytes: int  # update bytes received from it (the parts, as announced and checked)
    seconds: float  # its request, from dialing to the verified state
    failed: dict[str, str]  # donors asked before it (label -> why they were given up)
    liars: tuple[str, ...]  # of those, the ones proven to have served bytes no member applied


class CatchUpFailed(StateSyncError):
    """No donor's updates verified; `failed` and `liars` say what each did."""

    def __init__(self, why: str, failed: dict[str, str], liars: tuple[str, ...]) -> None:
        super().__init__(why)
        self.failed = failed
        self.liars = liars


async def fetch_updates(
    p2p: P2P,
    donor: DonorRef,
    req: dp.UpdatesRequest,
    *,
    codec: Codec,
    total_numel: int,
    max_nbytes: int,
    stall_s: float = CATCH_UP_STALL_S,
) -> tuple[list[CommittedUpdate], int]:
    """Ask one donor for the updates `req` names; returns them (every part checked against
    its digest) and their bytes. Raises CatchUpError (refused, malformed, a part that lies)
    or a stream error; each wait (dial, stream, header, every frame) is within `stall_s`."""
    pid = await asyncio.wait_for(_dial(p2p, donor.peer_id, donor.maddrs), stall_s)
    _, reader, writer = await asyncio.wait_for(p2p.call_binary_stream_handler(pid, UPDATES_PROTOCOL), stall_s)
    try:
        await write_message(writer, req)
        info, _ = await asyncio.wait_for(read_message(reader, dp.UpdatesInfo), stall_s)
        nbytes = check_info(info, req, codec, total_numel, max_nbytes)
        updates = await read_updates(reader, info, stall_s=stall_s)
    finally:
        writer.close()
    return updates, nbytes


async def catch_up_from_donors(
    p2p: P2P,
    donors: Sequence[DonorRef],
    *,
    run_id: str,
    cell_id: str,
    held: CellState,
    held_round: int,
    held_hash: str,
    committed_round: int,
    state_hash: str,
    codec: Codec,
    cfg: OuterConfig,
    max_nbytes: int,
    timeout_s: float = CATCH_UP_TIMEOUT_S,
    stall_s: float = CATCH_UP_STALL_S,
) -> CaughtUp:
    """Reach (cell, committed_round, state_hash) from `held`, the committed state of
    `held_round`, by the committed updates of the rounds between: the donors are asked in
    order (the coordinator's, at most MAX_SYNC_DONORS, duplicates dropped), one at a time;
    the first whose updates give exactly `state_hash` (`catchup.catch_up`, in a thread)
    wins. A donor that refuses, fails, stalls for `stall_s` or lies is given up for the
    next; all of them together get `timeout_s`. Raises CatchUpFailed when none verified
    (`held` is never changed), ValueError on bad arguments."""
    if not state_hash:
        raise ValueError("a committed state hash is required")
    if not 1 <= committed_round - held_round <= MAX_CATCH_UP_ROUNDS or stall_s <= 0 or timeout_s <= 0:
        raise ValueError(f"rounds {held_round}..{committed_round}: 1 to {MAX_CATCH_UP_ROUNDS} ahead, positive times")
    seen: dict[str, DonorRef] = {}
    for d in donors:
        if d.peer_id and d.peer_id not in seen and len(seen) < MAX_SYNC_DONORS:
            seen[d.peer_id] = d
    req = dp.UpdatesRequest(
        run_id=run_id,
        cell_id=cell_id,
        held_round=held_round,
        held_hash=held_hash,
        committed_round=committed_round,
        state_hash=state_hash,
    )
    total_numel = Layout.of(held.weights).total
    failed: dict[str, str] = {}
    liars: list[str] = []
    loop = asyncio.get_running_loop()
    deadline = loop.time() + timeout_s
    for d in seen.values():
        left = deadline - loop.time()
        if left <= 0:
            break
        t0 = time.monotonic()
        try:
            async with asyncio.timeout(left):
                updates, nbytes = await fetch_updates(
                    p2p, d, req, codec=codec, total_numel=total_numel, max_nbytes=max_nbytes, stall_s=stall_s
                )
                # off the event loop: decoding, the outer steps and the hash take a while
                state = await asyncio.to_thread(catch_up, held, updates, codec, cfg, state_hash)
        except CatchUpError as e:
            failed[d.label] = str(e)
            if e.lied:
                liars.append(d.label)
            log.info("catch-up: donor %s given up: %s", d.label, e)
            continue
        except TimeoutError:
            failed[d.label] = f"timed out (nothing for {stall_s}s, or the catch-up's {timeout_s}s are spent)"
            log.info("catch-up: donor %s given up: %s", d.label, failed[d.label])
            continue
        except _DONOR_ERRORS as e:
            failed[d.label] = f"{type(e).__name__}: {e}"
            log.info("catch-up: donor %s given up: %s", d.label, failed[d.label])
            continue
        took = time.monotonic() - t0
        return CaughtUp(state, tuple(updates), d.label, nbytes, took, failed, tuple(liars))
    why = "; ".join(f"{k}: {v}" for k, v in failed.items()) or "no donor to ask"
    raise CatchUpFailed(
        f"no donor's updates of rounds {held_round + 1}..{committed_round} verified ({why})", failed, tuple(liars)
    )
