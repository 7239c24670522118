"""`python -m oxygen_ros.serve.bench_hostile --json OUT`: what one hostile openpi client costs the others.

Starts `oxygen_serve --robot droid --random tiny --max-clients 3 --api-key-file ...` as its own process (the
server measured from outside: its resident memory, its open descriptors; its descriptor limit set to
--fd-limit, 1024 by default, a common default) and keeps one well-behaved client
calling `infer` in a closed loop throughout, then, one after the other:

  hostile   a second client sends a 32 MB message of empty msgpack maps, then one of empty lists (within
            --max-message-mb): the server's memory growth (peak resident set, VmHWM, reset through
            /proc/PID/clear_refs before each message) and the good client's
            slowest reply while each is handled, against the chunk period (horizon x control period);
  flood     1,000 connection attempts without the key: half open a socket and never send a request
            (held until the end of the phase), half send a keyless websocket handshake; the server's open
            descriptors sampled throughout, against half its descriptor limit; the good client's slowest reply;
  departed  a second client sends an observation with a 256-token question and closes while the reply
            decodes: the time until a new client is admitted (with the good client, the server is full until
            the slot is freed), beside the time the same question takes when its client stays;
  admission three floods from the right key's own address (80 idle sockets reopened as soon as closed, a
            keyless handshake flood, a wrong key every 0.1 s): the right key's time to its metadata, 20 tries
            each, and every refusal;
  big       two clients sending 30 MB observations as fast as they are answered: the good client's median
            and slowest reply against its median before.

Targets (issue: bounded inputs): a hostile message delays the good client by less than one chunk period and
grows the server by < 100 MB; the flood leaves the server below half its descriptor limit with the good
client served; a departed client's slot is free within 1 s; the right key admitted within 2 s under each
flood; the big senders delay the good client by less than one chunk period. Figures from a loaded machine are not figures.

`--protocol lerobot`: `oxygen_serve --protocol lerobot` under the LeRobot attacks instead (`lerobot_main`:
decode amplification through the pickle memo, shared references, stalled streams and waiting calls from one
connection, Ready bursts, names that cannot be applied, an unknown client in a loop).
"""
from __future__ import annotations

import argparse
import base64
import collections
import datetime
import json
import os
import resource
import platform
import secrets
import socket
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from .bench_openpi import observation
from .layouts import LAYOUTS

HOSTILE_BYTES = 32 << 20
FLOOD = 1000


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise KeyError(field)


def _open_fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _fd_limit(pid: int) -> int:
    for line in Path(f"/proc/{pid}/limits").read_text().splitlines():
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise KeyError("Max open files")


class Server:
    """oxygen_serve in a process of its own."""

    def __init__(self, robot: str, key_file: Path, max_clients: int, fd_limit: int):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
        soft = fd_limit if hard == resource.RLIM_INFINITY else min(fd_limit, hard)
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "oxygen_ros.serve", "--robot", robot, "--random", "tiny", "--port", "0",
             "--max-clients", str(max_clients), "--api-key-file", str(key_file)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
            preexec_fn=lambda: resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard)))
        self.port, self.log = None, []
        deadline = time.monotonic() + 300
        while self.port is None:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("oxygen_serve did not start:\n" + "".join(self.log))
            self.log.append(line)
            if "listening on ws://" in line:
                self.port = int(line.rsplit(":", 1)[1])
        threading.Thread(target=self._drain, daemon=True).start()

    def _drain(self) -> None:
        for line in self.proc.stdout:
            self.log.append(line)

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


