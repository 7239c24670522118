"""What a network server owes the engine's process before it reads what a client says: bounded sockets,
bounded failed logins, bounded decoding work. Protocol-free, so that every server of the package (openpi's
websocket, a gRPC one) takes the same pieces:

  - `SocketCap`: a hard cap on open connections, handshakes in progress included, checked when a socket
    is accepted: a flood of connections that never finish their handshake costs the process at most this
    many descriptors (not the process's whole descriptor limit);
  - `PeerFailures`: failed handshakes (a missing or wrong key) per peer address in a sliding window; past
    the limit the peer is refused before its key is checked again (no online key guessing, no log flood);
  - `OneDecoder`: one thread that decodes client messages one at a time, so that concurrent large
    messages never pile up on the interpreter beside the engine's thread.
"""
from __future__ import annotations

import asyncio
import collections
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, TypeVar

T = TypeVar("T")


def listener_problems(port: int, max_clients: int, max_message_bytes: int) -> list[str]:
    """What is wrong with a server's port, client count and message size (every protocol's server)."""
    out = []
    if not 0 <= port <= 65535:
        out.append(f"port {port} must be in 0..65535")
    if max_clients < 1:
        out.append(f"max_clients {max_clients} must be at least 1")
    if max_message_bytes < 1024:
        out.append(f"max_message_bytes {max_message_bytes} must be at least 1024")
    return out


class SocketCap:
    """Open connections counted from accept to close; `try_open` refuses the one beyond `limit`."""

    def __init__(self, limit: int):
        self.limit = limit
        self._open = 0
        self._accepted = 0
        self._refused = 0
        self._lock = threading.Lock()

    def try_open(self) -> bool:
        with self._lock:
            self._accepted += 1
            if self._open >= self.limit:
                self._refused += 1
                return False
            self._open += 1
            return True

    def close(self) -> None:
        with self._lock:
            self._open -= 1

    @property
    def open(self) -> int:
        with self._lock:
            return self._open

    @property
    def accepted(self) -> int:
        """Connections accepted so far, refused ones included."""
        with self._lock:
            return self._accepted

    @property
    def refused(self) -> int:
        """Connections closed at accept because `limit` were open."""
        with self._lock:
            return self._refused


class PeerFailures:
    """At most `limit` failed handshakes per peer address in any `window_s`; beyond it `retry_after(peer)`
    says how long the peer must wait. The table keeps at most `max_peers` addresses (the oldest entries go
    first), so a flood from many addresses cannot grow it without bound."""

    def __init__(self, limit: int = 10, window_s: float = 10.0, max_peers: int = 4096,
                 clock: Callable[[], float] = time.monotonic):
        self.limit, self.window_s, self.max_peers, self.clock = limit, window_s, max_peers, clock
        self._failures: collections.OrderedDict[str, collections.deque] = collections.OrderedDict()
        self._lock = threading.Lock()

    def record(self, peer: str) -> int:
        """Count a failed handshake of `peer`; returns its failures within the window (this one included)."""
        now = self.clock()
        with self._lock:
            times = self._failures.pop(peer, None) or collections.deque()
            self._trim(times, now)
            times.append(now)
            self._failures[peer] = times                   # most recent last
            while len(self._failures) > self.max_peers:
                self._failures.popitem(last=False)
            return len(times)

    def retry_after(self, peer: str) -> float:
        """0 when `peer` may try again, else the seconds until its oldest failure leaves the window."""
        now = self.clock()
        with self._lock:
            times = self._failures.get(peer)
            if not times:
                return 0.0
            self._trim(times, now)
            if len(times) < self.limit:
                return 0.0
            return times[-self.limit] + self.window_s - now

    def _trim(self, times: collections.deque, now: float) -> None:
        while times and now - times[0] >= self.window_s:
            times.popleft()


class OneDecoder:
    """Client messages decoded on one thread of their own, one at a time (in arrival order)."""

    def __init__(self, name: str):
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=name)

    def submit(self, fn: Callable[..., T], *args) -> "Future[T]":
        return self._pool.submit(fn, *args)

    async def run(self, fn: Callable[..., T], *args) -> T:
        return await asyncio.wrap_future(self.submit(fn, *args))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
