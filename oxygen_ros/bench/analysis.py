"""From run records to the benchmark's figures: per-setting statistics, the cost breakdown, the measured
limit (ideal speedup) and the equivalence checks.

Definitions (the JSON keys; all over the timed repetitions, warm-up excluded):
- frame time: `duration_s` of the cycles that processed a frame (decode-only cycles excluded);
  action_hz = horizon / mean frame time;
- total time of a setting: wall time of its runs, every cycle included (the decode-only tail after the
  last frame too), summed over repetitions; tokens_per_s = reply tokens / total time;
- reply_ms: Reply.latency_s (submitted -> finished, the engine's clock);
- speedup_vs_isolated = isolated total time / this setting's total time: the same frames, requests and
  tokens, so the ratio of the times to do the same work;
- steady frames: frame index >= ramp = ceil((T - 1) / k), T reply tokens, k decode steps per oxygen
  cycle (the first reply to finish inside the run needs that many frames, so from there on the oxygen
  batch no longer grows); steady_speedup_vs_isolated compares mean frame times over those frames.

The measured limit (`ideal_speedup`) uses only model costs measured in the same run (medians over cycles):
  P    = prefill_s of a frame (all settings; the same computation everywhere)
  D    = action_s (the denoise loop)
  q    = question prefill + first token, per request: shared_kv's admit_s / admitted (batch 1)
  d(1) = decode_s / decode_steps of isolated and shared_kv cycles (every step is batch 1)
  d(B) = oxygen's steady-state decode time per step (sum decode_s / sum decode_steps over its steady
         frame cycles), B = their mean batch size
with λ requests per frame and k decode steps per oxygen frame cycle:
  isolated ≈ P + D + λ (P + q + (T - 1) d(1))      (a second prefill per request, its reply decoded alone)
  oxygen   ≈ P + D + λ q + k d(B)                  (one prefill, every active reply advanced together)
  ideal_speedup = isolated / oxygen
In steady state k·B = λ(T - 1): k d(B) is exactly the cost of λ replies decoded at batch B, so the formula
is also the bound for the whole run (F frames: F times each side), ignoring the ramp-up and the
decode-only tail, where a real scheduler runs smaller, less efficient batches. Not included on either
side: preparing the observation (image resize), the engine's bookkeeping ("other" in the breakdown).
fraction_of_ideal = speedup_vs_isolated / ideal_speedup (steady_fraction_of_ideal: the steady-state one).
"""
from __future__ import annotations

import math
from collections import defaultdict

import numpy as np


def _mean(x):
    return float(np.mean(x)) if len(x) else None


def _median(x):
    return float(np.median(x)) if len(x) else None


def _pct(x, q):
    return float(np.percentile(x, q)) if len(x) else None


def _ms(x):
    return None if x is None else 1e3 * x


def ramp_frames(wl, oxygen_records) -> int:
    """Frames before the oxygen batch reaches its steady size (see the module docstring)."""
    if wl.budget == "fixed":
        k = wl.tokens_per_frame
    else:
        steps = [c.decode_steps for r in oxygen_records for _, c in r.frame_cycles]
        k = max(1.0, _median(steps) or 1.0)
    return int(math.ceil(max(wl.reply_tokens - 1, 0) / k))


def decode_by_batch(records) -> dict[int, float]:
    """Seconds per decode step by batch size, from cycles whose steps all had one batch size."""
    groups = defaultdict(list)
    for r in records:
        for c in r.cycles:
            if c.decode_steps and len(set(c.batch_sizes)) == 1:
                groups[c.batch_sizes[0]].append(c.decode_s / c.decode_steps)
    return {b: float(np.median(v)) for b, v in sorted(groups.items())}


def setting_stats(records, wl, horizon: int, steady_from: int) -> dict:
    frames = [(i, c) for r in records for i, c in r.frame_cycles]
    frame_s = [c.duration_s for _, c in frames]
    steady_s = [c.duration_s for i, c in frames if i >= steady_from]
    total = sum(r.wall_s for r in records)
    tokens = sum(r.tokens for r in records)
    replies = [rep for r in records for _, _, rep in r.replies]
    latency = [rep.latency_s for rep in replies if rep.success]
    batches = [b for r in records for c in r.cycles for b in c.batch_sizes]
    mean_frame = _mean(frame_s)
    parts = {name: _mean([getattr(c, name) for _, c in frames]) for name in ("prefill_s", "action_s", "admit_s")}
    # Decode time per frame: all decode of the run (decode-only tail included) spread over its frames.
    decode_total = sum(c.decode_s for r in records for c in r.cycles)
    frame_decode = _mean([c.decode_s for _, c in frames])
    other = mean_frame - parts["prefill_s"] - parts["action_s"] - parts["admit_s"] - frame_decode if frames else None
    return {
        "frame_ms_mean": _ms(mean_frame), "frame_ms_p50": _ms(_median(frame_s)), "frame_ms_p99": _ms(_pct(frame_s, 99)),
        "steady_frame_ms_mean": _ms(_mean(steady_s)),
        "action_hz": horizon / mean_frame if mean_frame else 0.0,
        "tokens_per_s": tokens / total if total > 0 else 0.0,
        "reply_ms_mean": _ms(_mean(latency)), "reply_ms_p99": _ms(_pct(latency, 99)),
        "avg_batch": _mean(batches) or 0.0,
        "pool_peak_blocks": None,           # filled in by the caller (the engine's allocator)
        "deadline_misses": int(sum(c.deadline_missed for _, c in frames)),
        "total_s": total, "total_s_per_rep": [r.wall_s for r in records],
        "frames": len(frames), "cycles": sum(len(r.cycles) for r in records),
        "decode_only_cycles": sum(1 for r in records for i in r.frame_of_cycle if i is None),
        "requests": len(replies), "tokens": tokens,
        "replies_failed": sum(1 for rep in replies if not rep.success),
        "unfinished": sum(r.unfinished for r in records),
        "breakdown_ms_per_frame": {"prefill": _ms(parts["prefill_s"]), "actions": _ms(parts["action_s"]),
                                   "admit": _ms(parts["admit_s"]), "decode": _ms(frame_decode),
                                   "other": _ms(other),
                                   # decode-only cycles after the last frame, spread over the frames
                                   "tail": _ms(sum(c.duration_s for r in records for i, c in zip(r.frame_of_cycle, r.cycles)
                                                   if i is None) / len(frames)) if frames else None},
        "decode_ms_total": _ms(decode_total),
        "decode_steps": int(sum(c.decode_steps for r in records for c in r.cycles)),
        "decode_step_ms_by_batch": {str(b): _ms(s) for b, s in decode_by_batch(records).items()},
    }


