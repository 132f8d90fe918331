"""Cells of a run: what one cell trains, on which data, with which loss.

`cell_task(spec, cell_id)` is the one entry point the worker, the coordinator's audit and
the benchmarks use. An expert cell `k{c}.r{r}` is a DiT or U-Net trained with rectified flow
only on cluster c's images and only on t in range r widened by the overlap (Decentralized
Diffusion Models, McAllister et al. 2025, for the clusters; eDiff-I, Balaji et al. 2022, for
the timestep experts). The `router` cell is a small classifier p(k | x_t, t) trained with
cross-entropy on noised images of every cluster.

Everything here is deterministic: the initial weights are a function of (run seed, cell
id) only, built under `torch.random.fork_rng` so the caller's global RNG is untouched, and
`eval_loss` draws its noise from its own seeded generator.

`param_count` and `cell_memory_bytes` are closed forms, so the scheduler can size a cell of
a DiT-XL run without allocating the model.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import torch
import torch.nn.functional as F
from torch import nn
from torch.overrides import TorchFunctionMode

from bagel.models import dit, flow, router, unet
from bagel.models.data import DataError, derive_seed, load_dataset
from bagel.protocol.cellmemory import DEVICE_COPIES, host_bytes_per_param

if TYPE_CHECKING:
    from bagel.protocol.runspec import RunSpec

ModelConfig = dit.DiTConfig | unet.UNetConfig | router.RouterConfig

# probability that an expert's training label is replaced by the null label (CFG training);
# DiT uses 0.1 as well.
LABEL_DROPOUT = 0.1
BYTES_PER_FLOAT = 4
EVAL_BATCH = 256


class CellError(ValueError):
    """The cell id does not name a cell of this run."""


def param_count(arch: str, preset: str, image_size: int, channels: int, num_classes: int) -> int:
    """Closed-form parameter count of an expert model (no model is built)."""
    return _count(expert_config(arch, preset, image_size, channels, num_classes))


def expert_config(arch: str, preset: str, image_size: int, channels: int, num_classes: int) -> ModelConfig:
    if arch == "dit":
        return dit.preset_config(preset, image_size, channels, num_classes)
    if arch == "unet":
        return unet.preset_config(preset, image_size, channels, num_classes)
    raise ValueError(f"unknown model.arch {arch!r}; known: dit, unet")


def _count(cfg: ModelConfig) -> int:
    if isinstance(cfg, dit.DiTConfig):
        return dit.param_count(cfg)
    if isinstance(cfg, unet.UNetConfig):
        return unet.param_count(cfg)
    return router.param_count(cfg)


def build(cfg: ModelConfig) -> nn.Module:
    """The model of a config (uses the global RNG; see CellTask.build_model for seeding)."""
    if isinstance(cfg, dit.DiTConfig):
        return dit.DiT(cfg)
    if isinstance(cfg, unet.UNetConfig):
        return unet.UNet(cfg)
    return router.Router(cfg)


def activation_bytes(cfg: ModelConfig, micro_batch: int) -> int:
    """Rough float32 activation memory kept for backward, per micro-batch.

    Counts the tensors autograd saves per layer (about 10 hidden-sized and 2 MLP-sized
    vectors per token and block for a DiT, plus the attention matrix; about 12 feature maps
    per residual block for the U-Net). An estimate to size cells, not a measurement.
    """
    if isinstance(cfg, dit.DiTConfig):
        t = cfg.tokens
        per_block = t * (10 * cfg.hidden + 2 * cfg.mlp_hidden) + 2 * cfg.heads * t * t
        floats = cfg.depth * per_block + 4 * t * cfg.hidden
    elif isinstance(cfg, unet.UNetConfig):
        floats = 0
        size = cfg.image_size
        for m in cfg.mults:
            floats += 2 * 12 * size * size * cfg.base * m  # encoder + decoder blocks
            size //= 2
        floats += 3 * 12 * size * size * cfg.base * cfg.mults[-1]
    else:
        floats = 6 * cfg.stages * cfg.image_size**2 * cfg.width
    return micro_batch * floats * BYTES_PER_FLOAT


def _parse(spec: RunSpec, cell_id: str) -> tuple[int, int] | None:
    from bagel.protocol.runspec import parse_cell

    try:
        parsed = parse_cell(cell_id)
    except ValueError as e:
        raise CellError(str(e)) from None
    if cell_id not in spec.cell_ids:
        raise CellError(f"cell {cell_id!r} is not a cell of run {spec.run.id!r} (cells: {list(spec.cell_ids)})")
    return parsed


def cell_config(spec: RunSpec, cell_id: str) -> ModelConfig:
    """The model config of a cell, from the spec alone."""
    m = spec.model
    if _parse(spec, cell_id) is None:
        return router.preset_config(m.router_preset, spec.data.clusters, m.image_size, m.channels, 0)
    return expert_config(m.arch, m.preset, m.image_size, m.channels, m.num_classes)


def cell_param_count(spec: RunSpec, cell_id: str) -> int:
    """Parameters of a cell's model, from the spec alone (closed form)."""
    return _count(cell_config(spec, cell_id))


