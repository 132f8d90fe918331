"""The wire format against a hostile peer, and bit-exact determinism across processes.

Every crafted buffer here carries a *valid* CRC32 (``fix_crc``), so each test reaches the
specific check it targets: a malicious encoder can always write a correct checksum.
Golden digests pin the exact bytes of every codec on a platform-independent input (cf.
torchft's diloco_regression_test fixtures): a change that moves one bit fails here.
Regenerate with ``BAGEL_WRITE_GOLDEN=1 pytest tests/test_codec_wire.py -k golden -s``.
"""

from __future__ import annotations

import hashlib
import os
import struct
import subprocess
import sys

import pytest
import torch

from bagel.compression import CodecError, CodecId, decode, get_codec, peek_header
from bagel.compression.topk import CHUNK

from test_compression_contract import fix_crc  # tests/ is on sys.path (pytest rootdir import)


def hashed_input(n: int) -> torch.Tensor:
    """Values from integer arithmetic only (Knuth's multiplicative hash), exact in float32,
    so the input is bit-identical on every platform and torch version."""
    i = torch.arange(n, dtype=torch.int64)
    h = (i * 2654435761) % (1 << 32)
    centred = (h - (1 << 31)).to(torch.float32) / float(1 << 31)  # exact: power-of-two divide
    return centred * centred * centred * 4.0  # heavy-ish tails, still exact in float32


def edit(buf: bytes, offset: int, fmt: str, value: int | float) -> bytes:
    b = bytearray(buf)
    struct.pack_into(fmt, b, offset, value)
    return fix_crc(b)


def body_offset(buf: bytes) -> int:
    return peek_header(buf).nbytes


def test_peek_header_reports_the_fields() -> None:
    buf = get_codec("int4:block=64").encode(torch.zeros(3, 100, dtype=torch.bfloat16))
    h = peek_header(buf)
    assert h.codec == CodecId.INT4 and h.dtype == torch.bfloat16 and h.shape == (3, 100)
    assert (h.block, h.numel, h.count, h.body_nbytes) == (64, 300, 5, 4 * 5 + 150)
    assert len(buf) == h.nbytes + h.body_nbytes + 4


def test_bytearray_and_memoryview_decode_like_bytes() -> None:
    x = hashed_input(1000)
    buf = get_codec("int8").encode(x)
    for form in (bytearray(buf), memoryview(buf), memoryview(b"xx" + buf)[2:]):
        assert torch.equal(decode(form), decode(buf))


@pytest.mark.parametrize(
    "offset, fmt, value, match",
    [
        (0, "<4s", b"XGLC", "magic"),
        (4, "<B", 2, "version"),
        (5, "<B", 17, "codec id"),
        (6, "<B", 0x82, "flag"),
        (7, "<B", 9, "dtype"),
        (8, "<B", 9, "ndim"),
        (9, "<B", 1, "reserved"),
        (16, "<Q", 999, "numel"),
        (32, "<Q", 12345, "declares"),
    ],
)
def test_header_fields_are_checked(offset: int, fmt: str, value, match: str) -> None:
    buf = get_codec("int8").encode(hashed_input(1000))
    with pytest.raises(CodecError, match=match):
        decode(edit(buf, offset, fmt, value))


def test_max_elements_limits_the_shape_and_each_dimension() -> None:
    buf = get_codec("fp16").encode(hashed_input(1000).view(10, 100))
    with pytest.raises(CodecError, match="max_elements"):
        decode(buf, max_elements=999)
    assert decode(buf, max_elements=1000).shape == (10, 100)
    # (0, 2**63): zero elements, but a dimension no tensor should carry.
    zero = get_codec("fp16").encode(torch.zeros(0, 5))
    with pytest.raises(CodecError, match="dimension"):
        decode(edit(zero, 48, "<Q", 2**63))


def test_huge_counts_with_tiny_bodies_are_refused() -> None:
    buf = get_codec("int8").encode(hashed_input(1000))
    for offset, value in [(24, 2**40), (12, 0), (12, 2**21), (24, 3)]:  # count, block, block, count
        with pytest.raises(CodecError):
            decode(edit(buf, offset, "<Q" if offset != 12 else "<I", value))


@pytest.mark.parametrize("name", ["int8", "int4"])
@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -1.0, 1e37])
def test_blockwise_scales_must_be_finite_non_negative_and_bounded(name: str, scale: float) -> None:
    buf = get_codec(name).encode(hashed_input(1000))
    with pytest.raises(CodecError, match="scale"):
        decode(edit(buf, body_offset(buf) + 4, "<f", scale))


def test_int4_odd_block_and_padding_nibble() -> None:
    buf = get_codec("int4:block=64").encode(hashed_input(1001))
    with pytest.raises(CodecError):
        decode(edit(buf, 12, "<I", 63))
    # The last byte's high nibble pads an odd-length tensor and must encode zero (8).
    last = len(buf) - 5
    with pytest.raises(CodecError, match="padding"):
        decode(edit(buf, last, "<B", (buf[last] & 0x0F) | 0x30))


