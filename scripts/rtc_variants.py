"""What was tried for issue #22 (docs/rtc.md, "What was tried"): at one delay, for each re-plan period,
naive, blend and RTC with the paper's settings, LeRobot 0.6.1's and the engine's (the same episodes, chunk
noise and re-plan period for every execution of a period).

    python scripts/rtc_variants.py --episodes 50 --seed 3000 --json docs/rtc_variants.json   # ~4 min, 2 cores

Each row: `python -m oxygen_ros.eval --delay-ticks D --replan R --execution E` with those RTC settings.
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict
from pathlib import Path

import torch

from oxygen_ros.eval import PAPER_RTC, RtcSettings, evaluate_execution

VARIANTS = {   # label: (execution, RTC settings)
    "naive": ("naive", RtcSettings()),
    "blend (5 ticks)": ("blend", RtcSettings()),
    "rtc, paper (vjp, exp, beta 5)": ("rtc", PAPER_RTC),
    "rtc, LeRobot 0.6.1 (error, linear, beta 10, horizon 10)": ("rtc", RtcSettings("linear", 10.0, 10, "error", 0)),
    "rtc, LeRobot's, horizon H - s": ("rtc", RtcSettings("linear", 10.0, 0, "error", 0)),
    "rtc, engine default (LeRobot's + 1 margin row)": ("rtc", RtcSettings()),
    "rtc, engine default, horizon H - s": ("rtc", RtcSettings(execution_horizon=0)),
}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--episodes", type=int, default=50)
    p.add_argument("--seed", type=int, default=3000)
    p.add_argument("--delay", type=int, default=6)
    p.add_argument("--replan", default="6,8,10", help="comma-separated re-plan periods (each >= the delay)")
    p.add_argument("--json", type=Path, default=None)
    a = p.parse_args()
    start, rows = time.monotonic(), []
    for replan in map(int, a.replan.split(",")):
        for label, (execution, settings) in VARIANTS.items():
            out = evaluate_execution(a.episodes, a.seed, replan=replan, delays=(a.delay,), executions=(execution,),
                                     settings=settings, log=lambda *_: None)
            s = out["execution"][execution][str(a.delay)]
            rows.append({"replan": replan, "variant": label, "execution": execution,
                         "rtc": asdict(settings) if execution == "rtc" else None, **s,
                         "boundary_over_within": s["boundary_jerk"] / s["within_jerk"]})
            print(f"replan {replan:2d}  {label:58s} success {s['success_rate']:.0%}  boundary "
                  f"{s['boundary_jerk']:.4f}  within {s['within_jerk']:.4f}  "
                  f"ratio {rows[-1]['boundary_over_within']:.2f}  all {s['mean_jerk']:.4f}", flush=True)
    result = {"episodes": a.episodes, "seed": a.seed, "delay_ticks": a.delay, "steps": 210, "blend_steps": 5,
              "rows": rows, "wall_s": round(time.monotonic() - start, 1),
              "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread"}
    if a.json:
        a.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
