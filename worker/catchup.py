"""Catching up by committed updates: a worker that holds a cell's committed state of round j
reaches round R by applying the committed updates of rounds j+1..R itself, instead of
downloading the whole state again.

Why that works: every member of a round applies exactly the same bytes (`averaging.py`):
the reducers' encoded averaged parts, `averaged = Layout.unflatten(cat(decode(part_j)))`,
then `outer_step(state, averaged, cfg, ema_step=max(1, round))` on a clone of the committed
state (`roundwork.reduce_round`); the outer step is bit-deterministic (`diloco.py`). So the
parts of a round, kept as they were applied (`CommittedUpdate`), are all a holder of the
round before needs. With int8 an update is about a quarter of the fp32 weights, and a full
state (weights, outer momentum, average) three times the weights: one round's update is
about 1/12 of a download (int4: 1/24).

Here: the update as kept, both sides' checks of the wire form (`protocol/dataplane.proto`:
UpdatesRequest, UpdatesInfo, then the parts' bytes), writing and reading the parts in
bounded frames with a sha256 per part, and applying the updates. The P2P side (the donor's
handler next to its state handler, the joiner trying its donors in order) is in
`statesync.py`; `Orders._sync` tries it before a full download.

Trust: a donor's answer is checked before a data byte is read: it must describe exactly
the rounds j+1..R (at most `MAX_CATCH_UP_ROUNDS`, none missing, in order), each in the run's
codec, cut in 1..`MAX_UPDATE_PARTS` parts whose element counts sum to the cell's parameter
count and whose byte sizes are at most the codec's encoding of that many elements
(`part_nbytes_limit`; so the total is bounded by the codec's encoding of the cell's
parameters, a little more per extra part), the total within the caller's limit. Then every
part must match its digest, decode with the run's codec into finite values of its size, and
the state the outer steps give must have the committed hash of R. Digest, decode or hash
failures are proof that the donor served bytes no member applied (`CatchUpError.lied`); the
caller then adopts nothing and falls back to the full download.
"""

from __future__ import annotations

import asyncio
import hashlib
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from itertools import pairwise

import torch

from bagel.compression import CodecError, peek_header
from bagel.protocol import dataplane_pb2 as dp
from bagel.protocol.runspec import MAX_CATCH_UP_ROUNDS
from bagel.robust.reduction import PartRejected
from bagel.worker.diloco import CellState, OuterConfig, StateFormatError, outer_step
from bagel.worker.framing import MAX_HEADER_NBYTES, read_frame, write_frame
from bagel.worker.parts import Codec, Layout, decode_part

__all__ = [
    "MAX_CATCH_UP_ROUNDS",
    "MAX_UPDATE_PARTS",
    "CatchUpError",
    "CommittedUpdate",
    "apply_updates",
    "catch_up",
    "chain_for",
    "check_info",
    "header_fits",
    "part_nbytes_limit",
    "read_updates",
    "request_refusal",
    "updates_info",
    "write_updates",
]

# Parts of one round (one per reducer of its exchange). An UpdatesInfo of MAX_CATCH_UP_ROUNDS
# rounds of this many parts (about 45 bytes each: a digest, two counts) stays well inside
# framing.MAX_HEADER_NBYTES; a cell exchanged by more contributors is refused, and synced by
# a full download.
MAX_UPDATE_PARTS = 128
SHA256_NBYTES = 32
MAX_CHUNK_NBYTES = 16 << 20  # as statesync.MAX_CHUNK_NBYTES: the largest data frame accepted


class CatchUpError(Exception):
    """A donor's updates cannot be used. `refused`: the donor said so (it does not hold
    them, or is busy); `lied`: it served bytes that no member of those rounds applied (a
    part that does not match its digest or does not decode, or a state of the wrong hash)."""

    def __init__(self, why: str, *, lied: bool = False, refused: bool = False) -> None:
        super().__init__(why)
        self.lied = lied
        self.refused = refused