class GoodClient:
    """A robot program calling infer in a closed loop on its own thread: (start, seconds, error) per call."""

    def __init__(self, port: int, key: str, layout, seed: int):
        from openpi_client.websocket_client_policy import WebsocketClientPolicy

        self.policy = WebsocketClientPolicy("127.0.0.1", port, api_key=key)
        self.layout, self.rng = layout, np.random.default_rng(seed)
        self.calls: list[tuple[float, float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            obs = observation(self.layout, self.rng, 224)
            t = time.monotonic()
            try:
                self.policy.infer(obs)
                error = ""
            except Exception as e:  # noqa: BLE001 - counted in the result
                error = f"{type(e).__name__}: {e}"
                self._stop.set()
            self.calls.append((t, time.monotonic() - t, error))

    def slowest_in(self, start: float, end: float) -> dict:
        """The calls that overlap [start, end]: how many, their slowest, their errors."""
        hits = [c for c in list(self.calls) if c[0] <= end and c[0] + c[1] >= start]
        return {"calls": len(hits), "slowest_s": max((c[1] for c in hits), default=None),
                "errors": [c[2] for c in hits if c[2]]}

    def typical_s(self, start: float, end: float) -> float | None:
        hits = [c[1] for c in list(self.calls) if start <= c[0] <= end and not c[2]]
        return float(np.median(hits)) if hits else None

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.policy._ws.close()


def hostile(server: Server, key: str, good: GoodClient) -> dict:
    import websockets.sync.client

    out = {}
    for name, filler in (("empty_maps", b"\x80"), ("empty_lists", b"\x90")):
        count = HOSTILE_BYTES - 16
        message = b"\xdd" + count.to_bytes(4, "big") + filler * count          # one array of `count` empties
        pid = server.proc.pid
        with websockets.sync.client.connect(f"ws://127.0.0.1:{server.port}", max_size=None,
                                            additional_headers={"Authorization": f"Api-Key {key}"}) as ws:
            ws.recv(timeout=30)                                                 # the metadata
            time.sleep(1.0)
            Path(f"/proc/{pid}/clear_refs").write_text("5")                     # VmHWM := VmRSS
            rss = _status_kb(pid, "VmRSS")
            t = time.monotonic()
            ws.send(message)
            reply = ws.recv(timeout=120)
            replied = time.monotonic()
            time.sleep(0.5)
        out[name] = {
            "message_bytes": len(message), "reply_s": round(replied - t, 4),
            "reply": reply if isinstance(reply, str) else f"<{len(reply)} bytes>",
            "server_rss_before_mb": rss / 1024, "server_peak_growth_mb": (_status_kb(pid, "VmHWM") - rss) / 1024,
            "server_rss_after_mb": _status_kb(pid, "VmRSS") / 1024,
            "good_client": good.slowest_in(t, replied + 0.25),
        }
        time.sleep(1.0)
    return out


def flood(server: Server, good: GoodClient) -> dict:
    pid, port = server.proc.pid, server.port
    held: list[socket.socket] = []
    lock = threading.Lock()
    outcomes: dict[str, int] = {}
    samples: list[int] = []
    done = threading.Event()

    def sample() -> None:
        while not done.is_set():
            samples.append(_open_fds(pid))
            time.sleep(0.02)

    def attempt(i: int) -> None:
        try:
            s = socket.create_connection(("127.0.0.1", port), timeout=10)
        except OSError as e:
            what = f"connect failed: {type(e).__name__}"
        else:
            if i % 2 == 0:                        # never sends its request head: held open
                with lock:
                    held.append(s)
                what = "held open"
            else:
                key = base64.b64encode(os.urandom(16)).decode()
                try:
                    s.sendall(f"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                              f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
                    head = s.recv(64).split(b"\r\n", 1)[0].decode(errors="replace")
                    what = head or "closed without a reply"
                except OSError as e:
                    what = f"{type(e).__name__}"
                s.close()
        with lock:
            outcomes[what] = outcomes.get(what, 0) + 1

    fds_before = _open_fds(pid)
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t = time.monotonic()
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(attempt, range(FLOOD)))
    attempts_s = time.monotonic() - t
    time.sleep(1.0)
    for s in held:
        s.close()
    end = time.monotonic()
    time.sleep(0.5)
    done.set()
    sampler.join()
    limit = _fd_limit(pid)
    return {"attempts": FLOOD, "attempts_s": round(attempts_s, 3), "outcomes": outcomes,
            "server_fds_before": fds_before, "server_fds_max": max(samples), "server_fd_limit": limit,
            "server_fds_after": _open_fds(pid), "good_client": good.slowest_in(t, end)}


# ------------------------------------------------------------------------------- openpi admission and fairness
def _right_key_admitted_s(port: int, key: str, timeout: float = 10.0) -> tuple[float, str]:
    """Seconds until a client with the right key has the metadata, and '' or why it was not admitted."""
    import websockets.sync.client

    t = time.monotonic()
    try:
        with websockets.sync.client.connect(f"ws://127.0.0.1:{port}", open_timeout=timeout, close_timeout=2,
                                            additional_headers={"Authorization": f"Api-Key {key}"}) as ws:
            ws.recv(timeout=timeout)
        return time.monotonic() - t, ""
    except Exception as e:  # noqa: BLE001 - counted in the result
        return time.monotonic() - t, f"{type(e).__name__}: {e}"[:200]


def _idle_socket(port: int, stop: threading.Event) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.settimeout(0.2)
        while not stop.is_set():
            try:
                if s.recv(1) == b"":
                    return
            except socket.timeout:
                continue


def _keyless_handshake(port: int, stop: threading.Event) -> None:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        key = base64.b64encode(os.urandom(16)).decode()
        s.sendall(f"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                  f"Sec-WebSocket-Key: {key}\r\nSec-WebSocket-Version: 13\r\n\r\n".encode())
        s.recv(256)


def _wrong_key(port: int, stop: threading.Event) -> None:
    import websockets.sync.client

    try:
        with websockets.sync.client.connect(f"ws://127.0.0.1:{port}", open_timeout=5,
                                            additional_headers={"Authorization": "Api-Key wrong-key-wrong-key"}):
            pass
    except Exception:  # noqa: BLE001 - refused, as expected
        pass
    stop.wait(0.1)


ADMISSION_FLOODS = {"idle_sockets_reopened_as_closed": (_idle_socket, 80),
                    "keyless_handshake_flood": (_keyless_handshake, 16),
                    "wrong_key_same_address_every_0.1_s": (_wrong_key, 1)}


def admission(server: Server, key: str, tries: int = 20) -> dict:
    """The issue's three floods from the right key's own address (so the per-address limit meets both): for
    each, a client with the right key connects `tries` times while the flood runs (each a new process's worth
    of connection: a fresh socket and handshake); the time to its metadata and every refusal."""
    out = {}
    for name, (attack, workers) in ADMISSION_FLOODS.items():
        stop = threading.Event()

        def loop():
            while not stop.is_set():
                try:
                    attack(server.port, stop)
                except OSError:
                    pass
        threads = [threading.Thread(target=loop, daemon=True) for _ in range(workers)]
        for t in threads:
            t.start()
        time.sleep(2.0)                                # the flood at full strength
        results = []
        for _ in range(tries):
            results.append(_right_key_admitted_s(server.port, key))
            time.sleep(0.1)
        stop.set()
        for t in threads:
            t.join(30)
        times = [t for t, why in results if not why]
        out[name] = {"tries": tries, "admitted": len(times), "refusals": [why for _, why in results if why][:5],
                     "admitted_max_s": round(max(times), 3) if times else None,
                     "admitted_median_s": round(float(np.median(times)), 3) if times else None}
        time.sleep(11.0)                               # the wrong keys' window empties before the next phase
    return out


def big_senders(server: Server, key: str, good: GoodClient, layout, senders: int = 2, seconds: float = 15.0) -> dict:
    """`senders` clients each sending 30 MB observations (one 3,000 x 3,300 image per camera, under the 32 MB
    message cap) as fast as the server answers them, for `seconds`: the good client's median and slowest
    reply then, against its median just before."""
    import websockets.sync.client
    from openpi_client import msgpack_numpy

    rng = np.random.default_rng(3)
    message = observation(layout, rng, 8)
    per_camera = (30 << 20) // len(layout.cameras)
    side = int((per_camera / 3) ** 0.5)
    for camera in layout.cameras:
        image = rng.integers(0, 256, (3, side, side) if layout.name == "aloha" else (side, side, 3), dtype=np.uint8)
        if len(camera.path) == 2:
            message[camera.path[0]][camera.path[1]] = image
        else:
            message[camera.key] = image
    data = msgpack_numpy.packb(message)
    stop, counts, errors = threading.Event(), [0] * senders, []

    def send(i: int) -> None:
        try:
            with websockets.sync.client.connect(f"ws://127.0.0.1:{server.port}", max_size=None, open_timeout=30,
                                                additional_headers={"Authorization": f"Api-Key {key}"}) as ws:
                ws.recv(timeout=30)
                while not stop.is_set():
                    ws.send(data)
                    ws.recv(timeout=120)
                    counts[i] += 1
        except Exception as e:  # noqa: BLE001 - counted
            errors.append(f"{type(e).__name__}: {e}"[:200])

    before_end = time.monotonic()
    before = good.typical_s(before_end - 5.0, before_end)
    threads = [threading.Thread(target=send, args=(i,), daemon=True) for i in range(senders)]
    t = time.monotonic()
    for th in threads:
        th.start()
    time.sleep(seconds)
    end = time.monotonic()
    stop.set()
    for th in threads:
        th.join(180)
    during = good.slowest_in(t + 1.0, end)
    return {"senders": senders, "message_bytes": len(data), "seconds": seconds,
            "messages_answered": counts, "sender_errors": errors[:3],
            "good_median_before_s": before, "good_median_during_s": good.typical_s(t + 1.0, end),
            "good_slowest_during_s": during["slowest_s"], "good_errors": during["errors"][:3]}


def departed(server: Server, key: str, layout, rate_wait_s: float) -> dict:
    import websockets
    from openpi_client import msgpack_numpy
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    time.sleep(rate_wait_s)                     # the flood's failed handshakes from this address expire
    rng = np.random.default_rng(7)
    question = {**observation(layout, rng, 224), "question": "Describe every object on the table in detail.",
                "max_tokens": 256, "timeout_s": 120.0}           # 256 tokens: ~28 s on a quiet 2-core machine
    stays = WebsocketClientPolicy("127.0.0.1", server.port, api_key=key)
    t = time.monotonic()
    reply = stays.infer(question)
    stays_s = time.monotonic() - t
    stays._ws.close()
    time.sleep(0.5)
    filler = WebsocketClientPolicy("127.0.0.1", server.port, api_key=key)      # holds the third slot
    leaves = WebsocketClientPolicy("127.0.0.1", server.port, api_key=key)
    leaves._ws.send(msgpack_numpy.Packer().pack(question))
    time.sleep(min(0.5, stays_s / 3))           # its chunk computed, its reply decoding
    leaves._ws.close()
    gone = time.monotonic()
    refused = 0
    while True:
        try:
            newcomer = WebsocketClientPolicy("127.0.0.1", server.port, api_key=key)
            break
        except websockets.InvalidStatus:
            refused += 1
            if time.monotonic() - gone > 120:
                raise
            time.sleep(0.02)
    admitted_s = time.monotonic() - gone
    newcomer._ws.close()
    filler._ws.close()
    return {"question_tokens": reply.get("tokens"), "question_s_when_the_client_stays": round(stays_s, 3),
            "slot_free_s": round(admitted_s, 3), "refused_meanwhile": refused}


# ---------------------------------------------------------------------------------- LeRobot (--protocol lerobot)
class _Call:
    """Pickles as `fn(*args)` (BUILD with `state`): a hostile pickle naming allowed globals."""

    def __init__(self, fn, args, state=None):
        self.fn, self.args, self.state = fn, args, state

    def __reduce__(self):
        return (self.fn, self.args) if self.state is None else (self.fn, self.args, self.state)


class LeRobotServerProcess(Server):
    """oxygen_serve --protocol lerobot --robot so101 --random tiny in a process of its own, its log kept."""

    def __init__(self, max_clients: int):
        env = dict(os.environ, PYTHONUNBUFFERED="1")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "oxygen_ros.serve", "--protocol", "lerobot", "--robot", "so101", "--random", "tiny",
             "--port", "0", "--max-clients", str(max_clients)],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        self.port, self.log = None, []
        deadline = time.monotonic() + 300
        while self.port is None:
            line = self.proc.stdout.readline()
            if not line and self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError("oxygen_serve did not start:\n" + "".join(self.log))
            self.log.append(line)
            if "listening for LeRobot robot_client on" in line:
                self.port = int(line.rsplit(":", 1)[1])
        threading.Thread(target=self._drain, daemon=True).start()

    def log_bytes(self) -> int:
        return sum(len(line) for line in list(self.log))


class LeRobotClient:
    """The calls LeRobot's robot_client makes (Ready, SendPolicyInstructions, SendObservations in 2 MB chunks,
    GetActions) on a connection of its own."""
    CHUNK = 2 << 20

    def __init__(self, port: int):
        import grpc

        from .lerobot import services_pb2_grpc

        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.max_receive_message_length", 4 << 20), ("grpc.max_send_message_length", 4 << 20),
            ("grpc.use_local_subchannel_pool", 1)])
        self.stub = services_pb2_grpc.AsyncInferenceStub(self.channel)

    @staticmethod
    def features(cameras=("front", "wrist"), shape=(480, 640, 3)) -> dict:
        from .layouts import SO101_JOINTS

        out = {"observation.state": {"dtype": "float32", "shape": (6,), "names": list(SO101_JOINTS)}}
        for cam in cameras:
            out[f"observation.images.{cam}"] = {"dtype": "image", "shape": shape,
                                                "names": ["height", "width", "channels"]}
        return out

    @staticmethod
    def instructions(name="user/pi05_so101", features=None):
        from .lerobot import services_pb2 as pb
        from .lerobot.wire import RemotePolicyConfig, encode

        features = features or LeRobotClient.features()
        return pb.PolicySetup(data=encode(RemotePolicyConfig("pi05", name, features, 10, "cuda")))

    def start(self) -> None:
        from .lerobot import services_pb2 as pb

        self.stub.Ready(pb.Empty())
        self.stub.SendPolicyInstructions(self.instructions())

    def stream(self, data: bytes):
        from .lerobot import services_pb2 as pb

        for sent in range(0, len(data), self.CHUNK):
            last = sent + self.CHUNK >= len(data)
            state = pb.TRANSFER_END if last else pb.TRANSFER_BEGIN if sent == 0 else pb.TRANSFER_MIDDLE
            yield pb.Observation(transfer_state=state, data=data[sent:sent + self.CHUNK])

    def send(self, data: bytes) -> None:
        self.stub.SendObservations(self.stream(data))

    def close(self) -> None:
        self.channel.close()


