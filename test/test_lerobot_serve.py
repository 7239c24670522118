"""The engine behind LeRobot's async-inference protocol (oxygen_ros/serve/lerobot/), over real gRPC.

`RobotClientReplay` makes the calls LeRobot 0.6.1's robot_client makes, in its order (Ready,
SendPolicyInstructions, SendObservations in 2 MB BEGIN/MIDDLE/END chunks, GetActions), with pickles written
by the package's encoder from LeRobot's documented classes, and reads the replies as the client does
(its classes by LeRobot's names; `.device.type`, `.item()`). Served: a small random pi0.5 with the so101
robot config's policy I/O. Hostile payloads must come back as a gRPC error saying why while another client
is served; two clients at once; a client that vanishes frees its robot.
"""
from __future__ import annotations

import collections
import io
import os
import pickle
import threading
import time
import warnings
from contextlib import contextmanager

import grpc
import numpy as np
import pytest
import torch

from conftest import small_config
from oxygen_ros.engine.engine import EngineConfig
from oxygen_ros.engine.factory import build_engine, build_model
from oxygen_ros.model.config import VisionConfig
from oxygen_ros.robot.configs import find_config, node_params
from oxygen_ros.robot.policy_io import RobotIOConfig
from oxygen_ros.serve.layouts import LEROBOT_LAYOUTS, SO101_JOINTS
from oxygen_ros.serve.lerobot import services_pb2 as pb
from oxygen_ros.serve.lerobot import services_pb2_grpc
from oxygen_ros.serve.lerobot.server import SERVED_BY_KEY, LeRobotOptions, LeRobotServer
from oxygen_ros.serve.lerobot.wire import (LEROBOT_MODULE, RemotePolicyConfig, TimedAction, TimedObservation,
                                           encode)

CHUNK_SIZE = 2 * 1024 * 1024            # LeRobot's transport/utils.py
HORIZON = 50                            # config/so101.yaml
CAMERA = (48, 64, 3)


def so101_engine():
    p = node_params(find_config("so101"), "oxygen_engine")
    cfg = small_config(action_dim=32, action_horizon=p["action_horizon"], max_token_len=64,
                       vision=VisionConfig(width=32, depth=1, mlp_dim=64, num_heads=2, image_size=56))
    return build_engine(built_model=build_model(cfg, seed=5), robot_io=RobotIOConfig.from_params(p),
                        state_in_prompt=p["state_in_prompt"], kv_budget_mb=16.0, engine=EngineConfig())


@contextmanager
def served(**options):
    engine = so101_engine()
    template = engine.preparer
    engine.remove_robot("")
    server = LeRobotServer(engine, LEROBOT_LAYOUTS["so101"], LeRobotOptions(port=0, **options), template,
                           served_by="test weights")
    engine.start()
    server.start()
    try:
        yield server
    finally:
        server.stop()
        engine.stop()


# ---------------------------------------------------------------------------------- the client's side
def lerobot_features(joints=SO101_JOINTS, cameras=("front", "wrist"), shape=CAMERA) -> dict:
    """LeRobot's hw_to_dataset_features(robot.observation_features, "observation", use_video=False)."""
    out = {"observation.state": {"dtype": "float32", "shape": (len(joints),), "names": list(joints)}}
    for cam in cameras:
        out[f"observation.images.{cam}"] = {"dtype": "image", "shape": shape, "names": ["height", "width", "channels"],
                                            "info": {"is_depth_map": False}}
    return out


def chunks(data: bytes):
    """LeRobot's send_bytes_in_chunks: BEGIN, MIDDLE..., END; a payload within one chunk is a lone END."""
    sent = 0
    while sent < len(data):
        state = pb.TRANSFER_MIDDLE
        if sent + CHUNK_SIZE >= len(data):
            state = pb.TRANSFER_END
        elif sent == 0:
            state = pb.TRANSFER_BEGIN
        yield pb.Observation(transfer_state=state, data=data[sent:sent + CHUNK_SIZE])
        sent += CHUNK_SIZE


class _ClientUnpickler(pickle.Unpickler):
    """What the robot_client's pickle.loads finds: LeRobot's classes under their module name."""

    def find_class(self, module, name):
        if module == LEROBOT_MODULE:
            return {"TimedAction": TimedAction}[name]
        return super().find_class(module, name)


