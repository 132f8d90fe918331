"""The upload cap (`--max-upload-mbps`): the token bucket's arithmetic on a fake clock, and
`framing.write_frame` under it: a frame leaves in small pieces, never faster than the rate
allows (the fake clock only moves when the pacer makes a sender wait)."""

from __future__ import annotations

import asyncio

import pytest

from bagel.worker import framing, pacing
from bagel.worker.pacing import UploadPacer


class FakeClock:
    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def test_the_bucket_lets_a_burst_through_then_charges_the_rate() -> None:
    clock = FakeClock()
    p = UploadPacer(1000.0, burst_bytes=100, clock=clock)
    assert p.debt_s(100) == 0.0  # the burst
    assert p.debt_s(500) == pytest.approx(0.5)  # in debt: wait it away
    clock.t = 0.5
    assert p.debt_s(0) == 0.0
    assert p.debt_s(250) == pytest.approx(0.25)
    clock.t = 10.0  # idle: the bucket refills, but only up to its burst
    assert p.debt_s(100) == 0.0
    assert p.debt_s(1) == pytest.approx(0.001)
    with pytest.raises(ValueError):
        UploadPacer(0.0)


def test_senders_that_honour_the_waits_average_at_most_the_rate() -> None:
    clock = FakeClock()
    rate = 10e6 / 8  # 10 Mbit/s
    p = UploadPacer(rate, clock=clock)
    for n in [pacing.PIECE_BYTES] * 2000 + [7, 70_000, 3] * 50:
        clock.t += p.debt_s(n)
    assert p.sent / clock.t <= rate + p.burst / clock.t
    assert p.sent / clock.t > 0.95 * rate  # and the cap is not a throttle below it


class RecordingWriter:
    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.writes: list[tuple[float, int]] = []

    def write(self, data: bytes | memoryview) -> None:
        self.writes.append((self.clock.t, len(data)))

    async def drain(self) -> None:
        pass


async def test_write_frame_paces_every_piece(monkeypatch: pytest.MonkeyPatch) -> None:
    clock = FakeClock()

    async def fake_sleep(s: float) -> None:
        clock.t += s

    monkeypatch.setattr(pacing.asyncio, "sleep", fake_sleep)
    rate = 1e6
    pacer = UploadPacer(rate, clock=clock)
    pacing.install(pacer)
    try:
        w = RecordingWriter(clock)
        n = 3 << 20
        sent = await framing.write_frame(w, bytes(n))  # type: ignore[arg-type]
    finally:
        pacing.install(None)
    assert sent == n + framing.LEN_NBYTES == sum(k for _, k in w.writes)
    assert pacer.sent >= sent * pacing.WIRE_OVERHEAD
    assert max(k for _, k in w.writes) <= pacing.PIECE_BYTES + framing.LEN_NBYTES
    # byte b may not leave before (b x overhead - burst) / rate: no window sees more than rate + burst
    total = 0
    for at, k in w.writes:
        total += k
        assert at >= (total * pacing.WIRE_OVERHEAD - pacer.burst) / rate - 1e-9
    assert clock.t == pytest.approx((pacer.sent - pacer.burst) / rate, rel=1e-6)


async def test_no_pacer_no_pieces() -> None:
    assert pacing.current() is None
    w = RecordingWriter(FakeClock())
    await framing.write_frame(w, bytes(3 << 20))  # type: ignore[arg-type]
    assert len(w.writes) == 1 + 3  # the length, then 1 MiB writes
    await asyncio.sleep(0)


def test_the_volunteer_flags_are_checked_and_rounds_are_planned_with_the_cap() -> None:
    from bagel.worker.cli import build_parser, config_from_args

    def cfg(*flags: str):  # noqa: ANN202
        return config_from_args(build_parser().parse_args(["join", "bagel1:x", *flags]))

    c = cfg("--max-upload-mbps", "5", "--cpu-threads", "2", "--uplink-mbps", "50")
    assert (c.max_upload_mbps, c.cpu_threads, c.uplink_mbps, c.fetch_data) == (5.0, 2, 5.0, "auto")
    assert cfg("--uplink-mbps", "3", "--max-upload-mbps", "5").uplink_mbps == 3.0
    assert (c.sync_timeout_s, cfg("--sync-timeout-s", "1800").sync_timeout_s) == (120.0, 1800.0)
    bads = (("--cpu-threads", "0"), ("--max-upload-mbps", "0"), ("--sync-timeout-s", "0"), ("--sync-timeout-s", "1e6"))
    for bad in bads:
        flag = bad[0]
        with pytest.raises(ValueError, match=flag):
            cfg(*bad)
