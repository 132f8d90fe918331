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
"m.<param>": momentum}` (`protocol/statehash.py`); `to_safetensors` / `from_safetensors`
serialise it without pickle.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import safetensors.torch
import torch

from bagel.models.experts import MOMENTUM_PREFIX, WEIGHT_PREFIX
from bagel.protocol.runspec import DilocoSection
from bagel.protocol.statehash import state_hash


class StateFormatError(ValueError):
    """A flat state mapping or safetensors blob is not a valid cell state."""


@dataclass(frozen=True)
class OuterConfig:
    """Outer optimizer hyper-parameters (spec.diloco)."""

    lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True

    @classmethod
    def from_spec(cls, diloco: DilocoSection) -> OuterConfig:
        """Read outer_lr, outer_momentum and nesterov from a `DilocoSection`."""
        return cls(
            lr=float(diloco.outer_lr),
            momentum=float(diloco.outer_momentum),
            nesterov=bool(getattr(diloco, "nesterov", True)),
        )


class CellState:
    """A cell's committed state: float32 CPU weights and outer momentum, by parameter name."""

    def __init__(self, weights: Mapping[str, torch.Tensor], momentum: Mapping[str, torch.Tensor] | None = None):
        self.weights: dict[str, torch.Tensor] = {}
        for name in sorted(weights):
            t = weights[name]
            if not isinstance(t, torch.Tensor) or not t.is_floating_point():
                raise StateFormatError(f"weight {name!r} is not a floating-point tensor")
            self.weights[name] = t.detach().to("cpu", torch.float32).clone().contiguous()
        if momentum is None:
            self.momentum = {n: torch.zeros_like(t) for n, t in self.weights.items()}
        else:
            if set(momentum) != set(self.weights):
                raise StateFormatError(
                    f"momentum names differ from weight names: {sorted(set(momentum) ^ set(self.weights))}"
                )
            self.momentum = {}
            for name, w in self.weights.items():
                m = momentum[name]
                if not isinstance(m, torch.Tensor) or tuple(m.shape) != tuple(w.shape):
                    raise StateFormatError(f"momentum {name!r} does not match its weight's shape {tuple(w.shape)}")
                self.momentum[name] = m.detach().to("cpu", torch.float32).clone().contiguous()

    @classmethod
    def from_model(cls, model: torch.nn.Module) -> CellState:
        """Initial state of a freshly built model: its trainable parameters, zero momentum."""
        return cls({n: p for n, p in model.named_parameters() if p.requires_grad})

    def clone(self) -> CellState:
        return CellState(self.weights, self.momentum)

    def to_flat(self) -> dict[str, torch.Tensor]:
        """The hashed/serialised form: {"w.<name>": weight, "m.<name>": momentum}."""
        flat = {WEIGHT_PREFIX + n: t for n, t in self.weights.items()}
        flat.update({MOMENTUM_PREFIX + n: t for n, t in self.momentum.items()})
        return flat

    @classmethod
    def from_flat(cls, flat: Mapping[str, torch.Tensor]) -> CellState:
        weights: dict[str, torch.Tensor] = {}
        momentum: dict[str, torch.Tensor] = {}
        for key, t in flat.items():
            if key.startswith(WEIGHT_PREFIX) and len(key) > len(WEIGHT_PREFIX):
                weights[key[len(WEIGHT_PREFIX) :]] = t
            elif key.startswith(MOMENTUM_PREFIX) and len(key) > len(MOMENTUM_PREFIX):
                momentum[key[len(MOMENTUM_PREFIX) :]] = t
            else:
                raise StateFormatError(f"state key {key!r} is neither 'w.<name>' nor 'm.<name>'")
            if t.dtype != torch.float32:
                raise StateFormatError(f"state tensor {key!r} is {t.dtype}, expected float32")
        if not weights:
            raise StateFormatError("state holds no weights")
        return cls(weights, momentum)

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

    def load_into(self, model: torch.nn.Module) -> None:
        """Copy the weights into model's parameters (any device/dtype); names must match exactly."""
        params = {n: p for n, p in model.named_parameters() if p.requires_grad}
        if set(params) != set(self.weights):
            raise StateFormatError(f"model parameters differ from the state: {sorted(set(params) ^ set(self.weights))}")
        with torch.no_grad():
            for name, p in params.items():
                p.copy_(self.weights[name])

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


def outer_step(state: CellState, avg_delta: Mapping[str, torch.Tensor], cfg: OuterConfig) -> None:
    """Apply one outer SGD(+Nesterov) step in place with the averaged pseudo-gradient as gradient.

    buf <- mu * buf + g;  update <- g + mu * buf (Nesterov) or buf;  w <- w - lr * update.
    """
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
