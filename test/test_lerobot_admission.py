"""The LeRobot server against clients that hold its doors (issue 40 items 2-4, issue 41 item 7), over real
gRPC: one connection cannot hold more than one call of each method, a stalled stream ends at its deadline,
Ready is idempotent per connection, a refused start frees its slot at once, `--max-clients` is exact,
policy instructions that cannot be applied (a CR/LF or a 3.9 MB policy name, shared references, a chunk
length of 0) are INVALID_ARGUMENT / RESOURCE_EXHAUSTED and never INTERNAL, and refusals are logged clipped
and rate-limited. An honest client on its own connection keeps getting chunks throughout.
"""
from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import grpc
import numpy as np
import pytest

from oxygen_ros.serve.lerobot import services_pb2 as pb
from oxygen_ros.serve.lerobot.server import RefusalLog
from oxygen_ros.serve.lerobot.wire import RemotePolicyConfig, encode
from test_lerobot_serve import (HORIZON, RobotClientReplay, honest_client, lerobot_features, observation, served,
                                status_of)


def _wait_for(predicate, timeout: float) -> bool:
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if predicate():
            return True
        time.sleep(0.05)
    return False


def _served_on(seen: list, before: int) -> bool:
    return _wait_for(lambda: len(seen) > before, 60.0)


def _stalled_stream(sent: threading.Event, hold: threading.Event):
    yield pb.Observation(transfer_state=pb.TRANSFER_BEGIN, data=b"x" * 1024)
    sent.set()
    hold.wait(30)


# ---------------------------------------------------------------------------------- one connection, many calls
def test_one_connection_cannot_hold_the_workers_with_stalled_streams():
    """Issue 40 item 3: 24 observation streams from one connection that send 1 kB and then nothing. One is
    held until its deadline (DEADLINE_EXCEEDED), the others are refused at once (RESOURCE_EXHAUSTED); new
    clients still get in and the honest client keeps getting chunks."""
    with served() as server, honest_client(server) as seen:
        bad = RobotClientReplay(server.port)
        bad.start()
        hold = threading.Event()
        try:
            futures = [bad.stub.SendObservations.future(_stalled_stream(threading.Event(), hold)) for _ in range(24)]
            newcomers = [RobotClientReplay(server.port) for _ in range(3)]
            for c in newcomers:
                c.stub.Ready(pb.Empty())              # admitted while the streams are stalled
            n = len(seen)
            codes = []
            for f in futures:
                with pytest.raises(grpc.RpcError) as e:
                    f.result(timeout=60)
                codes.append((e.value.code(), e.value.details()))
            assert _served_on(seen, n)
        finally:
            hold.set()
        kinds = {code for code, _ in codes}
        # UNAVAILABLE: HTTP/2 refused the stream (REFUSED_STREAM) beyond the connection's max_concurrent_streams.
        assert {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED} <= kinds, codes
        assert kinds <= {grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.DEADLINE_EXCEEDED,
                         grpc.StatusCode.UNAVAILABLE}, codes
        assert any("1 call in flight per connection" in text for code, text in codes
                   if code == grpc.StatusCode.RESOURCE_EXHAUSTED)
        # Answered when it stopped sending (stream_stall_s), not at the whole stream's deadline.
        assert any("sent nothing for 0.8 s (1024 bytes received)" in text for code, text in codes
                   if code == grpc.StatusCode.DEADLINE_EXCEEDED)
        for c in newcomers + [bad]:
            c.close()


def _dripping_stream(stop: threading.Event):
    yield pb.Observation(transfer_state=pb.TRANSFER_BEGIN, data=b"x" * 1024)
    while not stop.wait(0.3):                         # a chunk every 0.3 s, never the END
        yield pb.Observation(transfer_state=pb.TRANSFER_MIDDLE, data=b"x" * 1024)