def lerobot_observation(rng, timestep: int = 0, **extra) -> bytes:
    from .layouts import SO101_JOINTS
    from .lerobot.wire import TimedObservation, encode

    raw = {joint: float(rng.uniform(-90, 90)) for joint in SO101_JOINTS}
    raw |= {"front": rng.integers(0, 256, (480, 640, 3), dtype=np.uint8),
            "wrist": rng.integers(0, 256, (480, 640, 3), dtype=np.uint8), "task": "pick up the cube", **extra}
    return encode(TimedObservation(timestamp=time.time(), timestep=timestep, observation=raw, must_go=True))


class HonestLeRobotClient(GoodClient):
    """A LeRobot robot_client in a closed loop on its own thread: sends an observation, waits for its chunk;
    (start, seconds to the chunk, error) per observation."""

    def __init__(self, port: int):  # noqa: super-init - the websocket client is not made
        from .lerobot import services_pb2 as pb

        self.client, self.pb = LeRobotClient(port), pb
        self.client.start()
        self.rng = np.random.default_rng(0)
        self.frames = [lerobot_observation(self.rng, t) for t in range(4)]
        self.calls: list[tuple[float, float, str]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        step = 0
        while not self._stop.is_set():
            t = time.monotonic()
            try:
                self.client.send(self.frames[step % len(self.frames)])
                while not self._stop.is_set() and not self.client.stub.GetActions(self.pb.Empty()).data:
                    pass
                error = ""
            except Exception as e:  # noqa: BLE001 - counted in the result
                error = f"{type(e).__name__}: {e}"[:200]
            self.calls.append((t, time.monotonic() - t, error))
            step += 1

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)
        self.client.close()


