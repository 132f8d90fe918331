"""Run spec parsing: the example parses; unknown and ill-typed keys are named."""

from pathlib import Path

import pytest

from bagel.protocol.runspec import ROUTER_CELL, SpecError, load_spec, parse_cell, parse_spec, spec_source_hash

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "digits-2x2.toml"


def test_example_parses() -> None:
    spec = load_spec(EXAMPLE)
    assert spec.cell_ids == ("k0.r0", "k0.r1", "k1.r0", "k1.r1", ROUTER_CELL)
    assert len(spec.spec_hash) == 64
    assert spec.diloco.inner_steps == 50


@pytest.mark.parametrize(
    "text, needle",
    [
        ('[run]\nid = "x"\n[model]\narhc = "dit"\n', "model.arhc"),
        ('[run]\nid = "x"\n[bogus]\n', "[bogus]"),
        ('[run]\nid = "x"\n[data]\nclusters = "two"\n', "data.clusters"),
        ('[run]\nid = "x"\n[model]\narch = "gan"\n', "model.arch"),
        ('[run]\nid = "x"\n[diloco]\nnesterov = 1\n', "diloco.nesterov"),
        ('[run]\nid = "Bad Id"\n', "run.id"),
        ('[model]\narch = "dit"\n', "[run]"),
        ('[run]\nid = "x"\n[schedule]\nlease_s = 1.0\nheartbeat_s = 2.0\n', "schedule.lease_s"),
        ('[run]\nid = "x"\n[diloco]\naggregation = "median"\n', "diloco.aggregation: unknown reducer 'median'"),
        ('[run]\nid = "x"\n[diloco]\naggregation = "trimmed_mean:0.5"\n', "diloco.aggregation: trimmed_mean: trim"),
        ('[run]\nid = "x"\n[diloco]\naggregation = "centered_clip:iters=0"\n', "diloco.aggregation: centered_clip"),
        ('[run]\nid = "x"\n[diloco]\naggregation = "centered_clip:foo=1"\n', "diloco.aggregation: centered_clip: unk"),
        ('[run]\nid = "x"\n[diloco]\naggregation = "mean:2"\n', "diloco.aggregation: mean: cannot parse parameter"),
        ('[run]\nid = "x"\n[diloco]\naggregation = 1\n', "diloco.aggregation: expected a string"),
        ('[run]\nid = "x"\n[slo]\nround_success = 1.0\n', "slo.round_success"),
        ('[run]\nid = "x"\n[slo]\nwindow_rounds = 0\n', "slo.window_rounds"),
        ('[run]\nid = "x"\n[slo]\ncell_sample_target = -1\n', "slo.cell_sample_target"),
        ('[run]\nid = "x"\n[slo]\nobjective = 0.9\n', "slo.objective"),
        ('[run]\nid = "x"\n[cost]\ngpu_hour = { H100 = -1.0 }\n', "cost.gpu_hour.H100"),
        ('[run]\nid = "x"\n[cost]\ngpu_hour = { cpu = 1.0 }\n', "reserved"),
        ('[run]\nid = "x"\n[cost]\ngpu_hour = { H100 = "cheap" }\n', "cost.gpu_hour.H100"),
        ('[run]\nid = "x"\n[cost]\ngpu_hour = { a = 1.0, A = 2.0 }\n', "differ only in case"),
        ('[run]\nid = "x"\n[cost]\ncurrency = "US dollars"\n', "cost.currency"),
    ],
)
def test_bad_specs_name_the_key(text: str, needle: str) -> None:
    with pytest.raises(SpecError, match=None) as info:
        parse_spec(text)
    assert needle in str(info.value)


def test_aggregation_rule_defaults_to_centered_clip_and_is_part_of_the_spec() -> None:
    base = '[run]\nid = "x"\n'
    plain = parse_spec(base)
    assert plain.diloco.aggregation == "centered_clip"
    assert load_spec(EXAMPLE).diloco.aggregation == "centered_clip"
    rules = ("mean", "trimmed_mean:0.2", "trimmed_mean:trim=0.1", "centered_clip:rel=1,iters=10", "centered_clip:tau=2")
    for rule in rules:
        spec = parse_spec(base + f'[diloco]\naggregation = "{rule}"\n')
        assert spec.diloco.aggregation == rule
        assert spec.spec_hash != plain.spec_hash  # the rule is in the text, so in the hash


def test_spec_hash_covers_the_resolved_rule_not_only_the_text() -> None:
    """The same text hashes differently if its (default) rule resolves differently, so a worker
    whose release has another default never agrees on the hash with the coordinator."""
    import dataclasses
    import hashlib

    base = '[run]\nid = "x"\n'
    spec = parse_spec(base)
    assert spec.spec_hash != hashlib.sha256(base.encode()).hexdigest()
    as_mean = dataclasses.replace(spec, diloco=dataclasses.replace(spec.diloco, aggregation="mean"))
    assert as_mean.source == spec.source and as_mean.spec_hash != spec.spec_hash
    # changing any of the rule's parameters changes the hash as well
    stricter = dataclasses.replace(
        spec, diloco=dataclasses.replace(spec.diloco, aggregation="centered_clip:max_norm=5")
    )
    assert stricter.spec_hash not in (spec.spec_hash, as_mean.spec_hash)
    # spelling the default out resolves the same but is another text: another hash, and stable
    explicit = parse_spec(base + '[diloco]\naggregation = "centered_clip:rel=1,iters=10"\n')
    assert explicit.spec_hash == parse_spec(explicit.source).spec_hash != spec.spec_hash
    assert spec_source_hash(base) == spec.spec_hash


def test_parse_cell() -> None:
    assert parse_cell("k3.r1") == (3, 1)
    assert parse_cell(ROUTER_CELL) is None
    with pytest.raises(ValueError):
        parse_cell("k1-r1")
