"""The engine over openpi's websocket policy protocol (oxygen_ros/serve), driven by the real client:
openpi-client 0.1.2's WebsocketClientPolicy (installed without its numpy<2 pin, see requirements-nodeps.txt).

Each test serves a small random π0.5 with a robot config's policy I/O (config/<robot>.yaml): metadata,
shapes per config, the openpi-exact policy I/O through the socket (oracle case_e), two clients' frames in
one engine cycle, the API key, hostile messages while another client is served, language on the socket,
and a disconnecting client's slot and requests. One test starts `oxygen_serve` itself.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import msgpack
import numpy as np
import pytest
import torch
import websockets
import websockets.sync.client
from openpi_client import msgpack_numpy
from openpi_client.websocket_client_policy import WebsocketClientPolicy

from conftest import ORACLE, small_config
from oxygen_ros.engine.engine import EngineConfig
from oxygen_ros.engine.factory import build_engine, build_model
from oxygen_ros.model.config import VisionConfig
from oxygen_ros.robot.configs import find_config, node_params
from oxygen_ros.robot.policy_io import RobotIOConfig
from oxygen_ros.serve.layouts import LAYOUTS
from oxygen_ros.serve.server import ServeOptions, openpi_server

CASE_E = ORACLE / "case_e"
# openpi-client 0.1.2 connects without a context manager, which websockets 17 deprecates (it still works).
pytestmark = pytest.mark.filterwarnings("ignore:connect\\(\\) must be used as a context manager")


def base_engine(robot: str, norm_stats=None, image_size: int = 56, **engine_cfg):
    """A small random model with the robot config's horizon and policy I/O, as the engine node builds it."""
    p = node_params(find_config(robot), "oxygen_engine")
    cfg = small_config(action_dim=32, action_horizon=p["action_horizon"], max_token_len=64,
                       vision=VisionConfig(width=32, depth=1, mlp_dim=64, num_heads=2, image_size=image_size))
    return build_engine(built_model=build_model(cfg, seed=5), robot_io=RobotIOConfig.from_params(p),
                        norm_stats=norm_stats, state_in_prompt=p["state_in_prompt"], kv_budget_mb=16.0,
                        engine=EngineConfig(**engine_cfg))


@contextmanager
def served(robot: str, *, run_engine: bool = True, base=None, **options):
    """As oxygen_serve does: the engine built for the robot config, its robot "" the clients' template."""
    engine = base or base_engine(robot)
    template = engine.preparer
    engine.remove_robot("")
    server = openpi_server(engine, LAYOUTS[robot], ServeOptions(port=0, **options), template)
    if run_engine:
        server.engine.start()
    server.start()
    try:
        yield server
    finally:
        server.stop()
        server.engine.stop()


def client(server, **kw) -> WebsocketClientPolicy:
    return WebsocketClientPolicy("127.0.0.1", server.port, **kw)


def droid_obs(rng, size=(48, 64), prompt="put the marker in the cup") -> dict:
    return {"observation/exterior_image_1_left": rng.integers(0, 256, (*size, 3), dtype=np.uint8),
            "observation/wrist_image_left": rng.integers(0, 256, (*size, 3), dtype=np.uint8),
            "observation/joint_position": rng.uniform(-1, 1, 7),
            "observation/gripper_position": rng.uniform(0, 1, 1), "prompt": prompt}


def aloha_obs(rng, chw=True, wrists=("cam_left_wrist", "cam_right_wrist")) -> dict:
    shape = (3, 40, 56) if chw else (40, 56, 3)
    cams = ("cam_high", "cam_low") + tuple(wrists)
    state = rng.uniform(-0.5, 0.5, 14)
    state[[6, 13]] = rng.uniform(0.1, 0.9, 2)          # ALOHA's normalised gripper positions
    return {"images": {c: rng.integers(0, 256, shape, dtype=np.uint8) for c in cams}, "state": state,
            "prompt": "fold the towel"}


def libero_obs(rng) -> dict:
    return {"observation/image": rng.integers(0, 256, (56, 56, 3), dtype=np.uint8),
            "observation/wrist_image": rng.random((56, 56, 3), dtype=np.float32),     # float in [0, 1]: openpi scales
            "observation/state": rng.uniform(-1, 1, 8), "prompt": "put the bowl on the plate"}


# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("robot,make,shape", [
    ("droid", droid_obs, (15, 8)),
    ("aloha", lambda rng: aloha_obs(rng, chw=True), (50, 14)),
    ("libero", libero_obs, (10, 7)),
])
def test_metadata_and_action_shapes_per_config(robot, make, shape):
    rng = np.random.default_rng(0)
    with served(robot) as server:
        policy = client(server)
        meta = policy.get_server_metadata()
        assert (meta["server"], meta["robot"], meta["action_horizon"], meta["action_dim"]) == ("oxygen_ros", robot,
                                                                                              *shape)
        assert set(meta["observation"]["images"]) == {c.key for c in LAYOUTS[robot].cameras}
        out = policy.infer(make(rng))
        assert out["actions"].shape == shape and np.all(np.isfinite(out["actions"]))
        assert out["server_timing"]["infer_ms"] > 0 and out["policy_timing"]["infer_ms"] > 0
        again = policy.infer(make(rng))
        assert "prev_total_ms" in again["server_timing"]            # openpi's server reports the previous total
        assert again["policy_timing"]["frame_index"] > out["policy_timing"]["frame_index"]
        if robot == "aloha":
            hwc = policy.infer(aloha_obs(rng, chw=False, wrists=("cam_left_wrist",)))   # HWC, right wrist absent
            assert hwc["actions"].shape == shape


def test_aloha_chw_and_hwc_images_are_the_same_observation():
    """ALOHA clients send CHW (openpi's AlohaInputs transposes); HWC is accepted too and means the same."""
    rng = np.random.default_rng(1)
    chw = aloha_obs(rng)
    hwc = {**chw, "images": {k: np.moveaxis(v, 0, -1) for k, v in chw["images"].items()}}
    a, b = (LAYOUTS["aloha"].observation(m, 1.0) for m in (chw, hwc))
    for slot in ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb"):
        np.testing.assert_array_equal(a.images[slot], b.images[slot])
        assert a.images[slot].shape == (40, 56, 3)
    with pytest.raises(ValueError, match=r"images has unknown cameras \['cam_top'\]"):
        LAYOUTS["aloha"].observation({**chw, "images": {**chw["images"], "cam_top": chw["images"]["cam_high"]}}, 1.0)


def test_policy_io_through_the_socket_is_openpi_exact_on_case_e():
    """oracle case_e (openpi's own arithmetic, DROID layout) sent as openpi's DROID keys: the images and the
    normalised state the network receives, and the robot actions that come back, match openpi. The model's
    output is pinned to the case's: the action expert's output projection is zeroed (velocity 0, so the
    chunk is the noise) and the frame's noise is the case's model_actions."""
    inputs = dict(np.load(CASE_E / "inputs.npz"))
    expected = dict(np.load(CASE_E / "expected.npz"))
    base = base_engine("droid", norm_stats=str(CASE_E / "norm_stats.json"), image_size=224)
    torch.nn.init.zeros_(base.runner.model.action_out_proj.weight)
    torch.nn.init.zeros_(base.runner.model.action_out_proj.bias)
    seen = []
    with served("droid", base=base, run_engine=False) as server:
        engine = server.engine
        engine.frame_noise = lambda index: torch.as_tensor(inputs["model_actions"])
        engine.add_frame_listener(lambda index, obs: seen.append(obs))
        engine.start()
        state = inputs["state"]
        policy = client(server)
        out = policy.infer({
            "observation/exterior_image_1_left": inputs["image_base_0_rgb"],
            "observation/wrist_image_left": inputs["image_left_wrist_0_rgb"],
            "observation/joint_position": state[:7], "observation/gripper_position": state[7:],
            "prompt": "put the marker in the cup"})
        np.testing.assert_allclose(out["actions"], expected["robot_actions"], atol=1e-4, rtol=0)
        # What the network received for that frame (the client's own preparer, as the engine ran it).
        (obs,) = seen
        prepared = engine.preparers["openpi_0"].prepare(obs)
    images = prepared.row.images.permute(0, 2, 3, 1).numpy()          # [cameras, 224, 224, 3] in [-1, 1]
    for i, slot in enumerate(("base_0_rgb", "left_wrist_0_rgb")):
        diff = np.abs(images[i] - expected[f"image_{slot}"])
        assert diff.max() <= 2 / 255 + 1e-6 and diff.mean() <= 1e-3, (slot, diff.max(), diff.mean())
    np.testing.assert_allclose(prepared.model_state, expected["state_normalized"], atol=1e-4, rtol=0)


