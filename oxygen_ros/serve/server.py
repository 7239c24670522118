"""The engine behind openpi's websocket policy protocol: any `openpi-client` robot program points its
`WebsocketClientPolicy` here and gets chunks batched with every other client on one engine, plus answers
about what it sees on the same socket.

Protocol (openpi's `WebsocketPolicyServer`, as its client expects it):
  - `GET /healthz` -> 200 "OK"; with an API key, the handshake needs `Authorization: Api-Key <key>` (what
    `WebsocketClientPolicy(api_key=...)` sends), else the websocket opens and closes at once with 1008 and
    the reason, which the client raises (a plain HTTP request: 401); beyond `max_clients` connections,
    HTTP 503;
  - on connect the server sends its metadata (msgpack): the observation keys, action horizon and dimension...;
  - each binary msgpack-numpy message is answered by one message:
      an observation (the robot config's openpi keys, see layouts.py)
          -> {"actions": [H, D] robot units after the output transforms, "subtask": the text that conditioned
              them (hierarchical policies; "" when none),
              "server_timing": {"infer_ms", "prev_total_ms"}, "policy_timing": {"infer_ms", "frame_index",
              "cycle_frames"}};
      {"question": str, "max_tokens": int, ...} -> {"text", "finish_reason", "frame_index", "tokens",
          "server_timing"} about the client's newest observation (with observation keys in the same message:
          about that one, and its "actions" come back too: one prefill serves both);
  - an error is a text frame (the client raises RuntimeError with it); the connection stays usable after a
    bad message (malformed msgpack, wrong keys, shapes or values, a refused question). A message over
    `max_message_bytes` closes the connection (websocket close 1009: its bytes are not read); a server bug
    sends its traceback and closes (1011), as openpi's server does.

Concurrency: one asyncio loop serves every connection; the engine computes on its own thread. A client has
at most one message in flight (the protocol is request/reply) and waits only for its own frame, so a slow,
stalled or vanished client delays nobody; when it goes, its slot is freed and its requests end at once,
whatever its message was waiting for.

What a client can cost the process is bounded before it is read (limits.py), as websockets' own server
bounds it (`open_timeout`, `max_size`, `max_queue`) plus a door strangers cannot hold shut: at most
`max_handshakes` connections wait at the door (accepted, not admitted) and `max_clients` are admitted;
a connection coming to a full door pushes out the one silent the longest there (a robot program sends its
request head at once: a flood of silent sockets displaces only itself); `handshake_timeout_s` to send a
request head and to close; the key is checked first, and only failures count against the peer's address
(10 in 10 s, then HTTP 429 for its wrong keys, while its right key is still admitted); messages are
decoded one at a time on one thread, after protocol.scan refused any with more objects or nesting than an
openpi message has.
"""
from __future__ import annotations

import asyncio
import hmac
import http
import logging
import math
import socket
import threading
import time
import traceback
from dataclasses import dataclass, replace
from typing import Callable

import websockets
from websockets.asyncio.server import ServerConnection, serve
from websockets.frames import CloseCode

from oxygen_ros.engine.engine import Engine
from oxygen_ros.engine.frames import FramePreparer
from oxygen_ros.engine.requests import Reply, Sampling, TextRequest
from oxygen_ros.robot.errors import InputError

from .clients import ClientSlots, Computed, EngineHub, FrameFailed
from .layouts import Layout
from .limits import CpuShare, Doorway, OneDecoder, PeerFailures, listener_problems
from .protocol import ProtocolError, pack, unpack

log = logging.getLogger("oxygen_ros.serve")

QUESTION_KEYS = ("question", "max_tokens", "temperature", "top_p", "seed", "stop", "timeout_s")
FAILURE_WINDOW_S = 10.0             # failed handshakes per peer are counted over this window
KEY_HELP = "missing or wrong API key: WebsocketClientPolicy(host, port, api_key=...) sends it"   # a close reason


