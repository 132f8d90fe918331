"""One contract for every codec.

``check_codec(make_codec, ...)`` is written once and parametrized over every codec and
option (cf. torchft's ``run_multi_recovery_test`` and hivemind's tests/test_compression.py).
It checks round-trip error against the codec's own declared ``error_bound`` on Gaussian and
Student-t (df=3) data; zeros, one element, odd sizes, empty and 0-d tensors; fp32/fp16/bf16
/fp64 inputs; determinism; non-finite input; truncated, extended and bit-flipped buffers;
and a header that declares 2**40 elements.
"""

from __future__ import annotations

import struct
import zlib
from collections.abc import Callable

import numpy as np
import pytest
import torch

from bagel.compression import Codec, CodecError, NonFiniteError, decode, get_codec

CODECS = [
    "fp32",
    "fp16",
    "bf16",
    "int8",
    "int8:block=64",
    "int8:block=1000",
    "int8:block=1",
    "int8:stochastic",
    "int8:block=32:stochastic",
    "int4",
    "int4:block=32",
    "int4:block=2",
    "int4:block=512",
    "int4:stochastic",
    "int4:block=64:stochastic",
    "topk:0.01",
    "topk:0.1",
    "topk:0.5",
    "topk:1.0",
]

SIZES = [(1,), (2,), (3,), (7,), (255,), (257,), (1001,), (4099,), (70_001,), (3, 5, 7), (2, 1, 65_537)]


