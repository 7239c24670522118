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

The measured limit (`ideal_speedup`) uses only model costs measured in the same run, each the median over
the cycles of the setting it describes (on a shared machine each side then carries its own run's load):
  P    = prefill_s of a frame
  D    = action_s (the denoise loop)
  A    = admit_s per admitted request: isolated, its own prefill of the frame + the question prefill and
         first token (≈ P + q); shared_kv, q alone; oxygen, admit_s per frame (λ questions prefilled together)
  d(1) = decode_s / decode_steps of isolated (shared_kv) cycles: every step is batch 1
  d(B) = oxygen's steady-state decode time per step (decode_s / decode_steps of its steady frame cycles),
         B = their mean batch size, k = decode steps per steady frame cycle (mean; A_oxygen also a mean)
with λ requests per frame and T reply tokens (the first comes from the question prefill):
  isolated ≈ P + D + λ (A_iso + (T - 1) d(1))      (a second prefill per request, its reply decoded alone)
  shared   ≈ P + D + λ (q + (T - 1) d(1))
  oxygen   ≈ P + D + A_oxygen + k d(B)             (one prefill, every active reply advanced together)
  ideal_speedup = isolated / oxygen (settings.shared_kv.ideal_speedup = isolated / shared)
A setting that was not run borrows the pooled medians (P, D of all settings; q from shared_kv; d(1) from
isolated and shared_kv).
In steady state k·B = λ(T - 1): k d(B) is exactly the cost of λ replies decoded at batch B, so the formula
is also the bound for the whole run (F frames: F times each side), ignoring the ramp-up and the
decode-only tail, where a real scheduler runs smaller, less efficient batches. Not included on either
side: preparing the observation (image resize), the engine's bookkeeping ("other" in the breakdown).
fraction_of_ideal = speedup_vs_isolated / ideal_speedup (steady_fraction_of_ideal: the steady-state one).

On a machine shared with other work, wall times carry their load. Also reported, robust to it:
best_of_reps_total_s = sum over cycle positions of the fastest repetition's duration (the runs repeat
identical work cycle for cycle) and speedup_best_of_reps = the ratio of those.
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
    tail_s = sum(c.duration_s for r in records for i, c in zip(r.frame_of_cycle, r.cycles) if i is None)
    other = mean_frame - parts["prefill_s"] - parts["action_s"] - parts["admit_s"] - frame_decode if frames else None
    # Robust to other load on a shared machine: the runs repeat identical work cycle for cycle, so the
    # minimum over repetitions of each cycle's duration estimates its undisturbed time.
    best_total = None
    if len({len(r.cycles) for r in records}) == 1:
        best_total = float(sum(min(r.cycles[j].duration_s for r in records) for j in range(len(records[0].cycles))))
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
        "best_of_reps_total_s": best_total,
        "frames": len(frames), "cycles": sum(len(r.cycles) for r in records),
        "decode_only_cycles": sum(1 for r in records for i in r.frame_of_cycle if i is None),
        "requests": len(replies), "tokens": tokens,
        "replies_failed": sum(1 for rep in replies if not rep.success),
        "unfinished": sum(r.unfinished for r in records),
        "breakdown_ms_per_frame": {"prefill": _ms(parts["prefill_s"]), "actions": _ms(parts["action_s"]),
                                   "admit": _ms(parts["admit_s"]), "decode": _ms(frame_decode),
                                   "other": _ms(other),
                                   # decode-only cycles after the last frame, spread over the frames
                                   "tail": _ms(tail_s / len(frames)) if frames else None},
        "decode_ms_total": _ms(decode_total),
        "decode_steps": int(sum(c.decode_steps for r in records for c in r.cycles)),
        "decode_step_ms_by_batch": {str(b): _ms(s) for b, s in decode_by_batch(records).items()},
    }


