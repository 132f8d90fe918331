"""Architectures: shapes, closed-form parameter counts, presets, checkpoints round-trip."""

from __future__ import annotations

import json

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