def gaussian(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    return torch.randn(shape, generator=torch.Generator().manual_seed(seed))


def student_t(shape: tuple[int, ...], seed: int) -> torch.Tensor:
    rng = np.random.default_rng(seed)
    return torch.from_numpy(rng.standard_t(3, size=shape).astype(np.float32))


def fix_crc(buf: bytes | bytearray) -> bytes:
    """Recompute the trailing CRC32 so a hand-edited buffer reaches the later checks."""
    body = bytes(buf[:-4])
    return body + struct.pack("<I", zlib.crc32(body))


def _encode(codec: Codec, t: torch.Tensor, seed: int = 0) -> bytes:
    return codec.encode(t, generator=torch.Generator().manual_seed(seed))


def _roundtrip_within_bound(codec: Codec, t: torch.Tensor, seed: int = 0) -> torch.Tensor:
    buf = _encode(codec, t, seed)
    assert len(buf) == codec.encoded_nbytes(t.numel(), t.dim())
    out = decode(buf)
    assert out.dtype == torch.float32 and out.shape == t.shape
    if t.numel():
        err = float((out - t.float()).abs().max())
        bound = codec.error_bound(t)
        assert err <= bound, f"{codec.name}: max error {err} > declared bound {bound} for shape {tuple(t.shape)}"
    return out


def check_codec(make_codec: Callable[[], Codec], *, seed: int = 0) -> None:
    """The contract every codec must satisfy."""
    codec = make_codec()

    # 1. Round trip within the declared bound, Gaussian and heavy-tailed, many sizes/shapes.
    for i, shape in enumerate(SIZES):
        for data in (gaussian, student_t):
            _roundtrip_within_bound(codec, data(shape, seed + i), seed=i)
    _roundtrip_within_bound(codec, gaussian((300,), seed) * 1e-30)  # tiny magnitudes
    _roundtrip_within_bound(codec, gaussian((300,), seed) * 1e4)  # large (still fp16-representable)

    # 2. Zeros, one element, empty and 0-d tensors.
    for shape in [(1,), (1000,), (3, 333)]:
        assert torch.equal(decode(_encode(codec, torch.zeros(shape))), torch.zeros(shape))
    one = torch.tensor([0.625])
    _roundtrip_within_bound(codec, one)
    for shape in [(0,), (0, 7), (4, 0, 2)]:
        out = decode(_encode(codec, torch.zeros(shape)))
        assert out.shape == shape and out.dtype == torch.float32
    scalar = torch.tensor(-1.5)
    assert decode(_encode(codec, scalar)).shape == ()
    _roundtrip_within_bound(codec, scalar)

    # 3. Input dtypes: the bound holds against the input's own values; the header records the dtype.
    base = student_t((1001,), seed + 7)
    for dtype in (torch.float32, torch.float16, torch.bfloat16, torch.float64):
        _roundtrip_within_bound(codec, base.to(dtype))
    # Non-contiguous input is encoded as its logical values.
    mat = gaussian((64, 33), seed + 8)
    assert _encode(codec, mat.t()) == _encode(codec, mat.t().contiguous())

    # 4. Determinism: same input (and same generator seed) -> same bytes; decode is a function.
    x = student_t((5000,), seed + 9)
    a, b = _encode(codec, x, seed=3), _encode(codec, x, seed=3)
    assert a == b
    assert torch.equal(decode(a), decode(a))
    # Decoding into a caller's buffer writes every element (pre-filled with junk here).
    reuse = torch.full((5000,), 7.0)
    assert decode(a, out=reuse).data_ptr() == reuse.data_ptr()
    assert torch.equal(reuse, decode(a))
    with pytest.raises(ValueError, match="out must be"):
        decode(a, out=torch.zeros(4999))
    with pytest.raises(ValueError, match="out must be"):
        decode(a, out=torch.zeros(5000, dtype=torch.float64))
    if codec.stochastic:
        with pytest.raises(ValueError, match="Generator"):
            codec.encode(x)
        assert _encode(codec, x, seed=4) != a  # the generator really drives the rounding

    # 5. Non-finite input is rejected, wherever it sits.
    for bad in (float("nan"), float("inf"), float("-inf")):
        for pos in (0, 500, 4999):
            y = x.clone()
            y[pos] = bad
            with pytest.raises(NonFiniteError):
                _encode(codec, y)
            with pytest.raises(NonFiniteError):
                _encode(codec, y.to(torch.float16))
    with pytest.raises(NonFiniteError):
        _encode(codec, torch.tensor(float("nan")))

    # 6. Truncated, extended and bit-flipped buffers raise CodecError, every one of them.
    small = _encode(codec, student_t((37,), seed + 10))
    for n in range(len(small)):
        with pytest.raises(CodecError):
            decode(small[:n])
    for extra in (b"\0", b"\x01", b"\0" * 8, small):
        with pytest.raises(CodecError):
            decode(small + extra)
    for byte in range(len(small)):
        for bit in range(8):
            flipped = bytearray(small)
            flipped[byte] ^= 1 << bit
            with pytest.raises(CodecError):
                decode(bytes(flipped))

    # 7. A header declaring 2**40 elements is refused before anything is allocated.
    check_huge_header_rejected(_encode(codec, torch.ones(8)))


def check_huge_header_rejected(buf: bytes) -> None:
    # Shape (2**40,) and numel 2**40 in an otherwise valid 1-D header, CRC fixed up.
    edited = bytearray(buf)
    struct.pack_into("<Q", edited, 16, 2**40)  # numel
    struct.pack_into("<Q", edited, 40, 2**40)  # shape[0]
    edited = fix_crc(edited)
    calls: list[str] = []
    real = {name: getattr(torch, name) for name in ("empty", "zeros", "full", "frombuffer", "ones")}

    def guard(name: str):
        def f(*args, **kwargs):
            calls.append(name)
            return real[name](*args, **kwargs)

        return f

    mp = pytest.MonkeyPatch()
    try:
        for name in real:
            mp.setattr(torch, name, guard(name))
        with pytest.raises(CodecError, match="max_elements"):
            decode(edited)
        # Even with the limit lifted, the counts and lengths stop it before any allocation.
        with pytest.raises(CodecError):
            decode(edited, max_elements=2**62)
    finally:
        mp.undo()
    assert calls == [], f"decode allocated before rejecting the header: {calls}"


@pytest.mark.timeout(300)
@pytest.mark.parametrize("name", CODECS)
def test_codec_contract(name: str) -> None:
    check_codec(lambda: get_codec(name))


@pytest.mark.parametrize("name", CODECS)
def test_name_round_trips(name: str) -> None:
    codec = get_codec(name)
    assert get_codec(codec.name) == codec
    assert str(codec) == codec.name


@pytest.mark.parametrize(
    "name", ["int8", "int4", "int8:stochastic", "int4:block=32:stochastic", "bf16", "fp16", "topk:0.05"]
)
def test_nominal_rel_error_matches_gaussian_measurement(name: str) -> None:
    """``nominal_rel_error`` (used by choose_codec) is within a factor 1.5 of measurement."""
    codec = get_codec(name)
    x = gaussian((1 << 18,), 11)
    out = decode(_encode(codec, x))
    measured = float((out - x).norm() / x.norm())
    nominal = codec.nominal_rel_error()
    assert nominal / 1.5 <= measured <= nominal * 1.5, (measured, nominal)


@pytest.mark.parametrize("name", ["int8:stochastic", "int4:stochastic", "int4:block=16:stochastic"])
def test_stochastic_rounding_is_unbiased(name: str) -> None:
    codec = get_codec(name)
    # In each block one large value fixes the scale; the others sit between two levels.
    x = torch.full((4096,), 0.3) * torch.linspace(-1, 1, 4096)
    x[:: codec.block] = 7.0
    g = torch.Generator().manual_seed(5)
    trials = 400
    mean = sum(decode(codec.encode(x, generator=g)) for _ in range(trials)) / trials
    step = 7.0 / codec.qmax
    # Per element the mean of 400 draws has std <= step / (2 * sqrt(400)) = step / 40; 6 sigma.
    assert float((mean - x).abs().max()) <= 6 * step / 40
    nearest = decode(get_codec(name.replace(":stochastic", "")).encode(x))
    assert float((nearest - x).abs().mean()) > 3 * float((mean - x).abs().mean())


def test_fp16_rejects_values_it_cannot_represent() -> None:
    with pytest.raises(NonFiniteError, match="range"):
        get_codec("fp16").encode(torch.tensor([1.0, 70000.0]))
    # int8/int4/bf16 take the same value without complaint.
    for name in ("int8", "int4", "bf16", "fp32", "topk:0.5"):
        out = decode(get_codec(name).encode(torch.tensor([1.0, 70000.0])))
        assert abs(float(out[1]) - 70000.0) <= get_codec(name).error_bound(torch.tensor([1.0, 70000.0]))


def test_int4_is_at_most_055_bytes_per_value_with_scales() -> None:
    n = 1 << 24
    assert get_codec("int4").encoded_nbytes(n) / n <= 0.55
    assert get_codec("int4").encoded_nbytes(n) == 40 + 8 + 4 + 4 * (n // 128) + n // 2


def test_bad_names_are_refused_precisely() -> None:
    for name, match in [
        ("int3", "unknown codec"),
        ("int8:block=0", "block"),
        ("int8:block=x", "integer"),
        ("int8:fast", "unknown option"),
        ("int4:block=7", "even"),
        ("topk", "exactly one"),
        ("topk:0", r"\(0, 1\]"),
        ("topk:1.5", r"\(0, 1\]"),
        ("topk:nan", r"\(0, 1\]"),
        ("fp16:block=3", "no options"),
        ("", "non-empty"),
    ]:
        with pytest.raises(ValueError, match=match):
            get_codec(name)


def test_encode_refuses_non_float_tensors() -> None:
    with pytest.raises(TypeError, match="float"):
        get_codec("int8").encode(torch.arange(10))
    with pytest.raises(ValueError, match="dimensions"):
        get_codec("int8").encode(torch.zeros([1] * 9))
    with pytest.raises(TypeError, match="bytes-like"):
        decode("not bytes")  # type: ignore[arg-type]
