"""Benchmark: the memory and time of one exchange's host work, on a model-sized delta.

A real group exchange (`worker.averaging.DataPlane.all_reduce`) between `--members` data
planes in this process, each on its own hivemind DHT node and P2P daemon over loopback, as
in `tests/dataplane_peers.py`: signed (so every member reduces its own part as primary and
a second one as shadow), the run's default rule (`centered_clip`), int8 with error
feedback, on a delta of `--params` float32 parameters (DiT-S/2's 32,469,508 by default).

A thread samples the allocator's live bytes every 2 ms (glibc's `mallinfo2`: bytes in use
in the heap and in mmapped blocks; unlike resident memory this drops when memory is freed,
so it is what the code holds, not what the allocator kept), and attributes the peak to the
step running then: preparing a contribution, decoding a part, reducing a part. Figures are
in float32 copies of the delta, above what the process held with the deltas built, for
all members together (the members share the process, as in one worker's; divide by
`--members` for one worker's share).

    .venv/bin/python bench/exchange_memory.py [--params N] [--members 2] [--json out.json]

Run it on two checkouts to compare them (the same machine, back to back):
`PYTHONPATH=<checkout>/build/typecheck .venv/bin/python <checkout>/bench/exchange_memory.py`
after `make typecheck-root` there. Linux with glibc only. Not a test.
"""

from __future__ import annotations

import argparse
import asyncio
import ctypes
import gc
import hashlib
import json
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

import bagel.robust.reduction as reduction
import bagel.worker.averaging as averaging
import bagel.worker.reducer as reducer_mod
from bagel.compression import ErrorFeedback
from bagel.protocol.discovery import start_dht
from bagel.protocol.identity import Identity
from bagel.worker.averaging import DataPlane

RUN_ID = "exchange-memory"
CELL = "k0.r0"


class _MallInfo2(ctypes.Structure):
    _fields_ = [
        (n, ctypes.c_size_t)
        for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks")
    ] + [("keepcost", ctypes.c_size_t)]


_libc = ctypes.CDLL("libc.so.6")
_libc.mallinfo2.restype = _MallInfo2


def live_bytes() -> int:
    """Bytes the allocator has handed out and not taken back (heap in use + mmapped blocks)."""
    m = _libc.mallinfo2()
    return int(m.uordblks + m.hblkhd)


class Sampler:
    """Peak live bytes per step label, sampled in a thread."""

    def __init__(self) -> None:
        self.label = "exchange"
        self.peaks: dict[str, int] = {}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.002):
            b, k = live_bytes(), self.label
            if b > self.peaks.get(k, 0):
                self.peaks[k] = b

    def __enter__(self) -> Sampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()

    def wrap(self, module: Any, name: str) -> None:
        """Label the time spent in `module.name` (a function called from worker threads)."""
        f: Callable[..., Any] = getattr(module, name)

        def labelled(*args: Any, **kwargs: Any) -> Any:
            previous, self.label = self.label, name
            try:
                return f(*args, **kwargs)
            finally:
                self.label = previous

        setattr(module, name, labelled)


def make_delta(params: int, seed: int) -> dict[str, torch.Tensor]:
    """A delta of `params` parameters in 41 tensors of a pseudo-gradient's scale."""
    g = torch.Generator().manual_seed(seed)
    n = 40
    per = params // n
    out = {f"t{i:02d}": torch.randn(per, generator=g) * 1e-3 for i in range(n)}
    out["rest"] = torch.randn(params - per * n, generator=g) * 1e-3
    return out