def _lerobot_attack(server: LeRobotServerProcess, good: HonestLeRobotClient, attack) -> dict:
    """Run `attack()` (returns what the attacker saw) with the server's peak resident set reset before it, its
    log's growth and the honest client's calls that overlap it."""
    pid = server.proc.pid
    time.sleep(0.5)
    Path(f"/proc/{pid}/clear_refs").write_text("5")                     # VmHWM := VmRSS
    rss, log_bytes = _status_kb(pid, "VmRSS"), server.log_bytes()
    t = time.monotonic()
    seen = attack()
    answered = time.monotonic()
    time.sleep(0.5)
    return {**seen, "answered_s": round(answered - t, 4), "server_rss_before_mb": rss / 1024,
            "server_peak_growth_mb": (_status_kb(pid, "VmHWM") - rss) / 1024,
            "server_rss_after_mb": _status_kb(pid, "VmRSS") / 1024, "log_bytes_added": server.log_bytes() - log_bytes,
            "good_client": good.slowest_in(t, answered + 0.25)}


def _status(call) -> str:
    import grpc

    try:
        call()
        return "OK"
    except grpc.RpcError as e:
        return f"{e.code().name}: {e.details()[:160]}"


def _answer_times(futures, start: float) -> list:
    """Seconds from `start` to each future's answer, filled in as they come."""
    times = [None] * len(futures)
    for i, f in enumerate(futures):
        f.add_done_callback(lambda _, i=i: times.__setitem__(i, time.monotonic() - start))
    return times


