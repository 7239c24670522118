"""Socket clients as robots of one engine, and their observations' way to a chunk and back.

Each connection is a robot of the fleet engine (issue #17): its own intake slot (newest observation wins),
deadline, policy I/O and norm stats (those of the served robot config), its language requests owned by it.
The frames of concurrent clients are prefilled in one forward and denoised in one batch like any fleet's.

`ClientSlots` is the one place that knows how a client becomes a robot; `EngineHub` matches chunks to the
observations they were computed from: a client has at most one observation in flight (openpi's protocol is
request/reply), the engine's frame listener says which frame index it became (and in which cycle, with how
many other frames), its chunk listener delivers the chunk of that frame index. A frame the engine
discards (a bad observation, non-finite actions, a failed output transform: the engine's discard listener)
fails the client's wait with the reason instead of leaving it waiting. What the engine spends converting a
client's observation into model inputs (resizing its images: the engine's prepare listener) is charged to
that client's `CpuShare`, as its receiving and decoding are: a client sending huge images waits for them.
"""
from __future__ import annotations

import asyncio
import collections
import itertools
import threading
from dataclasses import dataclass

from oxygen_ros.engine.engine import ChunkResult, Engine
from oxygen_ros.engine.frames import FramePreparer
from oxygen_ros.robot.sync import Observation

from .limits import CpuShare

CLIENT_PREFIX = "openpi_"


class FrameFailed(Exception):
    """The engine will not compute a chunk for this observation: the text says why."""


@dataclass(frozen=True)
class Computed:
    chunk: ChunkResult
    cycle_frames: int          # frames prefilled and denoised together in the chunk's cycle (all robots)


@dataclass(eq=False)
class Ticket:
    """One observation of a client on its way through the engine."""

    robot: str
    obs: Observation
    loop: asyncio.AbstractEventLoop
    future: asyncio.Future
    frame_index: int | None = None
    cycle: int | None = None


class EngineHub:
    """The engine's listeners, shared by every client: frame announcements and chunks to tickets, preparation
    costs to the clients' shares."""

    _CYCLES_KEPT = 256

    def __init__(self, engine: Engine):
        self.engine = engine
        self._lock = threading.Lock()
        self._tickets: dict[str, Ticket] = {}             # robot -> its observation in flight
        self._shares: dict[str, CpuShare] = {}            # robot -> its client's share of the server's time
        self._cycle_frames: collections.OrderedDict[int, int] = collections.OrderedDict()
        engine.add_frame_listener(self._on_frame)
        engine.add_chunk_listener(self._on_chunk)
        engine.add_discard_listener(self.fail)
        engine.add_prepare_listener(self._on_prepared)

    # ------------------------------------------------------------------ event loop side
    def join(self, robot: str, share: CpuShare) -> None:
        """A client is the engine's `robot`: what preparing its observations costs is charged to `share`."""
        with self._lock:
            self._shares[robot] = share

    def leave(self, robot: str) -> None:
        with self._lock:
            self._shares.pop(robot, None)

    def submit(self, robot: str, obs: Observation) -> Ticket:
        """Hand a client's observation to the engine; await `ticket.future` for its Computed."""
        loop = asyncio.get_running_loop()
        ticket = Ticket(robot, obs, loop, loop.create_future())
        with self._lock:
            old = self._tickets.get(robot)
            self._tickets[robot] = ticket
        if old is not None:
            _resolve(old, FrameFailed("replaced by a newer observation of the same client"))
        self.engine.submit_observation(obs, robot=robot)
        return ticket

    def discarded(self) -> str:
        """Why no frame is computed at all now (the engine's safe stop), or ''."""
        return f"engine safe stop: {self.engine.faulted}" if self.engine.faulted else ""

    def in_flight(self) -> list[str]:
        """The robots whose observation waits for its chunk."""
        with self._lock:
            return sorted(self._tickets)

    def forget(self, ticket: Ticket) -> None:
        with self._lock:
            if self._tickets.get(ticket.robot) is ticket:
                del self._tickets[ticket.robot]

    # ------------------------------------------------------------------ engine (or preparer) thread
    def fail(self, robot: str, message: str) -> None:
        """The engine discarded this robot's frame (a bad observation, a fault): its ticket fails with why."""
        with self._lock:
            ticket = self._tickets.get(robot)
        if ticket is not None:
            _resolve(ticket, FrameFailed(message))

    def _on_frame(self, index: int, obs) -> None:
        # Called for each frame of a cycle before any chunk of it; stats count a cycle when it ends, so every
        # frame announced while the counter reads c belongs to the same cycle.
        cycle = self.engine.stats.counter("cycles")
        with self._lock:
            self._cycle_frames[cycle] = self._cycle_frames.get(cycle, 0) + 1
            while len(self._cycle_frames) > self._CYCLES_KEPT:
                self._cycle_frames.popitem(last=False)
            for ticket in self._tickets.values():
                if ticket.obs is obs:
                    ticket.frame_index, ticket.cycle = index, cycle

    def _on_prepared(self, robot: str, seconds: float) -> None:
        with self._lock:
            share = self._shares.get(robot)
        if share is not None:               # else not a client's robot (the bringup's own), or it left
            share.charge(seconds)

    def _on_chunk(self, chunk: ChunkResult) -> None:
        with self._lock:
            ticket = self._tickets.get(chunk.robot)
            if ticket is None or ticket.frame_index != chunk.plan.frame_index:
                return
            frames = self._cycle_frames.get(ticket.cycle, 1)
        _resolve(ticket, Computed(chunk, frames))


def _resolve(ticket: Ticket, outcome) -> None:
    def settle():
        if not ticket.future.done():
            if isinstance(outcome, Exception):
                ticket.future.set_exception(outcome)
            else:
                ticket.future.set_result(outcome)
    try:
        ticket.loop.call_soon_threadsafe(settle)
    except RuntimeError:        # the client's event loop has closed: nobody waits any more
        pass


class ClientSlots:
    """Clients as robots of the engine: a robot (openpi_<n>, n counting connections) is added when a client
    connects, with the served robot config's policy I/O, and removed when it goes (its pending frame is
    dropped, its requests end)."""

    def __init__(self, engine: Engine, template: FramePreparer, capacity: int):
        self.engine, self.template, self.capacity = engine, template, capacity
        self._clients: set[str] = set()
        self._count = itertools.count()
        self._lock = threading.Lock()

    @property
    def in_use(self) -> int:
        with self._lock:
            return len(self._clients)

    def acquire(self) -> str | None:
        """The robot name of a new client, or None when `capacity` clients are connected. ValueError when the
        engine cannot take one more robot (its KV pool)."""
        with self._lock:
            if len(self._clients) >= self.capacity:
                return None
            name = f"{CLIENT_PREFIX}{next(self._count)}"
            # Its captions would go to ROS topics a socket client never sees: none for its frames. No RTC
            # guidance either: an openpi client plays each chunk open-loop for its own replan rows, while the
            # guidance assumes the newest chunk plays at once (docs/rtc.md).
            self.engine.add_robot(name, self.template, captions=False, rtc=False)
            self._clients.add(name)
            return name

    def release(self, robot: str, reason: str) -> None:
        with self._lock:
            if robot in self._clients:
                self._clients.discard(robot)
                self.engine.remove_robot(robot, reason)
