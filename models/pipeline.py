"""The diffusers side of an export: the model classes of its folders and `BagelPipeline`, which composes them.

`models/export.py` writes the folders without diffusers; this module needs it (a test
extra). `BagelDiTTransformer2DModel` is diffusers' `DiTTransformer2DModel` with the two
fixed parts Bagel's DiT computes differently (the timestep features' frequency
denominator, half instead of half - 1, and the 2-D position embedding's axis order); its
weights and forward are diffusers' own. `BagelNativeModel` is a diffusers `ModelMixin`
around a Bagel module with no diffusers counterpart (the U-Net, the router).

`BagelPipeline.from_export(folder)` reads `model_index.json` and `composition.json`, loads
each component with `from_pretrained` (only the two classes above: the index names a
class, and nothing else is imported), and samples with the same composed sampler and
Euler integrator as `bagel-coordinator sample` (`models/compose.py`), so for the same seed
and parameters the two give the same images up to float rounding.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from diffusers import DiffusionPipeline, DiTTransformer2DModel, ModelMixin
from diffusers.configuration_utils import ConfigMixin, register_to_config
from diffusers.models.embeddings import Timesteps
from torch import nn

from bagel.models import compose, dit
from bagel.models.experts import build
from bagel.models.export import (
    COMPOSITION,
    DIT_CLASS,
    MODEL_INDEX,
    NATIVE_CLASS,
    PIPELINE_MODULE,
    ExportError,
    config_from_fields,
)


class BagelDiTTransformer2DModel(DiTTransformer2DModel):
    """diffusers' DiT with Bagel's timestep frequencies and position embedding (no other change)."""

    @register_to_config
    def __init__(
        self,
        num_attention_heads: int = 16,
        attention_head_dim: int = 72,
        in_channels: int = 4,
        out_channels: int | None = None,
        num_layers: int = 28,
        dropout: float = 0.0,
        norm_num_groups: int = 32,
        attention_bias: bool = True,
        sample_size: int = 32,
        patch_size: int = 2,
        activation_fn: str = "gelu-approximate",
        num_embeds_ada_norm: int | None = 1000,
        upcast_attention: bool = False,
        norm_type: str = "ada_norm_zero",
        norm_elementwise_affine: bool = False,
        norm_eps: float = 1e-6,
    ) -> None:
        # the same arguments as DiTTransformer2DModel, spelled out: diffusers records a
        # model's config from its __init__ signature
        super().__init__(
            num_attention_heads=num_attention_heads,
            attention_head_dim=attention_head_dim,
            in_channels=in_channels,
            out_channels=out_channels,
            num_layers=num_layers,
            dropout=dropout,
            norm_num_groups=norm_num_groups,
            attention_bias=attention_bias,
            sample_size=sample_size,
            patch_size=patch_size,
            activation_fn=activation_fn,
            num_embeds_ada_norm=num_embeds_ada_norm,
            upcast_attention=upcast_attention,
            norm_type=norm_type,
            norm_elementwise_affine=norm_elementwise_affine,
            norm_eps=norm_eps,
        )
        for block in self.transformer_blocks:
            block.norm1.emb.time_proj = Timesteps(dit.FREQ_DIM, flip_sin_to_cos=True, downscale_freq_shift=0)
        grid = self.config.sample_size // self.config.patch_size
        pos = dit.sincos_pos_embed(self.inner_dim, grid).unsqueeze(0)
        self.pos_embed.register_buffer("pos_embed", pos, persistent=False)

    def velocity(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        """Bagel's call: t in [0, 1] (diffusers' timestep is 1000 t), y None = the null label."""
        if y is None:
            y = torch.full((x.shape[0],), int(self.config.num_embeds_ada_norm), dtype=torch.long, device=x.device)
        timestep = 1000.0 * t.float().reshape(x.shape[0]).to(x.device)
        out = self(x, timestep=timestep, class_labels=y, return_dict=False)
        return out[0]


class BagelNativeModel(ModelMixin, ConfigMixin):
    """A Bagel U-Net or router as a diffusers model: config.json holds its architecture and config."""

    @register_to_config
    def __init__(self, arch: str = "router", model_config: dict[str, Any] | None = None) -> None:
        super().__init__()
        self.net = build(config_from_fields(arch, model_config or {}))

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.net(x, t, y)

    def velocity(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.net(x, t, y)


class _Velocity(nn.Module):
    """(x, t, y) -> v of an exported expert, the interface `compose.ComposedModel` calls."""

    def __init__(self, model: BagelDiTTransformer2DModel | BagelNativeModel) -> None:
        super().__init__()
        self.model = model

    def forward(self, x: torch.Tensor, t: torch.Tensor, y: torch.Tensor | None = None) -> torch.Tensor:
        return self.model.velocity(x, t, y)


_CLASSES: dict[str, type[ModelMixin]] = {DIT_CLASS: BagelDiTTransformer2DModel, NATIVE_CLASS: BagelNativeModel}


class BagelPipeline(DiffusionPipeline):
    """Samples a composed Bagel export: `pipe(classes, n=..., steps=..., seed=...)`."""

    def __init__(self, components: dict[str, ModelMixin] | None = None, composition: dict[str, Any] | None = None):
        super().__init__()
        self.components_by_cell: dict[str, ModelMixin] = dict(components or {})
        self.composition: dict[str, Any] = dict(composition or {})
        for model in self.components_by_cell.values():
            model.eval()

    @classmethod
    def from_export(cls, folder: str | Path) -> BagelPipeline:
        folder = Path(folder)
        try:
            index = json.loads((folder / MODEL_INDEX).read_text())
            comp = json.loads((folder / COMPOSITION).read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise ExportError(f"{folder}: not a diffusers export: {e}") from None
        models: dict[str, ModelMixin] = {}
        for cell_id, entry in sorted(comp.get("cells", {}).items()):
            name = entry.get("component")
            lib_cls = index.get(name)
            if not isinstance(lib_cls, list) or len(lib_cls) != 2 or lib_cls[0] != PIPELINE_MODULE:
                raise ExportError(f"{MODEL_INDEX}: component {name!r} is not one of {PIPELINE_MODULE}'s classes")
            klass = _CLASSES.get(lib_cls[1])
            if klass is None or entry.get("class") != lib_cls[1]:
                raise ExportError(f"{MODEL_INDEX}: unknown class {lib_cls[1]!r} for {name!r}")
            models[cell_id] = klass.from_pretrained(folder / name, use_safetensors=True, low_cpu_mem_usage=False)
        return cls(models, comp)

    def composed(self, routing: compose.Routing = "top1", generator: torch.Generator | None = None) -> Any:
        c = self.composition
        experts: dict[compose.Cell, nn.Module] = {}
        router_model: nn.Module | None = None
        for cell_id, model in self.components_by_cell.items():
            if cell_id == "router":
                router_model = _Velocity(model)
                continue
            k, r = (int(p[1:]) for p in cell_id.split("."))
            experts[(k, r)] = _Velocity(model).eval()
        class_given = c.get("class_given_cluster")
        null = c.get("null_label")
        return compose.ComposedModel(
            experts,
            [tuple(r) for r in c["ranges"]],
            int(c["clusters"]),
            router=router_model,
            cluster_prior=torch.tensor(c["cluster_prior"], dtype=torch.float32),
            class_given_cluster=torch.tensor(class_given, dtype=torch.float32) if class_given else None,
            null_label=None if null is None else int(null),
            routing=routing,
            generator=generator,
        )

    @torch.no_grad()
    def __call__(
        self,
        classes: list[int] | None = None,
        *,
        n: int = 8,
        steps: int = 32,
        guidance: float = 1.0,
        seed: int = 0,
        routing: compose.Routing = "top1",
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(images [N, C, H, W] in [-1, 1], labels or None), drawn exactly as `bagel-coordinator sample` draws."""
        c = self.composition
        nc = int(c["num_classes"])
        gen = torch.Generator().manual_seed(seed)
        composed = self.composed(routing, gen)
        classes = list(range(nc)) if classes is None and nc > 0 else classes
        labels = torch.tensor([k for k in (classes or []) for _ in range(n)], dtype=torch.long) if nc > 0 else None
        count = len(labels) if labels is not None else n
        size, ch = int(c["image_size"]), int(c["channels"])
        noise = torch.randn(count, ch, size, size, generator=gen)
        images = compose.sample(composed, noise, labels, steps=steps, guidance=guidance)
        return images.clamp(-1, 1), labels
