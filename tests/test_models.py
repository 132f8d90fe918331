"""Architectures: shapes, closed-form parameter counts, presets, checkpoints round-trip."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from bagel.models import checkpoint, dit, experts, router, unet


def _numel(model: torch.nn.Module) -> int:
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("preset", ["tiny", "mini", "S/2", "S/8"])
@pytest.mark.parametrize("num_classes", [0, 10])
def test_dit_shapes_and_param_count(preset, num_classes):
    cfg = dit.preset_config(preset, image_size=8, channels=1, num_classes=num_classes)
    model = dit.DiT(cfg)
    assert _numel(model) == dit.param_count(cfg)
    x = torch.randn(3, 1, 8, 8)
    y = torch.tensor([1, 2, 3]) if num_classes else None
    assert model(x, torch.rand(3), y).shape == x.shape


@pytest.mark.parametrize("preset", ["S/2", "B/4", "L/8", "XL/2"])
def test_big_dit_param_counts_on_meta_device(preset):
    # the paper's shapes, built without memory on the meta device
    cfg = dit.preset_config(preset, image_size=32, channels=4, num_classes=1000)
    with torch.device("meta"):
        model = dit.DiT(cfg)
    assert _numel(model) == dit.param_count(cfg)
    hidden, depth, heads, patch = dit.PRESETS[preset]
    assert (cfg.hidden, cfg.depth, cfg.heads, cfg.patch) == (hidden, depth, heads, patch)


def test_dit_presets_cover_the_paper_shapes():
    shapes = {"S": (384, 12), "B": (768, 12), "L": (1024, 24), "XL": (1152, 28)}
    for name, (h, d) in shapes.items():
        for p in (2, 4, 8):
            cfg = dit.preset_config(f"DiT-{name}/{p}", image_size=32)
            assert (cfg.hidden, cfg.depth, cfg.patch) == (h, d, p)
    assert dit.param_count(dit.preset_config("tiny")) < 1_000_000
    # DiT-XL/2 on 32x32x4 latents is the paper's 675M model (ours has no learned sigma)
    assert abs(dit.param_count(dit.preset_config("XL/2", 32, 4, 1000)) - 675e6) < 1e6
    with pytest.raises(ValueError):
        dit.preset_config("XXL/2")


def test_dit_is_zero_at_init_and_rejects_bad_input():
    model = dit.DiT(dit.preset_config("tiny"))
    out = model(torch.randn(2, 1, 8, 8), torch.rand(2), torch.tensor([0, 10]))
    assert torch.count_nonzero(out) == 0  # adaLN-Zero: the output layer starts at zero
    with pytest.raises(ValueError):
        model(torch.randn(2, 1, 16, 16), torch.rand(2))


@pytest.mark.parametrize("preset", list(unet.PRESETS))
@pytest.mark.parametrize("size", [8, 16])
def test_unet_shapes_and_param_count(preset, size):
    cfg = unet.preset_config(preset, image_size=size, channels=3, num_classes=5)
    model = unet.UNet(cfg)
    assert _numel(model) == unet.param_count(cfg)
    x = torch.randn(2, 3, size, size)
    assert model(x, torch.rand(2), torch.tensor([0, 4])).shape == x.shape
    assert model(x, torch.rand(2)).shape == x.shape
    assert experts.param_count("unet", preset, size, 3, 5) == unet.param_count(cfg)


@pytest.mark.parametrize("preset", list(router.PRESETS))
def test_router_shapes_and_param_count(preset):
    cfg = router.preset_config(preset, clusters=4, image_size=8, channels=1, num_classes=0)
    model = router.Router(cfg)
    assert _numel(model) == router.param_count(cfg)
    assert model(torch.randn(5, 1, 8, 8), torch.rand(5)).shape == (5, 4)


_SCHEMA_SCRIPT = """
import json, sys
from bagel.models.experts import cell_state_schema
from bagel.protocol.runspec import parse_spec
out = {}
for text in json.loads(sys.argv[1]):
    spec = parse_spec(text)
    out.update({f"{spec.model.arch}/{c}": cell_state_schema(spec, c) for c in spec.cell_ids})
