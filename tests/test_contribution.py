"""A contribution holds one vector the size of the delta (the residual), and gives the same
bytes and residual as compensating, flattening and decoding tensor by tensor."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bagel.compression import ErrorFeedback, get_codec
from bagel.worker.diloco import CellState
from bagel.worker.localstate import LocalCheckpoint, LocalStore
from bagel.worker.parts import Layout, decode_part, part_bounds, part_generator, prepare_contribution
from bagel.worker.roundwork import fresh_feedback

pytestmark = pytest.mark.timeout(30)


def _delta(seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {"b.weight": torch.randn(7, 5, generator=g), "a.bias": torch.randn(13, generator=g), "c": torch.randn(3)}


def _reference(delta: dict[str, torch.Tensor], ef: ErrorFeedback | None, codec_name: str, parts: int):
    """The per-tensor form: compensate each tensor, flatten, encode and decode each part,
    residual = compensated - decoded."""
    codec = get_codec(codec_name)
    layout = Layout.of(delta)
    compensated = {n: ef.compensate(n, t) if ef is not None else t.clone() for n, t in delta.items()}
    flat = layout.flatten(compensated)
    payloads, decoded = [], []
    for j, (s, e) in enumerate(part_bounds(layout.total, parts)):
        buf = codec.encode(flat[s:e], generator=part_generator("run", j))
        payloads.append(buf)
        decoded.append(decode_part(codec, buf, e - s))
    dec = layout.unflatten(torch.cat(decoded))
    return payloads, {n: torch.sub(compensated[n], dec[n]) for n in layout.names}


@pytest.mark.parametrize("codec_name", ["int8", "int4:stochastic", "topk:0.25", "fp16"])
def test_bytes_and_residual_are_the_per_tensor_forms(codec_name: str) -> None:
    codec = get_codec(codec_name)
    ef, ref_ef = ErrorFeedback(), ErrorFeedback()
    for rnd in range(3):  # the second and third rounds compensate with the stored residual
        delta = _delta(rnd)
        want_payloads, want_residual = _reference(delta, ref_ef, codec_name, 3)
        c = prepare_contribution(delta, codec, 3, ("run",), weight=1.0, error_feedback=ef)
        assert c.payloads == want_payloads
        for j in range(3):
            assert torch.equal(c.decoded(j), decode_part(codec, c.payloads[j], c.bounds[j][1] - c.bounds[j][0]))
        res = c.residual()
        assert set(res) == set(want_residual)
        for n, r in want_residual.items():
            assert torch.equal(res[n], r), n
            assert res[n].data_ptr() != 0 and res[n].untyped_storage().data_ptr() == c.residual_flat.data_ptr()
        c.commit_error_feedback(ef)
        for n, r in want_residual.items():
            ref_ef.update(n, r + 0.0, torch.zeros_like(r))  # the same values, stored by the old path
            assert torch.equal(ef.residual(n), ref_ef.residual(n))  # type: ignore[arg-type]
    assert all(not torch.equal(r, torch.zeros_like(r)) for r in c.residual().values())


def test_an_abstaining_contribution_sends_nothing_and_leaves_a_zero_residual() -> None:
    delta = _delta(0)
    delta["c"][1] = float("nan")
    ef = ErrorFeedback()
    c = prepare_contribution(delta, get_codec("int8"), 2, ("run",), weight=1.0, error_feedback=ef)
    assert c.abstained == "non-finite delta" and c.payloads == [b"", b""]
    assert torch.equal(c.decoded(0), torch.zeros(c.bounds[0][1]))
    c.commit_error_feedback(ef)
    assert all(torch.equal(ef.residual(n), torch.zeros(t.shape)) for n, t in delta.items())  # type: ignore[arg-type]


def test_error_feedback_store_and_compensate_into() -> None:
    ef = ErrorFeedback()
    r = torch.randn(4, 3)
    ef.store("w", r)
    assert ef.residual("w") is not None and ef.residual("w").data_ptr() == r.data_ptr()  # held, not copied
    t = torch.randn(4, 3)
    out = torch.empty(12)
    ef.compensate_into("w", t, out)
    assert torch.equal(out, ef.compensate("w", t).reshape(-1))
    ef.compensate_into("new", t, out)
    assert torch.equal(out, t.reshape(-1))
    with pytest.raises(ValueError, match="shape"):
        ef.compensate_into("w", torch.randn(12), out)
    with pytest.raises(ValueError, match="float32"):
        ef.store("w", r.double())
    # the committed residuals are shared with the fresh feedback of the next round, not copied
    fresh = fresh_feedback({"w": r})
    assert fresh.residual("w").data_ptr() == r.data_ptr()  # type: ignore[union-attr]


def test_a_checkpoint_of_residual_views_is_saved_and_loaded(tmp_path: Path) -> None:
    """The residuals an exchange leaves are views of one vector: safetensors (which refuses
    tensors that overlap) writes them, and they load back as they were."""
    c = prepare_contribution(_delta(1), get_codec("int8"), 2, ("run",), weight=1.0)
    residuals = c.residual()
    state = CellState({n: torch.zeros(t.shape) for n, t in residuals.items()})
    store = LocalStore(tmp_path, "run", "spec")
    store.save(LocalCheckpoint("k0.r0", 3, state, state.state_hash(), residuals))
    got = store.load()
    assert got is not None and got.committed_round == 3
    assert set(got.residuals) == set(residuals)
    assert all(torch.equal(got.residuals[n], residuals[n]) for n in residuals)
