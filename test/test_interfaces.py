"""oxygen_interfaces: field layout of the generated types, and a Converse service round trip
between two processes over DDS.

Needs the package built into the venv: scripts/build_interfaces.sh.
"""
import json
import os
import select
import subprocess
import sys
import time

import pytest

from oxygen_interfaces.action import Converse as ConverseAction
from oxygen_interfaces.msg import ActionChunk, Caption, LanguageUpdate, Located
from oxygen_interfaces.srv import Converse, Interject

CONVERSE_REQUEST = {
    "text": "string", "session_id": "string", "max_tokens": "uint32", "temperature": "float",
    "top_p": "float", "stop": "sequence<string>", "timeout_s": "float",
}
CONVERSE_RESPONSE = {
    "success": "boolean", "reply": "string", "error": "string", "tokens": "uint32",
    "frame_index": "uint64", "frame_stamp": "builtin_interfaces/Time", "queue_s": "double",
    "latency_s": "double", "finish_reason": "string", "located": "sequence<oxygen_interfaces/Located>",
}


def test_field_names_and_types():
    assert ActionChunk.get_fields_and_field_types() == {
        "header": "std_msgs/Header", "frame_index": "uint64", "horizon": "uint32", "dim": "uint32",
        "step_period_s": "double", "actions": "sequence<double>", "names": "sequence<string>",
        "compute_latency_s": "double", "rtc_delay_rows": "uint32", "model_actions": "sequence<float>",
        "subtask": "string",
    }
    assert Caption.get_fields_and_field_types() == {
        "header": "std_msgs/Header", "frame_index": "uint64", "prompt": "string", "text": "string",
    }
    assert LanguageUpdate.get_fields_and_field_types() == {
        "header": "std_msgs/Header", "robot": "string", "frame_index": "uint64", "text": "string",
    }
    assert Located.get_fields_and_field_types() == {
        "label": "string", "kind": "string", "normalized": "sequence<double>", "pixels": "sequence<double>",
        "camera": "string", "image_width": "uint32", "image_height": "uint32",
    }
    assert Interject.Request.get_fields_and_field_types() == {"text": "string", "robot": "string", "timeout_s": "float"}
    assert Interject.Response.get_fields_and_field_types() == {
        "success": "boolean", "plan": "string", "speech": "string", "reply": "string", "error": "string",
        "frame_index": "uint64", "frame_stamp": "builtin_interfaces/Time", "latency_s": "double",
        "finish_reason": "string",
    }
    assert Converse.Request.get_fields_and_field_types() == CONVERSE_REQUEST
    assert Converse.Response.get_fields_and_field_types() == CONVERSE_RESPONSE
    assert ConverseAction.Goal.get_fields_and_field_types() == CONVERSE_REQUEST
    assert ConverseAction.Result.get_fields_and_field_types() == CONVERSE_RESPONSE
    assert ConverseAction.Feedback.get_fields_and_field_types() == {
        "partial_reply": "string", "tokens": "uint32",
    }


# Converse server in its own process: replies with the request's fields as JSON. Exits by itself
# after a deadline so that it can never outlive the test by much.
SERVER = r"""
import json, sys, time
import rclpy
from rclpy.executors import SingleThreadedExecutor
from oxygen_interfaces.srv import Converse

def handle(req, res):
    res.success = True
    res.reply = json.dumps({f: getattr(req, f) if f != "stop" else list(req.stop)
                            for f in Converse.Request.get_fields_and_field_types()})
    res.tokens = 3
    res.frame_index = 2**40 + 7
    res.frame_stamp.sec, res.frame_stamp.nanosec = 123, 456
    res.queue_s, res.latency_s = 0.25, 0.5
    res.finish_reason = "stop"
    return res

rclpy.init()
node = rclpy.create_node("converse_test_server")
node.create_service(Converse, sys.argv[1], handle)
ex = SingleThreadedExecutor()
ex.add_node(node)
print("READY", flush=True)
deadline = time.monotonic() + float(sys.argv[2])
while rclpy.ok() and time.monotonic() < deadline:
    ex.spin_once(timeout_sec=0.1)
"""


def test_converse_service_round_trip():
    import rclpy
    from rclpy.executors import SingleThreadedExecutor

    from ros_harness import private_domain

    domain_id = private_domain(1)
    service = f"/oxygen_test_converse_{os.getpid()}"
    env = dict(os.environ, ROS_DOMAIN_ID=str(domain_id))
    server = subprocess.Popen([sys.executable, "-c", SERVER, service, "30"], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    context = rclpy.Context()
    try:
        ready, _, _ = select.select([server.stdout], [], [], 15.0)
        line = server.stdout.readline() if ready else ""
        if line.strip() != "READY":
            server.kill()
            pytest.fail(f"server did not start: {line!r}\n{server.stderr.read()[-2000:]}")

        rclpy.init(context=context, domain_id=domain_id)
        node = rclpy.create_node("converse_test_client", context=context)
        executor = SingleThreadedExecutor(context=context)
        executor.add_node(node)
        client = node.create_client(Converse, service)
        assert client.wait_for_service(timeout_sec=10.0), "service not discovered"

        req = Converse.Request(text="what is on the table?", session_id="s1", max_tokens=32,
                               temperature=0.5, top_p=0.75, stop=["\n", "."], timeout_s=2.0)
        t0 = time.monotonic()
        future = client.call_async(req)
        executor.spin_until_future_complete(future, timeout_sec=10.0)
        assert future.done(), "no reply within 10 s"
        res = future.result()
        print(f"service round trip {1e3 * (time.monotonic() - t0):.1f} ms")

        assert res.success and res.error == "" and res.finish_reason == "stop"
        assert json.loads(res.reply) == {
            "text": "what is on the table?", "session_id": "s1", "max_tokens": 32,
            "temperature": 0.5, "top_p": 0.75, "stop": ["\n", "."], "timeout_s": 2.0,
        }
        assert res.tokens == 3 and res.frame_index == 2**40 + 7
        assert (res.frame_stamp.sec, res.frame_stamp.nanosec) == (123, 456)
        assert (res.queue_s, res.latency_s) == (0.25, 0.5)
    finally:
        if context.ok():
            rclpy.shutdown(context=context)
        server.terminate()
        try:
            server.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait(timeout=5.0)
        server.stdout.close()
        server.stderr.close()


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-v", "-s"]))
