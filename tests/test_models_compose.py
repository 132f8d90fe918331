"""The composed sampler (routing by t and router top-1, fallbacks, conversions, CFG) and
router training."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.nn as nn

from bagel.models import compose, experts, flow, train
from bagel.protocol.runspec import load_spec

RANGES = flow.timestep_ranges(2)  # [(0, 0.5), (0.5, 1)]

EXAMPLE = Path(__file__).resolve().parents[1] / "examples" / "digits-2x2.toml"


class Const(nn.Module):
    """An 'expert' whose velocity is a constant that names its cell."""

    def __init__(self, value: float) -> None:
        super().__init__()
        self.value = value

    def forward(self, x, t, y=None):
        return torch.full_like(x, self.value)


class SignRouter(nn.Module):
    """Prefers cluster order given by a fixed score vector, flipped for samples with mean > 0."""

    def __init__(self, scores: list[float]) -> None:
        super().__init__()
        self.scores = torch.tensor(scores)

    def forward(self, x, t, y=None):
        s = self.scores.expand(x.shape[0], -1).clone()
        flip = x.flatten(1).mean(dim=1) > 0
        s[flip] = s[flip].flip(1)
        return s


def grid(clusters: int, ranges: int, missing: set[tuple[int, int]] = frozenset(), scale: float = 1.0):
    return {
        (k, r): Const(scale * (10 * k + r + 1)) for k in range(clusters) for r in range(ranges) if (k, r) not in missing
    }


def test_switches_expert_at_the_range_boundary_and_by_router():
    trace: list = []
    # small velocities, so the samples keep the sign the router routes by while integrating
    cm = compose.ComposedModel(grid(2, 2, scale=0.01), RANGES, 2, router=SignRouter([2.0, 0.0]), trace=trace)
    x = torch.cat([-torch.ones(1, 1, 4, 4), torch.ones(1, 1, 4, 4)])  # sample 0 -> k0, sample 1 -> k1
    compose.sample(cm, x, steps=10)
    assert len(trace) == 10
    for t, chosen in trace:
        r = 1 if t >= 0.5 else 0
        assert chosen.tolist() == [[0, r], [1, r]], t
    v = cm.velocity(x, torch.tensor([0.7, 0.2]))
    assert v[0].unique().tolist() == [pytest.approx(0.02)] and v[1].unique().tolist() == [pytest.approx(0.11)]


def test_fallback_to_the_same_clusters_nearest_range():
    cm = compose.ComposedModel(grid(2, 2, missing={(1, 0)}), RANGES, 2, router=SignRouter([0.0, 2.0]))
    x = -torch.ones(3, 1, 4, 4)  # router says cluster 1 for all
    chosen = cm.choose(x, torch.tensor([0.9, 0.3, 0.01]), None)
    assert chosen.tolist() == [[1, 1], [1, 1], [1, 1]]


def test_fallback_to_the_router_renormalised_over_available_clusters():
    # cluster 2 (the router's favourite) has no cell at all: its second choice, 1, answers.
    cm = compose.ComposedModel(
        grid(3, 2, missing={(2, 0), (2, 1), (1, 1)}), RANGES, 3, router=SignRouter([0.0, 1.0, 2.0])
    )
    x = -torch.ones(2, 1, 4, 4)
    chosen = cm.choose(x, torch.tensor([0.2, 0.8]), None)
    # t=0.2 -> (1, 0); t=0.8 -> cluster 1 lacks range 1 -> its nearest range 0
    assert chosen.tolist() == [[1, 0], [1, 0]]
    v = cm.velocity(x, torch.tensor([0.2, 0.8]))
    assert v.unique().tolist() == [11.0]


def test_class_prior_routes_conditional_samples_without_a_router():
    table = torch.tensor([[0.9, 0.1], [0.1, 0.9]])  # p(y | k): class 0 lives in cluster 0
    cm = compose.ComposedModel(
        grid(2, 1), [(0.0, 1.0)], 2, cluster_prior=torch.tensor([0.3, 0.7]), class_given_cluster=table, null_label=2
    )
    x = torch.zeros(3, 1, 4, 4)
    chosen = cm.choose(x, torch.full((3,), 0.5), torch.tensor([0, 1, 2]))
    # y=2 is the null label: the cluster prior alone decides
    assert chosen[:, 0].tolist() == [0, 1, 1]


def test_eps_and_x0_experts_are_converted_to_velocity():
    gen = torch.Generator().manual_seed(0)
    x0 = torch.randn(4, 1, 4, 4, generator=gen)
    eps = torch.randn(4, 1, 4, 4, generator=gen)
    t = torch.full((4,), 0.6)
    xt = flow.interpolate(x0, eps, t)

    class Oracle(nn.Module):
        def __init__(self, out):
            super().__init__()
            self.out = out

        def forward(self, x, tt, y=None):
            return self.out

    for kind, out in (("eps", eps), ("x0", x0), ("v", eps - x0)):
        cm = compose.single(Oracle(out), prediction=kind)
        torch.testing.assert_close(cm.velocity(xt, t), eps - x0, atol=1e-5, rtol=0)


def test_classifier_free_guidance_combines_conditional_and_null_passes():
    class LabelEcho(nn.Module):
        def forward(self, x, t, y=None):
            return y.float().view(-1, 1, 1, 1).expand_as(x).clone()

    cm = compose.single(LabelEcho(), null_label=10)
    x = torch.zeros(2, 1, 2, 2)
    v = cm.velocity(x, torch.full((2,), 0.5), torch.tensor([2, 4]), guidance=3.0)
    # v_null + 3 (v_cond - v_null) = 10 + 3 (y - 10)
    assert v[:, 0, 0, 0].tolist() == [10 + 3 * (2 - 10), 10 + 3 * (4 - 10)]
    with pytest.raises(ValueError):
        compose.single(LabelEcho()).velocity(x, torch.full((2,), 0.5), torch.tensor([1, 1]), guidance=2.0)


def test_bad_grids_are_rejected():
    with pytest.raises(ValueError):
        compose.ComposedModel({}, RANGES, 2)
    with pytest.raises(ValueError):
        compose.ComposedModel({(2, 0): Const(1)}, RANGES, 2)
    with pytest.raises(ValueError):
        compose.ComposedModel({(0, 0): Const(1)}, RANGES, 1, prediction={(0, 0): "score"})
    with pytest.raises(ValueError):
        compose.sample(compose.single(Const(1)), torch.zeros(1, 1, 2, 2), method="rk4")


@pytest.mark.timeout(240)
def test_training_the_router_lowers_its_cross_entropy():
    spec = load_spec(EXAMPLE)
    task = experts.cell_task(spec, "router")
    model = task.build_model()
    x, y = task.train_data()
    xh, yh = task.heldout_data()
    before = task.eval_loss(model, xh, yh, seed=0)
    res = train.train(model, task.loss, x, y, steps=150, batch_size=64, lr=3e-3, seed=0)
    after = task.eval_loss(res.model, xh, yh, seed=0)
    assert after < before - 0.1, (before, after)
    # a trained router is right far more often than chance on lightly noised held-out data
    gen = torch.Generator().manual_seed(1)
    t = torch.full((len(xh),), 0.2)
    xt = flow.interpolate(xh, torch.randn(xh.shape, generator=gen), t)
    acc = float((res.model(xt, t).argmax(1) == yh).float().mean())
    assert acc > 0.8


def test_from_cells_composes_checkpointed_cells_with_one_missing(tmp_path):
    from bagel.models import checkpoint

    spec = load_spec(EXAMPLE)
    loaded = {}
    for cell in ("k0.r0", "k0.r1", "k1.r1", "router"):  # k1.r0 is missing
        checkpoint.save(tmp_path / cell, experts.cell_task(spec, cell).build_model())
        loaded[cell], _ = checkpoint.load(tmp_path / cell)
    cm = compose.from_cells(spec, loaded)
    assert set(cm.experts) == {(0, 0), (0, 1), (1, 1)} and cm.router is not None
    assert cm.class_given_cluster.shape == (2, 10)
    # the low-t step of a sample routed to cluster 1 falls back to k1.r1
    x = torch.randn(4, 1, 8, 8, generator=torch.Generator().manual_seed(0))
    scores = cm.route_scores(x, torch.full((4,), 0.1), None)
    chosen = cm.choose(x, torch.full((4,), 0.1), None)
    for i in range(4):
        expect = (0, 0) if int(scores[i].argmax()) == 0 else (1, 1)
        assert tuple(chosen[i].tolist()) == expect
    out = compose.sample(cm, x, torch.arange(4), steps=4, method="heun", guidance=2.0)
    assert out.shape == x.shape and torch.isfinite(out).all()
    with pytest.raises(ValueError):
        compose.from_cells(spec, {"k5.r0": loaded["k0.r0"]})


def test_mixture_routing_is_the_router_weighted_sum_of_experts():
    rt = SignRouter([1.0, 0.0, -1.0])
    # cluster 2 has no cell: the mixture is renormalised over clusters 0 and 1
    cm = compose.ComposedModel(grid(3, 2, missing={(2, 0), (2, 1), (1, 0)}), RANGES, 3, router=rt, routing="mixture")
    x = -torch.ones(2, 1, 4, 4)
    v = cm.velocity(x, torch.tensor([0.8, 0.2]))
    w = torch.softmax(torch.tensor([1.0, 0.0]), dim=0)
    # t=0.8: cells (0,1) and (1,1) -> values 2 and 12; t=0.2: (0,0) and (1,1 nearest) -> 1 and 12
    assert v[0].unique().item() == pytest.approx(float(w[0] * 2 + w[1] * 12))
    assert v[1].unique().item() == pytest.approx(float(w[0] * 1 + w[1] * 12))


def test_sampled_routing_follows_the_router_distribution_and_the_generator():
    def make(seed):
        return compose.ComposedModel(
            grid(2, 1),
            [(0.0, 1.0)],
            2,
            router=SignRouter([0.0, 1.0]),
            routing="sample",
            generator=torch.Generator().manual_seed(seed),
        )

    x = -torch.ones(4000, 1, 2, 2)
    t = torch.full((4000,), 0.5)
    a = make(0).choose(x, t, None)
    assert torch.equal(a, make(0).choose(x, t, None))
    frac1 = float((a[:, 0] == 1).float().mean())
    assert frac1 == pytest.approx(float(torch.sigmoid(torch.tensor(1.0))), abs=0.03)
    with pytest.raises(ValueError):
        compose.ComposedModel(grid(2, 1), [(0.0, 1.0)], 2, routing="sample")
    with pytest.raises(ValueError):
        compose.ComposedModel(grid(2, 1), [(0.0, 1.0)], 2, routing="top2")


def test_prior_routing_draws_each_trajectorys_cluster_once_from_p_k_given_y():
    table = torch.tensor([[0.8, 0.2], [0.2, 0.8]])  # p(y | k)
    trace: list = []
    cm = compose.ComposedModel(
        grid(2, 2, scale=0.0),
        RANGES,
        2,
        router=SignRouter([5.0, 0.0]),
        cluster_prior=torch.tensor([1.0, 1.0]),
        class_given_cluster=table,
        null_label=2,
        routing="prior",
        generator=torch.Generator().manual_seed(0),
        trace=trace,
    )
    y = torch.tensor([0, 1]).repeat(2000)
    compose.sample(cm, torch.zeros(4000, 1, 2, 2), y, steps=6)
    first = trace[0][1][:, 0]
    for t, chosen in trace:  # the cluster sticks to the trajectory; the range follows t
        assert torch.equal(chosen[:, 0], first)
        assert set(chosen[:, 1].tolist()) == {1 if t >= 0.5 else 0}
    # the router (which prefers cluster 0 for everyone) is ignored; p(k | y) = p(y | k) here
    assert float((first[y == 0] == 0).float().mean()) == pytest.approx(0.8, abs=0.03)
    assert float((first[y == 1] == 1).float().mean()) == pytest.approx(0.8, abs=0.03)
    with pytest.raises(ValueError):
        compose.ComposedModel(grid(2, 1), [(0.0, 1.0)], 2, routing="prior")
