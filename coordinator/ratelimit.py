"""Token buckets per key (a worker key, a client address) in a bounded table.

`RateLimiter.take(key, now_s)` spends one token of `key`'s bucket and answers 0.0, or,
when the bucket is empty, how many seconds until a token is back (the retry hint the
coordinator sends with RESOURCE_EXHAUSTED). A bucket holds at most `burst` tokens and
refills at `rate` per second (the classic token bucket, as in RFC 2697's committed
burst). No clock is read: `now_s` is an argument (monotonic seconds).

The table is bounded: at `capacity` keys the least recently used is evicted. A bucket
idle for `burst / rate` seconds is full again, so evicting it loses nothing; only a
flood of more than `capacity` distinct keys within that time evicts live buckets, which
hands those keys a fresh burst, never more (the memory bound wins over exactness).
"""

from __future__ import annotations

from collections import OrderedDict

DEFAULT_CAPACITY = 1 << 16


class RateLimiter:
    """Token buckets by key, least recently used evicted at `capacity`."""

    __slots__ = ("rate", "burst", "capacity", "_buckets")

    def __init__(self, rate: float, burst: float, *, capacity: int = DEFAULT_CAPACITY) -> None:
        if rate <= 0 or burst < 1 or capacity < 1:
            raise ValueError("rate must be positive, burst and capacity at least 1")
        self.rate = float(rate)
        self.burst = float(burst)
        self.capacity = capacity
        self._buckets: OrderedDict[str, tuple[float, float]] = OrderedDict()  # key -> (tokens, at)

    def __len__(self) -> int:
        return len(self._buckets)

    def take(self, key: str, now_s: float, cost: float = 1.0) -> float:
        """Spend `cost` tokens of `key`: 0.0 if allowed, else the seconds until it would be."""
        buckets = self._buckets
        entry = buckets.get(key)
        if entry is None:
            tokens = self.burst
            if len(buckets) >= self.capacity:
                buckets.popitem(last=False)
        else:
            tokens, at = entry
            tokens = min(self.burst, tokens + max(0.0, now_s - at) * self.rate)
            buckets.move_to_end(key)
        if tokens >= cost:
            buckets[key] = (tokens - cost, now_s)
            return 0.0
        buckets[key] = (tokens, now_s)
        return (cost - tokens) / self.rate
