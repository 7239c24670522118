"""ConsoleNode (`oxygen_console`): the operator console, a web page served on localhost by aiohttp in
a thread of its own (its own asyncio loop; nothing of it runs on a ROS executor thread except the ROS
callbacks below).

    GET  /                  the page (static/index.html: plain HTML and JavaScript, no build step)
    GET  /picture/<name>    newest JPEG: `overlay` (the debug picture: chunk drawn, latest reply), a
                            camera slot (the newest observation's image), or `caption` (the frame the
                            newest scene caption describes); 204 while there is none yet
    GET  /status            status figures as JSON (with the newest frame's index, the newest caption and the
                            hierarchical policy's language: subtask, progress memory, plan, speech, each with
                            the frame it came from)
    GET  /favicon.ico       404, before any check: browsers ask for it without the token
    POST /ask               {"text", "session_id"?, "max_tokens"?} -> text/event-stream of {"partial"} then
                            {"reply"...}: a goal of the streaming conversation action (/oxygen/converse_stream)
    POST /enable            {"enabled": bool} -> the /oxygen/enable service's answer; enabling is refused
                            (409) while the engine is in its safe stop
    POST /clear_safe_stop   {} -> the engine node's clear_safe_stop service (std_srvs/Trigger)
    POST /prompt            {"text"} -> published on the task prompt topic (checked as the robot checks it)
    POST /interject         {"text"} -> the interjection service's answer (/oxygen/interject): plan, speech

Every request first passes the RequestGuard (guard.py): a name of this console in Host, its own
Origin, the token, JSON for changes. The token is generated per start and printed with the URL on
the process's standard output (as Jupyter does; not on /rosout, which every DDS participant reads),
or read from `token_file`. Connections are bounded (`max_connections`; more are answered 503 and
closed at once, so no client can take the process's file descriptors) and so is the time a request
head may take and a connection may idle (`request_head_timeout_s`).

Everything the page does goes through the same ROS interfaces any client uses (action, service,
topic); the figures and pictures are read in-process.
"""
from __future__ import annotations

import asyncio
import collections
import json
import threading
import time
from pathlib import Path

import cv2
from aiohttp import web
from diagnostic_msgs.msg import DiagnosticStatus
from rclpy.action import ActionClient
from rclpy.node import Node
from std_msgs.msg import String
from std_srvs.srv import SetBool, Trigger

from oxygen_ros.nodes.action_publisher import ENABLE_SERVICE
from oxygen_ros.nodes.engine_node import status
from oxygen_ros.nodes.params import Param, ParameterError, declare_all
from oxygen_ros.robot.errors import InputError
from oxygen_ros.robot.text import validate_text

from .guard import RequestGuard, is_loopback, new_token, read_token

STATIC = Path(__file__).resolve().parent / "static"
PARAMS = [
    Param("port", 0, "Port of the console on 127.0.0.1 (0: no console).", minimum=0, maximum=65535),
    Param("host", "127.0.0.1", "Address the console listens on (keep it local: the page can move the robot)."),
    Param("token_file", "", "File holding the console's token (first word, at least 16 characters, readable by "
                            "its owner only). Empty: a new token each start, printed with the URL."),
    Param("allowed_hosts", [], "Host names the console may be reached by besides localhost, 127.0.0.1, ::1 "
                                 "and `host` (a reverse proxy's name). Anything else is refused (DNS rebinding).", item=str),
    Param("max_connections", 32, "Open connections at most; more are answered 503 and closed at once.",
          minimum=1, maximum=1024),
    Param("request_head_timeout_s", 10.0, "A connection that has not sent a whole request head this long after "
                                          "it opened or after its last request is closed.",
          minimum=0.1, maximum=300.0),
]
MAX_SESSION_ID_CHARS = 100
# What the page shows of the robot's language state (Engine.language_state): each text and its frame (-1: none yet).
LANGUAGE_KEYS = ("task", "subtask", "subtask_frame", "memory", "memory_frame", "plan", "plan_frame", "speech",
                 "speech_frame")
# Frames kept (references) for the caption's picture: a caption is decoded over several cycles after the frame
# it describes (16 tokens at one per cycle: 16 frames later), and the page shows it beside that frame.
CAPTION_FRAMES = 64


class _Refused(asyncio.Protocol):
    """A connection over `max_connections`: answered 503 and closed before anything is read."""

    def connection_made(self, transport) -> None:
        transport.write(b"HTTP/1.1 503 Service Unavailable\r\nContent-Type: text/plain\r\nConnection: close\r\n"
                        b"Content-Length: 42\r\n\r\noxygen_console: too many open connections\n")
        transport.close()


