"""The composed sampler: one velocity field out of a grid of independently trained cells.

At each step the timestep range is chosen by t, and the cluster by the router's top-1
(Decentralized Diffusion Models, McAllister et al. 2025, found top-1 routing best, and it
runs one expert per sample instead of a full mixture). When the chosen cell is missing
(not trained yet, or its checkpoint lost), the fallbacks are, in order:
  1. the same cluster's nearest timestep range;
  2. the router renormalised over the clusters that have any cell, top-1 again, then that
     cluster's range for t or its nearest range.

`routing` selects the rule: "top1" (the default, as above); "sample", which draws the
cluster from the renormalised router distribution with an explicit generator (one expert
per sample, like top-1, but unbiased: in expectation it is the mixture); and "mixture",
the full mixture sum_k p(k | x_t, t) v_k(x_t, t), which is the exact velocity of a data
distribution that is a mixture of the clusters (K expert passes per step). Near t = 1 the
router is uncertain, and a deterministic top-1 sends every sample of a class to the same
cluster, dropping the other clusters' modes of that class; bench/experts_vs_monolith.py
compares the rules.

"prior" needs no router: each trajectory draws its cluster once, k ~ p(k | y) (or p(k)
when unconditional) from the cluster manifest, and follows that cluster's experts from t = 1
to t = 0, switching only the timestep range. That is ancestral sampling of the mixture
p(x | y) = sum_k p(k | y) p(x | k, y), exact when each expert has learned its cluster; it
avoids routing mistakes at high noise, where the router can barely see the image.

For class-conditional sampling the routing score also folds in the cluster's class
histogram by Bayes' rule, log p(k | x_t, t) + log p(y | k), assuming y is independent of x_t
given k. At t = 1, where x_t is pure noise, this is exactly the posterior over clusters;
later the router's evidence dominates.

Experts may predict velocity, noise (eps) or data (x0); outputs are converted to velocity
(flow.eps_to_velocity / x0_to_velocity) before use, so experts trained with different
objectives compose. Classifier-free guidance combines conditional and null-label passes of
the same expert.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn as nn

from bagel.models import flow

if TYPE_CHECKING:
    from bagel.protocol.runspec import RunSpec

Prediction = Literal["v", "eps", "x0"]
Routing = Literal["top1", "sample", "mixture", "prior"]
ROUTING_RULES: tuple[str, ...] = ("top1", "sample", "mixture", "prior")
Cell = tuple[int, int]


@dataclass
class ComposedModel:
    """A velocity field v(x_t, t, y) routed over expert cells {(cluster, range): model}."""

    experts: Mapping[Cell, nn.Module]
    ranges: Sequence[tuple[float, float]]  # unwidened timestep ranges, range 0 at t = 0
    clusters: int
    router: nn.Module | None = None
    # [clusters] p(k), used instead of a router when there is none.
    cluster_prior: torch.Tensor | None = None
    # [clusters, num_classes] p(y | k), folded into routing for conditional sampling.
    class_given_cluster: torch.Tensor | None = None
    prediction: Mapping[Cell, Prediction] = field(default_factory=dict)
    null_label: int | None = None  # label meaning "unconditional" for CFG
    routing: Routing = "top1"
    generator: torch.Generator | None = None  # required by routing="sample" and "prior"
    # set to a list to record (t, chosen cells [B, 2]) at every call, for inspection/tests.
    trace: list[tuple[float, torch.Tensor]] | None = None

    def __post_init__(self) -> None:
        if not self.experts:
            raise ValueError("a composed model needs at least one expert cell")
        for k, r in self.experts:
            if not (0 <= k < self.clusters and 0 <= r < len(self.ranges)):
                raise ValueError(f"expert cell {(k, r)} outside {self.clusters} clusters x {len(self.ranges)} ranges")
        for cell, kind in self.prediction.items():
            if kind not in ("v", "eps", "x0"):
                raise ValueError(f"cell {cell}: unknown prediction type {kind!r}")
        if self.routing not in ROUTING_RULES:
            raise ValueError(f"unknown routing rule {self.routing!r}; known: {', '.join(ROUTING_RULES)}")
        if self.routing in ("sample", "prior") and self.generator is None:
            raise ValueError(f'routing="{self.routing}" needs a torch.Generator')

    # --- routing --------------------------------------------------------------------------

    def route_scores(
        self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None, use_router: bool = True
    ) -> torch.Tensor:
        """[B, clusters] log-scores: router log-probs (or the prior), plus log p(y | k)."""
        b = x.shape[0]
        if self.router is not None and use_router:
            scores = torch.log_softmax(self.router(x, t).float(), dim=1)
        elif self.cluster_prior is not None:
            scores = self.cluster_prior.float().clamp_min(1e-12).log().expand(b, -1).to(x.device)
        else:
            scores = torch.zeros(b, self.clusters, device=x.device)
        if y is not None and self.class_given_cluster is not None:
            table = self.class_given_cluster.float().clamp_min(1e-12).log().to(x.device)
            valid = (y >= 0) & (y < table.shape[1])
            if self.null_label is not None:
                valid &= y != self.null_label
            picked = table[:, y.clamp(0, table.shape[1] - 1)].T  # [B, clusters]
            scores = scores + torch.where(valid[:, None], picked, torch.zeros_like(picked))
        return scores

    def _nearest_range(self, cluster: int, t: float) -> int | None:
        have = [r for (k, r) in self.experts if k == cluster]
        if not have:
            return None

        def gap(r: int) -> float:
            lo, hi = self.ranges[r]
            return 0.0 if lo <= t <= hi else min(abs(t - lo), abs(t - hi))

        return min(have, key=lambda r: (gap(r), r))

    def _available_scores(self, scores: torch.Tensor) -> torch.Tensor:
        """Scores with clusters that have no cell at all masked out (the renormalised router)."""
        have = torch.tensor([any(k == c for (k, _) in self.experts) for c in range(self.clusters)])
        return scores.masked_fill(~have.to(scores.device)[None], float("-inf"))

    def _cell_for(self, k: int, r: int, t: float) -> Cell | None:
        """(k, r) if present, else cluster k's nearest range, else None."""
        if (k, r) in self.experts:
            return k, r
        near = self._nearest_range(k, t)
        return None if near is None else (k, near)

    def draw_clusters(self, x: torch.Tensor, y: torch.Tensor | None) -> torch.Tensor:
        """[B] clusters drawn from p(k | y) (the manifest's prior, no router), over clusters
        that have a cell: the once-per-trajectory choice of routing="prior"."""
        assert self.generator is not None
        t = torch.ones(x.shape[0], device=x.device)
        masked = self._available_scores(self.route_scores(x, t, y, use_router=False))
        return torch.multinomial(torch.softmax(masked.double().cpu(), dim=1), 1, generator=self.generator).flatten()

    def choose(
        self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None, clusters: torch.Tensor | None = None
    ) -> torch.Tensor:
        """[B, 2] (cluster, range) of the cell that answers each sample, with the fallbacks.

        top1 and mixture report the top-1 cell; sample reports the drawn one; prior uses
        `clusters` (drawn once per trajectory by `sample`), or draws them if not given."""
        if self.routing == "prior":
            scores = self.route_scores(x, t, y, use_router=False)
            top = clusters.cpu() if clusters is not None else self.draw_clusters(x, y)
        else:
            scores = self.route_scores(x, t, y)
            top = scores.argmax(dim=1).cpu()
        masked = self._available_scores(scores)
        if self.routing == "sample":
            assert self.generator is not None
            probs = torch.softmax(masked.double().cpu(), dim=1)
            top = torch.multinomial(probs, 1, generator=self.generator).flatten()
        top_avail = masked.argmax(dim=1).cpu()
        out = torch.empty(x.shape[0], 2, dtype=torch.long)
        for i in range(x.shape[0]):
            ti = float(t[i])
            r = flow.range_index(ti, self.ranges)
            # fallback 1 inside _cell_for: the same cluster's nearest range;
            # fallback 2: the router renormalised over clusters that have any cell.
            cell = self._cell_for(int(top[i]), r, ti) or self._cell_for(int(top_avail[i]), r, ti)
            assert cell is not None
            out[i, 0], out[i, 1] = cell
        return out

    # --- velocity -------------------------------------------------------------------------

    def _expert_velocity(
        self, cell: Cell, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None, guidance: float
    ) -> torch.Tensor:
        model = self.experts[cell]
        if y is not None and guidance != 1.0:
            if self.null_label is None:
                raise ValueError("classifier-free guidance needs null_label")
            null = torch.full_like(y, self.null_label)
            out = model(torch.cat([x, x]), torch.cat([t, t]), torch.cat([y, null]))
            cond, uncond = out.chunk(2)
            out = flow.guided(cond, uncond, guidance)
        else:
            out = model(x, t, y)
        kind = self.prediction.get(cell, "v")
        if kind == "eps":
            return flow.eps_to_velocity(out, x, t)
        if kind == "x0":
            return flow.x0_to_velocity(out, x, t)
        return out

    @torch.no_grad()
    def velocity(
        self,
        x: torch.Tensor,
        t: torch.Tensor,
        y: torch.Tensor | None = None,
        guidance: float = 1.0,
        clusters: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """v(x_t, t, y): each sample answered by its routed cell (t may differ per sample).

        `clusters` fixes each sample's cluster for routing="prior" (see `sample`)."""
        t = t.reshape(x.shape[0]).to(x.device)
        if self.routing == "mixture":
            return self._mixture_velocity(x, t, y, guidance)
        chosen = self.choose(x, t, y, clusters)
        if self.trace is not None:
            self.trace.append((float(t[0]), chosen.clone()))
        v = torch.empty_like(x)
        for cell in {(int(k), int(r)) for k, r in chosen.tolist()}:
            idx = torch.nonzero((chosen[:, 0] == cell[0]) & (chosen[:, 1] == cell[1])).flatten().to(x.device)
            yi = y[idx] if y is not None else None
            v[idx] = self._expert_velocity(cell, x[idx], t[idx], yi, guidance).to(v.dtype)
        return v

    def _mixture_velocity(
        self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None, guidance: float
    ) -> torch.Tensor:
        """sum_k p(k | x_t, t[, y]) v_k over clusters with a cell, each at its range for t
        (or its nearest range)."""
        weights = torch.softmax(self._available_scores(self.route_scores(x, t, y)), dim=1)
        if self.trace is not None:
            self.trace.append((float(t[0]), self.choose(x, t, y)))
        v = torch.zeros_like(x)
        for k in range(self.clusters):
            for cell in {self._cell_for(k, flow.range_index(float(ti), self.ranges), float(ti)) for ti in t}:
                if cell is None:
                    continue
                idx = torch.tensor(
                    [
                        i
                        for i, ti in enumerate(t.tolist())
                        if self._cell_for(k, flow.range_index(ti, self.ranges), ti) == cell
                    ],
                    device=x.device,
                )
                yi = y[idx] if y is not None else None
                vk = self._expert_velocity(cell, x[idx], t[idx], yi, guidance).to(v.dtype)
                v[idx] += weights[idx, k].view(-1, *([1] * (x.dim() - 1))).to(v.dtype) * vk
        return v


def single(model: nn.Module, prediction: Prediction = "v", null_label: int | None = None) -> ComposedModel:
    """A monolithic model (all data, all t) seen through the same interface."""
    return ComposedModel({(0, 0): model}, [(0.0, 1.0)], 1, prediction={(0, 0): prediction}, null_label=null_label)


@torch.no_grad()
def sample(
    composed: ComposedModel,
    noise: torch.Tensor,
    y: torch.Tensor | None = None,
    *,
    steps: int = 32,
    method: Literal["euler", "heun"] = "euler",
    guidance: float = 1.0,
    shift: float = 1.0,
) -> torch.Tensor:
    """Integrate the composed field from noise (t = 1) to data (t = 0).

    With routing="prior" each sample's cluster is drawn once here and kept to the end."""
    clusters = composed.draw_clusters(noise, y) if composed.routing == "prior" else None

    def field_fn(x: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
        return composed.velocity(x, t, y, guidance, clusters)

    if method == "euler":
        return flow.euler_sample(field_fn, noise, steps, shift)
    if method == "heun":
        return flow.heun_sample(field_fn, noise, steps, shift)
    raise ValueError(f"unknown sampler {method!r}; known: euler, heun")


def class_histogram(
    cluster_labels: torch.Tensor, class_labels: torch.Tensor, clusters: int, classes: int
) -> torch.Tensor:
    """[clusters, classes] p(y | k) with add-one smoothing, from a cluster manifest."""
    counts = torch.ones(clusters, classes, dtype=torch.float64)
    counts.index_put_(
        (cluster_labels.long(), class_labels.long()),
        torch.ones(len(class_labels), dtype=torch.float64),
        accumulate=True,
    )
    return (counts / counts.sum(dim=1, keepdim=True)).float()


def from_cells(
    spec: RunSpec,
    models: Mapping[str, nn.Module],
    prediction: Mapping[str, Prediction] | None = None,
) -> ComposedModel:
    """A composed model of a run from whichever of its cells are available ({cell id: model},
    e.g. loaded with `checkpoint.load`); the router is used when present, the cluster sizes
    and class histogram come from the run's cluster manifest."""
    from bagel.models.data import load_dataset
    from bagel.protocol.runspec import ROUTER_CELL, parse_cell

    ds = load_dataset(spec)
    labels = torch.from_numpy(ds.manifest.train_labels)
    k, c = spec.data.clusters, spec.cells
    experts: dict[Cell, nn.Module] = {}
    kinds: dict[Cell, Prediction] = {}
    for cell_id, model in models.items():
        if cell_id == ROUTER_CELL:
            continue
        parsed = parse_cell(cell_id)
        if parsed is None or cell_id not in spec.expert_cells:
            raise ValueError(f"{cell_id!r} is not an expert cell of run {spec.run.id!r}")
        experts[parsed] = model.eval()
        kinds[parsed] = (prediction or {}).get(cell_id, "v")
    nc = spec.model.num_classes
    router_model = models.get(ROUTER_CELL)
    return ComposedModel(
        experts,
        flow.timestep_ranges(c.timestep_ranges, c.t_mean, c.t_std),
        k,
        router=router_model.eval() if router_model is not None else None,
        cluster_prior=torch.bincount(labels, minlength=k).float(),
        class_given_cluster=class_histogram(labels, ds.y_train, k, nc) if nc > 0 else None,
        prediction=kinds,
        null_label=nc if nc > 0 else None,
    )
