"""Human-readable output of the benchmark: the table printed to the terminal and the PNG plot."""
from __future__ import annotations


def _f(x, fmt="{:.1f}", none="-"):
    return none if x is None else fmt.format(x)


def table(result: dict) -> str:
    meta, wl, settings = result["meta"], result["meta"]["workload"], result["settings"]
    lines = []
    add = lines.append
    names = list(settings)
    add(f"OxyGen side-by-side benchmark: {' vs '.join(names)}")
    add("  one process, the same weights, frames, noise and requests for every setting; settings interleaved "
        "within each repetition")
    add(f"  machine  : {meta['machine']} | {meta['cpu_model']} | {meta['cores']} cores, torch {meta['torch']} "
        f"({meta['torch_threads']} threads), triton {meta['triton'] or 'n/a'} | 1-min load average before/after "
        f"{_f(meta['load_avg_start'], '{:.2f}')}/{_f(meta['load_avg_end'], '{:.2f}')}")
    cores, load = meta.get("cores") or 1, meta.get("load_avg_start")
    if load is not None and load > 0.5 * cores:
        add(f"  WARNING  : the machine was busy before the run (1-min load average {load:.2f} on {cores} cores): "
            f"wall times carry that load; compare the best-of-repetitions figures")
    add(f"  model    : preset {meta['preset']}, {meta['parameters'] / 1e6:.1f} M parameters, {meta['dtype']} on "
        f"{meta['device']}, attention {meta['attention_backend']}"
        f"{', CUDA graphs' if meta.get('cuda_graphs') else ''}")
    budget = (f"fixed {wl['tokens_per_frame']} tokens/frame" if wl["decode_budget"] == "fixed"
              else f"deadline ({1e3 * meta['frame_period_s']:.0f} ms frame period)")
    add(f"  workload : {wl['robot']} ({wl['cameras']} cameras {wl['image_hw'][0]}x{wl['image_hw'][1]}, "
        f"{wl['state_dim']}-dim state), {wl['frames']} frames, arrival {wl['arrival']} "
        f"({wl['requests']} requests, {wl['requests_per_frame']:.2f}/frame), {wl['reply_tokens']}-token greedy replies "
        f"(EOS ignored), {wl['denoise_steps']} denoise steps, decode budget {budget}")
    add(f"  runs     : {meta['repetitions']} timed repetitions per setting, interleaved; warm-up "
        f"({meta['warmup_frames']} frames per setting) excluded; date {meta['date']}")
    add("")
    head = (f"{'setting':<10} {'frame ms':>9} {'p50':>8} {'p99':>8} {'act Hz':>7} {'tok/s':>7} {'reply ms':>9} "
            f"{'p99':>8} {'batch':>6} {'peak blk':>8} {'misses':>6} {'total s':>8} {'speedup':>8}")
    add(head)
    add("-" * len(head))
    for n, s in settings.items():
        add(f"{n:<10} {_f(s['frame_ms_mean']):>9} {_f(s['frame_ms_p50']):>8} {_f(s['frame_ms_p99']):>8} "
            f"{s['action_hz']:>7.2f} {s['tokens_per_s']:>7.2f} {_f(s['reply_ms_mean'], '{:.0f}'):>9} "
            f"{_f(s['reply_ms_p99'], '{:.0f}'):>8} {s['avg_batch']:>6.2f} {s['pool_peak_blocks']:>8} "
            f"{s['deadline_misses']:>6} {s['total_s']:>8.2f} {_f(s['speedup_vs_isolated'], 'x{:.2f}'):>8}")
    add("")
    add("Where the time goes, ms per frame (means over frame cycles; tail = decode-only cycles after the last "
        "frame / frames):")
    add(f"{'setting':<10} {'prefill':>8} {'actions':>8} {'admit':>8} {'decode':>8} {'other':>7} {'tail':>7}   "
        f"decode step ms by batch")
    for n, s in settings.items():
        b = s["breakdown_ms_per_frame"]
        steps = ", ".join(f"{k}: {v:.1f}" for k, v in list(s["decode_step_ms_by_batch"].items())[:8])
        add(f"{n:<10} {_f(b['prefill']):>8} {_f(b['actions']):>8} {_f(b['admit']):>8} {_f(b['decode']):>8} "
            f"{_f(b['other']):>7} {_f(b['tail']):>7}   {steps}")
    add("")
    add("speedup = isolated total time / setting total time for the same work (same frames, requests and tokens; "
        "every cycle incl. the decode-only tail; summed over repetitions)")
    for n, s in settings.items():
        if n != "isolated" and s.get("speedup_per_rep"):
            rng = s["speedup_per_rep"]
            add(f"  {n}: x{_f(s['speedup_vs_isolated'], '{:.2f}')} (per repetition {min(rng):.2f}..{max(rng):.2f}; "
                f"best of repetitions per cycle x{_f(s.get('speedup_best_of_reps'), '{:.2f}')}); "
                f"steady-state frames (index >= {result['steady_from_frame']}): "
                f"x{_f(s.get('steady_speedup_vs_isolated'), '{:.2f}')}")
    lim = result.get("limit")
    ox = settings.get("oxygen", {})
    if lim and lim.get("ideal"):
        parts, i = lim["parts"], lim["ideal"]
        lam, T = parts["requests_per_frame"], parts["reply_tokens"]
        add("")
        add(f"Measured limit: per-frame model costs from this run (medians of each setting's own cycles), "
            f"λ = {lam:.2f} requests/frame, T = {T} tokens/reply")
        per = parts["settings"]

        def ms(x, fmt="{:.0f}"):
            return _f(x if x is None else 1e3 * x, fmt)
        if "isolated" in per:
            p = per["isolated"]
            add(f"  isolated  ≈ P {ms(p['P_s'])} + D {ms(p['D_s'])} + λ·(A {ms(p['admit_s_per_request'])} "
                f"[own prefill + question] + (T-1)·d(1) {ms(p['d1_s'], '{:.1f}')}) = "
                f"{ms(i.get('isolated_frame_s'))} ms/frame")
        if "shared_kv" in per:
            p = per["shared_kv"]
            add(f"  shared_kv ≈ P {ms(p['P_s'])} + D {ms(p['D_s'])} + λ·(q {ms(p['admit_s_per_request'])} "
                f"+ (T-1)·d(1) {ms(p['d1_s'], '{:.1f}')}) = {ms(i.get('shared_kv_frame_s'))} ms/frame")
        if "oxygen" in per:
            p = per["oxygen"]
            add(f"  oxygen    ≈ P {ms(p['P_s'])} + D {ms(p['D_s'])} + A {ms(p['admit_s_per_frame'])} [questions] + "
                f"k {_f(p['k'], '{:.2f}')} · d(B={_f(p['B'], '{:.2f}')}) {ms(p['dB_s'], '{:.1f}')} = "
                f"{ms(i.get('oxygen_frame_s'))} ms/frame")
        def pct(key):
            return _f(ox.get(key) and 100 * ox[key], "{:.0f}")
        add(f"  ideal speedup x{i['ideal_speedup']:.2f}; oxygen reaches "
            f"x{_f(ox.get('speedup_vs_isolated'), '{:.2f}')} = {pct('fraction_of_ideal')}% of it "
            f"(best of repetitions: {pct('best_of_reps_fraction_of_ideal')}%, "
            f"steady state: {pct('steady_fraction_of_ideal')}%)")
    eq = result["equivalence"]
    add("")
    sa = eq.get("standalone")
    add(f"Equivalence: max |action difference| between settings {eq['max_action_diff']:.3g}; replies identical "
        f"token for token: {eq['replies_match']} ({eq['replies_compared']} compared with {eq['reference']})"
        + (f"; standalone inference on frames {sa['frames']}: action diff {sa['max_action_diff']:.3g}, "
           f"replies match {sa['replies_match']} ({sa['replies_checked']} replies)" if sa else ""))
    add(f"KV pool empty at the end (every engine): {result['pool_empty_at_end']}")
    if result.get("rtc_cost"):
        c = result["rtc_cost"]
        add(f"RTC cost (action step, median of {c['repeats']} cycles, d = {c['delay_rows']}): plain {c['plain_ms']:.1f} ms "
            f"({c['plain_path']}); rtc error correction {c['rtc_error_ms']:.1f} ms (x{c['ratio_error']:.2f}), "
            f"vjp {c['rtc_vjp_ms']:.1f} ms (x{c['ratio_vjp']:.2f}) ({c['rtc_path']}); prefix conditioning "
            f"{c['rtc_prefix_ms']:.1f} ms (x{c['ratio_prefix']:.2f}) ({c['prefix_path']})")
    if result.get("sweep"):
        sw = result["sweep"]
        add("")
        add(f"Sweep of {sw['knob']} ({sw['repetitions']} repetition(s) per point; the main workload's point is "
            f"the main run):")
        add(f"{'value':>8} {'reps':>5} {'speedup':>8} {'best-of':>8} {'ideal':>8} {'fraction':>9} {'oxygen tok/s':>13} "
            f"{'oxygen Hz':>10}")
        for pt in sw["points"]:
            add(f"{pt['value']:>8} {pt['repetitions']:>5} {_f(pt['speedup_vs_isolated'], 'x{:.2f}'):>8} "
                f"{_f(pt['speedup_best_of_reps'], 'x{:.2f}'):>8} {_f(pt['ideal_speedup'], 'x{:.2f}'):>8} "
                f"{_f(pt['fraction_of_ideal'] and 100 * pt['fraction_of_ideal'], '{:.0f}%'):>9} "
                f"{_f(pt['oxygen_tokens_per_s'], '{:.2f}'):>13} {_f(pt['oxygen_action_hz'], '{:.2f}'):>10}")
    return "\n".join(lines)


