"""Catching up by committed updates, without a network (`worker/catchup.py`): the updates a
member applied, kept, written to the wire and read back, rebuild its state bit for bit; and
every hostile header, byte or update is refused with a precise error and changes nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import struct

import pytest
import torch

from bagel.compression import get_codec
from bagel.compression.wire import CodecId, Header, join, pack_header
from bagel.protocol import dataplane_pb2 as dp
from bagel.protocol.runspec import MAX_CATCH_UP_ROUNDS, SpecError, parse_spec
from bagel.robust.reduction import decode_part, part_bounds, result_generator
from bagel.worker.catchup import (
    MAX_UPDATE_PARTS,
    CatchUpError,
    CommittedUpdate,
    apply_updates,
    catch_up,
    chain_for,
    check_info,
    part_nbytes_limit,
    read_updates,
    request_refusal,
    updates_info,
    write_updates,
)
from bagel.worker.diloco import CellState, OuterConfig, outer_step
from bagel.worker.framing import MAX_HEADER_NBYTES, FrameError, read_message, write_frame, write_message
from bagel.worker.parts import Layout
from bagel.worker.statesync import StateServer

RUN, CELL = "test-run", "k0.r0"
CFG = OuterConfig(ema_decay=0.9)  # the average is part of the state, and of what the updates must rebuild

pytestmark = pytest.mark.timeout(60)


def base_state(seed: int = 0) -> CellState:
    g = torch.Generator().manual_seed(seed)
    w = {"blocks.0.attn.weight": torch.randn(48, 400, generator=g), "blocks.0.bias": torch.randn(400, generator=g),
         "head.weight": torch.randn(7, 13, generator=g)}  # fmt: skip
    state = CellState(w, None, w)
    outer_step(state, {n: 0.1 * torch.randn(t.shape, generator=g) for n, t in w.items()}, CFG)
    return state


def exchange_round(state: CellState, rnd: int, codec_name: str, k: int = 3, skip: tuple[int, ...] = (), seed: int = 0):
    """One committed round as the exchange makes it: each reducer encodes its averaged part
    once (`reduce_part`, with the result generator), every member decodes every part's bytes
    and takes the outer step on a clone of the committed state. Returns the update as kept
    (the parts as applied) and the member's new state."""
    codec = get_codec(codec_name)
    layout = Layout.of(state.weights)
    g = torch.Generator().manual_seed(1000 * rnd + seed)
    averaged_flat = 0.01 * torch.randn(layout.total, generator=g)
    bounds = part_bounds(layout.total, k, skip)
    bufs = [
        codec.encode(averaged_flat[s:e], generator=result_generator(RUN, CELL, rnd, 1, 1, j)) if e > s else b""
        for j, (s, e) in enumerate(bounds)
    ]
    parts = [decode_part(codec, b, e - s) if e > s else torch.zeros(0) for b, (s, e) in zip(bufs, bounds, strict=True)]
    new = state.clone()
    outer_step(new, layout.unflatten(torch.cat(parts)), CFG, ema_step=max(1, rnd))
    update = CommittedUpdate.of(
        rnd, codec.name, [e - s for s, e in bounds], bufs, base_hash=state.state_hash(), state_hash=new.state_hash()
    )
    return update, new


class Sink:
    """What a donor's stream writer needs: write and drain; keeps the bytes."""

    def __init__(self) -> None:
        self.buf = bytearray()

    def write(self, data: bytes) -> None:
        self.buf += data

    async def drain(self) -> None:
        pass


def request(held: int, target: int, want: str, held_hash: str = "") -> dp.UpdatesRequest:
    return dp.UpdatesRequest(
        run_id=RUN, cell_id=CELL, held_round=held, held_hash=held_hash, committed_round=target, state_hash=want
    )


async def on_the_wire(req: dp.UpdatesRequest, chain: list[CommittedUpdate], chunk: int = 700) -> bytes:
    """The donor's answer: the header, then every part in frames of at most `chunk`."""
    sink = Sink()
    await write_message(sink, updates_info(req, chain, chunk))  # type: ignore[arg-type]
    await write_updates(sink, chain, chunk)  # type: ignore[arg-type]
    return bytes(sink.buf)


def reader_of(raw: bytes) -> asyncio.StreamReader:
    r = asyncio.StreamReader()
    r.feed_data(raw)
    r.feed_eof()
    return r


