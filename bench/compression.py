"""Benchmark Bagel's codecs against hivemind's on the same tensors.

For every codec and data set (Gaussian, Student-t with df=3) it reports bytes per value
(everything on the wire: header, scales, CRC), relative L2 error, and encode and decode
throughput in GB/s of float32 input (best of ``--reps`` timed runs after one warm-up;
decode includes allocating the output tensor, as callers get it; ``dec->out`` is our decode
into a reused buffer, ``decode(buf, out=...)``, which shows what page-faulting a fresh
64 MiB output costs; ``enc/cpu`` and ``dec/cpu`` divide by the CPU seconds the process
used instead of wall-clock time, which a machine shared with other work distorts less,
especially with ``--threads 1``). It prints a table and,
with ``--json FILE``, writes ``{"meta": {...}, "targets": {...}, "rows": [...]}``.

hivemind's ``Uniform8BitQuantization`` and ``Quantile8BitQuantization`` break under
numpy >= 2.4, which the main environment has. They are measured in a side environment:
a venv at ``--side-venv`` (default ``bench-out/hivemind-np-venv``) with ``numpy<2.4``,
``torch==2.13.0`` and ``hivemind==1.1.12``, created once with pip and reused. This file is
run there as ``--hivemind-worker`` on the very same arrays (passed as .npy files) and
prints JSON rows. If the side environment cannot be built, those rows are reported as
unavailable, with the reason. ``Float16Compression`` and ``ScaledFloat16Compression`` run in
the main environment. The ``env`` column says where each row ran.

Usage::

    .venv/bin/python bench/compression.py                 # 16M values, the full table
    .venv/bin/python bench/compression.py --quick         # 1M values, 2 reps: a smoke run
    .venv/bin/python bench/compression.py --json bench-out/compression.json --threads 2

Not a test: nothing here is asserted. The "targets" block only reports the issue's goals.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch

OURS = ["fp32", "fp16", "bf16", "int8", "int8:stochastic", "int4", "int4:stochastic", "topk:0.01"]
HIVEMIND_MAIN = ["Float16Compression", "ScaledFloat16Compression"]
HIVEMIND_8BIT = ["Uniform8BitQuantization", "Quantile8BitQuantization"]
DATA = ["gaussian", "student_t"]
SIDE_REQUIREMENTS = ["numpy<2.4", "torch==2.13.0", "hivemind==1.1.12"]
ROOT = Path(__file__).resolve().parent.parent
T = TypeVar("T")


def make_data(kind: str, n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if kind == "gaussian":
        return rng.standard_normal(n, dtype=np.float32)
    if kind == "student_t":
        return rng.standard_t(3, size=n).astype(np.float32)
    raise ValueError(f"unknown data kind {kind!r}")


def best_time(fn: Callable[[], T], reps: int) -> tuple[float, float, T]:
    """(best wall-clock seconds, best CPU seconds, result)."""
    out = fn()  # warm-up (and the result we check)
    best, best_cpu = float("inf"), float("inf")
    for _ in range(reps):
        c0, t0 = time.process_time(), time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
        best_cpu = min(best_cpu, time.process_time() - c0)
    return best, best_cpu, out


def row(
    codec: str,
    impl: str,
    data: str,
    n: int,
    nbytes: int,
    x: torch.Tensor,
    y: torch.Tensor,
    t_enc: tuple[float, float],
    t_dec: tuple[float, float],
    env: str,
) -> dict:
    """One result row; ``t_enc``/``t_dec`` are (wall, cpu) seconds."""
    y = y.to(torch.float32).reshape(x.shape)
    rel = float(torch.linalg.vector_norm((y - x).double()) / torch.linalg.vector_norm(x.double()))
    gb = 4.0 * n / 1e9
    return {
        "codec": codec,
        "impl": impl,
        "data": data,
        "bytes_per_value": nbytes / n,
        "rel_error": rel,
        "encode_gbps": gb / t_enc[0],
        "decode_gbps": gb / t_dec[0],
        # Input bytes per CPU-second of this process (all threads): robust to a shared machine.
        "encode_cpu_gbps": gb / max(t_enc[1], 1e-9),
        "decode_cpu_gbps": gb / max(t_dec[1], 1e-9),
        "env": env,
    }


def measure_hivemind(name: str, x: torch.Tensor, data: str, reps: int, env: str) -> dict:
    import hivemind.compression as hc
    from hivemind.compression.base import CompressionInfo

    comp = getattr(hc, name)()
    info = CompressionInfo.from_tensor(x)
    t_enc, c_enc, msg = best_time(lambda: comp.compress(x, info), reps)
    t_dec, c_dec, y = best_time(lambda: comp.extract(msg), reps)
    return row(name, "hivemind", data, x.numel(), len(msg.buffer), x, y, (t_enc, c_enc), (t_dec, c_dec), env)


def measure_ours(name: str, x: torch.Tensor, data: str, reps: int) -> dict:
    from bagel.compression import decode, get_codec

    codec = get_codec(name)
    gen = torch.Generator().manual_seed(0)
    t_enc, c_enc, buf = best_time(lambda: codec.encode(x, generator=gen), reps)
    t_dec, c_dec, y = best_time(lambda: decode(buf), reps)
    out = torch.empty(x.numel(), dtype=torch.float32)
    t_reuse, _, _ = best_time(lambda: decode(buf, out=out), reps)
    r = row(codec.name, "bagel", data, x.numel(), len(buf), x, y, (t_enc, c_enc), (t_dec, c_dec), "main")
    r["decode_into_out_gbps"] = 4.0 * x.numel() / 1e9 / t_reuse  # decode(buf, out=reused buffer)
    return r


def unavailable(name: str, data: str, reason: str) -> dict:
    return {
        "codec": name,
        "impl": "hivemind",
        "data": data,
        "bytes_per_value": None,
        "rel_error": None,
        "encode_gbps": None,
        "decode_gbps": None,
        "encode_cpu_gbps": None,
        "decode_cpu_gbps": None,
        "env": "unavailable",
        "note": reason,
    }


def works_here(name: str) -> str | None:
    """None if hivemind's codec round-trips in this environment, else the error."""
    try:
        import hivemind.compression as hc
        from hivemind.compression.base import CompressionInfo

        x = torch.randn(4096)
        comp = getattr(hc, name)()
        comp.extract(comp.compress(x, CompressionInfo.from_tensor(x)))
        return None
    except Exception as e:  # noqa: BLE001 - any failure means "run it elsewhere"
        return f"{type(e).__name__}: {e}"


