"""Permissioned runs: operator-signed join tokens against a real coordinator.

The token matrix (no token, expired, revoked, reused beyond its uses, another run's,
forged, bound to another key): each refusal is its precise gRPC status and changes
nothing (every SQLite row, the core's snapshot). Tokens are made, listed and revoked
with `bagel-coordinator token ...` on the live data dir while the daemon serves; uses,
the binding and revocation survive a restart, and a revocation removes a worker that
joined with the token from the running daemon.
"""

from __future__ import annotations

import asyncio
import json
import os
from pathlib import Path
from typing import Any

import grpc
import pytest

from bagel.coordinator import cli
from bagel.coordinator.daemon import CoordinatorHandle, start_coordinator
from bagel.coordinator.store import Store
from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.client import CoordinatorClient
from bagel.protocol.identity import Identity
from bagel.protocol.jointoken import from_text, issue_token
from bagel.protocol.runspec import RunSpec, parse_spec

from simworkers import cluster_spec_text, fake_peer_id, uniform_cells

RUN = "tokrun"
PROFILE = pb.WorkerProfile(name="w", device_kind="cpu", vram_bytes=8 << 30, num_devices=1)


def token_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    """Run `bagel-coordinator token ...` in this process; its stdout (exit 0 asserted)."""
    capsys.readouterr()
    rc = cli.main(["token", *argv])
    out = capsys.readouterr()
    assert rc == 0, out.err
    return out.out.strip()


def permissioned_spec(data_dir: Path, capsys: pytest.CaptureFixture[str]) -> RunSpec:
    public = token_cli(capsys, "keygen", "--data-dir", str(data_dir))
    extra = f'[security]\nmode = "permissioned"\noperator_public_key = "{public}"\npow_bits = 8\n'
    return parse_spec(cluster_spec_text(RUN, lease_s=600.0, heartbeat_s=1.0, extra=extra))


async def start(spec: RunSpec, data_dir: Path) -> CoordinatorHandle:
    return await start_coordinator(spec, data_dir, cells=uniform_cells(spec.cell_ids), tick_ms=50)


async def register(h: CoordinatorHandle, who: Identity, token: bytes) -> pb.RegisterResponse:
    async with CoordinatorClient(f"127.0.0.1:{h.port}", who, RUN) as c:
        return await c.register(
            PROFILE,
            pb.PeerAddress(peer_id=fake_peer_id(who.worker_id), maddrs=["/ip4/127.0.0.1/tcp/1"]),
            join_token=token,
        )


async def fingerprint(h: CoordinatorHandle) -> tuple[Any, ...]:
    await h.app.writer.barrier()
    store = Store.open_readonly(h.data_dir)
    try:
        return store.dump(), h.state.snapshot()
    finally:
        store.close()


async def refused(h: CoordinatorHandle, who: Identity, token: bytes, code: grpc.StatusCode, words: str) -> None:
    before = await fingerprint(h)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await register(h, who, token)
    assert err.value.code() == code, f"{err.value.code().name}: {err.value.details()}"
    assert words in (err.value.details() or ""), err.value.details()
    assert await fingerprint(h) == before, "a refused token changed the coordinator's state"


def tokens(capsys: pytest.CaptureFixture[str], data_dir: Path) -> dict[str, dict[str, Any]]:
    return {t["name"]: t for t in json.loads(token_cli(capsys, "list", "--data-dir", str(data_dir), "--json"))}


