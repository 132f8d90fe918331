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
the arguments; memory is bounded by `CHUNK` elements per sender at a time, whatever the
model's size.
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


CHUNK = 1 << 20  # elements handled at a time: memory stays O(senders x CHUNK) for any model


def _generator(run_id: str, block: int) -> torch.Generator:
    """The projection's randomness for one block: a function of (run, block) only."""
    seed = int.from_bytes(hashlib.sha256(f"bagel-audit-sketch|{run_id}|{block}".encode()).digest()[:8], "little")
    return torch.Generator().manual_seed(seed & ((1 << 63) - 1))


def _bits(sums: torch.Tensor) -> int:
    bits = 0
    for i, v in enumerate(sums.tolist()):
        if v > 0:
            bits |= 1 << i
    return bits


def block_sketches(run_id: str, block: int, rows: list[torch.Tensor]) -> list[int]:
    """The 64 sign bits of each row's CountSketch over one block (every row is that block's
    elements of one sender): each element is added, with a random sign, to one of 64 buckets;
    bit i is set when bucket i's sum is positive. The buckets and signs are drawn CHUNK
    elements at a time from the block's own generator, so every reducer draws the same."""
    g = _generator(run_id, block)
    n = int(rows[0].numel()) if rows else 0
    sums = [torch.zeros(SKETCH_BITS, dtype=torch.float64) for _ in rows]
    for s in range(0, n, CHUNK):
        e = min(n, s + CHUNK)
        buckets = torch.randint(0, SKETCH_BITS, (e - s,), generator=g)
        signs = torch.randint(0, 2, (e - s,), generator=g).to(torch.float64) * 2.0 - 1.0
        for acc, row in zip(sums, rows, strict=True):
            acc.index_add_(0, buckets, row[s:e].to(torch.float64) * signs)
    return [_bits(x) for x in sums]


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
    rows = [accepted[n].reshape(-1) for n in names]
    numel = int(rows[0].numel()) if rows else 0
    inside = inner_blocks(start, start + numel, total, blocks) if numel else range(0)
    bounds = block_bounds(total, blocks)
    gram = torch.zeros(len(names), len(names), dtype=torch.float64)
    for s in range(0, numel, CHUNK):
        sub = torch.stack([r[s : s + CHUNK] for r in rows]).to(torch.float64)
        gram += sub @ sub.T
    norms = gram.diagonal().clamp(min=0.0).sqrt()
    cos = _cosines(gram, norms)
    sketches = [
        block_sketches(run_id, b, [r[bounds[b][0] - start : bounds[b][1] - start] for r in rows]) for b in inside
    ]
    out: list[SenderAudit] = []
    for i, n in enumerate(names):
        j = int(cos[i].argmax()) if len(names) > 1 else -1
        if j >= 0 and cos[i, j] < -1.0:  # a zero slice is near nobody
            j = -1
        out.append(
            SenderAudit(
                n,
                float(norms[i]),
                float(cos[i, j].clamp(-1.0, 1.0)) if j >= 0 else 0.0,
                names[j] if j >= 0 else "",
                "",
                tuple(sk[i] for sk in sketches),
            )
        )
    out += [SenderAudit(n, excluded=r[:200]) for n, r in sorted(excluded.items()) if n not in accepted]
    out.sort(key=lambda a: a.sender)
    return PartAudit(part, inside.start if len(inside) else 0, tuple(out))


def _cosines(gram: torch.Tensor, norms: torch.Tensor) -> torch.Tensor:
    """Pairwise cosines from the Gram matrix, the diagonal (and any zero row) set to -2
    (never nearest)."""
    k = gram.shape[0]
    if k < 2:
        return torch.full((k, k), -2.0, dtype=torch.float64)
    safe = torch.where(norms > 0, norms, torch.ones_like(norms))
    c = gram / safe[:, None] / safe[None, :]
    zero = norms <= 0
    c[zero, :] = -2.0
    c[:, zero] = -2.0
    c.fill_diagonal_(-2.0)
    return c


def hamming(a: int, b: int) -> int:
    return (a ^ b).bit_count()


__all__ = ["CHUNK", "SKETCH_BITS", "block_bounds", "block_sketches", "hamming", "inner_blocks", "part_audit"]
