"""Admission control and abuse limits of one coordinator: who may register, how often
anyone may call, how many streams may run.

`Admission` is the shell's one object for it (`CoordinatorApp.admission`), configured by
the run spec's `[security]` table:

- **rate limits**: a token bucket per client address on every RPC (checked by the
  interceptor before the request is even parsed) and one per worker key on every signed
  RPC (after the signature verified, so nobody can drain another key's bucket); GetStatus
  has a tighter bucket of its own, and so has Register (identities per address). Refusals are
  RESOURCE_EXHAUSTED with a retry hint (`RateLimited.retry_after_ms`, sent as the
  `bagel-retry-after-ms` trailer and in the details).
- **proof of work** (`protocol/pow.py`): `challenge()` hands out the current challenge,
  an HMAC of the time window under a secret drawn at start, so it needs no table and a
  restart invalidates old ones; `check_pow` accepts the current and the previous window.
- **streams**: `upload_slot` admits one upload per uploader and `max_uploads` in all;
  `download_slot` admits `max_downloads`; `take_shard_slot` admits one data-shard stream
  per worker and `max_downloads` in all (the servicer gives it back at the stream's
  deadline even if the client stopped reading); `upload_idle_s` is the idle deadline the servicer
  applies to every read of an upload stream.

Join tokens (permissioned runs) are checked by the servicer with `protocol/jointoken.py`
and the store (`Store.use_token`).
"""

from __future__ import annotations

import hashlib
import hmac
import os
import time
from collections.abc import Iterator
from contextlib import contextmanager

import grpc

from bagel.coordinator.interceptor import ShellError
from bagel.coordinator.ratelimit import RateLimiter
from bagel.protocol.pow import check_pow
from bagel.protocol.runspec import RunSpec

CHALLENGE_WINDOW_MS = 120_000


class RateLimited(ShellError):
    status = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "rate_limited"

    def __init__(self, what: str, retry_after_s: float) -> None:
        self.retry_after_ms = max(1, int(retry_after_s * 1000) + 1)
        super().__init__(f"rate limit of {what} exceeded; retry after {self.retry_after_ms} ms")


class PowRequired(ShellError):
    """No proof of work, or one for a challenge that is no longer valid: fetch a new one."""

    status = grpc.StatusCode.FAILED_PRECONDITION
    reason = "pow_required"


class PowInvalid(ShellError):
    status = grpc.StatusCode.PERMISSION_DENIED
    reason = "pow_invalid"


class UploadBusy(ShellError):
    status = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "upload_busy"


class UploadIdle(ShellError):
    status = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "upload_idle"


class DownloadsBusy(ShellError):
    status = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "downloads_busy"


class ShardStreamBusy(ShellError):
    status = grpc.StatusCode.RESOURCE_EXHAUSTED
    reason = "shard_stream_busy"


class ShardStreamExpired(ShellError):
    status = grpc.StatusCode.DEADLINE_EXCEEDED
    reason = "shard_stream_expired"


def client_address(peer: str) -> str:
    """The rate-limit key of a gRPC peer string: the IPv4 address, an IPv6 /64, or the peer.

    One IPv6 host usually holds a whole /64, so limiting single addresses would be free to
    dodge ("ipv4:1.2.3.4:5678", "ipv6:[2001:db8::1]:5678", "unix:/path").
    """
    kind, _, rest = peer.partition(":")
    if kind == "ipv4":
        return rest.rpartition(":")[0] or rest
    if kind == "ipv6":
        host = rest.rpartition(":")[0].strip("[]") if rest.startswith("[") else rest
        try:
            import ipaddress

            return str(ipaddress.IPv6Network(f"{host}/64", strict=False).network_address) + "/64"
        except ValueError:
            return host
    return peer[:128]


