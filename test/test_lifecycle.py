"""oxygen_engine as a managed node, driven from another process through the standard lifecycle services
(lifecycle_msgs ChangeState/GetState), as a lifecycle manager or `ros2 lifecycle set` would: a failed
configure (corrupt checkpoint) leaves it unconfigured with the reason; configure -> inactive (model loaded,
no actions, requests refused); activate -> actions, replies and the debug image; deactivate -> actions stop;
cleanup -> unconfigured (nothing published); configure again; shutdown from active -> finalized, actions
stop; the process then exits cleanly. With requests in flight (no camera: they wait), every transition and
Ctrl-C answers each of them with the reason, and cleanup -> configure -> activate works every time (issue #21).
Waits are event-driven with generous bounds (wait_until, output_stops), none a fixed slack."""
import signal
import time

import pytest
from diagnostic_msgs.msg import DiagnosticArray
from lifecycle_msgs.msg import State, Transition
from lifecycle_msgs.srv import ChangeState, GetState
from rcl_interfaces.msg import Parameter, ParameterType, ParameterValue
from rcl_interfaces.srv import SetParameters
from sensor_msgs.msg import Image
from std_msgs.msg import Float64MultiArray

from oxygen_interfaces.srv import Converse
from ros_harness import Bringup, RosClient, output_stops, private_domain, running_bringup, wait_until


def call(client, srv_type, name, request, timeout=120.0):
    c = client.node.create_client(srv_type, name)
    assert c.wait_for_service(timeout_sec=30.0), f"no service {name}"
    future = c.call_async(request)
    assert wait_until(future.done, timeout), f"{name}: no response in {timeout} s"
    client.node.destroy_client(c)
    return future.result()


def state(client) -> int:
    return call(client, GetState, "/oxygen_engine/get_state", GetState.Request()).current_state.id


def transition(client, transition_id: int) -> bool:
    return call(client, ChangeState, "/oxygen_engine/change_state",
                ChangeState.Request(transition=Transition(id=transition_id))).success


def set_checkpoint(client, path: str) -> None:
    value = ParameterValue(type=ParameterType.PARAMETER_STRING, string_value=path)
    r = call(client, SetParameters, "/oxygen_engine/set_parameters",
             SetParameters.Request(parameters=[Parameter(name="checkpoint", value=value)]))
    assert r.results[0].successful, r.results[0].reason


def ask(client, text="What is on the table?"):
    return call(client, Converse, "/oxygen/converse", Converse.Request(text=text, max_tokens=4), timeout=60.0)


@pytest.fixture(scope="module")
def managed():
    domain = private_domain(23)
    with running_bringup(["--demo", "--managed", "--status-period", "0"], domain, "lifecycle_manager_test") as running:
        yield running


