"""Per-peer message budgets of the control socket, charged before a frame is decoded.

A token bucket per ZeroMQ identity: a registered drafter sends a few messages
per step and one heartbeat per interval, far below its rate; a peer flooding
the socket has its excess dropped unread, so decoding cost and log lines stay
bounded whatever it sends. The table is bounded too: a flood of fresh
identities evicts the least recently seen ones, not the memory.
"""

from __future__ import annotations

from collections import OrderedDict


class PeerRateLimiter:
    def __init__(self, rate_per_s: float, burst: float, max_peers: int = 4096):
        self.rate = rate_per_s
        self.burst = burst
        self.max_peers = max_peers
        self._buckets: OrderedDict[bytes, tuple[float, float]] = OrderedDict()  # identity -> (tokens, last time)
        self.dropped = 0

    def allow(self, identity: bytes, now: float, cost: float = 1.0) -> bool:
        """Charge ``cost`` to ``identity``'s budget; False (and nothing charged) when it is spent."""
        tokens, last = self._buckets.pop(identity, (self.burst, now))
        tokens = min(self.burst, tokens + (now - last) * self.rate)
        allowed = tokens >= cost
        if allowed:
            tokens -= cost
        else:
            self.dropped += 1
        self._buckets[identity] = (tokens, now)
        if len(self._buckets) > self.max_peers:
            self._buckets.popitem(last=False)
        return allowed

    def forget(self, identity: bytes) -> None:
        self._buckets.pop(identity, None)
