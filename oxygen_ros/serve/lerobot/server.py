"""The engine behind LeRobot's async-inference protocol: LeRobot's unchanged `robot_client` points its
`--server_address` here and gets chunks batched with every other client (and every ROS robot) on one engine.

The protocol (gRPC `transport.AsyncInference`, LeRobot 0.6.1's policy_server as its robot_client expects it):
  - `Ready`: a client session starts; the client (its connection, `context.peer()`) becomes a robot of the
    engine (`lerobot_<n>`). A second `Ready` from the same connection starts a new session (a new robot);
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
FAILED_PRECONDITION, UNAVAILABLE), never an empty reply. A client never says goodbye: its robot goes when
its connection cancels a waiting GetActions, or after `idle_timeout_s` without a call.
"""
from __future__ import annotations

import collections
import functools
import itertools
import logging
import threading
import time
from concurrent import futures
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
from .wire import DecodeLimits, Refused, RemotePolicyConfig, TimedAction, TimedObservation, TooLarge, decode, encode

log = logging.getLogger("oxygen_ros.serve.lerobot")

ROBOT_PREFIX = "lerobot_"
POLICY_TYPE = "pi05"
LEROBOT_PORT = 8080                    # LeRobot's policy_server default
GRPC_MESSAGE_BYTES = 4 << 20          # LeRobot's MAX_MESSAGE_SIZE (its client sends 2 MB chunks)
SERVED_BY_KEY = "x-oxygen-served-by"  # trailing metadata of SendPolicyInstructions


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

    def problems(self) -> list[str]:
        out = listener_problems(self.port, self.max_clients, self.max_message_bytes)
        if self.fps is not None and not self.fps > 0:
            out.append(f"fps {self.fps} must be positive")
        if not self.actions_wait_s > 0:
            out.append(f"actions_wait_s {self.actions_wait_s} must be positive")
        if not self.idle_timeout_s > self.actions_wait_s:
            out.append(f"idle_timeout_s {self.idle_timeout_s} must exceed actions_wait_s {self.actions_wait_s}")
        return out


class _Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str):
        super().__init__(message)
        self.code = code


@dataclass(frozen=True)
class _Sent:
    obs: object                   # the Observation handed to the engine
    timestamp: float
    timestep: int
    received: float               # time.monotonic() when it was decoded


def _rpc(handler):
    """Turn _Abort into a gRPC status; a server bug into INTERNAL with its text (never an empty reply)."""
    @functools.wraps(handler)
    def wrapped(self, request, context):
        try:
            return handler(self, request, context)
        except _Abort as e:
            log.warning("%s from %s refused: %s", handler.__name__, context.peer(), e)
            context.abort(e.code, str(e))
        except Exception as e:  # noqa: BLE001 - a bug must still answer with a status saying what
            log.exception("%s from %s: server error", handler.__name__, context.peer())
            context.abort(grpc.StatusCode.INTERNAL, f"server error: {type(e).__name__}: {e}")
    return wrapped


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
        self.gone = False


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
        self._decoder = OneDecoder("oxygen-lerobot-decode")
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
        workers = 2 * o.max_clients + 4         # each client: one GetActions waiting, one observation stream
        server = grpc.server(futures.ThreadPoolExecutor(max_workers=workers, thread_name_prefix="oxygen-lerobot"),
                             maximum_concurrent_rpcs=workers,
                             options=[("grpc.max_receive_message_length", GRPC_MESSAGE_BYTES),
                                      ("grpc.max_send_message_length", GRPC_MESSAGE_BYTES),
                                      ("grpc.so_reuseport", 0)])
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
        with self._lock:
            old = self._clients.get(peer)
        if old is not None:
            self._release(old, "a new session of the same connection (Ready again)")
        with self._lock:
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
        config = self._decode(request.data, RemotePolicyConfig)
        problems = self._config_problems(config, client)
        if problems:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "policy instructions refused: " + "; ".join(problems))
        client.config = config
        log.info("LeRobot client %s (%s): policy %s %r, %d actions per chunk, device %r: served by %s (no per-client "
                 "load)", client.peer, client.robot, config.policy_type, config.pretrained_name_or_path,
                 config.actions_per_chunk, config.device, self.served_by)
        context.set_trailing_metadata(((SERVED_BY_KEY, f"{config.pretrained_name_or_path} -> {self.served_by}"),))
        return services_pb2.Empty()

    @_rpc
    def SendObservations(self, request_iterator, context):  # noqa: N802
        client = self._client(context)
        if client.config is None:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION, "send the policy instructions before observations")
        data = self._reassemble(request_iterator, context, client)
        timed = self._decode(data, TimedObservation)
        problems = []
        if type(timed.timestep) is not int or timed.timestep < 0:
            problems.append(f"timestep must be a non-negative int, got {timed.timestep!r}")
        if isinstance(timed.timestamp, bool) or not isinstance(timed.timestamp, (int, float)) \
                or timed.timestamp != timed.timestamp or abs(timed.timestamp) == float("inf"):
            problems.append(f"timestamp must be a finite number, got {timed.timestamp!r}")
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
    def _client(self, context) -> Client:
        with self._lock:
            client = self._clients.get(context.peer())
        if client is None:
            raise _Abort(grpc.StatusCode.FAILED_PRECONDITION,
                         f"unknown client {context.peer()}: call Ready first (or the session timed out after "
                         f"{self.options.idle_timeout_s:g} s without a call)")
        client.last_seen = time.monotonic()
        return client

    def _reassemble(self, request_iterator, context, client: Client) -> bytes:
        """LeRobot's chunked transfer: BEGIN starts (a lone END is a whole observation), MIDDLE appends, END
        ends; the byte cap is checked before each chunk is kept."""
        cap, parts, size = self.options.max_message_bytes, [], 0
        try:
            for message in request_iterator:
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
        except grpc.RpcError:
            pass
        if not context.is_active():
            self._release(client, "client disconnected in the middle of an observation")
            raise _Abort(grpc.StatusCode.CANCELLED, "client disconnected")
        raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, "the observation stream ended without TRANSFER_END")

    def _decode(self, data: bytes, expect: type):
        try:
            return self._decoder.submit(decode, data, expect, self.limits).result()
        except TooLarge as e:
            raise _Abort(grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except (Refused, MemoryError, RecursionError) as e:
            raise _Abort(grpc.StatusCode.INVALID_ARGUMENT, f"{type(e).__name__}: {e}")

    def _config_problems(self, config: RemotePolicyConfig, client: Client) -> list[str]:
        out = []
        kinds = {"policy_type": str, "pretrained_name_or_path": str, "device": str, "rename_map": dict}
        out += [f"{k} must be a {t.__name__}, got {type(getattr(config, k)).__name__}" for k, t in kinds.items()
                if not isinstance(getattr(config, k), t)]
        if isinstance(config.policy_type, str) and config.policy_type != POLICY_TYPE:
            out.append(f"policy_type {config.policy_type!r}: this server runs {POLICY_TYPE} (the engine's checkpoint)")
        horizon = self.engine.robot_info(client.robot).action_horizon
        n = config.actions_per_chunk
        if type(n) is not int or not 1 <= n <= horizon:
            out.append(f"actions_per_chunk {n!r} must be an int in 1..{horizon} (the model's horizon)")
        rename = config.rename_map if isinstance(config.rename_map, dict) else {}
        if not all(isinstance(k, str) and isinstance(v, str) for k, v in rename.items()):
            out.append("rename_map must map strings to strings")
            rename = {}
        out += self.layout.feature_problems(config.lerobot_features, rename)
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
