"""What a network server owes the engine's process before it reads what a client says: bounded sockets,
bounded failed logins, bounded decoding work. Protocol-free, so that every server of the package (openpi's
websocket, a gRPC one) takes the same pieces:

  - `Doorway`: open connections in two bounded budgets, those at the door (handshakes in progress) and
    those admitted (sessions), the longest silent at the door pushed out when it is full: a flood of
    connections that never finish their handshake costs the process a bounded number of descriptors and
    cannot keep a client with the right key out (one event-loop thread calls it: no lock);
  - `PeerFailures`: failed handshakes (a missing or wrong key) per peer address in a sliding window; past
    the limit the peer's wrong keys get a short refusal (no key guessing at speed, no log flood) while its
    right key is still admitted: failures are limited, not attempts;
  - `OneDecoder`: one thread that decodes client messages one at a time, so that concurrent large
    messages never pile up on the interpreter beside the engine's thread;
  - `CpuShare`: a client's next message read only once its last one's receiving, decoding and preparing
    time is paid back, so that one client sending large messages as fast as it can takes a bounded share
    of the CPU.
"""
from __future__ import annotations

import asyncio
import collections
import math
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Callable, Generic, Hashable, TypeVar

T = TypeVar("T")
C = TypeVar("C", bound=Hashable)


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


class Doorway(Generic[C]):
    """Open connections counted from accept to close in two budgets, so that strangers cannot hold the door
    shut: up to `max_waiting` at the door (accepted, not yet admitted: a handshake in progress, a refusal
    closing) and up to `max_admitted` admitted (the right key shown). Past `max_waiting`, `trim` names the
    connections to close among those at the door for `grace_s` or more: those silent (nothing received
    yet) first, then the oldest. A client sends its request head as soon as it connects, so a flood of
    silent sockets only ever displaces its own, a flood of handshakes its oldest, and admitted connections
    are never displaced. Within the grace the door holds at most `max_waiting + overflow` (beyond, `accept`
    names the connection silent the longest, to close at once)."""

    def __init__(self, max_waiting: int, max_admitted: int, grace_s: float = 0.25, overflow: int = 300,
                 clock: Callable[[], float] = time.monotonic):
        self.max_waiting, self.max_admitted, self.grace_s, self.overflow = max_waiting, max_admitted, grace_s, overflow
        self.clock = clock
        self._silent: collections.OrderedDict[C, float] = collections.OrderedDict()   # -> accept time, oldest first
        self._spoke: collections.OrderedDict[C, float] = collections.OrderedDict()
        self._admitted: set[C] = set()
        self.accepted = 0          # connections accepted so far
        self.displaced = 0         # closed because the door was full

    def accept(self, conn: C, spoke: bool = False) -> C | None:
        """Count a new connection at the door (`spoke`: bytes from it are already waiting); the connection to
        close at once when the door is past its overflow, else None."""
        self.accepted += 1
        (self._spoke if spoke else self._silent)[conn] = self.clock()
        if self.waiting <= self.max_waiting + self.overflow:
            return None
        self.displaced += 1
        return (self._silent or self._spoke).popitem(last=False)[0]

    def trim(self) -> list[C]:
        """The connections to close now so that at most `max_waiting` wait at the door, within the grace."""
        out, settled = [], self.clock() - self.grace_s
        for queue in (self._silent, self._spoke):
            while self.waiting > self.max_waiting and queue and next(iter(queue.values())) <= settled:
                out.append(queue.popitem(last=False)[0])
        self.displaced += len(out)
        return out

    def next_trim_s(self) -> float | None:
        """Seconds until `trim` can close one more (0: now); None while the door is not over `max_waiting`."""
        if self.waiting <= self.max_waiting:
            return None
        oldest = min(next(iter(q.values())) for q in (self._silent, self._spoke) if q)
        return max(0.0, oldest + self.grace_s - self.clock())

    def spoke(self, conn: C) -> None:
        """Bytes came from `conn`."""
        if conn in self._silent:
            self._spoke[conn] = self._silent.pop(conn)      # its accept time kept

    def admit(self, conn: C) -> bool:
        """Move a waiting connection in; False (it stays at the door) when `max_admitted` are in."""
        if len(self._admitted) >= self.max_admitted or (conn not in self._spoke and conn not in self._silent):
            return False
        self._spoke.pop(conn, None)
        self._silent.pop(conn, None)
        self._admitted.add(conn)
        return True

    def close(self, conn: C) -> None:
        self._silent.pop(conn, None)
        self._spoke.pop(conn, None)
        self._admitted.discard(conn)

    @property
    def waiting(self) -> int:
        return len(self._silent) + len(self._spoke)

    @property
    def admitted(self) -> int:
        return len(self._admitted)

    @property
    def limit(self) -> int:
        """The most connections open at once once the door is trimmed."""
        return self.max_waiting + self.max_admitted


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


class CpuShare:
    """One client's share of the server's time for its messages: after a message whose receiving, decoding
    and preparing held a server thread for `busy_s` (timed where it runs, from start to end, so that a
    loaded machine's slower work counts as what it costs the others), the client's next message is not read
    for `busy_s * (1 / share - 1)` (it waits in the socket, then in TCP): its messages hold the server at most
    `share` of the time whatever it sends. A robot's messages take milliseconds: the pause is far below its
    control period, and over by the time its next message comes (it waits for its reply first). Charged from
    any thread: the event loop, the decoder, the engine's preparer."""

    def __init__(self, share: float, clock: Callable[[], float] = time.monotonic):
        self.share, self.clock = share, clock
        self._resume_at = -math.inf
        self._lock = threading.Lock()

    def charge(self, busy_s: float) -> None:
        """A message of this client held the server `busy_s` more: its next one waits that much longer (from
        now at least: an idle client banks no credit)."""
        with self._lock:
            self._resume_at = max(self._resume_at, self.clock()) + busy_s * (1.0 / self.share - 1.0)

    def timed(self, fn: Callable[..., T], *args) -> T:
        """fn(*args), charged with the time it ran (on the thread that runs it: no queueing before it counted),
        whether it returns or raises (a refused message costs the others as much)."""
        start = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.charge(time.perf_counter() - start)

    def wait_s(self) -> float:
        """How long before the client's next message may be read."""
        return max(0.0, self._resume_at - self.clock())


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