class RobotClientReplay:
    def __init__(self, port: int):
        self.channel = grpc.insecure_channel(f"127.0.0.1:{port}", options=[
            ("grpc.max_receive_message_length", 4 << 20), ("grpc.max_send_message_length", 4 << 20),
            # A connection of its own, as each robot_client process has (channels of one process to one
            # address share one by default, and the server tells clients apart by their connection).
            ("grpc.use_local_subchannel_pool", 1)])
        self.stub = services_pb2_grpc.AsyncInferenceStub(self.channel)

    def start(self, actions_per_chunk=10, policy_type="pi05", features=None, rename_map=None):
        self.stub.Ready(pb.Empty())
        config = RemotePolicyConfig(policy_type, "user/pi05_so101", features or lerobot_features(),
                                    actions_per_chunk, "cuda")
        if rename_map is not None:
            config.rename_map = rename_map
        _, call = self.stub.SendPolicyInstructions.with_call(pb.PolicySetup(data=encode(config)))
        return dict(call.trailing_metadata())

    def send(self, obs: TimedObservation | bytes) -> None:
        self.stub.SendObservations(chunks(obs if isinstance(obs, bytes) else encode(obs)))

    def get_actions(self) -> list | None:
        reply = self.stub.GetActions(pb.Empty())
        if not reply.data:
            return None
        return _ClientUnpickler(io.BytesIO(reply.data)).load()

    def first_chunk(self, timeout=60.0) -> list:
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            actions = self.get_actions()
            if actions:
                return actions
        raise AssertionError("no chunk")

    def close(self):
        self.channel.close()


def observation(rng, timestep=0, timestamp=None, must_go=True, camera=CAMERA, task="pick up the cube", **extra):
    raw = {joint: float(rng.uniform(-90, 90)) for joint in SO101_JOINTS}
    raw["gripper.pos"] = float(rng.uniform(0, 100))
    raw["front"] = rng.integers(0, 256, camera, dtype=np.uint8)
    raw["wrist"] = rng.integers(0, 256, camera, dtype=np.uint8)
    raw["task"] = task
    raw.update(extra)
    return TimedObservation(timestamp=time.time() if timestamp is None else timestamp, timestep=timestep,
                            observation=raw, must_go=must_go)


def status_of(fn) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return e.value.code(), e.value.details()


# ---------------------------------------------------------------------------------- the call sequence
def test_robot_client_call_sequence_gets_timed_actions():
    rng = np.random.default_rng(0)
    with served() as server:
        client = RobotClientReplay(server.port)
        meta = client.start(actions_per_chunk=12)
        assert "user/pi05_so101" in meta[SERVED_BY_KEY] and "test weights" in meta[SERVED_BY_KEY]
        (robot,) = server.clients.values()
        assert robot in server.engine.robots
        assert client.get_actions() is None                 # nothing sent yet: an empty reply after the wait
        obs = observation(rng, timestep=37, timestamp=1000.25)
        client.send(obs)
        actions = client.first_chunk()
        assert len(actions) == 12
        assert [a.timestep for a in actions] == list(range(37, 49))
        np.testing.assert_allclose([a.timestamp for a in actions], 1000.25 + np.arange(12) / 30.0, rtol=0, atol=1e-9)
        for a in actions:
            assert isinstance(a.action, torch.Tensor) and a.action.device.type == "cpu"
            assert a.action.dtype == torch.float32 and a.action.shape == (6,)
            assert a.action.untyped_storage().nbytes() == 6 * 4          # its own row, not a view of the chunk
            a.action[0].item()
        chunk = server.engine.latest_chunk(robot)
        np.testing.assert_allclose(torch.stack([a.action for a in actions]).numpy(),
                                   chunk.plan.actions[:12].astype(np.float32), rtol=0, atol=0)
        assert client.get_actions() is None                 # a chunk is fetched once
        summary = server.served_summary()
        assert summary["chunks"] == summary["sessions"] == 1 and 0 < summary["latency_ms"]["max"] < 60e3
        client.close()


def test_a_large_observation_arrives_in_2mb_chunks():
    rng = np.random.default_rng(1)
    with served() as server:
        client = RobotClientReplay(server.port)
        client.start(actions_per_chunk=5, features=lerobot_features(shape=(720, 1280, 3)))
        obs = observation(rng, timestep=3, camera=(720, 1280, 3))
        assert [m.transfer_state for m in chunks(encode(obs))] == [pb.TRANSFER_BEGIN, pb.TRANSFER_MIDDLE,
                                                                   pb.TRANSFER_END]
        client.send(obs)
        assert [a.timestep for a in client.first_chunk()] == [3, 4, 5, 6, 7]
        client.close()


