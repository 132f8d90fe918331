"""Test helper: real hivemind peers on loopback, each with its own DHT node, as in production.

Every worker process runs its own DHT node, and the data plane rides on an in-process
replica of that node's P2P daemon (`dht.replicate_p2p()`); the helper does the same.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from dataclasses import dataclass

import hivemind
import pytest
import torch

from bagel.protocol.discovery import start_dht
from bagel.protocol.identity import Identity
from bagel.worker.averaging import Contributor, DataPlane

RUN_ID = "test-run"


@pytest.fixture(scope="module", autouse=True)
def torch_shm_manager():  # noqa: ANN201
    """Start torch's shared-memory manager before the per-test leak check looks.

    hivemind's MPFuture shares memory through torch with the file_system strategy, which
    spawns one `torch_shm_manager` child for the whole process on first use: not a leak of
    any one test (tests/test_discovery.py does the same). Import this into a test module.
    """
    torch.empty(1).share_memory_()
    yield


@dataclass
class Peer:
    worker_id: str
    dht: hivemind.DHT
    plane: DataPlane
    max_samples: int = 1000

    @property
    def p2p(self):  # noqa: ANN201
        return self.plane.p2p

    def contributor(self, max_samples: int | None = None) -> Contributor:
        maddrs = tuple(str(m) for m in self.dht.get_visible_maddrs())
        return Contributor(self.worker_id, self.plane.peer_id, maddrs, max_samples or self.max_samples)


@contextlib.asynccontextmanager
async def peers(
    n: int,
    *,
    reducer: str = "mean",
    pending_wait_s: float = 10.0,
    signed: bool = False,
    doctors: dict[int, float] | None = None,
) -> AsyncIterator[list[Peer]]:
    """n peers with their own DHT nodes (bootstrapped off the first) and started data planes.

    signed: every peer gets an Ed25519 identity (its worker id derived from the key, sorted
    by it), so exchanges are verified (primary and shadow reducers); doctors: peer index ->
    the factor its data plane scales the part it reduces by (a hostile reducer)."""
    dhts: list[hivemind.DHT] = []
    out: list[Peer] = []
    try:
        for _ in range(n):
            initial = dhts[0].get_visible_maddrs() if dhts else []
            dhts.append(start_dht(host_maddrs=["/ip4/127.0.0.1/tcp/0"], initial_peers=initial))
        idents = sorted((Identity.generate() for _ in range(n)), key=lambda x: x.worker_id) if signed else []
        for i, dht in enumerate(dhts):
            plane = DataPlane(
                await dht.replicate_p2p(),
                RUN_ID,
                reducer=reducer,
                pending_wait_s=pending_wait_s,
                identity=idents[i] if signed else None,
                doctor=(doctors or {}).get(i, 0.0),
            )
            await plane.start()
            out.append(Peer(idents[i].worker_id if signed else f"w{i}", dht, plane))
        yield out
    finally:
        for p in out:
            await p.plane.close()
        for dht in dhts:
            dht.shutdown()
