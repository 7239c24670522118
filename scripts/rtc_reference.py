"""Reference arrays for test/test_rtc.py from LeRobot 0.6.1's real-time chunking (RTCProcessor).

Run in a side environment that has LeRobot 0.6.1 (Python 3.12; never a dependency of this package):

    ../lerobot061/bin/python scripts/rtc_reference.py --out test/data/rtc_ref/lerobot061.npz

It records, for a grid of inputs:
- schedules: LeRobot's prefix weights get_prefix_weights(start, end, total) for the four schedules;
- guided velocities: RTCProcessor.denoise_step for small velocity functions whose parameters are stored
  with the arrays (test/test_rtc.py evaluates the same functions). LeRobot 0.6.1 evaluates v(x_t) before
  x_t requires a gradient, so its correction is the weighted error e itself (the identity for dx0/dx_t);
  the script also stores `full`: LeRobot's result plus w * t * (dv/dx_t)^T e, the paper's vector-Jacobian
  product, with e and w as LeRobot's debug tracker reports them and the Jacobian from torch.autograd.
  For a velocity function that does not depend on x_t (kind "const") both are the same.
Everything is float64 except what LeRobot makes float32 itself (the weights, its padding, its guidance
weight); leftover rows are rounded to float32 so that LeRobot's float32 padding keeps them exact.
"""
from __future__ import annotations

import argparse
import itertools
from pathlib import Path

import numpy as np
import torch
from lerobot.configs import RTCAttentionSchedule
from lerobot.policies.rtc.configuration_rtc import RTCConfig
from lerobot.policies.rtc.modeling_rtc import RTCProcessor

HORIZON, DIM, HIDDEN = 10, 3, 16
SCHEDULES = {"exp": RTCAttentionSchedule.EXP, "linear": RTCAttentionSchedule.LINEAR,
             "ones": RTCAttentionSchedule.ONES, "zeros": RTCAttentionSchedule.ZEROS}


def velocity(kind: str, x: torch.Tensor, t: float, w1, u, w2) -> torch.Tensor:
    """The velocity functions of the cases (test/test_rtc.py has the same): per row of x [B, H, A],
    "mlp": tanh(x_flat @ w1 + t u) @ w2, "const": tanh(t u) @ w2 (independent of x)."""
    flat = x.reshape(x.shape[0], -1)
    pre = flat @ w1 + t * u if kind == "mlp" else (t * u).expand(x.shape[0], -1)
    return (torch.tanh(pre) @ w2).reshape(x.shape)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, required=True)
    a = p.parse_args()
    rng = np.random.default_rng(22)
    out: dict[str, np.ndarray] = {}

    # ---------------------------------------------------------------- schedules
    grid = [(s, e, n) for n in (1, 5, 10, 20) for s in (0, 1, 3, 6, 12) for e in (0, 2, 5, 8, 10, 25)]
    out["schedule_grid"] = np.array(grid, dtype=np.int64)
    for name, enum in SCHEDULES.items():
        proc = RTCProcessor(RTCConfig(prefix_attention_schedule=enum))
        rows = np.zeros((len(grid), 25), dtype=np.float32)
        for i, (s, e, n) in enumerate(grid):
            rows[i, :n] = proc.get_prefix_weights(s, e, n).numpy()
        out[f"schedule_{name}"] = rows

    # ---------------------------------------------------------------- guided velocities
    w1 = torch.tensor(rng.normal(0, 0.3, (HORIZON * DIM, HIDDEN)))
    u = torch.tensor(rng.normal(0, 1.0, HIDDEN))
    w2 = torch.tensor(rng.normal(0, 0.3, (HIDDEN, HORIZON * DIM)))
    out.update(w1=w1.numpy(), u=u.numpy(), w2=w2.numpy())
    combos = list(itertools.product(("mlp", "const"), SCHEDULES, (1.0, 0.7, 0.3, 0.1)))
    cases = {k: [] for k in ("kind", "schedule", "t", "delay", "execution_horizon", "beta", "leftover_rows",
                             "leftover_dims", "x", "leftover", "lerobot", "full")}
    for kind, schedule, t in combos:
        delay = int(rng.integers(0, 8))
        horizon_end = int(rng.integers(3, HORIZON + 1))
        beta = float(rng.choice([5.0, 10.0]))
        rows = int(rng.choice([HORIZON, 7]))
        dims = int(rng.choice([DIM, 2]))
        x = torch.tensor(rng.normal(0, 1, (1, HORIZON, DIM)))
        leftover = torch.tensor(rng.normal(0, 1, (1, rows, dims)).astype(np.float32).astype(np.float64))
        proc = RTCProcessor(RTCConfig(prefix_attention_schedule=SCHEDULES[schedule], max_guidance_weight=beta,
                                      execution_horizon=horizon_end, debug=True))
        fn = lambda z, kind=kind, t=t: velocity(kind, z, t, w1, u, w2)   # noqa: E731
        result = proc.denoise_step(x, leftover, delay, t, fn, horizon_end)
        step = proc.get_all_debug_steps()[-1]
        _, vjp = torch.autograd.functional.vjp(fn, x, step.err)
        full = result + step.guidance_weight.double() * t * vjp
        for key, value in (("kind", kind), ("schedule", schedule), ("t", t), ("delay", delay),
                           ("execution_horizon", horizon_end), ("beta", beta), ("leftover_rows", rows),
                           ("leftover_dims", dims)):
            cases[key].append(value)
        cases["x"].append(x[0].numpy())
        padded = np.zeros((HORIZON, DIM))
        padded[:rows, :dims] = leftover[0].numpy()
        cases["leftover"].append(padded)
        cases["lerobot"].append(result[0].detach().numpy())
        cases["full"].append(full[0].detach().numpy())
    for key, values in cases.items():
        out[f"case_{key}"] = np.array(values)
    a.out.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(a.out, **out)
    print(f"{a.out}: {len(grid)} schedule rows x {len(SCHEDULES)}, {len(combos)} guided cases, "
          f"{a.out.stat().st_size} bytes")


if __name__ == "__main__":
    main()
