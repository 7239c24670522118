"""Installing from the public package index, as a user's machine does (no local wheels, no pip config).

- The requirement files hold each pin once, and requirements-python.txt (what a ROS 2 distro install takes)
  no ROS wheels.
- Every pin resolves for Python 3.10, 3.11 and 3.12 together with what the pinned packages require (torch
  2.13.0 requires triton==3.7.1): a dry run of pip with each interpreter, metadata only, nothing installed.
- scripts/setup.sh names an unreachable torch index in a few lines, without pip's retries and traceback.
- A smoke run on Python 3.10 (CI's suite runs on 3.11): scripts/setup.sh into a copy of the repository, then
  the tests that need no torch. PyPI's torch for Linux is the CUDA build (about 2.7 GB with its NVIDIA
  wheels), so the smoke run installs none (OXYGEN_TORCH=skip); what it covers and leaves out:
  docs/tests.md#installation.

Needs the public index (PyPI) and, for each Python version, its interpreter (python3.X on PATH or a pyenv
version); a missing interpreter skips that version's tests and says so."""
from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

REPO = Path(__file__).resolve().parents[1]
PYTHONS = ("3.10", "3.11", "3.12")
SMOKE_PYTHON = "3.10"     # the one Python with its own pins (requirements-python.txt) and Ubuntu 22.04's (Humble)
# The tests that import no torch: robot I/O, parameter descriptors, the console's request checks, sessions,
# progress, the simulated robot (MuJoCo), the interface package through rclpy.
SMOKE_TESTS = ["test_robot_chunks.py", "test_robot_images.py", "test_robot_limits_ee.py", "test_robot_stamps.py",
               "test_robot_state_text.py", "test_robot_sync.py", "test_robot_watch_rate.py", "test_params.py",
               "test_console_guard.py", "test_sessions.py", "test_progress.py", "test_sim_robot.py",
               "test_interfaces.py"]
SMOKE_NEEDS_TORCH = [  # in those files, the tests that start the engine node (it imports torch)
    "test_params.py::test_ros2_param_describe_shows_the_bounds",
    "test_console_guard.py::test_the_safe_stop_is_cleared_deliberately_and_output_stays_off"]
COPY_IGNORE = shutil.ignore_patterns(".venv", ".git", "build", "install", "log", "__pycache__", "*.egg-info",
                                     ".pytest_cache", "out", ".gpu", ".whl")