@dataclass(frozen=True)
class ServeOptions:
    host: str = "127.0.0.1"
    port: int = 8000                         # 0: any free port (see OpenpiServer.port)
    api_key: str | None = None
    max_clients: int = 8
    max_message_bytes: int = 32 << 20
    default_prompt: str | None = None        # for observations without "prompt" (openpi's --default_prompt)
    reply_timeout_s: float = 60.0            # a frame still without its chunk after this long is an error
    serial: bool = False                     # one client's frame at a time (openpi's server model; benchmark)
    max_handshakes: int = 32                 # connections at the door (handshakes, refusals closing)
    handshake_timeout_s: float = 3.0         # to send the request head; also to answer the closing handshake
    failed_handshakes_per_peer: int = 10     # in any 10 s; beyond, HTTP 429 for the peer's wrong keys
    client_time_share: float = 0.25          # of the server's time, for one client's messages (CpuShare)

    def problems(self) -> list[str]:
        out = listener_problems(self.port, self.max_clients, self.max_message_bytes)
        if not self.reply_timeout_s > 0:
            out.append(f"reply_timeout_s {self.reply_timeout_s} must be positive")
        if self.max_handshakes < 1:
            out.append(f"max_handshakes {self.max_handshakes} must be at least 1")
        if not 0 < self.handshake_timeout_s <= 60:
            out.append(f"handshake_timeout_s {self.handshake_timeout_s} must be in (0, 60]")
        if not 0 < self.client_time_share <= 1:
            out.append(f"client_time_share {self.client_time_share} must be in (0, 1]")
        if self.failed_handshakes_per_peer < 1:
            out.append(f"failed_handshakes_per_peer {self.failed_handshakes_per_peer} must be at least 1")
        if self.api_key is not None and not self.api_key.strip():
            out.append("the API key is empty")
        return out


class ClientGone(Exception):
    pass