class ConsoleNode(Node):
    def __init__(self, engine, action, conversation, observation, view, lifecycle_state,
                 safe_stop_service: str = "/oxygen_engine/clear_safe_stop", printer=print, **node_kwargs):
        """safe_stop_service: the engine node's clear_safe_stop service; printer: where the URL with the token
        goes (the process's standard output)."""
        super().__init__("oxygen_console", **node_kwargs)
        self.p, problems = declare_all(self, PARAMS)
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        token = ""
        if not all(isinstance(h, str) for h in self.p["allowed_hosts"]):
            problems.append(f"oxygen_console.allowed_hosts = {self.p['allowed_hosts']!r}: a list of host names")
        if self.p["port"] and self.p["token_file"]:
            try:
                token = read_token(self.p["token_file"])
            except ValueError as e:
                problems.append(f"oxygen_console.{e}")
        if problems:
            raise ParameterError("\n".join(problems))
        if not self.p["port"]:
            return                                   # no console: nothing else is created
        self.guard = RequestGuard(token or new_token(), self.p["host"], tuple(self.p["allowed_hosts"]))
        self._printer, self._token_printed = printer, not token
        self.engine, self.action, self.view, self.lifecycle_state = engine, action, view, lifecycle_state
        self.max_prompt_chars = observation.p["max_prompt_chars"]
        self.slots = observation.slots
        from oxygen_interfaces.action import Converse as ConverseAction

        self._ConverseAction = ConverseAction
        self.stream_client = ActionClient(self, ConverseAction, conversation.p["action_name"])
        self.enable_client = self.create_client(SetBool, ENABLE_SERVICE)
        self.safe_stop_client = self.create_client(Trigger, safe_stop_service)
        from oxygen_interfaces.srv import Interject

        self._Interject = Interject
        self.interject_client = self.create_client(Interject, conversation.p["interject_service"])
        self.prompt_pub = self.create_publisher(String, observation.p["prompt_topic"], 10)
        self._obs, self._frame_index = None, -1
        self._frames: collections.OrderedDict = collections.OrderedDict()     # index -> observation (bounded)
        self._frames_lock = threading.Lock()
        self._caption = None                  # (the newest caption, the image of the frame it describes or None)
        engine.add_frame_listener(self._on_frame)
        engine.add_caption_listener(self._on_caption)
        self._runner: web.AppRunner | None = None
        self._server: asyncio.AbstractServer | None = None
        self._thread: threading.Thread | None = None
        self.asked = self.interjected = 0
        self.refused = {"requests": 0, "connections": 0, "timed_out": 0}
        self._activity: dict = {}             # open connection (RequestHandler) -> [requests in progress, last activity]
        self._start_server()

    def _on_frame(self, index, obs) -> None:       # engine thread: references only
        with self._frames_lock:
            self._obs, self._frame_index = obs, index
            self._frames[index] = obs
            while len(self._frames) > CAPTION_FRAMES:
                self._frames.popitem(last=False)

    def _on_caption(self, caption) -> None:        # engine thread: references only
        if caption.robot:                          # the console serves the single robot
            return
        with self._frames_lock:
            obs = self._frames.get(caption.frame_index)
        self._caption = (caption, _first_image(obs) if obs is not None else None)

    # ------------------------------------------------------------------ server thread
    def _start_server(self) -> None:
        started = threading.Event()
        errors: list[BaseException] = []

        def serve():
            self._loop = asyncio.new_event_loop()
            try:
                self._loop.run_until_complete(self._serve())
            except BaseException as e:  # noqa: BLE001 - reported to the constructor (port in use...)
                errors.append(e)
                started.set()
                return
            started.set()
            self._loop.run_forever()

        self._thread = threading.Thread(target=serve, name="oxygen-console", daemon=True)
        self._thread.start()
        started.wait(10.0)
        if errors:
            raise ParameterError(f"oxygen_console: cannot serve on {self.p['host']}:{self.p['port']}: {errors[0]}")
        self.url = f"http://{self.p['host']}:{self.p['port']}/"
        if self._token_printed:
            self.get_logger().info(f"console on {self.url} (open the link with its token, printed on standard output)")
            self._printer(f"oxygen_console: open {self.url}?token={self.guard.token}", flush=True)
        else:
            self.get_logger().info(f"console on {self.url} (token from {self.p['token_file']}: open "
                                   f"{self.url}?token=<token>)")
        if not is_loopback(self.p["host"]):
            self.get_logger().warning(f"the console listens on {self.p['host']}, not only on this machine: anyone "
                                      "who can reach it and has the token can move the robot")

    async def _serve(self) -> None:
        app = web.Application(middlewares=[self._guarded])
        app.router.add_get("/favicon.ico", self._no_icon)
        app.router.add_get("/", self._page)
        app.router.add_get("/picture/{name}", self._picture)
        app.router.add_get("/status", self._status)
        app.router.add_post("/ask", self._ask)
        app.router.add_post("/enable", self._enable)
        app.router.add_post("/clear_safe_stop", self._clear_safe_stop)
        app.router.add_post("/prompt", self._prompt)
        app.router.add_post("/interject", self._interject)
        # aiohttp waits for a request head without a time limit (500 of 500 incomplete requests were still
        # open after 100 s): the head timeout below closes them, and idle keep-alive connections too.
        self._runner = web.AppRunner(app, keepalive_timeout=self.p["request_head_timeout_s"], access_log=None)
        await self._runner.setup()
        # Open connections are counted from their protocol's creation to aiohttp's connection_lost hook (its
        # RequestHandler reports its end to its manager, the Server): the Server's own list is filled only
        # when connection_made runs, a loop iteration later, so a burst of accepts got past it.
        server = self._runner.server
        lost = server.connection_lost

        def connection_lost(handler, exc) -> None:
            self._activity.pop(handler, None)
            lost(handler, exc)

        server.connection_lost = connection_lost
        self._server = await asyncio.get_running_loop().create_server(
            self._connection, self.p["host"], self.p["port"], reuse_address=True)

    # ------------------------------------------------------------------ connections
    def _connection(self) -> asyncio.Protocol:
        """A protocol per accepted connection: aiohttp's, or a 503 when `max_connections` are open."""
        if len(self._activity) >= self.p["max_connections"]:
            self.refused["connections"] += 1
            return _Refused()
        handler = self._runner.server()
        self._activity[handler] = [0, time.monotonic()]
        self._loop.call_later(self.p["request_head_timeout_s"], self._check_idle, handler)
        return handler

    def _check_idle(self, handler) -> None:
        """Close a connection that has had no request in progress for request_head_timeout_s (a head that
        never ends, or an idle keep-alive connection); look again later otherwise."""
        activity = self._activity.get(handler)
        if activity is None:                  # the connection has ended
            return
        busy, last = activity
        due = last + self.p["request_head_timeout_s"]
        if not busy and time.monotonic() >= due:
            self.refused["timed_out"] += 1
            self._activity.pop(handler, None)
            handler.force_close()
            return
        self._loop.call_later(max(due - time.monotonic(), 0.05) if not busy else self.p["request_head_timeout_s"],
                              self._check_idle, handler)

    @web.middleware
    async def _guarded(self, request: web.Request, handler):
        if request.path == "/favicon.ico":    # asked for by every browser, without the token: no icon, no refusal
            return await handler(request)
        refusal = self.guard.check(request.method, request.headers, request.query.get("token"),
                                   request.content_type if "Content-Type" in request.headers else "")
        if refusal is not None:
            self.refused["requests"] += 1
            self.get_logger().warning(f"console request {request.method} {request.path} refused: {refusal.reason}",
                                      throttle_duration_sec=5.0)
            return web.Response(status=refusal.status, text=refusal.reason)
        activity = self._activity.get(request.protocol)
        if activity is not None:
            activity[0] += 1
        try:
            response = await handler(request)
        finally:
            if activity is not None:
                activity[0] -= 1
                activity[1] = time.monotonic()
        # The page must not be framed by another site, the token not leak in a Referer, nothing be cached.
        response.headers.update({"Content-Security-Policy": "frame-ancestors 'none'", "X-Frame-Options": "DENY",
                                 "Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff",
                                 "Cache-Control": "no-store"})
        return response

    def close(self) -> None:
        if self._loop is None:
            return

        async def stop():
            if self._server is not None:
                self._server.close()
            if self._runner is not None:
                await self._runner.cleanup()

        asyncio.run_coroutine_threadsafe(stop(), self._loop).result(timeout=5.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
        self._loop = None

    def diagnostics(self) -> list[DiagnosticStatus]:
        if not self.url:
            return []
        values = dict(asked=self.asked, interjected=self.interjected, connections=len(self._activity),
                      refused_requests=self.refused["requests"], refused_connections=self.refused["connections"],
                      timed_out_connections=self.refused["timed_out"])
        return [status("oxygen_ros: console", DiagnosticStatus.OK, f"serving {self.url}", values)]

    # ------------------------------------------------------------------ handlers
    def status(self) -> dict:
        s = self.engine.stats.snapshot()
        robot = s["robots"].get("", {})         # the console serves the single robot (refused with a fleet)
        r = self.action.rate.summary()
        with self._frames_lock:
            obs, frame_index = self._obs, self._frame_index
        caption = self._caption
        return {
            "lifecycle": self.lifecycle_state(), "enabled": self.action.enabled,
            "action_state": self.action.last_status, "action_hz": r["rate_hz"], "jitter_ms": r["period_ms_std"],
            "chunk_hz": s["action_hz"], "frame_ms": s["frame_ms_mean"], "tokens_per_s": s["tokens_per_s"],
            "chunks_per_s": robot.get("chunks_per_s", 0.0), "late_chunks": robot.get("deadline_misses", 0),
            "kv_used": s["pool_blocks_used"], "kv_total": s["pool_blocks_total"], "faults": s["faults"],
            "safe_stop": self.engine.faulted, "dropped": s["dropped_frames"], "frames": s["frames"],
            "active_requests": s["active_requests"], "queued_requests": s["queued_requests"],
            "prompt": obs.prompt if obs is not None else "", "reply": self.view.reply if self.view else "",
            "cameras": ["overlay"] + [slot for slot in self.slots if obs is not None and obs.images.get(slot) is not None],
            "frame_index": frame_index,     # the frame of the camera pictures (-1: none yet)
            "caption": None if caption is None else {
                "text": caption[0].text, "frame_index": caption[0].frame_index, "picture": caption[1] is not None},
            "language": {k: v for k, v in self.engine.language_state("").items() if k in LANGUAGE_KEYS},
        }

    async def _no_icon(self, request: web.Request) -> web.Response:
        return web.Response(status=404)

    async def _page(self, request: web.Request) -> web.FileResponse:
        return web.FileResponse(STATIC / "index.html")

    async def _status(self, request: web.Request) -> web.Response:
        return web.json_response(self.status())

    async def _picture(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name == "overlay":
            data = self.view.latest_jpeg() if self.view else b""
        elif name == "caption":
            caption = self._caption
            data = _jpeg(caption[1]) if caption is not None and caption[1] is not None else b""
        elif name in self.slots:
            obs = self._obs
            image = obs.images.get(name) if obs is not None else None
            data = _jpeg(image) if image is not None else b""
        else:
            raise web.HTTPNotFound(text=f"no picture {name!r}: one of overlay, caption, {', '.join(self.slots)}")
        if not data:                          # not an error: the page keeps waiting (a 503 was one in its log)
            return web.Response(status=204, headers={"Cache-Control": "no-store"})
        return web.Response(body=data, content_type="image/jpeg", headers={"Cache-Control": "no-store"})

    async def _json_body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise web.HTTPBadRequest(text="expected a JSON body") from None
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text="expected a JSON object")
        return body

    def _goal(self, body: dict):
        """The streaming goal a /ask body asks for, checked as the conversation service will check it; a
        wrong type is the client's error (400), not the console's (500)."""
        text = body.get("text")
        if not isinstance(text, str) or not text.strip():
            raise web.HTTPBadRequest(text="'text' must be a non-empty string")
        try:
            text = validate_text(text, what="question", max_chars=self.engine.info.max_question_chars)
        except InputError as e:
            raise web.HTTPBadRequest(text=str(e)) from None
        limit = self.engine.config.max_tokens_limit
        max_tokens = body.get("max_tokens", 0)
        if max_tokens is None:
            max_tokens = 0
        if isinstance(max_tokens, bool) or not isinstance(max_tokens, int) or not 0 <= max_tokens <= limit:
            raise web.HTTPBadRequest(text=f"'max_tokens' must be an integer from 0 (the service's default) to "
                                          f"{limit}, got {max_tokens!r}")
        session_id = body.get("session_id", "")
        if session_id is None:
            session_id = ""
        if not isinstance(session_id, str) or len(session_id) > MAX_SESSION_ID_CHARS:
            raise web.HTTPBadRequest(text=f"'session_id' must be a string of at most {MAX_SESSION_ID_CHARS} "
                                          f"characters (empty: no session), got {session_id!r:.120}")
        return self._ConverseAction.Goal(text=text, session_id=session_id, max_tokens=max_tokens)

    async def _ask(self, request: web.Request) -> web.StreamResponse:
        goal = self._goal(await self._json_body(request))
        self.asked += 1
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def put(event: dict) -> None:                 # from ROS callbacks (executor thread)
            loop.call_soon_threadsafe(events.put_nowait, event)

        if not self.stream_client.wait_for_server(timeout_sec=0.0) and \
                not await loop.run_in_executor(None, lambda: self.stream_client.wait_for_server(timeout_sec=2.0)):
            put({"error": "conversation action server not available"})
        else:
            self._send_goal(goal, put)
        response = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-store"})
        await response.prepare(request)
        while True:
            event = await events.get()
            await response.write(f"data: {json.dumps(event)}\n\n".encode())
            if "partial" not in event:
                break
        await response.write_eof()
        return response

    def _send_goal(self, goal, put) -> None:
        def on_goal(future):
            handle = future.result()
            if not handle.accepted:
                put({"error": "busy: streaming goal rejected"})
                return
            handle.get_result_async().add_done_callback(lambda f: put(_result(f.result().result)))

        future = self.stream_client.send_goal_async(
            goal, feedback_callback=lambda fb: put({"partial": fb.feedback.partial_reply,
                                                    "tokens": fb.feedback.tokens}))
        future.add_done_callback(on_goal)

    async def _enable(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        if not isinstance(body.get("enabled"), bool):
            raise web.HTTPBadRequest(text="'enabled' must be true or false")
        if body["enabled"] and self.engine.faulted:
            # A safe stop is a latch with a reason: switching output on must not clear it in passing.
            return web.json_response({"success": False, "message": f"engine in safe stop ({self.engine.faulted}): "
                                      "clear the safe stop first, then enable"}, status=409)
        return await self._call(self.enable_client, SetBool.Request(data=body["enabled"]))

    async def _clear_safe_stop(self, request: web.Request) -> web.Response:
        await self._json_body(request)
        return await self._call(self.safe_stop_client, Trigger.Request())

    async def _call(self, client, request) -> web.Response:
        if not client.service_is_ready():
            return web.json_response({"success": False, "message": f"{client.srv_name} not available"}, status=503)
        result = await asyncio.wrap_future(_as_concurrent(client.call_async(request)))
        return web.json_response({"success": result.success, "message": result.message})

    async def _prompt(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        text = body.get("text")
        if not isinstance(text, str) or not text.strip():
            raise web.HTTPBadRequest(text="'text' must be a non-empty string")
        try:   # as the observation node checks it: a prompt it would reject is not reported as set
            text = validate_text(text, what="prompt", max_chars=self.max_prompt_chars)
        except InputError as e:
            raise web.HTTPBadRequest(text=f"{e} (oxygen_observation.max_prompt_chars)") from None
        self.prompt_pub.publish(String(data=text))
        return web.json_response({"success": True, "prompt": text})


    async def _interject(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        text = body.get("text")
        if not isinstance(text, str) or not text.strip():
            raise web.HTTPBadRequest(text="'text' must be a non-empty string")
        try:   # as the engine checks it
            text = validate_text(text, what="interjection", max_chars=self.engine.info.max_question_chars)
        except InputError as e:
            raise web.HTTPBadRequest(text=str(e)) from None
        client = self.interject_client
        if not client.service_is_ready():
            return web.json_response({"success": False, "error": f"{client.srv_name} not available"}, status=503)
        self.interjected += 1
        r = await asyncio.wrap_future(_as_concurrent(client.call_async(self._Interject.Request(text=text))))
        return web.json_response({"success": r.success, "plan": r.plan, "speech": r.speech, "reply": r.reply,
                                  "error": r.error, "frame_index": r.frame_index, "finish_reason": r.finish_reason})


def _first_image(obs):
    """The first camera image of an observation (the debug picture draws on it by default), None if none."""
    return next((image for image in obs.images.values() if image is not None), None)


def _jpeg(rgb) -> bytes:
    ok, jpeg = cv2.imencode(".jpg", cv2.cvtColor(rgb, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 85])
    return jpeg.tobytes() if ok else b""


def _result(r) -> dict:
    return {"reply": r.reply, "success": r.success, "error": r.error, "tokens": r.tokens,
            "finish_reason": r.finish_reason, "frame_index": r.frame_index, "latency_s": r.latency_s}


def _as_concurrent(future):
    """An rclpy future as a concurrent.futures.Future (awaitable from asyncio through wrap_future)."""
    import concurrent.futures

    out: concurrent.futures.Future = concurrent.futures.Future()
    future.add_done_callback(lambda f: out.set_exception(f.exception()) if f.exception() else out.set_result(f.result()))
    return out
