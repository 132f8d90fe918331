"""DiLoCo outer step and the cell state it updates (weights + outer Nesterov momentum).

DiLoCo (Douillard et al., "DiLoCo: Distributed Low-Communication Training of Language
Models", 2023): every member runs H inner AdamW steps from the same global weights, the
pseudo-gradients delta = theta_global - theta_local are averaged across the group, and
the averaged delta is fed as a gradient to an outer SGD with Nesterov momentum
(lr 0.7, momentum 0.9 in the paper and in `spec.diloco`).

Bit-identity: every member applies the same averaged delta (the data plane makes it
bit-identical) to the same committed state, so the outer step must be a deterministic
function of those bits on any hardware. It runs on CPU in float32 and is written as
single elementwise IEEE operations (one multiply or one add per line, never
`add(..., alpha=)`, which a vectorised kernel may fuse into an FMA on one CPU and not
on another). It equals `torch.optim.SGD(lr, momentum, nesterov=True, dampening=0)`
step for step, up to rounding (the golden test checks both, to 1e-6).

The state is exchanged and hashed as one flat mapping `{"w.<param>": weight,
"m.<param>": momentum}` (`protocol/statehash.py`), plus `"ema.<param>"` when the run keeps
an exponential moving average of the committed weights for sampling (`[ema] decay`);
`to_safetensors` / `from_safetensors` serialise it without pickle.

The average is updated right after the outer step, from the new weights, by the same rule
(single IEEE operations, CPU, float32), so it is as bit-identical across members as the
weights themselves and a commit's quorum of equal hashes covers it too: a joiner that
downloads the committed state, a worker resuming from its local checkpoint and the
coordinator's checkpoints all hold the same average bytes. The per-round decay warms up as
min(decay, (1 + r) / (10 + r)) (TensorFlow's and timm's EMA warm-up, per round here).

The state's dtype (`[sync] state_dtype`): float32 by default; with "bf16" or "fp16" every
tensor of the committed state lives on that grid. A `CellState` holds its tensors in its
`dtype`, and a state is rounded onto it, round-to-nearest-even on the CPU (`to_state_dtype`),
only where committed state is made: the initial state of round 0 (`from_model`, also from
`[model] init_from` weights) and the end of every outer step, which computes in float32
from the exact upcast of the state and stores the new weights, momentum and average
rounded. Rounding is a function of the float32 bits alone, so the replicas stay
bit-identical, and the state file, the download, a catch-up's result, the checkpoints and
the hash are all over the same half-size bytes: a download is lossless. Training and the
pseudo-gradient use the exact float32 upcast (`load_into`, `pseudo_gradient`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, MutableMapping
from dataclasses import dataclass

import safetensors.torch
import torch

from bagel.models.experts import EMA_PREFIX, MOMENTUM_PREFIX, WEIGHT_PREFIX
from bagel.protocol.runspec import DilocoSection, EmaSection
from bagel.protocol.statehash import state_hash


class StateFormatError(ValueError):
    """A flat state mapping or safetensors blob is not a valid cell state."""


# `[sync] state_dtype` -> the dtype a committed state's tensors are held, hashed and sent in
STATE_DTYPES: dict[str, torch.dtype] = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def state_dtype(spec: object) -> torch.dtype:
    """The dtype of a run's committed state: its `[sync] state_dtype` (float32 for a spec
    without a `sync` section, as some test doubles are)."""
    return STATE_DTYPES[str(getattr(getattr(spec, "sync", None), "state_dtype", "fp32"))]


def dtype_name(dtype: torch.dtype) -> str:
    """How errors name a state dtype: "float32", "bfloat16" or "float16"."""
    return str(dtype).removeprefix("torch.")


def to_state_dtype(t: torch.Tensor, dtype: torch.dtype, what: str = "tensor") -> torch.Tensor:
    """A contiguous CPU copy of `t` in `dtype`: the one rounding onto a state's grid.

    The cast runs on the CPU (a CUDA tensor is copied over first, unchanged), where torch
    rounds float32 to bfloat16 and float16 to nearest, ties to even (bfloat16 by integer
    operations on the bits, float16 by the IEEE conversion), so the result is a function of
    the float32 bits alone on any machine; `tests/test_state_dtype.py` checks both against
    independent references. A value beyond float16's range would become infinite: refused."""
    src = t.detach().to("cpu")
    out = src.to(dtype).contiguous()
    if out.data_ptr() == src.data_ptr():
        out = out.clone()
    overflow = dtype == torch.float16 and src.dtype != torch.float16 and bool(torch.isinf(out).any())
    if overflow and not bool(torch.isinf(src).any()):
        raise StateFormatError(f"{what} has values beyond float16's range (65504): use bf16 or fp32")
    return out


