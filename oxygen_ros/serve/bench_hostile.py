"""`python -m oxygen_ros.serve.bench_hostile --json OUT`: what one hostile openpi client costs the others.

Starts `oxygen_serve --robot droid --random tiny --max-clients 2 --api-key-file ...` as its own process (the
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
            the slot is freed), beside the time the same question takes when its client stays.

Targets (issue: bounded inputs): a hostile message delays the good client by less than one chunk period and
grows the server by < 100 MB; the flood leaves the server below half its descriptor limit with the good
client served; a departed client's slot is free within 1 s. Figures from a loaded machine are not figures.
"""
from __future__ import annotations

import argparse
import base64
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


def departed(server: Server, key: str, layout, rate_wait_s: float) -> dict:
    import websockets
    from openpi_client import msgpack_numpy
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    time.sleep(rate_wait_s)                     # the flood's failed handshakes from this address expire
    rng = np.random.default_rng(7)
    question = {**observation(layout, rng, 224), "question": "Describe every object on the table in detail.",
                "max_tokens": 256}
    stays = WebsocketClientPolicy("127.0.0.1", server.port, api_key=key)
    t = time.monotonic()
    reply = stays.infer(question)
    stays_s = time.monotonic() - t
    stays._ws.close()
    time.sleep(0.5)
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
    return {"question_tokens": reply.get("tokens"), "question_s_when_the_client_stays": round(stays_s, 3),
            "slot_free_s": round(admitted_s, 3), "refused_meanwhile": refused}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m oxygen_ros.serve.bench_hostile", description=__doc__.split("\n\n")[0])
    p.add_argument("--robot", choices=sorted(set(LAYOUTS) - {"demo"}), default="droid")
    p.add_argument("--fd-limit", type=int, default=1024, help="the server's descriptor limit (soft RLIMIT_NOFILE)")
    p.add_argument("--json", help="write the result here")
    a = p.parse_args(argv)
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
        server = Server(a.robot, key_file, max_clients=2, fd_limit=a.fd_limit)
        try:
            good = GoodClient(server.port, key, LAYOUTS[a.robot], seed=0)
            time.sleep(3.0)
            typical = good.typical_s(0, time.monotonic())
            result = {"hostile": hostile(server, key, good)}
            print(f"[bench hostile] {json.dumps(result['hostile'])}", flush=True)
            result["flood"] = flood(server, good)
            print(f"[bench hostile] {json.dumps(result['flood'])}", flush=True)
            # The good client keeps its slot: with the departing one the server is full (--max-clients 2).
            result["departed"] = departed(server, key, LAYOUTS[a.robot], rate_wait_s=11.0)
            print(f"[bench hostile] {json.dumps(result['departed'])}", flush=True)
            good.stop()
        finally:
            server.stop()
    h, f, d = result["hostile"], result["flood"], result["departed"]
    result["targets"] = {
        "hostile_delay_below_chunk_period": all(
            x["good_client"]["slowest_s"] is not None and x["good_client"]["slowest_s"] < chunk_period_s
            and not x["good_client"]["errors"] for x in h.values()),
        "hostile_growth_below_100_mb": all(x["server_peak_growth_mb"] < 100 for x in h.values()),
        "flood_below_half_the_descriptor_limit": f["server_fds_max"] < f["server_fd_limit"] / 2,
        "flood_good_client_served": f["good_client"]["calls"] > 0 and not f["good_client"]["errors"],
        "departed_slot_free_within_1_s": d["slot_free_s"] < 1.0,
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
