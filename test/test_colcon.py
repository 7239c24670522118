"""The ROS install path: colcon builds this workspace (both packages, the ament_python and the rosidl
one), and the installed `oxygen_bringup` finds its robot config in the package's share directory through
the ament index, as `ros2 launch oxygen_ros oxygen.launch.py` runs it.

The ROS 2 here is the PyPI wheels in the venv, so AMENT_PREFIX_PATH points at the venv (where they keep
their share/ament_index) — the same role /opt/ros/<distro> plays on a robot."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

from conftest import REPO
from ros_harness import private_domain  # a domain of this test process: no other bringup on it

IGNORE = shutil.ignore_patterns(".venv", ".git", "build", "install", "log", "__pycache__", "*.egg-info",
                                ".pytest_cache", "out")


def test_colcon_build_and_the_installed_bringup_starts_from_its_share_directory(tmp_path):
    ws = tmp_path / "ws"
    shutil.copytree(REPO, ws / "src" / "oxygen_ros", ignore=IGNORE)
    env = dict(os.environ, AMENT_PREFIX_PATH=sys.prefix, ROS_DOMAIN_ID=str(private_domain(93)), PYTHONUNBUFFERED="1",
               OMP_NUM_THREADS="1")
    env.pop("PYTHONPATH", None)
    colcon = Path(sys.executable).parent / "colcon"
    r = subprocess.run([str(colcon), "build", "--paths", "src/oxygen_ros", "src/oxygen_ros/oxygen_interfaces"],
                       cwd=ws, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "2 packages finished" in r.stdout, r.stdout[-2000:]

    install = ws / "install"
    share = install / "oxygen_ros" / "share" / "oxygen_ros"
    for f in ("package.xml", "launch/oxygen.launch.py", "config/demo.yaml", "config/droid.yaml",
              "config/aloha.yaml", "config/libero.yaml"):
        assert (share / f).is_file(), f
    assert (install / "oxygen_ros" / "share" / "ament_index" / "resource_index" / "packages" / "oxygen_ros").is_file()
    assert (install / "oxygen_interfaces" / "share" / "oxygen_interfaces" / "msg" / "ActionChunk.msg").is_file()
    bringup = install / "oxygen_ros" / "lib" / "oxygen_ros" / "oxygen_bringup"
    assert bringup.is_file()

    # Run from outside any checkout, with the workspace sourced as a robot would.
    script = (f". {install}/setup.bash && python -c 'import oxygen_ros; print(\"module\", oxygen_ros.__file__)' && "
              f"{bringup} --robot demo --duration 3")
    r = subprocess.run(["bash", "-c", script], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"module {install}/oxygen_ros/lib/" in r.stdout, r.stdout
    assert f"robot config {share}/config/demo.yaml" in r.stdout, r.stdout
    assert "oxygen_bringup: running" in r.stdout and "oxygen_bringup: stopped" in r.stdout
    assert "Traceback" not in r.stderr
