"""Cell sizes and compute targets the daemon hands the scheduler (coordinator/sizing.py)."""

from __future__ import annotations

import pytest

from bagel.coordinator import sizing
from bagel.models.experts import cell_host_bytes, cell_memory_bytes
from bagel.protocol.runspec import load_spec, parse_spec

from simworkers import cluster_spec_text


def test_targets_follow_cluster_sizes_and_range_mass() -> None:
    spec = parse_spec(cluster_spec_text())  # 2 clusters x 2 ranges + router
    t = sizing.cell_targets(spec, [300, 100])
    assert sum(t.values()) == pytest.approx(1.0)
    assert t["router"] == pytest.approx(sizing.ROUTER_SHARE)
    # cluster 0 has 3x the data of cluster 1; ranges are equal-probability: equal mass
    assert t["k0.r0"] == pytest.approx(3 * t["k1.r0"])
    assert t["k0.r0"] == pytest.approx(t["k0.r1"])
    uniform = sizing.cell_targets(spec, None)
    assert uniform["k0.r0"] == pytest.approx(uniform["k1.r1"])
    with pytest.raises(ValueError):
        sizing.cell_targets(spec, [1, 2, 3])


def test_no_router_gives_experts_everything() -> None:
    spec = parse_spec(cluster_spec_text().replace("router = true", "router = false"))
    t = sizing.cell_targets(spec, [1, 1])
    assert set(t) == set(spec.expert_cells) and sum(t.values()) == pytest.approx(1.0)


@pytest.mark.timeout(120)
def test_cell_configs_of_the_example_run() -> None:
    spec = load_spec("examples/digits-2x2.toml")
    configs = sizing.cell_configs(spec)
    assert [c.cell_id for c in configs] == list(spec.cell_ids)
    by = {c.cell_id: c for c in configs}
    # memory is the models' closed form at one sample, and each further sample adds
    # sample_bytes: at the largest micro-batch the plan may give, the closed form again
    mb = spec.diloco.max_micro_batch
    assert mb > 1
    assert by["k0.r0"].memory_bytes == cell_memory_bytes(spec, "k0.r0", 1)
    assert by["k0.r0"].sample_bytes > 0
    assert by["k0.r0"].memory_bytes + (mb - 1) * by["k0.r0"].sample_bytes == cell_memory_bytes(spec, "k0.r0", mb)
    assert by["router"].memory_bytes < by["k0.r0"].memory_bytes
    assert all(c.payload_bytes > 0 for c in configs)
    # the digits clusters are not equal in size, and the targets follow the manifest
    sizes = sizing.cluster_sizes(spec)
    assert sum(sizes) > 0 and by["k0.r0"].target_share / by["k1.r0"].target_share == pytest.approx(sizes[0] / sizes[1])
    # stored and loaded back unchanged; another spec's cells are refused
    assert sizing.configs_from_json(spec, sizing.configs_to_json(configs)) == configs
    # configs stored before sample_bytes existed load as sized at the largest micro-batch (0)
    old = [{k: v for k, v in d.items() if k != "sample_bytes"} for d in sizing.configs_to_json(configs)]
    assert all(c.sample_bytes == 0 for c in sizing.configs_from_json(spec, old))
    # the host's share: the closed form, kept in the store; configs stored before it load as 0 (not checked)
    assert by["k0.r0"].host_bytes == cell_host_bytes(spec, "k0.r0") > by["router"].host_bytes > 0
    older = [{k: v for k, v in d.items() if k != "host_bytes"} for d in sizing.configs_to_json(configs)]
    assert all(c.host_bytes == 0 for c in sizing.configs_from_json(spec, older))
    other = parse_spec(cluster_spec_text().replace("clusters = 2", "clusters = 3"))
    with pytest.raises(ValueError):
        sizing.configs_from_json(other, sizing.configs_to_json(configs))
