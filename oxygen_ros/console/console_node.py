"""ConsoleNode (`oxygen_console`): the operator console, a web page served on localhost by aiohttp in
a thread of its own (its own asyncio loop; nothing of it runs on a ROS executor thread except the ROS
callbacks below).

    GET  /                  the page (static/index.html: plain HTML and JavaScript, no build step)
    GET  /picture/<name>    newest JPEG: `overlay` (the debug picture: chunk drawn, latest reply) or a
                            camera slot (the newest observation's image)
    GET  /status            status figures as JSON
    POST /ask               {"text", "session_id"} -> text/event-stream of {"partial"} then {"reply"...}:
                            a goal of the streaming conversation action (/oxygen/converse_stream)
    POST /enable            {"enabled": bool} -> the /oxygen/enable service's answer
    POST /prompt            {"text"} -> published on the task prompt topic

Everything the page does goes through the same ROS interfaces any client uses (action, service,
topic); the figures and pictures are read in-process.
"""
from __future__ import annotations

import asyncio
import json
import threading
from pathlib import Path

import cv2
from aiohttp import web
from diagnostic_msgs.msg import DiagnosticStatus
from rclpy.action import ActionClient
from rclpy.node import Node
from std_msgs.msg import String
from std_srvs.srv import SetBool

from oxygen_ros.nodes.action_publisher import ENABLE_SERVICE
from oxygen_ros.nodes.engine_node import status
from oxygen_ros.nodes.params import Param, ParameterError, declare_all

STATIC = Path(__file__).resolve().parent / "static"
PARAMS = [
    Param("port", 0, "Port of the console on 127.0.0.1 (0: no console).", minimum=0, maximum=65535),
    Param("host", "127.0.0.1", "Address the console listens on (keep it local: the page can move the robot)."),
]


