"""Model checkpoints: safetensors weights plus a JSON config. No pickle anywhere.

`save(path, model)` writes `<path>.safetensors` (the state dict) and `<path>.json` (the
architecture name, its config dataclass as plain fields, the sha256 of the weights file and
free-form metadata), each atomically: a temp file in the same directory, fsync, os.replace,
then fsync of the directory. `load(path)` rebuilds the model from the
JSON, checks the sha256, and loads the tensors with safetensors, which cannot execute code.
A round trip is bit-exact.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from pathlib import Path
from typing import Any

from safetensors.torch import load as st_load
from safetensors.torch import save as st_save
from torch import nn

from bagel.models import dit, router, unet
from bagel.protocol.atomicfile import atomic_write

FORMAT = "bagel-model/1"
_ARCHS: dict[str, type] = {"dit": dit.DiTConfig, "unet": unet.UNetConfig, "router": router.RouterConfig}
_BUILD = {"dit": dit.DiT, "unet": unet.UNet, "router": router.Router}


class ModelCheckpointError(ValueError):
    """A checkpoint is missing, corrupt or describes an unknown model."""


def _arch_of(model: nn.Module) -> tuple[str, Any]:
    for name, cls in _BUILD.items():
        if isinstance(model, cls):
            return name, model.cfg
    raise ModelCheckpointError(f"cannot checkpoint a {type(model).__name__}: not a DiT, UNet or Router")


_atomic_write = atomic_write


def paths(path: str | Path) -> tuple[Path, Path]:
    p = Path(path)
    stem = p.with_suffix("") if p.suffix in (".safetensors", ".json") else p
    return stem.with_name(stem.name + ".safetensors"), stem.with_name(stem.name + ".json")


def save(path: str | Path, model: nn.Module, metadata: dict[str, Any] | None = None) -> tuple[Path, Path]:
    """Write the weights and the JSON config; returns their paths. The weights go first, so a
    JSON file always describes a complete weights file."""
    arch, cfg = _arch_of(model)
    weights_path, json_path = paths(path)
    state = {k: v.detach().contiguous().cpu() for k, v in model.state_dict().items()}
    blob = st_save(state)
    _atomic_write(weights_path, blob)
    meta = {
        "format": FORMAT,
        "arch": arch,
        "config": dataclasses.asdict(cfg),
        "weights": weights_path.name,
        "sha256": hashlib.sha256(blob).hexdigest(),
        "metadata": metadata or {},
    }
    _atomic_write(json_path, json.dumps(meta, indent=2, sort_keys=True).encode())
    return weights_path, json_path


def config_from_json(arch: str, fields: dict[str, Any]) -> Any:
    if arch not in _ARCHS:
        raise ModelCheckpointError(f"unknown arch {arch!r}; known: {sorted(_ARCHS)}")
    cls = _ARCHS[arch]
    names = {f.name for f in dataclasses.fields(cls)}
    if set(fields) != names:
        raise ModelCheckpointError(f"{arch} config fields {sorted(fields)} do not match {sorted(names)}")
    fields = {k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()}
    try:
        return cls(**fields)
    except (TypeError, ValueError) as e:
        raise ModelCheckpointError(f"invalid {arch} config: {e}") from None


def load(path: str | Path) -> tuple[nn.Module, dict[str, Any]]:
    """(model in eval mode, the JSON document). ModelCheckpointError on any mismatch."""
    weights_path, json_path = paths(path)
    try:
        meta = json.loads(json_path.read_text())
        blob = weights_path.read_bytes()
    except FileNotFoundError as e:
        raise ModelCheckpointError(f"missing checkpoint file {e.filename}") from None
    except json.JSONDecodeError as e:
        raise ModelCheckpointError(f"{json_path}: not JSON: {e}") from None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise ModelCheckpointError(f"{json_path}: not a {FORMAT} checkpoint")
    if hashlib.sha256(blob).hexdigest() != meta.get("sha256"):
        raise ModelCheckpointError(f"{weights_path}: sha256 does not match {json_path.name}")
    cfg = config_from_json(str(meta.get("arch")), dict(meta.get("config") or {}))
    model = _BUILD[meta["arch"]](cfg)
    try:
        state = st_load(blob)
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types for corrupt headers
        raise ModelCheckpointError(f"{weights_path}: unreadable safetensors: {e}") from None
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise ModelCheckpointError(f"{weights_path}: weights do not fit the config: {e}") from None
    return model.eval(), meta
