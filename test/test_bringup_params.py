"""oxygen_bringup refuses to start on bad or inconsistent parameters, naming every problem, one per line,
before anything moves (no DDS traffic needed: it exits while building its nodes)."""
import os
import subprocess
import sys

from conftest import REPO
from ros_harness import private_domain  # a domain of this test process: no other bringup on it


def bringup(*args, timeout=120):
    env = dict(os.environ, ROS_DOMAIN_ID=str(private_domain(91)), PYTHONUNBUFFERED="1")
    return subprocess.run([sys.executable, "-m", "oxygen_ros.bringup", *args, "--duration", "1"], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def test_a_robot_config_without_its_files_refuses_with_each_missing_file():
    r = bringup("--robot", "libero")
    assert r.returncode == 2, r.stdout + r.stderr
    err = r.stderr
    assert "refusing to start, bad parameters" in err
    for line in ("checkpoint not found: /opt/models/pi05_libero_pytorch",
                 "tokenizer not found: /opt/models/paligemma_tokenizer.model",
                 "norm_stats not found: /opt/models/pi05_libero_pytorch"):
        assert line in err


def test_a_horizon_that_contradicts_the_checkpoint_is_refused(tmp_path):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "config.json").write_text('{"action_horizon": 50, "action_dim": 32}')  # openpi's conversion
    params = tmp_path / "bad.yaml"
    params.write_text(f"oxygen_engine:\n  ros__parameters:\n    checkpoint: {checkpoint}\n    action_horizon: 10\n")
    r = bringup("--robot", "demo", "--params-file", str(params))
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"action_horizon 10 differs from the checkpoint's 50 ({checkpoint}/config.json)" in r.stderr
    assert "Traceback" not in r.stderr


def test_problems_of_every_node_are_listed_together(tmp_path):
    params = tmp_path / "bad.yaml"
    params.write_text("""
oxygen_observation:
  ros__parameters:
    cameras:
      base_0_rgb: {topic: ""}
      left_wrist_0_rgb: {topic: ""}
      right_wrist_0_rgb: {required: true}
oxygen_action:
  ros__parameters:
    action_rate_hz: 50.0
    joint_names: [a, b]
    interpolate: [true]
""")
    r = bringup("--robot", "demo", "--params-file", str(params))
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stderr.splitlines()
    for expected in ("camera slot right_wrist_0_rgb is required but has no topic",
                     "no camera topic configured (cameras.<slot>.topic)",
                     "joint_names has 2 names, the actions have 3 dimensions",
                     "action_rate_hz 50.0 differs from the engine's 70.0",
                     "interpolate has 1 entries, the actions have 3 dimensions"):
        assert any(expected in line for line in lines), r.stderr
    assert "Traceback" not in r.stderr


def test_corrupt_files_refuse_the_start_with_one_line_each(tmp_path):
    # Before: a corrupt tokenizer raised RuntimeError from sentencepiece, a corrupt safetensors file a
    # SafetensorError: both printed a traceback instead of the parameter error.
    tokenizer = tmp_path / "tokenizer.model"
    tokenizer.write_bytes(b"garbage" * 10)
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    (checkpoint / "model.safetensors.index.json").write_text('{"weight_map": {"a": "../secret.safetensors"}}')
    for key, value, expected in (("tokenizer", tokenizer, f"{tokenizer}: not a SentencePiece model"),
                                 ("checkpoint", checkpoint, "shard name '../secret.safetensors' is not a file name")):
        params = tmp_path / f"{key}.yaml"
        params.write_text(f"oxygen_engine:\n  ros__parameters:\n    {key}: {value}\n")
        r = bringup("--robot", "demo", "--params-file", str(params))
        assert r.returncode == 2, r.stdout + r.stderr
        assert "refusing to start, bad parameters" in r.stderr and expected in r.stderr, r.stderr
        assert "Traceback" not in r.stderr


def test_real_robot_configs_pass_every_parameter_check(tmp_path):
    """droid, aloha, libero and so101 as shipped (transforms, gripper units, camera rotation, control period,
    interpolation mask, replan steps) start with the tiny model in place of the checkpoint."""
    params = tmp_path / "tiny.yaml"
    params.write_text("oxygen_engine:\n  ros__parameters:\n    model: tiny\n    checkpoint: ''\n    tokenizer: ''\n"
                      "    norm_stats: ''\n    kv_budget_mb: 32.0\n")
    for robot in ("droid", "aloha", "libero", "so101"):
        r = bringup("--robot", robot, "--params-file", str(params))
        assert r.returncode == 0, (robot, r.stderr[-3000:])
        assert "Traceback" not in r.stderr


def test_a_missing_robot_config_is_refused_in_one_line(tmp_path, monkeypatch, capsys):
    from oxygen_ros import bringup as bringup_module
    from oxygen_ros.robot import configs

    monkeypatch.setattr(configs, "config_dirs", lambda: [tmp_path])
    assert bringup_module.main(["--robot", "droid"]) == 2
    err = capsys.readouterr().err.strip()
    assert err == f"oxygen_bringup: no robot config droid.yaml in {tmp_path}"


def test_a_recording_directory_that_cannot_be_created_is_refused(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    r = bringup("--robot", "demo", "--record", str(blocker / "bag"))
    assert r.returncode == 2, r.stdout + r.stderr
    assert f"oxygen_recorder.path '{blocker / 'bag'}': cannot record there:" in r.stderr
    assert "Traceback" not in r.stderr