def measured_parts(by_setting: dict, wl, steady_from: int) -> dict:
    """The model costs the limit is built from (see the module docstring); None where not measurable."""
    all_frames = [c for recs in by_setting.values() for r in recs for _, c in r.frame_cycles]
    P = _median([c.prefill_s for c in all_frames])
    D = _median([c.action_s for c in all_frames])
    q_samples = [c.admit_s / c.admitted for r in by_setting.get("shared_kv", []) for _, c in r.frame_cycles
                 if c.admitted]
    iso_admit = [c.admit_s / c.admitted for r in by_setting.get("isolated", []) for _, c in r.frame_cycles
                 if c.admitted]
    q = _median(q_samples)
    if q is None and iso_admit and P is not None:
        q = max(0.0, _median(iso_admit) - P)          # isolated admission = its prefill + the question
    d1 = _median([c.decode_s / c.decode_steps for name in ("isolated", "shared_kv") for r in by_setting.get(name, [])
                  for c in r.cycles if c.decode_steps and set(c.batch_sizes) == {1}])
    ox = [c for r in by_setting.get("oxygen", []) for i, c in r.frame_cycles if c.decode_steps]
    steady = [c for r in by_setting.get("oxygen", []) for i, c in r.frame_cycles if i >= steady_from and c.decode_steps]
    basis = steady or ox
    if basis:
        steps = sum(c.decode_steps for c in basis)
        dB = sum(c.decode_s for c in basis) / steps
        B = sum(sum(c.batch_sizes) for c in basis) / steps
        k = steps / len(basis)
        ox_admit = [c.admit_s for c in basis]
    else:
        dB = B = k = None
        ox_admit = []
    return {"P_s": P, "D_s": D, "q_s": q, "isolated_admit_s_per_request": _median(iso_admit), "d1_s": d1,
            "dB_s": dB, "B": B, "k": k, "steady_basis": "steady frames" if steady else "all oxygen frames",
            "oxygen_admit_s_per_frame": _median(ox_admit), "requests_per_frame": wl.requests_per_frame,
            "reply_tokens": wl.reply_tokens}


def ideal_speedup(parts: dict) -> dict | None:
    P, D, q, d1, dB, k = (parts[n] for n in ("P_s", "D_s", "q_s", "d1_s", "dB_s", "k"))
    lam, T = parts["requests_per_frame"], parts["reply_tokens"]
    if None in (P, D, q, d1) or (lam > 0 and None in (dB, k)):
        return None
    iso = P + D + lam * (P + q + (T - 1) * d1)
    ox = P + D + lam * q + ((k * dB) if lam > 0 else 0.0)
    return {"isolated_frame_s": iso, "oxygen_frame_s": ox, "ideal_speedup": iso / ox,
            "shared_kv_frame_s": P + D + lam * (q + (T - 1) * d1)}


def equivalence(by_setting: dict) -> dict:
    """Actions and replies of every setting and repetition against the first run (same frames, noise,
    requests): max |action difference| and whether every reply is identical token for token (and
    attached to the same frame)."""
    runs = [r for recs in by_setting.values() for r in recs]
    ref = runs[0]
    max_diff = 0.0
    reply_mismatch, frame_mismatch, compared = [], 0, 0
    for r in runs[1:]:
        for i, a in r.actions.items():
            max_diff = max(max_diff, float(np.max(np.abs(a.astype(np.float64) - ref.actions[i]))))
        for (idx, _, rep), (_, _, rep0) in zip(r.replies, ref.replies):
            compared += 1
            if r.reply_frame(rep) != ref.reply_frame(rep0):
                frame_mismatch += 1
            if rep.tokens != rep0.tokens or not rep.success or not rep0.success:
                reply_mismatch.append({"setting": r.setting, "rep": r.rep, "request": idx,
                                       "reason": rep.finish_reason, "tokens": len(rep.tokens),
                                       "reference_tokens": len(rep0.tokens)})
    counts_equal = len({len(r.replies) for r in runs}) == 1
    return {"max_action_diff": max_diff,
            "replies_match": counts_equal and not reply_mismatch and frame_mismatch == 0,
            "replies_compared": compared, "reply_mismatches": reply_mismatch[:20],
            "frame_mismatches": frame_mismatch, "reference": f"{ref.setting} rep {ref.rep}"}
