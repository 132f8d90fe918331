"""Benchmark: what verified reducers cost in bytes and time, over real hivemind P2P peers.

One group exchange of a delta of N float32 elements among k peers on loopback, with the
run's codec, unverified (one reducer per part, no signatures) and verified (a primary and
a shadow per part, signed contributions and receipts); bytes are the data plane's own
counters per member (sent + received, mean over members), time is the exchange's wall
time (median of the repeats). Also the CPU time of the coordinator's check of one
accusation (`adjudicate`: signatures, then one part's reduction re-run). Prints a table;
`--json FILE` writes the figures. Never asserted in tests.

    python bench/verified_reducers.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from bagel.compression import get_codec  # noqa: E402
from bagel.robust.aggregation import get_reducer  # noqa: E402
from bagel.robust.evidence import adjudicate, parse_evidence  # noqa: E402
from bagel.worker.averaging import ExchangeResult, ReducersDisagree  # noqa: E402

from dataplane_peers import RUN_ID, peers  # type: ignore[import-not-found]  # noqa: E402  (tests/ on the path)


async def one(k: int, numel: int, codec: str, signed: bool, repeats: int, doctor: bool = False) -> dict[str, Any]:
    async with peers(k, signed=signed, doctors={1: 1e3} if doctor else None) as ps:
        cs = [p.contributor() for p in ps]
        times, bytes_per_member = [], []
        last: list[Any] = []
        for rnd in range(1, repeats + 1):
            g = torch.Generator().manual_seed(rnd)
            deltas = [{"w": torch.randn(numel, generator=g)} for _ in ps]
            t0 = time.perf_counter()
            last = await asyncio.gather(
                *(
                    p.plane.all_reduce(
                        worker_id=p.worker_id,
                        cell_id="k0.r0",
                        round=rnd,
                        round_attempt=1,
                        reduce_attempt=1,
                        contributors=cs,
                        delta=deltas[i],
                        weight=10.0,
                        codec=codec,
                        timeout_s=120.0,
                    )
                    for i, p in enumerate(ps)
                ),
                return_exceptions=True,
            )
            times.append(time.perf_counter() - t0)
            ok = [r for r in last if isinstance(r, ExchangeResult)]
            if ok:
                bytes_per_member.append(statistics.mean(r.bytes_sent + r.bytes_received for r in ok))
        out: dict[str, Any] = {
            "k": k,
            "numel": numel,
            "codec": codec,
            "verified": signed,
            "exchange_s": statistics.median(times),
            "bytes_per_member": statistics.mean(bytes_per_member) if bytes_per_member else 0.0,
        }
        if doctor:
            # the accusation of the doctoring peer 1 (peer 1 also accuses the honest shadow: refuted)
            holder, req = next(
                (i, e)
                for i, r in enumerate(last)
                if isinstance(r, ReducersDisagree)
                for e in r.evidence
                if parse_evidence(e).receipt.reducer == ps[1].worker_id
            )
            members = [(c.worker_id, c.peer_id, c.max_samples) for c in cs]
            t0 = time.perf_counter()
            conviction = adjudicate(
                parse_evidence(req),
                run_id=RUN_ID,
                accuser=ps[holder].worker_id,
                members=members,
                codec=get_codec(codec),
                reducer=get_reducer("mean"),
            )
            out["adjudicate_s"] = time.perf_counter() - t0
            out["evidence_bytes"] = req.ByteSize()
            out["convicted"] = conviction.worker_id == ps[1].worker_id
        return out


async def main_async(quick: bool) -> list[dict[str, Any]]:
    numel = 200_000 if quick else 1_000_000
    repeats = 2 if quick else 4
    rows = []
    for k in (3, 4) if quick else (3, 4, 6):
        for signed in (False, True):
            rows.append(await one(k, numel, "int8", signed, repeats))
        rows.append(await one(k, numel, "int8", True, 1, doctor=True))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    rows = asyncio.run(main_async(args.quick))
    print(f"{'k':>2} {'numel':>9} {'verified':>8} {'MB/member':>10} {'exchange s':>10}  note")
    base: dict[int, float] = {}
    for r in rows:
        note = ""
        if "adjudicate_s" in r:
            note = (
                f"doctored part: convicted={r['convicted']}, evidence {r['evidence_bytes'] / 1e6:.2f} MB, "
                f"adjudicate {r['adjudicate_s'] * 1000:.0f} ms"
            )
        elif not r["verified"]:
            base[r["k"]] = r["bytes_per_member"]
        elif base.get(r["k"]):
            note = f"x{r['bytes_per_member'] / base[r['k']]:.2f} bytes"
        mb = r["bytes_per_member"] / 1e6
        print(f"{r['k']:>2} {r['numel']:>9} {r['verified']!s:>8} {mb:>10.2f} {r['exchange_s']:>10.2f}  {note}")
    if args.json:
        args.json.write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