def test_two_clients_frames_are_prefilled_and_denoised_in_one_cycle():
    """The engine is stepped by hand: both clients' observations wait, one cycle computes both, and each
    client gets the chunk of its own observation (the engine reports 2 frames in that cycle)."""
    rng = np.random.default_rng(2)
    with served("droid", run_engine=False) as server:
        engine = server.engine
        policies = [client(server) for _ in range(2)]
        sent = [droid_obs(rng, prompt=p) for p in ("open the drawer", "close the drawer")]
        results = [None, None]

        def ask(i):
            results[i] = policies[i].infer(sent[i])

        threads = [threading.Thread(target=ask, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        deadline = time.monotonic() + 10
        while len(server.hub.in_flight()) < 2:
            assert time.monotonic() < deadline, "the observations did not reach the engine"
            time.sleep(0.01)
        report = engine.run_frames()
        for t in threads:
            t.join(10)
        assert report.robots == ["openpi_0", "openpi_1"]
        assert report.chunks == 2
        assert [r["policy_timing"]["cycle_frames"] for r in results] == [2, 2]
        # Each reply is the chunk of that client's own frame.
        by_robot = {c.robot: c for c in [engine.latest_chunk("openpi_0"), engine.latest_chunk("openpi_1")]}
        for r in results:
            frame = r["policy_timing"]["frame_index"]
            match = [c for c in by_robot.values() if c.plan.frame_index == frame]
            assert len(match) == 1
            np.testing.assert_array_equal(r["actions"], match[0].plan.actions)
        assert results[0]["policy_timing"]["frame_index"] != results[1]["policy_timing"]["frame_index"]


def test_api_key_is_required_and_accepted(tmp_path):
    """openpi's client shows a close reason, not an HTTP body: a missing or wrong key opens the websocket and
    closes it with 1008 and the explanation; a plain HTTP request gets 401 with it."""
    rng = np.random.default_rng(3)
    with served("libero", api_key="s3cret-key") as server:
        for kw in ({}, {"api_key": "wrong"}):
            with pytest.raises(websockets.ConnectionClosedError, match=r"1008 .*missing or wrong API key: "
                                                                       r"WebsocketClientPolicy\(.*api_key="):
                client(server, **kw)
        assert client(server, api_key="s3cret-key").infer(libero_obs(rng))["actions"].shape == (10, 7)
        with pytest.raises(urllib.error.HTTPError, match="401") as refused:
            urllib.request.urlopen(f"http://127.0.0.1:{server.port}/", timeout=5)
        assert b"missing or wrong API key" in refused.value.read()
        with urllib.request.urlopen(f"http://127.0.0.1:{server.port}/healthz", timeout=5) as r:
            assert r.status == 200                                  # the health check needs no key


def test_hostile_messages_get_clear_errors_while_another_client_is_served():
    rng = np.random.default_rng(4)
    with served("droid") as server:
        hostile, good = client(server), client(server)

        def still_served():
            assert good.infer(droid_obs(rng))["actions"].shape == (15, 8)

        def error_for(raw) -> str:
            hostile._ws.send(raw)
            reply = hostile._ws.recv(timeout=30)
            assert isinstance(reply, str), "an error is a text frame"
            return reply

        # A client that sent an observation and never reads, and one that stalls in the middle of a message.
        stalled = websockets.sync.client.connect(f"ws://127.0.0.1:{server.port}", max_size=None)
        stalled.send(msgpack_numpy.packb(droid_obs(rng)))
        half = socket.create_connection(("127.0.0.1", server.port))
        half.sendall(b"GET / HTTP/1.1\r\nHost: x\r\nUpgrade: websocket\r\nConnection: Upgrade\r\n"
                     b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
                     b"\x82\xfe\x10\x00" + b"\x00" * 4 + b"\x00" * 100)     # a masked 4 KB frame, 100 bytes of it
        deadline = time.monotonic() + 5
        while server.slots.in_use != 4:                             # both are connected clients, waiting
            assert time.monotonic() < deadline
            time.sleep(0.01)
        still_served()
        assert "not a msgpack message" in error_for(b"\xc1\x00garbage")
        assert "expected a binary msgpack message" in error_for("a text frame")
        assert "expected a msgpack map" in error_for(msgpack_numpy.packb([1, 2, 3]))
        # Refused from the headers, before msgpack builds anything: too many objects, too deep, extension types.
        assert "more than 4096 msgpack objects" in error_for(msgpack.packb({"a": [0] * 5000}))
        assert "nested deeper than 16 maps or arrays" in error_for(b"\x81\xa1a" + b"\x91" * 20 + b"\x90")
        assert "msgpack extension type" in error_for(msgpack.packb({"a": msgpack.ExtType(1, b"x")}))
        still_served()
        wrong_shape = {**droid_obs(rng), "observation/joint_position": np.zeros((2, 7))}
        with pytest.raises(RuntimeError, match=r"observation/joint_position must have shape \[7\], got \[2, 7\]"):
            hostile.infer(wrong_shape)
        with pytest.raises(RuntimeError, match=r"observation/wrist_image_left must be an RGB image"):
            hostile.infer({**droid_obs(rng), "observation/wrist_image_left": np.zeros((5, 5), np.uint8)})
        nan_state = {**droid_obs(rng), "observation/gripper_position": np.array([np.nan])}
        with pytest.raises(RuntimeError, match=r"observation/gripper_position has non-finite values at \[0\]"):
            hostile.infer(nan_state)
        packed = msgpack.packb({"observation/joint_position": {b"__ndarray__": True, b"data": b"\x00" * 8,
                                                               b"dtype": "<f8", b"shape": [7]}})
        assert "needs 56 bytes, the message has 8" in error_for(packed)
        packed = msgpack.packb({"observation/joint_position": {b"__ndarray__": True, b"data": b"\x00" * 8,
                                                               b"dtype": "|O", b"shape": [1]}})
        assert "not a plain numeric or boolean dtype" in error_for(packed)
        assert hostile.infer(droid_obs(rng))["actions"].shape == (15, 8)     # still usable after all that
        still_served()
        # 100 MB: the connection is closed (1009) without reading it; the other client is served throughout.
        with pytest.raises(websockets.ConnectionClosedError, match="1009"):
            hostile._ws.send(b"\x00" * (100 << 20))
            hostile._ws.recv(timeout=30)
        still_served()
        stalled.close()
        half.close()
        deadline = time.monotonic() + 5
        while server.slots.in_use != 1:
            assert time.monotonic() < deadline
            time.sleep(0.01)


def test_a_frame_the_engine_discards_is_an_error_not_a_wait():
    """Non-finite actions (here: a NaN in the action expert's output layer) make the engine discard the frame:
    the client gets the engine's reason at once, not a reply after the timeout."""
    base = base_engine("libero")
    torch.nn.init.constant_(base.runner.model.action_out_proj.bias, float("nan"))
    with served("libero", base=base) as server:
        policy = client(server)
        t = time.monotonic()
        with pytest.raises(RuntimeError, match="FrameFailed: the engine discarded this frame: .*non-finite actions"):
            policy.infer(libero_obs(np.random.default_rng(9)))
        assert time.monotonic() - t < server.options.reply_timeout_s / 2


def test_language_on_the_socket():
    rng = np.random.default_rng(5)
    with served("droid") as server:
        policy = client(server)
        with pytest.raises(RuntimeError, match="no observation from this client yet"):
            policy.infer({"question": "What is on the table?", "max_tokens": 4})
        first = policy.infer(droid_obs(rng))
        reply = policy.infer({"question": "What is on the table?", "max_tokens": 5})
        assert set(reply) >= {"text", "finish_reason", "frame_index", "tokens"}
        assert isinstance(reply["text"], str) and reply["finish_reason"] in ("length", "eos", "stop")
        # About the newest observation: a frame computed from it again.
        assert 1 <= reply["tokens"] <= 5 and reply["frame_index"] >= first["policy_timing"]["frame_index"]
        both = policy.infer({**droid_obs(rng), "question": "Where is the cup?", "max_tokens": 3})
        assert both["actions"].shape == (15, 8)
        assert both["frame_index"] == both["policy_timing"]["frame_index"]    # one frame served both tasks
        with pytest.raises(RuntimeError, match=r"max_tokens must be in 1\.\.256"):
            policy.infer({"question": "hi", "max_tokens": 100000})
        with pytest.raises(RuntimeError, match="a question takes the keys"):
            policy.infer({"question": "hi", "max_token": 3})
        assert policy.infer(droid_obs(rng))["actions"].shape == (15, 8)


@pytest.mark.parametrize("cycle_after", ["question", "observation"])
def test_a_question_is_answered_about_the_frame_it_came_with(cycle_after):
    """An engine cycle runs right after the server hands the engine the question (or the observation it came
    with), before the other arrives; the engine is stepped by hand, its clock moved past a camera interval so
    that the previous frame may be re-used for a waiting question. The reply is about the observation the
    question came with, never the one before."""
    rng = np.random.default_rng(8)
    with served("droid", run_engine=False) as server:
        engine, cycles, offset = server.engine, threading.Lock(), [0.0]
        engine.clock = lambda: time.monotonic() + offset[0]

        def cycle():
            with cycles:
                engine.run_cycle()

        def stepped(fn, *args):
            with ThreadPoolExecutor(1) as pool:
                result = pool.submit(fn, *args)
                deadline = time.monotonic() + 60
                while not result.done():
                    assert time.monotonic() < deadline, "no reply"
                    cycle()
                    time.sleep(0.01)
                return result.result()

        policy = client(server)
        first = stepped(policy.infer, droid_obs(rng))["policy_timing"]["frame_index"]
        offset[0] += 10.0                           # the first frame is now re-usable for a waiting question
        name = "submit" if cycle_after == "question" else "submit_observation"
        hand_over = getattr(engine, name)
        setattr(engine, name, lambda *a, **kw: (hand_over(*a, **kw), cycle())[0])
        both = stepped(policy.infer, {**droid_obs(rng), "question": "Where is the cup?", "max_tokens": 3})
        assert both["policy_timing"]["frame_index"] > first
        assert both["frame_index"] == both["policy_timing"]["frame_index"]


def test_a_client_that_goes_frees_its_slot_and_ends_its_requests():
    """Capacity 1. The client's question and observation are in flight (the engine is stepped by hand) when
    it disconnects: its robot is removed from the engine (its request ends, its pending frame is dropped),
    its slot freed, and the next client is served."""
    rng = np.random.default_rng(6)
    with served("droid", run_engine=False, max_clients=1) as server:
        engine = server.engine
        handles = []
        submit = engine.submit
        engine.submit = lambda request: handles.append(submit(request)) or handles[-1]
        first = client(server)
        with pytest.raises(websockets.InvalidStatus, match="503"):
            client(server)                                          # full
        first._ws.send(msgpack_numpy.packb({**droid_obs(rng), "question": "What is there?", "max_tokens": 8}))
        deadline = time.monotonic() + 10
        while not server.hub.in_flight():
            assert time.monotonic() < deadline
            time.sleep(0.01)
        first._ws.close()
        while server.slots.in_use:
            assert time.monotonic() < deadline, "the slot was not freed"
            time.sleep(0.01)
        (handle,) = handles
        assert handle.done() and "client disconnected" in handle.result().error      # ended with the client
        assert not engine.active_requests and not engine.queued_requests
        assert engine.robots == () and not server.hub.in_flight()
        engine.start()
        assert client(server).infer(droid_obs(rng))["actions"].shape == (15, 8)


def test_oxygen_serve_command(tmp_path):
    """The console entry point as a user runs it: random weights said loudly, /healthz, an infer, Ctrl-C."""
    key = tmp_path / "key"
    key.write_text("k-123\n")
    key.chmod(0o600)
    out = subprocess.run([sys.executable, "-m", "oxygen_ros.serve", "--robot", "libero", "--random", "tiny",
                          "--api-key-file", str(key)], cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert out.returncode == 2 and "the token has 5 characters, at least 16" in out.stderr   # checked before the model
    key.write_text("k-123-long-enough-key\n")
    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "oxygen_ros.serve", "--robot", "libero", "--random", "tiny",
                             "--port", "0", "--api-key-file", str(key), "--max-clients", "2"],
                            cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines = []
    try:
        port = None
        deadline = time.monotonic() + 120
        while port is None:
            line = proc.stdout.readline()
            assert line or proc.poll() is None, "\n".join(lines)
            assert time.monotonic() < deadline, "\n".join(lines)
            lines.append(line.rstrip())
            if "listening on ws://" in line:
                port = int(line.rsplit(":", 1)[1])
        assert any("RANDOM WEIGHTS" in line for line in lines)
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/healthz", timeout=5) as r:
            assert r.read() == b"OK\n"
        policy = WebsocketClientPolicy("127.0.0.1", port, api_key="k-123-long-enough-key")
        assert policy.get_server_metadata()["max_clients"] == 2
        assert policy.infer(libero_obs(np.random.default_rng(7)))["actions"].shape == (10, 7)
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
        assert "oxygen_serve: stopped" in out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_oxygen_serve_refuses_bad_parameters(tmp_path):
    out = subprocess.run([sys.executable, "-m", "oxygen_ros.serve", "--robot", "droid", "--port", "0"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert "refusing to start" in out.stderr and "checkpoint not found: /opt/models/pi05_droid_pytorch" in out.stderr


def test_demo_episodes_through_openpi_runtime():
    """`python -m oxygen_ros.eval --openpi` on 4 episodes: oxygen_serve --robot demo (the shipped weights),
    openpi-client's Runtime + PolicyAgent + ActionChunkBroker, scene questions on the same socket. The
    in-process evaluation of these episodes touches 4/4 and answers 26/28; thresholds as test_demo_model's."""
    from oxygen_ros.serve.eval_openpi import evaluate_openpi

    out = evaluate_openpi(4, seed=1000, log=lambda *_: None)
    assert len(out["outcomes"]) == 4 and out["success_rate"] >= 0.75, out["outcomes"]
    assert out["answer_accuracy"] >= 0.85, out["wrong_answers"]
    assert out["chunks"] >= 4


def test_bringup_serves_openpi_clients_next_to_the_ros_robot():
    """`oxygen_bringup --demo --openpi-port 0`: a socket robot on the demo engine beside the simulated ROS robot:
    its frames are batched with the ROS robot's in one cycle, and the frame indices it gets are interleaved
    with the ROS robot's (one engine)."""
    from ros_harness import private_domain

    env = dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", ROS_DOMAIN_ID=str(private_domain(1)))
    proc = subprocess.Popen([sys.executable, "-m", "oxygen_ros.bringup", "--demo", "--openpi-port", "0",
                             "--duration", "90"], env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip() for line in proc.stdout), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        # Once the ROS robot is served (a status line with its actions), connect.
        while not any(line.startswith("[status] actions") for line in lines):
            assert proc.poll() is None and time.monotonic() < deadline, "\n".join(lines[-30:])
            time.sleep(0.1)
        (line,) = [line for line in lines if "openpi clients on ws://" in line]
        port = int(line.split("ws://")[1].split(" ")[0].rsplit(":", 1)[1])
        policy = WebsocketClientPolicy("127.0.0.1", port)
        assert policy.get_server_metadata()["robot"] == "demo"
        rng = np.random.default_rng(8)
        replies = [policy.infer({"observation/image": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8),
                                 "observation/state": rng.uniform(-0.5, 0.5, 3), "prompt": "touch the red cube"})
                   for _ in range(10)]
        assert all(r["actions"].shape == (20, 3) for r in replies)
        frames = [r["policy_timing"]["frame_index"] for r in replies]
        assert any(b - a > 1 for a, b in zip(frames, frames[1:])), frames          # the ROS robot's frames between
        assert max(r["policy_timing"]["cycle_frames"] for r in replies) >= 2, replies
        while not any("openpi clients 1/8" in line for line in lines if line.startswith("[status]")):
            assert time.monotonic() < deadline, "\n".join(lines[-30:])        # the status line counts it
            time.sleep(0.1)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 0, "\n".join(lines[-30:])
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
