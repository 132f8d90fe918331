"""The run spec the bed's benchmarks train: one tiny DiT cell on digits, int8 exchanges.

A cell small enough that a round on a 2-core host is a few seconds, so the links, not the
compute, decide what the benchmarks measure. `bench/netlab_nat.py`, `netlab_rounds.py` and
`netlab_relay_volunteer.py` share it; they differ only in the run id and the cell's size.
"""

from __future__ import annotations


def tiny_run_spec(run_id: str, *, max_replicas: int) -> str:
    """The spec's TOML text for `run_id`, with at most `max_replicas` workers per cell."""
    return f"""
[run]
id = "{run_id}"
seed = 0

[model]
arch = "dit"
preset = "tiny"
image_size = 8
channels = 1
num_classes = 10

[data]
source = "digits"
clusters = 1
holdout_fraction = 0.1

[cells]
timestep_ranges = 1
router = false

[diloco]
inner_steps = 10
inner_lr = 0.002
group_batch = 32
codec = "int8"
error_feedback = true

[schedule]
min_replicas = 1
max_replicas = {max_replicas}
lease_s = 3.0
heartbeat_s = 0.5
deadline_slack = 3.0
min_round_s = 1.0
quorum = 0.5
"""