def test_a_stream_that_keeps_dripping_ends_at_the_whole_streams_deadline():
    with served() as server:
        bad = RobotClientReplay(server.port)
        bad.start()
        stop = threading.Event()
        try:
            with pytest.raises(grpc.RpcError) as e:
                bad.stub.SendObservations(_dripping_stream(stop), timeout=30)
        finally:
            stop.set()
        assert e.value.code() == grpc.StatusCode.DEADLINE_EXCEEDED
        assert "the observation stream did not end within 2 s (" in e.value.details(), e.value.details()
        bad.close()


def test_one_connection_cannot_hold_the_workers_with_waiting_get_actions():
    """40 GetActions in flight from one connection: one waits (its actions_wait_s), the rest are refused at
    once (or, beyond HTTP/2's streams per connection, never reach it); the honest client keeps being served."""
    with served(actions_wait_s=1.0) as server, honest_client(server) as seen:
        bad = RobotClientReplay(server.port)
        bad.start()
        futures = [bad.stub.GetActions.future(pb.Empty()) for _ in range(40)]
        n = len(seen)
        outcomes = []
        for f in futures:
            try:
                f.result(timeout=60)
                outcomes.append("empty reply")
            except grpc.RpcError as e:
                outcomes.append(e.code().name)
                if e.code() == grpc.StatusCode.RESOURCE_EXHAUSTED:       # this server's refusal, not gRPC's limit
                    assert "1 call in flight per connection" in e.details(), e.details()
        assert _served_on(seen, n)
        # UNAVAILABLE: HTTP/2 refused the stream (REFUSED_STREAM) beyond the connection's max_concurrent_streams.
        assert outcomes.count("empty reply") >= 1 and "RESOURCE_EXHAUSTED" in outcomes, outcomes
        assert set(outcomes) <= {"empty reply", "RESOURCE_EXHAUSTED", "UNAVAILABLE"}, outcomes
        bad.close()


# ---------------------------------------------------------------------------------- sessions and slots
def test_concurrent_ready_on_one_connection_makes_one_robot():
    """Issue 40 item 4: concurrent Ready calls of one connection left robots nobody removed. Now: one session
    per connection whatever the calls; Ready again restarts it on the same robot."""
    with served() as server:
        client = RobotClientReplay(server.port)
        for _ in range(5):
            with ThreadPoolExecutor(8) as pool:
                for f in [pool.submit(client.stub.Ready.future(pb.Empty()).exception) for _ in range(8)]:
                    error = f.result()          # UNAVAILABLE: beyond HTTP/2's streams per connection
                    assert error is None or error.code() in (grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                             grpc.StatusCode.UNAVAILABLE), error
        (robot,) = server.clients.values()
        assert [r for r in server.engine.robots if r.startswith("lerobot_")] == [robot]
        client.start()                                      # Ready again: the same robot, a fresh session
        assert list(server.clients.values()) == [robot]
        client.send(observation(np.random.default_rng(0), timestep=3))
        assert client.first_chunk()[0].timestep == 3
        client.close()


def test_max_clients_is_exact_and_a_refused_start_frees_its_slot_at_once():
    """`--max-clients 1`: a second client is refused; a client whose policy instructions are refused (its start
    failed: LeRobot's client exits) frees the slot at once, not after the idle timeout."""
    with served(max_clients=1, idle_timeout_s=60.0) as server:
        first, second = RobotClientReplay(server.port), RobotClientReplay(server.port)
        first.start()
        code, text = status_of(lambda: second.stub.Ready(pb.Empty()))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "server full: 1 LeRobot clients" in text
        assert len(server.clients) == 1
        first.close()
        second.close()
    with served(max_clients=1, idle_timeout_s=60.0) as server:
        refused = RobotClientReplay(server.port)
        code, _ = status_of(lambda: refused.start(policy_type="act"))
        assert code == grpc.StatusCode.INVALID_ARGUMENT and server.clients == {}
        retry = RobotClientReplay(server.port)
        retry.start()                                       # at once: no "server full"
        refused.close()
        retry.close()


