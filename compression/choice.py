"""Bandwidth-aware codec choice: which codec gives the shortest expected round?

Pure arithmetic on the tensor size, the link, and the round's compute time; no I/O, no
clock. The rule (all quantities per peer, per outer round):

    traffic   = 2 * (m - 1) / m                      # butterfly all-reduce over m peers:
                                                      # send (m-1)/m of the tensor, receive
                                                      # (m-1)/m of the averaged result
    comm_s    = traffic * encoded_nbytes(numel) / link_bytes_per_s
    codec_s   = traffic * 4 * numel * (1 / encode_Bps + 1 / decode_Bps)
    round_s   = compute_s + codec_s + comm_s

Candidates whose ``nominal_rel_error()`` (expected relative L2 error on Gaussian data, a
closed form checked against measurement in the tests) exceeds ``max_rel_error`` are
excluded: quality is a constraint, not a price, because no exchange rate between seconds
and error holds for every run. Among the rest the fastest wins, except that a candidate
within ``rel_tolerance`` of the fastest round time and with a lower nominal error is
preferred (when compute dominates, compressing harder buys nothing worth its error).
Remaining ties go to the earlier candidate in the list.

``DEFAULT_THROUGHPUT`` holds encode/decode speeds in bytes of float32 input per second,
rounded down from single-thread CPU-time measurements of 16M-value tensors on the
project's CPU machine (decode including a fresh output allocation); pass measured values
(e.g. from ``bench/compression.py``) for other hardware. The default candidates are the
dense codecs; top-k needs error feedback to be useful, so a caller opts into it.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from .base import Codec, get_codec

DEFAULT_CANDIDATES: tuple[str, ...] = ("fp32", "fp16", "bf16", "int8", "int4")

# kind -> (encode, decode) bytes of fp32 input per second; ":stochastic" variants separate.
DEFAULT_THROUGHPUT: dict[str, tuple[float, float]] = {
    "fp32": (0.6e9, 1.0e9),
    "fp16": (1.1e9, 1.3e9),
    "bf16": (1.1e9, 1.3e9),
    "int8": (2.4e9, 1.4e9),
    "int4": (2.4e9, 1.2e9),
    "int8:stochastic": (1.2e9, 1.4e9),
    "int4:stochastic": (0.9e9, 1.0e9),
    "topk": (0.5e9, 1.0e9),
}


@dataclass(frozen=True)
class Estimate:
    codec: Codec
    wire_bytes: float
    comm_s: float
    codec_s: float
    round_s: float
    rel_error: float
    eligible: bool


@dataclass(frozen=True)
class CodecChoice:
    codec: Codec
    expected_round_s: float
    estimates: tuple[Estimate, ...]  # every candidate, in the order given


def throughput_of(codec: Codec, table: Mapping[str, tuple[float, float]]) -> tuple[float, float]:
    """(encode, decode) bytes/s for ``codec``: its full name, then kind plus
    ``:stochastic``, then its kind (the part of the name before the first colon)."""
    kind = codec.name.split(":", 1)[0]
    for key in (codec.name, f"{kind}:stochastic" if codec.stochastic else None, kind):
        if key is not None and key in table:
            return table[key]
    raise KeyError(f"no throughput for codec {codec.name!r}; pass throughput={{{kind!r}: (encode, decode)}}")


def estimate(
    codec: Codec,
    numel: int,
    link_bytes_per_s: float,
    compute_s: float,
    *,
    group_size: int = 2,
    throughput: Mapping[str, tuple[float, float]] | None = None,
) -> Estimate:
    """Expected round time of one codec under the rule in the module docstring."""
    if numel < 0 or not link_bytes_per_s > 0 or not compute_s >= 0 or group_size < 1:
        raise ValueError(
            f"need numel >= 0, link_bytes_per_s > 0, compute_s >= 0, group_size >= 1;"
            f" got {numel}, {link_bytes_per_s}, {compute_s}, {group_size}"
        )
    enc, dec = throughput_of(codec, throughput or DEFAULT_THROUGHPUT)
    traffic = 2.0 * (group_size - 1) / group_size
    wire = traffic * codec.encoded_nbytes(numel)
    comm = wire / link_bytes_per_s
    work = traffic * 4.0 * numel * (1.0 / enc + 1.0 / dec)
    return Estimate(codec, wire, comm, work, compute_s + work + comm, codec.nominal_rel_error(), True)


def choose_codec(
    numel: int,
    link_bytes_per_s: float,
    compute_s: float,
    candidates: Sequence[str | Codec] = DEFAULT_CANDIDATES,
    *,
    group_size: int = 2,
    max_rel_error: float | None = None,
    throughput: Mapping[str, tuple[float, float]] | None = None,
    rel_tolerance: float = 0.02,
) -> CodecChoice:
    """Pick the candidate with the best expected round time (rule: module docstring).

    Raises ``ValueError`` if no candidate meets ``max_rel_error``."""
    if not candidates:
        raise ValueError("no candidate codecs")
    estimates = []
    for c in candidates:
        codec = get_codec(c) if isinstance(c, str) else c
        e = estimate(codec, numel, link_bytes_per_s, compute_s, group_size=group_size, throughput=throughput)
        ok = max_rel_error is None or e.rel_error <= max_rel_error
        estimates.append(Estimate(e.codec, e.wire_bytes, e.comm_s, e.codec_s, e.round_s, e.rel_error, ok))
    eligible = [e for e in estimates if e.eligible]
    if not eligible:
        raise ValueError(f"no candidate has nominal relative error <= {max_rel_error}")
    fastest = min(e.round_s for e in eligible)
    near = [e for e in eligible if e.round_s <= fastest * (1.0 + rel_tolerance) or math.isclose(e.round_s, fastest)]
    best = min(near, key=lambda e: e.rel_error)  # min() keeps the first of equal errors
    return CodecChoice(best.codec, best.round_s, tuple(estimates))