def _answer_summary(replies: list[str], times: list) -> dict:
    """The slowest refusal, and the slowest answer of the calls admitted (a wait or a deadline of their own)."""
    refused = [t for r, t in zip(replies, times) if r != "OK" and not r.startswith("DEADLINE_EXCEEDED")]
    admitted = [t for r, t in zip(replies, times) if r == "OK" or r.startswith("DEADLINE_EXCEEDED")]
    return {"slowest_refusal_s": round(max(refused), 4) if refused else None,
            "admitted_answered_s": round(max(admitted), 4) if admitted else None}


def lerobot_attacks(server: LeRobotServerProcess, good: HonestLeRobotClient) -> dict:
    """Issue 40 items 1-4, each from a client of its own (started as LeRobot's client starts)."""
    import torch

    from .lerobot import services_pb2 as pb

    rng = np.random.default_rng(1)
    out = {}

    def one_message(name: str, data_fn) -> None:
        bad = LeRobotClient(server.port)
        bad.start()
        data = data_fn()

        def attack():
            return {"message_bytes": len(data), "reply": _status(lambda: bad.send(data))}
        out[name] = _lerobot_attack(server, good, attack)
        bad.close()

    buffer_args = (bytes(1 << 20), np.dtype("u1"), (1 << 20,), "C")
    one_message("frombuffer_2000x_1mib", lambda: lerobot_observation(
        rng, bad=[_Call(np._core.numeric._frombuffer, buffer_args) for _ in range(2000)]))
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        storage = torch.zeros(1 << 18).storage()
    tensor_args = (storage, 0, (1 << 18,), (1,), False, collections.OrderedDict())
    one_message("rebuild_tensor_500x_1mib", lambda: lerobot_observation(
        rng, bad=[_Call(torch._utils._rebuild_tensor_v2, tensor_args) for _ in range(500)]))
    one_message("ordered_dict_replaced_items", lambda: lerobot_observation(
        rng, bad=_Call(collections.OrderedDict, (), {"items": 1})))

    def instructions(name: str, setup_fn, times: int = 1) -> None:
        setup = setup_fn()

        def attack():
            replies = []
            for _ in range(times):
                bad = LeRobotClient(server.port)
                bad.stub.Ready(pb.Empty())
                replies.append(_status(lambda: bad.stub.SendPolicyInstructions(setup)))
                bad.close()
            return {"message_bytes": len(setup.data), "calls": times, "replies": sorted(set(replies))}
        out[name] = _lerobot_attack(server, good, attack)

    names: list = ["shoulder_pan.pos"]
    for _ in range(8):
        names = [names] * 10
    shared = {"observation.state": {"dtype": "float32", "shape": (6,), "names": names}}
    instructions("shared_references_1e8", lambda: LeRobotClient.instructions(features=shared))
    instructions("crlf_policy_name", lambda: LeRobotClient.instructions(name="user/pi05\r\nx: 1"))
    instructions("policy_name_3_9_mb_x20", lambda: LeRobotClient.instructions(name="n" * 3_900_000), times=20)

    def stalled_streams():
        bad = LeRobotClient(server.port)
        bad.start()
        hold = threading.Event()

        def stalled():
            yield pb.Observation(transfer_state=pb.TRANSFER_BEGIN, data=b"x" * 1024)
            hold.wait(60)
        t = time.monotonic()
        futures = [bad.stub.SendObservations.future(stalled()) for _ in range(24)]
        answered = _answer_times(futures, t)
        newcomers = []
        for _ in range(8):
            c = LeRobotClient(server.port)
            newcomers.append(_status(lambda: c.stub.Ready(pb.Empty())))
            c.close()
        replies = [_status(f.result) for f in futures]
        hold.set()
        bad.close()
        return {"streams": 24, "replies": dict(collections.Counter(r.split(":")[0] for r in replies)),
                **_answer_summary(replies, answered), "new_clients_ready": dict(collections.Counter(newcomers))}
    out["stalled_streams_24_one_connection"] = _lerobot_attack(server, good, stalled_streams)

    def get_actions_40():
        bad = LeRobotClient(server.port)
        bad.start()
        t = time.monotonic()
        futures = [bad.stub.GetActions.future(pb.Empty()) for _ in range(40)]
        answered = _answer_times(futures, t)
        replies = [_status(f.result) for f in futures]
        bad.close()
        return {"calls": 40, "replies": dict(collections.Counter(r.split(":")[0] for r in replies)),
                **_answer_summary(replies, answered)}
    out["get_actions_40_one_connection"] = _lerobot_attack(server, good, get_actions_40)

    def ready_bursts():
        before = sum("ready: robot" in line for line in list(server.log))
        bad = LeRobotClient(server.port)
        with ThreadPoolExecutor(8) as pool:
            for _ in range(100):
                list(pool.map(lambda _: _status(lambda: bad.stub.Ready(pb.Empty())), range(8)))
        bad.close()
        time.sleep(0.5)
        return {"bursts": 100, "calls_per_burst": 8,
                "robots_made": sum("ready: robot" in line for line in list(server.log)) - before}
    out["concurrent_ready_100_bursts"] = _lerobot_attack(server, good, ready_bursts)

    def unknown_client_loop():
        lines = len(server.log)
        bad = LeRobotClient(server.port)
        replies = [_status(lambda: bad.stub.GetActions(pb.Empty())).split(":")[0] for _ in range(200)]
        bad.close()
        time.sleep(0.3)
        return {"calls": 200, "replies": dict(collections.Counter(replies)),
                "log_lines_added": sum("unknown client" in line for line in server.log[lines:])}
    out["unknown_client_loop_200"] = _lerobot_attack(server, good, unknown_client_loop)
    return out


