"""The reduction of one part of a group exchange, as one function every checker shares.

`reduce_one_part` is what a reducer does with the contributions it received for its part:
decode each codec frame, drop the ones the rule refuses (`Reducer.validate`: shape, dtype,
finiteness; header-level problems and abstentions arrive here already named), clamp each
kept weight to the sender's budget from the frozen contributor set, screen the group's
norms (`Reducer.screen`: a part far above the group's, or a "zero update"), aggregate in
sorted-sender order (`Reducer.aggregate`: float64, fixed order, so deterministic), and
encode the result once with a generator seeded from the exchange's coordinates
(`result_generator`). Because every step is deterministic, the same inputs give the same
bytes on every machine, which is what makes a reducer checkable at all:

- the worker's primary and shadow reducers (`bagel.worker.reducer`) both call it, and a
  contributor applies a part only when their digests agree;
- the coordinator calls it again over the signed inputs of an accusation
  (`bagel.robust.evidence`) and compares with the accused's signed digest.

The group screen runs inside this function (before the aggregate, with `exact_norm`), so
that all three computations stay one and the same.

Also here, because the coordinator needs them without importing the worker: the part
split (`part_bounds`), the codec slice the data plane uses (`Codec`), decoding one part
(`decode_part`) and the seeded generators (`part_generator`).
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch

from bagel.compression import decode
from bagel.protocol import dataplane_pb2 as dp
from bagel.robust.aggregation import PartRejected, Reducer, clamp_weight

__all__ = [
    "Codec",
    "NoValidContribution",
    "PartInput",
    "PartResult",
    "decode_part",
    "group_digest_of",
    "header_problem",
    "part_bounds",
    "part_generator",
    "reduce_one_part",
    "result_generator",
    "part_weights_of",
    "skipped_positions",
]


class Codec(Protocol):
    """The slice of `bagel.compression.Codec` the data plane uses."""

    @property
    def name(self) -> str: ...

    def encode(self, t: torch.Tensor, *, generator: torch.Generator | None = None) -> bytes: ...

    def encoded_nbytes(self, numel: int) -> int: ...


class NoValidContribution(ValueError):
    """Every contribution to the part was excluded: there is nothing to aggregate."""


def part_bounds(
    total: int, parts: int, skip: Collection[int] = (), weights: Sequence[int] | None = None
) -> list[tuple[int, int]]:
    """Split [0, total) into `parts` contiguous ranges, sized by `weights` (None: all equal).

    Positions in `skip` (members that reduce no part: reached through a relay) get an empty
    range and the others share the vector the same way; if every position is skipped, none is.

    `weights` are the coordinator's integer part weights (`Member.part_weight`, from the
    uplinks the other members measured: a slow uplink reduces a smaller part, so it
    uploads less of the averaged result). Position i gets floor(total x w_i / W) elements,
    W the active positions' weight sum, and the elements left over go one each to the
    largest remainders, ties to the lower position (largest remainder, integers only, so
    every machine cuts at the same places). Equal weights give exactly the equal split:
    the first total % parts active positions get one element more. A weight below 1
    counts as 1 (an unset proto field is 0), so no active position is left out by a weight.
    """
    if parts < 1:
        raise ValueError("at least one part")
    if weights is not None and len(weights) != parts:
        raise ValueError(f"{len(weights)} part weights for {parts} parts")
    skipped = {i for i in skip if 0 <= i < parts}
    if len(skipped) == parts:
        skipped = set()
    active = [i for i in range(parts) if i not in skipped]
    w = {i: (max(1, int(weights[i])) if weights is not None else 1) for i in active}
    wsum = sum(w.values())
    size = {i: total * w[i] // wsum for i in active}
    left = total - sum(size.values())  # < len(active): each floor dropped less than one element
    by_remainder = sorted(active, key=lambda i: (-(total * w[i] % wsum), i))
    for i in by_remainder[:left]:
        size[i] += 1
    bounds, start = [], 0
    for i in range(parts):
        end = start + size.get(i, 0)
        bounds.append((start, end))
        start = end
    return bounds


def skipped_positions(members: Sequence[tuple[Any, ...]]) -> frozenset[int]:
    """The positions of frozen members (worker id, peer id, budget[, no_reduce[, weight]]) that reduce no part."""
    return frozenset(i for i, m in enumerate(members) if len(m) > 3 and m[3])


def part_weights_of(members: Sequence[tuple[Any, ...]]) -> list[int] | None:
    """The part weights of frozen members (worker id, peer id, budget[, no_reduce[, weight]]),
    None when every member has weight 1 (the equal split)."""
    ws = [max(1, int(m[4])) if len(m) > 4 else 1 for m in members]
    return ws if any(x != 1 for x in ws) else None


def decode_part(codec: Codec, buf: bytes, numel: int) -> torch.Tensor:
    """Decode with the codec's own `decode` if it has one (test stand-ins), else the module's."""
    dec = getattr(codec, "decode", None)
    try:
        t = dec(buf, max_elements=numel) if dec is not None else decode(buf, max_elements=numel)
    except (ValueError, RuntimeError, TypeError) as e:  # CodecError is a ValueError; stand-ins may differ
        raise PartRejected(f"undecodable payload: {e}") from e
    return t.reshape(-1).clone()  # decode may return a view of the immutable buffer


def part_generator(*key: object) -> torch.Generator:
    """A generator seeded from the exchange coordinates, so stochastic codecs are reproducible."""
    seed = int.from_bytes(hashlib.sha256("|".join(map(str, key)).encode()).digest()[:8], "big") >> 1
    return torch.Generator().manual_seed(seed)


def result_generator(
    run_id: str, cell_id: str, round: int, round_attempt: int, reduce_attempt: int, part: int
) -> torch.Generator:
    """The generator the result of `part` is encoded with: the same for every reducer of it."""
    return part_generator(run_id, cell_id, round, round_attempt, reduce_attempt, "result", part)


@dataclass(frozen=True)
class PartInput:
    """One contributor's input to a part, as received.

    weight: the weight the sender claimed (signed, in a verified exchange); max_samples: its
    budget in the frozen contributor set; payload: the codec frame, None when the sender
    sent none (abstained, or refused before reading); problem: a reason to exclude it that
    was found before decoding (an inconsistent header), "" when there is none.
    """

    sender: str
    weight: float
    max_samples: int
    payload: bytes | None
    problem: str = ""


@dataclass(frozen=True)
class PartResult:
    payload: bytes  # the encoded averaged part: every contributor applies decode(payload)
    included: tuple[str, ...]  # senders aggregated, sorted
    excluded: tuple[tuple[str, str], ...]  # (sender, reason), sorted by sender
    total_weight: float  # sum of the clamped weights of `included`
    # sender -> its decoded part, for the included senders: what the reducer's audit reads
    # (`robust/audit.py`); not part of the result's identity
    parts: Mapping[str, torch.Tensor] = field(default_factory=dict, compare=False, repr=False)
    # sender -> its clamped weight in the aggregate, for the included senders (the loss audit
    # measures each slice at its share of the mean)
    weights: Mapping[str, float] = field(default_factory=dict, compare=False, repr=False)

    @property
    def digest(self) -> bytes:
        return hashlib.sha256(self.payload).digest()


def _exclusion(inp: PartInput, reducer: Reducer, codec: Codec, numel: int) -> tuple[str, torch.Tensor | None]:
    if inp.problem:
        return inp.problem, None
    if not (math.isfinite(inp.weight) and inp.weight > 0) or inp.payload is None:
        return "abstained (non-finite delta or no samples)", None
    try:
        part = decode_part(codec, inp.payload, numel)
        reducer.validate(part, numel)
    except PartRejected as e:
        return e.reason, None
    return "", part


def reduce_one_part(
    codec: Codec,
    reducer: Reducer,
    numel: int,
    inputs: Sequence[PartInput],
    generator: torch.Generator | None,
) -> PartResult:
    """Decode, validate, clamp, screen the group's norms, aggregate in sorted-sender order, encode
    once (see the module doc).

    Raises NoValidContribution when nothing is left to aggregate, ValueError on duplicate senders.
    """
    by_sender = {i.sender: i for i in inputs}
    if len(by_sender) != len(inputs):
        raise ValueError("duplicate senders among the inputs")
    kept: list[tuple[str, float, torch.Tensor]] = []
    excluded: list[tuple[str, str]] = []
    for sender in sorted(by_sender):
        inp = by_sender[sender]
        reason, part = _exclusion(inp, reducer, codec, numel)
        if part is None:
            excluded.append((sender, reason))
        else:
            kept.append((sender, clamp_weight(inp.weight, max(1, inp.max_samples)), part))
    # the group screen: norms far outside the group's are left out like a bad part
    screening = reducer.screen([p for _, _, p in kept])
    excluded += [(kept[j][0], reason) for j, reason in screening.excluded]
    kept = [kept[j] for j in screening.kept]
    if not kept:
        raise NoValidContribution(f"no valid contribution: {dict(excluded)}")
    excluded.sort()
    weights = [w for _, w, _ in kept]
    averaged = reducer.aggregate([p for _, _, p in kept], weights)
    payload = codec.encode(averaged, generator=generator)
    return PartResult(
        payload,
        tuple(s for s, _, _ in kept),
        tuple(excluded),
        float(sum(weights)),
        {s: p for s, _, p in kept},
        {s: w for s, w, _ in kept},
    )


def group_digest_of(members: Sequence[tuple[Any, ...]]) -> str:
    """Binds an exchange to one frozen contributor set of (worker id, peer id, budget[, no_reduce[,
    part weight]]), sorted by worker id: every member, and the coordinator checking evidence, must
    see the same one (a member that reduces no part is marked, and a part weight other than 1
    is written, so the split is bound too; a set of weight-1 members hashes as it always did)."""
    text = "|".join(
        f"{m[0]},{m[1]},{m[2]}"
        + (",r" if len(m) > 3 and m[3] else "")
        + (f",w{int(m[4])}" if len(m) > 4 and int(m[4]) != 1 else "")
        for m in members
    )
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def header_problem(
    h: dp.ContributionHeader, *, num_parts: int, total_numel: int, part_numel: int, layout_digest: str, codec: Codec
) -> str:
    """Why a contributor's header is inconsistent with the reducer's view ('' when it is fine).

    A contribution with a problem is excluded before its payload is read; the coordinator
    applies the same check to the headers of an accusation.
    """
    if h.num_parts != num_parts or h.total_numel != total_numel:
        return f"sender has {h.num_parts} parts of {h.total_numel} elements, we have {num_parts} parts of {total_numel}"
    if h.part_numel != part_numel:
        return f"part has {h.part_numel} elements, expected {part_numel}"
    if h.layout_digest != layout_digest:
        return "different tensor layout (model)"
    if h.codec != codec.name:
        return f"codec {h.codec!r}, the run uses {codec.name!r}"
    if not (math.isfinite(h.weight) and h.weight > 0):
        if h.weight == 0 and h.payload_nbytes == 0:
            return "abstained (non-finite delta or no samples)"
        return f"weight {h.weight} is not positive"
    if not 0 < h.payload_nbytes <= codec.encoded_nbytes(part_numel):
        return f"payload of {h.payload_nbytes} bytes, limit {codec.encoded_nbytes(part_numel)}"
    return ""
