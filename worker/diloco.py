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
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import safetensors.torch
import torch

from bagel.models.experts import EMA_PREFIX, MOMENTUM_PREFIX, WEIGHT_PREFIX
from bagel.protocol.runspec import DilocoSection, EmaSection
from bagel.protocol.statehash import state_hash


class StateFormatError(ValueError):
    """A flat state mapping or safetensors blob is not a valid cell state."""


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
    """A cell's committed state: float32 CPU weights, outer momentum and optionally the
    average of the committed weights (`ema`, None when the run keeps none), by parameter name."""

    def __init__(
        self,
        weights: Mapping[str, torch.Tensor],
        momentum: Mapping[str, torch.Tensor] | None = None,
        ema: Mapping[str, torch.Tensor] | None = None,
    ):
        self.weights: dict[str, torch.Tensor] = {}
        for name in sorted(weights):
            t = weights[name]
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise StateFormatError(f"weight {name!r} is not a floating-point tensor")
            self.weights[name] = t.detach().to("cpu", torch.float32).clone().contiguous()
        if momentum is None:
            self.momentum = {n: torch.zeros_like(t) for n, t in self.weights.items()}
        else:
            self.momentum = self._like_weights(momentum, "momentum")
        self.ema: dict[str, torch.Tensor] | None = None if ema is None else self._like_weights(ema, "ema")

    def _like_weights(self, tensors: Mapping[str, torch.Tensor], what: str) -> dict[str, torch.Tensor]:
        """Float32 CPU copies of `tensors`, which must have exactly the weights' names and shapes."""
        if set(tensors) != set(self.weights):
            raise StateFormatError(f"{what} names differ from weight names: {sorted(set(tensors) ^ set(self.weights))}")
        out: dict[str, torch.Tensor] = {}
        for name, w in self.weights.items():
            m = tensors[name]
            if not isinstance(m, torch.Tensor) or tuple(m.shape) != tuple(w.shape):
                raise StateFormatError(f"{what} {name!r} does not match its weight's shape {tuple(w.shape)}")
            out[name] = m.detach().to("cpu", torch.float32).clone().contiguous()
        return out

    @classmethod
    def from_model(cls, model: torch.nn.Module, *, ema: bool = False) -> CellState:
        """Initial state of a freshly built model: its trainable parameters, zero momentum, and
        with `ema` an average that starts at the weights."""
        weights = {n: p for n, p in model.named_parameters() if p.requires_grad}
        return cls(weights, None, weights if ema else None)

    def clone(self) -> CellState:
        return CellState(self.weights, self.momentum, self.ema)

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
    def from_flat(cls, flat: Mapping[str, torch.Tensor]) -> CellState:
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
            if t.dtype != torch.float32:
                raise StateFormatError(f"state tensor {key!r} is {t.dtype}, expected float32")
        if not weights:
            raise StateFormatError("state holds no weights")
        return cls(weights, momentum, ema or None)

    def state_hash(self) -> str:
        return state_hash(self.to_flat())

    def to_safetensors(self) -> bytes:
        return safetensors.torch.save(self.to_flat())

    @classmethod
    def from_safetensors(cls, data: bytes) -> CellState:
        """Parse a safetensors blob (no pickle is involved) into a validated state."""
        try:
            flat = safetensors.torch.load(data)
        except Exception as e:  # safetensors raises its own SafetensorError on a bad header
            raise StateFormatError(f"not a valid safetensors file: {e}") from e
        return cls.from_flat(flat)

    def load_into(self, model: torch.nn.Module, *, sampling: bool = False) -> None:
        """Copy the weights (with `sampling`, `sampling_weights`) into model's parameters (any
        device/dtype); names must match exactly."""
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

    `local` is a name -> tensor mapping or a model's `named_parameters()`.
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
        out[name] = g - theta
    return out


def outer_step(state: CellState, avg_delta: Mapping[str, torch.Tensor], cfg: OuterConfig, ema_step: int = 1) -> None:
    """Apply one outer SGD(+Nesterov) step in place with the averaged pseudo-gradient as gradient.

    buf <- mu * buf + g;  update <- g + mu * buf (Nesterov) or buf;  w <- w - lr * update.
    Then, when the state keeps an average: ema <- d * ema + (1 - d) * w, with
    d = `ema_decay_at(cfg.ema_decay, ema_step)` (the round being committed).
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
    for name in sorted(state.weights):
        g = avg_delta[name]
        if g.dtype != torch.float32 or g.device.type != "cpu" or tuple(g.shape) != tuple(state.weights[name].shape):
            raise StateFormatError(
                f"{name!r}: delta must be a float32 CPU tensor of shape {tuple(state.weights[name].shape)}"
            )
        buf = state.momentum[name]
        buf.mul_(cfg.momentum)
        buf.add_(g)
        if cfg.nesterov:
            update = buf * cfg.momentum
            update.add_(g)
        else:
            update = buf.clone()
        update.mul_(cfg.lr)
        state.weights[name].sub_(update)
    if state.ema is not None:
        update_ema(state.ema, state.weights, ema_decay_at(cfg.ema_decay, ema_step))


def update_ema(ema: Mapping[str, torch.Tensor], weights: Mapping[str, torch.Tensor], decay: float) -> None:
    """ema <- decay * ema + (1 - decay) * weights, in place, name by name in sorted order.

    One multiply and one add per line, never `lerp_` or `add(..., alpha=)` (a kernel may fuse
    those into an FMA on one CPU and not on another), so the bytes are a function of the
    inputs' bytes and `decay` alone on any machine."""
    keep = float(decay)
    take = 1.0 - keep
    for name in sorted(weights):
        e = ema[name]
        e.mul_(keep)
        part = weights[name] * take
        e.add_(part)
