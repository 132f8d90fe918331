"""Group all-reduce over real hivemind peers on loopback (each with its own DHT node).

Through our group exchange, 3 peers average correctly within each
codec's bound AND end bit-identical. Plus weights, failures, validation and byte counts.
"""

from __future__ import annotations

import asyncio
import gc
import hashlib
import weakref
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from bagel.compression import ErrorFeedback, decode, get_codec
from bagel.protocol import dataplane_pb2 as dp
from bagel.protocol.runspec import parse_spec
from bagel.robust.aggregation import get_reducer
from bagel.worker.averaging import (
    PART_PROTOCOL,
    Contributor,
    ExchangeResult,
    ExchangeTimeout,
    Layout,
    group_digest,
    part_bounds,
)
from bagel.worker.diloco import CellState, OuterConfig, outer_step
from bagel.worker.framing import read_message, write_frame, write_message
from bagel.worker.parts import decode_part, part_generator, prepare_contribution, reduce_part
from bagel.worker.roundwork import ReduceOutcome, RoundWork, reduce_round
from bagel.worker.trainer import InnerPlan, TrainResult

from dataplane_peers import RUN_ID, Peer, peers, torch_shm_manager  # noqa: F401 (autouse fixture)

CELL = "k0.r0"
CODECS = ["fp32", "fp16", "bf16", "int8", "int4", "int4:stochastic", "topk:0.25"]


