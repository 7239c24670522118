"""The engine behind LeRobot's async-inference protocol: LeRobot's unchanged `robot_client` points its
`--server_address` here and gets chunks batched with every other client (and every ROS robot) on one engine.

The protocol (gRPC `transport.AsyncInference`, LeRobot 0.6.1's policy_server as its robot_client expects it):
  - `Ready`: a client session starts; the client (its connection, `context.peer()`) becomes a robot of the
    engine (`lerobot_<n>`). `Ready` again on the same connection restarts that session on the same robot
    (idempotent: concurrent or repeated calls never make a second robot);
  - `SendPolicyInstructions`: a pickled RemotePolicyConfig, validated, never loaded: pi05 (what the engine
    runs), the client's features mapped onto the robot config, `actions_per_chunk` <= the horizon; the
    engine's own checkpoint serves it (said in the reply's trailing metadata and the log);
  - `SendObservations`: a pickled TimedObservation in chunks (BEGIN, MIDDLE..., END; a small one is one END);
    the newest per client wins (no similarity filter: every observation may become a frame; `must_go` ones
    are never dropped for being similar);
  - `GetActions`: waits up to `actions_wait_s` for the client's newest chunk not yet fetched, then replies
    empty (as LeRobot's server does). The chunk is a pickled list[TimedAction]: action i has
    timestamp = observation timestamp + i / fps and timestep = observation timestep + i, a CPU float32
    tensor of the robot's action dimension; `actions_per_chunk` rows.
Every refusal is a gRPC error status with the reason (INVALID_ARGUMENT, RESOURCE_EXHAUSTED,
FAILED_PRECONDITION, DEADLINE_EXCEEDED, UNAVAILABLE), never an empty reply, and never INTERNAL for what a
client sent. A client never says goodbye: its robot goes when its connection cancels a waiting GetActions,
when its policy instructions are refused (its start failed: the slot is free at once for its retry), or after
`idle_timeout_s` without a call.

Admission, as gRPC's own servers bound their peers: each connection may have one call of each method in
flight (`CALLS_IN_FLIGHT`, what LeRobot's client does: one GetActions waiting, one observation streaming;
HTTP/2's max_concurrent_streams caps the connection itself), so that one connection holds at most that many
of the `2 * max_clients + SPARE_WORKERS` workers (`maximum_concurrent_rpcs` answers RESOURCE_EXHAUSTED beyond
them, never queueing); every call ends within its own deadline (an observation stream within
`stream_timeout_s`, a GetActions within `actions_wait_s`); keepalive pings are enforced (a ping flood closes
its connection) and a connection without a call for long is closed. Refusals are logged once per client,
reason and `REFUSAL_LOG_WINDOW_S` (with the count of those not logged), client-given text clipped.
"""
from __future__ import annotations

import collections
import functools
import itertools
import logging
import math
import queue
import threading
import time
from concurrent import futures
from contextlib import contextmanager
from dataclasses import dataclass

import grpc
import numpy as np
import torch

from oxygen_ros.engine.engine import ChunkResult, Engine
from oxygen_ros.engine.frames import FramePreparer
from oxygen_ros.robot.errors import InputError
from oxygen_ros.serve.layouts import LeRobotLayout
from oxygen_ros.serve.limits import OneDecoder, listener_problems

from . import services_pb2, services_pb2_grpc
from .wire import (DecodeLimits, Refused, RemotePolicyConfig, TimedAction, TimedObservation, TooLarge, clipped, decode,
                   encode)

log = logging.getLogger("oxygen_ros.serve.lerobot")

ROBOT_PREFIX = "lerobot_"
POLICY_TYPE = "pi05"
LEROBOT_PORT = 8080                    # LeRobot's policy_server default
GRPC_MESSAGE_BYTES = 4 << 20          # LeRobot's MAX_MESSAGE_SIZE (its client sends 2 MB chunks)
SERVED_BY_KEY = "x-oxygen-served-by"  # trailing metadata of SendPolicyInstructions
CALLS_IN_FLIGHT = 1                   # per connection and method (LeRobot's client: one GetActions, one stream)
SPARE_WORKERS = 8                     # beyond two per client: the short calls (Ready, instructions, refusals)
REFUSAL_LOG_WINDOW_S = 10.0           # one log line per client, refusal kind and window
MAX_NAME_CHARS = 512                  # a policy name or device (a Hub id or a path)
OBSERVATION_SLACK_BYTES = 64 << 10    # beyond the declared cameras: joints as numpy scalars, small extras


