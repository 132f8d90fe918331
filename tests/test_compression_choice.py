"""Bandwidth-aware codec choice: the documented rule, checked by hand and by property."""

from __future__ import annotations

import random

import pytest

from bagel.compression import choose_codec, get_codec
from bagel.compression.choice import DEFAULT_THROUGHPUT, estimate, throughput_of

MB = 1e6
N = 16 * 2**20  # a 16M-parameter cell


def test_estimate_follows_the_documented_formula() -> None:
    table = {"int8": (2e9, 1e9)}
    e = estimate(get_codec("int8"), N, link_bytes_per_s=12.5 * MB, compute_s=30.0, group_size=4, throughput=table)
    traffic = 2 * 3 / 4
    wire = traffic * get_codec("int8").encoded_nbytes(N)
    assert e.wire_bytes == pytest.approx(wire)
    assert e.comm_s == pytest.approx(wire / (12.5 * MB))
    assert e.codec_s == pytest.approx(traffic * 4 * N * (1 / 2e9 + 1 / 1e9))
    assert e.round_s == pytest.approx(30.0 + e.comm_s + e.codec_s)


def test_home_uplink_picks_the_smallest_dense_codec() -> None:
    # 10 Mbit/s: every byte counts, int4 moves the fewest.
    choice = choose_codec(N, link_bytes_per_s=1.25 * MB, compute_s=60.0)
    assert choice.codec.name == "int4:block=128"
    times = {e.codec.name: e.round_s for e in choice.estimates}
    assert times["int4:block=128"] < times["int8:block=256"] < times["fp16"] < times["fp32"]


def test_quality_constraint_excludes_coarse_codecs() -> None:
    choice = choose_codec(N, link_bytes_per_s=1.25 * MB, compute_s=60.0, max_rel_error=0.01)
    assert choice.codec.name == "int8:block=256"
    excluded = {e.codec.name for e in choice.estimates if not e.eligible}
    assert excluded == {"int4:block=128"}
    with pytest.raises(ValueError, match="no candidate"):
        choose_codec(N, 1.25 * MB, 60.0, candidates=["int4", "topk:0.01"], max_rel_error=0.01)


def test_when_compute_dominates_the_most_accurate_near_fastest_codec_wins() -> None:
    # 10 GB/s link and a 10-minute round: codecs differ by well under 2% of the round.
    choice = choose_codec(N, link_bytes_per_s=10e9, compute_s=600.0)
    assert choice.codec.name == "fp32"
    # With no tolerance the raw fastest wins instead.
    fastest = choose_codec(N, link_bytes_per_s=10e9, compute_s=600.0, rel_tolerance=0.0)
    assert fastest.codec.name != "fp32"
    assert fastest.expected_round_s == min(e.round_s for e in fastest.estimates)


def test_fast_link_without_compute_prefers_cheap_codecs_over_fp32() -> None:
    # At 10 GB/s the wire costs less than fp32's extra copy and checksum; int8 wins.
    choice = choose_codec(N, link_bytes_per_s=10e9, compute_s=0.0, rel_tolerance=0.0)
    times = {e.codec.name: e.round_s for e in choice.estimates}
    assert times[choice.codec.name] == min(times.values())
    assert times["fp32"] > times["int8:block=256"]


def test_single_member_group_moves_nothing_and_keeps_full_precision() -> None:
    choice = choose_codec(N, link_bytes_per_s=1.25 * MB, compute_s=10.0, group_size=1)
    assert all(e.wire_bytes == 0 and e.codec_s == 0 for e in choice.estimates)
    assert choice.codec.name == "fp32"


def test_topk_opt_in_and_custom_throughput() -> None:
    choice = choose_codec(N, 1.25 * MB, 60.0, candidates=["int8", "int4", "topk:0.01"])
    assert choice.codec.name == "topk:0.01"
    with pytest.raises(KeyError, match="throughput"):
        choose_codec(N, 1.25 * MB, 60.0, candidates=["int8"], throughput={"fp32": (1e9, 1e9)})
    assert throughput_of(get_codec("int8:stochastic"), DEFAULT_THROUGHPUT) == DEFAULT_THROUGHPUT["int8:stochastic"]
    assert throughput_of(get_codec("int8:block=64"), DEFAULT_THROUGHPUT) == DEFAULT_THROUGHPUT["int8"]


def test_bad_arguments_are_refused() -> None:
    for args in [(-1, 1e6, 1.0), (N, 0.0, 1.0), (N, 1e6, -1.0)]:
        with pytest.raises(ValueError):
            choose_codec(*args)
    with pytest.raises(ValueError, match="no candidate codecs"):
        choose_codec(N, 1e6, 1.0, candidates=[])


def test_choice_is_within_tolerance_of_the_fastest_eligible_on_random_inputs() -> None:
    rng = random.Random(0)
    for _ in range(300):
        numel = rng.randint(0, 10**9)
        link = 10 ** rng.uniform(5, 10)
        compute = rng.uniform(0, 600)
        group = rng.randint(1, 16)
        limit = rng.choice([None, 0.001, 0.01, 0.2])
        tol = rng.choice([0.0, 0.02, 0.1])
        choice = choose_codec(numel, link, compute, group_size=group, max_rel_error=limit, rel_tolerance=tol)
        eligible = [e for e in choice.estimates if e.eligible]
        fastest = min(e.round_s for e in eligible)
        assert choice.expected_round_s <= fastest * (1 + tol) + 1e-12
        # Nothing eligible and at least as fast is strictly more accurate.
        for e in eligible:
            if e.round_s <= choice.expected_round_s:
                assert e.rel_error >= choice.codec.nominal_rel_error()
