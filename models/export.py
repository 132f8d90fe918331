"""Exported models: a run's committed weights as self-describing safetensors or diffusers folders.

Two layouts, both without the outer optimizer's momentum:

- `safetensors`: `<cell>.safetensors` per cell, its `__metadata__` naming the format, the
  architecture and its config (JSON), the cell, run, round and state hash, so the file
  alone rebuilds the model; and `composition.json` (below).
- `diffusers`: one folder per cell (`config.json` + `diffusion_pytorch_model.safetensors`),
  `model_index.json` naming each folder's class, and `composition.json`;
  `models/pipeline.py`'s `BagelPipeline` composes them. A DiT expert maps onto diffusers'
  `DiTTransformer2DModel` (adaLN-Zero, the same block): `dit_to_diffusers` renames and
  splits the tensors (fused qkv -> to_q/to_k/to_v; the shared timestep and label
  embedders are copied into every block's `norm1.emb`, as diffusers keeps one per block;
  the final adaLN -> proj_out_1, the output linear -> proj_out_2). Two things of Bagel's
  DiT have no switch in that class: its timestep features use frequencies
  10000^(-i/128) where diffusers' DiT uses downscale_freq_shift=1 (10000^(-i/127)), and
  its 2-D position embedding puts the row axis first; so the folder's class is
  `BagelDiTTransformer2DModel`, a subclass that changes exactly those two fixed
  (parameter-free) parts. The U-Net (`models/unet.py`) and the router have no diffusers
  class with their layout; each is exported as `BagelNativeModel`, a diffusers
  `ModelMixin` around Bagel's own module (config.json holds the architecture and config).

`composition.json` holds what composing the cells needs beyond their weights: timestep
ranges, clusters, the cluster prior p(k) and p(y | k) from the cluster manifest, the null
label, and which folder or file is which cell.

No diffusers import here (export needs none); `read_weights` reads either layout back
for `[model] init_from`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save as st_save

from bagel.models import dit, router, unet
from bagel.protocol.atomicfile import atomic_write

SAFETENSORS_FORMAT = "bagel-export/1"
DIFFUSERS_WEIGHTS = "diffusion_pytorch_model.safetensors"
COMPOSITION = "composition.json"
MODEL_INDEX = "model_index.json"
PIPELINE_MODULE = "bagel.models.pipeline"
DIT_CLASS = "BagelDiTTransformer2DModel"
NATIVE_CLASS = "BagelNativeModel"
DIFFUSERS_VERSION = "0.42.1"  # written into config.json: the diffusers release this mapping was checked with

ARCH_OF = {dit.DiTConfig: "dit", unet.UNetConfig: "unet", router.RouterConfig: "router"}
CONFIG_OF = {v: k for k, v in ARCH_OF.items()}


class ExportError(ValueError):
    """An export cannot be written or read back (unknown layout, a tensor that does not fit)."""


def arch_of(cfg: Any) -> str:
    try:
        return ARCH_OF[type(cfg)]
    except KeyError:
        raise ExportError(f"no export for a {type(cfg).__name__}") from None


def config_from_fields(arch: str, fields: Mapping[str, Any]) -> Any:
    """A model config from its plain fields (JSON), ExportError on anything that does not fit."""
    cls = CONFIG_OF.get(arch)
    if cls is None:
        raise ExportError(f"unknown architecture {arch!r}; known: {sorted(CONFIG_OF)}")
    names = {f.name for f in dataclasses.fields(cls)}
    if set(fields) != names:
        raise ExportError(f"{arch} config fields {sorted(fields)} do not match {sorted(names)}")
    try:
        return cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    except (TypeError, ValueError) as e:
        raise ExportError(f"invalid {arch} config: {e}") from None


def describe(cfg: Any, **extra: str) -> dict[str, str]:
    """safetensors `__metadata__` (string to string) that makes a weights file self-describing."""
    return {
        "format": SAFETENSORS_FORMAT,
        "arch": arch_of(cfg),
        "config": json.dumps(dataclasses.asdict(cfg), sort_keys=True),
        **extra,
    }


# ---------------------------------------------------------------------------- DiT <-> diffusers


def dit_maps_to_diffusers(cfg: dit.DiTConfig) -> bool:
    """diffusers' DiT block has a fixed 4x MLP; other ratios have no mapping."""
    return cfg.mlp_ratio == 4.0 and cfg.mlp_hidden == 4 * cfg.hidden