# A cell's committed state as stored and hashed: "w.<param>" weights and "m.<param>" outer
# momentum (`worker/diloco.py`'s CellState.to_flat uses these), one per parameter, and with
# `[ema] decay` > 0 the average of the committed weights, "ema.<param>"; every tensor in the
# run's `[sync] state_dtype` (float32 by default).
WEIGHT_PREFIX = "w."
MOMENTUM_PREFIX = "m."
EMA_PREFIX = "ema."
# `[sync] state_dtype` -> the safetensors dtype of the state's tensors
SAFETENSORS_STATE_DTYPES = {"fp32": "F32", "bf16": "BF16", "fp16": "F16"}


class _NoRandomFill(TorchFunctionMode):
    """Skips the random fills of a model built on the meta device, where they have no values
    to fill. Only their cost is saved: torch implements `normal_` on meta through a Python
    reference that imports `torch._dynamo` on its first call, over a second of CPU in a
    process that never trains, as the coordinator's (its preflight and checkpoint checks
    call `cell_state_schema`; `dit.sincos_pos_embed` computes its table on the CPU for the
    same reason). A mode is thread-local, so a model another thread builds at the same
    moment keeps its initialisation: the idea of `no_init_weights` in Hugging Face
    transformers, without its patching of `torch.nn.init` for every thread."""

    FILLS = frozenset({torch.Tensor.normal_, torch.Tensor.uniform_})

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        # the in-place `torch.nn.init` functions (a trailing underscore) fill their tensor
        # and return it; they hand it on by keyword, a Tensor method positionally
        name = getattr(func, "__name__", "")
        fill = func in self.FILLS or (getattr(func, "__module__", None) == "torch.nn.init" and name.endswith("_"))
        target = args[0] if args else kwargs.get("tensor")
        if fill and isinstance(target, torch.Tensor) and target.is_meta:
            return target
        return func(*args, **kwargs)


def cell_state_schema(spec: RunSpec, cell_id: str) -> dict[str, tuple[str, tuple[int, ...]]]:
    """{tensor name: (safetensors dtype, shape)} of a cell's committed state, from the spec
    alone: the trainable parameters of its model, built on the meta device (no memory,
    no init), each as a weight and a momentum of the same shape, plus an average when the
    spec keeps one (`[ema]`), all in the spec's `[sync] state_dtype`. What a checkpoint of
    the cell must hold, exactly (the coordinator checks uploads against it: a tensor in
    another dtype is refused, not cast)."""
    with torch.device("meta"), _NoRandomFill():
        model = build(cell_config(spec, cell_id))
    dtype = SAFETENSORS_STATE_DTYPES[spec.sync.state_dtype]
    out: dict[str, tuple[str, tuple[int, ...]]] = {}
    for n, p in model.named_parameters():
        if p.requires_grad:
            out[WEIGHT_PREFIX + n] = (dtype, tuple(p.shape))
            out[MOMENTUM_PREFIX + n] = (dtype, tuple(p.shape))
            if spec.ema.decay > 0:
                out[EMA_PREFIX + n] = (dtype, tuple(p.shape))
    return out


