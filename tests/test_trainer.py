"""Inner loop: deterministic per (run, cell, round, member), grad accumulation, stop, throttle."""

from __future__ import annotations

import threading

import pytest
import torch
from torch import nn

from bagel.models.data import shard
from bagel.worker.trainer import (
    InnerPlan,
    InnerTrainer,
    RoundKey,
    micro_batch_seed,
    micro_batches,
    pick_device,
    round_indices,
)


class LinearTask:
    """A noisy linear regression: small enough to run in milliseconds, with generator-drawn noise."""

    def __init__(self, n: int = 256, seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.x = torch.randn(n, 6, generator=g)
        self.w = torch.randn(6, 1, generator=g)
        self.y = self.x @ self.w

    def build_model(self) -> nn.Module:
        torch.manual_seed(1)
        return nn.Linear(6, 1)

    def train_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self.x, self.y

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        noise = 0.05 * torch.randn(y.shape, generator=generator)
        return ((model(x) + noise - y) ** 2).mean()


def _run(
    plan: InnerPlan, key: RoundKey, task: LinearTask | None = None, **kw
) -> tuple[dict[str, torch.Tensor], object]:
    task = task or LinearTask()
    model = task.build_model()
    tr = InnerTrainer(task, model, torch.device("cpu"), lr=0.05, **kw)
    idx = round_indices(shard, key, tr.num_train, plan)
    res = tr.run(key, plan, idx)
    return {k: v.clone() for k, v in model.state_dict().items()}, res


KEY = RoundKey("run", "k0.r0", 1, 0, 2)


def test_same_key_gives_bit_identical_weights():
    plan = InnerPlan(inner_steps=5, micro_batch=8, grad_accum=2)
    a, ra = _run(plan, KEY)
    b, rb = _run(plan, KEY)
    for k in a:
        assert torch.equal(a[k], b[k])
    assert ra.samples == rb.samples == plan.samples
    assert ra.steps == 5 and ra.completed


def test_other_member_or_round_trains_on_other_data():
    plan = InnerPlan(inner_steps=3, micro_batch=8, grad_accum=1)
    a, _ = _run(plan, KEY)
    b, _ = _run(plan, RoundKey("run", "k0.r0", 1, 1, 2))
    c, _ = _run(plan, RoundKey("run", "k0.r0", 2, 0, 2))
    assert not torch.equal(a["weight"], b["weight"])
    assert not torch.equal(a["weight"], c["weight"])


def test_loss_goes_down_across_rounds():
    task = LinearTask()
    model = task.build_model()
    tr = InnerTrainer(task, model, torch.device("cpu"), lr=0.05)
    plan = InnerPlan(inner_steps=20, micro_batch=16, grad_accum=1)
    losses = []
    for rnd in range(1, 4):
        key = RoundKey("run", "c", rnd, 0, 1)
        losses.append(tr.run(key, plan, round_indices(shard, key, tr.num_train, plan)).mean_loss)
    assert losses[2] < losses[0] * 0.5


def test_grad_accum_matches_one_big_micro_batch():
    """Accumulation weights each micro-batch by its size: 2x8 == 1x16 up to float order."""
    key = KEY

    # the noise differs by micro-batch layout, so compare with noise-free gradients:
    class NoNoise(LinearTask):
        def loss(self, model, x, y, generator):
            return ((model(x) - y) ** 2).mean()

    a, _ = _run(InnerPlan(4, 8, 2), key, NoNoise())
    b, _ = _run(InnerPlan(4, 16, 1), key, NoNoise())
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=1e-5, atol=1e-6)


def test_stop_event_ends_round_early():
    task = LinearTask()
    model = task.build_model()
    tr = InnerTrainer(task, model, torch.device("cpu"), lr=0.05)
    plan = InnerPlan(inner_steps=50, micro_batch=4, grad_accum=1)
    stop = threading.Event()
    seen = []

    def on_step(p):
        seen.append(p.step)
        if p.step == 3:
            stop.set()

    res = tr.run(KEY, plan, round_indices(shard, KEY, tr.num_train, plan), on_step=on_step, stop=stop)
    assert not res.completed
    assert res.steps == 3 and res.samples == 12
    assert seen == [1, 2, 3]


class RecordingEvent(threading.Event):
    def __init__(self) -> None:
        super().__init__()
        self.waits: list[float] = []

    def wait(self, timeout=None):  # type: ignore[override]
        self.waits.append(timeout)
        return False


def test_throttle_sleeps_its_factor_minus_one_times_compute():
    task = LinearTask()
    model = task.build_model()
    tr = InnerTrainer(task, model, torch.device("cpu"), lr=0.05, throttle=3.0)
    plan = InnerPlan(inner_steps=4, micro_batch=4, grad_accum=1)
    ev = RecordingEvent()
    res = tr.run(KEY, plan, round_indices(shard, KEY, tr.num_train, plan), stop=ev)
    assert res.completed and len(ev.waits) == 4
    assert all(w > 0 for w in ev.waits)
    with pytest.raises(ValueError, match="throttle"):
        InnerTrainer(task, model, torch.device("cpu"), lr=0.05, throttle=0.5)


def test_progress_reports_every_step_with_samples():
    task = LinearTask()
    model = task.build_model()
    tr = InnerTrainer(task, model, torch.device("cpu"), lr=0.05)
    plan = InnerPlan(inner_steps=3, micro_batch=5, grad_accum=2)
    seen = []
    tr.run(KEY, plan, round_indices(shard, KEY, tr.num_train, plan), on_step=seen.append)
    assert [p.step for p in seen] == [1, 2, 3]
    assert [p.samples for p in seen] == [10, 20, 30]
    assert all(p.steps == 3 and p.samples_per_s > 0 for p in seen)


def test_micro_batch_layout_and_validation():
    assert micro_batches(32, 4, 1) == 4
    assert micro_batches(32, 3, 2) == 4  # rounded up to a multiple of the ranks
    assert micro_batches(2, 8, 1) == 2  # never more micro-batches than samples
    with pytest.raises(ValueError):
        InnerPlan(0, 1, 1)
    with pytest.raises(ValueError, match="sample indices"):
        task = LinearTask()
        InnerTrainer(task, task.build_model(), torch.device("cpu"), lr=0.1).run(
            KEY, InnerPlan(2, 4, 1), torch.arange(3)
        )
    assert micro_batch_seed(KEY, 0, 1) == micro_batch_seed(KEY, 0, 1) != micro_batch_seed(KEY, 0, 2)
    # the value is pinned: training numerics (and the golden fixtures) depend on it
    assert micro_batch_seed(KEY, 3, 1) == 5395492153264570060


def test_round_indices_rejects_a_bad_shard():
    plan = InnerPlan(2, 4, 1)
    with pytest.raises(ValueError, match="expected 8"):
        round_indices(lambda *a: list(range(5)), KEY, 100, plan)
    with pytest.raises(ValueError, match="outside"):
        round_indices(lambda *a: [0] * 7 + [100], KEY, 100, plan)


def test_pick_device():
    assert pick_device("cpu").type == "cpu"
    assert pick_device("auto").type in ("cpu", "cuda")
    with pytest.raises(ValueError):
        pick_device("tpu")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="CUDA"):
            pick_device("cuda:0")