@dataclass(frozen=True)
class CommittedUpdate:
    """The committed update of one round, as every member applied it: the reducers'
    encoded averaged parts, in part order (b"" for a part nobody reduced).

    base_hash / state_hash: the committed state it applies to (round - 1) and the one it
    gives (round); "" where unknown. A donor uses them to refuse a request its updates
    cannot answer; a joiner trusts neither and checks the hash of what it computes."""

    round: int
    codec: str  # canonical codec name
    part_numels: tuple[int, ...]
    parts: tuple[bytes, ...]
    part_sha256: tuple[bytes, ...]
    base_hash: str = ""
    state_hash: str = ""

    @classmethod
    def of(
        cls,
        round: int,
        codec: str,
        part_numels: Sequence[int],
        parts: Sequence[bytes],
        *,
        base_hash: str = "",
        state_hash: str = "",
    ) -> CommittedUpdate:
        """The update of `round` from the parts as applied; hashes every part (a pass over
        the bytes: call it off the event loop for a large model)."""
        if len(part_numels) != len(parts):
            raise ValueError(f"{len(parts)} parts but {len(part_numels)} part sizes")
        digests = tuple(hashlib.sha256(p).digest() for p in parts)
        return cls(round, codec, tuple(int(n) for n in part_numels), tuple(parts), digests, base_hash, state_hash)

    @property
    def nbytes(self) -> int:
        return sum(len(p) for p in self.parts)

    def to_pb(self) -> dp.RoundUpdate:
        return dp.RoundUpdate(
            round=self.round,
            codec=self.codec,
            part_numel=list(self.part_numels),
            part_nbytes=[len(p) for p in self.parts],
            part_sha256=list(self.part_sha256),
        )


def part_nbytes_limit(codec: Codec, numel: int) -> int:
    """The most bytes a part of `numel` elements may take: the codec's exact encoding of a
    flat tensor of that many elements (0 for an empty part, which is never sent)."""
    return codec.encoded_nbytes(numel) if numel else 0


# ---------------------------------------------------------------- the donor's side


def request_refusal(req: dp.UpdatesRequest) -> str:
    """Why a request is malformed ('' if it is not): from a round held to 1 to
    `MAX_CATCH_UP_ROUNDS` rounds on, with the committed hash of the last."""
    ahead = req.committed_round - req.held_round
    if req.held_round < 0:
        return f"held round {req.held_round} is negative"
    if not 1 <= ahead <= MAX_CATCH_UP_ROUNDS:
        return (
            f"rounds {req.held_round}..{req.committed_round}: a catch-up spans 1 to {MAX_CATCH_UP_ROUNDS} rounds,"
            f" not {ahead}"
        )
    if not req.state_hash:
        return "no committed hash to reach"
    return ""


def chain_for(req: dp.UpdatesRequest, held: Mapping[int, CommittedUpdate]) -> tuple[list[CommittedUpdate], str]:
    """The held updates of rounds held_round + 1 .. committed_round in order, or ([], why
    they cannot answer the request). `req` passed `request_refusal`."""
    want = range(req.held_round + 1, req.committed_round + 1)
    missing = [r for r in want if r not in held]
    if missing:
        have = ", ".join(map(str, sorted(held))) or "none"
        if len(missing) == 1:
            what = f"the update of round {missing[0]} is"
        else:
            what = f"the updates of rounds {', '.join(map(str, missing))} are"
        return [], f"{req.cell_id}: {what} not held here (held: {have})"
    chain = [held[r] for r in want]
    first = chain[0]
    if req.held_hash and first.base_hash and first.base_hash != req.held_hash:
        return [], f"our update of round {first.round} applies to another state of round {req.held_round} than yours"
    for a, b in pairwise(chain):
        if a.state_hash and b.base_hash and a.state_hash != b.base_hash:
            return [], f"our updates of rounds {a.round} and {b.round} do not follow each other"
    last = chain[-1]
    if last.state_hash and last.state_hash != req.state_hash:
        return [], f"our round {last.round} has a different hash"
    for u in chain:
        if not 1 <= len(u.parts) <= MAX_UPDATE_PARTS:
            return [], f"round {u.round} has {len(u.parts)} parts, more than the {MAX_UPDATE_PARTS} served"
    return chain, ""


def updates_info(req: dp.UpdatesRequest, chain: Sequence[CommittedUpdate], chunk_nbytes: int) -> dp.UpdatesInfo:
    """The header of an answer that serves `chain` (from `chain_for`)."""
    return dp.UpdatesInfo(
        status=dp.STATUS_OK,
        cell_id=req.cell_id,
        held_round=req.held_round,
        committed_round=req.committed_round,
        state_hash=req.state_hash,
        chunk_nbytes=chunk_nbytes,
        rounds=[u.to_pb() for u in chain],
    )


