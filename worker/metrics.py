"""The worker's round metrics: what it reports in each ReportRound, and its own Prometheus
endpoint (`bagel-worker join --metrics-listen HOST:PORT`).

`round_metrics` turns one round's measurements (the trainer's split of its inner loop, the
exchange's encode time, the outer step, the wait between READY and the exchange) into the
report's `<phase>_ms` fields, with the memory at the report: CUDA free (cudaMemGetInfo) and
torch's peak allocated bytes on a GPU, the resident set size on every device.

`WorkerMetrics` exports the same figures on a private registry (no worker id as a label:
the endpoint is this one worker's), plus its byte counters, exchange and checkpoint apart:
- `bagel_info{run_id,spec_hash,version}`             gauge 1 (once the run is known)
- `bagel_worker_step_seconds_total{phase}`           counter: round time by phase
- `bagel_worker_samples_total`                       counter: samples trained
- `bagel_worker_denoising_samples_per_second`        gauge: the last round's training throughput
- `bagel_worker_memory_bytes{kind}`                  gauge: cuda_free, cuda_peak_allocated, rss
- `bagel_worker_bytes_total{kind,direction}`         counter: kind exchange | checkpoint, sent | received
- `bagel_worker_rounds_committed_total`              counter
"""

from __future__ import annotations

import os
import resource
import sys
from typing import Any

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest
from prometheus_client.exposition import start_http_server

PHASES = ("data", "forward_backward", "optimizer", "encode", "exchange", "outer_step", "waiting")
TRAINING_FIELDS = frozenset({"data_ms", "forward_backward_ms", "optimizer_ms", "waiting_ms"})


def rss_bytes() -> int:
    """Resident set size of this process now (/proc), else its peak (getrusage)."""
    try:
        with open("/proc/self/statm", encoding="ascii") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except (OSError, ValueError, IndexError):
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return int(peak if sys.platform == "darwin" else peak * 1024)


def memory(device: torch.device) -> dict[str, int]:
    """The report's memory fields: CUDA free and peak allocated (then reset, so the next
    round's peak is its own) on a GPU, RSS always."""
    out = {"rss_bytes": rss_bytes()}
    if device.type == "cuda":
        free, _total = torch.cuda.mem_get_info(device)
        out["cuda_free_bytes"] = int(free)
        out["cuda_peak_allocated_bytes"] = int(torch.cuda.max_memory_allocated(device))
        torch.cuda.reset_peak_memory_stats(device)
    return out


def round_metrics(result: Any, outcome: Any, waiting_s: float, device: torch.device) -> dict[str, int]:
    """The ReportRound fields of one round: `result` a TrainResult, `outcome` a
    ReduceOutcome (None: the exchange failed, only training is reported)."""
    seconds = {
        "data": result.data_s,
        "forward_backward": result.forward_backward_s,
        "optimizer": result.optimizer_s,
        "waiting": waiting_s + result.throttle_s,
    }
    if outcome is not None:
        seconds |= {
            "encode": outcome.encode_s,
            "exchange": max(0.0, outcome.comm_s - outcome.encode_s),
            "outer_step": outcome.outer_step_s,
        }
    out = {f"{p}_ms": max(0, int(s * 1000)) for p, s in seconds.items()}
    return out | memory(device)


class WorkerMetrics:
    """This worker's series on its own registry, served over HTTP by prometheus-client."""

    def __init__(self) -> None:
        self.registry = r = CollectorRegistry(auto_describe=True)
        self.info = Gauge(
            "bagel_info", "Run and software version (value 1)", ["run_id", "spec_hash", "version"], registry=r
        )
        self.step_seconds = Counter("bagel_worker_step_seconds", "Round time by phase", ["phase"], registry=r)
        self.samples = Counter("bagel_worker_samples", "Samples trained", registry=r)
        self.throughput = Gauge(
            "bagel_worker_denoising_samples_per_second", "The last round's training throughput", registry=r
        )
        self.memory = Gauge("bagel_worker_memory_bytes", "Memory at the last report", ["kind"], registry=r)
        self.bytes = Counter(
            "bagel_worker_bytes", "Bytes moved: exchange or checkpoint, by direction", ["kind", "direction"], registry=r
        )
        self.rounds_committed = Counter("bagel_worker_rounds_committed", "Rounds this worker committed", registry=r)
        for kind in ("exchange", "checkpoint"):
            for direction in ("sent", "received"):
                self.bytes.labels(kind, direction)
        self._server: Any = None

    def set_run(self, run_id: str, spec_hash: str) -> None:
        from importlib.metadata import PackageNotFoundError, version

        try:
            v = version("bagel")
        except PackageNotFoundError:
            v = "unknown"
        self.info.clear()
        self.info.labels(run_id, spec_hash, v).set(1)

    def round(self, fields: dict[str, int], samples: int) -> None:
        for p in PHASES:
            self.step_seconds.labels(p).inc(fields.get(f"{p}_ms", 0) / 1000.0)
        self.samples.inc(samples)
        train_s = sum(fields.get(f"{p}_ms", 0) for p in ("data", "forward_backward", "optimizer")) / 1000.0
        if train_s > 0:
            self.throughput.set(samples / train_s)
        for kind in ("cuda_free", "cuda_peak_allocated", "rss"):
            if f"{kind}_bytes" in fields:
                self.memory.labels(kind).set(fields[f"{kind}_bytes"])

    def moved(self, kind: str, direction: str, n: int) -> None:
        self.bytes.labels(kind, direction).inc(n)

    def serve(self, host: str, port: int) -> int:
        """Start the HTTP endpoint; returns the bound port (port 0 picks one)."""
        self._server, _thread = start_http_server(port, addr=host, registry=self.registry)
        return int(self._server.server_address[1])

    def stop(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None

    def text(self) -> str:
        return generate_latest(self.registry).decode()
