"""Test harness for the ROS side: runs oxygen_bringup in its own process (as a robot would) on a private
DDS domain, and gives the test process an rclpy node with a background executor to talk to it."""
from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import rclpy
from rclpy.context import Context
from rclpy.executors import SingleThreadedExecutor
from rclpy.node import Node

REPO = Path(__file__).resolve().parents[1]


_domains: dict[tuple[str, int], int] = {}       # (test module, offset) -> the domain this process gave it
DOMAINS = 101       # DDS domain ids 1..101 are valid with the default port mapping (Linux ephemeral ports above)


def private_domain(offset: int) -> int:
    """A DDS domain id of the calling test module's `offset` in this test process (the same one each time that
    module asks), distinct from the domain of every other (module, offset) this process has used. Tests run in
    parallel workers (pytest-xdist, scripts/test.sh): each worker takes its domains from its own share of
    1..DOMAINS, so two workers' processes never meet on one domain, and within a worker a test's bringup never
    meets the participants an earlier test's processes may leave behind for a while (two modules asking for the
    same offset get two domains)."""
    key = (sys._getframe(1).f_globals.get("__name__", ""), offset)
    if key not in _domains:
        worker = os.environ.get("PYTEST_XDIST_WORKER", "gw0")
        index = int(worker[2:]) if worker[2:].isdigit() else 0
        span = DOMAINS // max(1, int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1")))
        if len(_domains) >= span:
            raise RuntimeError(f"this test worker has used all {span} DDS domains of its share: fewer workers")
        _domains[key] = 1 + index * span + (os.getpid() * 7 + len(_domains)) % span
    return _domains[key]


class Bringup:
    """oxygen_bringup in a subprocess; its combined output is collected for log assertions."""

    def __init__(self, args: list[str], domain: int, timeout_s: float = 120.0, prefix: tuple = (),
                 env: dict | None = None):
        """prefix: a command it runs under (e.g. `ip netns exec NS`); env: extra environment variables."""
        env = dict(os.environ, ROS_DOMAIN_ID=str(domain), PYTHONUNBUFFERED="1", **(env or {}))
        self.proc = subprocess.Popen([*prefix, sys.executable, "-m", "oxygen_ros.bringup", *args,
                                      "--duration", str(timeout_s)], cwd=REPO, env=env,
                                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.lines: list[str] = []
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self):
        for line in self.proc.stdout:
            self.lines.append(line.rstrip("\n"))

    def output(self) -> str:
        return "\n".join(self.lines)

    def wait_for_line(self, text: str, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(text in line for line in self.lines):
                return True
            if self.proc.poll() is not None:
                return False
            time.sleep(0.05)
        return False

    def stop(self, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(2)  # SIGINT: the bringup's orderly shutdown
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        self._reader.join(5)
        return self.proc.returncode


@contextmanager
def running_bringup(args: list[str], domain: int, client_name: str = "oxygen_test_client",
                    ready: str = "oxygen_bringup: running", ready_timeout: float = 90.0):
    """(bringup, client) while the bringup runs; afterwards it must stop cleanly (exit code 0)."""
    bringup = Bringup(args, domain)
    client = RosClient(domain, client_name)
    try:
        assert bringup.wait_for_line(ready, ready_timeout), bringup.output()
        yield bringup, client
    finally:
        client.close()
        code = bringup.stop()
        print(bringup.output()[-4000:])
        assert code == 0, f"bringup exited with {code}"


class RosClient:
    """A node in the test process, spun by a background executor on its own rclpy context."""

    def __init__(self, domain: int, name: str = "oxygen_test_client"):
        os.environ["ROS_DOMAIN_ID"] = str(domain)
        self.context = Context()
        rclpy.init(context=self.context)
        self.node = Node(name, context=self.context)
        self.executor = SingleThreadedExecutor(context=self.context)
        self.executor.add_node(self.node)
        self._thread = threading.Thread(target=self.executor.spin, daemon=True)
        self._thread.start()

    def collect(self, msg_type, topic: str, qos=10) -> list:
        """Subscribe and return the list the messages (with arrival times) are appended to."""
        received: list = []
        self.node.create_subscription(msg_type, topic, lambda m: received.append((time.monotonic(), m)), qos)
        return received

    def close(self):
        self.executor.shutdown(timeout_sec=2.0)
        self.node.destroy_node()
        rclpy.shutdown(context=self.context)


def wait_until(predicate, timeout: float, period: float = 0.05) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(period)
    return predicate()


def output_stops(messages: list, quiet_s: float = 1.0, timeout: float = 20.0) -> bool:
    """`messages` (a RosClient.collect list) stop: none for `quiet_s` (within `timeout`), then none for
    another 1.5 s. Event-driven: a command already in flight when output stopped may land late on a loaded
    machine (a fixed 0.3 s slack failed under load), but output that goes on is caught."""
    def quiet():
        return not messages or time.monotonic() - messages[-1][0] > quiet_s
    if not wait_until(quiet, timeout):
        return False
    count = len(messages)
    time.sleep(1.5)
    return len(messages) == count


@contextmanager
def engine_node_in_process(tmp_path, engine_params: str, domain: int):
    """An oxygen_engine lifecycle node (unconfigured) in this process, on its own rclpy context, with
    `engine_params` (YAML lines under its ros__parameters); stopped and destroyed afterwards."""
    from oxygen_ros.nodes.engine_node import EngineNode

    params = tmp_path / "engine_params.yaml"
    params.write_text("oxygen_engine:\n  ros__parameters:\n" + "".join(f"    {line}\n" for line in engine_params.splitlines()))
    os.environ["ROS_DOMAIN_ID"] = str(domain)
    context = Context()
    rclpy.init(args=["t", "--ros-args", "--params-file", str(params)], context=context)
    node = EngineNode(context=context)
    try:
        yield node
    finally:
        if node.engine is not None:
            node.engine.stop()
        node.destroy_node()
        rclpy.shutdown(context=context)