def test_policy_instructions_are_validated():
    with served() as server:
        client = RobotClientReplay(server.port)
        code, text = status_of(lambda: client.stub.SendPolicyInstructions(pb.PolicySetup(data=b"")))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "Ready" in text
        code, text = status_of(lambda: client.start(policy_type="act"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and "pi05" in text
        joints = [j for j in SO101_JOINTS if j != "wrist_roll.pos"] + ["elbow_roll.pos"]
        code, text = status_of(lambda: client.start(features=lerobot_features(joints=joints,
                                                                              cameras=("front", "top"))))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "missing joints ['wrist_roll.pos']" in text and "extra joints ['elbow_roll.pos']" in text
        assert "extra cameras ['top']" in text
        code, text = status_of(lambda: client.start(actions_per_chunk=HORIZON + 1))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and f"1..{HORIZON}" in text
        # A renamed camera maps by its new name (LeRobot's rename_map).
        client.start(features=lerobot_features(cameras=("front", "top")),
                     rename_map={"observation.images.top": "observation.images.wrist"})
        client.close()


# ---------------------------------------------------------------------------------- hostile payloads
class _System:
    def __init__(self, command):
        self.command = command

    def __reduce__(self):
        return os.system, (self.command,)


class _AllowedNames:
    """A pickle naming only allowed globals, with arguments that would allocate if trusted."""

    def __init__(self, fn, args, state=None):
        self.fn, self.args, self.state = fn, args, state

    def __reduce__(self):
        return (self.fn, self.args) if self.state is None else (self.fn, self.args, self.state)


def _with(rng, value) -> bytes:
    return encode(observation(rng, bad=value))


def _nested(depth):
    value = 1.0
    for _ in range(depth):
        value = [value]
    return value


def _storage(values: torch.Tensor):
    """A tensor's storage, which pickles as torch.storage._load_from_bytes (TypedStorage: torch warns about it
    once per process, so the warning is neither expected nor shown)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        return values.storage()


def hostile_payloads(rng, marker):
    reconstruct = np._core.multiarray._reconstruct
    one = _storage(torch.ones(1))
    # Issue 40 item 1: calls of allowed functions on ONE memoised argument tuple, each building it again.
    buffer_args = (bytes(1 << 20), np.dtype("u1"), (1 << 20,), "C")
    tensor_args = (_storage(torch.zeros(1 << 18)), 0, (1 << 18,), (1,), False, collections.OrderedDict())
    return {
        "os.system": (pickle.dumps(_System(f"touch {marker}")), "INVALID_ARGUMENT", "refused global"),
        "os.system inside": (_with(rng, _System(f"touch {marker}")), "INVALID_ARGUMENT", "refused global"),
        "numpy shape bomb": (_with(rng, _AllowedNames(reconstruct, (np.ndarray, (10**10,), b"b"))),
                             "INVALID_ARGUMENT", "only plain arrays"),
        "numpy state bomb": (_with(rng, _AllowedNames(reconstruct, (np.ndarray, (0,), b"b"),
                                                      (1, (10**9,), np.dtype("u1"), False, b""))),
                             "INVALID_ARGUMENT", "needs 1000000000 bytes, carries 0"),
        "tensor stride bomb": (_with(rng, _AllowedNames(torch._utils._rebuild_tensor_v2,
                                                        (one, 0, (10**10,), (0,),
                                                         False, collections.OrderedDict()))),
                               "INVALID_ARGUMENT", "does not lie inside its storage"),
        "object array": (_with(rng, np.array([1, "a"], dtype=object)), "INVALID_ARGUMENT", "refused"),
        "deep nesting": (_with(rng, _nested(40)), "RESOURCE_EXHAUSTED", "nested deeper"),
        "4 GB declared length": (b"\x80\x04\x8e" + (4 << 30).to_bytes(8, "little") + b"abc.", "INVALID_ARGUMENT",
                                 "4294967296"),
        "memo index bomb": (b"\x80\x04Nr" + (1 << 31).to_bytes(4, "little") + b".", "INVALID_ARGUMENT",
                            "memo index"),
        "persistent id": (b"\x80\x04\x8c\x01xQ.", "INVALID_ARGUMENT", "persistent ids"),
        "not a pickle": (b"\xff\xfe", "INVALID_ARGUMENT", "malformed"),
        "wrong class": (encode(RemotePolicyConfig("pi05", "x", {}, 1)), "INVALID_ARGUMENT", "RemotePolicyConfig"),
        "over the byte cap": (encode(observation(rng, camera=(1024, 1024, 3))), "RESOURCE_EXHAUSTED", "bytes"),
        # The client declared two 48x64 cameras: what its observation may build is their size and some slack.
        "memo reuse: 2,000 frombuffer of 1 MiB": (
            _with(rng, [_AllowedNames(np._core.numeric._frombuffer, buffer_args) for _ in range(2000)]),
            "RESOURCE_EXHAUSTED", "would build more than"),
        "memo reuse: 500 tensors of 1 MiB": (
            _with(rng, [_AllowedNames(torch._utils._rebuild_tensor_v2, tensor_args) for _ in range(500)]),
            "RESOURCE_EXHAUSTED", "would build more than"),
        "OrderedDict with a replaced items": (
            _with(rng, _AllowedNames(collections.OrderedDict, (), {"items": 1})), "INVALID_ARGUMENT",
            "OrderedDict with a state"),
        "a 400-digit timestamp": (encode(observation(rng, timestamp=10**400)), "INVALID_ARGUMENT",
                                  "timestamp must be a finite number"),
    }


@contextmanager
def honest_client(server):
    """A LeRobot client sending observations and fetching chunks in a loop on its own connection; yields the
    timesteps of the chunks it got (after its first one)."""
    client = RobotClientReplay(server.port)
    client.start(actions_per_chunk=4)
    rng, stop, seen = np.random.default_rng(11), threading.Event(), []

    def drive():
        step = 0
        while not stop.is_set():
            client.send(observation(rng, timestep=step))
            actions = client.get_actions()
            if actions:
                seen.append(actions[0].timestep)
            step += 1
    thread = threading.Thread(target=drive)
    thread.start()
    try:
        assert _wait_for(lambda: seen, 60.0), "the honest client got no chunk"
        yield seen
    finally:
        stop.set()
        thread.join()
        client.close()


def test_hostile_payloads_get_an_error_status_while_another_client_is_served(tmp_path):
    rng = np.random.default_rng(2)
    marker = tmp_path / "pwned"
    with served(max_message_bytes=2 << 20) as server, honest_client(server) as chunks_seen:
        bad = RobotClientReplay(server.port)
        bad.start(actions_per_chunk=4)
        # Served before the hostile payloads start (on a quiet machine they all take less than a first chunk).
        for name, (payload, code, words) in hostile_payloads(np.random.default_rng(3), marker).items():
            got, text = status_of(lambda: bad.send(payload))
            assert (name, got.name) == (name, code), text
            assert words in text, (name, text)
        for name, messages in {"no END": [pb.Observation(transfer_state=pb.TRANSFER_BEGIN, data=b"x")],
                               "unknown state": [pb.Observation(transfer_state=pb.TRANSFER_UNKNOWN, data=b"x")]
                               }.items():
            got, text = status_of(lambda: bad.stub.SendObservations(iter(messages)))
            assert got == grpc.StatusCode.INVALID_ARGUMENT, (name, text)
        n = len(chunks_seen)
        assert _wait_for(lambda: len(chunks_seen) > n, 30.0), "the other client was not served after the payloads"
        assert not marker.exists()
        bad.send(observation(rng, timestep=9))                 # and the hostile one's session still works
        assert bad.first_chunk()[0].timestep == 9
        bad.close()


# ---------------------------------------------------------------------------------- several clients, leaving
def test_two_clients_at_once_each_with_its_own_chunk_length():
    rng = np.random.default_rng(4)
    with served() as server:
        a, b = RobotClientReplay(server.port), RobotClientReplay(server.port)
        a.start(actions_per_chunk=5)
        b.start(actions_per_chunk=17)
        assert len(set(server.clients.values())) == 2
        assert set(server.clients.values()) <= set(server.engine.robots)
        a.send(observation(rng, timestep=100))
        b.send(observation(rng, timestep=200))
        got = {}
        threads = [threading.Thread(target=lambda c=c, k=k: got.__setitem__(k, c.first_chunk()))
                   for k, c in (("a", a), ("b", b))]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert [x.timestep for x in got["a"]] == list(range(100, 105))
        assert [x.timestep for x in got["b"]] == list(range(200, 217))
        a.close()
        b.close()


def _wait_for(predicate, timeout=10.0) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def test_a_client_that_disconnects_mid_stream_frees_its_robot():
    rng = np.random.default_rng(5)
    with served() as server:
        client = RobotClientReplay(server.port)
        client.start()
        (robot,) = server.clients.values()
        data = encode(observation(rng, camera=(720, 1280, 3)))
        first_sent = threading.Event()

        def stalled():
            yield pb.Observation(transfer_state=pb.TRANSFER_BEGIN, data=data[:CHUNK_SIZE])
            first_sent.set()
            time.sleep(30)          # never finishes: the channel closes under it

        future = client.stub.SendObservations.future(stalled())
        assert first_sent.wait(10)
        client.close()
        assert _wait_for(lambda: robot not in server.engine.robots), "its robot is still served"
        assert server.clients == {}
        future.cancel()


def test_a_silent_client_is_freed_after_the_idle_timeout():
    with served(idle_timeout_s=2.5, actions_wait_s=0.5) as server:
        client = RobotClientReplay(server.port)
        client.start()
        (robot,) = server.clients.values()
        time.sleep(1.0)
        assert robot in server.engine.robots
        assert _wait_for(lambda: robot not in server.engine.robots, timeout=10.0)
        code, text = status_of(lambda: client.send(observation(np.random.default_rng(6))))
        assert code == grpc.StatusCode.FAILED_PRECONDITION and "Ready" in text
        client.close()


# ---------------------------------------------------------------------------------- oxygen_bringup --lerobot-port
DEMO_JOINTS = ("joint_1.pos", "joint_2.pos", "joint_3.pos")


def test_bringup_serves_lerobot_clients_next_to_the_ros_robot():
    """`oxygen_bringup --demo --lerobot-port 0`: a LeRobot client on the demo engine beside the simulated ROS
    robot: Ready, policy instructions, an observation, its timed actions; the status line counts it."""
    import os
    import signal
    import subprocess
    import sys

    from ros_harness import private_domain         # a domain of this test process: no other bringup on it

    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", ROS_DOMAIN_ID=str(private_domain(41)))
    proc = subprocess.Popen([sys.executable, "-m", "oxygen_ros.bringup", "--demo", "--lerobot-port", "0",
                             "--duration", "120"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip() for line in proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 150
        while not any(line.startswith("[status] actions") for line in lines):   # the ROS robot is served
            assert proc.poll() is None and time.monotonic() < deadline, "\n".join(lines[-30:])
            time.sleep(0.1)
        (line,) = [line for line in lines if "LeRobot clients on " in line]
        client = RobotClientReplay(int(line.split("LeRobot clients on ")[1].split(" ")[0].rsplit(":", 1)[1]))
        client.start(actions_per_chunk=8, features=lerobot_features(joints=DEMO_JOINTS, cameras=("base",),
                                                                    shape=(64, 64, 3)))
        rng = np.random.default_rng(9)
        raw = {joint: float(rng.uniform(-0.5, 0.5)) for joint in DEMO_JOINTS}
        raw |= {"base": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8), "task": "touch the red cube"}
        client.send(TimedObservation(timestamp=50.0, timestep=7, observation=raw, must_go=True))
        actions = client.first_chunk()
        assert [a.timestep for a in actions] == list(range(7, 15))
        assert all(a.action.shape == (3,) and a.action.dtype == torch.float32 for a in actions)
        while not any("LeRobot clients 1/8" in line for line in lines if line.startswith("[status]")):
            assert time.monotonic() < deadline, "\n".join(lines[-30:])
            time.sleep(0.1)
        client.close()
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, "\n".join(lines[-30:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_bringup_refuses_a_lerobot_port_in_use_before_the_model_loads():
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = subprocess.run([sys.executable, "-m", "oxygen_ros.bringup", "--demo", "--duration", "1", "--lerobot-port",
                            str(port)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        f"oxygen_bringup: refusing to start: --lerobot-port: port {port} on 127.0.0.1 is in use (another program "
        "listens there): give another port or stop that program"]
    r = subprocess.run([sys.executable, "-m", "oxygen_ros.bringup", "--robot", "libero", "--lerobot-port", "0"],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "--lerobot-port needs --robot with a LeRobot mapping (demo, so101)" in r.stderr
