"""Per-sender statistics of one part of a group exchange, for the coordinator's audit.

The reducer of a part sees every contributor's slice of the flattened pseudo-gradient. It
reports, for each sender (`protocol.messages.SenderAudit`), what the coordinator needs to
spot a freeloader without seeing any tensor:

- the L2 norm of its decoded slice: a zero update has a norm far below the others';
- the highest cosine with another sender's slice in the same round: a copied update is
  (nearly) collinear with its original, honest updates from different shards are not;
- a sketch of its slice that the coordinator compares with the same sender's sketches of
  earlier rounds: a replayed update has the same sketch again. The flattened vector is cut
  into `blocks` fixed blocks (independent of how the exchange splits it into parts, so a
  block means the same elements in every round); for each block lying wholly inside the
  part, 64 sign bits of a CountSketch (each element added, with a random sign, to one of 64
  buckets; Charikar, Chen and Farach-Colton 2002) whose hashing is seeded by the run id
  and the block alone. Equal vectors give equal bits; the fraction of differing bits grows
  with the angle between two vectors, as in SimHash (Charikar 2002), so codec noise flips
  a bit or two and a fresh update about half of them.

Pure tensor code: no I/O; the projection's randomness is a `torch.Generator` seeded from
the arguments.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

import torch

from bagel.protocol.messages import PartAudit, SenderAudit

SKETCH_BITS = 64


def block_bounds(total: int, blocks: int) -> list[tuple[int, int]]:
    """The fixed sketch blocks [start, end) of a flattened vector of `total` elements."""
    return [(b * total // blocks, (b + 1) * total // blocks) for b in range(blocks)]


def inner_blocks(start: int, end: int, total: int, blocks: int) -> range:
    """Indices of the sketch blocks lying wholly inside [start, end) (non-empty ones)."""
    bounds = block_bounds(total, blocks)
    inside = [b for b, (s, e) in enumerate(bounds) if start <= s and e <= end and e > s]
    return range(inside[0], inside[-1] + 1) if inside else range(0)


def _projection(run_id: str, block: int, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(bucket of each element, its sign) for one block: a function of (run, block) only."""
    seed = int.from_bytes(hashlib.sha256(f"bagel-audit-sketch|{run_id}|{block}".encode()).digest()[:8], "little")
    g = torch.Generator().manual_seed(seed & ((1 << 63) - 1))
    buckets = torch.randint(0, SKETCH_BITS, (n,), generator=g)
    signs = torch.randint(0, 2, (n,), generator=g).to(torch.float64) * 2.0 - 1.0
    return buckets, signs


def sketch_bits(x: torch.Tensor, buckets: torch.Tensor, signs: torch.Tensor) -> int:
    """64 sign bits of the CountSketch of `x` (bit i set when bucket i's sum is positive)."""
    sums = torch.zeros(SKETCH_BITS, dtype=torch.float64).index_add_(0, buckets, x.to(torch.float64) * signs)
    bits = 0
    for i, v in enumerate(sums.tolist()):
        if v > 0:
            bits |= 1 << i
    return bits


def part_audit(
    run_id: str,
    part: int,
    start: int,
    total: int,
    blocks: int,
    accepted: Mapping[str, torch.Tensor],
    excluded: Mapping[str, str],
) -> PartAudit:
    """The audit of one part [start, start + numel) of a `total`-element vector: per sender
    (sorted), its norm, nearest other sender by cosine, and sketch; excluded senders carry
    only the reason. `accepted` maps sender -> its decoded slice (all the same length)."""
    names = sorted(accepted)
    numel = int(accepted[names[0]].numel()) if names else 0
    first = inner_blocks(start, start + numel, total, blocks) if numel else range(0)
    bounds = block_bounds(total, blocks)
    projections = [
        (bounds[b][0] - start, bounds[b][1] - start, *_projection(run_id, b, bounds[b][1] - bounds[b][0]))
        for b in first
    ]
    mat = torch.stack([accepted[n].reshape(-1).to(torch.float64) for n in names]) if names else torch.zeros(0, 0)
    norms = mat.norm(dim=1) if names else torch.zeros(0)
    cos = _cosines(mat, norms)
    out: list[SenderAudit] = []
    for i, n in enumerate(names):
        j = int(cos[i].argmax()) if len(names) > 1 else -1
        if j >= 0 and cos[i, j] < -1.0:  # a zero slice is near nobody
            j = -1
        sketch = tuple(sketch_bits(mat[i, s:e], bk, sg) for s, e, bk, sg in projections)
        out.append(
            SenderAudit(
                n,
                float(norms[i]),
                float(cos[i, j]) if j >= 0 else 0.0,
                names[j] if j >= 0 else "",
                "",
                sketch,
            )
        )
    out += [SenderAudit(n, excluded=r[:200]) for n, r in sorted(excluded.items()) if n not in accepted]
    out.sort(key=lambda a: a.sender)
    return PartAudit(part, first.start if len(first) else 0, tuple(out))


def _cosines(mat: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """Pairwise cosines of the rows, the diagonal (and any zero row) set to -2 (never nearest)."""
    k = mat.shape[0]
    if k < 2:
        return torch.full((k, k), -2.0, dtype=torch.float64)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    unit = mat / safe[:, None]
    c = unit @ unit.T
    zero = norms <= 0
    c[zero, :] = -2.0
    c[:, zero] = -2.0
    c.fill_diagonal_(-2.0)
    return c


def hamming(a: int, b: int) -> int:
    return (a ^ b).bit_count()


__all__ = ["SKETCH_BITS", "block_bounds", "hamming", "inner_blocks", "part_audit", "sketch_bits"]
