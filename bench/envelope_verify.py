"""Benchmark: CPU cost of signing and verifying control-plane envelopes.

The coordinator must verify ~2,000 heartbeats/s (10k workers, 5 s period) on 2 cores;
this measures what one `Verifier.verify` (+ validation) costs per message, single
threaded, with many distinct senders so the key cache and replay cache behave as in
production. Prints a table; `--json FILE` writes the figures. Never asserted in tests.

    python bench/envelope_verify.py [--quick] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

from bagel.protocol import bagel_pb2 as pb
from bagel.protocol.envelope import Verifier, sign_request
from bagel.protocol.identity import Identity, load_public_key
from bagel.protocol.runspec import load_spec
from bagel.protocol.validation import validate

SPEC = load_spec(Path(__file__).resolve().parents[1] / "examples" / "digits-2x2.toml")


def _heartbeat() -> pb.HeartbeatRequest:
    return pb.HeartbeatRequest(
        phase=pb.PHASE_TRAINING,
        cell_id="k0.r1",
        round=12,
        inner_step=7,
        loss=0.25,
        local=pb.LocalState(cell_id="k0.r1", committed_round=11, state_hash="ab" * 32),
    )


def run(n_messages: int, n_senders: int) -> dict[str, float]:
    senders = [Identity.generate() for _ in range(n_senders)]
    now = 1_700_000_000_000
    t0 = time.perf_counter()
    signed = [
        sign_request(senders[i % n_senders], _heartbeat(), run_id=SPEC.run.id, method="Heartbeat", now_ms=now)
        for i in range(n_messages)
    ]
    sign_s = time.perf_counter() - t0
    wire = [s.SerializeToString() for s in signed]

    # The floor: Ed25519 verification alone (libsodium through PyNaCl, what we use)...
    keys = [load_public_key(s.public_key) for s in signed]
    t0 = time.perf_counter()
    for key, s in zip(keys, signed, strict=True):
        key.verify(s.signature, s.payload)
    ed25519_s = time.perf_counter() - t0
    # ...and the peer it replaced: OpenSSL through `cryptography`, same messages
    from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PublicKey

    ossl = [Ed25519PublicKey.from_public_bytes(s.public_key) for s in signed]
    t0 = time.perf_counter()
    for okey, s in zip(ossl, signed, strict=True):
        okey.verify(s.signature, s.payload)
    openssl_s = time.perf_counter() - t0

    verifier = Verifier(SPEC.run.id, max_clock_skew_s=30.0)
    t0 = time.perf_counter()
    for raw in wire:
        got = verifier.verify(pb.SignedRequest.FromString(raw), "Heartbeat", now)
        validate("Heartbeat", got.message, SPEC)
    verify_s = time.perf_counter() - t0
    return {
        "messages": n_messages,
        "senders": n_senders,
        "sign_us": sign_s / n_messages * 1e6,
        "ed25519_verify_us": ed25519_s / n_messages * 1e6,
        "openssl_ed25519_verify_us": openssl_s / n_messages * 1e6,
        "verify_validate_us": verify_s / n_messages * 1e6,
        "verifies_per_core_s": n_messages / verify_s,
    }


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="2,000 messages instead of 20,000")
    ap.add_argument("--senders", type=int, default=1000, help="distinct worker keys")
    ap.add_argument("--json", type=Path, help="write the results as JSON to this file")
    args = ap.parse_args(argv)
    n = 2_000 if args.quick else 20_000
    res = run(n, min(args.senders, n))
    print(
        f"{'messages':>9} {'senders':>8} {'sign us':>8} {'ed25519 us':>11} {'openssl us':>11} "
        f"{'verify+validate us':>19} {'verifies/core/s':>16}"
    )
    print(
        f"{res['messages']:>9} {res['senders']:>8} {res['sign_us']:>8.1f} {res['ed25519_verify_us']:>11.1f} "
        f"{res['openssl_ed25519_verify_us']:>11.1f} "
        f"{res['verify_validate_us']:>19.1f} {res['verifies_per_core_s']:>16.0f}"
    )
    if args.json:
        args.json.write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
