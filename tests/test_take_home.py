"""Taking the model home: `bagel-coordinator sample` and `export`, and `[model] init_from`.

One short in-process run serves every test here: a real coordinator (real SQLite store,
real checkpoint store with the real cell schemas) and two simulated workers that speak the
real protocol; their rounds end in real model weights (a few AdamW steps of the cell's own
loss from the previous committed state), which they upload as checkpoints. The run has
cells k0.r0, k1.r0 and the router; no worker offers k1.r0, so it never trains. While the
daemon is still serving, `sample --allow-partial` and both exports run against its data dir.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors import safe_open

from bagel.coordinator import cli
from bagel.coordinator.committed import load_committed
from bagel.coordinator.daemon import start_coordinator
from bagel.coordinator.store import Store
from bagel.models import initfrom
from bagel.models.data import load_dataset
from bagel.models.experts import cell_task
from bagel.protocol.runspec import load_spec, parse_spec, weights_digest

from simworkers import cluster_spec_text, start_workers, stop_workers, uniform_cells

# long leases: a simulated worker trains inside the event loop, which holds up its heartbeats
SPEC = cluster_spec_text(
    "takehome", min_replicas=1, every_rounds=1, min_round_s=0.3, lease_s=15.0, heartbeat_s=0.5
).replace("timestep_ranges = 2", "timestep_ranges = 1")
TRAINED = ("k0.r0", "router")
SAMPLE_ARGS = ["--n", "3", "--classes", "0,3,7", "--steps", "6", "--seed", "11"]


def _pretrained(spec: Any) -> dict[str, dict[str, np.ndarray]]:
    """Each offered cell's weights after 20 AdamW steps of its own loss (before the run: a
    simulated worker's round must not hold up its event loop); on one thread, which is the
    fastest on a busy machine."""
    out = {}
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for cell_id in TRAINED:
            out[cell_id] = _train(spec, cell_id)
    finally:
        torch.set_num_threads(threads)
    return out


def _train(spec: Any, cell_id: str) -> dict[str, np.ndarray]:
    task = cell_task(spec, cell_id)
    model = task.build_model().train()
    x, y = task.train_data()
    gen = torch.Generator().manual_seed(len(cell_id))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(20):
        idx = torch.randint(0, len(x), (32,), generator=gen)
        loss = task.loss(model, x[idx], y[idx], gen)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return {n: p.detach().numpy().copy() for n, p in model.named_parameters()}


def _states(trained: dict[str, dict[str, np.ndarray]]) -> Any:
    """What an honest round ends with: the trained weights nudged by a pure function of the
    round's key (so contributors agree and every round's hash is new), zero momentum."""

    def state(cell_id: str, rnd: int, prev_hash: str, contributors: Any) -> dict[str, np.ndarray]:
        seed = int.from_bytes(hashlib.sha256(f"{cell_id}|{rnd}|{prev_hash}".encode()).digest()[:8], "little")
        rng = np.random.default_rng(seed)
        flat = {}
        for n, w in trained[cell_id].items():
            flat["w." + n] = (w + 1e-4 * rng.standard_normal(w.shape)).astype(np.float32)
            flat["m." + n] = np.zeros_like(w)
        return flat

    return state


async def _run(data_dir: Path, out: Path) -> dict[str, int]:
    spec = parse_spec(SPEC)
    load_dataset(spec)  # cached per process: the k-means of the clusters, before any lease runs
    h = await start_coordinator(spec, data_dir, cells=uniform_cells(spec.cell_ids), tick_ms=50)
    workers = await start_workers(
        f"127.0.0.1:{h.port}", spec.run.id, 2, cells=TRAINED, state_fn=_states(_pretrained(spec))
    )
    codes: dict[str, int] = {}
    try:
        deadline = time.monotonic() + 60
        while not all(h.app.checkpoints.list(c) for c in TRAINED):
            assert time.monotonic() < deadline, f"no checkpoints yet: {[w.stats.errors[-3:] for w in workers]}"
            await asyncio.sleep(0.1)
        # the workers stop (so the committed state holds still) and the daemon keeps serving
        # while these read its data dir
        await stop_workers(workers)
        d = str(data_dir)
        codes["sample"] = await asyncio.to_thread(
            cli.main, ["sample", "--data-dir", d, "--out", str(out / "partial"), "--allow-partial", *SAMPLE_ARGS]
        )
        for fmt in ("diffusers", "safetensors"):
            codes[fmt] = await asyncio.to_thread(
                cli.main, ["export", "--data-dir", d, "--out", str(out / fmt), "--format", fmt]
            )
        assert h.app.state.snapshot() is not None  # still serving
    finally:
        await stop_workers(workers)
        await h.stop()
    return codes


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("takehome")
    codes = asyncio.run(_run(root / "data", root / "out"))
    return {"data": root / "data", "out": root / "out", "codes": codes}


@pytest.mark.timeout(120)
def test_sample_writes_grid_arrays_and_a_manifest_that_matches_the_store(run: dict[str, Any]) -> None:
    assert run["codes"] == {"sample": 0, "diffusers": 0, "safetensors": 0}
    out = run["out"] / "partial"
    manifest = json.loads((out / "manifest.json").read_text())
    store = Store.open_readonly(run["data"])
    try:
        commits = {(c, r): h for c, r, h in store.commits()}
        metas = {(m.cell_id, m.round): m for m in store.list_checkpoints()}
        spec_hash = store.spec().spec_hash  # type: ignore[union-attr]
    finally:
        store.close()
    assert manifest["spec_hash"] == spec_hash and manifest["seed"] == 11 and manifest["routing"] == "top1"
    assert sorted(manifest["cells"]) == sorted(TRAINED)
    for cell, used in manifest["cells"].items():
        assert commits[(cell, used["round"])] == used["state_hash"]
        meta = metas[(cell, used["round"])]
        assert (
            meta.sha256
            == used["sha256"]
            == hashlib.sha256((run["data"] / "checkpoints" / meta.path).read_bytes()).hexdigest()
        )
        assert used["committed_round"] >= used["round"] >= 1
    # the cell nobody trained: missing, and what stood in for it is recorded
    assert set(manifest["missing"]) == {"k1.r0"} and "never trained" in manifest["missing"]["k1.r0"]
    assert "router renormalised" in manifest["substituted"]["k1.r0"]
    samples, labels = np.load(out / "samples.npy"), np.load(out / "labels.npy")
    assert samples.shape == (9, 1, 8, 8) and samples.dtype == np.float32
    assert np.isfinite(samples).all() and samples.min() >= -1 and samples.max() <= 1 and samples.std() > 0.05
    assert labels.tolist() == [0, 0, 0, 3, 3, 3, 7, 7, 7]
    grid = np.asarray(Image.open(out / "grid.png").convert("RGB"))
    assert grid.shape[0] >= 3 * 36 and grid.shape[1] >= 28 + 3 * 36  # 3 labelled rows of 3 tiles
    caption = (grid[:, :, 0] > 120) & (grid[:, :, 1] < 90)  # the red line naming the substitute
    assert caption[3 * 36 :].any() and not caption[: 3 * 36].any()


@pytest.mark.timeout(60)
def test_sample_refuses_a_cell_that_never_trained_by_name(
    run: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    code = cli.main(["sample", "--data-dir", str(run["data"]), "--out", str(tmp_path / "s"), *SAMPLE_ARGS])
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "cell k1.r0" in err and "never trained" in err and "--allow-partial" in err
    assert not (tmp_path / "s" / "manifest.json").exists()


@pytest.mark.timeout(60)
def test_stored_checkpoints_and_safetensors_export_are_self_describing(run: dict[str, Any]) -> None:
    from bagel.models.export import config_from_fields, model_from_file, read_weights

    committed = load_committed(run["data"])
    for cell in TRAINED:
        w = committed.cells[cell]
        stored = run["data"] / "checkpoints" / cell / f"{w.round:010d}.safetensors"
        with safe_open(str(stored), framework="pt") as f:
            meta = f.metadata()
        assert meta["cell_id"] == cell and meta["round"] == str(w.round) and meta["state_hash"] == w.state_hash
        assert config_from_fields(meta["arch"], json.loads(meta["config"])) == w.config
        exported = run["out"] / "safetensors" / f"{cell}.safetensors"
        with safe_open(str(exported), framework="pt") as f:
            meta = f.metadata()
            names = set(f.keys())  # noqa: SIM118 - a safe_open handle
        assert config_from_fields(meta["arch"], json.loads(meta["config"])) == w.config
        assert names == set(w.weights)  # weights only: no outer momentum
        assert exported.stat().st_size < 0.6 * stored.stat().st_size
        # either file alone rebuilds the model: no run spec needed
        x, t = torch.randn(4, 1, 8, 8), torch.rand(4)
        with torch.no_grad():
            want = w.model()(x, t)
            for f in (stored, exported):
                assert torch.equal(model_from_file(f)(x, t), want)
    back = read_weights(run["out"] / "safetensors")
    assert set(back) == set(TRAINED)
    assert all(torch.equal(back[c][n], t) for c in TRAINED for n, t in committed.cells[c].weights.items())


@pytest.mark.timeout(120)
def test_diffusers_export_loads_in_diffusers_and_matches_bagel(run: dict[str, Any]) -> None:
    from bagel.models.pipeline import BagelDiTTransformer2DModel, BagelNativeModel, BagelPipeline

    folder = run["out"] / "diffusers"
    index = json.loads((folder / "model_index.json").read_text())
    assert index["k0_r0"] == ["bagel.models.pipeline", "BagelDiTTransformer2DModel"]
    assert index["router"] == ["bagel.models.pipeline", "BagelNativeModel"]
    committed = load_committed(run["data"])
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(6, 1, 8, 8, generator=gen)
    t = torch.rand(6, generator=gen)
    y = torch.tensor([0, 3, 7, 9, 10, 1])  # 10 is the null label
    ours = committed.cells["k0.r0"].model()
    theirs = BagelDiTTransformer2DModel.from_pretrained(folder / "k0_r0", low_cpu_mem_usage=False).eval()
    assert (folder / "k0_r0" / "config.json").is_file()
    assert (folder / "k0_r0" / "diffusion_pytorch_model.safetensors").is_file()
    with torch.no_grad():
        v_ours, v_theirs = ours(x, t, y), theirs.velocity(x, t, y)
        # the same thing through diffusers' own call convention: timestep = 1000 t
        v_call = theirs(x, timestep=1000.0 * t, class_labels=y).sample
    assert v_ours.abs().max() > 0.05  # trained weights, not the zero-initialised output layer
    assert (v_ours - v_theirs).abs().max() <= 1e-5 and (v_ours - v_call).abs().max() <= 1e-5
    router = BagelNativeModel.from_pretrained(folder / "router", low_cpu_mem_usage=False).eval()
    with torch.no_grad():
        assert (committed.cells["router"].model()(x, t) - router(x, t)).abs().max() <= 1e-5
    # the composed pipeline draws what `sample` drew for the same seed and parameters
    pipe = BagelPipeline.from_export(folder)
    images, labels = pipe([0, 3, 7], n=3, steps=6, seed=11)
    assert labels is not None and labels.tolist() == [0, 0, 0, 3, 3, 3, 7, 7, 7]
    drawn = np.load(run["out"] / "partial" / "samples.npy")
    assert np.abs(images.numpy() - drawn).max() <= 1e-4


@pytest.mark.timeout(120)
def test_init_from_starts_a_run_at_the_exported_checkpoint(
    run: dict[str, Any], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    committed = load_committed(run["data"])
    body = SPEC.replace('id = "takehome"', 'id = "finetune"')
    spec_file = tmp_path / "run.toml"
    rel = os.path.relpath(run["out"] / "diffusers", tmp_path)  # relative to the spec file's folder
    spec_file.write_text(body.replace("[data]", f'[model]\ninit_from = "{rel}"\n\n[data]'))
    spec = load_spec(spec_file)
    assert spec.init_sha256 == weights_digest(run["out"] / "diffusers")
    assert spec.spec_hash != parse_spec(spec.source).spec_hash  # the weights' digest is in the spec hash
    assert initfrom.check(spec) == list(TRAINED)  # k1.r0 was never exported: it starts fresh
    fresh_spec = parse_spec(SPEC)
    for cell in TRAINED:
        task, fresh = cell_task(spec, cell), cell_task(fresh_spec, cell)
        model = task.build_model()
        x, y = task.heldout_data()
        start = task.eval_loss(model, x, y, seed=0)
        exported = task.eval_loss(committed.cells[cell].model(), x, y, seed=0)
        untrained = fresh.eval_loss(fresh.build_model(), x, y, seed=0)
        assert abs(start - exported) <= 1e-6 * max(1.0, exported)  # begins at the checkpoint's loss
        assert abs(untrained - exported) > 0.02  # which is not where a fresh run begins
    # the coordinator serves it, and a worker's client accepts the spec hash with the digest
    asyncio.run(_serve_and_register(spec, tmp_path / "data"))
    # a checkpoint whose tensors do not fit: one error line naming the tensor, before serving
    bad = tmp_path / "bad.toml"
    bad.write_text(body.replace("[data]", f'[model]\npreset = "mini"\ninit_from = "{rel}"\n\n[data]'))
    bystander = subprocess.Popen(["sleep", "60"])  # a child of the caller, not of the refused daemon
    try:
        code = cli.main(["serve", "--run", str(bad), "--data-dir", str(tmp_path / "bad"), "--insecure", "--no-dht"])
        assert bystander.poll() is None  # serve ends only the children it started
    finally:
        bystander.kill()
        bystander.wait()
    err = capsys.readouterr().err
    assert code == 2 and err.count("\n") == 1
    assert "tensor 'x_embed.weight' is [96, 1, 4, 4] in the checkpoint, the model has [192, 1, 2, 2]" in err


async def _serve_and_register(spec: Any, data_dir: Path) -> None:
    h = await start_coordinator(spec, data_dir, cells=uniform_cells(spec.cell_ids), tick_ms=50)
    workers = await start_workers(f"127.0.0.1:{h.port}", spec.run.id, 1, cells=TRAINED)
    try:
        deadline = time.monotonic() + 20
        while not workers[0].stats.registrations:
            assert time.monotonic() < deadline, workers[0].stats.errors[-3:]
            await asyncio.sleep(0.05)
    finally:
        await stop_workers(workers)
        await h.stop()


@pytest.mark.timeout(60)
def test_unmapped_architectures_export_as_native_diffusers_models(tmp_path: Path) -> None:
    from bagel.models import dit, unet
    from bagel.models.export import read_weights, write_export
    from bagel.models.pipeline import BagelNativeModel

    torch.manual_seed(3)
    models = {"k0.r0": unet.UNet(unet.preset_config("tiny", 8, 1, 10)), "k0.r1": dit.DiT(dit.DiTConfig(mlp_ratio=2.0))}
    cells = {c: (m.cfg, {n: p + 0.01 for n, p in m.state_dict().items()}, {}) for c, m in models.items()}
    doc = write_export(tmp_path, "diffusers", cells, {"num_classes": 10})
    assert {e["class"] for e in doc["cells"].values()} == {"BagelNativeModel"}
    x, t, y = torch.randn(2, 1, 8, 8), torch.tensor([0.2, 0.9]), torch.tensor([1, 10])
    for cell, (_cfg, w, _) in cells.items():
        ours = models[cell]
        ours.load_state_dict(w)
        theirs = BagelNativeModel.from_pretrained(tmp_path / cell.replace(".", "_"), low_cpu_mem_usage=False)
        with torch.no_grad():
            assert (ours.eval()(x, t, y) - theirs.eval()(x, t, y)).abs().max() <= 1e-6
        assert all(torch.equal(read_weights(tmp_path)[cell][n], v) for n, v in w.items())
