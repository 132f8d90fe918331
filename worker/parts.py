"""How a pseudo-gradient becomes parts and bytes: layout, part split, codec calls, peers (pure).

Shared by the group exchange (`averaging.py`) and its tests. The flattening order is
fixed (sorted parameter names) and the split deterministic (`part_bounds`), so every
contributor cuts the same vector at the same places. Stochastic codecs get a generator
seeded from the exchange's coordinates (`part_generator`), so a re-run encodes the
same bytes.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from bagel.compression import get_codec
from bagel.protocol.messages import FrozenMember, frozen_member
from bagel.robust.reduction import (
    Codec,
    decode_part,
    group_digest_of,
    part_bounds,
    part_generator,
    part_weights_of,
    skipped_positions,
)

__all__ = [
    "Codec",
    "Contribution",
    "Contributor",
    "Layout",
    "decode_part",
    "group_digest",
    "part_bounds",
    "part_generator",
    "prepare_contribution",
    "reduce_part",
    "resolve_codec",
    "split_of",
]

# ---------------------------------------------------------------- codecs


def resolve_codec(codec: str | Codec) -> Codec:
    """A codec object from its name (`bagel.compression.get_codec`), or the object itself."""
    return get_codec(codec) if isinstance(codec, str) else codec


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
        text = ";".join(f"{n}:{','.join(map(str, s))}" for n, s in zip(self.names, self.shapes, strict=True))
        return hashlib.sha256(text.encode()).hexdigest()

    def flatten(self, tensors: Mapping[str, torch.Tensor]) -> torch.Tensor:
        if set(tensors) != set(self.names):
            raise ValueError(f"tensor names differ from the layout: {sorted(set(tensors) ^ set(self.names))}")
        return torch.cat([tensors[n].detach().to("cpu", torch.float32).reshape(-1) for n in self.names])

    def unflatten(self, flat: torch.Tensor, *, copy: bool = True) -> dict[str, torch.Tensor]:
        """The tensors of a flat vector by name: copies, or with `copy=False` views of it."""
        if flat.numel() != self.total:
            raise ValueError(f"flat vector has {flat.numel()} elements, layout has {self.total}")
        out, start = {}, 0
        for name, shape, n in zip(self.names, self.shapes, self.numels, strict=True):
            view = flat[start : start + n].reshape(shape)
            out[name] = view.clone() if copy else view
            start += n
        return out


@dataclass(frozen=True)
class Contributor:
    """One member of the frozen contributor set (from the coordinator's `Member`)."""

    worker_id: str
    peer_id: str  # base58 libp2p peer id
    maddrs: tuple[str, ...] = ()
    max_samples: int = 1
    no_reduce: bool = False  # reduces no part (reached through a relay): its part is empty
    # its part's relative size in the split (`part_bounds`), from the uplink its peers
    # measured; 1 for everyone = equal parts
    part_weight: int = 1

    def frozen(self) -> FrozenMember:
        """As the group digest and the coordinator's frozen set write it (`frozen_member`)."""
        return frozen_member(self.worker_id, self.peer_id, self.max_samples, self.no_reduce, self.part_weight)


def group_digest(contributors: Sequence[Contributor]) -> str:
    """Binds an exchange to one frozen contributor set: every member must see the same one."""
    return group_digest_of([c.frozen() for c in contributors])


def split_of(contributors: Sequence[Contributor], total: int) -> list[tuple[int, int]]:
    """The part bounds every member of this (sorted) contributor set cuts: relayed members'
    parts empty, the others sized by their part weights (`part_bounds`)."""
    frozen = [c.frozen() for c in contributors]
    return part_bounds(total, len(frozen), skipped_positions(frozen), part_weights_of(frozen))


@dataclass
class Contribution:
    """Our side of one exchange before a byte is sent: the parts we encode, and what the codec dropped.

    It holds one vector the size of the delta, the residual, not the compensated delta, its
    flat copy and the decoded parts besides: a reducer decodes our part from the payload,
    and the residual is all error feedback keeps."""

    layout: Layout
    bounds: list[tuple[int, int]]
    codec: Codec
    payloads: list[bytes]  # one codec frame per part (b"" for an empty part or when abstaining)
    abstained: str  # non-empty: we send nothing (non-finite delta or no samples), and why
    # compensated - decode(payload), flattened: what the codec dropped (zeros when abstaining,
    # so a non-finite delta is not carried into the next round)
    residual_flat: torch.Tensor

    def decoded(self, j: int) -> torch.Tensor:
        """decode(payload) of part j: exactly what its reducers aggregate (zeros for an empty one)."""
        s, e = self.bounds[j]
        if not self.payloads[j]:
            return torch.zeros(e - s)
        return decode_part(self.codec, self.payloads[j], e - s)

    def residual(self) -> dict[str, torch.Tensor]:
        """The residual by tensor name: views of `residual_flat`, not copies (never change them in place)."""
        return self.layout.unflatten(self.residual_flat, copy=False)

    def commit_error_feedback(self, error_feedback: Any) -> None:
        """Store the new residual per tensor name (`ErrorFeedback.store`); call only after success."""
        for n, r in self.residual().items():
            error_feedback.store(n, r)


def prepare_contribution(
    delta: Mapping[str, torch.Tensor],
    codec: Codec,
    num_parts: int,
    gen_key: tuple,
    *,
    weight: float,
    error_feedback: Any = None,
    skip: Collection[int] = (),
    weights: Sequence[int] | None = None,
) -> Contribution:
    """Compensate with the error-feedback residual, flatten, split, encode every part, and keep
    what the codec dropped.

    One float32 vector the size of the delta is made: the compensated delta is written into
    it tensor by tensor, each part is encoded from it, and then the part's decoded values
    are subtracted from it in place, so it ends as the residual (the same elementwise adds
    and subtractions as compensating and subtracting tensor by tensor).

    Pure: the residual is not stored here (`Contribution.commit_error_feedback` does that once
    the exchange succeeded, so a failed attempt leaves the worker's feedback untouched).
    """
    layout = Layout.of(delta)
    flat = torch.empty(layout.total, dtype=torch.float32)
    start = 0
    for n, numel in zip(layout.names, layout.numels, strict=True):
        out = flat[start : start + numel]
        if error_feedback is not None:
            error_feedback.compensate_into(n, delta[n], out)
        else:
            out.copy_(delta[n].detach().reshape(-1))
        start += numel
    finite = bool(torch.isfinite(flat).all())
    abstained = "" if finite and weight > 0 else ("non-finite delta" if not finite else "no samples")
    # `skip`: positions that reduce no part; `weights`: the parts' relative sizes (None: equal)
    bounds = part_bounds(layout.total, num_parts, skip, weights)
    payloads: list[bytes] = []
    for j, (s, e) in enumerate(bounds):
        if abstained or s == e:
            payloads.append(b"")
            continue
        buf = codec.encode(flat[s:e], generator=part_generator(*gen_key, j))
        payloads.append(buf)
        flat[s:e] -= decode_part(codec, buf, e - s)  # the part becomes its residual
    if abstained:
        flat.zero_()
    return Contribution(layout, bounds, codec, payloads, abstained, flat)


def reduce_part(
    codec: Codec,
    reducer: Any,
    parts: Sequence[torch.Tensor],
    weights: Sequence[float],
    generator: torch.Generator | None,
) -> bytes:
    """Aggregate already decoded and validated contributions and encode once (the last two
    steps of `bagel.robust.reduction.reduce_one_part`, which the reducers call)."""
    return codec.encode(reducer.aggregate(parts, weights), generator=generator)