@dataclass(frozen=True)
class OuterConfig:
    """Outer optimizer hyper-parameters (spec.diloco)."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    ema_decay: float = 0.0  # `[ema] decay`; 0: the state keeps no average

    @classmethod
    def from_spec(cls, diloco: DilocoSection, ema: EmaSection | None = None) -> OuterConfig:
        """Read outer_lr, outer_momentum and nesterov from a `DilocoSection`, the decay from `[ema]`."""
        return cls(
            lr=float(diloco.outer_lr),
            momentum=float(diloco.outer_momentum),
            nesterov=bool(getattr(diloco, "nesterov", True)),
            ema_decay=float(ema.decay) if ema is not None else 0.0,
        )


def ema_decay_at(decay: float, step: int) -> float:
    """The decay of the average's update at committed round `step` (>= 1): warmed up, capped at `decay`."""
    return min(decay, (1.0 + step) / (10.0 + step))


class CellState:
    """A cell's committed state: CPU weights, outer momentum and optionally the average of the
    committed weights (`ema`, None when the run keeps none), by parameter name, every tensor
    in `dtype` (float32, or the run's bfloat16 / float16 grid: `state_dtype`).

    Given tensors are copied and rounded onto `dtype` (`to_state_dtype`); a state's own
    tensors (`clone`) are copied unchanged."""

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor],
        momentum: Mapping[str, torch.Tensor] | None = None,
        ema: Mapping[str, torch.Tensor] | None = None,
        *,
        dtype: torch.dtype = torch.float32,
    ):
        if dtype not in STATE_DTYPES.values():
            raise StateFormatError(f"a state is float32, bfloat16 or float16, not {dtype_name(dtype)}")
        self.dtype = dtype
        self.weights: dict[str, torch.Tensor] = {}
        for name in sorted(weights):
            t = weights[name]
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise StateFormatError(f"weight {name!r} is not a floating-point tensor")
            self.weights[name] = to_state_dtype(t, dtype, f"weight {name!r}")
        if momentum is None:
            self.momentum = {n: torch.zeros_like(t) for n, t in self.weights.items()}
        else:
            self.momentum = self._like_weights(momentum, "momentum")
        self.ema: dict[str, torch.Tensor] | None = None if ema is None else self._like_weights(ema, "ema")

    def _like_weights(self, tensors: Mapping[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
        """CPU copies of `tensors` in the state's dtype, which must have exactly the weights' names and shapes."""
        if set(tensors) != set(self.weights):
            raise StateFormatError(f"{what} names differ from weight names: {sorted(set(tensors) ^ set(self.weights))}")
        out: dict[str, torch.Tensor] = {}
        for name, w in self.weights.items():
            m = tensors[name]
            if not isinstance(m, torch.Tensor) or tuple(m.shape) != tuple(w.shape):
                raise StateFormatError(f"{what} {name!r} does not match its weight's shape {tuple(w.shape)}")
            if not m.is_floating_point():
                raise StateFormatError(f"{what} {name!r} is not a floating-point tensor")
            out[name] = to_state_dtype(m, self.dtype, f"{what} {name!r}")
        return out

    @classmethod
    def from_model(cls, model: torch.nn.Module, *, ema: bool = False, dtype: torch.dtype = torch.float32) -> CellState:
        """Initial state of a freshly built model: its trainable parameters rounded onto
        `dtype`, zero momentum, and with `ema` an average that starts at the (rounded) weights."""
        weights = {n: p for n, p in model.named_parameters() if p.requires_grad}
        return cls(weights, None, weights if ema else None, dtype=dtype)

    def clone(self) -> CellState:
        return CellState(self.weights, self.momentum, self.ema, dtype=self.dtype)

    @property
    def sampling_weights(self) -> dict[str, torch.Tensor]:
        """The weights to sample from: the average when the state keeps one, else the weights."""
        return self.ema if self.ema is not None else self.weights

    def to_flat(self) -> dict[str, torch.Tensor]:
        """The hashed/serialised form: {"w.<name>": weight, "m.<name>": momentum[, "ema.<name>": average]}."""
        flat = {WEIGHT_PREFIX + n: t for n, t in self.weights.items()}
        flat.update({MOMENTUM_PREFIX + n: t for n, t in self.momentum.items()})
        if self.ema is not None:
            flat.update({EMA_PREFIX + n: t for n, t in self.ema.items()})
        return flat

    @classmethod
    def from_flat(cls, flat: Mapping[str, torch.Tensor], *, dtype: torch.dtype = torch.float32) -> CellState:
        """The state of a flat mapping (`to_flat`'s form) whose every tensor is exactly `dtype`,
        the run's state dtype: a tensor of another dtype is refused, never cast."""
        weights: dict[str, torch.Tensor] = {}
        momentum: dict[str, torch.Tensor] = {}
        ema: dict[str, torch.Tensor] = {}
        for key, t in flat.items():
            if key.startswith(WEIGHT_PREFIX) and len(key) > len(WEIGHT_PREFIX):
                weights[key[len(WEIGHT_PREFIX) :]] = t
            elif key.startswith(MOMENTUM_PREFIX) and len(key) > len(MOMENTUM_PREFIX):
                momentum[key[len(MOMENTUM_PREFIX) :]] = t
            elif key.startswith(EMA_PREFIX) and len(key) > len(EMA_PREFIX):
                ema[key[len(EMA_PREFIX) :]] = t
            else:
                raise StateFormatError(f"state key {key!r} is neither 'w.<name>', 'm.<name>' nor 'ema.<name>'")
            if not isinstance(t, torch.Tensor) or t.dtype != dtype:
                got = dtype_name(t.dtype) if isinstance(t, torch.Tensor) else type(t).__name__
                raise StateFormatError(
                    f"state tensor {key!r} is {got}, expected {dtype_name(dtype)} (the run's [sync] state_dtype)"
                )
        if not weights:
            raise StateFormatError("state holds no weights")
        return cls(weights, momentum, ema or None, dtype=dtype)

    def state_hash(self) -> str:
        return state_hash(self.to_flat())

    def to_safetensors(self) -> bytes:
        return safetensors.torch.save(self.to_flat())

    @classmethod
    def from_safetensors(cls, data: bytes, *, dtype: torch.dtype = torch.float32) -> CellState:
        """Parse a safetensors blob (no pickle is involved) into a validated state of `dtype`."""
        try:
            flat = safetensors.torch.load(data)
        except Exception as e:  # safetensors raises its own SafetensorError on a bad header
            raise StateFormatError(f"not a valid safetensors file: {e}") from e
        return cls.from_flat(flat, dtype=dtype)

    def load_into(self, model: torch.nn.Module, *, sampling: bool = False) -> None:
        """Copy the weights (with `sampling`, `sampling_weights`) into model's parameters (any
        device/dtype; a half-precision state is upcast exactly into float32 parameters);
        names must match exactly."""
        source = self.sampling_weights if sampling else self.weights
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if set(params) != set(source):
            raise StateFormatError(f"model parameters differ from the state: {sorted(set(params) ^ set(source))}")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(source[name])

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.to_flat().values())


def pseudo_gradient(
    global_weights: Mapping[str, torch.Tensor], local: Mapping[str, torch.Tensor] | Iterable
) -> dict[str, torch.Tensor]:
    """delta = theta_global - theta_local, float32 on CPU, by name.

    `local` is a name -> tensor mapping or a model's `named_parameters()`; `global_weights`
    may be a half-precision state's, taken at its exact float32 value.
    """
    local_map = dict(local.items() if isinstance(local, Mapping) else local)
    if set(local_map) - set(global_weights):
        raise StateFormatError(f"local parameters not in the state: {sorted(set(local_map) - set(global_weights))}")
    missing = set(global_weights) - set(local_map)
    if missing:
        raise StateFormatError(f"local parameters missing: {sorted(missing)}")
    out: dict[str, torch.Tensor] = {}
    for name in sorted(global_weights):
        g = global_weights[name]
        theta = local_map[name].detach().to("cpu", torch.float32)
        if tuple(theta.shape) != tuple(g.shape):
            raise StateFormatError(f"{name!r}: local shape {tuple(theta.shape)} != global {tuple(g.shape)}")
        out[name] = g.to(torch.float32) - theta
    return out


def outer_step(state: CellState, avg_delta: Mapping[str, torch.Tensor], cfg: OuterConfig, ema_step: int = 1) -> None:
    """Apply one outer SGD(+Nesterov) step in place with the averaged pseudo-gradient as gradient.

    buf <- mu * buf + g;  update <- g + mu * buf (Nesterov) or buf;  w <- w - lr * update.
    Then, when the state keeps an average: ema <- d * ema + (1 - d) * w, with
    d = `ema_decay_at(cfg.ema_decay, ema_step)` (the round being committed).

    Always computed in float32: a float32 state's tensors are updated in place; a bfloat16 /
    float16 state is taken at its exact float32 value and the new momentum, weights and
    average are stored rounded onto its grid (`to_state_dtype`), the average from the
    rounded new weights, so the result is the committed state itself.
    """
    if (state.ema is not None) != (cfg.ema_decay > 0):
        raise StateFormatError(
            "the state keeps an average of the weights but the run has none"
            if state.ema is not None
            else "the run keeps an average of the weights (ema.decay > 0) but the state has none"
        )
    if ema_step < 1:
        raise ValueError(f"ema_step must be at least 1, got {ema_step}")
    if set(avg_delta) != set(state.weights):
        raise StateFormatError(f"delta names differ from the state: {sorted(set(avg_delta) ^ set(state.weights))}")
    on_grid = state.dtype != torch.float32
    for name in sorted(state.weights):
        g = avg_delta[name]
        if g.dtype != torch.float32 or g.device.type != "cpu" or tuple(g.shape) != tuple(state.weights[name].shape):
            raise StateFormatError(
                f"{name!r}: delta must be a float32 CPU tensor of shape {tuple(state.weights[name].shape)}"
            )
        # float32 tensors: a float32 state's own (`.to` returns them), or exact upcasts
        buf = state.momentum[name].to(torch.float32)
        w = state.weights[name].to(torch.float32)
        buf.mul_(cfg.momentum)
        buf.add_(g)
        if cfg.nesterov:
            update = buf * cfg.momentum
            update.add_(g)
        else:
            update = buf.clone()
        update.mul_(cfg.lr)
        w.sub_(update)
        if on_grid:
            state.momentum[name] = to_state_dtype(buf, state.dtype, f"momentum {name!r}")
            state.weights[name] = to_state_dtype(w, state.dtype, f"weight {name!r}")
    if state.ema is not None:
        update_ema(state.ema, state.weights, ema_decay_at(cfg.ema_decay, ema_step))


def update_ema(ema: MutableMapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor], decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * weights, in place, name by name in sorted order.

    One multiply and one add per line, never `lerp_` or `add(..., alpha=)` (a kernel may fuse
    those into an FMA on one CPU and not on another), so the bytes are a function of the
    inputs' bytes and `decay` alone on any machine. In float32: a half-precision average is
    computed from the exact upcasts and stored back rounded onto its own dtype."""
    keep = float(decay)
    take = 1.0 - keep
    for name in sorted(weights):
        held = ema[name]
        e = held.to(torch.float32)
        e.mul_(keep)
        part = weights[name].to(torch.float32) * take
        e.add_(part)
        if held.dtype != torch.float32:
            ema[name] = to_state_dtype(e, held.dtype, f"average {name!r}")