def test_transitions_through_the_lifecycle_services(managed, tmp_path):
    bringup, client = managed
    actions = client.collect(Float64MultiArray, "/oxygen/action")
    pictures = client.collect(Image, "/oxygen/debug_image")
    diagnostics = client.collect(DiagnosticArray, "/diagnostics")
    assert state(client) == State.PRIMARY_STATE_UNCONFIGURED

    # A corrupt checkpoint: configure fails, the node stays unconfigured and says why.
    bad = tmp_path / "bad_ckpt"
    bad.mkdir()
    (bad / "model.safetensors").write_bytes(b"this is not a safetensors file")
    set_checkpoint(client, str(bad))
    assert not transition(client, Transition.TRANSITION_CONFIGURE)
    assert state(client) == State.PRIMARY_STATE_UNCONFIGURED
    assert bringup.wait_for_line("configure failed, staying unconfigured", 5), bringup.output()

    def engine_message():
        for _, msg in reversed(list(diagnostics)):
            for st in msg.status:
                if st.name == "oxygen_ros: engine":
                    return st.message
        return ""
    assert wait_until(lambda: "configure failed" in engine_message() and str(bad) in engine_message(), 10), \
        engine_message()

    # Configure with good parameters: inactive, model loaded, nothing published, requests refused.
    set_checkpoint(client, "")
    assert transition(client, Transition.TRANSITION_CONFIGURE)
    assert state(client) == State.PRIMARY_STATE_INACTIVE
    assert bringup.wait_for_line("loading model demo from random weights (no checkpoint) on cpu: done in", 30)
    time.sleep(1.5)
    assert not actions, "actions published while inactive"
    r = ask(client)
    assert not r.success and "inactive" in r.error, r

    # Activate: actions flow and questions are answered.
    assert transition(client, Transition.TRANSITION_ACTIVATE)
    assert state(client) == State.PRIMARY_STATE_ACTIVE
    assert wait_until(lambda: len(actions) > 20, 60), "no actions after activate:\n" + bringup.output()
    r = ask(client)
    assert r.success and r.tokens > 0, r
    # The debug picture: the camera frame (224 px scaled to 448) over a 7-lane joint strip, then the reply.
    assert wait_until(lambda: len(pictures) >= 2, 10), "no debug image"
    picture = pictures[-1][1]
    assert picture.encoding == "rgb8" and picture.width == 448 and picture.height > 448 + 3 * 18   # 3 joint lanes

    # Deactivate: actions stop (output_stops: event-driven, a command already in flight may land late on a
    # loaded machine), the model stays loaded.
    assert transition(client, Transition.TRANSITION_DEACTIVATE)
    assert output_stops(actions), "actions published after deactivate"
    assert state(client) == State.PRIMARY_STATE_INACTIVE
    assert not ask(client).success
    assert transition(client, Transition.TRANSITION_ACTIVATE)      # no reload: active again at once
    count = len(actions)
    assert wait_until(lambda: len(actions) > count + 20, 30)
    assert transition(client, Transition.TRANSITION_DEACTIVATE)

    # Cleanup releases the model (and the nodes around it); shutdown finalizes.
    assert transition(client, Transition.TRANSITION_CLEANUP)
    assert state(client) == State.PRIMARY_STATE_UNCONFIGURED
    assert bringup.wait_for_line("unconfigured: model released", 5)
    assert output_stops(actions), "actions published while unconfigured"
    count = len(actions)

    # Configure again (the nodes around the engine are rebuilt), activate, and shut down from active.
    assert transition(client, Transition.TRANSITION_CONFIGURE)
    assert transition(client, Transition.TRANSITION_ACTIVATE)
    assert wait_until(lambda: len(actions) > count + 20, 60), "no actions after a second configure"
    assert ask(client).success
    assert transition(client, Transition.TRANSITION_ACTIVE_SHUTDOWN)
    assert state(client) == State.PRIMARY_STATE_FINALIZED
    assert output_stops(actions), "actions published after shutdown"


# ------------------------------------------------------------------ requests in flight (issue #21, item 1)
# No camera (`--robot demo` without the simulated robot): every question waits in the engine's queue for a
# frame that never comes, so each transition meets 30 pending calls and 4 executing streaming goals.
CALLS, GOALS = 30, 4
# All of them wait at once: the engine's per-owner cap (16 by default) must not refuse any.
DEEP_QUEUE = ["--ros-args", "-p", "oxygen_engine:max_queued_per_owner:=64"]


class InFlight:
    """CALLS service calls and GOALS streaming goals (their results asked for at once), all pending."""

    def __init__(self, client):
        from rclpy.action import ActionClient
        from rclpy.qos import QoSProfile

        from oxygen_interfaces.action import Converse as ConverseAction

        node = client.node
        # Deep client queues: a burst of responses must not be dropped by the client's own reader.
        self.service = node.create_client(Converse, "/oxygen/converse", qos_profile=QoSProfile(depth=1000))
        self.stream = ActionClient(node, ConverseAction, "/oxygen/converse_stream",
                                   goal_service_qos_profile=QoSProfile(depth=100),
                                   result_service_qos_profile=QoSProfile(depth=100))
        assert self.service.wait_for_service(timeout_sec=30) and self.stream.wait_for_server(timeout_sec=30)
        self.calls = [self.service.call_async(Converse.Request(text=f"question {i}?", max_tokens=4,
                                                               timeout_s=60.0)) for i in range(CALLS)]
        self.goals = [self.stream.send_goal_async(ConverseAction.Goal(text=f"streamed {i}?", max_tokens=4,
                                                                      timeout_s=60.0)) for i in range(GOALS)]
        assert wait_until(lambda: all(g.done() for g in self.goals), 30), "goals not accepted"
        assert all(g.result().accepted for g in self.goals)
        self.results = [g.result().get_result_async() for g in self.goals]
        self.client, self.node = client, node

    def answered(self) -> tuple[int, int]:
        return sum(f.done() for f in self.calls), sum(f.done() for f in self.results)

    def wait_answered(self, reason: str, timeout: float = 20.0) -> None:
        """Every call and goal answered, refused with `reason` (no reply can exist without a frame)."""
        start = time.monotonic()
        wait_until(lambda: self.answered() == (CALLS, GOALS), timeout)
        print(f"{reason}: {self.answered()} of {(CALLS, GOALS)} (calls, goals) answered "
              f"{time.monotonic() - start:.2f} s after the transition returned")
        assert self.answered() == (CALLS, GOALS), f"answered (calls, goals): {self.answered()} of {(CALLS, GOALS)}"
        for r in [f.result() for f in self.calls] + [f.result().result for f in self.results]:
            assert not r.success and reason in r.error, r

    def close(self) -> None:
        self.node.destroy_client(self.service)
        self.stream.destroy()