def lerobot_main(json_path: str | None) -> int:
    """The LeRobot server under issue 40's attacks (items 1-4), one after the other, an honest client (two
    640x480 cameras, closed loop: observation, then GetActions until its chunk) throughout. Per attack: the
    replies, the time to them (per call; for many calls at once the slowest refusal, and apart the calls
    admitted: a GetActions' own wait, a stalled stream's end when it sent nothing for 0.8 s), the server's peak resident growth
    (VmHWM reset through /proc/PID/clear_refs before each), its log's growth, the honest client's slowest
    observation-to-chunk time overlapping the attack. Targets: refusals within 1 s with a specific status,
    growth < 100 MB per attack and < 300 MB in total, the honest client's chunk within one chunk period and
    never refused, no INTERNAL, no traceback in the server's log."""
    from oxygen_ros.robot.configs import find_config, node_params

    params = node_params(find_config("so101"), "oxygen_engine")
    chunk_period_s = params["action_horizon"] * params["control_period_s"]
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load = os.getloadavg()[0]
    server = LeRobotServerProcess(max_clients=32)    # room for every attack's sessions (freed when idle)
    try:
        rss_start = _status_kb(server.proc.pid, "VmRSS") / 1024
        good = HonestLeRobotClient(server.port)
        time.sleep(5.0)
        typical = good.typical_s(0, time.monotonic())
        result = {"attacks": lerobot_attacks(server, good)}
        rss_end = _status_kb(server.proc.pid, "VmRSS") / 1024
        good.stop()
    finally:
        server.stop()
    a = result["attacks"]
    tracebacks = sum("Traceback" in line for line in server.log)
    slowest = {k: v["good_client"]["slowest_s"] for k, v in a.items()}
    per_call = {k: a[k]["answered_s"] / a[k].get("calls", 1) for k in a if "calls_per_burst" not in a[k]
                and "slowest_refusal_s" not in a[k]}
    per_call["concurrent_ready_100_bursts"] = a["concurrent_ready_100_bursts"]["answered_s"] / 100
    per_call |= {k: a[k]["slowest_refusal_s"] for k in a if "slowest_refusal_s" in a[k]}
    result["answer_s_per_call"] = {k: round(v, 4) for k, v in per_call.items()}
    result["targets"] = {
        "refused_within_1_s": all(v < 1.0 for v in per_call.values()),
        "stalled_stream_answered_within_1_s": a["stalled_streams_24_one_connection"]["admitted_answered_s"] < 1.0,
        "no_internal": not any("INTERNAL" in json.dumps(v) for v in a.values()),
        "growth_below_100_mb_per_attack": all(v["server_peak_growth_mb"] < 100 for v in a.values()),
        "growth_below_300_mb_in_total": rss_end - rss_start < 300,
        "honest_chunk_below_chunk_period": all(s is not None and s < chunk_period_s for s in slowest.values()),
        "honest_client_never_refused": not any(v["good_client"]["errors"] for v in a.values()),
        "no_traceback_in_the_server_log": tracebacks == 0,
    }
    result["meta"] = {"command": "python -m oxygen_ros.serve.bench_hostile --protocol lerobot"
                                 + (f" --json {json_path}" if json_path else ""),
                      "started": started, "robot": "so101", "model": "tiny (random weights)",
                      "chunk_period_s": chunk_period_s, "honest_chunk_typical_s": typical,
                      "server_rss_start_mb": rss_start, "server_rss_end_mb": rss_end,
                      "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                      "load_avg_1min_start": load, "load_avg_1min_end": os.getloadavg()[0],
                      "note": " ".join(lerobot_main.__doc__.split())}
    print(f"[bench hostile lerobot] {json.dumps(result, indent=1)}", flush=True)
    if json_path:
        Path(json_path).parent.mkdir(parents=True, exist_ok=True)
        Path(json_path).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {json_path}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m oxygen_ros.serve.bench_hostile", description=__doc__.split("\n\n")[0])
    p.add_argument("--robot", choices=sorted(set(LAYOUTS) - {"demo"}), default="droid")
    p.add_argument("--fd-limit", type=int, default=1024, help="the server's descriptor limit (soft RLIMIT_NOFILE)")
    p.add_argument("--json", help="write the result here")
    p.add_argument("--protocol", choices=("openpi", "lerobot"), default="openpi",
                   help="lerobot: oxygen_serve --protocol lerobot under issue 40's LeRobot attacks (lerobot_main)")
    a = p.parse_args(argv)
    if a.protocol == "lerobot":
        return lerobot_main(a.json)
    from oxygen_ros.robot.configs import find_config, node_params

    params = node_params(find_config(a.robot), "oxygen_engine")
    chunk_period_s = params["action_horizon"] * params["control_period_s"]
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    load = os.getloadavg()[0]
    key = secrets.token_urlsafe(24)
    with tempfile.TemporaryDirectory() as tmp:
        key_file = Path(tmp) / "key"
        key_file.write_text(key + "\n")
        key_file.chmod(0o600)
        server = Server(a.robot, key_file, max_clients=3, fd_limit=a.fd_limit)
        try:
            good = GoodClient(server.port, key, LAYOUTS[a.robot], seed=0)
            time.sleep(3.0)
            typical = good.typical_s(0, time.monotonic())
            result = {"hostile": hostile(server, key, good)}
            print(f"[bench hostile] {json.dumps(result['hostile'])}", flush=True)
            result["flood"] = flood(server, good)
            print(f"[bench hostile] {json.dumps(result['flood'])}", flush=True)
            # The good client and a filler keep their slots: with the departing one the server is full
            # (--max-clients 3).
            result["departed"] = departed(server, key, LAYOUTS[a.robot], rate_wait_s=11.0)
            print(f"[bench hostile] {json.dumps(result['departed'])}", flush=True)
            result["admission"] = admission(server, key)
            print(f"[bench hostile] {json.dumps(result['admission'])}", flush=True)
            result["big_senders"] = big_senders(server, key, good, LAYOUTS[a.robot])
            print(f"[bench hostile] {json.dumps(result['big_senders'])}", flush=True)
            good.stop()
        finally:
            server.stop()
    h, f, d, adm, big = result["hostile"], result["flood"], result["departed"], result["admission"], result["big_senders"]
    result["targets"] = {
        "hostile_delay_below_chunk_period": all(
            x["good_client"]["slowest_s"] is not None and x["good_client"]["slowest_s"] < chunk_period_s
            and not x["good_client"]["errors"] for x in h.values()),
        "hostile_growth_below_100_mb": all(x["server_peak_growth_mb"] < 100 for x in h.values()),
        "flood_below_half_the_descriptor_limit": f["server_fds_max"] < f["server_fd_limit"] / 2,
        "flood_good_client_served": f["good_client"]["calls"] > 0 and not f["good_client"]["errors"],
        "departed_slot_free_within_1_s": d["slot_free_s"] < 1.0,
        "right_key_admitted_within_2_s_under_each_flood": all(
            x["admitted"] == x["tries"] and x["admitted_max_s"] < 2.0 for x in adm.values()),
        "big_senders_good_client_within_a_chunk_period": big["good_slowest_during_s"] is not None
        and big["good_slowest_during_s"] < chunk_period_s and not big["good_errors"],
    }
    result["meta"] = {"command": "python -m oxygen_ros.serve.bench_hostile " + " ".join(sys.argv[1:] if argv is None
                                                                                        else argv),
                      "started": started, "robot": a.robot, "chunk_period_s": chunk_period_s,
                      "good_client_typical_infer_s": typical,
                      "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
                      "load_avg_1min_start": load, "load_avg_1min_end": os.getloadavg()[0],
                      "note": __doc__.split("\n\n", 1)[1].strip()}
    print(f"[bench hostile] targets: {json.dumps(result['targets'])}", flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=2) + "\n")
        print(f"wrote {a.json}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
