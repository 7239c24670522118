"""docs/rtc_switch.png: one joint's commanded trace across a chunk switch at a delay of d ticks, naive vs
blend vs RTC (the paper's settings, LeRobot 0.6.1's, and the engine's: LeRobot's with one margin row), in
the first episode of the delay evaluation.

    python scripts/rtc_switch_plot.py --out docs/rtc_switch.png          # ~10 s on 2 cores

The episode, its chunk noise and the timing are those of `python -m oxygen_ros.eval --delay-ticks ...`
(seed 3000, episode 0): the chunk observed at tick t plays from tick t + d. The plotted joint is the one
whose command jumps most at naive's first chunk-to-chunk switch.
"""
from __future__ import annotations

import argparse
from pathlib import Path

import matplotlib
import numpy as np

from oxygen_ros.eval import PAPER_RTC, RtcSettings, evaluate_execution

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

VARIANTS = {   # label: (execution, RTC settings)
    "naive": ("naive", RtcSettings()),
    "blend (5 ticks)": ("blend", RtcSettings()),
    "rtc, paper (VJP, exp, beta 5)": ("rtc", PAPER_RTC),
    "rtc, LeRobot 0.6.1 (error, linear, beta 10)": ("rtc", RtcSettings(margin_rows=0)),
    "rtc, engine default (LeRobot's + 1 margin row)": ("rtc", RtcSettings()),
}
COLOURS = ("tab:red", "tab:orange", "tab:blue", "tab:green", "tab:purple")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", type=Path, default=Path("docs/rtc_switch.png"))
    p.add_argument("--delay", type=int, default=6)
    p.add_argument("--seed", type=int, default=3000)
    a = p.parse_args()
    traces = {}
    for label, (execution, settings) in VARIANTS.items():
        run: dict = {}
        evaluate_execution(1, a.seed, delays=(a.delay,), executions=(execution,), settings=settings, traces=run,
                           log=lambda *_: None)
        traces[label] = run[(execution, a.delay)]
    naive = traces["naive"]
    switch = naive.switches[0]
    joint = int(np.argmax(np.abs(naive.commands[switch] - naive.commands[switch - 1])))
    ticks = np.arange(switch - 10, min(switch + 12, min(len(t.commands) for t in traces.values())))
    fig, ax = plt.subplots(figsize=(8, 4))
    for (label, ep), colour in zip(traces.items(), COLOURS):
        ax.plot(ticks, ep.commands[ticks, joint], "o-", ms=3, lw=1.2, color=colour, label=label)
    ax.axvline(switch - 0.5, color="grey", ls="--", lw=1)
    ax.text(switch - 0.3, ax.get_ylim()[0], " new chunk takes over", color="grey", fontsize=8, va="bottom")
    ax.set_xlabel(f"control tick (1/70 s); the new chunk was observed {a.delay} ticks before it takes over")
    ax.set_ylabel(f"commanded joint_{joint + 1} (rad)")
    ax.set_title(f"Chunk switch at a delay of {a.delay} ticks (demo model, evaluation episode 0 of seed {a.seed})",
                 fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(a.out, dpi=120)
    print(f"{a.out}: joint_{joint + 1}, switch at tick {switch}")


if __name__ == "__main__":
    main()
