"""The console's request checks alone (console/guard.py: Host, Origin, Sec-Fetch-Site, token, JSON for
changes), its token file, and the safe stop as an operator meets it: in process, a console with a token
read from a file refuses to switch output on while the engine is in its safe stop, and the engine node's
clear_safe_stop service clears it and leaves output off (issue #21)."""
from __future__ import annotations

import http.client
import json
import os
import socket
import threading
from types import SimpleNamespace

import pytest
import rclpy
from rclpy.context import Context
from rclpy.executors import SingleThreadedExecutor
from rclpy.parameter import Parameter

from oxygen_ros.console.guard import RequestGuard, host_name, read_token

TOKEN = "t" * 32


class Headers(dict):
    """A case-insensitive header mapping, as aiohttp gives one."""

    def __init__(self, **values):
        super().__init__({k.replace("_", "-").lower(): v for k, v in values.items()})

    def get(self, key, default=None):
        return super().get(key.lower(), default)


def check(method="GET", token=TOKEN, query=None, content_type="", listen="127.0.0.1", allowed=(), **headers):
    headers.setdefault("Host", "127.0.0.1:8080")
    if token is not None:
        headers["X-Oxygen-Token"] = token
    return RequestGuard(TOKEN, listen, allowed).check(method, Headers(**headers), query, content_type)


def test_a_request_from_the_console_itself_passes():
    assert check() is None
    assert check("POST", content_type="application/json", Origin="http://127.0.0.1:8080",
                 Sec_Fetch_Site="same-origin") is None
    assert check(Host="localhost:9000", Origin="http://localhost:9000") is None     # through an SSH tunnel
    assert check(Host="[::1]:8080") is None
    assert check(token=None, query=TOKEN) is None                                  # the page, its pictures
    assert check(token=None, Authorization=f"Bearer {TOKEN}") is None
    assert check(Sec_Fetch_Site="none") is None                                    # typed in the address bar


@pytest.mark.parametrize("headers, status, says", [
    (dict(Host="attacker.example:8080"), 403, "Host"),                             # DNS rebinding
    (dict(Host="127.0.0.1.attacker.example"), 403, "Host"),
    (dict(Host=""), 403, "Host"),
    (dict(Origin="http://attacker.example"), 403, "Origin"),
    (dict(Origin="http://127.0.0.1:9999"), 403, "Origin"),                          # another port: another page
    (dict(Origin="null"), 403, "Origin"),                                           # a sandboxed frame
    (dict(Sec_Fetch_Site="cross-site"), 403, "Sec-Fetch-Site"),
    (dict(Sec_Fetch_Site="same-site"), 403, "Sec-Fetch-Site"),
    (dict(token=None), 401, "token"),
    (dict(token="x" * 32), 401, "token"),
    (dict(token=TOKEN[:-1]), 401, "token"),
    (dict(token=None, Authorization=f"Basic {TOKEN}"), 401, "token"),
])
def test_requests_from_elsewhere_are_refused(headers, status, says):
    refusal = check(**headers)
    assert refusal is not None and refusal.status == status and says in refusal.reason, refusal


def test_changes_take_json_only():
    for content_type in ("", "text/plain", "application/x-www-form-urlencoded", "multipart/form-data"):
        refusal = check("POST", content_type=content_type)
        assert refusal.status == 415 and "application/json" in refusal.reason
    assert check("GET", content_type="text/plain") is None


def test_names_of_the_console():
    assert host_name("127.0.0.1:8080") == "127.0.0.1" and host_name("[::1]:80") == "::1"
    assert host_name("Robot.Local") == "robot.local" and host_name("::1") == "::1"
    assert check(Host="robot.lab:8080", allowed=("robot.lab",)) is None
    assert check(Host="10.0.0.5:8080", listen="10.0.0.5") is None
    assert check(Host="10.0.0.5:8080", listen="0.0.0.0").status == 403          # listening everywhere names nothing


def test_token_file(tmp_path):
    path = tmp_path / "token"
    with pytest.raises(ValueError, match="No such file"):
        read_token(str(path))
    path.write_text(TOKEN + "\n")
    path.chmod(0o644)
    with pytest.raises(ValueError, match="chmod 600"):
        read_token(str(path))
    path.chmod(0o600)
    assert read_token(str(path)) == TOKEN
    path.write_text("short\n")
    with pytest.raises(ValueError, match="at least 16"):
        read_token(str(path))


# ------------------------------------------------------------------ in process: the safe stop
def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def console_and_engine_node(engine_factory, tmp_path):
    """A console (token from a file) and an engine node, on one rclpy context spun in a thread; the
    engine node holds a real engine (the small test model), the console stand-ins for the other nodes."""
    from oxygen_ros.console.console_node import ConsoleNode
    from oxygen_ros.nodes.engine_node import EngineNode
    from oxygen_ros.robot.rate import RateMeter

    token_file = tmp_path / "token"
    token_file.write_text(TOKEN)
    token_file.chmod(0o600)
    context = Context()
    rclpy.init(context=context)
    engine = engine_factory()
    printed = []
    engine_node = EngineNode(context=context)
    engine_node.engine = engine
    outputs = []
    engine_node.attached = SimpleNamespace(disable_output=lambda: outputs.append(False))
    port = free_port()
    console = ConsoleNode(
        engine, action=SimpleNamespace(enabled=True, last_status="ok", rate=RateMeter()),
        conversation=SimpleNamespace(p={"action_name": "oxygen/converse_stream", "interject_service": "oxygen/interject"}),
        observation=SimpleNamespace(slots=["base_0_rgb"], p={"prompt_topic": "oxygen/prompt", "max_prompt_chars": 500}),
        view=None, lifecycle_state=lambda: "active", safe_stop_service=engine_node.clear_safe_stop_service,
        printer=lambda *a, **k: printed.append(a), context=context,
        parameter_overrides=[Parameter("port", value=port), Parameter("token_file", value=str(token_file))])
    executor = SingleThreadedExecutor(context=context)
    for node in (engine_node, console):
        executor.add_node(node)
    thread = threading.Thread(target=executor.spin, daemon=True)
    thread.start()

    def post(path, body: dict, token=TOKEN):
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=20)
        try:
            conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json", "X-Oxygen-Token": token})
            r = conn.getresponse()
            return r.status, json.loads(r.read()) if r.status != 401 else None
        finally:
            conn.close()

    yield SimpleNamespace(engine=engine, post=post, outputs=outputs, printed=printed, console=console)
    console.close()
    executor.shutdown(timeout_sec=2.0)
    engine_node.engine = engine_node.attached = None
    for node in (console, engine_node):
        node.destroy_node()
    rclpy.shutdown(context=context)


def test_the_safe_stop_is_cleared_deliberately_and_output_stays_off(console_and_engine_node):
    c = console_and_engine_node
    assert not c.printed                      # a token from a file is not printed
    assert c.post("/enable", {"enabled": True}, token="wrong")[0] == 401
    c.engine.faulted = "5 consecutive faulty frames, last: NaN in the action chunk"
    status, answer = c.post("/enable", {"enabled": True})
    assert status == 409 and not answer["success"] and "safe stop" in answer["message"], answer
    assert c.engine.faulted                   # switching output on did not clear it in passing
    status, answer = c.post("/clear_safe_stop", {})
    assert status == 200 and answer["success"] and "enable it to move again" in answer["message"], answer
    assert not c.engine.faulted and c.outputs == [False]
    status, answer = c.post("/clear_safe_stop", {})
    assert not answer["success"] and answer["message"] == "no safe stop to clear"
