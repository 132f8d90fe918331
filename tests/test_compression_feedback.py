"""Error feedback: with EF the decoded running sum tracks the true
sum to within one step's declared error bound; without EF, a biased codec drifts away.

Why the EF bound holds: with ``c_t = g_t + e_t``, ``d_t = decode(encode(c_t))`` and
``e_{t+1} = c_t - d_t``, the sum telescopes: ``sum d_t = sum g_t - e_T``. So the gap is the
last residual, which the codec's contract bounds by ``error_bound(c_{T-1})``.
"""

from __future__ import annotations

import pytest
import torch

from bagel.compression import ErrorFeedback, decode, get_codec

STEPS = 200
N = 4096


def fixed_sequence(seed: int = 0) -> list[torch.Tensor]:
    """A fixed random sequence of updates with a persistent, heavy-tailed mean: in most
    blocks one large entry sets the scale and the small ones sit below half a level, so
    nearest rounding drops them in the same direction every step."""
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(N, generator=g) * 0.02
    mean[::97] = 3.0  # one large entry in every 128-block
    return [mean + 0.01 * torch.randn(N, generator=g) for _ in range(STEPS)]


def run(codec_name: str, use_ef: bool, seed: int = 0) -> tuple[float, float]:
    """(max |true sum - decoded sum|, max over steps of the codec's declared bound)."""
    codec = get_codec(codec_name)
    gen = torch.Generator().manual_seed(seed)
    ef = ErrorFeedback()
    true_sum = torch.zeros(N, dtype=torch.float64)
    sent_sum = torch.zeros(N, dtype=torch.float64)
    bound = 0.0
    for g in fixed_sequence(seed):
        c = ef.compensate("w", g) if use_ef else g
        d = decode(codec.encode(c, generator=gen))
        if use_ef:
            ef.update("w", c, d)
        bound = max(bound, codec.error_bound(c))
        true_sum += g.double()
        sent_sum += d.double()
    return float((true_sum - sent_sum).abs().max()), bound


@pytest.mark.parametrize("codec_name", ["int4", "int4:stochastic", "int8:block=1024", "topk:0.05"])
def test_error_feedback_keeps_the_sum_within_one_step_bound(codec_name: str) -> None:
    gap_ef, bound = run(codec_name, use_ef=True)
    gap_plain, _ = run(codec_name, use_ef=False)
    # float32 residual arithmetic over 200 steps: a few ulps of the running values.
    slack = 1e-4 * bound + 1e-5
    assert gap_ef <= bound + slack, f"with EF: gap {gap_ef} > one-step bound {bound}"
    if codec_name != "int4:stochastic":
        # Biased codecs: without EF the dropped mass piles up, far beyond one step's bound.
        assert gap_plain > 10 * bound, f"without EF the gap {gap_plain} stayed within 10x {bound}"
    else:
        # Unbiased rounding drifts like a random walk (sqrt(T) steps), still beyond one step.
        assert gap_plain > 2 * bound, f"without EF the gap {gap_plain} stayed within 2x {bound}"


def test_int4_ef_gap_is_the_last_residual() -> None:
    codec = get_codec("int4")
    ef = ErrorFeedback()
    total = torch.zeros(N, dtype=torch.float64)
    sent = torch.zeros(N, dtype=torch.float64)
    for g in fixed_sequence(3)[:20]:
        c = ef.compensate(0, g)
        d = decode(codec.encode(c))
        ef.update(0, c, d)
        total += g.double()
        sent += d.double()
    residual = ef.residual(0)
    assert residual is not None
    assert torch.allclose(total - sent, residual.double(), atol=1e-5)


def test_compensate_update_reset_and_shape_checks() -> None:
    ef = ErrorFeedback()
    t = torch.ones(3, dtype=torch.float16)
    first = ef.compensate("a", t)
    assert first.dtype == torch.float32 and torch.equal(first, torch.ones(3))
    first[0] = 5.0
    assert float(t[0]) == 1.0  # compensate never aliases its input
    ef.update("a", torch.tensor([1.0, 2.0, 3.0]), torch.tensor([1.0, 1.5, 2.0]))
    assert torch.equal(ef.compensate("a", torch.zeros(3)), torch.tensor([0.0, 0.5, 1.0]))
    assert "a" in ef and len(ef) == 1
    with pytest.raises(ValueError, match="shape"):
        ef.compensate("a", torch.zeros(4))
    with pytest.raises(ValueError, match="shape"):
        ef.update("a", torch.zeros(3), torch.zeros(2))
    ef.reset("a")
    assert "a" not in ef and ef.residual("a") is None
    ef.update("b", torch.zeros(2), torch.zeros(2))
    ef.reset()
    assert len(ef) == 0