@pytest.mark.timeout(120)
async def test_token_matrix(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    data = tmp_path / "c"
    spec = permissioned_spec(data, capsys)
    h = await start(spec, data)
    try:

        def create(name: str, uses: int = 1, expires_s: float = 3600) -> bytes:
            text = token_cli(
                capsys,
                "create",
                "--data-dir",
                str(data),
                "--expires-s",
                str(expires_s),
                "--uses",
                str(uses),
                "--name",
                name,
            )
            assert text.startswith("bagel-token1:") and "\n" not in text  # the token and nothing else
            return from_text(text)

        a, b = Identity.generate(), Identity.generate()
        good = create("good", uses=1)
        resp = await register(h, a, good)
        assert resp.worker_id == a.worker_id
        await register(h, a, good)  # an active worker re-registering spends no use
        listed = tokens(capsys, data)["good"]
        assert listed["uses_left"] == 0 and listed["bound_worker"] == a.worker_id and not listed["revoked"]

        # no token
        await refused(h, b, b"", grpc.StatusCode.UNAUTHENTICATED, "join token")
        # forged: signed by a key that is not the operator's, and a valid token with a changed claim
        forged = issue_token(
            Identity.generate(),
            run_id=RUN,
            token_id=os.urandom(16),
            name="forged",
            issued_ms=0,
            expires_ms=1 << 60,
            uses=5,
        )
        await refused(h, b, forged, grpc.StatusCode.UNAUTHENTICATED, "not signed by this run's operator")
        tampered = bytearray(create("tampered", uses=1))
        tampered[-70] ^= 1  # inside the claims (the last 66 bytes are the signature field)
        await refused(h, b, bytes(tampered), grpc.StatusCode.UNAUTHENTICATED, "")
        await refused(h, b, b"\xff" * 40, grpc.StatusCode.UNAUTHENTICATED, "does not parse")
        # another run's: the operator's own signature, for another run id
        operator = Identity.load(data / "operator.key")
        other_run = issue_token(
            operator, run_id="otherrun", token_id=os.urandom(16), name="other", issued_ms=0, expires_ms=1 << 60, uses=5
        )
        await refused(h, b, other_run, grpc.StatusCode.PERMISSION_DENIED, "for run 'otherrun'")
        # validly signed for this run, but not issued from this data dir
        stray = issue_token(
            operator, run_id=RUN, token_id=os.urandom(16), name="stray", issued_ms=0, expires_ms=1 << 60, uses=5
        )
        await refused(h, b, stray, grpc.StatusCode.PERMISSION_DENIED, "not issued by this coordinator")
        # bound to the key that used it first
        await refused(h, b, good, grpc.StatusCode.PERMISSION_DENIED, "bound to another worker key")
        # expired
        short = create("short", uses=3, expires_s=0.05)
        await asyncio.sleep(0.2)
        await refused(h, b, short, grpc.StatusCode.UNAUTHENTICATED, "expired")
        # revoked (by name, on the live data dir)
        revoked = create("revoked", uses=3)
        assert token_cli(capsys, "revoke", "--data-dir", str(data), "revoked").startswith("revoked revoked ")
        await refused(h, b, revoked, grpc.StatusCode.PERMISSION_DENIED, "revoked")
        table = token_cli(capsys, "list", "--data-dir", str(data))
        row = next(line for line in table.splitlines() if " good " in line)
        assert a.public_key.hex()[:16] in row and a.worker_id in row and "0/1" in row and " no " in row
        assert " yes " in next(line for line in table.splitlines() if line.startswith("│ revoked "))
        # reused beyond its uses: `a` leaves, and its one use is spent
        async with CoordinatorClient(f"127.0.0.1:{h.port}", a, RUN) as c:
            await c.leave("bye")
        await refused(h, a, good, grpc.StatusCode.PERMISSION_DENIED, "no uses left")
        # a token of two uses admits its key twice (a fresh join each time), then no more
        twice = create("twice", uses=2)
        await register(h, b, twice)
        async with CoordinatorClient(f"127.0.0.1:{h.port}", b, RUN) as c:
            await c.leave("bye")
        await register(h, b, twice)
        assert tokens(capsys, data)["twice"]["uses_left"] == 0
    finally:
        await h.stop()

    # everything is durable: after a restart the spent and bound tokens are still refused
    h = await start(spec, data)
    try:
        await refused(h, Identity.generate(), good, grpc.StatusCode.PERMISSION_DENIED, "bound to another worker key")
        await refused(h, a, good, grpc.StatusCode.PERMISSION_DENIED, "no uses left")
        await refused(h, b, revoked, grpc.StatusCode.PERMISSION_DENIED, "revoked")
    finally:
        await h.stop()


@pytest.mark.timeout(120)
async def test_revocation_removes_a_worker_from_the_running_daemon(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    data = tmp_path / "c"
    spec = permissioned_spec(data, capsys)
    h = await start(spec, data)
    try:
        text = token_cli(capsys, "create", "--data-dir", str(data), "--expires-s", "600", "--uses", "5", "--name", "w1")
        me = Identity.generate()
        await register(h, me, from_text(text))
        async with CoordinatorClient(f"127.0.0.1:{h.port}", me, RUN) as c:
            await c.heartbeat(pb.PHASE_IDLE)
            # revoke by id from "another process" (the CLI's own SQLite connection)
            token_id = tokens(capsys, data)["w1"]["id"]
            token_cli(capsys, "revoke", "--data-dir", str(data), token_id)
            assert tokens(capsys, data)["w1"]["revoked"] is True
            deadline = asyncio.get_running_loop().time() + 10
            code = grpc.StatusCode.OK
            while asyncio.get_running_loop().time() < deadline:
                try:
                    await c.heartbeat(pb.PHASE_IDLE)
                except grpc.aio.AioRpcError as e:
                    code = e.code()
                    break
                await asyncio.sleep(0.2)
            assert code == grpc.StatusCode.NOT_FOUND, "the revoked worker was not removed"
        with pytest.raises(grpc.aio.AioRpcError) as err:
            await register(h, me, from_text(text))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        await h.stop()


def test_token_cli_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """One error line and exit 2: no data dir yet, an open run, a wrong operator key."""
    data = tmp_path / "none"
    assert cli.main(["token", "list", "--data-dir", str(data)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: no coordinator database") and err.count("\n") == 1
    assert cli.main(["token", "revoke", "--data-dir", str(data), "x"]) == 2
    capsys.readouterr()

    async def open_run() -> None:
        spec = parse_spec(cluster_spec_text("openrun", lease_s=600.0, heartbeat_s=1.0))
        h = await start(spec, tmp_path / "open")
        await h.stop()

    asyncio.run(open_run())
    token_cli(capsys, "keygen", "--data-dir", str(tmp_path / "open"))
    argv = ["token", "create", "--data-dir", str(tmp_path / "open"), "--expires-s", "60", "--uses", "1", "--name", "n"]
    assert cli.main(argv) == 2
    assert "is open" in capsys.readouterr().err
    assert cli.main(["token", "keygen", "--data-dir", str(tmp_path / "open")]) == 2  # never overwrites a key
    assert "exists already" in capsys.readouterr().err
    assert (
        cli.main(
            ["token", "create", "--data-dir", str(tmp_path / "open"), "--expires-s", "0", "--uses", "1", "--name", "n"]
        )
        == 2
    )
    assert "--expires-s" in capsys.readouterr().err


def test_worker_takes_the_token_from_its_flag_or_the_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    from bagel.protocol.jointoken import to_text
    from bagel.worker import cli as worker_cli

    raw = issue_token(
        Identity.generate(), run_id=RUN, token_id=os.urandom(16), name="w", issued_ms=0, expires_ms=1 << 60, uses=1
    )
    p = worker_cli.build_parser()
    cfg = worker_cli.config_from_args(p.parse_args(["join", "bagel1:x", "--token", to_text(raw)]))
    assert cfg.join_token == raw
    monkeypatch.setenv("BAGEL_JOIN_TOKEN", to_text(raw))
    assert worker_cli.config_from_args(p.parse_args(["join", "bagel1:x"])).join_token == raw
    monkeypatch.delenv("BAGEL_JOIN_TOKEN")
    assert worker_cli.config_from_args(p.parse_args(["join", "bagel1:x"])).join_token == b""
    with pytest.raises(ValueError, match="--token"):
        worker_cli.config_from_args(p.parse_args(["join", "bagel1:x", "--token", "nope"]))
    # the command line: one error line, exit 2
    assert worker_cli.main(["join", "bagel1:x", "--token", "bagel-token1:!!", "--data-dir", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("bagel-worker: --token") and err.count("\n") == 1