def plot(result: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    settings = result["settings"]
    names = list(settings)
    sweep = result.get("sweep")
    ncols = 3 if sweep else 2
    fig, axes = plt.subplots(1, ncols, figsize=(5.2 * ncols, 4.4))
    colors = {"prefill": "#4C72B0", "actions": "#DD8452", "admit": "#55A868", "decode": "#C44E52",
              "other": "#8C8C8C", "tail": "#CCB974"}

    ax = axes[0]
    bottom = [0.0] * len(names)
    for part, color in colors.items():
        vals = [settings[n]["breakdown_ms_per_frame"][part] or 0.0 for n in names]
        vals = [max(v, 0.0) for v in vals]
        ax.bar(names, vals, bottom=bottom, color=color, label=part if part != "tail" else "tail (decode-only)")
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, n in enumerate(names):
        s = settings[n]
        ax.text(x, bottom[x], f"{s['frame_ms_mean']:.0f} ms\n{s['action_hz']:.2f} Hz", ha="center", va="bottom",
                fontsize=8)
    ax.set_ylim(0, max(bottom) * 1.22)
    ax.set_ylabel("ms per frame")
    ax.set_title("Frame time (bars: frame cycle; + tail)")
    ax.legend(fontsize=7, loc="upper right")

    ax = axes[1]
    tps = [settings[n]["tokens_per_s"] for n in names]
    bars = ax.bar(names, tps, color=["#8C8C8C", "#4C72B0", "#C44E52"][:len(names)])
    for b, n in zip(bars, names):
        sp = settings[n].get("speedup_vs_isolated")
        ax.text(b.get_x() + b.get_width() / 2, b.get_height(), f"{b.get_height():.2f}" + (f"\nx{sp:.2f}" if sp else ""),
                ha="center", va="bottom", fontsize=8)
    ideal = settings.get("oxygen", {}).get("ideal_speedup")
    if ideal and "isolated" in settings:
        ax.axhline(settings["isolated"]["tokens_per_s"] * ideal, color="k", ls="--", lw=1,
                   label=f"measured limit (x{ideal:.2f} over isolated)")
        ax.legend(fontsize=7, loc="upper left")
    ax.set_ylim(0, max(tps + [settings.get("isolated", {}).get("tokens_per_s", 0) * (ideal or 0)]) * 1.25)
    ax.set_ylabel("reply tokens / s (whole run)")
    ax.set_title("Language throughput")

    if sweep:
        ax = axes[2]
        xs = [p["value"] for p in sweep["points"]]
        ax.plot(xs, [p["speedup_vs_isolated"] for p in sweep["points"]], "o-", color="#C44E52", label="oxygen measured")
        ax.plot(xs, [p["ideal_speedup"] for p in sweep["points"]], "s--", color="k", label="measured limit")
        if any(p.get("shared_kv_speedup") for p in sweep["points"]):
            ax.plot(xs, [p.get("shared_kv_speedup") for p in sweep["points"]], "^-", color="#4C72B0",
                    label="shared_kv measured")
        ax.set_xlabel(sweep["knob"])
        ax.set_ylabel("speedup vs isolated")
        ax.set_ylim(bottom=0)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        ax.set_title(f"Speedup vs {sweep['knob']}")

    meta, wl = result["meta"], result["meta"]["workload"]
    fig.suptitle(f"{meta['preset']} ({meta['parameters'] / 1e6:.0f} M params, {meta['dtype']}, {meta['device']}: "
                 f"{meta['cpu_model'] if meta['device'] == 'cpu' else meta.get('gpu', '')}), {wl['robot']}, "
                 f"{wl['frames']} frames x {meta['repetitions']} reps, {wl['reply_tokens']}-token replies, "
                 f"{wl['denoise_steps']} denoise steps", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