def side_python(venv_dir: Path, log: Callable[[str], None]) -> tuple[Path | None, str]:
    """The side venv's python, creating the venv once; (None, reason) if that fails."""
    py = venv_dir / "bin" / "python"
    ready = venv_dir / ".ready"
    if ready.exists() and py.exists():
        return py, "cached"
    log(f"creating side environment {venv_dir} ({', '.join(SIDE_REQUIREMENTS)}); one-time, takes minutes")
    try:
        subprocess.run(
            [sys.executable, "-m", "venv", "--clear", str(venv_dir)],
            check=True,
            capture_output=True,
            text=True,
            timeout=300,
        )
        subprocess.run(
            [str(py), "-m", "pip", "install", "-q", *SIDE_REQUIREMENTS],
            check=True,
            capture_output=True,
            text=True,
            timeout=1800,
        )
        check = "import numpy, hivemind, torch; assert tuple(map(int, numpy.__version__.split('.')[:2])) < (2, 4)"
        subprocess.run([str(py), "-c", check], check=True, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.SubprocessError) as e:
        detail = getattr(e, "stderr", "") or ""
        return None, f"side env failed: {type(e).__name__}: {detail.strip().splitlines()[-1] if detail.strip() else e}"
    ready.write_text(" ".join(SIDE_REQUIREMENTS) + "\n")
    return py, "created"


def run_side(py: Path, data_dir: Path, names: list[str], reps: int, threads: int) -> tuple[list[dict], str | None]:
    cmd = [str(py), str(Path(__file__).resolve()), "--hivemind-worker", "--data-dir", str(data_dir)]
    cmd += ["--codecs", ",".join(names), "--reps", str(reps), "--threads", str(threads)]
    try:
        out = subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=3600)
    except subprocess.CalledProcessError as e:
        tail = (e.stderr or "").strip().splitlines()
        return [], f"side run failed: {tail[-1] if tail else e}"
    except subprocess.TimeoutExpired:
        return [], "side run timed out"
    return json.loads(out.stdout.strip().splitlines()[-1]), None


def worker_main(args: argparse.Namespace) -> int:
    """Side-environment mode: measure hivemind codecs on the .npy files, print JSON rows."""
    torch.set_num_threads(args.threads)
    env = f"side (numpy {np.__version__})"
    rows = []
    for data in DATA:
        x = torch.from_numpy(np.load(Path(args.data_dir) / f"{data}.npy"))
        for name in args.codecs.split(","):
            rows.append(measure_hivemind(name, x, data, args.reps, env))
    print(json.dumps(rows))
    return 0