async def received(raw: bytes, req: dp.UpdatesRequest, codec_name: str, total: int, max_nbytes: int = 1 << 30):
    """The joiner's side of the same stream: the header checked, then the parts read."""
    r = reader_of(raw)
    info, _ = await read_message(r, dp.UpdatesInfo)
    check_info(info, req, get_codec(codec_name), total, max_nbytes)
    return await read_updates(r, info, stall_s=5.0)


@pytest.mark.parametrize("codec_name", ["int8", "int4:block=64:stochastic", "fp16"])
async def test_the_updates_as_kept_and_sent_rebuild_the_members_state(codec_name: str) -> None:
    held = base_state()
    before = held.to_safetensors()
    chain, member = [], held
    for rnd, skip in ((5, ()), (6, (1,)), (7, ())):  # round 6: a part nobody reduced (a relayed member)
        update, member = exchange_round(member, rnd, codec_name, skip=skip)
        chain.append(update)
    want = member.state_hash()
    req = request(4, 7, want, held.state_hash())
    assert chain_for(req, {u.round: u for u in chain}) == (chain, "")
    raw = await on_the_wire(req, chain)
    total = Layout.of(held.weights).total
    got = await received(raw, req, codec_name, total)
    assert [u.parts for u in got] == [u.parts for u in chain]  # the bytes as applied, in part order
    assert [u.part_numels for u in got] == [u.part_numels for u in chain] and got[1].parts[1] == b""
    caught = catch_up(held, got, get_codec(codec_name), CFG, want)
    assert caught.state_hash() == want and caught.to_safetensors() == member.to_safetensors()
    assert held.to_safetensors() == before  # the held state itself is never touched
    # the catch-up of one round and of two: the same states as the member's on the way
    one = catch_up(held, got[:1], get_codec(codec_name), CFG, chain[0].state_hash)
    assert one.state_hash() == chain[0].state_hash
    # an update's bytes: a fraction of the state (int8: ~1/4 of the weights, the state is 3x them)
    ratio = sum(u.nbytes for u in chain) / len(chain) / len(member.to_safetensors())
    limit = {"int8": 0.1, "int4:block=64:stochastic": 0.06, "fp16": 0.2}[codec_name]
    assert ratio < limit, ratio


def test_the_part_limit_is_the_codecs_exact_encoding() -> None:
    for name in ("int8", "int4", "fp32", "topk:0.1"):
        codec = get_codec(name)
        for n in (1, 7, 256, 1000, 65537):
            assert part_nbytes_limit(codec, n) == len(codec.encode(torch.randn(n)))
        assert part_nbytes_limit(codec, 0) == 0


