"""DiLoCo outer step, error feedback and cell state (golden outer step).

- The outer step matches torch.optim.SGD(nesterov=True) and a hand-written numpy
  reference of Douillard et al. 2023 (outer SGD + Nesterov on the averaged delta).
- Four rounds of the data plane's pure pipeline (error-feedback compensation, int4 parts,
  the reducer's weighted mean and re-encode, the outer step) match an independent numpy
  reference to 1e-6, and a golden JSON fixture (torchft's habit: regenerate with
  `WRITE_FIXTURE=true`), so a numeric change shows up as a diff in review.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from bagel.compression import ErrorFeedback, decode, get_codec
from bagel.protocol.statehash import state_hash
from bagel.robust.aggregation import WeightedMean
from bagel.worker.diloco import CellState, OuterConfig, StateFormatError, outer_step, pseudo_gradient
from bagel.worker.parts import decode_part, part_bounds, part_generator, prepare_contribution, reduce_part

FIXTURE = Path(__file__).parent / "fixtures" / "diloco_golden.json"
WRITE = os.environ.get("WRITE_FIXTURE", "").lower() in ("1", "true", "yes")
SHAPES = {"a.weight": (3, 4), "a.bias": (4,), "b.weight": (2, 3)}


def initial_weights(seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(s, generator=g) for n, s in SHAPES.items()}


# ---------------------------------------------------------------- outer step alone


@pytest.mark.parametrize("nesterov", [True, False])
def test_outer_step_matches_torch_sgd(nesterov: bool) -> None:
    cfg = OuterConfig(lr=0.7, momentum=0.9, nesterov=nesterov)
    state = CellState(initial_weights())
    params = {n: torch.nn.Parameter(t.clone()) for n, t in initial_weights().items()}
    opt = torch.optim.SGD(list(params.values()), lr=cfg.lr, momentum=cfg.momentum, nesterov=nesterov)
    g = torch.Generator().manual_seed(1)
    for _ in range(5):
        delta = {n: 0.1 * torch.randn(s, generator=g) for n, s in SHAPES.items()}
        outer_step(state, delta, cfg)
        for n, p in params.items():
            p.grad = delta[n].clone()
        opt.step()
    for n, p in params.items():
        torch.testing.assert_close(state.weights[n], p.detach(), rtol=0, atol=1e-6)
        torch.testing.assert_close(state.momentum[n], opt.state[p]["momentum_buffer"], rtol=0, atol=1e-6)


def test_outer_step_matches_handwritten_nesterov() -> None:
    """Nesterov momentum as in the paper's outer optimizer, in float64 numpy."""
    lr, mu = 0.7, 0.9
    state = CellState(initial_weights())
    w = {n: t.numpy().astype(np.float64) for n, t in initial_weights().items()}
    m = {n: np.zeros(s) for n, s in SHAPES.items()}
    g = torch.Generator().manual_seed(2)
    for _ in range(5):
        delta = {n: 0.1 * torch.randn(s, generator=g) for n, s in SHAPES.items()}
        outer_step(state, delta, OuterConfig(lr, mu, True))
        for n in SHAPES:
            d = delta[n].numpy().astype(np.float64)
            m[n] = mu * m[n] + d
            w[n] = w[n] - lr * (d + mu * m[n])
    for n in SHAPES:
        np.testing.assert_allclose(state.weights[n].numpy(), w[n], rtol=0, atol=1e-6)
        np.testing.assert_allclose(state.momentum[n].numpy(), m[n], rtol=0, atol=1e-6)


def test_outer_step_refuses_mismatched_delta_and_leaves_state_alone() -> None:
    state = CellState(initial_weights())
    before = state.state_hash()
    with pytest.raises(StateFormatError, match="names"):
        outer_step(state, {"a.weight": torch.zeros(3, 4)}, OuterConfig())
    bad = {n: torch.zeros(s) for n, s in SHAPES.items()}
    bad["b.weight"] = torch.zeros(3, 2)
    with pytest.raises(StateFormatError, match="shape"):
        outer_step(state, bad, OuterConfig())
    bad["b.weight"] = torch.zeros(2, 3, dtype=torch.float64)
    with pytest.raises(StateFormatError):
        outer_step(state, bad, OuterConfig())
    assert state.state_hash() == before


# ---------------------------------------------------------------- golden: EF + exchange pipeline + outer step

MEMBERS = ("w0", "w1", "w2")
SAMPLES = {"w0": 32.0, "w1": 16.0, "w2": 48.0}
MAX_SAMPLES = {"w0": 32, "w1": 32, "w2": 32}  # w2's weight is clamped to 32
ROUNDS = 4
CODEC = "int4"


def local_weights(global_w: dict[str, torch.Tensor], rnd: int, member: int) -> dict[str, torch.Tensor]:
    """Stand-in for H inner steps: a fixed, member-specific move away from the global weights."""
    g = torch.Generator().manual_seed(1000 * rnd + member)
    return {n: global_w[n] - 0.05 * (member + 1) * torch.randn(s, generator=g) for n, s in SHAPES.items()}


