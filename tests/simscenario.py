"""A small simulator scenario for the engine's unit tests: two cells of equal RTX 4090s on
equal home links that stay online (no churn, no diurnal swing), so one mechanism at a time
shows in the ledger. Each test module sets the link speed and the run-spec lines it is
about, and derives its churn variant from the text."""

from __future__ import annotations


def two_cell_scenario_text(name: str, *, seed: int, home_mbit: float, diloco: str = "", extra: str = "") -> str:
    """The scenario's TOML. `diloco`: lines added to `[run_spec.diloco]`; `extra`: whole
    run-spec tables added after `[run_spec.schedule]`."""
    return f"""
[scenario]
name = "{name}"
workers = 16
hours = 2.0
seed = {seed}
policies = ["bagel"]

[run_spec.run]
id = "{name}"

[run_spec.data]
clusters = 2

[run_spec.cells]
timestep_ranges = 1
router = false

[run_spec.diloco]
inner_steps = 500
group_batch = 768
max_micro_batch = 32
codec = "int4"
{diloco}
[run_spec.schedule]
min_replicas = 2
max_replicas = 16
lease_s = 60.0
heartbeat_s = 15.0
min_round_s = 60.0
{extra}
[population]
gpu_mix = {{ rtx4090 = 1.0 }}
throughput_jitter = 0.0

[population.links]
home_mbit_median = {home_mbit}
home_mbit_sigma = 0.0

[population.availability]
session_weibull_shape = 1.0
session_weibull_scale_h = 10000.0
diurnal_amplitude = 0.0
initial_online_fraction = 1.0
"""