print(json.dumps({"schemas": out, "dynamo": "torch._dynamo" in sys.modules}))
"""


def _specs() -> list[str]:
    from simworkers import cluster_spec_text

    dit_text = cluster_spec_text("models")  # 2 clusters x 2 timestep ranges and the router
    return [dit_text, dit_text.replace('arch = "dit"', 'arch = "unet"')]


def test_state_schema_is_the_models_own_and_loads_no_compiler():
    """`cell_state_schema` builds each cell's model on the meta device for its names and
    shapes. It gives exactly the trainable parameters of the model as built for training,
    and, in a fresh interpreter, it does not load `torch._dynamo` (over a second of CPU
    that a coordinator, which never trains, would pay at every start)."""
    from bagel.protocol.runspec import parse_spec

    texts = _specs()
    proc = subprocess.run(
        [sys.executable, "-c", _SCHEMA_SCRIPT, json.dumps(texts)], capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    got = json.loads(proc.stdout)
    assert got["dynamo"] is False
    for text in texts:
        spec = parse_spec(text)
        for cell in spec.cell_ids:
            schema = got["schemas"][f"{spec.model.arch}/{cell}"]
            model = experts.build(experts.cell_config(spec, cell))
            params = {n: list(p.shape) for n, p in model.named_parameters() if p.requires_grad}
            assert {k[2:]: shape for k, (_dt, shape) in schema.items() if k.startswith("w.")} == params
            assert {k[2:] for k in schema if k.startswith("m.")} == set(params)


def test_skipping_fills_touches_only_meta_tensors():
    """The schema's build skips the random fills of meta tensors only: a model built on the
    CPU inside the same mode is initialised exactly as outside it."""
    cfg = dit.preset_config("tiny")
    torch.manual_seed(3)
    plain = dit.DiT(cfg)
    torch.manual_seed(3)
    with experts._NoRandomFill():
        inside = dit.DiT(cfg)
    for (n, a), (_n, b) in zip(plain.state_dict().items(), inside.state_dict().items(), strict=True):
        assert torch.equal(a, b), n
    assert any(p.abs().sum() > 0 for p in inside.parameters())
    with torch.device("meta"), experts._NoRandomFill():
        meta = dit.DiT(cfg)
    assert meta.pos_embed.is_meta and all(p.is_meta for p in meta.parameters())
    assert torch.equal(plain.pos_embed, dit.sincos_pos_embed(cfg.hidden, cfg.image_size // cfg.patch).unsqueeze(0))


@pytest.mark.parametrize(
    "model",
    [
        dit.DiT(dit.preset_config("tiny")),
        unet.UNet(unet.preset_config("tiny", 8, 1, 0)),
        router.Router(router.preset_config("tiny", 3, 8, 1, 0)),
    ],
    ids=["dit", "unet", "router"],
)
def test_checkpoint_round_trip_is_exact(tmp_path, model):
    with torch.no_grad():  # make every tensor non-trivial (zero-initialised layers included)
        for p in model.parameters():
            p.add_(torch.randn_like(p))
    w, j = checkpoint.save(tmp_path / "cell", model, {"round": 7})
    assert w.suffix == ".safetensors" and j.suffix == ".json"
    loaded, meta = checkpoint.load(tmp_path / "cell")
    assert meta["metadata"] == {"round": 7}
    assert type(loaded) is type(model) and loaded.cfg == model.cfg
    a, b = model.state_dict(), loaded.state_dict()
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    x = torch.randn(2, *((1, 8, 8)))
    assert torch.equal(model.eval()(x, torch.tensor([0.3, 0.9])), loaded(x, torch.tensor([0.3, 0.9])))


def test_checkpoint_rejects_tampering(tmp_path):
    model = dit.DiT(dit.preset_config("tiny"))
    w, j = checkpoint.save(tmp_path / "m", model)
    blob = bytearray(w.read_bytes())
    blob[-1] ^= 1
    w.write_bytes(bytes(blob))
    with pytest.raises(checkpoint.ModelCheckpointError, match="sha256"):
        checkpoint.load(tmp_path / "m")
    checkpoint.save(tmp_path / "m", model)
    doc = json.loads(j.read_text())
    doc["config"]["hidden"] = 128
    j.write_text(json.dumps(doc))
    with pytest.raises(checkpoint.ModelCheckpointError):
        checkpoint.load(tmp_path / "m")
    with pytest.raises(checkpoint.ModelCheckpointError, match="missing"):
        checkpoint.load(tmp_path / "absent")