def format_table(rows: list[dict]) -> str:
    head = (
        f"{'codec':26} {'impl':8} {'data':9} {'bytes/val':>9} {'rel L2 err':>10} {'enc GB/s':>8} {'dec GB/s':>8}"
        f" {'dec->out':>8} {'enc/cpu':>8} {'dec/cpu':>8}  env"
    )
    lines = [head, "-" * len(head)]
    for r in rows:
        if r["bytes_per_value"] is None:
            dashes = " ".join(f"{'-':>8}" for _ in range(5))
            lines.append(
                f"{r['codec']:26} {r['impl']:8} {r['data']:9} {'-':>9} {'-':>10} {dashes}  unavailable: {r['note']}"
            )
            continue
        reuse = f"{r['decode_into_out_gbps']:.3f}" if "decode_into_out_gbps" in r else "-"
        lines.append(
            f"{r['codec']:26} {r['impl']:8} {r['data']:9} {r['bytes_per_value']:9.4f} {r['rel_error']:10.3e}"
            f" {r['encode_gbps']:8.3f} {r['decode_gbps']:8.3f} {reuse:>8}"
            f" {r['encode_cpu_gbps']:8.3f} {r['decode_cpu_gbps']:8.3f}  {r['env']}"
        )
    return "\n".join(lines)


