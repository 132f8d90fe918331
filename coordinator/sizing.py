"""Per-cell sizes and compute targets for the scheduler, computed once per run by the shell.

The pure core takes `CellConfig(cell_id, memory_bytes, target_share, payload_bytes)`; this
module derives them from the run spec:

- **memory_bytes**: `bagel.models.experts.cell_memory_bytes` (closed form: parameters x the
  float32 copies training keeps on the device, plus activations) at a micro-batch of one
  sample, the least a member can be given: a cell fits a card that holds that.
- **host_bytes**: `bagel.models.experts.cell_host_bytes`, what a worker holds on the host
  besides (committed states, the exchange's working copies): a GPU worker's RAM must hold
  it, and a CPU worker's RAM must hold both.
- **sample_bytes**: the activations of one more sample (`activation_bytes` is linear in the
  micro-batch), so the planner gives each member the largest micro-batch its own memory
  holds, up to `diloco.max_micro_batch` (`protocol/cellmemory.py`): a 24 GiB card
  trains a large expert at a small micro-batch with more accumulation, an 80 GiB one at
  the run's largest, for the same per-step batch.
- **payload_bytes**: the encoded size of one pseudo-gradient (parameter count through the
  run's codec's exact `encoded_nbytes`), for the communication-time estimate.
- **target_share**: proportional to cluster size x timestep-range mass. Ranges are
  equal-probability quantiles of the training t-density (`bagel.models.flow`), so each range
  has mass 1/R; cluster sizes come from the run's deterministic k-means manifest. The
  router cell gets a small fixed share (`ROUTER_SHARE`): it is a small classifier.

Loading the dataset and importing torch take seconds, so the daemon computes this on the
first start only and keeps the result in its store (the configs are part of the run, like
the spec); `fallback=True` replaces a failure (e.g. a folder dataset not present on the
coordinator host) by uniform cluster sizes, logged.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence

from bagel.coordinator.core.records import CellConfig
from bagel.coordinator.core.scheduler import ROUTER_SHARE, cell_targets
from bagel.protocol.runspec import STATE_DTYPE_NBYTES, RunSpec

log = logging.getLogger(__name__)


def cluster_sizes(spec: RunSpec) -> list[int]:
    """Training samples per cluster, from the run's k-means manifest (loads the dataset)."""
    import numpy as np

    from bagel.models.data import cluster_manifest

    manifest = cluster_manifest(spec)
    return [int(n) for n in np.bincount(manifest.train_labels, minlength=spec.data.clusters)]


def _param_count(spec: RunSpec, cell_id: str) -> int:
    from bagel.models import dit, experts, router, unet

    cfg = experts.cell_config(spec, cell_id)
    if isinstance(cfg, dit.DiTConfig):
        return dit.param_count(cfg)
    if isinstance(cfg, unet.UNetConfig):
        return unet.param_count(cfg)
    return router.param_count(cfg)


def cell_configs(spec: RunSpec, *, sizes: Sequence[int] | None = None, fallback: bool = True) -> list[CellConfig]:
    """CellConfigs of every cell of the run (see the module docstring)."""
    from bagel.compression import get_codec
    from bagel.models.experts import cell_memory_sizes

    if sizes is None:
        try:
            sizes = cluster_sizes(spec)
        except Exception as e:
            if not fallback:
                raise
            log.warning("cluster sizes unavailable (%s); using uniform compute targets", e)
            sizes = None
    targets = cell_targets(spec, sizes)
    codec = get_codec(spec.diloco.codec)
    out = []
    for cell in spec.cell_ids:
        memory, sample, host = cell_memory_sizes(spec, cell)
        payload = codec.encoded_nbytes(_param_count(spec, cell))
        out.append(
            CellConfig(
                cell_id=cell,
                memory_bytes=memory,
                target_share=targets[cell],
                payload_bytes=payload,
                sample_bytes=sample,
                host_bytes=host,
            )
        )
    return out


def configs_to_json(configs: Sequence[CellConfig]) -> list[dict[str, object]]:
    return [
        {
            "cell_id": c.cell_id,
            "memory_bytes": c.memory_bytes,
            "target_share": c.target_share,
            "payload_bytes": c.payload_bytes,
            "sample_bytes": c.sample_bytes,
            "host_bytes": c.host_bytes,
        }
        for c in configs
    ]


def configs_from_json(spec: RunSpec, data: object) -> list[CellConfig]:
    """Stored configs back; ValueError if they do not name exactly the spec's cells."""
    if not isinstance(data, list):
        raise ValueError("stored cell configs are not a list")
    configs = [
        CellConfig(
            cell_id=str(d["cell_id"]),
            memory_bytes=int(d["memory_bytes"]),
            target_share=float(d["target_share"]),
            payload_bytes=int(d["payload_bytes"]),
            # absent from configs stored before it: their memory_bytes is at the run's largest micro-batch
            sample_bytes=int(d.get("sample_bytes", 0)),
            # absent from configs stored before it: their memory_bytes counts the host's copies
            # too (seven float32 copies on the device), and the host is not checked
            host_bytes=int(d.get("host_bytes", 0)),
        )
        for d in data
        if isinstance(d, Mapping)
    ]
    if [c.cell_id for c in configs] != list(spec.cell_ids):
        raise ValueError("stored cell configs do not match the spec's cells")
    return configs


__all__ = ["ROUTER_SHARE", "cell_configs", "cell_targets", "cluster_sizes"]


# Slack for a checkpoint's safetensors header (names, dtypes, shapes, offsets as JSON).
CHECKPOINT_HEADER_SLACK_BYTES = 1 << 20


def checkpoint_bytes_bound(spec: RunSpec, cell_id: str) -> int:
    """The most bytes an honest checkpoint of `cell_id` takes: weights and outer momentum
    (`worker/diloco.py`'s CellState), and the average of the weights where the run keeps one
    (`[ema]`), each in the run's `[sync] state_dtype`, plus a header slack. An upload
    declaring more is refused before any byte is accepted. Imports the models (slow): call
    it once per cell, off the event loop."""
    copies = 3 if spec.ema.decay > 0 else 2
    nbytes = STATE_DTYPE_NBYTES[spec.sync.state_dtype]
    return nbytes * copies * _param_count(spec, cell_id) + CHECKPOINT_HEADER_SLACK_BYTES