class ConsoleNode(Node):
    def __init__(self, engine, action, conversation, observation, view, lifecycle_state, **node_kwargs):
        super().__init__("oxygen_console", **node_kwargs)
        self.p, problems = declare_all(self, PARAMS)
        if problems:
            raise ParameterError("\n".join(problems))
        self.url = ""
        self._loop: asyncio.AbstractEventLoop | None = None
        if not self.p["port"]:
            return                                   # no console: nothing else is created
        self.engine, self.action, self.view, self.lifecycle_state = engine, action, view, lifecycle_state
        self.slots = observation.slots
        from oxygen_interfaces.action import Converse as ConverseAction

        self._ConverseAction = ConverseAction
        self.stream_client = ActionClient(self, ConverseAction, conversation.p["action_name"])
        self.enable_client = self.create_client(SetBool, ENABLE_SERVICE)
        self.prompt_pub = self.create_publisher(String, observation.p["prompt_topic"], 10)
        self._obs = None
        engine.add_frame_listener(self._on_frame)
        self._runner: web.AppRunner | None = None
        self._thread: threading.Thread | None = None
        self.asked = 0
        self._start_server()

    def _on_frame(self, index, obs) -> None:       # engine thread: a reference only
        self._obs = obs

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
        self.get_logger().info(f"console on {self.url}")

    async def _serve(self) -> None:
        app = web.Application()
        app.router.add_get("/", lambda r: web.FileResponse(STATIC / "index.html"))
        app.router.add_get("/picture/{name}", self._picture)
        app.router.add_get("/status", lambda r: web.json_response(self.status()))
        app.router.add_post("/ask", self._ask)
        app.router.add_post("/enable", self._enable)
        app.router.add_post("/prompt", self._prompt)
        self._runner = web.AppRunner(app)
        await self._runner.setup()
        await web.TCPSite(self._runner, self.p["host"], self.p["port"]).start()

    def close(self) -> None:
        if self._loop is None:
            return
        if self._runner is not None:
            asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(timeout=5.0)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=5.0)
        self._loop = None

    def diagnostics(self) -> list[DiagnosticStatus]:
        if not self.url:
            return []
        return [status("oxygen_ros: console", DiagnosticStatus.OK, f"serving {self.url}", {"asked": self.asked})]

    # ------------------------------------------------------------------ handlers
    def status(self) -> dict:
        s = self.engine.stats.snapshot()
        r = self.action.rate.summary()
        obs = self._obs
        return {
            "lifecycle": self.lifecycle_state(), "enabled": self.action.enabled,
            "action_state": self.action.last_status, "action_hz": r["rate_hz"], "jitter_ms": r["period_ms_std"],
            "chunk_hz": s["action_hz"], "frame_ms": s["frame_ms_mean"], "tokens_per_s": s["tokens_per_s"],
            "kv_used": s["pool_blocks_used"], "kv_total": s["pool_blocks_total"], "faults": s["faults"],
            "safe_stop": self.engine.faulted, "dropped": s["dropped_frames"], "frames": s["frames"],
            "active_requests": s["active_requests"], "queued_requests": s["queued_requests"],
            "prompt": obs.prompt if obs is not None else "", "reply": self.view.reply if self.view else "",
            "cameras": ["overlay"] + [slot for slot in self.slots if obs is not None and obs.images.get(slot) is not None],
        }

    async def _picture(self, request: web.Request) -> web.Response:
        name = request.match_info["name"]
        if name == "overlay":
            data = self.view.latest_jpeg() if self.view else b""
        elif name in self.slots:
            obs = self._obs
            image = obs.images.get(name) if obs is not None else None
            data = b""
            if image is not None:
                ok, jpeg = cv2.imencode(".jpg", cv2.cvtColor(image, cv2.COLOR_RGB2BGR), [cv2.IMWRITE_JPEG_QUALITY, 85])
                data = jpeg.tobytes()
        else:
            raise web.HTTPNotFound(text=f"no picture {name!r}: one of overlay, {', '.join(self.slots)}")
        if not data:
            raise web.HTTPServiceUnavailable(text="no picture yet")
        return web.Response(body=data, content_type="image/jpeg", headers={"Cache-Control": "no-store"})

    async def _json_body(self, request: web.Request) -> dict:
        try:
            body = await request.json()
        except (ValueError, UnicodeDecodeError):
            raise web.HTTPBadRequest(text="expected a JSON body") from None
        if not isinstance(body, dict):
            raise web.HTTPBadRequest(text="expected a JSON object")
        return body

    async def _ask(self, request: web.Request) -> web.StreamResponse:
        body = await self._json_body(request)
        text = body.get("text")
        if not isinstance(text, str) or not text.strip():
            raise web.HTTPBadRequest(text="'text' must be a non-empty string")
        self.asked += 1
        events: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def put(event: dict) -> None:                 # from ROS callbacks (executor thread)
            loop.call_soon_threadsafe(events.put_nowait, event)

        goal = self._ConverseAction.Goal(text=text, session_id=str(body.get("session_id", ""))[:100],
                                         max_tokens=int(body.get("max_tokens", 0) or 0))
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
        if not self.enable_client.service_is_ready():
            return web.json_response({"success": False, "message": "/oxygen/enable not available"})
        future = self.enable_client.call_async(SetBool.Request(data=body["enabled"]))
        result = await asyncio.wrap_future(_as_concurrent(future))
        return web.json_response({"success": result.success, "message": result.message})

    async def _prompt(self, request: web.Request) -> web.Response:
        body = await self._json_body(request)
        text = body.get("text")
        if not isinstance(text, str) or not text.strip():
            raise web.HTTPBadRequest(text="'text' must be a non-empty string")
        self.prompt_pub.publish(String(data=text))
        return web.json_response({"success": True})


def _result(r) -> dict:
    return {"reply": r.reply, "success": r.success, "error": r.error, "tokens": r.tokens,
            "finish_reason": r.finish_reason, "frame_index": r.frame_index, "latency_s": r.latency_s}


def _as_concurrent(future):
    """An rclpy future as a concurrent.futures.Future (awaitable from asyncio through wrap_future)."""
    import concurrent.futures

    out: concurrent.futures.Future = concurrent.futures.Future()
    future.add_done_callback(lambda f: out.set_exception(f.exception()) if f.exception() else out.set_result(f.result()))
    return out
