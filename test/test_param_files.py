"""Params files, `--ros-args -p` values and ports are checked before rclpy reads them and before the model
loads (nodes/param_files.py): every mistake one line naming file, node and parameter, all listed, exit 2.
Before, a misspelled name or node section was silently ignored, `kv_budget_mb: lots` silently became the robot
config's 16.0, a wrong type or a YAML error gave a traceback, and a port in use was found after the model load."""
from __future__ import annotations

import math
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from conftest import REPO
from ros_harness import private_domain  # a domain of this test process: no other bringup on it

ENGINE_LOG = "[oxygen_engine]"       # the engine node's first log line is the model load: none may appear


def run(module: str, *args, timeout=180) -> subprocess.CompletedProcess:
    env = dict(os.environ, ROS_DOMAIN_ID=str(private_domain(96)), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", module, *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=timeout)


def refused_lines(stderr: str) -> list[str]:
    """The problem lines under 'refusing to start, bad parameters:' (indented, one per problem)."""
    lines = stderr.splitlines()
    start = next(i for i, line in enumerate(lines) if "refusing to start, bad parameters:" in line)
    return [line.strip() for line in lines[start + 1:] if line.startswith("  ")]


def write(path: Path, text: str) -> str:
    path.write_text(text)
    return str(path)


BAD = """\
oxygen_action:
  ros__parameters:
    upper_limit: [0.1, 0.1, 0.1]
    hold_timeout_s: forever
oxygen_engin:
  ros__parameters:
    kv_budget_mb: 8.0
oxygen_engine:
  ros__parameters:
    kv_budjet_mb: 8.0
    kv_budget_mb: lots
    denoise_steps: ten
    block_size: 5000
    checkpont: /models/pi05
"""


def test_every_mistake_is_one_line_naming_file_node_and_key_all_listed_before_the_model_loads(tmp_path):
    bad = write(tmp_path / "bad.yaml", BAD)
    syntax = write(tmp_path / "syntax.yaml", "oxygen_engine:\n  ros__parameters:\n    model: tiny\n   seed: [\n")
    missing = str(tmp_path / "missing.yaml")
    r = run("oxygen_ros.bringup", "--demo", "--duration", "1", "--params-file", bad, "--params-file", syntax,
            "--params-file", missing, "--ros-args", "-p", "oxygen_engine:kv_budget_mb:=64")
    assert r.returncode == 2, r.stdout + r.stderr
    assert "Traceback" not in r.stderr and ENGINE_LOG not in r.stdout + r.stderr, r.stdout + r.stderr
    expected = [
        f"{syntax}:4:4: not valid YAML",
        f"{missing}: cannot read the parameters file: not found",
        f"{bad}:3: oxygen_action.upper_limit: unknown parameter (did you mean upper_limits?)",
        f"{bad}:4: oxygen_action.hold_timeout_s = 'forever': must be a float",
        f"{bad}:5: oxygen_engin: unknown node (did you mean oxygen_engine?)",
        f"{bad}:10: oxygen_engine.kv_budjet_mb: unknown parameter (did you mean kv_budget_mb?)",
        f"{bad}:11: oxygen_engine.kv_budget_mb = 'lots': must be a float",
        f"{bad}:12: oxygen_engine.denoise_steps = 'ten': must be an integer",
        f"{bad}:13: oxygen_engine.block_size = 5000: must be <= 1024",
        f"{bad}:14: oxygen_engine.checkpont: unknown parameter (did you mean checkpoint?)",
        "--ros-args -p oxygen_engine:kv_budget_mb:=64: oxygen_engine.kv_budget_mb = 64: must be a float: write 64.0",
    ]
    lines = refused_lines(r.stderr)
    assert len(lines) == len(expected), r.stderr              # one line per mistake, nothing else
    for line, start in zip(sorted(lines), sorted(expected)):
        assert line.startswith(start), (line, start)


def test_a_misspelled_checkpoint_key_is_named_not_the_configs_default_path(tmp_path):
    params = write(tmp_path / "mine.yaml", "oxygen_engine:\n  ros__parameters:\n    checkpont: /models/pi05\n")
    r = run("oxygen_ros.bringup", "--robot", "libero", "--duration", "1", "--params-file", params)
    assert r.returncode == 2, r.stdout + r.stderr
    assert refused_lines(r.stderr) == [f"{params}:3: oxygen_engine.checkpont: unknown parameter "
                                       "(did you mean checkpoint?)"]
    assert "not found" not in r.stderr


def test_oxygen_serve_checks_the_same_files(tmp_path):
    params = write(tmp_path / "bad.yaml", "oxygen_engine:\n  ros__parameters:\n    kv_budget_mb: lots\n")
    r = run("oxygen_ros.serve", "--robot", "demo", "--port", "0", "--params-file", params)
    assert r.returncode == 2, r.stdout + r.stderr
    assert refused_lines(r.stderr) == [f"{params}:3: oxygen_engine.kv_budget_mb = 'lots': must be a float "
                                       "such as 256.0"]
    assert ENGINE_LOG not in r.stdout + r.stderr


def test_an_unrecognised_argument_is_refused_in_one_line():
    # Before: rclpy.init raised UnknownROSArgsError, a traceback after the imports.
    r = run("oxygen_ros.bringup", "--demo", "--duration", "3", "--duraton", "1", timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert "unrecognized arguments: --duraton 1" in r.stderr and "Traceback" not in r.stderr


@pytest.fixture
def busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


@pytest.mark.parametrize("flag", ["--console", "--openpi-port"])
def test_a_port_in_use_is_said_as_such_before_the_model_loads(busy_port, flag):
    r = run("oxygen_ros.bringup", "--demo", "--duration", "1", flag, str(busy_port))
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip().splitlines() == [
        f"oxygen_bringup: refusing to start: {flag}: port {busy_port} on 127.0.0.1 is in use (another program "
        "listens there): give another port or stop that program"]
    assert ENGINE_LOG not in r.stdout + r.stderr


def test_oxygen_serve_says_its_port_is_in_use_before_the_model_loads(busy_port):
    r = run("oxygen_ros.serve", "--robot", "demo", "--port", str(busy_port))
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"oxygen_serve: refusing to start: --port: port {busy_port} on 127.0.0.1 is in use" in r.stderr
    assert "bad parameters" not in r.stderr and "Traceback" not in r.stderr
    assert ENGINE_LOG not in r.stdout + r.stderr


def test_valid_overrides_still_apply_from_a_file_and_from_ros_args(tmp_path):
    """A regression guard for the checker: good values (a float, the ROS built-in use_sim_time under /**, a
    list of ints for a float list) pass and reach the engine; a -p value wins over the files, as in rcl."""
    params = write(tmp_path / "ok.yaml", "/**:\n  ros__parameters:\n    use_sim_time: false\n"
                                          "oxygen_engine:\n  ros__parameters:\n    kv_budget_mb: 8.0\n"
                                          "oxygen_action:\n  ros__parameters:\n    upper_limits: [2, 2, 3]\n")
    blocks = []
    for extra in ([], ["--ros-args", "-p", "oxygen_engine:kv_budget_mb:=4.0"]):
        r = run("oxygen_ros.bringup", "--demo", "--duration", "0.5", "--status-period", "0", "--params-file", params,
                *extra)
        assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
        blocks.append(int(re.search(r"engine ready: .* (\d+) KV blocks", r.stdout + r.stderr).group(1)))
    assert abs(blocks[0] - 2 * blocks[1]) <= 1, blocks       # the pool follows the budget: 8 MiB, then 4 MiB


# ------------------------------------------------------------------------------------------------ in process
def test_every_shipped_config_passes_and_a_planted_typo_in_each_is_caught(tmp_path):
    from oxygen_ros.param_files import check

    configs = sorted((REPO / "config").glob("*.yaml"))
    assert len(configs) >= 5
    for config in configs:
        assert check([config]).problems == [], config
        planted = tmp_path / config.name
        shutil.copy(config, planted)
        text = planted.read_text().replace("ros__parameters:\n", "ros__parameters:\n    polcy: oxygen\n", 1)
        planted.write_text(text)
        assert [p for p in check([planted]).problems if ".polcy: " in p and "(did you mean policy?)" in p], config


def test_sections_as_ros_names_them(tmp_path):
    from oxygen_ros.param_files import check

    ok = write(tmp_path / "ok.yaml", "/oxygen_action:\n  ros__parameters: {replan_steps: 2}\n"
                                      "/**:\n  ros__parameters: {action_rate_hz: 70.0}\n"
                                      "/**/oxygen_view:\n  ros__parameters: {rate_hz: 1.0}\n")
    assert check([ok]).problems == []
    bad = write(tmp_path / "bad.yaml", "/arm_a/oxygen_action:\n  ros__parameters: {replan_steps: 2}\n"
                                       "arm_b:\n  oxygen_action:\n    ros__parameters: {replan_steps: 2}\n"
                                       "/**:\n  ros__parameters: {replan_step: 2}\n"
                                       "oxygen_view:\n  rate_hz: 1.0\n")
    problems = check([bad]).problems
    assert [p.split(": ")[1] for p in problems] == ["arm_b", "oxygen_view", "/**.replan_step",
                                                     "/arm_a/oxygen_action"], problems
    assert "did you mean replan_steps?" in problems[2]
    assert "configures no node: the nodes run in /" in problems[3]
    # ... and with the nodes in a namespace (-r __ns:=/arm_a), /arm_a/oxygen_action is theirs
    assert check([write(tmp_path / "ns.yaml", "/arm_a/oxygen_action:\n  ros__parameters: {replan_steps: 2}\n")],
                 ["--ros-args", "-r", "__ns:=/arm_a"]).problems == []


def test_values_are_typed_as_rcl_types_them(tmp_path):
    """The checker's typing against rcl's own parser: a node started with the file and every override
    declared reports the same value and type for each."""
    import rclpy
    from rclpy.context import Context
    from rclpy.node import Node

    from oxygen_ros.params_yaml import read_file

    scalars = ["yes", "Off", "y", "true", "64", "-7", "0x10", "010", "64.0", "1e3", ".nan", "-.inf", "inf", "lots",
               "'64'", '"true"', "null", "1_000", "[1, 2]", "[1.5, 2.0]", "[a, 'b']", "[true, no]"]
    text = "typed:\n  ros__parameters:\n" + "".join(f"    p{i}: {s}\n" for i, s in enumerate(scalars))
    params = write(tmp_path / "typed.yaml", text)
    given, problems = read_file(params)
    assert problems == []
    context = Context()
    rclpy.init(args=["t", "--ros-args", "--params-file", params], context=context)
    try:
        node = Node("typed", context=context, automatically_declare_parameters_from_overrides=True)
        for g in given:
            ros = node.get_parameter(g.name).value
            ros = list(ros) if not isinstance(ros, (bool, int, float, str)) else ros
            assert type(ros) is type(g.value), (g.name, ros, g.value)
            if isinstance(ros, float) and math.isnan(ros):
                assert math.isnan(g.value)
            else:
                assert ros == g.value, (g.name, ros, g.value)
        node.destroy_node()
    finally:
        rclpy.shutdown(context=context)


def test_mixed_lists_and_empty_values_are_refused_as_rcl_would(tmp_path):
    from oxygen_ros.param_files import check

    bad = write(tmp_path / "bad.yaml", "oxygen_action:\n  ros__parameters:\n    upper_limits: [1, 1.7, 2.6]\n"
                                       "    frame_id:\n    lower_limits: [a, b, c]\n")
    assert [p.split(": ", 1)[1] for p in check([bad]).problems] == [
        "oxygen_action.upper_limits: a list mixes float and int entries: ROS lists have one type (write 1.0, not 1, "
        "among floats)",
        "oxygen_action.frame_id: no value (write '' for an empty string)",
        "oxygen_action.lower_limits = ['a', 'b', 'c']: must be a list of numbers ('a' is not)"]


def test_port_problems_name_each_port_and_skip_port_zero(busy_port):
    from oxygen_ros.param_files import PortUse, port_problems

    with socket.socket() as free:
        free.bind(("127.0.0.1", 0))
        free_port = free.getsockname()[1]                   # bound, not listening: free again once closed
    assert port_problems([PortUse("--port", "127.0.0.1", 0), PortUse("--console", "127.0.0.1", free_port)]) == []
    problems = port_problems([PortUse("--console", "127.0.0.1", busy_port), PortUse("--openpi-port", "127.0.0.1",
                                                                                     busy_port)])
    assert problems[0].startswith(f"--console: port {busy_port} on 127.0.0.1 is in use")
    assert problems[1] == f"--console and --openpi-port both use port {busy_port}: give each its own"


# ------------------------------------------------------------------------- files read once, safely (issue 40)
def _refusal(path) -> str:
    from oxygen_ros.params_yaml import read_file

    given, problems = read_file(path)
    assert given == [] and len(problems) == 1, problems
    assert "\n" not in problems[0] and len(problems[0]) < 300, problems[0]
    return problems[0]


def test_alias_bombs_deep_nesting_and_non_utf8_are_one_line_refusals_without_building_anything(tmp_path):
    """Before: a 632-byte alias bomb was still being expanded after 45 s at 740 MB, a recursive alias, 10,000
    levels and non-UTF-8 bytes each ended in a traceback. rcl's parser expands no alias: refused at the first."""
    import tracemalloc

    bomb = "a: &a [x, x, x, x, x, x, x, x, x]\n" + "".join(
        f"{chr(98 + i)}: &{chr(98 + i)} [*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, "
        f"*{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}, *{chr(97 + i)}]\n" for i in range(9))
    bomb_file = write(tmp_path / "bomb.yaml", "oxygen_engine:\n  ros__parameters:\n" +
                      "".join("    " + line + "\n" for line in bomb.splitlines()))
    assert len(Path(bomb_file).read_bytes()) < 1000                  # 9^10 strings once expanded
    tracemalloc.start()
    try:
        said = _refusal(bomb_file)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert said == f"{bomb_file}:4:12: not valid YAML: an alias (*a): ROS's parameter parser reads none; write the value"
    assert peak < 4 << 20, f"{peak >> 20} MB while refusing it"
    recursive = write(tmp_path / "recursive.yaml", "oxygen_engine:\n  ros__parameters: &p\n    seed: *p\n")
    assert _refusal(recursive) == (f"{recursive}:3:11: not valid YAML: an alias (*p): ROS's parameter parser "
                                   "reads none; write the value")
    deep = write(tmp_path / "deep.yaml", "oxygen_engine:\n  ros__parameters:\n    seed: " + "[" * 10_000 + "]" * 10_000)
    assert _refusal(deep).startswith(f"{deep}:3:") and _refusal(deep).endswith("nested deeper than 32 levels")
    latin1 = tmp_path / "latin1.yaml"
    latin1.write_bytes(b"oxygen_engine:\n  ros__parameters:\n    prompt: caf\xe9\n")
    assert _refusal(latin1) == (f"{latin1}:3: not UTF-8 text (byte 0xe9); ROS parameters files are UTF-8")


def test_a_fifo_a_device_or_a_huge_file_is_refused_at_once(tmp_path):
    """Before: a FIFO given as the params file hung the start (and Ctrl-C did not stop it)."""
    from oxygen_ros.params_yaml import MAX_PARAMS_BYTES

    fifo = tmp_path / "params.yaml"
    os.mkfifo(fifo)
    assert _refusal(fifo) == f"{fifo}: cannot read the parameters file: is a FIFO, not a regular file"
    assert _refusal("/dev/zero") == "/dev/zero: cannot read the parameters file: is a device, not a regular file"
    huge = tmp_path / "huge.yaml"
    with open(huge, "wb") as f:
        f.truncate(1 << 30)
    assert _refusal(huge) == (f"{huge}: cannot read the parameters file: {1 << 30} bytes, more than the "
                              f"{MAX_PARAMS_BYTES} such a file may have")


def test_the_checker_and_rcl_see_the_same_parameters(tmp_path):
    """Two ros__parameters blocks under one node (rcl applies both, the checker saw the last: a misspelled
    upper_limit in the first went unseen), a name given twice, a NUL inside a quoted string (checked whole,
    applied cut at the NUL): each refused with its file and line."""
    from oxygen_ros.param_files import check

    two = write(tmp_path / "two.yaml", "oxygen_action:\n  ros__parameters:\n    upper_limit: [0.1]\n"
                                       "  ros__parameters:\n    replan_steps: 2\n")
    assert check([two]).problems == [f"{two}:4: oxygen_action: a second ros__parameters block (the first at line "
                                     "2): rcl applies both; write one"]
    twice = write(tmp_path / "twice.yaml", "oxygen_action:\n  ros__parameters:\n    replan_steps: 2\n"
                                           "    replan_steps: 3\n")
    assert check([twice]).problems == [f"{twice}:4: oxygen_action.replan_steps: given twice under one node "
                                       "(first at line 3); write it once"]
    nul = write(tmp_path / "nul.yaml", 'oxygen_engine:\n  ros__parameters:\n    prompt: "pick\\0 the cube"\n'
                                       '    robots: ["a\\0b"]\n')
    assert check([nul]).problems == [
        f"{nul}:3: oxygen_engine.prompt: a NUL character in a string: rcl would cut it there",
        f"{nul}:4: oxygen_engine.robots: a NUL character in a string: rcl would cut it there"]


def test_the_fleet_reads_the_files_with_the_checkers_reader_and_rcls_types(tmp_path):
    from oxygen_ros.nodes.fleet import ParamsFiles

    params = write(tmp_path / "fleet.yaml", "oxygen_engine:\n  ros__parameters:\n    robots: [arm_a]\n"
                                            "    arm_a: {robot_config: droid, norm_stats: 'on', asset_id: 1_000}\n"
                                            "/arm_a/oxygen_action:\n  ros__parameters: {replan_steps: 0x10, "
                                            "rate: 1e3, flag: Off}\n")
    files = ParamsFiles([params])
    # PyYAML 1.1 reads 'on' quoted as 'on' too, but 1_000 as 1000 and Off as False; rcl: '1_000', 16, 1000.0, False
    assert files.engine() == {"robots": ["arm_a"], "arm_a.robot_config": "droid", "arm_a.norm_stats": "on",
                              "arm_a.asset_id": "1_000"}
    assert files.node("/arm_a/oxygen_action") == {"replan_steps": 16, "rate": 1000.0, "flag": False}
    fifo = tmp_path / "fifo.yaml"
    os.mkfifo(fifo)
    assert ParamsFiles([fifo]).problems == [f"{fifo}: cannot read the parameters file: is a FIFO, not a regular file"]


# ----------------------------------------------------------------- sections of other nodes (issue 41 item 4)
def test_a_parameter_in_another_nodes_section_names_its_node_and_hints_only_close_names(tmp_path):
    from oxygen_ros.param_files import check

    params = write(tmp_path / "mixed.yaml", "oxygen_engine:\n  ros__parameters:\n    hold_timeout_s: 2.0\n"
                                            "oxygen_camera:\n  ros__parameters:\n    rate_hz: 1.0\n"
                                            "oxygen_engin:\n  ros__parameters:\n    seed: 1\n"
                                            "robot_state_publisher:\n  ros__parameters:\n    publish_frequency: 20.0\n"
                                            "    use_tf_static: true\n"
                                            "/camera/realsense2_camera:\n  ros__parameters: {enable_depth: false}\n")
    report = check([params])
    assert report.problems[0] == f"{params}:3: oxygen_engine.hold_timeout_s: belongs to oxygen_action (write it under oxygen_action:)"
    assert report.problems[1].startswith(f"{params}:4: oxygen_camera: unknown node (this package's: oxygen_engine, ")
    assert "did you mean" not in report.problems[1]            # every node name shares oxygen_: no hint from that
    assert report.problems[2] == f"{params}:7: oxygen_engin: unknown node (did you mean oxygen_engine?)"
    assert len(report.problems) == 3
    # ROS 2 lets each node take its own section from a shared file: other packages' sections are listed once
    assert report.others == [f"{params}:10: robot_state_publisher: not a node of this package (left to its own node)",
                             f"{params}:14: /camera/realsense2_camera: not a node of this package (left to its own node)"]


@pytest.mark.parametrize("module,extra", [("oxygen_ros.bringup", ["--robot", "demo", "--duration", "1"]),
                                           ("oxygen_ros.serve", ["--robot", "demo", "--port", "0"])])
def test_bringup_and_serve_say_another_packages_section_once_and_refuse_only_this_packages_mistakes(
        tmp_path, module, extra):
    params = write(tmp_path / "shared.yaml", "robot_state_publisher:\n  ros__parameters:\n    publish_frequency: 20.0\n"
                                             "oxygen_engine:\n  ros__parameters:\n    kv_budget_mb: lots\n")
    r = run(module, *extra, "--params-file", params)
    assert r.returncode == 2, r.stdout + r.stderr
    said = f"{params}:1: robot_state_publisher: not a node of this package (left to its own node)"
    assert (r.stdout + r.stderr).count(said) == 1, r.stdout + r.stderr
    assert refused_lines(r.stderr) == [f"{params}:6: oxygen_engine.kv_budget_mb = 'lots': must be a float such as 256.0"]


def test_did_you_mean_only_for_a_name_a_typo_away():
    from oxygen_ros.param_files import _did_you_mean

    nodes = ["oxygen_engine", "oxygen_action", "oxygen_recorder", "oxygen_view"]
    assert _did_you_mean("oxygen_engin", nodes) == " (did you mean oxygen_engine?)"
    assert _did_you_mean("oxygen_acton", nodes) == " (did you mean oxygen_action?)"
    for far in ("oxygen_camera", "oxygen_record_node", "oxygen_", "camera"):
        assert _did_you_mean(far, nodes) == "", far
    assert _did_you_mean("upper_limit", ["upper_limits", "lower_limits"]) == " (did you mean upper_limits?)"
    assert _did_you_mean("hold_timeout_s", ["max_timeout_s", "seed"]) == ""
    assert _did_you_mean("rate", ["rate_hz", "seed"]) == ""       # 3 edits from a short name
