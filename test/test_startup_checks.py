"""Every check that needs no model runs before the load, and each refusal is printed once: a recording
directory that cannot be written, a console token file others can read, a checkpoint that is not there;
argument mistakes are answered before torch is imported. (A full-size π0.5 takes minutes to load: a
refusal after it costs those minutes.)"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import REPO
from ros_harness import private_domain  # a domain of this test process: no other bringup on it

LOADING = "[oxygen_engine]: loading model"


def bringup(*args, timeout=180):
    env = dict(os.environ, ROS_DOMAIN_ID=str(private_domain(92)), PYTHONUNBUFFERED="1")
    r = subprocess.run([sys.executable, "-m", "oxygen_ros.bringup", *args, "--duration", "1"], cwd=REPO, env=env,
                       capture_output=True, text=True, timeout=timeout)
    return r.returncode, r.stdout + r.stderr


def test_a_recording_directory_that_cannot_be_written_is_refused_before_the_load(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    code, out = bringup("--robot", "demo", "--record", str(blocker / "bag"))
    assert code == 2, out
    line = f"oxygen_recorder.path '{blocker / 'bag'}': cannot record there: {blocker} is not a directory"
    assert out.count(line) == 1 and LOADING not in out and "Traceback" not in out, out


def test_a_read_only_recording_folder_is_refused_before_the_load(tmp_path):
    if os.geteuid() == 0:
        pytest.skip("root writes into a read-only folder")
    folder = tmp_path / "read_only"
    folder.mkdir()
    folder.chmod(0o500)
    try:
        code, out = bringup("--robot", "demo", "--record", str(folder / "bag"))
    finally:
        folder.chmod(0o700)
    assert code == 2 and out.count(f"cannot record there: {folder} is not writable") == 1 and LOADING not in out, out


def test_a_console_token_file_readable_by_others_is_refused_before_the_load(tmp_path):
    token = tmp_path / "token"
    token.write_text("a-long-enough-console-token-0123456789\n")
    token.chmod(0o644)
    params = tmp_path / "console.yaml"
    params.write_text(f"oxygen_console:\n  ros__parameters:\n    token_file: {token}\n")
    code, out = bringup("--robot", "demo", "--console", "18080", "--params-file", str(params))
    assert code == 2, out
    line = f"oxygen_console.token_file {token} can be read by other users (mode 644): chmod 600 {token}"
    assert out.count(line) == 1 and LOADING not in out and "Traceback" not in out, out


def test_a_missing_checkpoint_is_named_once_before_the_load():
    code, out = bringup("--robot", "libero")
    assert code == 2, out
    for line in ("checkpoint not found: /opt/models/pi05_libero_pytorch",
                 "tokenizer not found: /opt/models/paligemma_tokenizer.model",
                 "norm_stats not found: /opt/models/pi05_libero_pytorch"):
        assert out.count(line) == 1, out
    assert "oxygen_bringup: refusing to start, bad parameters:" in out and LOADING not in out, out


def test_a_problem_found_at_configure_is_printed_once(tmp_path):
    """What only the engine node can find (the checkpoint's own files): its log lists it, the bringup's line
    points at that list instead of printing it again."""
    tokenizer = tmp_path / "tokenizer.model"
    tokenizer.write_bytes(b"garbage" * 10)
    params = tmp_path / "tokenizer.yaml"
    params.write_text(f"oxygen_engine:\n  ros__parameters:\n    tokenizer: {tokenizer}\n")
    code, out = bringup("--robot", "demo", "--params-file", str(params))
    assert code == 2, out
    assert out.count(f"{tokenizer}: not a SentencePiece model") == 1, out
    assert "oxygen_bringup: refusing to start, bad parameters (oxygen_engine's configure failed: above)" in out


def imports_torch_before_refusing(module: str, args: list[str]) -> tuple[bool, str]:
    """(whether torch was imported, the refusal) for `module`'s argument parsing of `args`."""
    code = (f"import sys\nfrom oxygen_ros.{module} import parse_args\n"
            f"try:\n    parse_args({args!r})\nexcept SystemExit:\n    print('torch' in sys.modules)\n")
    r = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    return r.stdout.strip() == "True", r.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("module", ["bringup", "serve.cli"])
def test_a_mistyped_robot_is_answered_without_importing_torch(module):
    torch_imported, refusal = imports_torch_before_refusing(module, ["--robot", "droidd"])
    assert "argument --robot: invalid choice: 'droidd'" in refusal
    assert not torch_imported


def test_lerobot_protocol_with_an_openpi_robot_points_to_so101():
    torch_imported, refusal = imports_torch_before_refusing("serve.cli", ["--protocol", "lerobot", "--robot", "droid"])
    assert refusal == ("oxygen_serve: error: --protocol lerobot --robot droid: LeRobot's robot_client is served for "
                       "--robot demo|so101 (a LeRobot checkpoint's joints and cameras); --robot droid serves openpi "
                       "clients (--protocol openpi)")
    assert not torch_imported


def test_server_defaults_come_from_the_servers_options():
    """The options parsed without their defaults (no server import before the checks) get ServeOptions' and
    LeRobotOptions' after; the help's port is the server's."""
    from oxygen_ros.bringup import parse_args as bringup_args
    from oxygen_ros.serve.cli import OPENPI_PORT, parse_args
    from oxygen_ros.serve.lerobot import LEROBOT_PORT
    from oxygen_ros.serve.lerobot.server import LeRobotOptions
    from oxygen_ros.serve.server import ServeOptions

    openpi, lerobot = ServeOptions(), LeRobotOptions()
    args, _ = parse_args(["--robot", "demo"])
    assert (args.host, args.port, args.max_clients, args.max_message_mb, args.reply_timeout) == \
        (openpi.host, openpi.port, openpi.max_clients, openpi.max_message_bytes / 2**20, openpi.reply_timeout_s)
    assert OPENPI_PORT == openpi.port and LEROBOT_PORT == lerobot.port
    assert parse_args(["--robot", "so101", "--protocol", "lerobot"])[0].port == lerobot.port
    assert parse_args(["--robot", "demo", "--max-clients", "3"])[0].max_clients == 3
    args, _ = bringup_args(["--demo"])
    assert (args.openpi_host, args.openpi_max_clients, args.lerobot_host, args.lerobot_max_clients) == \
        (openpi.host, openpi.max_clients, lerobot.host, lerobot.max_clients)


def test_so101_is_a_bringup_robot():
    """config/so101.yaml has its ROS topics: oxygen_bringup --robot so101 takes it (it was refused as an
    invalid choice while docs named the config)."""
    from oxygen_ros.bringup import parse_args

    assert parse_args(["--robot", "so101"])[0].robot == "so101"


def test_a_missing_adapter_base_is_named_before_the_load(tmp_path):
    from oxygen_ros.bringup import _file_problems

    missing = str(tmp_path / "pi05_base_copy")
    assert _file_problems({"checkpoint_base": missing}, {}, None) == [f"checkpoint_base not found: {missing}"]
    assert _file_problems({"checkpoint_base": "lerobot/pi05_base"}, {}, None) == []     # fetched by the node


def test_the_status_line_of_a_configuring_engine_shows_its_download():
    from types import SimpleNamespace

    from oxygen_ros.bringup import inactive_status
    from oxygen_ros.model.download import DownloadState
    from oxygen_ros.nodes.download_status import Downloads

    downloads = Downloads()
    node = SimpleNamespace(state_label="configuring", downloads=downloads)
    assert inactive_status(node) == "[status] oxygen_engine configuring"
    downloads.update("oxygen_ros: checkpoint download", DownloadState(
        "lerobot/pi05_base", "downloading", done=3_200_000_000, total=14_500_000_000, elapsed_s=80.0))
    line = inactive_status(node)
    expected = "[status] oxygen_engine configuring | downloading lerobot/pi05_base: 3.2 GB of 14.5 GB"
    assert line.startswith(expected), line