def interpreter(version: str) -> str | None:
    """python<version> from PATH, else the newest pyenv <version>.x; None when neither runs."""
    pyenv = Path(os.environ.get("PYENV_ROOT", Path.home() / ".pyenv"))
    candidates = [shutil.which(f"python{version}")]
    candidates += sorted(glob.glob(str(pyenv / "versions" / f"{version}.*" / "bin" / f"python{version}")),
                         key=lambda p: [int(x) for x in re.findall(r"\d+", Path(p).parents[1].name)], reverse=True)
    for exe in filter(None, candidates):
        r = subprocess.run([exe, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                           capture_output=True, text=True)
        if r.returncode == 0 and r.stdout.strip() == version:
            return exe
    return None


def require_interpreter(version: str) -> str:
    exe = interpreter(version)
    if exe is None:
        pytest.skip(f"no Python {version} here (python{version} on PATH or a pyenv version)")
    return exe


def public_index_env(**extra) -> dict:
    """The environment without pip's configuration: what a user's machine resolves (PyPI only)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env.update(PIP_CONFIG_FILE=os.devnull, PIP_DISABLE_PIP_VERSION_CHECK="1", **extra)
    env.pop("VIRTUAL_ENV", None)
    return env


def requirement_lines(path: Path) -> list[str]:
    """The requirement lines of one file (comments, blank lines and -r includes left out)."""
    lines = (line.split(" #")[0].strip() for line in path.read_text().splitlines())
    return [line for line in lines if line and not line.startswith(("#", "-"))]


def pins(path: Path, version: str) -> dict[str, str]:
    """{package: pinned version} of a requirement file for one Python version (its markers evaluated)."""
    out = {}
    for line in requirement_lines(path):
        req = Requirement(line)
        if req.marker is None or req.marker.evaluate({"python_version": version, "python_full_version": f"{version}.0"}):
            name = canonicalize_name(req.name)
            assert name not in out, f"{path.name}: two pins of {req.name} apply on Python {version}"
            (spec,) = req.specifier
            assert spec.operator == "==", f"{path.name}: {line!r} is not a pin (==)"
            out[name] = spec.version
    return out


def test_each_pin_has_one_source_and_the_python_only_file_has_no_ros():
    files = {name: REPO / name for name in ("requirements.txt", "requirements-python.txt", "requirements-nodeps.txt")}
    assert "-r requirements-python.txt" in files["requirements.txt"].read_text().splitlines()
    seen: dict[str, str] = {}
    for fname, path in files.items():
        names = {canonicalize_name(Requirement(line).name) for line in requirement_lines(path)}
        for name in names:
            assert name not in seen, f"{name} is pinned in both {seen[name]} and {fname}"
            seen[name] = fname
        for version in PYTHONS:       # every package has exactly one pin on each Python
            assert set(pins(path, version)) == names, (fname, version)
    ros = [n for n, f in seen.items() if f == "requirements-python.txt" and n.startswith(("ros-", "colcon", "rclpy"))]
    assert not ros, f"requirements-python.txt is for ROS 2 distro installs and must not pull ROS wheels: {ros}"


@pytest.mark.parametrize("version", PYTHONS)
def test_every_pin_resolves_from_the_public_index(version, tmp_path):
    exe = require_interpreter(version)
    report = tmp_path / "report.json"
    # --python: resolve for that interpreter (its tags and markers). fast-deps: read each wheel's metadata
    # with HTTP range requests instead of downloading it (torch alone is 0.5 GB).
    pip = [sys.executable, "-m", "pip", "--isolated", "--python", exe, "install", "--dry-run", "--ignore-installed",
           "--use-feature=fast-deps"]
    r = subprocess.run(pip + ["--report", str(report), "-r", "requirements.txt"], cwd=REPO, env=public_index_env(),
                       capture_output=True, text=True, timeout=900)
    errors = "\n".join(line for line in r.stderr.splitlines() if line.startswith("ERROR"))
    assert r.returncode == 0, f"Python {version}: the pins do not resolve from the public index:\n{errors or r.stderr[-3000:]}"
    resolved = {canonicalize_name(item["metadata"]["name"]): item["metadata"]["version"]
                for item in json.loads(report.read_text())["install"]}
    expected = pins(REPO / "requirements-python.txt", version) | pins(REPO / "requirements.txt", version)
    assert {name: resolved.get(name) for name in expected} == expected
    assert resolved["triton"] == expected["triton"]           # the triton torch asks for is ours

    r = subprocess.run(pip + ["--no-deps", "-r", "requirements-nodeps.txt"], cwd=REPO, env=public_index_env(),
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, f"Python {version}: requirements-nodeps.txt: {r.stderr[-2000:]}"


def copy_of_repo(tmp_path: Path) -> Path:
    dest = tmp_path / "oxygen_ros"
    shutil.copytree(REPO, dest, ignore=COPY_IGNORE)
    return dest


def test_setup_names_an_unreachable_torch_index_in_a_few_lines(tmp_path):
    repo = copy_of_repo(tmp_path)
    env = public_index_env(PYTHON=sys.executable, OXYGEN_TORCH="cpu",
                           OXYGEN_TORCH_CPU_INDEX="http://127.0.0.1:9/whl/cpu")   # nothing listens on port 9
    r = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, env=env, capture_output=True, text=True, timeout=600)
    out = r.stdout + r.stderr
    assert r.returncode == 1, out
    assert "torch: 2.13.0, the CPU build (OXYGEN_TORCH=cpu)" in out, out
    assert "error: torch 2.13.0 from PyTorch's CPU index: cannot reach 127.0.0.1" in out, out
    assert "OXYGEN_TORCH=cuda" in out and "OXYGEN_TORCH=skip" in out, out    # what to do instead
    assert "Traceback" not in out and "Retrying" not in out, out
    assert len(out.splitlines()) <= 15, out


def test_setup_and_the_torch_free_tests_on_another_python(tmp_path):
    """setup.sh on Python 3.10 from the public index (without torch), then the tests that import no torch."""
    exe = require_interpreter(SMOKE_PYTHON)
    repo = copy_of_repo(tmp_path)
    try:
        r = subprocess.run(["bash", "scripts/setup.sh"], cwd=repo, env=public_index_env(PYTHON=exe, OXYGEN_TORCH="skip"),
                           capture_output=True, text=True, timeout=1800)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        assert f"creating .venv with Python {SMOKE_PYTHON}" in r.stdout
        assert "warning: OXYGEN_TORCH=skip and .venv has no torch" in r.stdout
        # --noconftest: conftest.py builds the torch fixtures; these tests use none of them.
        r = subprocess.run([str(repo / ".venv/bin/python"), "-m", "pytest", "-q", "-p", "no:cacheprovider",
                            "--noconftest", *[f"test/{f}" for f in SMOKE_TESTS],
                            *[f"--deselect=test/{t}" for t in SMOKE_NEEDS_TORCH]],
                           cwd=repo, env=public_index_env(), capture_output=True, text=True,
                           timeout=900)
        assert r.returncode == 0, r.stdout[-5000:] + r.stderr[-2000:]
        assert re.search(r"\d+ passed", r.stdout) and "skipped" not in r.stdout, r.stdout[-2000:]
    finally:
        shutil.rmtree(repo, ignore_errors=True)      # its .venv is ~1 GB: not kept with pytest's temp folders