async def write_updates(
    writer: asyncio.StreamWriter,
    chain: Sequence[CommittedUpdate],
    chunk_nbytes: int,
    *,
    on_frame: Callable[[int], None] | None = None,
) -> int:
    """Every part of every round in order, each in frames of at most `chunk_nbytes` (a frame
    never spans two parts); returns the bytes put on the stream, and tells `on_frame` the
    bytes of each frame as it goes."""
    sent = 0
    for u in chain:
        for p in u.parts:
            view = memoryview(p)
            for at in range(0, len(view), chunk_nbytes):
                n = await write_frame(writer, view[at : at + chunk_nbytes])
                sent += n
                if on_frame is not None:
                    on_frame(n)
    return sent


# ---------------------------------------------------------------- the joiner's side


def check_info(info: dp.UpdatesInfo, req: dp.UpdatesRequest, codec: Codec, total_numel: int, max_nbytes: int) -> int:
    """Check a donor's header before a data byte is read; returns the data bytes announced.

    total_numel: the cell's parameter count (the joiner's own state's Layout.total);
    max_nbytes: the most update bytes the caller takes in all."""
    if info.status != dp.STATUS_OK:
        raise CatchUpError(f"refused: {info.reason or dp.Status.Name(info.status)}", refused=True)
    asked = (req.cell_id, req.held_round, req.committed_round, req.state_hash)
    if (info.cell_id, info.held_round, info.committed_round, info.state_hash) != asked:
        raise CatchUpError(
            f"answers for {info.cell_id} rounds {info.held_round}..{info.committed_round}, not the request"
        )
    if not 0 < info.chunk_nbytes <= MAX_CHUNK_NBYTES:
        raise CatchUpError(f"announces {info.chunk_nbytes}-byte frames, limit {MAX_CHUNK_NBYTES}")
    if len(info.rounds) > MAX_CATCH_UP_ROUNDS:
        raise CatchUpError(f"announces {len(info.rounds)} rounds, at most {MAX_CATCH_UP_ROUNDS} are taken")
    got = [r.round for r in info.rounds]
    want = list(range(req.held_round + 1, req.committed_round + 1))
    if got != want:
        raise CatchUpError(f"announces rounds {got}, not {want[0]}..{want[-1]} in order")
    total = 0
    for r in info.rounds:
        if r.codec != codec.name:
            raise CatchUpError(f"round {r.round}: codec {r.codec[:40]!r}, the run's is {codec.name!r}")
        k = len(r.part_numel)
        if not 1 <= k <= MAX_UPDATE_PARTS:
            raise CatchUpError(f"round {r.round}: {k} parts, 1 to {MAX_UPDATE_PARTS} are taken")
        if len(r.part_nbytes) != k or len(r.part_sha256) != k:
            raise CatchUpError(
                f"round {r.round}: {k} part sizes, {len(r.part_nbytes)} byte counts, {len(r.part_sha256)} digests"
            )
        if (neg := min(r.part_numel)) < 0:
            raise CatchUpError(f"round {r.round}: a part of {neg} elements")
        if sum(r.part_numel) != total_numel:
            raise CatchUpError(f"round {r.round}: parts of {sum(r.part_numel)} elements, the cell has {total_numel}")
        for i, (n, b, d) in enumerate(zip(r.part_numel, r.part_nbytes, r.part_sha256, strict=True)):
            limit = part_nbytes_limit(codec, n)
            if not (0 < b <= limit if n else b == 0):
                raise CatchUpError(f"round {r.round} part {i}: {b} bytes for {n} elements (at most {limit})")
            if len(d) != SHA256_NBYTES:
                raise CatchUpError(f"round {r.round} part {i}: a digest of {len(d)} bytes")
            total += b
    if total > max_nbytes:
        raise CatchUpError(f"announces {total} bytes of updates, limit {max_nbytes}")
    return total


