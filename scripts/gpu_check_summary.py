"""summary.json of scripts/gpu_check.sh: the environment and each step's outcome, rewritten after every step
(a run cut short still says what it did). Standard library only, plus torch/triton when importable: it
must work on any GPU machine's python as it is, and report a broken torch rather than fail with it."""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

LOG_TAIL_LINES = 40


def _run(cmd: list[str]) -> str | None:
    try:
        return subprocess.run(cmd, capture_output=True, text=True, timeout=20).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def environment(device: str, root: Path) -> dict:
    env = {"date_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
           "python": platform.python_version(), "platform": platform.platform(), "cpus": os.cpu_count(),
           "requested_device": device,
           "git_commit": _commit(root),
           "nvidia_smi": _run(["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
                               "--format=csv,noheader"])}
    for module in ("numpy", "safetensors", "sentencepiece", "pytest", "xdist", "yaml"):
        env[module] = _version(module)
    try:
        import torch

        env["torch"] = torch.__version__
        env["cuda_runtime"] = torch.version.cuda
        env["cuda_available"] = torch.cuda.is_available()
        if torch.cuda.is_available():
            props = torch.cuda.get_device_properties(0)
            env["gpu"] = {"name": props.name, "capability": f"{props.major}.{props.minor}",
                          "sms": props.multi_processor_count, "memory_gib": round(props.total_memory / 2**30, 1)}
    except Exception as e:  # a broken torch is what this file must report, not die of
        env["torch"] = f"import failed: {e!r}"
    env["triton"] = _version("triton")
    return env


def _commit(root: Path) -> str | None:
    """From git where the history is there, else what scripts/gpu_prepare.sh wrote for a copy without it."""
    commit = _run(["git", "-C", str(root), "rev-parse", "HEAD"])
    marker = root / ".gpu" / "commit"
    if commit is None and marker.exists():
        commit = " ".join(marker.read_text().split())
    return commit


def _version(module: str) -> str | None:
    try:
        return getattr(__import__(module), "__version__", "present")
    except Exception as e:
        return None if isinstance(e, ImportError) else f"import failed: {e!r}"


def steps(table: Path, logs: Path) -> list[dict]:
    out = []
    for line in table.read_text().splitlines():
        name, rc, seconds, limit = line.split("\t")
        rec = {"name": name, "status": "skipped (budget spent)" if rc == "skipped" else
               "ok" if rc == "0" else "timed out" if rc in ("124", "137") else f"failed (exit {rc})",
               "exit_code": None if rc == "skipped" else int(rc), "seconds": int(seconds), "limit_s": int(limit)}
        log = logs / f"{name}.log"
        if log.exists():
            rec["log_tail"] = log.read_text(errors="replace").splitlines()[-LOG_TAIL_LINES:]
        out.append(rec)
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument("--steps", type=Path, required=True, help="the step table (name, exit, seconds, limit)")
    p.add_argument("--logs", type=Path, required=True, help="folder of <step>.log")
    p.add_argument("--device", default="cuda")
    p.add_argument("--root", type=Path, required=True)
    a = p.parse_args()
    cached = a.logs / "environment.json"   # read once per run (importing torch takes seconds)
    if cached.exists():
        env = json.loads(cached.read_text())
    else:
        env = environment(a.device, a.root)
        cached.write_text(json.dumps(env))
    done = steps(a.steps, a.logs)
    summary = {"environment": env, "steps": done,
               "all_ok": bool(done) and all(s["status"] == "ok" for s in done),
               "results": sorted(f.name for f in a.out.glob("*.json") if f.name != "summary.json")}
    tmp = a.out / "summary.json.tmp"
    tmp.write_text(json.dumps(summary, indent=1) + "\n")
    tmp.replace(a.out / "summary.json")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