def queued(bringup_client, count: int) -> bool:
    """The conversation service has received `count` requests (its diagnostics say so)."""
    diagnostics = bringup_client.collect(DiagnosticArray, "/diagnostics")

    def received():
        for _, msg in reversed(list(diagnostics)):
            for st in msg.status:
                if st.name == "oxygen_ros: conversation":
                    return int({kv.key: kv.value for kv in st.values}["requests"])
        return 0
    return wait_until(lambda: received() >= count, 30)


@pytest.fixture(scope="module")
def cameraless():
    domain = private_domain(24)
    with running_bringup(["--robot", "demo", "--managed", "--status-period", "0", *DEEP_QUEUE], domain,
                         "lifecycle_inflight_test") as running:
        yield running


def test_every_pending_request_is_answered_by_deactivate_cleanup_and_shutdown(cameraless):
    bringup, client = cameraless
    for cycle in range(3):     # cleanup -> configure -> activate works every time
        assert transition(client, Transition.TRANSITION_CONFIGURE), f"cycle {cycle}:\n" + bringup.output()[-3000:]
        assert transition(client, Transition.TRANSITION_ACTIVATE)
        assert state(client) == State.PRIMARY_STATE_ACTIVE
        pending = InFlight(client)
        assert queued(client, CALLS + GOALS)
        assert pending.answered() == (0, 0)
        start = time.monotonic()
        assert transition(client, Transition.TRANSITION_DEACTIVATE)
        assert transition(client, Transition.TRANSITION_CLEANUP)
        print(f"deactivate + cleanup with {CALLS} calls and {GOALS} goals pending: {time.monotonic() - start:.2f} s")
        pending.wait_answered("oxygen_engine deactivated")
        pending.close()
        assert state(client) == State.PRIMARY_STATE_UNCONFIGURED
    # Shutdown from active answers them too, and the process then exits cleanly (running_bringup: code 0).
    assert transition(client, Transition.TRANSITION_CONFIGURE)
    assert transition(client, Transition.TRANSITION_ACTIVATE)
    pending = InFlight(client)
    assert queued(client, CALLS + GOALS)
    assert transition(client, Transition.TRANSITION_ACTIVE_SHUTDOWN)
    pending.wait_answered("oxygen_engine shutdown")
    assert state(client) == State.PRIMARY_STATE_FINALIZED
    assert "Traceback" not in bringup.output() and "InvalidHandle" not in bringup.output(), bringup.output()


def test_sigint_answers_every_pending_request():
    domain = private_domain(25)
    bringup = Bringup(["--robot", "demo", "--status-period", "0", *DEEP_QUEUE], domain)
    client = RosClient(domain, "lifecycle_sigint_test")
    try:
        assert bringup.wait_for_line("oxygen_bringup: running", 90), bringup.output()
        pending = InFlight(client)
        assert queued(client, CALLS + GOALS)
        bringup.proc.send_signal(signal.SIGINT)
        pending.wait_answered("oxygen_engine shutdown")
        assert bringup.proc.wait(30) == 0, bringup.output()
    finally:
        client.close()
        bringup.stop()
    assert "Traceback" not in bringup.output(), bringup.output()


def test_repeated_sigint_exits_0_without_a_traceback():
    """Ctrl-C hammered (or `ros2 launch` stopping): SIGINT every 0.1 s for 3 s. The first one stops the
    process in order; the others must neither kill it (Python restores the default SIGINT handler while it
    finalises: a late SIGINT ended the process with -2, i.e. 130 in a shell) nor print a traceback."""
    domain = private_domain(26)
    bringup = Bringup(["--demo", "--status-period", "0"], domain)
    try:
        assert bringup.wait_for_line("oxygen_bringup: running", 90), bringup.output()
        time.sleep(1.0)
        for _ in range(30):
            if bringup.proc.poll() is not None:
                break
            bringup.proc.send_signal(signal.SIGINT)
            time.sleep(0.1)
        assert bringup.proc.wait(30) == 0, bringup.output()[-3000:]
    finally:
        bringup.stop()
    assert "oxygen_bringup: stopped" in bringup.output()
    assert "Traceback" not in bringup.output(), bringup.output()