def run_pipeline() -> tuple[CellState, dict[str, ErrorFeedback], list[dict]]:
    """Our code, as the data plane runs it, minus the network (test_averaging proves the
    network result equals this: the same `prepare_contribution` and `reduce_part`)."""
    codec, reducer, cfg = get_codec(CODEC), WeightedMean(), OuterConfig(0.7, 0.9, True)
    state = CellState(initial_weights())
    efs = {m: ErrorFeedback() for m in MEMBERS}
    log = []
    for rnd in range(1, ROUNDS + 1):
        contribs = {}
        for i, m in enumerate(MEMBERS):
            delta = pseudo_gradient(state.weights, local_weights(state.weights, rnd, i))
            key = ("golden", "k0.r0", rnd, 1, 1, m)
            contribs[m] = prepare_contribution(
                delta, codec, len(MEMBERS), key, weight=SAMPLES[m], error_feedback=efs[m]
            )
        layout, bounds = contribs["w0"].layout, contribs["w0"].bounds
        weights = [min(SAMPLES[m], MAX_SAMPLES[m]) for m in MEMBERS]
        pieces = []
        for j, (s, e) in enumerate(bounds):
            gen = part_generator("golden", "k0.r0", rnd, 1, 1, "result", j)
            buf = reduce_part(codec, reducer, [contribs[m].decoded(j) for m in MEMBERS], weights, gen)
            pieces.append(decode_part(codec, buf, e - s))
        averaged = layout.unflatten(torch.cat(pieces))
        for m in MEMBERS:
            contribs[m].commit_error_feedback(efs[m])
        outer_step(state, averaged, cfg)
        log.append({"round": rnd, "averaged": averaged, "state_hash": state.state_hash()})
    return state, efs, log


def run_reference() -> tuple[dict, dict, dict, list[dict]]:
    """Independent reference: the formulas, written out in numpy.

    e_i <- c_i - Q(c_i) with c_i = (theta - theta_i) + e_i (error feedback, Seide 2014 /
    Karimireddy 2019); a = Q(sum_i w_i Q(c_i) / sum_i w_i) with w_i = min(samples, max);
    m <- mu m + a; theta <- theta - lr (a + mu m) (Nesterov). Q = decode(encode(.)) part by
    part (the codec is not what is tested here). Pre-quantization arithmetic is float32,
    as the pipeline's, so a value on a rounding boundary lands on the same side.
    """
    codec = get_codec(CODEC)
    names = sorted(SHAPES)
    sizes = [int(np.prod(SHAPES[n])) for n in names]
    total = sum(sizes)
    bounds = part_bounds(total, len(MEMBERS))

    def flat(d: dict[str, np.ndarray]) -> np.ndarray:
        return np.concatenate([d[n].reshape(-1) for n in names]).astype(np.float32)

    def Q(x: np.ndarray) -> np.ndarray:
        return np.concatenate([decode(codec.encode(torch.from_numpy(x[s:e].copy()))).numpy() for s, e in bounds])

    theta = flat({n: t.numpy() for n, t in initial_weights().items()})
    mom = np.zeros(total, dtype=np.float32)
    err = {m: np.zeros(total, dtype=np.float32) for m in MEMBERS}
    w = np.array([min(SAMPLES[m], MAX_SAMPLES[m]) for m in MEMBERS], dtype=np.float64)
    log = []
    for rnd in range(1, ROUNDS + 1):
        unflat, start = {}, 0
        for n, k in zip(names, sizes, strict=True):
            unflat[n] = torch.from_numpy(theta[start : start + k].reshape(SHAPES[n]).copy())
            start += k
        sent = []
        for i, m in enumerate(MEMBERS):
            local = flat({n: t.numpy() for n, t in local_weights(unflat, rnd, i).items()})
            c = (theta - local) + err[m]
            q = Q(c)
            err[m] = c - q
            sent.append(q.astype(np.float64))
        a = Q((sum(wi * q for wi, q in zip(w, sent, strict=True)) / w.sum()).astype(np.float32))
        mom = mom * np.float32(0.9) + a
        theta = theta - (a + mom * np.float32(0.9)) * np.float32(0.7)
        log.append({"round": rnd, "averaged": a})
    return {"theta": theta}, {"mom": mom}, err, log