class CountedConnection(ServerConnection):
    """A connection counted at the server's door from accept to close (limits.Doorway): when the door is full
    the connection that has waited longest there is aborted, before anything more is read from it.
    `refusal`: why the handler must close it (a wrong key)."""

    def __init__(self, server: "OpenpiServer", *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.openpi, self.refusal = server, ""
        # Its receiving, decoding and layout transform (charged here), its frames' preparation (by the EngineHub)
        self.pace = CpuShare(server.options.client_time_share)

    def connection_made(self, transport) -> None:
        super().connection_made(transport)
        self.openpi.at_the_door(self.openpi.door.accept(self, _bytes_waiting(transport)))

    def data_received(self, data: bytes) -> None:
        self.openpi.door.spoke(self)
        self.pace.timed(super().data_received, data)         # framing, unmasking, assembling: on the loop

    def connection_lost(self, exc) -> None:
        self.openpi.door.close(self)
        super().connection_lost(exc)


class RequestFailed(Exception):
    """A question the engine refused or could not answer: the text says why."""


def openpi_server(engine: Engine, layout: Layout, options: ServeOptions = ServeOptions(),
                  template: FramePreparer | None = None) -> "OpenpiServer":
    """The server for `engine`: each client becomes a robot of it with `template`'s policy I/O (default: the
    engine's first robot's, i.e. the robot config it was built with)."""
    hub = EngineHub(engine)
    slots = ClientSlots(engine, template or engine.preparer, options.max_clients)
    return OpenpiServer(engine, slots, hub, layout, options)


class OpenpiServer:
    def __init__(self, engine: Engine, slots: ClientSlots, hub: EngineHub, layout: Layout,
                 options: ServeOptions = ServeOptions()):
        problems = options.problems()
        model_slots = slots.template.cfg.camera_slots
        missing = [s for s in layout.slots if s not in model_slots]
        if missing:
            problems.append(f"the {layout.name} layout feeds camera slots {missing} the model does not have "
                            f"({', '.join(model_slots)})")
        if problems:
            raise ValueError("; ".join(problems))
        self.engine, self.slots, self.hub, self.layout, self.options = engine, slots, hub, layout, options
        self.port: int | None = None             # the bound port once running
        self._serial = asyncio.Lock() if options.serial else None
        self.door: Doorway[CountedConnection] = Doorway(options.max_handshakes, options.max_clients)
        self.failures = PeerFailures(options.failed_handshakes_per_peer, FAILURE_WINDOW_S)
        self.decoder: OneDecoder | None = None
        self._door_logged_at = -math.inf
        self._trim_timer: asyncio.TimerHandle | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stopping: asyncio.Event | None = None
        self._thread: threading.Thread | None = None

    # ------------------------------------------------------------------ running
    async def serve_until(self, stop: asyncio.Event, on_ready: Callable[[int], None] | None = None) -> None:
        """Serve until `stop` is set; `on_ready(port)` once listening."""
        o = self.options
        self.decoder = OneDecoder("oxygen-openpi-decode")
        try:
            async with serve(self._handle, o.host, o.port, process_request=self._process_request,
                             create_connection=lambda *a, **kw: CountedConnection(self, *a, **kw),
                             open_timeout=o.handshake_timeout_s, close_timeout=o.handshake_timeout_s,
                             # max_queue=1: a request/reply client has one message in flight; one that
                             # sends ahead has at most 2 buffered here (up to max_message_bytes each), the
                             # rest wait in TCP
                             max_size=o.max_message_bytes, max_queue=1, compression=None) as server:
                self.port = server.sockets[0].getsockname()[1]
                log.info("openpi policy server on ws://%s:%d (%s observations, up to %d clients%s)", o.host,
                         self.port, self.layout.name, o.max_clients, ", API key required" if o.api_key else "")
                if on_ready is not None:
                    on_ready(self.port)
                await stop.wait()
        finally:
            self.decoder.close()

    def start(self) -> "OpenpiServer":
        """Serve on a thread of its own (tests, the bringup); returns once the port is bound."""
        ready, failed = threading.Event(), []

        def run():
            async def main():
                self._loop, self._stopping = asyncio.get_running_loop(), asyncio.Event()
                await self.serve_until(self._stopping, lambda port: ready.set())
            try:
                asyncio.run(main())
            except Exception as e:  # noqa: BLE001 - reported to start()'s caller (e.g. the port is taken)
                failed.append(e)
                ready.set()

        self._thread = threading.Thread(target=run, name="oxygen-openpi-server", daemon=True)
        self._thread.start()
        ready.wait()
        if failed:
            raise failed[0]
        return self

    def stop(self, timeout: float = 10.0) -> None:
        if self._loop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(timeout)
            self._thread = None

    def status(self) -> str:
        return f"openpi clients {self.slots.in_use}/{self.slots.capacity}"

    # ------------------------------------------------------------------ handshake
    def at_the_door(self, pushed_out: CountedConnection | None) -> None:
        """A connection came to the door (`pushed_out`: one to close at once, the door past its overflow)."""
        if pushed_out is not None:
            self._close_at_the_door([pushed_out])
        self._trim_soon()

    def _trim_soon(self) -> None:
        wait = self.door.next_trim_s()
        if self._trim_timer is None and wait is not None:
            self._trim_timer = asyncio.get_running_loop().call_later(wait, self._trim_the_door)

    def _trim_the_door(self) -> None:
        self._trim_timer = None
        self._close_at_the_door(self.door.trim())
        self._trim_soon()

    def _close_at_the_door(self, connections: list[CountedConnection]) -> None:
        for connection in connections:
            connection.transport.abort()
        now = time.monotonic()
        if connections and now - self._door_logged_at >= 10.0:      # once per 10 s, not once per socket
            self._door_logged_at = now
            log.warning("%d connections waiting at the door (max_handshakes): closing the one silent the longest "
                        "for each new one, %d so far", self.door.max_waiting, self.door.displaced)

    def _process_request(self, connection: CountedConnection, request):
        if request.path == "/healthz":
            return connection.respond(http.HTTPStatus.OK, "OK\n")
        key = self.options.api_key
        # The key first: a stranger's failures must not lock out the right key from the same address.
        if key is not None and not _key_matches(request.headers.get("Authorization"), key):
            peer = _peer(connection)
            wait = self.failures.retry_after(peer)
            if wait > 0:        # not counted again: the peer's table stays `failed_handshakes_per_peer` long
                return connection.respond(http.HTTPStatus.TOO_MANY_REQUESTS,
                                          f"too many failed handshakes from {peer}: retry in {math.ceil(wait)} s\n")
            failures = self.failures.record(peer)
            if failures in (1, self.options.failed_handshakes_per_peer):
                log.warning("refused %s: missing or wrong API key (%d in %g s)", peer, failures, FAILURE_WINDOW_S)
            if request.headers.get("Upgrade", "").lower() != "websocket":
                return connection.respond(http.HTTPStatus.UNAUTHORIZED,
                                          f"{KEY_HELP} (header 'Authorization: Api-Key <key>')\n")
            # openpi's client shows the close reason, not an HTTP status's body: open, then close with it.
            connection.refusal = KEY_HELP
            return None
        if not self.door.admit(connection):
            return connection.respond(http.HTTPStatus.SERVICE_UNAVAILABLE, self._full())
        return None

    def _full(self) -> str:
        return f"server full: {self.slots.capacity} clients connected (max_clients)\n"

    def metadata(self, robot: str) -> dict:
        info = self.engine.robot_info(robot)
        return {
            "server": "oxygen_ros", "client": robot, "robot": self.layout.name,
            "action_horizon": info.action_horizon, "action_dim": info.action_dim,
            "control_period_s": self.engine.preparers[robot].io.control_period_s,
            "observation": self.layout.describe(),
            "language": {"keys": list(QUESTION_KEYS), "max_tokens_limit": self.engine.config.max_tokens_limit,
                         "max_question_chars": info.max_question_chars},
            "max_message_bytes": self.options.max_message_bytes, "max_clients": self.options.max_clients,
        }

    # ------------------------------------------------------------------ a connection
    async def _handle(self, ws: CountedConnection) -> None:
        if ws.refusal:
            await ws.close(CloseCode.POLICY_VIOLATION, ws.refusal)
            return
        try:
            robot = self.slots.acquire()
        except ValueError as e:     # the engine cannot take one more robot (its KV pool)
            log.warning("refused a client: %s", e)
            await ws.close(CloseCode.TRY_AGAIN_LATER, str(e)[:120])
            return
        if robot is None:           # another client took the last slot after this one's handshake
            await ws.close(CloseCode.TRY_AGAIN_LATER, self._full().strip())
            return
        session = ClientSession(self, ws, robot)
        log.info("client %s connected from %s", robot, ws.remote_address)
        reason = "client disconnected"
        try:
            await ws.send(pack(self.metadata(robot)))
            while True:
                await session.paced()
                data = await ws.recv()
                reply = await session.answer(data)
                await ws.send(reply)
        except ClientGone:
            pass
        except websockets.ConnectionClosed as e:
            if e.sent is not None and e.sent.code == CloseCode.MESSAGE_TOO_BIG:
                reason = f"message too big: {e.sent.reason}"
                log.warning("client %s: %s", robot, reason)
        except Exception:  # noqa: BLE001 - a server bug: tell the client (as openpi does) and close
            reason = "server error"
            text = traceback.format_exc()
            log.error("client %s: server error:\n%s", robot, text)
            try:
                await ws.send(text)
                await ws.close(CloseCode.INTERNAL_ERROR, "Internal server error. Traceback included in previous frame.")
            except websockets.ConnectionClosed:
                pass
        finally:
            self.slots.release(robot, reason)      # first: its requests end with this reason
            session.end()
            log.info("client %s gone (%s)", robot, reason)


class ClientSession:
    """One connection: its robot name, its newest observation, what it has in flight."""

    def __init__(self, server: OpenpiServer, ws: CountedConnection, robot: str):
        self.server, self.ws, self.robot = server, ws, robot
        self.engine, self.hub, self.layout, self.options = server.engine, server.hub, server.layout, server.options
        self.newest = None                       # the last observation it sent (questions are about it)
        self._closed = asyncio.ensure_future(ws.wait_closed())
        self._prev_total_ms: float | None = None
        self._work: asyncio.Future | None = None         # the message being answered
        self._requests: set = set()                      # its questions' handles not yet answered
        self.pace = ws.pace
        self.hub.join(robot, self.pace)

    async def paced(self) -> None:
        """Until the client's share of the server's time lets its next message be read (charges may still come
        meanwhile: a message it sent ahead); ClientGone as soon as the connection closes (its slot is freed at
        once, not after the wait)."""
        while (wait := self.pace.wait_s()) > 0:
            await asyncio.wait({self._closed}, timeout=wait)
            if self._closed.done():
                raise ClientGone()

    async def answer(self, data) -> bytes | str:
        """One message -> the reply bytes, or an error text for the client to raise; ClientGone as soon as the
        connection closes, whatever the message waits for (decoding, its chunk, a question's reply)."""
        self._work = asyncio.ensure_future(self._answer(data))
        done, _ = await asyncio.wait({self._work, self._closed}, return_when=asyncio.FIRST_COMPLETED)
        if self._work not in done:
            raise ClientGone()
        return self._work.result()

    async def _answer(self, data) -> bytes | str:
        start = time.monotonic()
        try:
            message = await self.server.decoder.run(self.pace.timed, unpack, data)
            if "question" in message:
                reply = await self._ask(message, start)
            else:
                reply = await self._infer(message, start)
        except (ProtocolError, InputError, FrameFailed, RequestFailed) as e:
            return f"{type(e).__name__}: {e}"
        reply["server_timing"]["infer_ms"] = 1e3 * (time.monotonic() - start)
        if self._prev_total_ms is not None:
            reply["server_timing"]["prev_total_ms"] = self._prev_total_ms
        out = pack(reply)
        self._prev_total_ms = 1e3 * (time.monotonic() - start)   # without this reply's send, as openpi's
        return out

    # ------------------------------------------------------------------ actions
    async def _observation(self, message: dict):
        obs = await asyncio.get_running_loop().run_in_executor(
            None, self.pace.timed, self.layout.observation, message, time.monotonic(), self.options.default_prompt)
        self.newest = obs
        return obs

    async def _infer(self, message: dict, start: float) -> dict:
        if not self.layout.has_observation(message):
            raise InputError(f"neither an observation (keys {', '.join(self.layout.keys())}) nor a question "
                             f"(key 'question'); got keys {sorted(map(str, message))}")
        computed = await self._compute(await self._observation(message), start)
        return self._actions(computed)

    def _actions(self, computed: Computed) -> dict:
        chunk = computed.chunk
        return {"actions": chunk.plan.actions, "subtask": chunk.subtask, "server_timing": {},
                "policy_timing": {"infer_ms": 1e3 * chunk.compute_s, "frame_index": chunk.plan.frame_index,
                                  "cycle_frames": computed.cycle_frames}}

    async def _compute(self, obs, start: float, then: Callable[[], None] | None = None) -> Computed:
        if self.server._serial is None:
            return await self._wait_chunk(obs, start, then)
        async with self.server._serial:             # openpi's model: one frame at a time
            return await self._wait_chunk(obs, start, then)

    async def _wait_chunk(self, obs, start: float, then: Callable[[], None] | None) -> Computed:
        """The chunk of `obs`; `then()` right after the engine has it (a question about it: see _ask)."""
        ticket = self.hub.submit(self.robot, obs)
        try:
            if then is not None:
                then()
            while True:
                done, _ = await asyncio.wait({ticket.future}, timeout=0.25)
                if ticket.future in done:
                    return ticket.future.result()
                why = self.hub.discarded()
                if why:
                    raise FrameFailed(why)
                if time.monotonic() - start > self.options.reply_timeout_s:
                    raise FrameFailed(f"no action chunk {self.options.reply_timeout_s:g} s after the observation "
                                      f"(engine overloaded or stopped?)")
        finally:
            self.hub.forget(ticket)

    # ------------------------------------------------------------------ language
    async def _ask(self, message: dict, start: float) -> dict:
        with_observation = self.layout.has_observation(message)
        if not with_observation:
            unknown = sorted(str(k) for k in message if k not in QUESTION_KEYS)
            if unknown:
                raise InputError(f"a question takes the keys {', '.join(QUESTION_KEYS)}, got also {unknown} (to ask "
                                 f"about a new observation, send all its keys with the question)")
        request = self._request(message)
        if with_observation:
            obs = await self._observation(message)
        elif self.newest is None:
            raise InputError("no observation from this client yet: send one first, or send the question together "
                             "with an observation's keys")
        else:
            # The engine answers about frames it computes: the newest observation becomes a frame again.
            obs = replace(self.newest, stamp_s=time.monotonic())
        # About this observation's frame, never an older one the engine holds or re-uses for this robot.
        request = replace(request, not_before_stamp=obs.stamp_s)
        loop = asyncio.get_running_loop()
        replied, handles = loop.create_future(), []

        def ask() -> None:
            # After the observation is the engine's, and only about its frame or a newer one (not_before_stamp):
            # a cycle between the two, or a frame the engine holds for this robot, would otherwise answer about
            # the client's previous frame.
            handle = self.engine.submit(request)
            handles.append(handle)
            self._requests.add(handle)
            handle.add_done_callback(lambda r: _settle_from_thread(loop, replied, r))

        chunk = asyncio.ensure_future(self._compute(obs, start, then=ask))
        try:
            done, _ = await asyncio.wait({replied, chunk}, return_when=asyncio.FIRST_EXCEPTION)
            if chunk in done and chunk.exception() is not None:
                raise chunk.exception()
            reply: Reply = await replied
            computed = await chunk
        finally:
            chunk.cancel()
            for handle in handles:
                handle.cancel()                      # a no-op once answered
                self._requests.discard(handle)
        if not reply.success:
            what = "refused" if reply.finish_reason == "refused" else f"failed ({reply.finish_reason})"
            raise RequestFailed(f"question {what}: {reply.error}")
        if reply.frame_index != computed.chunk.plan.frame_index:     # the engine's promise, kept visible
            raise RequestFailed(f"question answered about frame {reply.frame_index}, not the observation's frame "
                                f"{computed.chunk.plan.frame_index}")
        out = {"text": reply.text, "finish_reason": reply.finish_reason, "frame_index": reply.frame_index,
               "tokens": len(reply.tokens), "server_timing": {}}
        if with_observation:
            out.update((k, v) for k, v in self._actions(computed).items() if k != "server_timing")
        return out

    def _request(self, m: dict) -> TextRequest:
        """The question's fields, type-checked (the engine checks ranges and refuses with the reason)."""
        kinds = {"question": (str, bytes), "max_tokens": int, "temperature": (int, float), "top_p": (int, float),
                 "seed": int, "stop": (list, tuple, str), "timeout_s": (int, float)}
        wrong = [f"{k} must be {_names(t)}, got {type(m[k]).__name__}" for k, t in kinds.items()
                 if k in m and (not isinstance(m[k], t) or isinstance(m[k], bool))]
        if wrong:
            raise InputError("; ".join(wrong))
        question = m["question"].decode("utf-8", "replace") if isinstance(m["question"], bytes) else m["question"]
        stop = (m["stop"],) if isinstance(m.get("stop"), str) else tuple(m.get("stop", ()))
        try:
            sampling = Sampling(float(m.get("temperature", 0.0)), float(m.get("top_p", 1.0)), int(m.get("seed", 0)))
        except ValueError as e:
            raise InputError(str(e)) from None
        return TextRequest(question, max_tokens=int(m.get("max_tokens", 32)), sampling=sampling, stop=stop,
                           timeout_s=float(m.get("timeout_s", 30.0)), owner=self.robot)

    # ------------------------------------------------------------------
    def end(self) -> None:
        """The connection is gone: stop waiting for anything on its behalf, cancel its unanswered questions
        (after ClientSlots.release, which ended them with the reason; this is for any still running)."""
        self.hub.leave(self.robot)
        self._closed.cancel()
        for handle in list(self._requests):
            handle.cancel()
        if self._work is not None:
            self._work.cancel()


def _settle(future: asyncio.Future, value) -> None:
    if not future.done():
        future.set_result(value)


def _settle_from_thread(loop: asyncio.AbstractEventLoop, future: asyncio.Future, value) -> None:
    try:
        loop.call_soon_threadsafe(_settle, future, value)
    except RuntimeError:        # the loop has closed (the server stopped): nobody waits any more
        pass


def _names(t) -> str:
    types = t if isinstance(t, tuple) else (t,)
    return " or ".join(x.__name__ for x in types)


def _bytes_waiting(transport) -> bool:
    """Whether the peer has already sent something (its request head) on an accepted socket: a look at the
    kernel's buffer, nothing read."""
    sock = transport.get_extra_info("socket")
    if sock is None:
        return False
    peek = socket.socket(fileno=sock.fileno())
    try:
        return bool(peek.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT))
    except OSError:              # nothing yet (EAGAIN), or the peer is already gone
        return False
    finally:
        peek.detach()           # the descriptor stays the transport's


def _peer(connection: ServerConnection) -> str:
    address = connection.remote_address
    return str(address[0]) if address else "unknown"


def _key_matches(header: str | None, key: str) -> bool:
    if not header or not header.startswith("Api-Key "):
        return False
    return hmac.compare_digest(header[len("Api-Key "):].strip().encode(), key.strip().encode())