@pytest.mark.parametrize("n", [0, -1, True, 2.0, HORIZON + 1])
def test_actions_per_chunk_must_be_an_int_within_the_horizon(n):
    with served() as server:
        client = RobotClientReplay(server.port)
        code, text = status_of(lambda: client.start(actions_per_chunk=n))
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert f"actions_per_chunk {n!r} must be an int in 1..{HORIZON}" in text
        client.close()


def _instructions(name="user/pi05_so101", features=None, **fields) -> pb.PolicySetup:
    return pb.PolicySetup(data=encode(RemotePolicyConfig("pi05", name, features or lerobot_features(), 10, "cuda",
                                                         **fields)))


def test_policy_instructions_that_cannot_be_applied_are_invalid_argument_never_internal(caplog):
    """A CR/LF in the policy name (a metadata value cannot hold it: INTERNAL, after the config was applied), a
    3.9 MB name (logged whole), feature lists sharing references 10^8 times (the decoder busy for 20 s): each
    refused before anything is applied, the reply and the log line clipped."""
    names = ["shoulder_pan.pos"]
    for _ in range(8):
        names = [names] * 10
    shared = {"observation.state": {"dtype": "float32", "shape": (6,), "names": names}}
    cases = {"CR/LF name": (_instructions("user/pi05\r\nx-evil: 1"), "INVALID_ARGUMENT", "printable characters"),
             "3.9 MB name": (_instructions("n" * 3_900_000), "INVALID_ARGUMENT", "at most 512 printable"),
             "shared references": (_instructions(features=shared), "RESOURCE_EXHAUSTED", "shared references"),
             "non-ASCII name": (_instructions("用户/pi05"), None, None)}
    caplog.set_level(logging.INFO, logger="oxygen_ros.serve.lerobot")
    with served() as server:
        for name, (setup, code, words) in cases.items():
            client = RobotClientReplay(server.port)
            client.stub.Ready(pb.Empty())
            if code is None:                                # printable, not ASCII: served, said in ASCII
                _, call = client.stub.SendPolicyInstructions.with_call(setup)
                assert "\\u7528\\u6237/pi05 ->" in dict(call.trailing_metadata())["x-oxygen-served-by"]
                client.close()
                continue
            got, text = status_of(lambda: client.stub.SendPolicyInstructions(setup))
            assert (name, got.name) == (name, code), text
            assert words in text and len(text) <= 400, (name, text[:400])
            # Nothing was applied: the refused start's session is gone.
            got, _ = status_of(lambda: client.stub.GetActions(pb.Empty()))
            assert got == grpc.StatusCode.FAILED_PRECONDITION, name
            client.close()
    lines = [r.getMessage() for r in caplog.records]
    assert all(len(line) < 2000 for line in lines), max(len(line) for line in lines)
    assert not any("server error" in line for line in lines)


# ---------------------------------------------------------------------------------- the log
def test_an_unknown_client_in_a_loop_is_logged_once(caplog):
    """After a server restart a running client asks "GetActions" in a loop: each gets FAILED_PRECONDITION,
    the log says it once."""
    caplog.set_level(logging.INFO, logger="oxygen_ros.serve.lerobot")
    with served() as server:
        client = RobotClientReplay(server.port)
        for _ in range(20):
            code, text = status_of(lambda: client.stub.GetActions(pb.Empty()))
            assert code == grpc.StatusCode.FAILED_PRECONDITION and "call Ready first" in text
        client.close()
    assert sum("unknown client" in r.getMessage() for r in caplog.records) == 1


