"""GPU check: one short, prepared run of the project's own code on a CUDA device.

    python bench/gpu_check.py --json gpu_check.json          # CUDA when torch sees it, else the CPU part
    python bench/gpu_check.py --device cpu --json out.json   # the CPU part (the suite's smoke test)

What it measures, each part on the project's own code path:

1. **train**: a DiT-S/2-class expert cell (`models/dit.py` preset S/2: hidden 384, depth 12,
   6 heads, patch 2) on 32x32 images with the run's channels (the bundled digits, resized),
   one training step = the cell's rectified-flow loss (`CellTask.loss`), backward, AdamW.
   Three modes: fp32, bf16 autocast (what the worker's `InnerTrainer` uses on CUDA), and
   `torch.compile` of the model under bf16 autocast (its first steps, the compilation, are
   timed apart). Each: samples/s, ms/step, peak memory (`torch.cuda.max_memory_allocated`),
   and VRAM headroom = the device's total memory - that peak. Next to the peak, "sched est"
   is what the coordinator's scheduler assumes the cell needs on the device at this batch
   (`models.experts.cell_memory_bytes`: DEVICE_COPIES float32 copies of the parameters, the
   weights, gradients and AdamW's two moments, plus activations; a GPU gets the cell when
   that is at most 1 - `vram_headroom` of its memory, and the host's share,
   `cell_host_bytes`, fits its RAM), and the JSON has the training data this script keeps
   on the device (`data_bytes`, in the peak, not in the estimate). The outer state, the
   round's starting weights and the error-feedback residual are host tensors. So the
   estimate should be near the peak less the data, and how near is what this figure shows
   on a real card.
2. **diloco**: one DiLoCo round between two workers sharing the device: each trains H inner
   steps from the same committed state through the worker's `roundwork.train_round` (two
   threads at once, one `CellRuntime` each), then the two exchange and apply the outer
   step through the worker's `roundwork.reduce_round`. The exchange is the real data plane
   (`worker/averaging.py`'s `DataPlane.all_reduce`: verified reducers over hivemind's libp2p
   streams, two DHT nodes on loopback) when hivemind is importable; otherwise two in-process
   replicas averaging their pseudo-gradients with the same part code (`parts.prepare_contribution`,
   `robust.reduction.reduce_one_part` per part, then `diloco.outer_step`), without the
   network, and the output says which. It checks that both replicas end bit-identical.
3. **sampler**: the composed sampler (`models/compose.py`'s `from_cells` + `sample`, what
   `bagel-coordinator sample` runs) over a 2 clusters x 2 timestep-ranges grid of S/2 experts
   and the router: samples/s at the given Euler steps, fp32 and bf16 autocast.

Without CUDA it runs the CPU part: the same three parts at tiny sizes (the tiny DiT on 8x8,
few steps, fp32 only; bf16 and compile are skipped), and the table and JSON say that the
GPU part is unverified. Each part reports its own error instead of stopping the others.

Runs from a checkout without installing it: when `bagel` is not importable, the tree's
folders are mapped onto the `bagel` package here (as setuptools' package-dir does).
Dependencies: torch, numpy, safetensors, scikit-learn (the digits), protobuf at least the
generated messages' version (7.35; the DiLoCo part imports them: with an older one that part
reports the import error and the others run); hivemind only for the real data plane. Well under 5 minutes on one H200.
Not a test; `tests/test_gpu_check.py` runs the CPU part as a smoke test.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import resource
import sys
import threading
import time
import types
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
CELL = "k0.r0"
MODES = ("fp32", "bf16", "compile")


def ensure_bagel_importable() -> None:
    """`bagel.<pkg>` is folder `<pkg>/` of this checkout; map it when nothing is installed."""
    try:
        import bagel  # noqa: F401
    except ImportError:
        pkg = types.ModuleType("bagel")
        pkg.__path__ = [str(ROOT)]
        sys.modules["bagel"] = pkg


# ---------------------------------------------------------------- sizes and specs


def sizes(cuda: bool) -> dict[str, Any]:
    """What each part runs: DiT-S/2 on 32x32 on a GPU; the tiny DiT on 8x8, a few steps, on CPU."""
    if cuda:
        return dict(
            preset="S/2", image_size=32, batch=256, warmup=5, steps=20, compile_warmup=3,
            inner_steps=20, member_batch=64, sampler_samples=256, sampler_steps=32,
        )  # fmt: skip
    return dict(
        preset="tiny", image_size=8, batch=8, warmup=1, steps=3, compile_warmup=0,
        inner_steps=2, member_batch=8, sampler_samples=8, sampler_steps=4,
    )  # fmt: skip


SPEC = """
[run]
id = "gpu-check"
seed = 0

