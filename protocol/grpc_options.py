"""gRPC channel and server options shared by the coordinator and every client.

Two things must agree between the two ends, so they are defined once here:

- **Message size limits.** 8 MiB each way. Checkpoints stream in 1 MiB chunks
  (`CHECKPOINT_CHUNK_BYTES`), so no legitimate message comes near the limit, and an
  oversized one is refused by gRPC itself with RESOURCE_EXHAUSTED before it is parsed.
- **Keepalive.** A client that pings more often than the server allows is sent GOAWAY
  `too_many_pings` and loses its connection (gRPC's keepalive guide, "A16 client-side
  keepalive"). So the client pings every `CLIENT_KEEPALIVE_TIME_MS` (30 s), which is at
  least the server's `SERVER_MIN_PING_INTERVAL_MS` (10 s), and both sides permit pings
  without active calls (workers idle between heartbeats are the normal case).
  `tests/test_client.py` asserts these relations.
"""

from __future__ import annotations

MAX_MESSAGE_BYTES = 8 << 20
CHECKPOINT_CHUNK_BYTES = 1 << 20

SERVER_MIN_PING_INTERVAL_MS = 10_000  # pings closer than this count as strikes
SERVER_KEEPALIVE_TIME_MS = 60_000  # server pings idle clients to detect dead peers
SERVER_KEEPALIVE_TIMEOUT_MS = 20_000
CLIENT_KEEPALIVE_TIME_MS = 30_000
CLIENT_KEEPALIVE_TIMEOUT_MS = 10_000
PERMIT_WITHOUT_CALLS = 1
# a client's channel retries a lost connection at most this far apart (gRPC's own backoff)
MAX_RECONNECT_BACKOFF_MS = 5_000
# how long after a restart a coordinator waits for its workers to re-attach, beyond a
# lease: a worker whose channel backed off reconnects within MAX_RECONNECT_BACKOFF_MS, and
# heartbeats within one heartbeat interval after that
RESTART_REATTACH_MS = 2 * MAX_RECONNECT_BACKOFF_MS

Options = list[tuple[str, int | str]]


def server_options() -> Options:
    """Options for `grpc.aio.server(options=...)`."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", SERVER_KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", SERVER_KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", PERMIT_WITHOUT_CALLS),
        ("grpc.http2.min_recv_ping_interval_without_data_ms", SERVER_MIN_PING_INTERVAL_MS),
        ("grpc.http2.max_ping_strikes", 2),
        ("grpc.so_reuseport", 0),  # never share a port with a stale coordinator
    ]


def channel_options() -> Options:
    """Options for `grpc.aio.insecure_channel/secure_channel(options=...)`."""
    return [
        ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
        ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
        ("grpc.keepalive_time_ms", CLIENT_KEEPALIVE_TIME_MS),
        ("grpc.keepalive_timeout_ms", CLIENT_KEEPALIVE_TIMEOUT_MS),
        ("grpc.keepalive_permit_without_calls", PERMIT_WITHOUT_CALLS),
        ("grpc.http2.max_pings_without_data", 0),  # 0 = no cap on pings between calls
        # Reconnect quickly after a coordinator restart (our retry helper backs off too).
        ("grpc.initial_reconnect_backoff_ms", 200),
        ("grpc.max_reconnect_backoff_ms", MAX_RECONNECT_BACKOFF_MS),
        ("grpc.enable_retries", 0),  # retries are ours: each must be re-signed (fresh nonce)
    ]