async def test_the_joiner_refuses_malformed_headers_before_reading_a_data_byte() -> None:
    held = base_state()
    total = Layout.of(held.weights).total
    u5, s5 = exchange_round(held, 5, "int8")
    u6, s6 = exchange_round(s5, 6, "int8")
    req = request(4, 6, s6.state_hash())
    good = updates_info(req, [u5, u6], 4096)
    codec = get_codec("int8")

    def refused(mutate, match: str, **kw) -> CatchUpError:
        info = dp.UpdatesInfo()
        info.CopyFrom(good)
        mutate(info)
        with pytest.raises(CatchUpError, match=match) as e:
            check_info(info, kw.get("req", req), codec, kw.get("total", total), kw.get("max_nbytes", 1 << 30))
        return e.value

    assert check_info(good, req, codec, total, 1 << 30) == u5.nbytes + u6.nbytes

    def not_available(i: dp.UpdatesInfo) -> None:
        i.status, i.reason = dp.STATUS_NOT_AVAILABLE, "the update of round 5 is not held here"

    e = refused(not_available, "refused: the update of round 5 is not held here")
    assert e.refused and not e.lied
    refused(lambda i: setattr(i, "cell_id", "k1.r0"), "answers for k1.r0 rounds 4..6, not the request")
    refused(lambda i: setattr(i, "state_hash", "0" * 64), "not the request")
    refused(lambda i: setattr(i, "chunk_nbytes", 0), "0-byte frames")
    refused(lambda i: setattr(i, "chunk_nbytes", (16 << 20) + 1), "frames, limit")
    # too many rounds, and rounds with a gap or out of order
    many = request(0, 9, s6.state_hash())
    with pytest.raises(CatchUpError, match=f"announces 9 rounds, at most {MAX_CATCH_UP_ROUNDS}"):
        bad = updates_info(many, [dataclasses.replace(u5, round=r) for r in range(1, 10)], 4096)
        check_info(bad, many, codec, total, 1 << 30)
    wide = request(4, 7, s6.state_hash())
    with pytest.raises(CatchUpError, match=r"announces rounds \[5, 6\], not 5..7 in order"):
        check_info(updates_info(wide, [u5, u6], 4096), wide, codec, total, 1 << 30)
    refused(lambda i: setattr(i.rounds[1], "round", 7), r"announces rounds \[5, 7\], not 5..6")
    refused(lambda i: i.rounds.reverse(), r"announces rounds \[6, 5\]")
    # the run's codec, the parts' counts, sizes and digests
    refused(lambda i: setattr(i.rounds[0], "codec", "fp32"), "round 5: codec 'fp32', the run's is 'int8:block=256'")

    def no_parts(i: dp.UpdatesInfo) -> None:
        for f in ("part_numel", "part_nbytes", "part_sha256"):
            del getattr(i.rounds[0], f)[:]

    refused(no_parts, f"round 5: 0 parts, 1 to {MAX_UPDATE_PARTS}")

    def too_many_parts(i: dp.UpdatesInfo) -> None:
        r = i.rounds[0]
        n = MAX_UPDATE_PARTS + 1
        del r.part_numel[:], r.part_nbytes[:], r.part_sha256[:]
        r.part_numel.extend([1] * n)
        r.part_nbytes.extend([60] * n)
        r.part_sha256.extend([b"\0" * 32] * n)

    refused(too_many_parts, f"round 5: {MAX_UPDATE_PARTS + 1} parts")
    refused(lambda i: i.rounds[1].part_sha256.pop(), "round 6: 3 part sizes, 3 byte counts, 2 digests")

    def shifted(i: dp.UpdatesInfo) -> None:  # the sizes no longer sum to the cell's parameters
        i.rounds[0].part_numel[0] += 1

    refused(shifted, f"round 5: parts of {total + 1} elements, the cell has {total}")
    refused(lambda i: None, f"parts of {total} elements, the cell has {total - 1}", total=total - 1)

    def negative(i: dp.UpdatesInfo) -> None:
        i.rounds[0].part_numel[0] = -5
        i.rounds[0].part_numel[1] += u5.part_numels[0] + 5

    refused(negative, "round 5: a part of -5 elements")
    limit = part_nbytes_limit(codec, u5.part_numels[2])

    def oversized(i: dp.UpdatesInfo) -> None:
        i.rounds[0].part_nbytes[2] = limit + 1

    refused(oversized, rf"round 5 part 2: {limit + 1} bytes for {u5.part_numels[2]} elements \(at most {limit}\)")

    def empty_with_bytes(i: dp.UpdatesInfo) -> None:
        i.rounds[0].part_nbytes[1] = 0

    refused(empty_with_bytes, "round 5 part 1: 0 bytes for")

    def short_digest(i: dp.UpdatesInfo) -> None:
        i.rounds[1].part_sha256[0] = b"\1" * 31

    refused(short_digest, "round 6 part 0: a digest of 31 bytes")
    refused(lambda i: None, f"announces {u5.nbytes + u6.nbytes} bytes of updates, limit 1000", max_nbytes=1000)

    # a header frame over the limit is refused before its body is read (none follows here)
    r = reader_of(struct.pack(">I", MAX_HEADER_NBYTES + 1))
    with pytest.raises(FrameError, match=f"over the {MAX_HEADER_NBYTES}-byte limit"):
        await read_message(r, dp.UpdatesInfo)


def _crafted(codec_id: CodecId, numel: int, body: bytes) -> bytes:
    """A well-formed codec buffer (header, body, valid CRC): what a hostile donor can write."""
    return join(pack_header(Header(codec_id, 0, torch.float32, (numel,), 0, numel, numel, len(body))), memoryview(body))


