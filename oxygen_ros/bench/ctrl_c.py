"""`python -m oxygen_ros.bench.ctrl_c`: how long after a Ctrl-C (SIGINT) the start of `oxygen_bringup` and
`oxygen_serve` ends (target: within 2 s), for a signal during the imports and one during the model load.

Each run starts the command on the demo checkpoint in a subprocess and sends SIGINT:
- imports: as soon as the robot config line is printed (torch and the node set are still being imported);
- load: 1 s after the engine says it loads the model, the checkpoint read at --tensor-s seconds a tensor (the
  demo's 111 tensors at 0.5 s: a load of about a minute, as a full-size π0.5 read from disk; the largest
  π0.5 tensor, the 1 GB embedding, takes about that long to read).
It records the time from the signal to the process's exit, the exit code (130: a start stopped by a signal)
and what ended it: the start's own checks ("interrupted while starting") or the grace timer ("did not stop
within"). The load average is written beside the figures: on a busy machine the timer thread waits for a CPU.
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np

class ReadHook:
    """A safetensors handle (model.checkpoint._open's) whose get_tensor calls `before(key)` first: a slowed or
    counted checkpoint read, for this benchmark and the load-stop tests."""

    def __init__(self, handle, before):
        self.handle, self.before = handle, before

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return self.handle.__exit__(*exc)

    def __getattr__(self, name):
        return getattr(self.handle, name)

    def get_tensor(self, key):
        self.before(key)
        return self.handle.get_tensor(key)


SLOWED_START = """
import sys, time
from oxygen_ros.bench.ctrl_c import ReadHook
from oxygen_ros.model import checkpoint
open_file = checkpoint._open
checkpoint._open = lambda f: ReadHook(open_file(f), lambda key: time.sleep({tensor_s}))
from oxygen_ros.{module} import main
sys.argv[0] = "{module}"
raise SystemExit(main(sys.argv[1:]))
"""
COMMANDS = {"oxygen_bringup": ("bringup", ["--demo", "--duration", "120", "--status-period", "0"]),
            "oxygen_serve": ("serve.cli", ["--robot", "demo", "--port", "0"])}
MOMENTS = {"imports": ": robot config", "load": "[oxygen_engine]: loading model demo from"}


def one_run(prog: str, moment: str, tensor_s: float, domain: int) -> dict:
    module, args = COMMANDS[prog]
    env = dict(os.environ, ROS_DOMAIN_ID=str(domain), PYTHONUNBUFFERED="1")
    proc = subprocess.Popen([sys.executable, "-c", SLOWED_START.format(module=module, tensor_s=tensor_s), *args],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    seen = threading.Event()

    def read():
        for line in proc.stdout:
            lines.append(line.rstrip("\n"))
            if MOMENTS[moment] in line:
                seen.set()
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    if not seen.wait(120):
        proc.kill()
        raise RuntimeError(f"{prog} never printed {MOMENTS[moment]!r}:\n" + "\n".join(lines[-20:]))
    if moment == "load":
        time.sleep(1.0)                                   # a few tensors in
    proc.send_signal(signal.SIGINT)
    signalled = time.monotonic()
    code = proc.wait(120)
    ended_s = time.monotonic() - signalled
    reader.join(5)
    out = "\n".join(lines)
    return {"ended_s": round(ended_s, 3), "exit_code": code,
            "ended_by": "grace timer" if "did not stop within" in out else
                        "start's checks" if "interrupted while starting" in out else "other"}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m oxygen_ros.bench.ctrl_c", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5, help="runs per command and moment")
    parser.add_argument("--tensor-s", type=float, default=0.5, help="seconds to read each checkpoint tensor")
    parser.add_argument("--domain", type=int, default=77, help="ROS_DOMAIN_ID of the runs (a free one)")
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args(argv)
    results = {"what": "seconds from SIGINT to the exit of a start, per command and moment (bench/ctrl_c.py)",
               "target_s": 2.0, "tensor_s": args.tensor_s, "load_average_before": os.getloadavg(), "cases": {}}
    for prog in COMMANDS:
        for moment in MOMENTS:
            runs = [one_run(prog, moment, args.tensor_s, args.domain) for _ in range(args.runs)]
            times = [r["ended_s"] for r in runs]
            case = {"runs": runs, "min_s": min(times), "median_s": float(np.median(times)), "max_s": max(times),
                    "within_target": sum(t <= results["target_s"] for t in times),
                    "exit_codes": sorted({r["exit_code"] for r in runs})}
            results["cases"][f"{prog} {moment}"] = case
            print(f"{prog:15s} {moment:8s} median {case['median_s']:.2f} s, max {case['max_s']:.2f} s, "
                  f"{case['within_target']}/{len(runs)} within {results['target_s']:g} s, exit {case['exit_codes']}",
                  flush=True)
    results["load_average_after"] = os.getloadavg()
    if args.json:
        args.json.write_text(json.dumps(results, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