[model]
arch = "dit"
preset = "{preset}"
image_size = {image_size}
channels = {channels}
num_classes = 10

[data]
source = "digits"
clusters = {clusters}
holdout_fraction = 0.1
whole_classes = true

[cells]
timestep_ranges = {ranges}
router = {router}

[diloco]
inner_steps = {inner_steps}
inner_lr = 0.001
group_batch = {group_batch}
codec = "int8"
error_feedback = true
"""


def make_spec(sz: dict[str, Any], channels: int, grid: bool) -> Any:
    from bagel.protocol.runspec import parse_spec

    return parse_spec(
        SPEC.format(
            preset=sz["preset"],
            image_size=sz["image_size"],
            channels=channels,
            clusters=2 if grid else 1,
            ranges=2 if grid else 1,
            router="true" if grid else "false",
            inner_steps=sz["inner_steps"],
            group_batch=2 * sz["member_batch"],
        )
    )


# ---------------------------------------------------------------- measuring


def sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


def memory(device: torch.device) -> dict[str, Any]:
    """Peak allocated, the device's total and the headroom on CUDA; the process's peak RSS on CPU."""
    if device.type == "cuda":
        peak = int(torch.cuda.max_memory_allocated(device))
        total = int(torch.cuda.get_device_properties(device).total_memory)
        return {"peak_mem_bytes": peak, "total_mem_bytes": total, "headroom_bytes": total - peak}
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * (1 if sys.platform == "darwin" else 1024)
    return {"peak_mem_bytes": None, "total_mem_bytes": None, "headroom_bytes": None, "peak_rss_bytes": int(rss)}


@contextmanager
def autocast(device: torch.device, bf16: bool) -> Iterator[None]:
    if device.type == "cuda" and bf16:
        with torch.autocast(device_type="cuda", dtype=torch.bfloat16):
            yield
    else:
        yield


def part(name: str, fn: Callable[[], dict[str, Any]]) -> dict[str, Any]:
    """Run one part; its failure is recorded, and the other parts still run."""
    t0 = time.perf_counter()
    try:
        out = fn()
    except Exception as e:  # noqa: BLE001  (a report of what failed is the point here)
        out = {"status": "error", "error": f"{type(e).__name__}: {e}"}
        print(f"gpu_check: {name} failed: {out['error']}", file=sys.stderr, flush=True)
    out.setdefault("status", "ok")
    out["wall_s"] = time.perf_counter() - t0
    return out


# ---------------------------------------------------------------- 1. training step throughput


def train_mode(spec: Any, device: torch.device, sz: dict[str, Any], mode: str) -> dict[str, Any]:
    """One mode's training steps on the cell: samples/s, ms/step, peak memory, headroom."""
    from bagel.models.experts import cell_memory_bytes, cell_task

    task = cell_task(spec, CELL)
    model = task.build_model().to(device)
    params = sum(p.numel() for p in model.parameters() if p.requires_grad)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=spec.diloco.inner_lr)
    x_all, y_all = task.train_data()
    x_all, y_all = x_all.to(device), y_all.to(device)
    gen = torch.Generator().manual_seed(0)
    run_model: Any = torch.compile(model) if mode == "compile" else model
    bf16 = mode in ("bf16", "compile")
    batch = sz["batch"]

    def step() -> float:
        idx = torch.randint(0, x_all.shape[0], (batch,), generator=gen).to(device)
        with autocast(device, bf16):
            loss = task.loss(run_model, x_all[idx], y_all[idx], gen)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        return float(loss.detach())

    reset_peak(device)
    t0 = time.perf_counter()
    for _ in range(sz["warmup"] + (sz["compile_warmup"] if mode == "compile" else 0)):
        step()
    sync(device)
    warmup_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    losses = [step() for _ in range(sz["steps"])]
    sync(device)
    dt = time.perf_counter() - t0
    return {
        "params": params,
        "batch": batch,
        "steps": sz["steps"],
        "step_ms": 1000.0 * dt / sz["steps"],
        "samples_per_s": batch * sz["steps"] / dt,
        "warmup_s": warmup_s,  # compile: the compilation is in here
        "loss": sum(losses) / len(losses),
        # the scheduler's VRAM figure for this cell at this batch, to hold against the peak
        "sched_estimate_bytes": cell_memory_bytes(spec, CELL, batch),
        "data_bytes": sum(t.numel() * t.element_size() for t in (x_all, y_all)),
        **memory(device),
    }