async def test_the_joiner_refuses_bad_bytes_and_bad_updates_and_keeps_its_state() -> None:
    held = base_state()
    before = held.to_safetensors()
    total = Layout.of(held.weights).total
    codec = get_codec("int8")
    u5, s5 = exchange_round(held, 5, "int8")
    u6, s6 = exchange_round(s5, 6, "int8")
    want = s6.state_hash()
    req = request(4, 6, want)
    raw = await on_the_wire(req, [u5, u6])
    head = len(raw) - sum(4 + len(p) for u in (u5, u6) for p in u.parts)  # the header frame

    # one byte flipped on the stream: that part does not match its digest (a proven lie)
    flipped = bytearray(raw)
    flipped[head + 4 + 100] ^= 0x01
    with pytest.raises(CatchUpError, match="round 5 part 0 does not match its announced digest") as e:
        await received(bytes(flipped), req, "int8", total)
    assert e.value.lied
    # a truncated stream, and a frame that runs past its part (or past the chunk size)
    with pytest.raises(FrameError, match="stream closed"):
        await received(raw[:-10], req, "int8", total)
    sink = Sink()
    await write_message(sink, updates_info(req, [u5, u6], 1 << 20))  # type: ignore[arg-type]
    await write_frame(sink, u5.parts[0] + u5.parts[1])  # type: ignore[arg-type]
    both, first = len(u5.parts[0]) + len(u5.parts[1]), len(u5.parts[0])
    with pytest.raises(FrameError, match=f"declared a {both}-byte frame, over the {first}-byte limit"):
        await received(bytes(sink.buf), req, "int8", total)  # two parts in one frame

    # updates that arrive intact but are not what the members applied
    def with_part(u: CommittedUpdate, i: int, buf: bytes) -> CommittedUpdate:
        parts = list(u.parts)
        parts[i] = buf
        return CommittedUpdate.of(u.round, u.codec, u.part_numels, parts)

    n0 = u5.part_numels[0]
    cases = [
        (with_part(u5, 0, u5.parts[0][:-4] + b"\0\0\0\0"), "round 5 part 0: undecodable payload: checksum mismatch"),
        (
            with_part(u5, 0, _crafted(CodecId.FP32, n0, bytes(4 * n0))),
            "round 5 part 0: encoded with codec id 0, not int8",
        ),
        (with_part(u5, 0, codec.encode(torch.zeros(n0 - 1))), f"decodes to {n0 - 1} float32 values, not {n0}"),
    ]
    other, _ = exchange_round(held, 5, "int8", seed=1)  # valid int8 bytes of another average
    cases.append((other, "the updates of rounds 5..6 give state hash"))
    for bad5, match in cases:
        with pytest.raises(CatchUpError, match=match) as e:
            catch_up(held, [bad5, u6], codec, CFG, want)
        assert e.value.lied, match
    # decoded values that are not finite (the fp32 codec refuses them in its body)
    fp32 = get_codec("fp32")
    f5, _ = exchange_round(held, 5, "fp32")
    body = bytearray(torch.zeros(f5.part_numels[0]).numpy().tobytes())
    body[8:12] = struct.pack("<f", float("nan"))
    nan5 = with_part(f5, 0, _crafted(CodecId.FP32, f5.part_numels[0], bytes(body)))
    with pytest.raises(CatchUpError, match="round 5 part 0: undecodable payload: fp32 body holds non-finite values"):
        catch_up(held, [nan5], fp32, CFG, f5.state_hash)
    # the run's codec only, a gap in the rounds, nothing at all
    with pytest.raises(CatchUpError, match="round 5: codec 'int8:block=256', the run's is 'fp32'"):
        catch_up(held, [u5, u6], fp32, CFG, want)
    with pytest.raises(CatchUpError, match="updates of rounds 5 and 7 leave a gap"):
        apply_updates(held, [u5, dataclasses.replace(u6, round=7)], codec, CFG)
    with pytest.raises(CatchUpError, match="no update"):
        catch_up(held, [], codec, CFG, want)
    # a state without the average cannot take the run's outer step with one
    plain = CellState(held.weights, held.momentum)
    with pytest.raises(CatchUpError, match="round 5: the run keeps an average"):
        catch_up(plain, [u5, u6], codec, CFG, want)
    assert held.to_safetensors() == before
    assert catch_up(held, [u5, u6], codec, CFG, want).state_hash() == want  # and the honest ones still work


