"""Benchmark: a sync by committed updates (1 and 2 rounds behind) against a full download.

The tiny DiT cell (`models/dit.py` preset "tiny", 8x8 digits, with the average of the
committed weights, `[ema] decay = 0.9`) in one process, over real hivemind P2P daemons on
loopback: two members commit rounds 5 and 6 with the real exchange (`reduce_round`,
`--codec`, random pseudo-gradients: the sizes and the work do not depend on the values) and
one of them serves its states and the rounds' updates (`StateServer`); a joiner holding round
4 or 5 reaches round 6 by the updates (`catch_up_from_donors`: fetch, decode, outer steps, the
state hash) and, for comparison, by the full download from the same donor
(`fetch_state_from_donors`, the path `Orders._sync` takes with one donor). Each is timed on
plain loopback (no bandwidth limit: the CPU's time to serialize, hash, decode and step) and
with the donor's uplink capped by the worker's own `UploadPacer` (`--mbps`, as
`bagel-worker join --max-upload-mbps`). Prints a table; `--json FILE` writes the figures.
Not a test.

    .venv/bin/python bench/catch_up_sync.py [--codec int8] [--mbps 0,40] [--repeats 5] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import hivemind
import torch

from bagel.models.dit import DiT, preset_config
from bagel.protocol.runspec import parse_spec
from bagel.worker import pacing
from bagel.worker.averaging import DataPlane
from bagel.worker.diloco import CellState, OuterConfig
from bagel.worker.parts import resolve_codec
from bagel.worker.roundwork import RoundWork, reduce_round
from bagel.worker.statesync import DonorRef, StateServer, catch_up_from_donors, fetch_state_from_donors
from bagel.worker.trainer import InnerPlan, TrainResult

RUN, CELL = "catch-up-bench", "k0.r0"


def spec_for(codec: str) -> Any:
    return parse_spec(
        f'[run]\nid = "{RUN}"\n[diloco]\ncodec = "{codec}"\nerror_feedback = false\naggregation = "mean"\n'
        "[ema]\ndecay = 0.9\n[sync]\ncatch_up_rounds = 2\n"
    )


async def commit_rounds(planes: list[DataPlane], dhts: list[Any], spec: Any, base: CellState) -> list[Any]:
    """Rounds 5 and 6 committed by two members with the real exchange; each outcome per round."""
    contributors = [
        SimpleNamespace(
            worker_id=f"m{i}",
            peer=SimpleNamespace(peer_id=p.peer_id, maddrs=[str(m) for m in d.get_visible_maddrs()]),
            max_samples=100,
            no_reduce=False,
            part_weight=0,
        )
        for i, (p, d) in enumerate(zip(planes, dhts, strict=True))
    ]
    order = SimpleNamespace(reduce_attempt=1, contributors=contributors)
    outs, held = [], [base, base]
    for rnd in (5, 6):
        works = []
        for i in range(2):
            w = RoundWork(CELL, rnd, 1, i, 2, InnerPlan(1, 1, 1), 0)
            w.result = TrainResult(samples=10, mean_loss=0.0, steps=1, compute_s=0.0, completed=True)
            g = torch.Generator().manual_seed(10 * rnd + i)
            w.delta = {n: 1e-3 * torch.randn(t.shape, generator=g) for n, t in base.weights.items()}
            works.append(w)
        got = await asyncio.gather(
            *(
                reduce_round(planes[i], spec, f"m{i}", held[i], works[i], order, None, 60.0,
                             base_hash=held[i].state_hash())
                for i in range(2)
            )
        )  # fmt: skip
        assert got[0].state_hash == got[1].state_hash and got[0].update is not None
        held = [o.state for o in got]
        outs.append(got[0])
    return outs


async def run(codec: str, repeats: int, links: list[float]) -> dict[str, Any]:
    torch.manual_seed(0)
    spec = spec_for(codec)
    cfg = OuterConfig.from_spec(spec.diloco, spec.ema)
    model = DiT(preset_config("tiny"))
    base = CellState.from_model(model, ema=True)
    params = sum(t.numel() for t in base.weights.values())
    dhts: list[Any] = []
    planes: list[DataPlane] = []
    try:
        for _ in range(3):
            initial = dhts[0].get_visible_maddrs() if dhts else []
            dhts.append(hivemind.DHT(start=True, host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial))
        for d in dhts:
            planes.append(DataPlane(await d.replicate_p2p(), RUN))
            await planes[-1].start()
        out5, out6 = await commit_rounds(planes[:2], dhts[:2], spec, base)
        server = StateServer(planes[0].p2p, RUN, keep=3)
        await server.start()
        server.publish(CELL, 5, out5.state, updates=[out5.update])
        server.publish(CELL, 6, out6.state, updates=[out6.update])
        donor = DonorRef(planes[0].peer_id, tuple(str(m) for m in dhts[0].get_visible_maddrs()), 0.0, "donor")
        joiner = planes[2].p2p
        rows: list[dict[str, Any]] = []
        for mbps in links:
            pacing.install(pacing.UploadPacer.from_mbps(mbps) if mbps > 0 else None)
            try:
                rows += await measure(joiner, donor, codec, cfg, repeats, base, out5, out6, mbps)
            finally:
                pacing.install(None)
        await server.close()
    finally:
        for p in planes:
            await p.close()
        for d in dhts:
            d.shutdown()
    for r in rows:
        full = next(x for x in rows if x["link_mbps"] == r["link_mbps"] and x["rounds"] == 0)
        r["bytes_ratio"] = round(r["bytes"] / full["bytes"], 4)
        r["time_ratio"] = round(r["s"] / full["s"], 3)
    for r in rows:
        r["s"] = round(r["s"], 4)
    return {"cell": "tiny DiT (8x8, 1 channel, 10 classes), with its average", "params": params,
            "codec": resolve_codec(codec).name, "repeats": repeats, "rows": rows}  # fmt: skip


async def measure(
    joiner: Any,
    donor: DonorRef,
    codec: str,
    cfg: OuterConfig,
    repeats: int,
    base: CellState,
    out5: Any,
    out6: Any,
    mbps: float,
) -> list[dict[str, Any]]:
    """The full download of round 6, and the catch-ups from rounds 5 and 4: medians of `repeats`."""
    want = out6.state_hash
    rows: list[dict[str, Any]] = []
    full_s, full_nbytes = [], 0
    for _ in range(repeats):
        t0 = time.perf_counter()
        got = await fetch_state_from_donors(
            joiner, [donor], run_id=RUN, cell_id=CELL, committed_round=6, state_hash=want, max_nbytes=1 << 30
        )
        full_s.append(time.perf_counter() - t0)
        full_nbytes = got.synced.nbytes
        assert got.synced.state_hash == want
    rows.append({"link_mbps": mbps, "sync": "full download", "rounds": 0, "bytes": full_nbytes,
                 "s": statistics.median(full_s)})  # fmt: skip
    for behind, held in ((1, out5.state), (2, base)):
        times, nbytes = [], 0
        for _ in range(repeats):
            t0 = time.perf_counter()
            caught = await catch_up_from_donors(
                joiner, [donor], run_id=RUN, cell_id=CELL, held=held, held_round=6 - behind,
                held_hash=held.state_hash(), committed_round=6, state_hash=want,
                codec=resolve_codec(codec), cfg=cfg, max_nbytes=held.nbytes(),
            )  # fmt: skip
            times.append(time.perf_counter() - t0)
            nbytes = caught.nbytes
            assert caught.state.to_safetensors() == out6.state.to_safetensors() and not caught.failed
        rows.append({"link_mbps": mbps, "sync": f"updates, {behind} round{'s' if behind > 1 else ''}",
                     "rounds": behind, "bytes": nbytes, "s": statistics.median(times)})  # fmt: skip
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--mbps", default="0,40", help="donor uplink caps to time at, Mbit/s (0: none)")
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    res = asyncio.run(run(args.codec, args.repeats, [float(x) for x in args.mbps.split(",")]))
    print(f"\nsync to round 6 of the {res['cell']}: {res['params']} parameters, codec {res['codec']}, "
          f"loopback, median of {res['repeats']}")  # fmt: skip
    print(f"{'donor uplink':<14}{'sync':<20}{'bytes':>12}{'x full':>9}{'seconds':>10}{'x full':>9}")
    for r in res["rows"]:
        link = f"{r['link_mbps']:g} Mbit/s" if r["link_mbps"] > 0 else "uncapped"
        print(f"{link:<14}{r['sync']:<20}{r['bytes']:>12}{r['bytes_ratio']:>9.3f}{r['s']:>10.4f}"
              f"{r['time_ratio']:>9.2f}")  # fmt: skip
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