@dataclass(frozen=True)
class LeRobotOptions:
    host: str = "127.0.0.1"
    port: int = LEROBOT_PORT             # 0: any free port (LeRobotServer.port)
    max_clients: int = 8
    max_message_bytes: int = 32 << 20    # one reassembled observation
    default_prompt: str | None = None    # for observations whose task is empty
    fps: float | None = None             # TimedAction spacing; None: the robot config's control rate, else 30
    actions_wait_s: float = 2.0          # GetActions' wait before an empty reply (LeRobot's obs_queue_timeout)
    idle_timeout_s: float = 15.0         # a client without a call for this long is gone
    stream_timeout_s: float = 2.0        # one observation's whole stream (a stale one after a chunk period anyway)
    stream_stall_s: float = 0.8          # a stream with no chunk for this long has stopped sending (a 2 MiB chunk
                                         # of LeRobot's client takes 0.8 s at 21 Mbit/s)

    def problems(self) -> list[str]:
        out = listener_problems(self.port, self.max_clients, self.max_message_bytes)
        if not self.stream_timeout_s > 0:
            out.append(f"stream_timeout_s {self.stream_timeout_s} must be positive")
        if not 0 < self.stream_stall_s <= self.stream_timeout_s:
            out.append(f"stream_stall_s {self.stream_stall_s} must be positive and at most stream_timeout_s "
                       f"{self.stream_timeout_s}")
        if self.fps is not None and not self.fps > 0:
            out.append(f"fps {self.fps} must be positive")
        if not self.actions_wait_s > 0:
            out.append(f"actions_wait_s {self.actions_wait_s} must be positive")
        if not self.idle_timeout_s > self.actions_wait_s:
            out.append(f"idle_timeout_s {self.idle_timeout_s} must exceed actions_wait_s {self.actions_wait_s}")
        return out


def _finite(x: int | float) -> bool:
    try:
        return math.isfinite(x)
    except OverflowError:               # an int beyond a float's range
        return False


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, logged: bool = False):
        super().__init__(message)
        self.code, self.logged = code, logged


@dataclass(frozen=True)
class _Sent:
    obs: object                   # the Observation handed to the engine
    timestamp: float
    timestep: int
    received: float               # time.monotonic() when it was decoded


def _rpc(handler):
    """One call of `handler`: admitted (at most CALLS_IN_FLIGHT of it per connection), _Abort turned into its
    gRPC status (the text clipped, the log rate-limited); a server bug into INTERNAL with its text (never an
    empty reply)."""
    method = handler.__name__

    @functools.wraps(handler)
    def wrapped(self, request, context):
        peer = context.peer()
        try:
            with self._in_flight(peer, method):
                return handler(self, request, context)
        except _Abort as e:
            text = clipped(str(e), 300)
            if not e.logged:
                self._refusals.log(peer, method, e.code, text)
            context.abort(e.code, text)
        except Exception as e:  # noqa: BLE001 - a bug must still answer with a status saying what
            log.exception("%s from %s: server error", method, peer)
            context.abort(grpc.StatusCode.INTERNAL, clipped(f"server error: {type(e).__name__}: {e}", 300))
    return wrapped


class RefusalLog:
    """Refusals logged once per (client, call, status) and `window_s`; the ones held back are counted in the
    next line. A client calling in a loop after a server restart ("unknown client") is logged once, ever
    (the oldest of `max_keys` keys are forgotten first, so a flood of peers cannot grow the table)."""

    def __init__(self, window_s: float = REFUSAL_LOG_WINDOW_S, max_keys: int = 4096, clock=time.monotonic):
        self.window_s, self.max_keys, self.clock = window_s, max_keys, clock
        self._last: collections.OrderedDict[tuple, list] = collections.OrderedDict()   # key -> [when, held]
        self._lock = threading.Lock()

    def log(self, peer: str, method: str, code: grpc.StatusCode, text: str, once: bool = False) -> bool:
        """Log this refusal unless one like it was logged within the window (`once`: ever); True if logged."""
        key, now = (peer, method if not once else "", code, once), self.clock()
        with self._lock:
            entry = self._last.get(key)
            if entry is not None and (once or now - entry[0] < self.window_s):
                entry[1] += 1
                return False
            held = entry[1] if entry is not None else 0
            self._last[key] = [now, 0]
            self._last.move_to_end(key)
            while len(self._last) > self.max_keys:
                self._last.popitem(last=False)
        more = f" ({held} more like it in the last {now - entry[0]:.0f} s)" if held else ""
        log.warning("%s from %s refused%s: %s", method, peer, more, text)
        return True