def _setting_parts(records, steady_from: int) -> dict:
    """Medians of one setting's own cycles."""
    frames = [(i, c) for r in records for i, c in r.frame_cycles]
    admit = [c.admit_s / c.admitted for _, c in frames if c.admitted]
    d1 = [c.decode_s / c.decode_steps for r in records for c in r.cycles
          if c.decode_steps and set(c.batch_sizes) == {1}]
    steady = [c for i, c in frames if i >= steady_from]
    basis = steady if any(c.decode_steps for c in steady) else [c for _, c in frames]
    out = {"P_s": _median([c.prefill_s for _, c in frames]), "D_s": _median([c.action_s for _, c in frames]),
           "admit_s_per_request": _median(admit), "d1_s": _median(d1), "dB_s": None, "B": None, "k": None,
           "admit_s_per_frame": None}
    stepping = [c for c in basis if c.decode_steps]
    if stepping:
        # k and the question prefill per frame: means over every frame cycle of the basis (with sparse
        # arrivals some cycles admit nothing or decode nothing); d(B): the median step time where it steps.
        steps = sum(c.decode_steps for c in stepping)
        out.update(dB_s=_median([c.decode_s / c.decode_steps for c in stepping]),
                   B=sum(sum(c.batch_sizes) for c in stepping) / steps, k=steps / len(basis),
                   admit_s_per_frame=_mean([c.admit_s for c in basis]),
                   basis="steady frames" if basis is steady else "all frames")
    return out


def measured_parts(by_setting: dict, wl, steady_from: int) -> dict:
    """The model costs the limit is built from (see the module docstring): each setting's own medians,
    and the same pooled over the settings (the fallback for a setting that was not run)."""
    per = {s: _setting_parts(recs, steady_from) for s, recs in by_setting.items()}
    all_frames = [c for recs in by_setting.values() for r in recs for _, c in r.frame_cycles]
    P = _median([c.prefill_s for c in all_frames])
    D = _median([c.action_s for c in all_frames])
    q = per["shared_kv"]["admit_s_per_request"] if "shared_kv" in per else None
    if q is None and "isolated" in per and None not in (per["isolated"]["admit_s_per_request"], P):
        q = max(0.0, per["isolated"]["admit_s_per_request"] - P)   # isolated admission = its prefill + question
    d1 = _median([c.decode_s / c.decode_steps for name in ("isolated", "shared_kv") for r in by_setting.get(name, [])
                  for c in r.cycles if c.decode_steps and set(c.batch_sizes) == {1}])
    ox = per.get("oxygen", {})
    return {"pooled": {"P_s": P, "D_s": D, "q_s": q, "d1_s": d1, "dB_s": ox.get("dB_s"), "B": ox.get("B"),
                       "k": ox.get("k")},
            "settings": per, "requests_per_frame": wl.requests_per_frame, "reply_tokens": wl.reply_tokens,
            "steady_from_frame": steady_from}


def ideal_speedup(parts: dict) -> dict | None:
    """Per-frame model cost of each policy at this workload and their ratio (module docstring)."""
    lam, T = parts["requests_per_frame"], parts["reply_tokens"]
    pooled, per = parts["pooled"], parts["settings"]

    def get(setting, name, fallback=None):
        v = per.get(setting, {}).get(name)
        return v if v is not None else fallback

    P, D, q, d1 = pooled["P_s"], pooled["D_s"], pooled["q_s"], pooled["d1_s"]
    iso_admit = get("isolated", "admit_s_per_request", None if None in (P, q) else P + q)
    shared_admit = get("shared_kv", "admit_s_per_request", q)
    ox_admit = get("oxygen", "admit_s_per_frame", None if q is None else lam * q)
    terms = {
        "isolated": (get("isolated", "P_s", P), get("isolated", "D_s", D), iso_admit, get("isolated", "d1_s", d1)),
        "shared_kv": (get("shared_kv", "P_s", P), get("shared_kv", "D_s", D), shared_admit,
                      get("shared_kv", "d1_s", d1)),
    }
    out = {}
    for name, (p, d, a, dd) in terms.items():
        if None not in (p, d) and (lam == 0 or None not in (a, dd)):
            out[f"{name}_frame_s"] = p + d + (lam * (a + (T - 1) * dd) if lam > 0 else 0.0)
    po, do, k, dB = get("oxygen", "P_s", P), get("oxygen", "D_s", D), get("oxygen", "k"), get("oxygen", "dB_s")
    if None not in (po, do) and (lam == 0 or None not in (ox_admit, k, dB)):
        out["oxygen_frame_s"] = po + do + ((ox_admit + k * dB) if lam > 0 else 0.0)
    if "isolated_frame_s" not in out or "oxygen_frame_s" not in out:
        return None
    out["ideal_speedup"] = out["isolated_frame_s"] / out["oxygen_frame_s"]
    return out


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