def dit_diffusers_config(cfg: dit.DiTConfig) -> dict[str, Any]:
    return {
        "_class_name": DIT_CLASS,
        "_diffusers_version": DIFFUSERS_VERSION,
        "num_attention_heads": cfg.heads,
        "attention_head_dim": cfg.hidden // cfg.heads,
        "in_channels": cfg.channels,
        "out_channels": cfg.channels,
        "num_layers": cfg.depth,
        "dropout": 0.0,
        "norm_num_groups": 32,
        "attention_bias": True,
        "sample_size": cfg.image_size,
        "patch_size": cfg.patch,
        "activation_fn": "gelu-approximate",
        # the label table: num_classes rows plus the CFG null row (diffusers adds it when
        # class dropout is on, as in its DiT); an unconditional DiT gets a single zero row
        "num_embeds_ada_norm": cfg.num_classes,
        "upcast_attention": False,
        "norm_type": "ada_norm_zero",
        "norm_elementwise_affine": False,
        "norm_eps": 1e-6,
    }


def dit_to_diffusers(cfg: dit.DiTConfig, w: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Bagel DiT weights -> `BagelDiTTransformer2DModel` (diffusers DiT names)."""
    if not dit_maps_to_diffusers(cfg):
        raise ExportError(f"a DiT with mlp_ratio {cfg.mlp_ratio} has no diffusers DiT layout")
    d = cfg.hidden
    out: dict[str, torch.Tensor] = {
        "pos_embed.proj.weight": w["x_embed.weight"],
        "pos_embed.proj.bias": w["x_embed.bias"],
        "proj_out_1.weight": w["final.ada.1.weight"],
        "proj_out_1.bias": w["final.ada.1.bias"],
        "proj_out_2.weight": w["final.linear.weight"],
        "proj_out_2.bias": w["final.linear.bias"],
    }
    labels = w["y_embed.weight"] if cfg.num_classes > 0 else torch.zeros(1, d)
    for i in range(cfg.depth):
        b, o = f"blocks.{i}.", f"transformer_blocks.{i}."
        emb = o + "norm1.emb."
        out[emb + "timestep_embedder.linear_1.weight"] = w["t_embed.mlp.0.weight"]
        out[emb + "timestep_embedder.linear_1.bias"] = w["t_embed.mlp.0.bias"]
        out[emb + "timestep_embedder.linear_2.weight"] = w["t_embed.mlp.2.weight"]
        out[emb + "timestep_embedder.linear_2.bias"] = w["t_embed.mlp.2.bias"]
        out[emb + "class_embedder.embedding_table.weight"] = labels
        out[o + "norm1.linear.weight"] = w[b + "ada.1.weight"]
        out[o + "norm1.linear.bias"] = w[b + "ada.1.bias"]
        qw, kw, vw = w[b + "attn.qkv.weight"].split(d, dim=0)
        qb, kb, vb = w[b + "attn.qkv.bias"].split(d, dim=0)
        for name, wt, bs in (("to_q", qw, qb), ("to_k", kw, kb), ("to_v", vw, vb)):
            out[o + f"attn1.{name}.weight"], out[o + f"attn1.{name}.bias"] = wt, bs
        out[o + "attn1.to_out.0.weight"] = w[b + "attn.proj.weight"]
        out[o + "attn1.to_out.0.bias"] = w[b + "attn.proj.bias"]
        out[o + "ff.net.0.proj.weight"] = w[b + "mlp.0.weight"]
        out[o + "ff.net.0.proj.bias"] = w[b + "mlp.0.bias"]
        out[o + "ff.net.2.weight"] = w[b + "mlp.2.weight"]
        out[o + "ff.net.2.bias"] = w[b + "mlp.2.bias"]
    return {k: v.detach().contiguous().clone() for k, v in out.items()}


def dit_from_diffusers(config: Mapping[str, Any], t: Mapping[str, torch.Tensor]) -> tuple[dit.DiTConfig, dict]:
    """The inverse of `dit_to_diffusers` (block 0's embedders are the shared ones)."""
    try:
        heads, hd = int(config["num_attention_heads"]), int(config["attention_head_dim"])
        nc = int(config["num_embeds_ada_norm"])
        cfg = dit.DiTConfig(
            image_size=int(config["sample_size"]),
            channels=int(config["in_channels"]),
            patch=int(config["patch_size"]),
            hidden=heads * hd,
            depth=int(config["num_layers"]),
            heads=heads,
            mlp_ratio=4.0,
            num_classes=nc,
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ExportError(f"not a {DIT_CLASS} config: {e}") from None
    emb = "transformer_blocks.0.norm1.emb."
    try:
        w: dict[str, torch.Tensor] = {
            "x_embed.weight": t["pos_embed.proj.weight"],
            "x_embed.bias": t["pos_embed.proj.bias"],
            "t_embed.mlp.0.weight": t[emb + "timestep_embedder.linear_1.weight"],
            "t_embed.mlp.0.bias": t[emb + "timestep_embedder.linear_1.bias"],
            "t_embed.mlp.2.weight": t[emb + "timestep_embedder.linear_2.weight"],
            "t_embed.mlp.2.bias": t[emb + "timestep_embedder.linear_2.bias"],
            "final.ada.1.weight": t["proj_out_1.weight"],
            "final.ada.1.bias": t["proj_out_1.bias"],
            "final.linear.weight": t["proj_out_2.weight"],
            "final.linear.bias": t["proj_out_2.bias"],
        }
        if nc > 0:
            w["y_embed.weight"] = t[emb + "class_embedder.embedding_table.weight"]
        for i in range(cfg.depth):
            b, o = f"blocks.{i}.", f"transformer_blocks.{i}."
            w[b + "ada.1.weight"] = t[o + "norm1.linear.weight"]
            w[b + "ada.1.bias"] = t[o + "norm1.linear.bias"]
            w[b + "attn.qkv.weight"] = torch.cat([t[o + f"attn1.to_{n}.weight"] for n in "qkv"])
            w[b + "attn.qkv.bias"] = torch.cat([t[o + f"attn1.to_{n}.bias"] for n in "qkv"])
            w[b + "attn.proj.weight"] = t[o + "attn1.to_out.0.weight"]
            w[b + "attn.proj.bias"] = t[o + "attn1.to_out.0.bias"]
            w[b + "mlp.0.weight"] = t[o + "ff.net.0.proj.weight"]
            w[b + "mlp.0.bias"] = t[o + "ff.net.0.proj.bias"]
            w[b + "mlp.2.weight"] = t[o + "ff.net.2.weight"]
            w[b + "mlp.2.bias"] = t[o + "ff.net.2.bias"]
    except KeyError as e:
        raise ExportError(f"diffusers DiT weights lack tensor {e.args[0]!r}") from None
    return cfg, w


# ---------------------------------------------------------------------------- writing


def component_name(cell_id: str) -> str:
    """The folder (and pipeline component) name of a cell: dots are not attribute-safe."""
    return cell_id.replace(".", "_")


def _write_safetensors(path: Path, tensors: Mapping[str, torch.Tensor], meta: dict[str, str] | None) -> str:
    blob = st_save({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, metadata=meta)
    atomic_write(path, blob)
    return hashlib.sha256(blob).hexdigest()


def write_export(
    out: Path,
    fmt: str,
    cells: Mapping[str, tuple[Any, Mapping[str, torch.Tensor], dict[str, str]]],
    composition: dict[str, Any],
) -> dict[str, Any]:
    """Write {cell: (config, weights, provenance)} in layout `fmt`; returns composition.json's content."""
    if fmt not in ("safetensors", "diffusers"):
        raise ExportError(f"unknown export format {fmt!r}; known: safetensors, diffusers")
    out.mkdir(parents=True, exist_ok=True)
    files: dict[str, dict[str, Any]] = {}
    index: dict[str, Any] = {"_class_name": "BagelPipeline", "_diffusers_version": DIFFUSERS_VERSION}
    for cell_id, (cfg, weights, prov) in sorted(cells.items()):
        meta = describe(cfg, cell_id=cell_id, **prov)
        if fmt == "safetensors":
            name = f"{cell_id}.safetensors"
            files[cell_id] = {"path": name, "sha256": _write_safetensors(out / name, weights, meta)}
            continue
        comp = component_name(cell_id)
        folder = out / comp
        folder.mkdir(parents=True, exist_ok=True)
        if isinstance(cfg, dit.DiTConfig) and dit_maps_to_diffusers(cfg):
            config = dit_diffusers_config(cfg)
            tensors = dit_to_diffusers(cfg, weights)
            cls = DIT_CLASS
        else:
            config = {
                "_class_name": NATIVE_CLASS,
                "_diffusers_version": DIFFUSERS_VERSION,
                "arch": arch_of(cfg),
                "model_config": dataclasses.asdict(cfg),
            }
            tensors = {"net." + k: v for k, v in weights.items()}
            cls = NATIVE_CLASS
        atomic_write(folder / "config.json", json.dumps(config, indent=2, sort_keys=True).encode())
        sha = _write_safetensors(folder / DIFFUSERS_WEIGHTS, tensors, meta)
        files[cell_id] = {"path": f"{comp}/{DIFFUSERS_WEIGHTS}", "sha256": sha, "component": comp, "class": cls}
        index[comp] = [PIPELINE_MODULE, cls]
    doc = {**composition, "format": fmt, "cells": files}
    atomic_write(out / COMPOSITION, json.dumps(doc, indent=2, sort_keys=True).encode())
    if fmt == "diffusers":
        atomic_write(out / MODEL_INDEX, json.dumps(index, indent=2, sort_keys=True).encode())
    return doc


# ---------------------------------------------------------------------------- reading back


def _read_tensors(path: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    try:
        with safe_open(str(path), framework="pt") as h:
            meta = dict(h.metadata() or {})
            return {k: h.get_tensor(k) for k in h.keys()}, meta  # noqa: SIM118 - a safe_open handle
    except Exception as e:  # noqa: BLE001 - safetensors raises its own error types
        raise ExportError(f"{path}: unreadable safetensors: {e}") from None


def weight_files(path: Path) -> list[Path]:
    """The weight files an export (folder) or a single safetensors file consists of, sorted."""
    if path.is_file():
        return [path]
    comp = path / COMPOSITION
    if not comp.is_file():
        raise ExportError(f"{path}: neither a .safetensors file nor an export folder (no {COMPOSITION})")
    doc = _json(comp)
    cells = doc.get("cells")
    if not isinstance(cells, dict):
        raise ExportError(f"{comp}: no cells table")
    out = []
    for entry in cells.values():
        rel = Path(str(entry.get("path", "")) if isinstance(entry, dict) else "")
        if rel.is_absolute() or ".." in rel.parts or not rel.parts:
            raise ExportError(f"{comp}: bad path {rel}")
        out.append(path / rel)
    return sorted(out)


def digest(path: str | Path) -> str:
    """The weights' digest `model.init_from` puts into the spec hash (`runspec.weights_digest`)."""
    from bagel.protocol.runspec import weights_digest

    return weights_digest(path)


def _json(path: Path) -> dict[str, Any]:
    try:
        doc = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise ExportError(f"{path}: {e}") from None
    if not isinstance(doc, dict):
        raise ExportError(f"{path}: not a JSON object")
    return doc


def read_weights(path: str | Path) -> dict[str, dict[str, torch.Tensor]]:
    """{cell id: Bagel weights} of an export folder (either layout), or {"*": weights} of a
    single safetensors file (which then starts every cell whose model it fits)."""
    path = Path(path)
    if path.is_file():
        tensors, _meta = _read_tensors(path)
        prefixed = any(k.startswith("w.") for k in tensors)
        if prefixed:  # a coordinator checkpoint: weights and momentum; keep the weights
            tensors = {k[2:]: v for k, v in tensors.items() if k.startswith("w.")}
        return {"*": tensors}
    doc = _json(path / COMPOSITION)
    out: dict[str, dict[str, torch.Tensor]] = {}
    cells = doc.get("cells")
    if not isinstance(cells, dict):
        raise ExportError(f"{path / COMPOSITION}: no cells table")
    weight_files(path)  # checks every path stays inside the folder
    for cell_id in sorted(cells):
        entry = cells[cell_id]
        f = path / str(entry["path"])
        tensors, _meta = _read_tensors(f)
        if doc.get("format") == "diffusers":
            config = _json(f.parent / "config.json")
            if config.get("_class_name") == DIT_CLASS:
                _cfg, tensors = dit_from_diffusers(config, tensors)
            else:
                tensors = {k[4:]: v for k, v in tensors.items() if k.startswith("net.")}
        out[str(cell_id)] = tensors
    return out


def cell_metadata(spec: Any, cell_id: str) -> dict[str, str]:
    """What a stored checkpoint of `cell_id` says about itself: architecture, config, cell, run."""
    from bagel.models.experts import cell_config

    return describe(cell_config(spec, cell_id), cell_id=cell_id, run_id=spec.run.id, spec_hash=spec.spec_hash)


def model_from_file(path: str | Path) -> Any:
    """The model a self-describing safetensors file holds (a stored checkpoint or a
    `safetensors` export), built from its metadata alone, in eval mode."""
    from bagel.models.experts import build

    path = Path(path)
    tensors, meta = _read_tensors(path)
    if meta.get("format") != SAFETENSORS_FORMAT:
        raise ExportError(f"{path}: no {SAFETENSORS_FORMAT} metadata (not a self-describing file)")
    try:
        fields = json.loads(meta["config"])
    except (KeyError, json.JSONDecodeError) as e:
        raise ExportError(f"{path}: unreadable model config in the metadata: {e}") from None
    cfg = config_from_fields(str(meta.get("arch")), fields)
    with torch.random.fork_rng(devices=[]):
        model = build(cfg)
    if any(k.startswith("w.") for k in tensors):
        # a stored checkpoint: its average of the committed weights where it keeps one (what
        # `sample` draws from), else its weights
        prefix = "ema." if any(k.startswith("ema.") for k in tensors) else "w."
        tensors = {k[len(prefix) :]: v for k, v in tensors.items() if k.startswith(prefix)}
    missing, unexpected = model.load_state_dict(tensors, strict=False)
    buffers = {n for n, _ in model.named_buffers()}
    if unexpected or set(missing) - buffers:
        raise ExportError(f"{path}: weights do not fit the described model ({missing[:3]}, {unexpected[:3]})")
    return model.eval()