def train_part(spec: Any, device: torch.device, sz: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for mode in MODES:
        if device.type != "cuda" and mode != "fp32":
            out[mode] = {"status": "skipped", "why": "no CUDA device (the worker trains plain fp32 on CPU)"}
            continue
        out[mode] = part(f"train {mode}", lambda m=mode: train_mode(spec, device, sz, m))  # type: ignore[misc]
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------- 2. one DiLoCo round, two workers


def diloco_round(spec: Any, device: torch.device, sz: dict[str, Any], exchange: str) -> dict[str, Any]:
    from bagel.protocol.messages import Instruction, Member, Order, PeerAddress
    from bagel.worker import ddp
    from bagel.worker.diloco import CellState
    from bagel.worker.roundwork import RoundWork, fresh_feedback, train_round
    from bagel.worker.trainer import InnerPlan, build_runtime

    use_plane = exchange == "dataplane" or (exchange == "auto" and _hivemind_available())
    runtimes = [build_runtime(spec, CELL, device) for _ in range(2)]
    committed = CellState.from_model(runtimes[0].task.build_model())
    plan = InnerPlan(sz["inner_steps"], sz["member_batch"], 1)
    works = [RoundWork(CELL, 1, 1, m, 2, plan, 0) for m in range(2)]
    ctx = ddp.DistContext()
    reset_peak(device)
    t_round = time.perf_counter()
    results: list[Any] = [None, None]
    errors: list[BaseException] = []

    def train(m: int) -> None:  # the two workers share the device, each in its own thread
        try:
            results[m] = train_round(spec.run.id, runtimes[m], committed, works[m], ctx, False, None)
        except BaseException as e:  # noqa: BLE001  (re-raised below, in the main thread)
            errors.append(e)

    threads = [threading.Thread(target=train, args=(m,)) for m in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    sync(device)
    train_s = time.perf_counter() - t_round
    if errors:
        raise errors[0]
    for m, r in enumerate(results):
        if r is None or not r[0].completed:
            raise RuntimeError(f"member {m} did not finish its inner steps")
        works[m].result, works[m].delta = r
    mem = memory(device)
    t_ex = time.perf_counter()
    if use_plane:
        how = "DataPlane.all_reduce (hivemind libp2p, 2 DHT nodes on loopback) via roundwork.reduce_round"
        outcomes = asyncio.run(_exchange_dataplane(spec, committed, works, Instruction, Member, Order, PeerAddress))
    else:
        how = "in-process: parts.prepare_contribution + robust.reduction.reduce_one_part + diloco.outer_step"
        outcomes = _exchange_inprocess(spec, committed, works, fresh_feedback)
    exchange_s = time.perf_counter() - t_ex
    hashes = {o["state_hash"] for o in outcomes}
    samples = sum(w.result.samples for w in works if w.result is not None)
    return {
        "exchange": how,
        "members": 2,
        "inner_steps": plan.inner_steps,
        "member_batch": plan.micro_batch,
        "samples": samples,
        "train_s": train_s,
        "train_samples_per_s": samples / train_s,
        "exchange_s": exchange_s,
        "round_s": time.perf_counter() - t_round,
        # on the data plane: what its streams counted (every part to its primary and its shadow);
        # in process: the encoded contribution (all parts), what would go on the wire once
        "bytes_per_member": [o["bytes"] for o in outcomes],
        "bytes_kind": "sent on the data plane" if use_plane else "encoded contribution (in process, not sent)",
        "state_nbytes": committed.nbytes(),
        "replicas_identical": len(hashes) == 1,
        "state_hash": sorted(hashes)[0],
        "mean_loss": sum(w.result.mean_loss for w in works if w.result is not None) / 2,
        **mem,
    }


def _hivemind_available() -> bool:
    try:
        import hivemind  # noqa: F401
    except ImportError:
        return False
    return True


async def _exchange_dataplane(
    spec: Any, committed: Any, works: list[Any], Instruction: Any, Member: Any, Order: Any, PeerAddress: Any
) -> list[dict[str, Any]]:
    """The worker's exchange path: two data planes on loopback, `reduce_round` for each member."""
    import hivemind

    from bagel.worker.averaging import DataPlane
    from bagel.worker.roundwork import fresh_feedback, reduce_round

    dhts: list[Any] = []
    planes: list[Any] = []
    try:
        for _ in range(2):
            dht = hivemind.DHT(
                start=True,
                host_maddrs=["/ip4/127.0.0.1/tcp/0"],
                initial_peers=list(dhts[0].get_visible_maddrs()) if dhts else [],
            )
            dhts.append(dht)
            plane = DataPlane(await dht.replicate_p2p(), spec.run.id, pending_wait_s=30.0)
            await plane.start()
            planes.append(plane)
        ids = ["w0", "w1"]
        members = tuple(
            Member(
                ids[m],
                PeerAddress(planes[m].peer_id, tuple(str(a) for a in dhts[m].get_visible_maddrs())),
                works[m].result.samples,
            )
            for m in range(2)
        )
        i = Instruction(Order.REDUCE, cell_id=CELL, round=1, contributors=members, reduce_attempt=1, round_attempt=1)
        outs = await asyncio.gather(
            *(
                reduce_round(planes[m], spec, ids[m], committed, works[m], i, fresh_feedback({}), 120.0)
                for m in range(2)
            )
        )
        return [{"state_hash": o.state_hash, "bytes": o.bytes_sent} for o in outs]
    finally:
        for plane in planes:
            await plane.close()
        for dht in dhts:
            dht.shutdown()


def _exchange_inprocess(spec: Any, committed: Any, works: list[Any], fresh_feedback: Any) -> list[dict[str, Any]]:
    """Two replicas in one process: each member's contribution, every part reduced once by the
    shared reduction, and each replica's own outer step from the decoded average."""
    from bagel.compression import get_codec
    from bagel.robust.aggregation import get_reducer
    from bagel.robust.reduction import PartInput, decode_part, reduce_one_part, result_generator
    from bagel.worker.diloco import OuterConfig, outer_step
    from bagel.worker.parts import prepare_contribution

    codec = get_codec(spec.diloco.codec)
    reducer = get_reducer(spec.diloco.aggregation)
    ids = ["w0", "w1"]
    contribs = [
        prepare_contribution(
            w.delta,
            codec,
            2,
            (spec.run.id, CELL, 1, 1, 1, ids[m]),
            weight=float(w.result.samples),
            error_feedback=fresh_feedback({}),
        )
        for m, w in enumerate(works)
    ]
    bounds = contribs[0].bounds
    averaged = []
    for p, (s, e) in enumerate(bounds):
        inputs = [
            PartInput(ids[m], float(works[m].result.samples), works[m].result.samples, c.payloads[p])
            for m, c in enumerate(contribs)
        ]
        red = reduce_one_part(codec, reducer, e - s, inputs, result_generator(spec.run.id, CELL, 1, 1, 1, p))
        averaged.append(decode_part(codec, red.payload, e - s))
    avg = contribs[0].layout.unflatten(torch.cat(averaged))
    cfg = OuterConfig.from_spec(spec.diloco)
    outs = []
    for m in range(2):
        new = committed.clone()
        outer_step(new, {n: t.clone() for n, t in avg.items()}, cfg)
        outs.append({"state_hash": new.state_hash(), "bytes": sum(len(b) for b in contribs[m].payloads)})
    return outs


# ---------------------------------------------------------------- 3. the composed sampler


def sampler_part(spec: Any, device: torch.device, sz: dict[str, Any]) -> dict[str, Any]:
    from bagel.models.compose import from_cells, sample
    from bagel.models.experts import cell_task

    models = {cell: cell_task(spec, cell).build_model().to(device) for cell in spec.cell_ids}
    composed = from_cells(spec, models)
    n, steps = sz["sampler_samples"], sz["sampler_steps"]
    gen = torch.Generator().manual_seed(0)
    noise = torch.randn(n, spec.model.channels, spec.model.image_size, spec.model.image_size, generator=gen)
    noise = noise.to(device)
    labels = (torch.arange(n) % spec.model.num_classes).to(device)
    out: dict[str, Any] = {"cells": sorted(models), "samples": n, "steps": steps}
    for mode in ("fp32", "bf16"):
        if device.type != "cuda" and mode == "bf16":
            out[mode] = {"status": "skipped", "why": "no CUDA device"}
            continue

        def run(bf16: bool = mode == "bf16") -> dict[str, Any]:
            with autocast(device, bf16):
                sample(composed, noise[: min(n, 8)], labels[: min(n, 8)], steps=2)  # warm-up
                sync(device)
                reset_peak(device)
                t0 = time.perf_counter()
                images = sample(composed, noise, labels, steps=steps)
                sync(device)
                dt = time.perf_counter() - t0
            if not bool(torch.isfinite(images.float()).all()):
                raise RuntimeError("the sampler produced non-finite pixels")
            return {"samples_per_s": n / dt, "ms_per_step": 1000.0 * dt / steps, "sample_s": dt, **memory(device)}

        out[mode] = part(f"sampler {mode}", run)
    return out


# ---------------------------------------------------------------- report


def environment(device: torch.device) -> dict[str, Any]:
    env: dict[str, Any] = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda_available": torch.cuda.is_available(),
        "device": str(device),
        "hivemind": _hivemind_available(),
    }
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(gpu=props.name, gpu_total_mem_bytes=int(props.total_memory), cuda=torch.version.cuda)
    try:
        import google.protobuf

        env["protobuf"] = google.protobuf.__version__
    except ImportError:
        env["protobuf"] = None
    return env


def gib(n: Any) -> str:
    return "-" if n is None else f"{n / 2**30:.2f} GiB"


def table(r: dict[str, Any]) -> str:
    lines = [
        f"gpu_check on {r['env']['device']} ({r['env'].get('gpu', 'no GPU')}), torch {r['env']['torch']}; "
        f"cell {r['config']['preset']} on {r['config']['image_size']}x{r['config']['image_size']}"
        f"x{r['config']['channels']}",
    ]
    if not r["gpu_verified"]:
        lines.append("GPU PART UNVERIFIED: no CUDA device; this is the CPU part at tiny sizes (fp32 only).")
    lines += [
        "",
        f"{'train':10} {'status':8} {'samples/s':>10} {'ms/step':>9} {'peak mem':>11} {'sched est':>11} "
        f"{'headroom':>11} {'warm-up s':>9}",
    ]
    for mode, t in r["train"].items():
        if t["status"] != "ok":
            lines.append(f"{mode:10} {t['status']:8} {t.get('why') or t.get('error', '')}")
            continue
        lines.append(
            f"{mode:10} {'ok':8} {t['samples_per_s']:10.1f} {t['step_ms']:9.2f} {gib(t['peak_mem_bytes']):>11} "
            f"{gib(t['sched_estimate_bytes']):>11} {gib(t['headroom_bytes']):>11} {t['warmup_s']:9.1f}"
        )
    d = r["diloco"]
    lines.append("")
    if d["status"] == "ok":
        lines += [
            f"diloco round, 2 workers on one device: {d['inner_steps']} inner steps x batch {d['member_batch']} each; "
            f"train {d['train_s']:.2f} s ({d['train_samples_per_s']:.1f} samples/s together), "
            f"exchange + outer step {d['exchange_s']:.2f} s, round {d['round_s']:.2f} s",
            f"  exchange: {d['exchange']}",
            f"  bytes per member ({d['bytes_kind']}): {d['bytes_per_member']} (state {d['state_nbytes']} B); "
            f"replicas bit-identical: {d['replicas_identical']}; peak mem {gib(d['peak_mem_bytes'])}",
        ]
    else:
        lines.append(f"diloco round: {d['status']}: {d.get('error', '')}")
    s = r["sampler"]
    lines.append("")
    if s["status"] == "ok":
        lines.append(
            f"composed sampler over {len(s['cells'])} cells, {s['samples']} samples x {s['steps']} Euler steps:"
        )
        for mode in ("fp32", "bf16"):
            m = s[mode]
            if m["status"] == "ok":
                lines.append(
                    f"  {mode:5} {m['samples_per_s']:10.1f} samples/s  {m['ms_per_step']:8.2f} ms/step  "
                    f"peak mem {gib(m['peak_mem_bytes'])}"
                )
            else:
                lines.append(f"  {mode:5} {m['status']}: {m.get('why') or m.get('error', '')}")
    else:
        lines.append(f"composed sampler: {s['status']}: {s.get('error', '')}")
    lines.append(f"\ntotal {r['wall_s']:.1f} s")
    return "\n".join(lines)


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    p.add_argument("--json", default="", help="write the results to this JSON file")
    p.add_argument("--device", default="auto", help="auto (CUDA when torch sees one), cpu, or cuda[:N]")
    p.add_argument("--channels", type=int, default=1, help="image channels (default 1, the digits')")
    p.add_argument(
        "--exchange",
        choices=("auto", "dataplane", "inprocess"),
        default="auto",
        help="the DiLoCo round's exchange: the real data plane (needs hivemind), in-process replicas, "
        "or auto (the data plane when hivemind is importable)",
    )
    args = p.parse_args(argv)
    if args.device == "auto":
        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    try:
        dev = torch.device(args.device)
    except RuntimeError:
        p.error(f"--device {args.device}: expected auto, cpu or cuda[:N]")
    if dev.type not in ("cpu", "cuda") or (dev.type == "cuda" and not torch.cuda.is_available()):
        p.error(f"--device {args.device}: this torch sees no such device")
    if not 1 <= args.channels <= 4:
        p.error("--channels must be between 1 and 4")
    args.dev = dev
    return args


def main(argv: list[str] | None = None) -> dict[str, Any]:
    args = parse_args(argv)
    ensure_bagel_importable()
    device: torch.device = args.dev
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(1)  # the CPU part is a smoke run on a shared machine
    sz = sizes(cuda)
    t0 = time.perf_counter()
    result: dict[str, Any] = {
        "bench": "gpu_check",
        "gpu_verified": cuda,
        "note": "measured on a CUDA device"
        if cuda
        else "GPU part unverified: no CUDA device, the CPU part ran at tiny sizes (fp32 only)",
        "env": environment(device),
        "config": {**sz, "channels": args.channels},
    }
    cell_spec = make_spec(sz, args.channels, grid=False)
    result["train"] = train_part(cell_spec, device, sz)
    result["diloco"] = part("diloco", lambda: diloco_round(cell_spec, device, sz, args.exchange))
    result["sampler"] = part("sampler", lambda: sampler_part(make_spec(sz, args.channels, True), device, sz))
    result["wall_s"] = time.perf_counter() - t0
    print(table(result), flush=True)
    if args.json:
        path = Path(args.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(result, indent=2, default=_json_default))
    return result


def _json_default(o: Any) -> Any:
    return str(o)


if __name__ == "__main__":
    main()
