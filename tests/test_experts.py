"""Cells: deterministic init, data selection, losses, memory estimates, bad cell ids."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

from bagel.models import experts
from bagel.protocol.runspec import load_spec, parse_spec
from bagel.protocol.statehash import state_hash

EXAMPLE = str(Path(__file__).resolve().parents[1] / "examples" / "digits-2x2.toml")


@pytest.fixture(scope="module")
def spec():
    return load_spec(EXAMPLE)


def _hash(model: torch.nn.Module) -> str:
    return state_hash({f"w.{k}": v for k, v in model.state_dict().items()})


def test_build_model_is_deterministic_and_leaves_global_rng_alone(spec):
    torch.manual_seed(123)
    before = torch.get_rng_state()
    hashes = {c: _hash(experts.cell_task(spec, c).build_model()) for c in spec.cell_ids}
    assert torch.equal(before, torch.get_rng_state())
    assert hashes == {c: _hash(experts.cell_task(spec, c).build_model()) for c in spec.cell_ids}
    assert len(set(hashes.values())) == len(hashes)  # each cell has its own init


@pytest.mark.timeout(180)
def test_build_model_is_bit_identical_in_another_process(spec):
    code = (
        "from bagel.protocol.runspec import load_spec; from bagel.models import experts;"
        "from bagel.protocol.statehash import state_hash;"
        f"m = experts.cell_task(load_spec({EXAMPLE!r}), 'k1.r0').build_model();"
        "print(state_hash({'w.' + k: v for k, v in m.state_dict().items()}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=170, check=True)
    assert out.stdout.strip() == _hash(experts.cell_task(spec, "k1.r0").build_model())


def test_cell_data_partitions_the_dataset(spec):
    sizes = {}
    for k in range(spec.data.clusters):
        x0, y0 = experts.cell_task(spec, f"k{k}.r0").train_data()
        x1, _ = experts.cell_task(spec, f"k{k}.r1").train_data()
        assert torch.equal(x0, x1)  # both ranges of a cluster train on the same images
        assert y0.dtype == torch.int64 and int(y0.max()) < 10
        sizes[k] = len(x0)
    xr, yr = experts.cell_task(spec, "router").train_data()
    assert len(xr) == sum(sizes.values())
    assert set(yr.tolist()) == set(range(spec.data.clusters))
    assert [int((yr == k).sum()) for k in sizes] == list(sizes.values())
    xh, yh = experts.cell_task(spec, "router").heldout_data()
    assert len(xh) == 180 and len(yh) == 180


def test_losses_use_only_the_generator_and_eval_is_deterministic(spec):
    for cell in ("k0.r1", "router"):
        task = experts.cell_task(spec, cell)
        model = task.build_model()
        x, y = task.train_data()
        l1 = task.loss(model, x[:16], y[:16], torch.Generator().manual_seed(4))
        torch.manual_seed(999)  # the global RNG must not matter
        l2 = task.loss(model, x[:16], y[:16], torch.Generator().manual_seed(4))
        assert torch.equal(l1, l2) and l1.requires_grad
        xh, yh = task.heldout_data()
        assert task.eval_loss(model, xh, yh, seed=1) == task.eval_loss(model, xh, yh, seed=1)


def test_cell_ranges_follow_the_spec(spec):
    lo = experts.cell_task(spec, "k0.r0")
    hi = experts.cell_task(spec, "k0.r1")
    assert lo.t_range == (0.0, pytest.approx(0.5)) and hi.t_range == (pytest.approx(0.5), 1.0)
    assert lo.train_range == (0.0, pytest.approx(0.55)) and hi.train_range == (pytest.approx(0.45), 1.0)


def test_memory_estimate_is_closed_form_and_grows_with_batch(spec):
    task = experts.cell_task(spec, "k0.r0")
    p = sum(t.numel() for t in task.build_model().parameters())
    est = task.model_nbytes_estimate(8)
    assert est > experts.DEVICE_COPIES * 4 * p
    assert task.model_nbytes_estimate(64) > est
    # a DiT-XL/2 run is sized without building it (675M parameters, ~11 GB on the card)
    big = parse_spec('[run]\nid = "xl"\n[model]\npreset = "XL/2"\nimage_size = 32\nchannels = 3\nnum_classes = 1000\n')
    assert experts.param_count("dit", "XL/2", 32, 4, 1000) == 674_816_272
    assert experts.cell_memory_bytes(big, "k0.r0", 1) > 4 * 4 * 670e6
    assert experts.cell_memory_bytes(big, "router", 1) < 100e6
    n = experts.cell_param_count(big, "k0.r0")
    # on the host: three states of weights and momentum in float32, and 9 float32 working copies
    assert experts.cell_host_bytes(big, "k0.r0") == (3 * 2 * 4 + 9 * 4) * n
    one, sample, host = experts.cell_memory_sizes(big, "k0.r0")
    assert (one, host) == (experts.cell_memory_bytes(big, "k0.r0", 1), experts.cell_host_bytes(big, "k0.r0"))
    assert experts.cell_memory_bytes(big, "k0.r0", 5) == one + 4 * sample
    # the average adds a tensor to each state; a bf16 state halves the states, not the working copies
    half = parse_spec(
        '[run]\nid = "xl"\n[model]\npreset = "XL/2"\nimage_size = 32\nchannels = 3\nnum_classes = 1000\n'
        '[sync]\nstate_dtype = "bf16"\n[ema]\ndecay = 0.999\n'
    )
    assert experts.cell_host_bytes(half, "k0.r0") == (3 * 3 * 2 + 9 * 4) * n
    assert experts.cell_param_count(big, "k0.r0") == experts.param_count("dit", "XL/2", 32, 3, 1000)
    assert experts.cell_param_count(spec, "k0.r0") == p


@pytest.mark.parametrize("bad", ["k9.r0", "k0.r7", "nope", "k0.r0 ", "router2"])
def test_unknown_cells_are_rejected(spec, bad):
    with pytest.raises(experts.CellError):
        experts.cell_task(spec, bad)


def test_router_cell_absent_when_disabled():
    s = parse_spec('[run]\nid = "x"\n[cells]\nrouter = false\n')
    with pytest.raises(experts.CellError):
        experts.cell_task(s, "router")