def cell_memory_bytes(spec: RunSpec, cell_id: str, micro_batch: int) -> int:
    """A cell's training memory on the device (closed form): DEVICE_COPIES x params x 4
    bytes plus the activations of a micro-batch. What must fit the card (a CPU worker: its
    RAM, with `cell_host_bytes` beside it)."""
    if micro_batch < 1:
        raise ValueError(f"micro_batch must be at least 1, got {micro_batch}")
    cfg = cell_config(spec, cell_id)
    return DEVICE_COPIES * BYTES_PER_FLOAT * _count(cfg) + activation_bytes(cfg, micro_batch)


def cell_host_bytes(spec: RunSpec, cell_id: str) -> int:
    """What a worker of the cell holds on the host besides the device's share (closed form,
    `bagel.protocol.cellmemory.host_bytes_per_param`): HOST_STATES committed states (weights
    and momentum, and the average with `[ema]`, in the run's `[sync] state_dtype`) plus
    HOST_WORK_COPIES float32 copies of the parameters. It does not depend on the
    micro-batch. On a GPU worker it must fit the host's RAM; on a CPU worker the device is
    the host, so it adds to `cell_memory_bytes`."""
    from bagel.protocol.runspec import STATE_DTYPE_NBYTES

    per_param = host_bytes_per_param(STATE_DTYPE_NBYTES[spec.sync.state_dtype], spec.ema.decay > 0)
    return per_param * _count(cell_config(spec, cell_id))


def cell_memory_sizes(spec: RunSpec, cell_id: str) -> tuple[int, int, int]:
    """(a cell's device memory with a micro-batch of one sample, what each further sample
    adds, its host memory): the activations are linear in the micro-batch, so
    `cell_memory_bytes` at m is first + (m - 1) x second. What the coordinator sizes a cell
    by (`coordinator/sizing.py`) and the worker measures by (`worker/profile.py`), through
    `bagel.protocol.cellmemory`."""
    return (
        cell_memory_bytes(spec, cell_id, 1),
        activation_bytes(cell_config(spec, cell_id), 1),
        cell_host_bytes(spec, cell_id),
    )