def targets(rows: list[dict]) -> dict:
    """The issue's goals, computed from the rows (reported, never asserted)."""

    def get(codec: str, impl: str, data: str) -> dict | None:
        return next((r for r in rows if r["codec"] == codec and r["impl"] == impl and r["data"] == data), None)

    out: dict = {}
    for data in DATA:
        ours, theirs = get("int8:block=256", "bagel", data), get("Uniform8BitQuantization", "hivemind", data)
        if ours and theirs and theirs["encode_gbps"]:
            out[f"int8_encode_speedup_vs_uniform8bit_{data}"] = ours["encode_gbps"] / theirs["encode_gbps"]
            out[f"int8_lower_error_than_uniform8bit_{data}"] = ours["rel_error"] < theirs["rel_error"]
        if ours and theirs and theirs["encode_cpu_gbps"]:
            out[f"int8_encode_cpu_speedup_vs_uniform8bit_{data}"] = ours["encode_cpu_gbps"] / theirs["encode_cpu_gbps"]
        if ours:
            e, d = ours["encode_gbps"], ours["decode_gbps"]
            out[f"int8_encode_plus_decode_gbps_{data}"] = 1.0 / (1.0 / e + 1.0 / d)
            e, d = ours["encode_cpu_gbps"], ours["decode_cpu_gbps"]
            out[f"int8_encode_plus_decode_cpu_gbps_{data}"] = 1.0 / (1.0 / e + 1.0 / d)
        int4 = get("int4:block=128", "bagel", data)
        if int4:
            out[f"int4_bytes_per_value_{data}"] = int4["bytes_per_value"]
    # Goals judged on wall-clock time (the measure); the *_cpu_* entries are context.
    speedups = [v for k, v in out.items() if k.startswith("int8_encode_speedup")]
    out["goal_int8_encode_4x_uniform8bit"] = bool(speedups) and min(speedups) >= 4.0
    out["goal_int8_lower_error"] = all(v for k, v in out.items() if k.startswith("int8_lower_error")) and bool(speedups)
    out["goal_int4_at_most_0.55_bytes"] = all(v <= 0.55 for k, v in out.items() if k.startswith("int4_bytes"))
    out["goal_int8_encode_plus_decode_1gbps"] = all(
        v >= 1.0 for k, v in out.items() if k.startswith("int8_encode_plus")
    )
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--numel", type=int, default=16 * 2**20, help="values per tensor (default 16M = 16777216)")
    p.add_argument("--quick", action="store_true", help="short run: 1M values and 2 reps (overrides --numel/--reps)")
    p.add_argument("--reps", type=int, default=3, help="timed repetitions per measurement; the best is reported")
    p.add_argument("--threads", type=int, default=2, help="torch intra-op threads (the target machine has 2 cores)")
    p.add_argument("--json", type=Path, default=None, help="write the rows and targets to this JSON file")
    p.add_argument("--codecs", default=",".join(OURS), help="comma-separated Bagel codec names to measure")
    p.add_argument("--no-hivemind", action="store_true", help="skip all hivemind rows")
    p.add_argument(
        "--side-venv",
        type=Path,
        default=ROOT / "bench-out" / "hivemind-np-venv",
        help="side environment for hivemind's 8-bit codecs (created once)",
    )
    p.add_argument("--no-side-env", action="store_true", help="do not create or use the side environment")
    p.add_argument(
        "--no-thp",
        action="store_true",
        help="do not back large tensors with transparent huge pages (THP_MEM_ALLOC_ENABLE; the worker sets it)",
    )
    p.add_argument("--hivemind-worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--data-dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if not args.no_thp:
        # as `bagel-worker` does: torch reads it at its first large allocation. Decoding into a
        # fresh 64 MB tensor is otherwise dominated by 4 KiB page faults. Inherited by the
        # hivemind side process, so both sides are measured alike.
        os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")
    if args.hivemind_worker:
        return worker_main(args)
    if args.quick:
        args.numel, args.reps = 1 << 20, 2

    torch.set_num_threads(args.threads)
    sys.path.insert(0, str(ROOT))  # not needed once installed; lets `python bench/compression.py` work anyway

    def log(msg: str) -> None:
        print(f"[bench] {msg}", file=sys.stderr, flush=True)

    n = args.numel
    arrays = {d: make_data(d, n, seed=i) for i, d in enumerate(DATA)}
    rows: list[dict] = []
    for data in DATA:
        x = torch.from_numpy(arrays[data])
        for name in args.codecs.split(","):
            log(f"bagel {name} on {data}")
            rows.append(measure_ours(name, x, data, args.reps))
        if not args.no_hivemind:
            for name in HIVEMIND_MAIN:
                log(f"hivemind {name} on {data}")
                rows.append(measure_hivemind(name, x, data, args.reps, "main"))

    side_note = None
    if not args.no_hivemind:
        here = [nm for nm in HIVEMIND_8BIT if works_here(nm) is None]
        elsewhere = [nm for nm in HIVEMIND_8BIT if nm not in here]
        for data in DATA:
            x = torch.from_numpy(arrays[data])
            for name in here:
                log(f"hivemind {name} on {data} (main env)")
                rows.append(measure_hivemind(name, x, data, args.reps, "main"))
        if elsewhere:
            reason = f"broken in the main env (numpy {np.__version__}): {works_here(elsewhere[0])}"
            py, status = (
                (None, "side env disabled (--no-side-env)") if args.no_side_env else side_python(args.side_venv, log)
            )
            side_rows: list[dict] = []
            if py is not None:
                with tempfile.TemporaryDirectory(
                    dir=ROOT / "bench-out" if (ROOT / "bench-out").is_dir() else None
                ) as tmp:
                    for data in DATA:
                        np.save(Path(tmp) / f"{data}.npy", arrays[data])
                    log(f"hivemind {', '.join(elsewhere)} in the side environment ({status})")
                    side_rows, err = run_side(py, Path(tmp), elsewhere, args.reps, args.threads)
                if err:
                    status = err
            if side_rows:
                rows.extend(side_rows)
                side_note = f"{', '.join(elsewhere)}: {reason}; measured in side venv {args.side_venv}"
            else:
                side_note = f"{', '.join(elsewhere)}: {reason}; side env unavailable: {status}"
                rows.extend(unavailable(nm, d, status) for d in DATA for nm in elsewhere)

    order = {d: i for i, d in enumerate(DATA)}
    rows.sort(key=lambda r: (order[r["data"]], r["impl"] != "bagel"))
    result_targets = targets(rows)
    print(
        f"\n{n} values per tensor, {args.threads} torch threads, THP {'off' if args.no_thp else 'on'}, "
        f"best of {args.reps}; torch {torch.__version__}, numpy {np.__version__}, {platform.machine()}"
    )
    print(format_table(rows))
    if side_note:
        print(f"\nnote: {side_note}")
    print(
        "\ntargets: "
        + ", ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in result_targets.items())
    )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {
            "numel": n,
            "threads": args.threads,
            "reps": args.reps,
            "torch": torch.__version__,
            "numpy": np.__version__,
            "machine": platform.machine(),
            "cpus": os.cpu_count(),
            "side_env": side_note,
        }
        args.json.write_text(json.dumps({"meta": meta, "targets": result_targets, "rows": rows}, indent=2) + "\n")
        log(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