def make_delta(seed: int, scale: float = 1.0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    # odd sizes, so parts straddle tensors and blocks
    return {
        "blocks.0.attn.weight": torch.randn(17, 9, generator=g) * scale,
        "blocks.0.attn.bias": torch.randn(9, generator=g) * scale,
        "head.weight": torch.randn(3, 33, generator=g) * scale,
    }


async def exchange(
    ps: list[Peer],
    contributors: list[Contributor],
    deltas: dict[str, dict],
    weights: dict[str, float],
    codec,
    *,
    round: int,
    timeout_s: float = 30.0,
    efs: dict | None = None,
) -> dict[str, ExchangeResult]:
    by_id = {p.worker_id: p for p in ps}
    ids = sorted(deltas)
    coros = [
        by_id[w].plane.all_reduce(
            worker_id=w,
            cell_id=CELL,
            round=round,
            round_attempt=1,
            reduce_attempt=1,
            contributors=contributors,
            delta=deltas[w],
            weight=weights[w],
            codec=codec,
            timeout_s=timeout_s,
            error_feedback=(efs or {}).get(w),
        )
        for w in ids
    ]
    results = await asyncio.wait_for(asyncio.gather(*coros), timeout_s + 30)
    return dict(zip(ids, results, strict=True))


def max_diff_across(results: dict[str, ExchangeResult]) -> float:
    first = next(iter(results.values())).averaged
    return max(float((r.averaged[k] - first[k]).abs().max()) for r in results.values() for k in first)


def assert_bit_identical(results: dict[str, ExchangeResult]) -> None:
    first = next(iter(results.values())).averaged
    for w, r in results.items():
        assert set(r.averaged) == set(first)
        for k in first:
            assert torch.equal(r.averaged[k], first[k]), f"{w} differs from the first peer on {k}"


@pytest.mark.timeout(240)
async def test_three_peers_bit_identical_and_within_codec_bound_for_every_codec() -> None:
    async with peers(3) as ps:
        cs = [p.contributor() for p in ps]
        weights = {"w0": 30.0, "w1": 10.0, "w2": 20.0}
        total_w = sum(weights.values())
        measured = {}
        for rnd, name in enumerate(CODECS, start=1):
            codec = get_codec(name)
            deltas = {p.worker_id: make_delta(10 * rnd + i) for i, p in enumerate(ps)}
            results = await exchange(ps, cs, deltas, weights, name, round=rnd)
            measured[name] = max_diff_across(results)
            assert_bit_identical(results)

            layout = Layout.of(deltas["w0"])
            flats = {w: layout.flatten(d) for w, d in deltas.items()}
            true_mean = sum(flats[w].double() * weights[w] for w in flats) / total_w
            got = layout.flatten(results["w0"].averaged).double()
            # Declared bound, part by part: each contribution is encoded once (error <= own),
            # then the reducer's average a is encoded once more. Every codec's bound is monotone
            # in |x| elementwise and |a| <= |true mean| + own, so that second error is at most
            # error_bound(|true mean| + own).
            for j, (s, e) in enumerate(part_bounds(layout.total, 3)):
                own = sum(weights[w] * codec.error_bound(flats[w][s:e]) for w in flats) / total_w
                again = codec.error_bound((true_mean[s:e].abs() + own).float())
                err = float((got[s:e] - true_mean[s:e]).abs().max())
                assert err <= own + again + 1e-6, f"{name} part {j}: error {err} over bound {own + again}"
            if name == "fp32":
                assert float((got - true_mean).abs().max()) < 1e-6
            # The network result is exactly the pure pipeline that tests/test_diloco.py's golden
            # test checks against its reference (same seeded generators, stochastic codecs too).
            contribs = {
                w: prepare_contribution(deltas[w], codec, 3, (RUN_ID, CELL, rnd, 1, 1, w), weight=weights[w])
                for w in sorted(deltas)
            }
            pieces = []
            for j, (s, e) in enumerate(part_bounds(layout.total, 3)):
                gen = part_generator(RUN_ID, CELL, rnd, 1, 1, "result", j)
                buf = reduce_part(
                    codec,
                    get_reducer("mean"),
                    [c.decoded(j) for c in contribs.values()],
                    [weights[w] for w in contribs],
                    gen,
                )
                pieces.append(decode_part(codec, buf, e - s))
            assert torch.equal(got.float(), torch.cat(pieces)), f"{name}: network result != pure pipeline"
        print("\nmax |difference| across 3 peers, by codec:", measured)
        assert all(v == 0.0 for v in measured.values())


async def test_error_feedback_residual_and_byte_counts() -> None:
    async with peers(3) as ps:
        cs = [p.contributor() for p in ps]
        efs = {p.worker_id: ErrorFeedback() for p in ps}
        weights = {"w0": 1.0, "w1": 1.0, "w2": 1.0}
        codec = get_codec("int4")
        for rnd in (1, 2):
            deltas = {p.worker_id: make_delta(100 * rnd + i) for i, p in enumerate(ps)}
            for i, d in enumerate(deltas.values()):  # big enough that sends really interleave
                d["z.big"] = torch.randn(2_000_000, generator=torch.Generator().manual_seed(rnd * 10 + i))
            before = {w: {k: efs[w].compensate(k, t) for k, t in d.items()} for w, d in deltas.items()}
            results = await exchange(ps, cs, deltas, weights, "int4", round=rnd, efs=efs)
            assert_bit_identical(results)
            layout = Layout.of(deltas["w0"])
            bounds = part_bounds(layout.total, 3)
            for w, r in results.items():
                compensated = layout.flatten(before[w])
                decoded = torch.cat([decode(codec.encode(compensated[s:e])) for s, e in bounds])
                expect = layout.unflatten(compensated - decoded)
                for k in expect:
                    assert torch.equal(r.residual[k], expect[k])
                    assert torch.equal(efs[w].residual(k), expect[k])
        # Bytes: every member sends each other reducer its part, and returns its own averaged part
        # to each other contributor; frames add 4 bytes each, headers a few hundred. A part stream
        # that broke, or met a reducer not ready yet, is sent again, header and payload, and
        # counted again: each resend may add one part and a header (seen on a loaded CI runner).
        n = layout.total
        sizes = [e - s for s, e in bounds]
        resent = sum(r.resends for r in results.values())
        per_resend = max(codec.encoded_nbytes(x) for x in sizes) + 512
        print(f"\npart streams sent again: {resent}")
        for i, w in enumerate(sorted(results)):
            payload = sum(codec.encoded_nbytes(sizes[j]) for j in range(3) if j != i) + 2 * codec.encoded_nbytes(
                sizes[i]
            )
            assert payload <= results[w].bytes_sent <= payload + 4 * 512 + results[w].resends * per_resend
            assert payload <= results[w].bytes_received <= payload + 4 * 512 + resent * per_resend
        if resent == 0:  # a resent payload the reducer discarded unread is sent but not received
            assert sum(r.bytes_sent for r in results.values()) == sum(r.bytes_received for r in results.values())
            approx = 2 * 2 / 3 * codec.encoded_nbytes(n)
            assert abs(results["w0"].bytes_sent - approx) < 0.2 * approx + 4 * 512


async def test_weights_are_clamped_to_max_samples_and_reducer_is_pluggable() -> None:
    async with peers(3) as ps:
        # w2 claims 1000 samples but its budget is 10.
        cs = [ps[0].contributor(100), ps[1].contributor(100), ps[2].contributor(10)]
        deltas = {p.worker_id: make_delta(i) for i, p in enumerate(ps)}
        weights = {"w0": 1.0, "w1": 3.0, "w2": 1000.0}
        results = await exchange(ps, cs, deltas, weights, "fp32", round=1)
        assert_bit_identical(results)
        layout = Layout.of(deltas["w0"])
        ref = (
            1.0 * layout.flatten(deltas["w0"]).numpy().astype(np.float64)
            + 3.0 * layout.flatten(deltas["w1"]).numpy().astype(np.float64)
            + 10.0 * layout.flatten(deltas["w2"]).numpy().astype(np.float64)
        ) / 14.0
        got = layout.flatten(results["w1"].averaged).numpy()
        np.testing.assert_allclose(got, ref, rtol=0, atol=1e-6)
        assert results["w0"].total_weights == (14.0, 14.0, 14.0)

        # The same exchange with a robust rule: a sign-flipped, scaled attacker barely moves the median-ish result.
        for p in ps:
            p.plane.reducer = get_reducer("trimmed_mean:0.34")
        deltas["w2"] = {k: -50.0 * v for k, v in deltas["w2"].items()}
        robust = await exchange(ps, cs, deltas, weights, "fp32", round=2)
        assert_bit_identical(robust)
        # 50x the others' norm: the group screen excludes w2 from every part, and the trimmed mean
        # of the two parts left is their midpoint (their coordinate-wise median)
        assert {(e.sender, e.reason.split(" ")[0]) for e in robust["w0"].excluded} == {("w2", "norm")}
        assert len(robust["w0"].excluded) == 3
        stacked = torch.stack([layout.flatten(deltas[w]) for w in ("w0", "w1")])
        assert torch.allclose(layout.flatten(robust["w0"].averaged), stacked.mean(dim=0), atol=1e-6)
        # a scale the screen lets through (3x): the trimmed mean of three is their median
        deltas["w2"] = {k: -3.0 * v for k, v in make_delta(2).items()}
        robust = await exchange(ps, cs, deltas, weights, "fp32", round=3)
        assert_bit_identical(robust)
        assert robust["w0"].excluded == ()
        stacked = torch.stack([layout.flatten(deltas[w]) for w in ("w0", "w1", "w2")])
        median = stacked.median(dim=0).values
        assert torch.allclose(layout.flatten(robust["w0"].averaged), median, atol=1e-6)


SPEC_TEXT = """
[run]
id = "test-run"
[diloco]
codec = "fp32"
error_feedback = false
"""


async def test_the_specs_aggregation_rule_is_the_one_the_exchange_uses() -> None:
    """reduce_round hands the spec's diloco.aggregation to the data plane, whose own rule is
    mean: with a trimmed mean over 3 the attacker is cut and the result is the median. (The
    attacker's 3x stays within the group screen, so the rule, not the screen, decides.)"""
    async with peers(3, reducer="mean") as ps:
        cs = [p.contributor() for p in ps]
        deltas = {p.worker_id: make_delta(i) for i, p in enumerate(ps)}
        deltas["w2"] = {k: -3.0 * v for k, v in deltas["w2"].items()}  # sign-flipped and scaled
        committed = CellState({k: torch.zeros_like(v) for k, v in deltas["w0"].items()})
        order = SimpleNamespace(
            reduce_attempt=1,
            contributors=[
                SimpleNamespace(
                    worker_id=c.worker_id,
                    peer=SimpleNamespace(peer_id=c.peer_id, maddrs=list(c.maddrs)),
                    max_samples=c.max_samples,
                    no_reduce=False,
                    part_weight=0,
                )
                for c in cs
            ],
        )

        async def reduce_all(spec_text: str, rnd: int) -> dict[str, ReduceOutcome]:
            spec = parse_spec(spec_text)
            works = {}
            for i, p in enumerate(ps):
                w = RoundWork(CELL, rnd, 1, i, 3, InnerPlan(1, 1, 1), 0)
                w.result = TrainResult(samples=10, mean_loss=0.0, steps=1, compute_s=0.0, completed=True)
                w.delta = deltas[p.worker_id]
                works[p.worker_id] = w
            outs = await asyncio.gather(
                *(
                    reduce_round(p.plane, spec, p.worker_id, committed, works[p.worker_id], order, None, 30.0)
                    for p in ps
                )
            )
            return dict(zip((p.worker_id for p in ps), outs, strict=True))

        def expected(avg: torch.Tensor, spec_text: str) -> CellState:
            new = committed.clone()
            outer_step(new, Layout.of(deltas["w0"]).unflatten(avg), OuterConfig.from_spec(parse_spec(spec_text).diloco))
            return new

        layout = Layout.of(deltas["w0"])
        stacked = torch.stack([layout.flatten(deltas[w]) for w in ("w0", "w1", "w2")])
        trimmed_text = SPEC_TEXT + 'aggregation = "trimmed_mean:0.34"\n'
        mean_text = SPEC_TEXT + 'aggregation = "mean"\n'
        assert parse_spec(trimmed_text).diloco.aggregation == "trimmed_mean:0.34"
        for spec_text, avg, rnd in [
            (mean_text, stacked.double().mean(dim=0).float(), 1),  # the mean: the attacker drags it
            (trimmed_text, stacked.median(dim=0).values, 2),
        ]:
            outs = await reduce_all(spec_text, rnd)
            assert len({o.state_hash for o in outs.values()}) == 1, "replicas differ"
            want = expected(avg, spec_text)
            got = outs["w0"].state
            for k in want.weights:
                assert torch.allclose(got.weights[k], want.weights[k], atol=1e-5), (spec_text, k)
        mean_state = expected(stacked.double().mean(dim=0).float(), mean_text)
        assert any(not torch.allclose(got.weights[k], mean_state.weights[k], atol=1e-2) for k in got.weights), (
            "the trimmed mean gave the mean's result"
        )


@pytest.mark.timeout(120)
async def test_missing_contributor_fails_with_timeout_not_hang() -> None:
    async with peers(3) as ps:
        cs = [p.contributor() for p in ps]
        deltas = {p.worker_id: make_delta(i) for i, p in enumerate(ps[:2])}
        weights = {"w0": 1.0, "w1": 1.0}
        # w2 is alive but never joins the exchange (a hang) ...
        for rnd in (1, 2):
            with pytest.raises(ExchangeTimeout) as info:
                await exchange(ps, cs, deltas, weights, "int8", round=rnd, timeout_s=3.0)
            assert info.value.missing == ("w2",)
            # ... then it dies outright.
            await ps[2].plane.close()
            ps[2].dht.shutdown()


async def test_cancelled_exchange_cleans_up_and_the_next_one_runs() -> None:
    async with peers(2) as ps:
        w0, w1 = ps
        cs = [w0.contributor(), w1.contributor()]
        deltas = {"w0": make_delta(0), "w1": make_delta(1)}
        # The agent abandons a reduce (new instruction, shutdown): cancelling must not leave the
        # exchange registered, or late streams would be answered from a dead session.
        task = asyncio.ensure_future(w0.plane.all_reduce(
            worker_id="w0", cell_id=CELL, round=1, round_attempt=1, reduce_attempt=1, contributors=cs,
            delta=deltas["w0"], weight=1.0, codec="int8", timeout_s=30.0,
        ))  # fmt: skip
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not w0.plane._sessions  # internal: nothing left registered ...
        assert not w0.plane._finished  # ... nor kept as ended, which would refuse the rerun below
        for rnd in (1, 2):  # the same exchange again (now with w1), then the next round
            assert_bit_identical(await exchange(ps, cs, deltas, {"w0": 1.0, "w1": 1.0}, "int8", round=rnd))


async def test_late_reducer_is_retried_until_it_starts() -> None:
    """A contributor that gets ORDER_REDUCE late: the others' streams are told NOT_READY and retry."""
    async with peers(3, pending_wait_s=0.3) as ps:
        cs = [p.contributor() for p in ps]
        deltas = {p.worker_id: make_delta(i) for i, p in enumerate(ps)}

        async def run(p: Peer, delay: float) -> ExchangeResult:
            await asyncio.sleep(delay)
            return await p.plane.all_reduce(
                worker_id=p.worker_id, cell_id=CELL, round=1, round_attempt=1, reduce_attempt=1, contributors=cs,
                delta=deltas[p.worker_id], weight=1.0, codec="int8", timeout_s=30.0,
            )  # fmt: skip

        done = await asyncio.wait_for(asyncio.gather(run(ps[0], 0), run(ps[1], 0), run(ps[2], 1.5)), 60)
        assert_bit_identical(dict(zip(["w0", "w1", "w2"], done, strict=True)))


class RawFp32:
    """Test stand-in codec: raw float32 bytes, and a decoder that does NOT reject NaN,
    so the reducer's own validation is what stands between a NaN and the average."""

    name = "raw32"

    def encode(self, t: torch.Tensor, *, generator=None) -> bytes:
        return t.detach().float().contiguous().numpy().tobytes()

    def decode(self, buf: bytes, *, max_elements: int) -> torch.Tensor:
        if len(buf) % 4 or len(buf) // 4 > max_elements:
            raise ValueError("bad raw32 buffer")
        return torch.from_numpy(np.frombuffer(buf, dtype=np.float32).copy())

    def encoded_nbytes(self, numel: int) -> int:
        return 4 * numel


class NanInPartZero(RawFp32):
    """A Byzantine contributor: its part for reducer 0 is all NaN."""

    def __init__(self, part0_numel: int):
        self.part0_numel = part0_numel

    def encode(self, t: torch.Tensor, *, generator=None) -> bytes:
        if t.numel() == self.part0_numel and not getattr(self, "_done", False):
            self._done = True
            return torch.full_like(t, float("nan")).numpy().tobytes()
        return super().encode(t)


async def test_nan_part_is_excluded_and_nonfinite_member_abstains() -> None:
    async with peers(3) as ps:
        cs = [p.contributor() for p in ps]
        deltas = {p.worker_id: make_delta(i) for i, p in enumerate(ps)}
        layout = Layout.of(deltas["w0"])
        bounds = part_bounds(layout.total, 3)
        weights = {"w0": 1.0, "w1": 1.0, "w2": 1.0}
        by_id = {p.worker_id: p for p in ps}
        codecs = {"w0": RawFp32(), "w1": NanInPartZero(bounds[0][1]), "w2": RawFp32()}
        results = dict(
            zip(
                ["w0", "w1", "w2"],
                await asyncio.wait_for(
                    asyncio.gather(
                        *(
                            by_id[w].plane.all_reduce(
                                worker_id=w,
                                cell_id=CELL,
                                round=1,
                                round_attempt=1,
                                reduce_attempt=1,
                                contributors=cs,
                                delta=deltas[w],
                                weight=weights[w],
                                codec=codecs[w],
                                timeout_s=20.0,
                            )
                            for w in ("w0", "w1", "w2")
                        )
                    ),
                    60,
                ),
                strict=True,
            )
        )
        assert_bit_identical(results)
        for r in results.values():
            assert [(e.part, e.sender) for e in r.excluded] == [(0, "w1")]
            assert "non-finite" in r.excluded[0].reason
        flats = {w: layout.flatten(d) for w, d in deltas.items()}
        got = layout.flatten(results["w2"].averaged)
        s, e = bounds[0]
        assert torch.allclose(got[s:e], (flats["w0"][s:e] + flats["w2"][s:e]) / 2, atol=1e-6)
        s, e = bounds[1]
        assert torch.allclose(got[s:e], (flats["w0"][s:e] + flats["w1"][s:e] + flats["w2"][s:e]) / 3, atol=1e-6)

        # A member whose own delta is not finite abstains: the others finish without it, and it
        # still applies the same average.
        deltas["w2"]["head.weight"][0, 0] = float("inf")
        results = await exchange(ps, cs, deltas, weights, RawFp32(), round=2)
        assert_bit_identical(results)
        assert results["w2"].abstained and not results["w0"].abstained
        expect = (flats["w0"] + flats["w1"]) / 2
        assert torch.allclose(layout.flatten(results["w0"].averaged), expect, atol=1e-6)
        assert {(e.sender) for e in results["w0"].excluded} == {"w2"}


async def send_raw(sender: Peer, reducer: Peer, header: dp.ContributionHeader, payload: bytes) -> dp.ReducedHeader:
    """What a hostile peer can do: open the part protocol by hand and send anything."""
    _, reader, writer = await sender.p2p.call_binary_stream_handler(reducer.p2p.peer_id, PART_PROTOCOL)
    try:
        await write_message(writer, header)
        await write_frame(writer, payload)
        reply, _ = await asyncio.wait_for(read_message(reader, dp.ReducedHeader), 30)
        return reply
    finally:
        writer.close()


async def test_messages_from_non_contributors_impostors_and_stale_rounds_are_rejected() -> None:
    async with peers(3) as ps:
        w0, w1, w2 = ps
        cs = [w0.contributor(), w1.contributor()]  # w2 is not a contributor
        deltas = {"w0": make_delta(0), "w1": make_delta(1)}
        layout = Layout.of(deltas["w0"])
        bounds = part_bounds(layout.total, 2)
        codec = get_codec("int8")
        payload = codec.encode(torch.ones(bounds[0][1]))

        def header(sender: str, rnd: int = 1, run: str = RUN_ID) -> dp.ContributionHeader:
            tag = dp.ExchangeTag(
                run_id=run, cell_id=CELL, round=rnd, round_attempt=1, reduce_attempt=1, group_digest=group_digest(cs)
            )
            return dp.ContributionHeader(
                tag=tag,
                sender=sender,
                part=0,
                num_parts=2,
                total_numel=layout.total,
                part_numel=bounds[0][1],
                layout_digest=layout.digest,
                codec=codec.name,
                weight=1.0,
                payload_nbytes=len(payload),
            )

        honest = asyncio.ensure_future(exchange(ps, cs, deltas, {"w0": 1.0, "w1": 1.0}, "int8", round=1))
        outsider, impostor = await asyncio.gather(
            send_raw(w2, w0, header("w2"), payload),  # not in the contributor set
            send_raw(w2, w0, header("w1"), payload),  # claims to be w1 from w2's peer id
        )
        results = await honest
        assert outsider.status == dp.STATUS_REJECTED and "not a contributor" in outsider.reason
        assert impostor.status == dp.STATUS_REJECTED and "peer" in impostor.reason
        assert_bit_identical(results)
        assert all(not r.excluded for r in results.values())
        true_mean = (layout.flatten(deltas["w0"]) + layout.flatten(deltas["w1"])) / 2
        assert float((layout.flatten(results["w0"].averaged) - true_mean).abs().max()) < 0.1

        # After round 1 has run here, a round-0 message is stale; another run's is refused too.
        stale = await send_raw(w1, w0, header("w1", rnd=0), payload)
        assert stale.status == dp.STATUS_REJECTED and "stale" in stale.reason
        foreign = await send_raw(w1, w0, header("w1", run="other-run"), payload)
        assert foreign.status == dp.STATUS_REJECTED and "wrong run" in foreign.reason


async def test_inconsistent_or_oversized_contribution_is_excluded_before_reading() -> None:
    async with peers(2) as ps:
        w0, w1 = ps
        cs = [w0.contributor(), w1.contributor()]
        deltas = {"w0": make_delta(0)}
        layout = Layout.of(deltas["w0"])
        bounds = part_bounds(layout.total, 2)
        tag = dp.ExchangeTag(
            run_id=RUN_ID, cell_id=CELL, round=1, round_attempt=1, reduce_attempt=1, group_digest=group_digest(cs)
        )
        # w1 announces a payload far over int8's exact size for the part; w0 must not read it.
        evil = dp.ContributionHeader(
            tag=tag,
            sender="w1",
            part=0,
            num_parts=2,
            total_numel=layout.total,
            part_numel=bounds[0][1],
            layout_digest=layout.digest,
            codec=get_codec("int8").name,
            weight=1.0,
            payload_nbytes=1 << 40,
        )
        _, reader, writer = await w1.p2p.call_binary_stream_handler(w0.p2p.peer_id, PART_PROTOCOL)
        await write_message(writer, evil)
        # w0 runs its side alone: part 0 completes without w1 (excluded); w0 then waits for w1's
        # part 1, which never comes, so the exchange as a whole fails by its deadline.
        with pytest.raises(ExchangeTimeout) as info:
            await asyncio.wait_for(
                w0.plane.all_reduce(
                    worker_id="w0",
                    cell_id=CELL,
                    round=1,
                    round_attempt=1,
                    reduce_attempt=1,
                    contributors=cs,
                    delta=deltas["w0"],
                    weight=1.0,
                    codec="int8",
                    timeout_s=3.0,
                ),
                30,
            )
        assert info.value.missing == ("w1",)
        reply, _ = await asyncio.wait_for(read_message(reader, dp.ReducedHeader), 10)
        writer.close()
        assert reply.status == dp.STATUS_OK
        assert [(e.sender, "limit" in e.reason) for e in reply.excluded] == [("w1", True)]
        assert list(reply.included) == ["w0"]


async def test_duplicate_contribution_with_other_bytes_is_rejected() -> None:
    async with peers(2) as ps:
        w0, w1 = ps
        cs = [w0.contributor(), w1.contributor()]
        deltas = {"w0": make_delta(0), "w1": make_delta(1)}
        layout = Layout.of(deltas["w0"])
        bounds = part_bounds(layout.total, 2)
        codec = get_codec("int8")
        honest = asyncio.ensure_future(exchange(ps, cs, deltas, {"w0": 1.0, "w1": 1.0}, "int8", round=1))
        tag = dp.ExchangeTag(
            run_id=RUN_ID, cell_id=CELL, round=1, round_attempt=1, reduce_attempt=1, group_digest=group_digest(cs)
        )
        other = codec.encode(torch.full((bounds[0][1],), 7.0))
        header = dp.ContributionHeader(
            tag=tag,
            sender="w1",
            part=0,
            num_parts=2,
            total_numel=layout.total,
            part_numel=bounds[0][1],
            layout_digest=layout.digest,
            codec=codec.name,
            weight=1.0,
            payload_nbytes=len(other),
        )
        results = await honest
        reply = await send_raw(w1, w0, header, other)
        assert reply.status == dp.STATUS_REJECTED and "different contribution" in reply.reason
        assert_bit_identical(results)


def test_layout_and_parts_are_deterministic() -> None:
    d = make_delta(0)
    layout = Layout.of(d)
    assert layout.names == tuple(sorted(d))
    assert layout.total == 17 * 9 + 9 + 99
    flat = layout.flatten(d)
    back = layout.unflatten(flat)
    assert all(torch.equal(back[k], d[k]) for k in d)
    assert part_bounds(10, 3) == [(0, 4), (4, 7), (7, 10)]
    assert part_bounds(2, 3) == [(0, 1), (1, 2), (2, 2)]
    assert Layout.of(make_delta(5)).digest == layout.digest
    assert Layout.of({"x": torch.zeros(3)}).digest != layout.digest
    a = [Contributor("a", "p1", (), 5), Contributor("b", "p2", (), 5)]
    assert group_digest(a) != group_digest([a[0], Contributor("b", "p2", (), 6)])
    assert hashlib.sha256(b"").hexdigest()  # sanity: hashlib available for digests


async def test_a_member_that_reduces_nothing_gets_an_empty_part_and_replicas_stay_identical() -> None:
    """A relayed member (`no_reduce`, the coordinator's plan) reduces no part: the vector is split
    among the others, it returns no averaged part, and every replica applies the same bytes as
    the pure pipeline over that split. Control: the same exchange with equal parts costs the
    relayed member an averaged part's upload to each other member. Round 2 also gives the
    first member part weight 3 (the coordinator's plan from measured uplinks): its part is
    three times the other's, and the replicas still apply the pure pipeline's bytes; each
    reducer reports what it measured of the senders' contributions."""
    import dataclasses

    async with peers(3, signed=True) as ps:  # verified: primary and shadow reducers
        plain = [p.contributor() for p in ps]
        relayed = [dataclasses.replace(c, no_reduce=c.worker_id == plain[1].worker_id) for c in plain]
        relayed[0] = dataclasses.replace(relayed[0], part_weight=3)
        weights = {c.worker_id: 1.0 for c in plain}
        sent = {}
        for rnd, cs in ((1, plain), (2, relayed)):
            deltas = {p.worker_id: make_delta(7 * rnd + i) for i, p in enumerate(ps)}
            for i, d in enumerate(deltas.values()):
                d["z.big"] = torch.randn(300_000, generator=torch.Generator().manual_seed(rnd * 10 + i))
            results = await exchange(ps, cs, deltas, weights, "int8", round=rnd)
            assert_bit_identical(results)
            sent[rnd] = results[plain[1].worker_id].bytes_sent
        layout = Layout.of(deltas[plain[0].worker_id])
        bounds = part_bounds(layout.total, 3, {1}, [3, 1, 1])
        assert bounds[1][0] == bounds[1][1] and bounds[0][1] - bounds[0][0] >= 3 * (layout.total // 4)
        assert all(r.part_numels == tuple(e - s for s, e in bounds) for r in results.values())
        ids = set(results)
        for w, r in results.items():
            assert {x for x, _, _ in r.peer_rates} <= ids - {w} and all(n > 0 and ms > 0 for _, n, ms in r.peer_rates)
        assert any(r.peer_rates for r in results.values())  # (a stream that waited for its reducer is untimed)
        codec = get_codec("int8")
        contribs = {
            w: prepare_contribution(
                deltas[w], codec, 3, (RUN_ID, CELL, 2, 1, 1, w), weight=1.0, skip=[1], weights=[3, 1, 1]
            )
            for w in sorted(deltas)
        }
        pieces = []
        for j, (s, e) in enumerate(bounds):
            if s == e:
                continue
            gen = part_generator(RUN_ID, CELL, 2, 1, 1, "result", j)
            buf = reduce_part(codec, get_reducer("mean"), [c.decoded(j) for c in contribs.values()], [1.0] * 3, gen)
            pieces.append(decode_part(codec, buf, e - s))
        got = layout.flatten(results[plain[0].worker_id].averaged)
        assert torch.equal(got, torch.cat(pieces))
        # with shadows (S the vector's bytes): equal parts cost it 2 x S/3 to primaries, S/3 to the
        # one shadow that is not itself and S/3 x 2 for its averaged part = 5S/3; reducing nothing,
        # its two halves go to their primaries and the one shadow that is not itself = 3S/2
        assert sent[2] < 0.95 * sent[1], sent


async def test_a_finished_exchange_keeps_no_reference_to_the_rounds_state() -> None:
    """A data plane keeps its last few exchanges so that a contributor whose stream broke can
    fetch its result, but not the loss audit's closure, which holds the round's committed
    state and this worker's delta (`roundwork.loss_probe`): kept, four exchanges held about
    16 float32 copies of a cell's parameters on every worker (bench/worker_memory.py)."""

    class RoundState:  # stands for what the probe closes over
        pass

    async with peers(3) as ps:
        cs = [p.contributor() for p in ps]
        refs: list[weakref.ref] = []
        coros = []
        for i, p in enumerate(ps):
            state = RoundState()
            refs.append(weakref.ref(state))

            def probe(start: int, parts, state=state):  # noqa: ANN001
                assert state is not None
                return {s: (0.0, 0.0) for s in parts}

            coros.append(
                p.plane.all_reduce(
                    worker_id=p.worker_id,
                    cell_id=CELL,
                    round=1,
                    round_attempt=1,
                    reduce_attempt=1,
                    contributors=cs,
                    delta=make_delta(i),
                    weight=1.0,
                    codec="fp32",
                    timeout_s=30.0,
                    audit_blocks=4,
                    loss_probe=probe,
                )
            )
        del state, probe
        results = await asyncio.wait_for(asyncio.gather(*coros), 60)
        assert all(r.audit for r in results)  # the probes ran
        assert all(p.plane._finished for p in ps)  # the exchanges are kept ...
        gc.collect()
        assert [r() for r in refs] == [None, None, None]  # ... without the round's state