def test_the_donor_refuses_what_its_updates_cannot_answer() -> None:
    held = base_state()
    u5, s5 = exchange_round(held, 5, "int8")
    u6, s6 = exchange_round(s5, 6, "int8")
    u7, s7 = exchange_round(s6, 7, "int8")
    want = s7.state_hash()
    assert request_refusal(request(4, 7, want)) == ""
    assert "a catch-up spans 1 to 8 rounds, not 0" in request_refusal(request(4, 4, want))
    assert "not 9" in request_refusal(request(0, 9, want))
    assert "not -2" in request_refusal(request(6, 4, want))
    assert "negative" in request_refusal(request(-1, 3, want))
    assert request_refusal(request(4, 7, "")) == "no committed hash to reach"
    kept = {5: u5, 7: u7}
    assert chain_for(request(4, 7, want), kept) == ([], f"{CELL}: the update of round 6 is not held here (held: 5, 7)")
    assert (
        chain_for(request(4, 7, want), {7: u7})[1] == f"{CELL}: the updates of rounds 5, 6 are not held here (held: 7)"
    )
    kept = {5: u5, 6: u6, 7: u7}
    assert chain_for(request(5, 7, want, s5.state_hash()), kept) == ([u6, u7], "")
    assert "applies to another state of round 5 than yours" in chain_for(request(5, 7, want, "f" * 64), kept)[1]
    assert chain_for(request(4, 7, "e" * 64), kept)[1] == "our round 7 has a different hash"
    other6, _ = exchange_round(held, 6, "int8", seed=3)  # an update of round 6 from another base than round 5's
    broken = {5: u5, 6: other6, 7: u7}
    assert "rounds 5 and 6 do not follow each other" in chain_for(request(4, 7, want), broken)[1]
    wide = CommittedUpdate.of(7, u7.codec, [1] * (MAX_UPDATE_PARTS + 1), [b"x"] * (MAX_UPDATE_PARTS + 1))
    assert f"more than the {MAX_UPDATE_PARTS} served" in chain_for(request(6, 7, "", ""), {7: wide})[1]


def test_the_server_keeps_the_last_updates_bounded_in_count_and_bytes() -> None:
    server = StateServer(None, RUN)  # type: ignore[arg-type]  (publish and withdraw need no network)
    state, chain = base_state(), []
    for rnd in range(1, 6):
        update, state = exchange_round(state, rnd, "int8")
        chain.append(update)
        server.publish(CELL, rnd, state, updates=[update], keep_updates=2)
    assert server.held_updates(CELL) == (4, 5)
    # what a worker that caught up keeps: the updates it applied, at most keep_updates of them
    server.withdraw()
    server.publish(CELL, 5, state, updates=chain[1:], keep_updates=3)
    assert server.held_updates(CELL) == (3, 4, 5)
    server.publish(CELL, 5, state, updates=chain, keep_updates=MAX_CATCH_UP_ROUNDS + 5)
    assert server.held_updates(CELL) == (1, 2, 3, 4, 5)
    # never an update of a round after the state's, and none at all with keep_updates 0
    server.publish(CELL, 3, state, updates=[dataclasses.replace(chain[0], round=9)], keep_updates=8)
    assert server.held_updates(CELL) == (1, 2, 3, 4, 5)
    server.publish(CELL, 5, state, keep_updates=0)
    assert server.held_updates(CELL) == ()
    # in bytes, at most the newest state's file: the oldest go first
    fat = [dataclasses.replace(u, parts=u.parts + (bytes(len(state.to_safetensors()) // 3),)) for u in chain]
    server.publish(CELL, 5, state, updates=fat, keep_updates=8)
    assert server.held_updates(CELL) == (4, 5)
    server.withdraw(CELL)
    assert server.held_updates(CELL) == ()


def test_catch_up_rounds_is_validated() -> None:
    base = "[run]\nid = 'r'\n"
    assert parse_spec(base).sync.catch_up_rounds == 2
    for ok in (0, 1, MAX_CATCH_UP_ROUNDS):
        assert parse_spec(base + f"[sync]\ncatch_up_rounds = {ok}\n").sync.catch_up_rounds == ok
    for bad in (-1, MAX_CATCH_UP_ROUNDS + 1):
        with pytest.raises(SpecError, match="sync.catch_up_rounds: between 0 and 8"):
            parse_spec(base + f"[sync]\ncatch_up_rounds = {bad}\n")