async def read_updates(reader: asyncio.StreamReader, info: dp.UpdatesInfo, *, stall_s: float) -> list[CommittedUpdate]:
    """Read the parts `info` (checked by `check_info`) announces, each frame within
    `stall_s` and within what is left of its part, each part checked against its digest."""
    out: list[CommittedUpdate] = []
    last = info.rounds[-1].round if info.rounds else None
    for r in info.rounds:
        parts: list[bytes] = []
        for i, (b, d) in enumerate(zip(r.part_nbytes, r.part_sha256, strict=True)):
            digest = hashlib.sha256()
            frames: list[bytes] = []
            got = 0
            while got < b:
                frame = await asyncio.wait_for(read_frame(reader, min(info.chunk_nbytes, b - got)), stall_s)
                if not frame:
                    raise CatchUpError(f"round {r.round} part {i}: an empty frame")
                digest.update(frame)
                frames.append(frame)
                got += len(frame)
            if digest.digest() != d:
                raise CatchUpError(f"round {r.round} part {i} does not match its announced digest", lied=True)
            parts.append(frames[0] if len(frames) == 1 else b"".join(frames))
        out.append(
            CommittedUpdate(
                r.round,
                r.codec,
                tuple(r.part_numel),
                tuple(parts),
                tuple(r.part_sha256),
                state_hash=info.state_hash if r.round == last else "",
            )
        )
    return out


def _decoded(u: CommittedUpdate, codec: Codec, layout: Layout) -> dict[str, torch.Tensor]:
    """The averaged delta of update `u`, decoded as the exchange decodes it, in `layout`."""
    if u.codec != codec.name:
        raise CatchUpError(f"round {u.round}: codec {u.codec!r}, the run's is {codec.name!r}")
    if len(u.parts) != len(u.part_numels) or sum(u.part_numels) != layout.total:
        raise CatchUpError(f"round {u.round}: parts of {sum(u.part_numels)} elements, the cell has {layout.total}")
    flat: list[torch.Tensor] = []
    for i, (n, buf) in enumerate(zip(u.part_numels, u.parts, strict=True)):
        where = f"round {u.round} part {i}"
        if n == 0:
            if buf:
                raise CatchUpError(f"{where}: {len(buf)} bytes for an empty part", lied=True)
            flat.append(torch.zeros(0))
            continue
        codec_id = getattr(codec, "codec_id", None)  # a bagel.compression codec (test stand-ins have none)
        if codec_id is not None:
            try:
                h = peek_header(buf, max_elements=n)
            except CodecError as e:
                raise CatchUpError(f"{where}: undecodable: {e}", lied=True) from e
            if h.codec != codec_id:
                raise CatchUpError(f"{where}: encoded with codec id {int(h.codec)}, not {codec.name}", lied=True)
        try:
            part = decode_part(codec, buf, n)  # the exchange's own decode (worker/averaging.py)
        except PartRejected as e:
            raise CatchUpError(f"{where}: {e.reason}", lied=True) from e
        if part.dtype != torch.float32 or part.numel() != n:
            dtype = str(part.dtype).removeprefix("torch.")
            raise CatchUpError(f"{where}: decodes to {part.numel()} {dtype} values, not {n} float32", lied=True)
        if not bool(torch.isfinite(part).all()):
            bad = int((~torch.isfinite(part)).sum())
            raise CatchUpError(f"{where}: {bad} non-finite values", lied=True)
        flat.append(part)
    return layout.unflatten(torch.cat(flat))


def apply_updates(state: CellState, updates: Sequence[CommittedUpdate], codec: Codec, cfg: OuterConfig) -> CellState:
    """Blocking: a clone of `state` after the outer step of every update in order, each with
    `ema_step=max(1, round)` as its members applied it. `state` is never changed."""
    for a, b in pairwise(updates):
        if b.round != a.round + 1:
            raise CatchUpError(f"updates of rounds {a.round} and {b.round} leave a gap")
    layout = Layout.of(state.weights)
    new = state.clone()
    for u in updates:
        averaged = _decoded(u, codec, layout)
        try:
            outer_step(new, averaged, cfg, ema_step=max(1, u.round))
        except StateFormatError as e:
            raise CatchUpError(f"round {u.round}: {e}") from e
    return new


def catch_up(
    state: CellState, updates: Sequence[CommittedUpdate], codec: Codec, cfg: OuterConfig, state_hash: str
) -> CellState:
    """Blocking: `apply_updates`, and the result only if it has the committed `state_hash`."""
    if not updates:
        raise CatchUpError("no update to apply")
    new = apply_updates(state, updates, codec, cfg)
    got = new.state_hash()
    if got != state_hash:
        rounds = f"{updates[0].round}..{updates[-1].round}"
        raise CatchUpError(
            f"the updates of rounds {rounds} give state hash {got[:16]}..., not the committed {state_hash[:16]}...",
            lied=True,
        )
    return new


def header_fits(info: dp.UpdatesInfo) -> bool:
    """Whether the header is within the frame limit every joiner reads it with."""
    return info.ByteSize() <= MAX_HEADER_NBYTES