@dataclass(frozen=True)
class CellTask:
    """Everything one cell needs to train and be evaluated. Build with `cell_task`."""

    spec: RunSpec
    cell_id: str
    kind: Literal["expert", "router"]
    cluster: int | None  # None for the router
    trange: int | None
    t_range: tuple[float, float]  # the range this expert answers for at sampling time
    train_range: tuple[float, float]  # t_range widened by cells.overlap: what it trains on
    config: ModelConfig

    def build_model(self) -> nn.Module:
        """Initial weights: a function of (run seed, cell id) only, or the spec's `model.init_from`
        weights (verified against the digest in the spec hash); bit-identical everywhere.

        Seeds the global generator inside fork_rng, so the caller's RNG state is unchanged."""
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(derive_seed("init", self.spec.run.seed, self.cell_id))
            model = build(self.config)
        if self.spec.model.init_from:  # start from the run's pretrained weights where they fit
            from bagel.models import initfrom

            initfrom.apply(self.spec, self.cell_id, model)
        return model

    def _select(self, heldout: bool) -> tuple[torch.Tensor, torch.Tensor]:
        from bagel.models import datashards

        fetched = datashards.installed(self.spec, self.cell_id)  # shards from the coordinator
        if fetched is not None:
            return (fetched.x_heldout, fetched.y_heldout) if heldout else (fetched.x_train, fetched.y_train)
        ds = load_dataset(self.spec)
        x, y = (ds.x_heldout, ds.y_heldout) if heldout else (ds.x_train, ds.y_train)
        labels = torch.from_numpy(ds.manifest.heldout_labels if heldout else ds.manifest.train_labels)
        if self.kind == "router":
            return x, labels.to(torch.int64)
        nc = self.spec.model.num_classes
        if nc > 0 and int(y.max()) >= nc:
            raise DataError(f"data has label {int(y.max())} but model.num_classes = {nc}")
        assert self.cluster is not None  # an expert's task (the router's returned above)
        idx = torch.nonzero(labels == self.cluster).flatten()
        return x[idx], y[idx]

    def train_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(images [N,C,H,W] in [-1,1], labels): experts get their cluster's images and class
        labels, the router gets every image and its cluster label."""
        return self._select(heldout=False)

    def heldout_data(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._select(heldout=True)

    def loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, generator: torch.Generator) -> torch.Tensor:
        """Training loss of one micro-batch; every random draw comes from `generator`."""
        c = self.spec.cells
        if self.kind == "router":
            return router_loss(model, x, y, generator, c.t_mean, c.t_std)
        nc = self.spec.model.num_classes
        return flow.rf_loss(
            model,
            x,
            y if nc > 0 else None,
            generator,
            t_range=self.train_range,
            t_mean=c.t_mean,
            t_std=c.t_std,
            label_dropout=LABEL_DROPOUT if nc > 0 else 0.0,
            null_label=nc,
        )

    @torch.no_grad()
    def eval_loss(self, model: nn.Module, x: torch.Tensor, y: torch.Tensor, seed: int = 0) -> float:
        """Mean loss over (x, y) with noise from a generator seeded by `seed` (no label
        dropout): the same model and data give the same number in any process."""
        if len(x) == 0:
            raise ValueError("eval_loss needs at least one sample")
        gen = torch.Generator().manual_seed(seed)
        c = self.spec.cells
        was_training = model.training
        model.eval()
        total = 0.0
        try:
            for i in range(0, len(x), EVAL_BATCH):
                xb, yb = x[i : i + EVAL_BATCH], y[i : i + EVAL_BATCH]
                if self.kind == "router":
                    batch = router_loss(model, xb, yb, gen, c.t_mean, c.t_std)
                else:
                    nc = self.spec.model.num_classes
                    batch = flow.rf_loss(
                        model,
                        xb,
                        yb if nc > 0 else None,
                        gen,
                        t_range=self.train_range,
                        t_mean=c.t_mean,
                        t_std=c.t_std,
                    )
                total += float(batch) * len(xb)
        finally:
            model.train(was_training)
        return total / len(x)

    def model_nbytes_estimate(self, micro_batch: int) -> int:
        """params + grads + AdamW + outer state + error feedback + activations, in bytes."""
        return cell_memory_bytes(self.spec, self.cell_id, micro_batch)


def router_loss(
    model: nn.Module,
    x: torch.Tensor,
    clusters: torch.Tensor,
    generator: torch.Generator,
    t_mean: float = 0.0,
    t_std: float = 1.0,
) -> torch.Tensor:
    """Cross-entropy of the router on x_t, t drawn from the run's logit-normal over [0, 1]."""
    t = flow.sample_t(x.shape[0], generator, 0.0, 1.0, t_mean, t_std)
    eps = torch.randn(x.shape, generator=generator, dtype=x.dtype).to(x.device)
    xt = flow.interpolate(x, eps, t.to(x.device))
    return F.cross_entropy(model(xt, t.to(x.device)), clusters.to(x.device))


def cell_task(spec: RunSpec, cell_id: str) -> CellTask:
    """The task of `cell_id` in `spec`; CellError if the run has no such cell."""
    parsed = _parse(spec, cell_id)
    cfg = cell_config(spec, cell_id)
    if parsed is None:
        return CellTask(spec, cell_id, "router", None, None, (0.0, 1.0), (0.0, 1.0), cfg)
    k, r = parsed
    c = spec.cells
    t_range = flow.timestep_ranges(c.timestep_ranges, c.t_mean, c.t_std)[r]
    return CellTask(spec, cell_id, "expert", k, r, t_range, flow.widen(t_range, c.overlap), cfg)