def test_int_codes_the_encoder_never_writes_still_decode_finite() -> None:
    buf = get_codec("int8:block=4").encode(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    out = decode(edit(buf, body_offset(buf) + 4, "<b", -128))
    scale = torch.tensor(4.0, dtype=torch.float32) / 127  # the stored float32 scale
    assert float(out[0]) == float(scale * -128)


@pytest.mark.parametrize("name, bad", [("fp32", float("nan")), ("fp16", float("inf")), ("bf16", float("-inf"))])
def test_float_bodies_with_non_finite_values_are_refused(name: str, bad: float) -> None:
    buf = get_codec(name).encode(hashed_input(100))
    dtype = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}[name]
    raw = torch.tensor([bad], dtype=dtype).view(torch.uint8).numpy().tobytes()
    b = bytearray(buf)
    at = body_offset(buf) + 7 * len(raw)
    b[at : at + len(raw)] = raw
    with pytest.raises(CodecError, match="non-finite"):
        decode(fix_crc(b))


class TopkLayout:
    """Offsets of a top-k body's sections, for crafting hostile variants."""

    def __init__(self, buf: bytes) -> None:
        h = peek_header(buf)
        self.h, self.base = h, h.nbytes
        self.k = h.count
        self.nchunks = -(-h.numel // CHUNK)
        self.values = self.base
        self.counts = self.base + 4 * self.k
        self.offsets = self.counts + 4 * self.nchunks
        self.padding = self.offsets + 2 * self.k


def _topk_buf(n: int = 3 * CHUNK + 100, fraction: float = 0.001) -> tuple[bytes, TopkLayout]:
    x = hashed_input(n)
    x[-1] = 1e6  # so the last, 100-element chunk holds a kept index
    buf = get_codec(f"topk:{fraction}").encode(x)
    return buf, TopkLayout(buf)


def test_topk_round_trip_keeps_exact_values_at_sorted_indices() -> None:
    x = hashed_input(3 * CHUNK + 100)
    codec = get_codec("topk:0.001")
    out = decode(codec.encode(x))
    kept = out.nonzero().view(-1)
    assert kept.numel() == codec.kept(x.numel())
    assert torch.equal(out[kept], x[kept])
    assert float(x.abs()[out == 0].max()) <= float(x[kept].abs().min())


def test_topk_ties_go_to_the_lowest_indices() -> None:
    x = torch.tensor([1.0, -1.0, 1.0, 1.0, 2.0, 1.0, -1.0])
    out = decode(get_codec("topk:0.4").encode(x))  # k = ceil(2.8) = 3
    assert out.tolist() == [1.0, -1.0, 0.0, 0.0, 2.0, 0.0, 0.0]
    # The same on a large tensor whose threshold comes from the strided sample.
    big = torch.zeros(1 << 20)
    big[::3] = 1.0
    big[7] = 5.0
    dec = decode(get_codec("topk:0.01").encode(big))
    k = get_codec("topk:0.01").kept(big.numel())
    kept = dec.nonzero().view(-1)
    assert kept.numel() == k and float(dec[7]) == 5.0
    assert torch.equal(kept[kept != 7], torch.arange(0, 3 * (k - 1), 3)[: k - 1])


def test_topk_counts_are_checked() -> None:
    buf, L = _topk_buf()
    with pytest.raises(CodecError, match="more kept values"):
        decode(edit(buf, L.counts, "<I", CHUNK + 1))
    with pytest.raises(CodecError, match="sum"):
        decode(edit(buf, L.counts, "<I", struct.unpack_from("<I", buf, L.counts)[0] + 1))
    # The last chunk has only 100 elements.
    with pytest.raises(CodecError, match="more kept values"):
        decode(edit(buf, L.counts + 4 * (L.nchunks - 1), "<I", 101))
    with pytest.raises(CodecError, match="kept values declared"):
        decode(edit(buf, 24, "<Q", L.h.numel + 1))


def test_topk_indices_must_be_sorted_unique_and_in_range() -> None:
    buf, L = _topk_buf()
    first, second = struct.unpack_from("<HH", buf, L.offsets)
    with pytest.raises(CodecError, match="strictly increasing"):  # duplicate
        decode(edit(buf, L.offsets + 2, "<H", first))
    b = bytearray(buf)
    struct.pack_into("<HH", b, L.offsets, second, first)  # swapped
    with pytest.raises(CodecError, match="strictly increasing"):
        decode(fix_crc(b))
    # Move the last index past numel (it sits in the 100-element last chunk).
    with pytest.raises(CodecError, match="out of range"):
        decode(edit(buf, L.offsets + 2 * (L.k - 1), "<H", 65535))


def test_topk_values_and_padding_are_checked() -> None:
    buf, L = _topk_buf()
    with pytest.raises(CodecError, match="non-finite"):
        decode(edit(buf, L.values, "<f", float("nan")))
    odd_buf = get_codec("topk:0.5").encode(hashed_input(5))  # k = 3: 2 padding bytes
    L2 = TopkLayout(odd_buf)
    assert L2.padding < len(odd_buf) - 4
    with pytest.raises(CodecError, match="padding"):
        decode(edit(odd_buf, L2.padding, "<B", 1))


GOLDEN = {
    # name: (sha256 of encode(hashed_input(70001)) with generator seed 7, sha256 of its decode)
    "fp32": (
        "f87973d538d07736dbc00d7cf71539d08ec1e062dde411f5b2542debdfe3254e",
        "9c008c209c625e845763c81180463c6614d2cff1e178e0e181228e4ede6c8248",
    ),
    "fp16": (
        "d8af4145ac587d654348ec712528f4f8fd44350f191b3444e56303140a792258",
        "ba09e8eabd67db291b03f428aa00569ce42167ccf43764edd76fa630a84a032a",
    ),
    "bf16": (
        "1aa0afd2e63dd004f1292b48af8a9c661deea600a1b2545f9a03958bf03b9b30",
        "0a9b092f595a062e58ede0de4f07941a85cbfdd7cecf0aa01fb76b2b018b9fa4",
    ),
    "int8": (
        "86901468f1eb5f1b0de8da128e1614c95076946be7c93f7971fa029bc2d2a1aa",
        "faa9cb29efd3c9eef90314c8521ea7a8ff5626ab6930955249e457fcdb2d2eda",
    ),
    "int8:block=64": (
        "433e00fffb9182bf91ce5caa5d08d8c4baaafc1d460e372ddcdd31a52945e389",
        "a85222d9e07a72e73719f9d7be83f9df32a590ca175f83745c89ddc5defa8db3",
    ),
    "int8:stochastic": (
        "45487d56e9d2ccacf54c4c719cf07675ba8a7f81b0b4d71af14e92b29769ac34",
        "be5c50e5cdcf61e3cea2ba4f18499cc0c1adec14412acdd534a07008d62a2908",
    ),
    "int4": (
        "ac705da693522a3348a452bc06abf8634ee46c729b0dbba631e07f5927efff19",
        "b10074bff1cf818ed7a6188436debe4d40aacf22c5dcd9a691185dea36f8a1ed",
    ),
    "int4:stochastic": (
        "73cc5a9e1e354c6721ac8923854fd1a0fee5a6c3905e298dfb548e1fff425fe9",
        "55683605a206ef35e35e2eca5f02336f515b172df6625e205f1c31dc422d6d45",
    ),
    "topk:0.01": (
        "3271ec392a0947865b47baf38d2a109f5bb846c588083c02c0268acb880e2dfc",
        "51e16ae640a616d1c302ee9d5d01aacd3beb214e59597a045120213a38465716",
    ),
}

GOLDEN_NAMES = [
    "fp32",
    "fp16",
    "bf16",
    "int8",
    "int8:block=64",
    "int8:stochastic",
    "int4",
    "int4:stochastic",
    "topk:0.01",
]


def _digests(name: str) -> tuple[str, str]:
    buf = get_codec(name).encode(hashed_input(70001), generator=torch.Generator().manual_seed(7))
    out = decode(buf)
    return hashlib.sha256(buf).hexdigest(), hashlib.sha256(out.numpy().tobytes()).hexdigest()


@pytest.mark.parametrize("name", GOLDEN_NAMES)
def test_golden_bytes(name: str) -> None:
    got = _digests(name)
    if os.environ.get("BAGEL_WRITE_GOLDEN"):
        print(f'    "{name}": ("{got[0]}", "{got[1]}"),')
        return
    assert got == GOLDEN[name], f"{name}: encoded bytes or decoded values changed"


_CHILD = """
import sys, torch
torch.set_num_threads(int(sys.argv[1]))
sys.path.insert(0, sys.argv[2])
from test_codec_wire import _digests, GOLDEN_NAMES
for name in GOLDEN_NAMES:
    print(name, *_digests(name))
"""


@pytest.mark.timeout(180)
def test_same_bytes_in_another_process_with_other_thread_counts() -> None:
    here = {name: _digests(name) for name in GOLDEN_NAMES}
    root = os.path.dirname(os.path.abspath(__file__))
    for threads in (1, 2):
        out = subprocess.run(
            [sys.executable, "-c", _CHILD, str(threads), root], capture_output=True, text=True, timeout=150, check=True
        ).stdout
        there = {line.split()[0]: tuple(line.split()[1:]) for line in out.strip().splitlines()}
        assert there == here


def test_crc32_combine_and_the_two_thread_crc_equal_zlib() -> None:
    import os
    import random
    import zlib

    from bagel.compression.wire import crc32, crc32_combine

    rng = random.Random(0)
    for _ in range(200):
        a, b = os.urandom(rng.randint(0, 300)), os.urandom(rng.randint(0, 300))
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)
    for n in (100, (4 << 20) - 1, 4 << 20, (4 << 20) + 7):  # below and above the two-thread size
        data = os.urandom(n)
        assert crc32(memoryview(data)) == zlib.crc32(data)