class Client:
    """One session of one connection: its robot, its policy setup, its observation in flight, its newest
    chunk not yet fetched."""

    def __init__(self, peer: str, robot: str):
        self.peer, self.robot = peer, robot
        self.config: RemotePolicyConfig | None = None
        self.last_seen = time.monotonic()
        self.changed = threading.Condition()
        self.sent: _Sent | None = None              # the newest observation submitted
        self.frames: dict[int, _Sent] = {}          # frame index -> its observation (latest few)
        self.ready: list[TimedAction] | None = None  # the newest chunk not yet fetched
        self.ready_from: _Sent | None = None       # ... and the observation it answers
        self.failure: str | None = None            # why the engine dropped its newest frame
        self.limits: DecodeLimits | None = None     # its observations' budget, from its declared features
        self.gone = False

    def restart(self) -> None:
        """A new session on the same robot (Ready again): nothing of the previous one is kept."""
        with self.changed:
            self.config = self.limits = self.sent = self.ready = self.ready_from = self.failure = None
            self.frames = {}
            self.last_seen = time.monotonic()
            self.changed.notify_all()


class LeRobotServer(services_pb2_grpc.AsyncInferenceServicer):
    def __init__(self, engine: Engine, layout: LeRobotLayout, options: LeRobotOptions = LeRobotOptions(),
                 template: FramePreparer | None = None, served_by: str = "the engine's checkpoint"):
        problems = options.problems()
        template = template or engine.preparer
        missing = [s for s in layout.slots if s not in template.cfg.camera_slots]
        if missing:
            problems.append(f"the {layout.name} layout feeds camera slots {missing} the model does not have "
                            f"({', '.join(template.cfg.camera_slots)})")
        if problems:
            raise ValueError("; ".join(problems))
        period = template.io.control_period_s
        self.fps = options.fps or (1.0 / period if period > 0 else 30.0)
        self.engine, self.layout, self.options, self.template, self.served_by = engine, layout, options, template, served_by
        self.limits = DecodeLimits(max_bytes=options.max_message_bytes)
        self.port: int | None = None
        self._clients: dict[str, Client] = {}       # peer -> its session
        self._by_robot: dict[str, Client] = {}
        self._lock = threading.Lock()
        self._count = itertools.count()
        # Decoding on one thread of its own, one message at a time: each message's work is bounded by its
        # budget (wire.DecodeLimits: bytes built, objects walked, max_seconds), so a thread is enough, and the
        # decoded arrays need no second copy out of a process.
        self._decoder = OneDecoder("oxygen-lerobot-decode")
        self._calls: collections.Counter[tuple[str, str]] = collections.Counter()   # (peer, method) in flight
        self._refusals = RefusalLog()
        self._stop = threading.Event()
        self._served = collections.deque(maxlen=100_000)   # (robot, when, observation -> chunk s) per chunk fetched
        self._grpc: grpc.Server | None = None
        self._reaper: threading.Thread | None = None
        engine.add_frame_listener(self._on_frame)
        engine.add_chunk_listener(self._on_chunk)
        engine.add_discard_listener(self._on_discard)

    # ------------------------------------------------------------------ running
    def start(self) -> "LeRobotServer":
        """Listen (returns once the port is bound; OSError when it cannot be)."""
        o = self.options
        # Each client: one GetActions waiting, one observation stream; the spare ones answer the short calls.
        workers = 2 * o.max_clients + SPARE_WORKERS
        idle_ms = int(1e3 * (o.idle_timeout_s + 5.0))
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="oxygen-lerobot"),
                             maximum_concurrent_rpcs=workers,
                             options=[("grpc.max_receive_message_length", GRPC_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", GRPC_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", 0),
                                      # HTTP/2 streams per connection: one per method of the protocol.
                                      ("grpc.max_concurrent_streams", 4 * CALLS_IN_FLIGHT),
                                      # A connection with no call since its session would have been reaped.
                                      ("grpc.max_connection_idle_ms", idle_ms),
                                      # Keepalive enforcement: pings more often than every 10 s without data
                                      # twice over close the connection (gRPC's ping-flood protection).
                                      ("grpc.http2.min_ping_interval_without_data_ms", 10_000),
                                      ("grpc.http2.max_ping_strikes", 2),
                                      ("grpc.keepalive_time_ms", 30_000), ("grpc.keepalive_timeout_ms", 10_000)])
        services_pb2_grpc.add_AsyncInferenceServicer_to_server(self, server)
        port = server.add_insecure_port(f"{o.host}:{o.port}")
        if port == 0:
            raise OSError(f"cannot listen on {o.host}:{o.port}")
        server.start()
        self._grpc, self.port = server, port
        self._reaper = threading.Thread(target=self._reap, name="oxygen-lerobot-idle", daemon=True)
        self._reaper.start()
        log.info("LeRobot policy server on %s:%d (%s robots, up to %d clients, fps %.3g)", o.host, port,
                 self.layout.name, o.max_clients, self.fps)
        return self

    def stop(self, grace: float = 1.0) -> None:
        self._stop.set()
        if self._grpc is not None:
            self._grpc.stop(grace).wait()
        for client in list(self._clients.values()):
            self._release(client, "server stopping")
        self._decoder.close()

    def wait(self) -> None:
        self._stop.wait()

    def status(self) -> str:
        return f"LeRobot clients {len(self._clients)}/{self.options.max_clients}, {len(self._served)} chunks served"

    def served_summary(self) -> dict:
        """The chunks fetched so far: how many, the rate at which a client got them (per client session:
        chunks after its first over the time to its last; the mean over sessions), and their latency from
        the observation's arrival to the chunk's reply (decode, the engine's queue and cycle, the reply)."""
        served = list(self._served)
        if not served:
            return {"chunks": 0}
        sessions = collections.defaultdict(list)
        for robot, when, _ in served:
            sessions[robot].append(when)
        rates = [(len(t) - 1) / (t[-1] - t[0]) for t in sessions.values() if len(t) > 1 and t[-1] > t[0]]
        latency = 1e3 * np.array([s for _, _, s in served])
        return {"chunks": len(served), "sessions": len(sessions),
                "chunks_per_s_per_client": float(np.mean(rates)) if rates else None,
                "latency_ms": {"p50": float(np.percentile(latency, 50)), "p90": float(np.percentile(latency, 90)),
                               "max": float(latency.max())}}

    @property
    def clients(self) -> dict[str, str]:
        """peer -> engine robot name (the sessions served now)."""
        with self._lock:
            return {peer: c.robot for peer, c in self._clients.items()}

    # ------------------------------------------------------------------ RPCs
    @_rpc
    def Ready(self, request, context):  # noqa: N802 - gRPC's method name
        peer = context.peer()
        with self._lock:            # check and add at once: concurrent Readys never make two robots
            old = self._clients.get(peer)
            if old is not None:
                old.restart()
                # DEBUG: LeRobot's client says Ready once per run; a loop of them must not flood the log.
                log.debug("LeRobot client %s ready again: a new session on robot %s", peer, old.robot)
                return services_pb2.Empty()
            if len(self._clients) >= self.options.max_clients:
                raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"server full: {self.options.max_clients} LeRobot clients connected (--max-clients)")
            robot = f"{ROBOT_PREFIX}{next(self._count)}"
            try:
                # No captions (nobody reads them) and no RTC (the client blends chunks itself).
                self.engine.add_robot(robot, self.template, captions=False, rtc=False)
            except ValueError as e:
                raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"the engine cannot take one more robot: {e}")
            client = Client(peer, robot)
            self._clients[peer], self._by_robot[robot] = client, client
        log.info("LeRobot client %s ready: robot %s", peer, robot)
        return services_pb2.Empty()

    @_rpc
    def SendPolicyInstructions(self, request, context):  # noqa: N802
        client = self._client(context)
        try:
            config = self._decode(request.data, RemotePolicyConfig)
            problems = self._config_problems(config, client)
            if problems:
                raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "policy instructions refused: " + "; ".join(problems))
        except _Abort:
            # LeRobot's client gives up when its instructions are refused: its slot is free for the retry now.
            self._release(client, "its policy instructions were refused")
            raise
        limits = self._observation_limits(config)
        with client.changed:
            if client.gone:
                raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, "this client was removed meanwhile: call Ready")
            client.config, client.limits = config, limits
        log.info("LeRobot client %s (%s): policy %s %r, %d actions per chunk, device %r: served by %s (no per-client "
                 "load)", client.peer, client.robot, config.policy_type, config.pretrained_name_or_path,
                 config.actions_per_chunk, config.device, self.served_by)
        # Checked printable, made ASCII: a metadata value may hold neither control characters nor non-ASCII.
        name = config.pretrained_name_or_path.encode("ascii", "backslashreplace").decode()
        context.set_trailing_metadata(((SERVED_BY_KEY, f"{name} -> {self.served_by}"),))
        return services_pb2.Empty()

    @_rpc
    def SendObservations(self, request_iterator, context):  # noqa: N802
        client = self._client(context)
        if client.config is None:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, "send the policy instructions before observations")
        data = self._reassemble(request_iterator, context, client)
        timed = self._decode(data, TimedObservation, client.limits)
        problems = []
        if type(timed.timestep) is not int or timed.timestep < 0:
            problems.append(clipped(f"timestep must be a non-negative int, got {timed.timestep!r}"))
        if isinstance(timed.timestamp, bool) or not isinstance(timed.timestamp, (int, float)) \
                or not _finite(timed.timestamp):
            problems.append(clipped(f"timestamp must be a finite number, got {timed.timestamp!r}"))
        if not isinstance(timed.must_go, bool):
            problems.append(f"must_go must be a bool, got {type(timed.must_go).__name__}")
        if not isinstance(timed.observation, dict):
            problems.append(f"observation must be a dict, got {type(timed.observation).__name__}")
        if problems:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "bad TimedObservation: " + "; ".join(problems))
        try:
            obs = self.layout.observation(timed.observation, time.monotonic(), self.options.default_prompt,
                                          client.config.rename_map)
        except InputError as e:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, str(e))
        except (TypeError, ValueError, OverflowError) as e:     # a value no robot sends, e.g. a 400-digit joint
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"bad observation: {type(e).__name__}: {e}")
        sent = _Sent(obs, float(timed.timestamp), timed.timestep, time.monotonic())
        with client.changed:
            if client.gone:
                raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, "this client was removed (idle, or replaced by a new Ready): call Ready")
            client.sent, client.failure = sent, None
        try:
            # Latest wins: it replaces the robot's observation not yet taken by the engine (must_go or not:
            # a newer observation of the same robot always serves it better).
            self.engine.submit_observation(obs, robot=client.robot)
        except ValueError as e:          # the robot was removed meanwhile (idle timeout, a new session)
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, f"this client was removed ({e}): call Ready")
        return services_pb2.Empty()

    @_rpc
    def GetActions(self, request, context):  # noqa: N802
        client = self._client(context)
        deadline = time.monotonic() + self.options.actions_wait_s
        with client.changed:
            while client.ready is None and client.failure is None and not client.gone:
                left = deadline - time.monotonic()
                if left <= 0 or not context.is_active():
                    break
                client.changed.wait(min(left, 0.1))
                client.last_seen = time.monotonic()
            chunk, failure, answered = client.ready, client.failure, client.ready_from
            client.ready = client.failure = client.ready_from = None
        if not context.is_active():             # the client closed its channel: it is gone
            self._release(client, "client disconnected")
            return services_pb2.Actions()
        if failure is not None:
            raise _Abort(grpc.StatusCode.ABORTED, f"no chunk for the newest observation: {failure}")
        if self.engine.faulted:
            raise _Abort(grpc.StatusCode.UNAVAILABLE, f"engine safe stop: {self.engine.faulted}")
        if chunk is None:
            return services_pb2.Actions()       # nothing yet: the client asks again (LeRobot's behaviour)
        reply = services_pb2.Actions(data=encode(chunk))
        now = time.monotonic()
        self._served.append((client.robot, now, now - answered.received))
        return reply

    # ------------------------------------------------------------------ helpers (gRPC threads)
    @contextmanager
    def _in_flight(self, peer: str, method: str):
        """Admit one call of `method` from the connection `peer`: RESOURCE_EXHAUSTED beyond CALLS_IN_FLIGHT,
        at once (a refused call holds nothing)."""
        key = (peer, method)
        with self._lock:
            if self._calls[key] >= CALLS_IN_FLIGHT:
                raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                             f"{method}: {CALLS_IN_FLIGHT} call in flight per connection (LeRobot's client makes one "
                             "at a time); wait for its reply")
            self._calls[key] += 1
        try:
            yield
        finally:
            with self._lock:
                self._calls[key] -= 1
                if not self._calls[key]:
                    del self._calls[key]

    def _client(self, context) -> Client:
        peer = context.peer()
        with self._lock:
            client = self._clients.get(peer)
        if client is None:
            text = (f"unknown client {peer}: call Ready first (or the session timed out after "
                    f"{self.options.idle_timeout_s:g} s without a call, or the server restarted)")
            # A client left running across a server restart asks in a loop: logged once per connection.
            self._refusals.log(peer, "unknown client", grpc.StatusCode.FAILED_PRECONDITION, text, once=True)
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, text, logged=True)
        client.last_seen = time.monotonic()
        return client

    def _reassemble(self, request_iterator, context, client: Client) -> bytes:
        """LeRobot's chunked transfer: BEGIN starts (a lone END is a whole observation), MIDDLE appends, END
        ends. The bytes of the whole stream are counted against the cap before each chunk is kept, and the
        stream must end within `stream_timeout_s` and bring a chunk at least every `stream_stall_s`
        (DEADLINE_EXCEEDED): a reader thread pulls the chunks, at most two ahead, so that this call can give up
        on a client that stops sending."""
        cap, parts, size = self.options.max_message_bytes, [], 0
        chunks: queue.Queue = queue.Queue(maxsize=2)
        done = threading.Event()

        def pull() -> None:
            end = None                                  # the stream ended
            try:
                for message in request_iterator:
                    if not _put(message):
                        return
            except grpc.RpcError:
                end = grpc.RpcError                     # its connection went
            _put(end)

        def _put(item) -> bool:
            while not done.is_set():
                try:
                    chunks.put(item, timeout=0.1)
                    return True
                except queue.Full:
                    continue
            return False

        threading.Thread(target=pull, name="oxygen-lerobot-stream", daemon=True).start()
        deadline = time.monotonic() + self.options.stream_timeout_s
        try:
            while True:
                wait = min(deadline - time.monotonic(), self.options.stream_stall_s)
                try:
                    message = chunks.get(timeout=max(0.0, wait))
                except queue.Empty:
                    why = (f"did not end within {self.options.stream_timeout_s:g} s" if time.monotonic() >= deadline
                           else f"sent nothing for {self.options.stream_stall_s:g} s")
                    raise _Abort(grpc.StatusCode.DEADLINE_EXCEEDED,
                                 f"the observation stream {why} ({size} bytes received)") from None
                if message is None or message is grpc.RpcError:
                    gone = message is grpc.RpcError
                    break
                client.last_seen = time.monotonic()
                state = message.transfer_state
                if state == services_pb2.TRANSFER_BEGIN:
                    parts, size = [], 0
                elif state not in (services_pb2.TRANSFER_MIDDLE, services_pb2.TRANSFER_END):
                    raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"unknown transfer state {state}")
                size += len(message.data)
                if size > cap:
                    raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                 f"observation over {cap} bytes (--max-message-mb): refused before decoding")
                parts.append(message.data)
                if state == services_pb2.TRANSFER_END:
                    return b"".join(parts)
        finally:
            done.set()
        # A closing channel may half-close its streams before it cancels them: a moment to tell the two apart.
        end = time.monotonic() + 0.2
        while not gone and context.is_active() and time.monotonic() < end:
            time.sleep(0.01)
        if gone or not context.is_active():
            self._release(client, "client disconnected in the middle of an observation")
            raise _Abort(grpc.StatusCode.CANCELLED, "client disconnected")
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "the observation stream ended without TRANSFER_END")

    def _decode(self, data: bytes, expect: type, limits: DecodeLimits | None = None):
        try:
            return self._decoder.submit(decode, data, expect, limits or self.limits).result()
        except TooLarge as e:
            raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except (Refused, MemoryError, RecursionError) as e:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{type(e).__name__}: {e}")
        except Exception as e:  # noqa: BLE001 - a decoder gap is still the client's bytes: never INTERNAL
            log.exception("%s: undecodable message (the decoder did not expect this)", expect.__name__)
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{expect.__name__}: undecodable: {type(e).__name__}: {e}")

    def _observation_limits(self, config: RemotePolicyConfig) -> DecodeLimits:
        """What one observation of this client may build: its declared cameras (uint8 H x W x 3, what the
        layout accepts), its joints and a little slack; never more than the byte cap."""
        images, count = 0, 0
        for key, value in config.lerobot_features.items():
            shape = value.get("shape") if isinstance(value, dict) else None
            if key.startswith("observation.images.") and isinstance(shape, (tuple, list)) \
                    and all(type(d) is int and d > 0 for d in shape):
                images += math.prod(shape)
                count += 1
        joints = len(self.layout.joints)
        return DecodeLimits(max_bytes=self.limits.max_bytes, max_arrays=count + joints + 8,
                            max_built_bytes=min(self.limits.max_bytes, images + OBSERVATION_SLACK_BYTES))

    def _config_problems(self, config: RemotePolicyConfig, client: Client) -> list[str]:
        out = []
        kinds = {"policy_type": str, "pretrained_name_or_path": str, "device": str, "rename_map": dict}
        out += [f"{k} must be a {t.__name__}, got {type(getattr(config, k)).__name__}" for k, t in kinds.items()
                if not isinstance(getattr(config, k), t)]
        for key in ("pretrained_name_or_path", "device"):
            value = getattr(config, key)
            if isinstance(value, str) and (len(value) > MAX_NAME_CHARS or not value.isprintable()):
                out.append(f"{key} {clipped(repr(value), 80)}: at most {MAX_NAME_CHARS} printable characters (no "
                           "line breaks or control characters)")
        if isinstance(config.policy_type, str) and config.policy_type != POLICY_TYPE:
            out.append(f"policy_type {clipped(repr(config.policy_type), 80)}: this server runs {POLICY_TYPE} (the "
                       "engine's checkpoint)")
        try:
            horizon = self.engine.robot_info(client.robot).action_horizon
        except (KeyError, ValueError):            # the session went meanwhile (idle, a new Ready)
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, "this client was removed meanwhile: call Ready") from None
        n = config.actions_per_chunk
        if type(n) is not int or not 1 <= n <= horizon:
            out.append(f"actions_per_chunk {clipped(repr(n), 40)} must be an int in 1..{horizon} (the model's horizon)")
        rename = config.rename_map if isinstance(config.rename_map, dict) else {}
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in rename.items()):
            out.append("rename_map must map strings to strings")
            rename = {}
        out += [clipped(p) for p in self.layout.feature_problems(config.lerobot_features, rename)]
        return out

    def _release(self, client: Client, reason: str) -> None:
        with self._lock:
            if self._clients.get(client.peer) is client:
                del self._clients[client.peer]
            if self._by_robot.pop(client.robot, None) is None:
                return
        with client.changed:
            client.gone = True
            client.changed.notify_all()
        try:
            self.engine.remove_robot(client.robot, reason)
        except (KeyError, ValueError):
            pass
        log.info("LeRobot client %s (%s) gone: %s", client.peer, client.robot, reason)

    def _reap(self) -> None:
        while not self._stop.wait(0.5):
            now = time.monotonic()
            with self._lock:
                idle = [c for c in self._clients.values() if now - c.last_seen > self.options.idle_timeout_s]
            for client in idle:
                self._release(client, f"no call for {self.options.idle_timeout_s:g} s")

    # ------------------------------------------------------------------ engine listeners (engine thread)
    def _on_frame(self, index: int, obs) -> None:
        with self._lock:
            clients = list(self._by_robot.values())
        for client in clients:
            sent = client.sent
            if sent is not None and sent.obs is obs:
                with client.changed:
                    client.frames[index] = sent
                    while len(client.frames) > 8:
                        client.frames.pop(next(iter(client.frames)))
                return

    def _on_chunk(self, chunk: ChunkResult) -> None:
        with self._lock:
            client = self._by_robot.get(chunk.robot)
        if client is None or client.config is None:
            return
        with client.changed:
            sent = client.frames.pop(chunk.plan.frame_index, None)
        if sent is None:
            return
        rows = torch.as_tensor(chunk.plan.actions[:client.config.actions_per_chunk], dtype=torch.float32)
        dt = 1.0 / self.fps
        actions = [TimedAction(timestamp=sent.timestamp + i * dt, timestep=sent.timestep + i, action=row.clone())
                   for i, row in enumerate(rows)]
        with client.changed:
            client.ready, client.ready_from = actions, sent
            client.changed.notify_all()

    def _on_discard(self, robot: str, why: str) -> None:
        with self._lock:
            client = self._by_robot.get(robot)
        if client is not None:
            with client.changed:
                client.failure = why
                client.changed.notify_all()