def test_golden_outer_step_and_error_feedback_match_reference_and_fixture() -> None:
    state, efs, log = run_pipeline()
    ref_theta, ref_mom, ref_err, ref_log = run_reference()
    names = sorted(SHAPES)

    def flat(d: dict[str, torch.Tensor]) -> np.ndarray:
        return np.concatenate([d[n].reshape(-1).numpy() for n in names])

    np.testing.assert_allclose(flat(state.weights), ref_theta["theta"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(flat(state.momentum), ref_mom["mom"], rtol=0, atol=1e-6)
    for m in MEMBERS:
        got = flat({n: efs[m].residual(n) for n in names})
        np.testing.assert_allclose(got, ref_err[m], rtol=0, atol=1e-6)
        assert np.abs(got).max() > 0, "error feedback kept nothing: the test would not see a wrong update"
    for ours, ref in zip(log, ref_log, strict=True):
        np.testing.assert_allclose(flat(ours["averaged"]), ref["averaged"], rtol=0, atol=1e-6)

    record = {
        "about": "tests/test_diloco.py golden: 3 members, int4 + error feedback, weighted mean, outer Nesterov"
        " lr 0.7 mu 0.9; regenerate with WRITE_FIXTURE=true",
        "codec": CODEC,
        "rounds": [
            {"round": r["round"], "state_hash": r["state_hash"], "averaged": flat(r["averaged"]).tolist()} for r in log
        ],
        "weights": flat(state.weights).tolist(),
        "momentum": flat(state.momentum).tolist(),
        "residuals": {m: flat({n: efs[m].residual(n) for n in names}).tolist() for m in MEMBERS},
    }
    if WRITE:
        FIXTURE.parent.mkdir(parents=True, exist_ok=True)
        FIXTURE.write_text(json.dumps(record, indent=1) + "\n")
    assert FIXTURE.exists(), f"{FIXTURE} is missing: run with WRITE_FIXTURE=true once and commit it"
    golden = json.loads(FIXTURE.read_text())
    assert golden["codec"] == CODEC
    np.testing.assert_allclose(record["weights"], golden["weights"], rtol=0, atol=1e-6)
    np.testing.assert_allclose(record["momentum"], golden["momentum"], rtol=0, atol=1e-6)
    for m in MEMBERS:
        np.testing.assert_allclose(record["residuals"][m], golden["residuals"][m], rtol=0, atol=1e-6)
    for ours, theirs in zip(record["rounds"], golden["rounds"], strict=True):
        np.testing.assert_allclose(ours["averaged"], theirs["averaged"], rtol=0, atol=1e-6)
    # The hashes are exact: on IEEE hardware every step above is deterministic bit for bit.
    assert [r["state_hash"] for r in record["rounds"]] == [r["state_hash"] for r in golden["rounds"]]


# ---------------------------------------------------------------- cell state


def test_cell_state_flat_safetensors_and_hash_round_trip() -> None:
    state = CellState(initial_weights())
    outer_step(state, {n: torch.ones(s) for n, s in SHAPES.items()}, OuterConfig())
    flat = state.to_flat()
    assert sorted(flat) == sorted([f"w.{n}" for n in SHAPES] + [f"m.{n}" for n in SHAPES])
    assert state.state_hash() == state_hash(flat)
    back = CellState.from_safetensors(state.to_safetensors())
    assert back.state_hash() == state.state_hash()
    assert all(torch.equal(back.momentum[n], state.momentum[n]) for n in SHAPES)
    clone = state.clone()
    clone.weights["a.bias"][0] += 1
    assert clone.state_hash() != state.state_hash()


def test_cell_state_rejects_malformed_input() -> None:
    w = initial_weights()
    with pytest.raises(StateFormatError, match="neither"):
        CellState.from_flat({"x.a": torch.zeros(1)})
    with pytest.raises(StateFormatError, match="float32"):
        CellState.from_flat({"w.a": torch.zeros(1, dtype=torch.float64), "m.a": torch.zeros(1)})
    with pytest.raises(StateFormatError, match="momentum names"):
        CellState.from_flat({"w.a": torch.zeros(1), "m.b": torch.zeros(1)})
    with pytest.raises(StateFormatError, match="shape"):
        CellState(w, {n: torch.zeros(1) for n in w})
    with pytest.raises(StateFormatError, match="safetensors"):
        CellState.from_safetensors(b"\x00" * 64)
    with pytest.raises(StateFormatError, match="no weights"):
        CellState.from_flat({})


def test_from_model_load_into_and_pseudo_gradient() -> None:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2))
    state = CellState.from_model(model)
    assert set(state.weights) == {"0.weight", "0.bias", "1.weight", "1.bias"}
    assert all(float(m.abs().sum()) == 0 for m in state.momentum.values())
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.5)
    delta = pseudo_gradient(state.weights, model.named_parameters())
    assert all(torch.allclose(d, torch.full_like(d, -0.5)) for d in delta.values())
    state.load_into(model)
    assert all(torch.equal(p.detach(), state.weights[n]) for n, p in model.named_parameters())
    with pytest.raises(StateFormatError, match="missing"):
        pseudo_gradient(state.weights, {"0.weight": torch.zeros(3, 4)})
    with pytest.raises(StateFormatError, match="differ"):
        CellState(initial_weights()).load_into(model)