def _digest(tensors: dict[str, torch.Tensor]) -> str:
    h = hashlib.sha256()
    for name in sorted(tensors):
        h.update(name.encode())
        h.update(tensors[name].contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


async def run(args: argparse.Namespace) -> dict[str, Any]:
    dhts: list[Any] = []
    planes: list[tuple[str, DataPlane]] = []
    try:
        idents = sorted((Identity.generate() for _ in range(args.members)), key=lambda x: x.worker_id)
        for ident in idents:
            initial = dhts[0].get_visible_maddrs() if dhts else []
            dhts.append(start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial))
            plane = DataPlane(await dhts[-1].replicate_p2p(), RUN_ID, reducer="centered_clip", identity=ident)
            await plane.start()
            planes.append((ident.worker_id, plane))
        contributors = [
            averaging.Contributor(w, p.peer_id, tuple(str(m) for m in d.get_visible_maddrs()), max_samples=1000)
            for (w, p), d in zip(planes, dhts, strict=True)
        ]
        deltas = {w: make_delta(args.params, i) for i, (w, _) in enumerate(planes)}
        feedback = {w: ErrorFeedback() for w, _ in planes}
        gc.collect()
        base = live_bytes()
        sampler = Sampler()
        for module, name in (
            (averaging, "prepare_contribution"),
            (averaging, "decode_part"),
            (reducer_mod, "reduce_one_part"),
            (reduction, "reduce_one_part"),
        ):
            if hasattr(module, name):
                sampler.wrap(module, name)
        with sampler:
            t0 = time.perf_counter()
            results = await asyncio.gather(
                *(
                    p.all_reduce(
                        worker_id=w,
                        cell_id=CELL,
                        round=1,
                        round_attempt=1,
                        reduce_attempt=1,
                        contributors=contributors,
                        delta=deltas[w],
                        weight=100.0,
                        codec="int8",
                        timeout_s=600.0,
                        error_feedback=feedback[w],
                    )
                    for w, p in planes
                )
            )
            seconds = time.perf_counter() - t0
        gc.collect()
        kept = live_bytes() - base
        first = results[0].averaged
        identical = all(torch.equal(r.averaged[k], first[k]) for r in results for k in first)
        # digests of the result and of the first member's residual: equal across checkouts
        # when a change keeps every bit (the deltas are seeded)
        averaged_sha = _digest(first)
        w0 = planes[0][0]
        residual_sha = _digest({n: r for n in deltas[w0] if (r := feedback[w0].residual(n)) is not None})
        del results
    finally:
        for _, p in planes:
            await p.close()
        for d in dhts:
            d.shutdown()
    copy = 4 * args.params
    return {
        "params": args.params,
        "members": args.members,
        "exchange_s": seconds,
        "bit_identical": identical,
        "averaged_sha256": averaged_sha,
        "residual_sha256": residual_sha,
        "peak_copies_by_step": {k: (v - base) / copy for k, v in sorted(sampler.peaks.items(), key=lambda kv: kv[1])},
        "peak_copies": (max(sampler.peaks.values()) - base) / copy,
        "held_after_copies": kept / copy,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--params", type=int, default=32_469_508, help="delta size (default: DiT-S/2's)")
    ap.add_argument("--members", type=int, default=2, help="members of the exchange (default: 2)")
    ap.add_argument("--json", type=Path, default=None, help="write the figures here")
    args = ap.parse_args(argv)
    if args.members < 2 or args.params < args.members:
        print("--members must be at least 2 and --params at least --members", file=sys.stderr)
        return 2
    torch.set_num_threads(1)
    out = asyncio.run(run(args))
    print(
        f"one exchange, {out['members']} members in one process, {out['params']:,} parameters, int8 + error "
        f"feedback, centered_clip, signed: {out['exchange_s']:.1f} s, replicas bit-identical: {out['bit_identical']}"
    )
    print(f"sha256 of the averaged update {out['averaged_sha256'][:16]}, of a residual {out['residual_sha256'][:16]}")
    print("peak live memory above the deltas, in float32 copies of the delta, all members together:")
    for k, v in out["peak_copies_by_step"].items():
        print(f"  {k:24s} {v:7.2f}")
    print(f"  {'held after the exchange':24s} {out['held_after_copies']:7.2f}")
    if args.json:
        args.json.write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
