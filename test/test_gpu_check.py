"""scripts/gpu_check.sh rehearsed on the CPU (GPU_CHECK_DEVICE=cpu): the plumbing a device run depends on —
the package staged without installing it, nothing imported that the device image lacks (ROS, transforms3d,
OpenCV, PyYAML are made unimportable here), results under $OUT within what a device run brings back (at
most 8 files, at most 2 folders down, plain names), a summary that says what ran, and the time budget that
keeps the script inside its caller's timeout."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# What the device image does not have (or need not have): any import of these fails the rehearsal.
ABSENT_ON_DEVICE = ("rclpy", "rosidl_runtime_py", "oxygen_interfaces", "transforms3d", "cv2", "yaml")

BLOCKER = f"""
import importlib.abc, sys
class _Absent(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name.split(".")[0] in {ABSENT_ON_DEVICE!r}:
            raise ImportError(f"{{name}} is not on the device image")
        return None
sys.meta_path.insert(0, _Absent())
"""


def run_check(tmp_path: Path, **env_vars) -> tuple[subprocess.CompletedProcess, Path]:
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER)
    out = tmp_path / "out"
    env = {k: v for k, v in os.environ.items() if k not in ("TRITON_INTERPRET", "OXYGEN_KERNEL_TEST_DEVICE")}
    env.update(OUT=str(out), PYTHON=sys.executable, GPU_CHECK_DEVICE="cpu", PYTHONPATH=str(site),
               OMP_NUM_THREADS="1", TMPDIR=str(tmp_path), **env_vars)
    proc = subprocess.run(["bash", str(REPO / "scripts" / "gpu_check.sh")], env=env, capture_output=True,
                          text=True, timeout=600)
    return proc, out


def assert_device_returnable(out: Path):
    files = [p for p in out.rglob("*") if p.is_file()]
    assert 0 < len(files) <= 8, files
    for f in files:
        rel = f.relative_to(out)
        assert len(rel.parts) <= 3, rel                     # $OUT/a/b/file at the deepest
        assert all(re.fullmatch(r"[A-Za-z0-9._-]+", part) for part in rel.parts), rel
        assert f.stat().st_size <= 16 * 2**20, rel


def test_rehearsal_stages_runs_and_reports(tmp_path):
    """One kernel test through the interpreter, the random weights saved and the eager benchmark loading them:
    every step ok, the bench JSON written, the environment recorded, the staging folder removed."""
    proc, out = run_check(tmp_path, GPU_CHECK_STEPS="kernel_tests,bench_eager",
                          GPU_CHECK_PYTEST_ARGS="-k test_norms_match_torch")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    steps = {s["name"]: s for s in summary["steps"]}
    assert list(steps) == ["kernel_tests", "weights", "bench_eager"], proc.stdout   # weights: background
    assert all(s["status"] == "ok" for s in steps.values()), json.dumps(summary["steps"], indent=1)
    assert summary["all_ok"]
    assert any("passed" in line for line in steps["kernel_tests"]["log_tail"])
    assert summary["results"] == ["bench_tiny_eager.json"]
    bench = json.loads((out / "bench_tiny_eager.json").read_text())
    assert bench["meta"]["weights"].endswith("weights_tiny") and bench["meta"]["cuda_graphs"] is False
    assert bench["meta"]["preset"] == "tiny" and bench["pool_empty_at_end"]
    assert bench["rtc_cost"]["plain_path"] == "eager" and bench["rtc_cost"]["rtc_vjp_ms"] > 0   # issue #22's cost
    env = summary["environment"]
    assert env["torch"] and env["triton"] and env["requested_device"] == "cpu" and env["yaml"] is None
    assert "===== bench_eager: exit 0" in (out / "steps.log").read_text()
    assert not list(tmp_path.glob("oxygen_gpu_check.*")), "the staging folder is left behind"
    assert_device_returnable(out)


def test_budget_spent_skips_steps_and_still_writes_the_summary(tmp_path):
    proc, out = run_check(tmp_path, GPU_CHECK_BUDGET_S="0")
    assert proc.returncode == 0, proc.stdout + proc.stderr
    summary = json.loads((out / "summary.json").read_text())
    assert [s["name"] for s in summary["steps"]] == ["weights", "kernel_tests", "microbench", "bench", "bench_eager", "fleet"]
    assert {s["status"] for s in summary["steps"]} == {"skipped (budget spent)"}
    assert not summary["all_ok"]
    assert_device_returnable(out)
