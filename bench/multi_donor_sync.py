"""Benchmark: how long a joiner's state sync takes from k = 1, 2, 4 donors on capped uplinks.

One committed cell state of `--mb` MB (fp32 weights and outer momentum, seeded, so every
donor process builds the same state and serializes it to the same bytes) is served by four
real donor processes, each its own hivemind P2P daemon with a real `StateServer`; a real
joiner process fetches it with `fetch_state_from_donors` from the first k donors (k = 1 is
the single-stream path, `fetch_state`), verifying sha256 and the state hash as a worker
does, and the time of the whole call is what the table shows.

Where each donor's uplink is capped:
- `--mode netlab` (the default where the machine allows it; root): on the network test bed
  (sim/netlab/, tag "ms"), donors in pub1..pub4, each link's `up` direction shaped by tbf to
  `--link` Mbit/s, the joiner in `coord`, unshaped;
- `--mode pacer` (elsewhere): on loopback, each donor process sends through the worker's own
  `UploadPacer` token bucket at `--link` Mbit/s (`bagel-worker join --max-upload-mbps`).

The claim checked: time(k) <= 1.3 / k x time(1). Prints a table; `--json FILE` writes the
figures. Not a test.

`--state-dtype bf16|fp16` (`[sync] state_dtype`): the same parameters with the committed
state on that grid, so the file the donors serve and the joiner verifies is half the bytes
(`--mb` is always the fp32 state's size); compare a run of each at the same `--mb`.

    sudo .venv/bin/python bench/multi_donor_sync.py [--mb 128] [--link 40] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bagel.sim.netlab.bed import NetLab, missing_prerequisite

RUN = "msync-bench"
CELL = "k0.r0"
ROUND = 7
DONORS = 4
PORT = 7100


def build_state(mb: float, seed: int, dtype: str = "fp32") -> Any:
    """A seeded committed state of about `mb` MB in fp32 (half weights, half outer momentum),
    rounded onto `dtype` (half the bytes in bf16 or fp16)."""
    import torch

    from bagel.worker.diloco import STATE_DTYPES, CellState

    n = int(mb * 1e6 / 8)  # 4 bytes of weight and 4 of momentum per parameter
    g = torch.Generator().manual_seed(seed)
    rows = max(1, n // 1024)
    w = {"blocks.0.weight": torch.randn(rows, 1024, generator=g), "blocks.0.bias": torch.randn(1024, generator=g)}
    m = {k: 0.01 * torch.randn(t.shape, generator=g) for k, t in w.items()}
    return CellState(w, m, dtype=STATE_DTYPES[dtype])


async def _donor(ip: str, addr_file: str, mb: float, mbps: float, dtype: str) -> None:
    """Serve the state from a P2P daemon on ip; write `maddr hash nbytes` to addr_file."""
    import asyncio

    from hivemind.p2p import P2P

    from bagel.worker import pacing
    from bagel.worker.statesync import StateServer

    if mbps > 0:
        pacing.install(pacing.UploadPacer.from_mbps(mbps))
    state = build_state(mb, seed=0, dtype=dtype)
    p2p = await P2P.create(host_maddrs=[f"/ip4/{ip}/tcp/{PORT if ip != '127.0.0.1' else 0}"])
    server = StateServer(p2p, RUN, chunk_nbytes=1 << 20)
    await server.start()
    want = server.publish(CELL, ROUND, state)
    nbytes = len(state.to_safetensors())
    maddr = (await p2p.get_visible_maddrs())[0]
    tmp = Path(addr_file + ".tmp")
    tmp.write_text(f"{maddr}/p2p/{p2p.peer_id.to_base58()} {want} {nbytes}")
    tmp.rename(addr_file)
    await asyncio.sleep(3600)


async def _joiner(ip: str, donors_file: str, ks: str, repeats: int, link_mbps: float, out: str, dtype: str) -> None:
    """Fetch the state from the first k donors for each k; write the timings as JSON."""
    from hivemind.p2p import P2P

    from bagel.worker.diloco import STATE_DTYPES
    from bagel.worker.statesync import DonorRef, fetch_state_from_donors

    lines = [ln.split() for ln in Path(donors_file).read_text().splitlines() if ln.strip()]
    want, nbytes = lines[0][1], int(lines[0][2])
    assert all(ln[1] == want and int(ln[2]) == nbytes for ln in lines), "the donors built different states"
    refs = []
    for i, (full, _, _) in enumerate(lines):
        maddr, _, pid = full.rpartition("/p2p/")
        refs.append(DonorRef(pid, (maddr,), link_mbps * 1e6 / 8, f"donor{i + 1}"))
    p2p = await P2P.create(host_maddrs=[f"/ip4/{ip}/tcp/{PORT if ip != '127.0.0.1' else 0}"])
    rows = []
    try:
        for rep in range(repeats):
            for k in (int(x) for x in ks.split(",")):
                t0 = time.perf_counter()
                got = await fetch_state_from_donors(
                    p2p, refs[:k], run_id=RUN, cell_id=CELL, committed_round=ROUND, state_hash=want,
                    max_nbytes=nbytes, timeout_s=600.0, dtype=STATE_DTYPES[dtype],
                )  # fmt: skip
                s = time.perf_counter() - t0
                assert got.synced.state_hash == want and got.synced.nbytes == nbytes
                rows.append({"k": k, "repeat": rep, "s": round(s, 3), "bytes_by_donor": got.nbytes_by_donor,
                             "failed": got.failed})  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    finally:
        await p2p.shutdown()
    Path(out).write_text(json.dumps({"state_nbytes": nbytes, "state_hash": want, "rows": rows}))


def _wait_files(paths: list[Path], procs: list[subprocess.Popen[Any]], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while not all(p.exists() for p in paths):
        dead = [p for p in procs if p.poll() is not None]
        if dead:
            raise RuntimeError(f"a donor exited with {dead[0].returncode} before it served")
        if time.monotonic() > deadline:
            raise RuntimeError("the donors did not come up in time")
        time.sleep(0.2)


def run(mode: str, mb: float, link: float, ks: str, repeats: int, root: Path, dtype: str = "fp32") -> dict[str, Any]:
    py, me = sys.executable, str(Path(__file__).resolve())
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    addrs = [root / f"donor{i}.addr" for i in range(1, DONORS + 1)]
    donors_file, out = root / "donors", root / "joiner.json"

    def start_all(start: Any, ip_of: Any, pace: float) -> None:
        procs = []
        for i, addr in enumerate(addrs, start=1):
            with open(root / f"donor{i}.log", "w") as f:
                argv = [py, me, "_donor", ip_of(i), str(addr), str(mb), str(pace), dtype]
                procs.append(start(i, argv, stdout=f, stderr=subprocess.STDOUT, env=env))
        _wait_files(addrs, procs, 300)
        donors_file.write_text("\n".join(a.read_text() for a in addrs) + "\n")

    jargv = [py, me, "_joiner", "", str(donors_file), ks, str(repeats), str(link), str(out), dtype]
    if mode == "netlab":
        with NetLab(tag="ms", homes=0, per_home=0, public=DONORS) as lab:
            for i in range(1, DONORS + 1):
                lab.shape(f"pub{i}", rate_mbit=link, direction="up")
            start_all(lambda i, argv, **kw: lab.run_in(f"pub{i}", argv, **kw), lambda i: lab.ip(f"pub{i}"), 0.0)
            jargv[3] = lab.ip("coord")
            with open(root / "joiner.log", "w") as f:
                joiner = lab.run_in("coord", jargv, stdout=f, stderr=subprocess.STDOUT, env=env)
                joiner.wait(timeout=900)
    else:
        procs: list[subprocess.Popen[Any]] = []
        try:

            def spawn(i: int, argv: list[str], **kw: Any) -> subprocess.Popen[Any]:
                procs.append(subprocess.Popen(argv, start_new_session=True, **kw))
                return procs[-1]

            start_all(spawn, lambda i: "127.0.0.1", link)
            jargv[3] = "127.0.0.1"
            with open(root / "joiner.log", "w") as f:
                spawn(0, jargv, stdout=f, stderr=subprocess.STDOUT, env=env).wait(timeout=900)
        finally:
            for p in procs:
                if p.poll() is None:
                    os.killpg(p.pid, 15)
                    p.wait(timeout=10)
    if not out.exists():
        raise RuntimeError("the joiner failed:\n" + (root / "joiner.log").read_text()[-3000:])
    result: dict[str, Any] = json.loads(out.read_text())
    return result


def main() -> int:
    if len(sys.argv) > 1 and sys.argv[1] in ("_donor", "_joiner"):
        import asyncio

        v = sys.argv[2:]
        if sys.argv[1] == "_donor":
            asyncio.run(_donor(v[0], v[1], float(v[2]), float(v[3]), v[4]))
        else:
            asyncio.run(_joiner(v[0], v[1], v[2], int(v[3]), float(v[4]), v[5], v[6]))
        return 0
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mb", type=float, default=128.0, help="the fp32 state's size in MB (default 128)")
    ap.add_argument(
        "--state-dtype",
        choices=("fp32", "bf16", "fp16"),
        default="fp32",
        help="the committed state's dtype ([sync] state_dtype): bf16/fp16 serve half the bytes",
    )
    ap.add_argument("--link", type=float, default=40.0, help="each donor's uplink cap, Mbit/s (default 40)")
    ap.add_argument("--ks", default="1,2,4", help="donor counts to time, in order (default 1,2,4)")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--mode", choices=("auto", "netlab", "pacer"), default="auto")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--keep", type=Path, help="keep the logs here (default: a temporary folder)")
    a = ap.parse_args()
    ks = [int(x) for x in a.ks.split(",")]
    if a.mb <= 0 or a.link <= 0 or a.repeats < 1 or not all(1 <= k <= DONORS for k in ks):
        print(f"multi_donor_sync: --mb, --link, --repeats positive; each k in 1..{DONORS}", file=sys.stderr)
        return 2
    mode = a.mode
    reason = missing_prerequisite()
    if mode == "auto":
        mode = "pacer" if reason else "netlab"
    elif mode == "netlab" and reason:
        print(f"multi_donor_sync: {reason}", file=sys.stderr)
        return 1
    with tempfile.TemporaryDirectory(prefix="msync-") as tmp:
        root = a.keep or Path(tmp)
        root.mkdir(parents=True, exist_ok=True)
        got = run(mode, a.mb, a.link, a.ks, a.repeats, root, a.state_dtype)
    rows = got["rows"]
    best = {k: min(r["s"] for r in rows if r["k"] == k) for k in ks}
    base = best.get(1)
    ideal = got["state_nbytes"] * 8 / (a.link * 1e6)
    cap_where = "tbf on each donor's uplink (netlab)" if mode == "netlab" else "each donor's UploadPacer (loopback)"
    print(
        f"state {got['state_nbytes'] / 1e6:.1f} MB ({a.state_dtype}), donor uplinks {a.link:g} Mbit/s, "
        f"capped by {cap_where}"
    )
    print(
        f"{'k':>2s} {'time s':>8s} {'t(k)/t(1)':>9s} {'bound 1.3/k':>11s} {'ok':>3s} {'ideal s':>8s}"
        "  MB from each donor"
    )
    summary = []
    for k in ks:
        ratio = best[k] / base if base else None
        ok = ratio is not None and ratio <= 1.3 / k
        shares = next(r["bytes_by_donor"] for r in rows if r["k"] == k and r["s"] == best[k])
        mbs = " ".join(f"{v / 1e6:.1f}" for v in shares.values())
        print(f"{k:2d} {best[k]:8.2f} {ratio if ratio is not None else float('nan'):9.3f} {1.3 / k:11.3f} "
              f"{'yes' if ok else 'NO':>3s} {ideal / k:8.2f}  {mbs}")  # fmt: skip
        summary.append({"k": k, "time_s": best[k], "ratio": ratio, "bound": 1.3 / k, "ok": ok})
    if a.json:
        doc = {"mode": mode, "mb": a.mb, "state_dtype": a.state_dtype, "link_mbps": a.link,
               "state_nbytes": got["state_nbytes"], "runs": rows, "summary": summary}  # fmt: skip
        a.json.write_text(json.dumps(doc, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