class Admission:
    """The coordinator's admission state (see the module docstring)."""

    def __init__(self, spec: RunSpec, *, secret: bytes | None = None) -> None:
        sec = spec.security
        self.run_id = spec.run.id
        self.pow_bits = sec.pow_bits
        self.upload_idle_s = sec.upload_idle_s
        self.max_uploads = sec.max_uploads
        self.max_downloads = sec.max_downloads
        self._secret = secret if secret is not None else os.urandom(32)
        self.per_ip = RateLimiter(sec.ip_rate_per_s, sec.ip_burst)
        self.per_key = RateLimiter(sec.key_rate_per_s, sec.key_burst)
        self.public = RateLimiter(sec.status_rate_per_s, sec.status_burst)
        self.registers = RateLimiter(sec.register_rate_per_s, sec.register_burst)
        # the detailed view is large (~50 bytes a worker): workers share one bucket for it
        # (the operator's keys do not), so many keys cannot turn it into a bandwidth flood
        self.detailed = RateLimiter(sec.status_rate_per_s, sec.status_burst, capacity=1)
        self._uploads: set[str] = set()
        self.downloads = 0
        self._shard_streams: dict[str, object] = {}  # worker -> the token of its open stream

    # ------------------------------------------------------------------ rate limits

    def limit_ip(self, address: str, now_s: float) -> None:
        wait = self.per_ip.take(address, now_s)
        if wait:
            raise RateLimited(f"address {address}", wait)

    def limit_peer(self, peer: str) -> None:
        """The interceptor's hook: the per-address bucket of a gRPC peer string, now."""
        self.limit_ip(client_address(peer), time.monotonic())

    def limit_key(self, worker_id: str, now_s: float) -> None:
        wait = self.per_key.take(worker_id, now_s)
        if wait:
            raise RateLimited(f"worker {worker_id}", wait)

    def limit_public(self, address: str, now_s: float) -> None:
        """Unsigned GetStatus: a bucket of its own per address."""
        wait = self.public.take(address, now_s)
        if wait:
            raise RateLimited(f"public calls from {address}", wait)

    def limit_detailed(self, now_s: float) -> None:
        """A worker's detailed GetStatus: one bucket for all workers together."""
        wait = self.detailed.take("workers", now_s)
        if wait:
            raise RateLimited("detailed status answers to workers", wait)

    def limit_register(self, address: str, now_s: float) -> None:
        """Register: new identities per address, a bucket of its own (before the signature)."""
        wait = self.registers.take(address, now_s)
        if wait:
            raise RateLimited(f"registrations from {address}", wait)

    # ------------------------------------------------------------------ proof of work

    def _challenge_of(self, window: int) -> bytes:
        msg = self.run_id.encode() + b"|" + window.to_bytes(8, "little", signed=True)
        return hmac.new(self._secret, msg, hashlib.sha256).digest()

    def challenge(self, now_ms: int) -> tuple[bytes, int]:
        """(challenge, expires_unix_ms): valid in this window and the next."""
        window = now_ms // CHALLENGE_WINDOW_MS
        return self._challenge_of(window), (window + 2) * CHALLENGE_WINDOW_MS

    def check_pow(self, challenge: bytes, nonce: int, public_key: bytes, now_ms: int) -> None:
        """PowRequired / PowInvalid unless the Register carries a valid proof (one hash)."""
        if self.pow_bits <= 0:
            return
        if not challenge:
            raise PowRequired(f"this run needs a proof of work of {self.pow_bits} bits: call AdmissionChallenge first")
        window = now_ms // CHALLENGE_WINDOW_MS
        if not any(hmac.compare_digest(challenge, self._challenge_of(w)) for w in (window, window - 1)):
            raise PowRequired("the proof-of-work challenge is unknown or expired: fetch a new one")
        if not check_pow(challenge, self.run_id, public_key, nonce, self.pow_bits):
            raise PowInvalid(f"the proof of work does not have {self.pow_bits} leading zero bits")

    # ------------------------------------------------------------------ streams

    @contextmanager
    def upload_slot(self, uploader: str) -> Iterator[None]:
        """One upload per uploader, `max_uploads` in all (UploadBusy otherwise)."""
        if uploader in self._uploads:
            raise UploadBusy(f"worker {uploader} has an upload in progress already: one at a time")
        if len(self._uploads) >= self.max_uploads:
            raise UploadBusy(f"{self.max_uploads} uploads in progress: retry later")
        self._uploads.add(uploader)
        try:
            yield
        finally:
            self._uploads.discard(uploader)

    @contextmanager
    def download_slot(self) -> Iterator[None]:
        if self.downloads >= self.max_downloads:
            raise DownloadsBusy(f"{self.max_downloads} checkpoint downloads in progress: retry later")
        self.downloads += 1
        try:
            yield
        finally:
            self.downloads -= 1

    def take_shard_slot(self, worker_id: str) -> object:
        """One data-shard stream per worker, `max_downloads` in all (ShardStreamBusy otherwise);
        give it back with `release_shard_slot` (idempotent), at the end or at the deadline."""
        if worker_id in self._shard_streams:
            raise ShardStreamBusy(f"worker {worker_id} has a data-shard stream open already: one at a time")
        if len(self._shard_streams) >= self.max_downloads:
            raise ShardStreamBusy(f"{self.max_downloads} data-shard streams in progress: retry later")
        token = object()
        self._shard_streams[worker_id] = token
        return token

    def release_shard_slot(self, worker_id: str, token: object) -> None:
        """Give back the slot `token` holds (not a later stream's of the same worker)."""
        if self._shard_streams.get(worker_id) is token:
            del self._shard_streams[worker_id]

    @property
    def uploads(self) -> int:
        return len(self._uploads)