def test_refusals_are_logged_once_per_client_and_window(caplog):
    """RefusalLog on a simulated clock: a refusal repeated 100 times in 5 s is one line; after the window the
    next line counts the ones held back; another client or status is its own line."""
    now = [0.0]
    refusals = RefusalLog(window_s=10.0, clock=lambda: now[0])
    caplog.set_level(logging.WARNING, logger="oxygen_ros.serve.lerobot")
    logged = []
    for i in range(100):
        now[0] = i * 0.05
        logged.append(refusals.log("ipv4:10.0.0.2:5000", "SendObservations", grpc.StatusCode.INVALID_ARGUMENT, "bad"))
    assert logged == [True] + [False] * 99
    assert refusals.log("ipv4:10.0.0.3:5000", "SendObservations", grpc.StatusCode.INVALID_ARGUMENT, "bad")
    assert refusals.log("ipv4:10.0.0.2:5000", "SendObservations", grpc.StatusCode.RESOURCE_EXHAUSTED, "big")
    now[0] = 10.0
    assert refusals.log("ipv4:10.0.0.2:5000", "SendObservations", grpc.StatusCode.INVALID_ARGUMENT, "bad")
    assert "(99 more like it in the last 10 s)" in caplog.records[-1].getMessage()
    assert len(caplog.records) == 4
    assert refusals.log("p", "unknown client", grpc.StatusCode.FAILED_PRECONDITION, "x", once=True)
    now[0] = 1e6
    assert not refusals.log("p", "unknown client", grpc.StatusCode.FAILED_PRECONDITION, "x", once=True)


# ---------------------------------------------------------------------------------- the byte cap on the stream
def test_the_byte_cap_counts_the_whole_stream_not_each_chunk():
    """Five 1 MiB chunks under a 2.5 MiB cap: every chunk is under the cap, their total is not. Refused while
    receiving ("before decoding"), not by the decoder after the whole stream was kept."""
    with served(max_message_bytes=int(2.5 * 2**20)) as server:
        client = RobotClientReplay(server.port)
        client.start()
        chunk = b"\0" * (1 << 20)
        messages = [pb.Observation(transfer_state=pb.TRANSFER_BEGIN, data=chunk)]
        messages += [pb.Observation(transfer_state=pb.TRANSFER_MIDDLE, data=chunk) for _ in range(3)]
        messages += [pb.Observation(transfer_state=pb.TRANSFER_END, data=chunk)]
        code, text = status_of(lambda: client.stub.SendObservations(iter(messages)))
        assert code == grpc.StatusCode.RESOURCE_EXHAUSTED and "refused before decoding" in text, text
        client.close()


# ---------------------------------------------------------------------------------- the command line
def test_api_key_file_is_refused_with_the_lerobot_protocol(capsys, tmp_path):
    """LeRobot's client sends no key: a key file would be accepted and never checked. Refused at parsing."""
    from oxygen_ros.serve.cli import parse_args

    key = tmp_path / "key"
    key.write_text("k" * 32)
    with pytest.raises(SystemExit) as e:
        parse_args(["--robot", "so101", "--protocol", "lerobot", "--api-key-file", str(key)])
    assert e.value.code == 2
    assert "--api-key-file: LeRobot's robot_client sends no key" in capsys.readouterr().err
    args, _ = parse_args(["--robot", "so101", "--protocol", "lerobot"])
    assert args.api_key_file is None and args.protocol == "lerobot"



def test_a_stop_while_serving_is_not_called_a_stop_of_the_start(capfd):
    """`oxygen_serve --protocol lerobot` marks itself running once it listens: a Ctrl-C then stops it (the
    signal handler's line says "stopping", not "stopping the start", which would end the process as a start
    that hangs), and the serving returns 0 with its summary."""
    import argparse
    import types

    from oxygen_ros.serve import lerobot
    from oxygen_ros.serve.cli import StopRequest
    from test_lerobot_serve import so101_engine

    node = types.SimpleNamespace(engine=so101_engine())
    args = argparse.Namespace(host="127.0.0.1", port=0, max_clients=2, max_message_mb=32.0, default_prompt=None,
                              fps=None, random="tiny", layout="so101")
    stop, result = StopRequest("oxygen_serve"), []
    thread = threading.Thread(target=lambda: result.append(lerobot.serve(node, args, stop)))
    thread.start()
    try:
        assert _wait_for(lambda: "listening for LeRobot robot_client" in capfd.readouterr().out or stop.running, 120)
        assert _wait_for(lambda: stop.running, 5.0), "serving, yet not marked running"
    finally:
        stop.set()
        thread.join(60)
    assert result == [0]
