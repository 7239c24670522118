"""`python -m oxygen_ros.bench`: the engine's three policies side by side, in one process.

isolated (openpi-style: a prefill for the action and another per request, each reply decoded alone inside
its frame), shared_kv (one prefill per frame, replies still decoded alone inside the frame) and oxygen
(one prefill per frame, every active reply advanced together, k tokens per frame) run on the same weights,
the same synthetic frames, the same per-frame noise and the same requests, interleaved within each
repetition (rep 1: isolated, shared_kv, oxygen; rep 2: ...), after an untimed warm-up. Replies are greedy
and run to exactly --reply-tokens tokens (EOS ignored, `EngineConfig.ignore_eos`) so every setting does the
same work. The figures and the measured limit are defined in oxygen_ros/bench/analysis.py.

Paper default workload: 10 denoise steps, 30-token replies, 5 tokens per frame, one request per frame.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import torch

from oxygen_ros.engine.config import POLICIES, EngineConfig
from oxygen_ros.engine.engine import Engine

from . import analysis, report
from .harness import REQUEST_TIMEOUT_S, run_workload
from .reference import standalone_check
from .workload import ROBOTS, make_workload, parse_arrival

DEFAULT_PROMPT = "pick up the black bowl and place it on the plate"
DEFAULT_QUESTION = "What objects are on the table?"
SWEEP_KNOBS = ("reply-tokens", "tokens-per-frame")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m oxygen_ros.bench", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--preset", choices=("tiny", "bench", "pi05"), default="bench", help="model size")
    p.add_argument("--checkpoint", default=None, help="weights (default: deterministic random weights)")
    p.add_argument("--tokenizer", default=None, help="SentencePiece model (default: the shipped small one)")
    p.add_argument("--settings", default=",".join(POLICIES),
                   help="comma-separated subset of " + ",".join(POLICIES))
    p.add_argument("--frames", type=int, default=12, help="frames per repetition")
    p.add_argument("--denoise-steps", type=int, default=10)
    p.add_argument("--reply-tokens", type=int, default=30, help="tokens per reply (greedy, exactly this many)")
    budget = p.add_mutually_exclusive_group()
    budget.add_argument("--tokens-per-frame", type=int, default=5, help="fixed decode budget: steps per cycle")
    budget.add_argument("--deadline", action="store_true",
                        help="deadline decode budget: decode while the frame period (horizon / action rate) lasts")
    p.add_argument("--action-rate-hz", type=float, default=70.0, help="sets the frame period of --deadline")
    p.add_argument("--arrival", default="every", help="every | every:K | burst:N | poisson:RATE (requests per frame)")
    p.add_argument("--robot", choices=sorted(ROBOTS), default="libero")
    p.add_argument("--repeat", type=int, default=3, help="timed repetitions per setting")
    p.add_argument("--warmup-frames", type=int, default=2, help="untimed frames per setting before the runs")
    p.add_argument("--check-frames", type=int, default=2,
                   help="frames also checked against standalone inference (0: off)")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=("float32", "bfloat16", "float16"), default=None,
                   help="default: float32 on the CPU, bfloat16 on CUDA")
    p.add_argument("--no-cuda-graphs", action="store_true",
                   help="run decode steps and denoise loops eagerly on CUDA (default: captured graphs)")
    p.add_argument("--threads", type=int, default=None, help="torch CPU threads (default: torch's)")
    p.add_argument("--kv-budget-mb", type=float, default=256.0, help="KV pool per engine")
    p.add_argument("--max-batch", type=int, default=64, help="decode batch cap (EngineConfig.max_active_requests)")
    p.add_argument("--seed", type=int, default=0, help="weights, frames, noise and Poisson arrivals")
    p.add_argument("--prompt", default=DEFAULT_PROMPT, help="the task prompt of every frame")
    p.add_argument("--question", default=DEFAULT_QUESTION, help="the text of every request")
    p.add_argument("--sweep", default=None, metavar="KNOB=V1,V2,...",
                   help=f"also measure speedup vs a knob ({' or '.join(SWEEP_KNOBS)}), e.g. reply-tokens=10,30,60")
    p.add_argument("--sweep-repeat", type=int, default=1, help="repetitions per sweep point")
    p.add_argument("--robots", default=None, metavar="N[,N...]",
                   help="fleet benchmark instead of the policies: N robots on one engine (fleet.batched) vs N "
                        "single-robot engines (fleet.separate); several values measure how cost grows with N")
    adv = p.add_argument_group("--adversarial (bench/adversarial.py): actions first under a flood of questions")
    adv.add_argument("--adversarial", action="store_true",
                     help="the engine thread in real time: the paper's workload, then a flood of the longest "
                          "questions; chunks/s, largest gap, deadline misses, tokens/s (JSON: adversarial)")
    adv.add_argument("--camera-hz", type=float, default=15.0, help="frames handed to the engine per second")
    adv.add_argument("--seconds", type=float, default=10.0, help="counted seconds per phase")
    adv.add_argument("--warmup", type=float, default=2.0, help="uncounted seconds at the start of each phase")
    adv.add_argument("--flood-queue", type=int, default=64, help="waiting requests the flood keeps queued")
    adv.add_argument("--compare-unbounded", action="store_true",
                     help="also the flood with question prefill unbounded by the budget (the old behaviour)")
    p.add_argument("--rtc-repeats", type=int, default=5,
                   help="timed cycles of the RTC cost (bench/rtc_cost.py: the action step with and without "
                        "real-time chunking; JSON: rtc_cost); 0: not measured")
    p.add_argument("--json", default=None, metavar="OUT", help="write the results as JSON")
    p.add_argument("--plot", default=None, metavar="OUT.png", help="write a PNG plot (matplotlib)")
    p.add_argument("--quiet", action="store_true", help="no progress lines")
    return p


def _check_args(p: argparse.ArgumentParser, a) -> list[str]:
    settings = [s.strip() for s in a.settings.split(",") if s.strip()]
    bad = [s for s in settings if s not in POLICIES]
    if bad or not settings or len(set(settings)) != len(settings):
        p.error(f"--settings must be a comma-separated subset of {','.join(POLICIES)}, got {a.settings!r}")
    for name in ("frames", "denoise_steps", "reply_tokens", "tokens_per_frame", "repeat", "sweep_repeat", "max_batch"):
        if getattr(a, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1")
    if a.robots is not None:
        try:
            a.robots = [int(v) for v in a.robots.split(",") if v.strip()]
        except ValueError:
            a.robots = []
        if not a.robots or min(a.robots) < 1 or len(set(a.robots)) != len(a.robots):
            p.error("--robots must be distinct positive integers, e.g. 2 or 1,2,4")
        if a.deadline or a.sweep:
            p.error("--robots runs the fixed decode budget without --sweep")
    if a.adversarial and (a.robots or a.sweep):
        p.error("--adversarial runs on its own: not with --robots or --sweep")
    if a.adversarial and not (a.camera_hz > 0 and a.seconds > 0 and a.warmup >= 0 and a.flood_queue >= 1):
        p.error("--adversarial needs --camera-hz > 0, --seconds > 0, --warmup >= 0 and --flood-queue >= 1")
    if a.warmup_frames < 0 or a.check_frames < 0 or a.rtc_repeats < 0:
        p.error("--warmup-frames, --check-frames and --rtc-repeats must be >= 0")
    try:
        parse_arrival(a.arrival)
    except ValueError as e:
        p.error(str(e))
    if a.sweep:
        knob, _, values = a.sweep.partition("=")
        try:
            vals = [int(v) for v in values.split(",") if v.strip()]
        except ValueError:
            vals = []
        if knob not in SWEEP_KNOBS or not vals or min(vals) < 1:
            p.error(f"--sweep must be KNOB=V1,V2,... with KNOB in {SWEEP_KNOBS} and positive integers")
        if knob == "tokens-per-frame" and a.deadline:
            p.error("--sweep tokens-per-frame needs the fixed budget (not --deadline)")
        if "isolated" not in settings:
            p.error("--sweep needs the isolated setting (speedups are relative to it)")
        a.sweep = (knob, vals)
    return [s for s in POLICIES if s in settings]      # always in the canonical order


# ---------------------------------------------------------------------------------------------- setup
def _dtype(name):
    return None if name is None else getattr(torch, name)


def make_engine(model, setting: str, a, reply_tokens: int, tokens_per_frame: int) -> Engine:
    from oxygen_ros.engine.factory import build_engine

    cfg = EngineConfig(policy=setting, decode_budget="deadline" if a.deadline else "fixed",
                       tokens_per_frame=tokens_per_frame, action_rate_hz=a.action_rate_hz,
                       denoise_steps=a.denoise_steps, ignore_eos=True, max_active_requests=a.max_batch,
                       max_queued_requests=max(64, 4 * a.max_batch),
                       max_queued_per_owner=max(64, 4 * a.max_batch), max_tokens_limit=max(256, reply_tokens),
                       seed=a.seed, cuda_graphs=False if a.no_cuda_graphs else None,
                       max_timeout_s=REQUEST_TIMEOUT_S)
    # Random full-size weights run with the shipped small tokenizer (the factory allows it without a checkpoint).
    return build_engine(built_model=model, engine=cfg, checkpoint=a.checkpoint, tokenizer=a.tokenizer,
                        kv_budget_mb=a.kv_budget_mb)


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _version(dist: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(dist)
    except Exception:
        return None


def _git_commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=Path(__file__).resolve().parent,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except Exception:
        return None


def _load() -> float | None:
    try:
        return os.getloadavg()[0]
    except OSError:
        return None


# ---------------------------------------------------------------------------------------------- running
def run_settings(engines: dict, wl, repeat: int, log, label: str = "") -> dict:
    records = {s: [] for s in engines}
    for rep in range(repeat):
        for s, engine in engines.items():
            rec = run_workload(engine, wl, s, rep)
            records[s].append(rec)
            log(f"{label}rep {rep + 1}/{repeat} {s:<9}: {len(rec.frame_cycles)} frames + "
                f"{len(rec.cycles) - len(rec.frame_cycles)} decode-only cycles, {rec.tokens} tokens, "
                f"{rec.wall_s:.2f} s")
    return records


def summarize(records: dict, engines: dict, wl, horizon: int) -> dict:
    """Per-setting statistics, speedups, the measured limit and the equivalence checks of one workload."""
    steady_from = analysis.ramp_frames(wl, records["oxygen"]) if "oxygen" in records else 0
    settings = {s: analysis.setting_stats(recs, wl, horizon, steady_from) for s, recs in records.items()}
    for s, st in settings.items():
        st["pool_peak_blocks"] = int(engines[s].stats.snapshot()["pool_peak_blocks"])
        st["ideal_speedup"] = None
    parts = analysis.measured_parts(records, wl, steady_from)
    ideal = analysis.ideal_speedup(parts)
    if "isolated" in records:
        iso = settings["isolated"]
        for s, st in settings.items():
            st["speedup_vs_isolated"] = iso["total_s"] / st["total_s"] if st["total_s"] > 0 else None
            st["speedup_per_rep"] = [a.wall_s / b.wall_s for a, b in zip(records["isolated"], records[s])]
            st["speedup_best_of_reps"] = (iso["best_of_reps_total_s"] / st["best_of_reps_total_s"]
                                          if iso["best_of_reps_total_s"] and st["best_of_reps_total_s"] else None)
            st["steady_speedup_vs_isolated"] = (iso["steady_frame_ms_mean"] / st["steady_frame_ms_mean"]
                                                if st["steady_frame_ms_mean"] and iso["steady_frame_ms_mean"] else None)
    else:
        for st in settings.values():
            st["speedup_vs_isolated"] = st["steady_speedup_vs_isolated"] = st["speedup_best_of_reps"] = None
            st["speedup_per_rep"] = []
    if "oxygen" in settings:
        ox = settings["oxygen"]
        ox["ideal_speedup"] = ideal["ideal_speedup"] if ideal else None
        ox["fraction_of_ideal"] = (ox["speedup_vs_isolated"] / ox["ideal_speedup"]
                                   if ox["ideal_speedup"] and ox["speedup_vs_isolated"] else None)
        ox["best_of_reps_fraction_of_ideal"] = (ox["speedup_best_of_reps"] / ox["ideal_speedup"]
                                                if ox["ideal_speedup"] and ox["speedup_best_of_reps"] else None)
        ox["steady_fraction_of_ideal"] = (ox["steady_speedup_vs_isolated"] / ox["ideal_speedup"]
                                          if ox["ideal_speedup"] and ox["steady_speedup_vs_isolated"] else None)
    if "shared_kv" in settings and ideal and ideal.get("shared_kv_frame_s"):
        settings["shared_kv"]["ideal_speedup"] = ideal["isolated_frame_s"] / ideal["shared_kv_frame_s"]
    return {"settings": settings, "steady_from_frame": steady_from,
            "limit": {"parts": parts, "ideal": ideal, "definition": analysis.__doc__.split("\n\n", 2)[2].strip()},
            "equivalence": analysis.equivalence(records)}


def _meta(a, cfg, model, info, started: str, load_start, argv) -> dict:
    """Machine, versions, model and run parameters: what a figure needs to say how it was measured."""
    from oxygen_ros.model.config import num_parameters

    return {
        "machine": f"{platform.node()} ({platform.machine()})", "platform": platform.platform(),
        "cpu_model": _cpu_model(), "cores": os.cpu_count(), "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(), "triton": _version("triton"), "numpy": np.__version__,
        "python": platform.python_version(),
        "gpu": torch.cuda.get_device_name(model.device) if model.device.type == "cuda" else None,
        "preset": a.preset, "parameters": num_parameters(cfg),
        "parameters_built": int(sum(p.numel() for p in model.parameters())),
        "weights": a.checkpoint or f"random (seed {a.seed})", "dtype": str(model.dtype).removeprefix("torch."),
        "device": str(model.device), "attention_backend": info.attention_backend,
        "cuda_graphs": info.cuda_graphs and model.device.type == "cuda",
        "frame_period_s": info.frame_period_s, "action_horizon": cfg.action_horizon,
        "repetitions": a.repeat, "warmup_frames": a.warmup_frames, "date": started,
        "command": "python -m oxygen_ros.bench " + " ".join(sys.argv[1:] if argv is None else argv),
        "git_commit": _git_commit(), "load_avg_start": load_start, "load_avg_end": _load(),
    }


def main_fleet(a, cfg, model, started: str, load_start, argv, log) -> int:
    """--robots: fleet.batched vs fleet.separate for each N (the JSON's `fleet` is the largest N's)."""
    from . import fleet

    scaling = []
    for n in a.robots:
        point = fleet.run_fleet(model, cfg, a, n, log)
        scaling.append({"robots": n, **point})
    result = {"fleet": {**scaling[-1], "preset": a.preset}, "scaling": scaling}
    engine = fleet.build(model, 1, a)[0]
    result["meta"] = _meta(a, cfg, model, engine.info, started, load_start, argv)
    result["meta"]["workload"] = {
        "per_robot": fleet.make_loads(1, a, cfg)["r0"].params(), "robots": a.robots,
        "note": fleet.__doc__.split("\n\n", 1)[1].strip()}
    print(fleet.table(result["fleet"], scaling), flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=2, default=_jsonable, allow_nan=False) + "\n")
        log(f"wrote {a.json}")
    return 0


def main_adversarial(a, cfg, model, started: str, load_start, argv, log) -> int:
    from . import adversarial

    result = {"adversarial": adversarial.run(model, a, cfg, log)}
    result["meta"] = _meta(a, cfg, model, make_engine(model, "oxygen", a, a.reply_tokens, 1).info, started,
                           load_start, argv)
    targets = result["adversarial"]["targets"]
    log("targets: " + ", ".join(f"{k} {v:.2f}" if isinstance(v, float) else f"{k} {v}" for k, v in targets.items()))
    line, warning = adversarial.verdict(targets, load_start, result["meta"]["load_avg_end"], os.cpu_count() or 1)
    result["adversarial"]["verdict"] = {"verdict": line, "load_warning": warning}
    for text in (warning, line):
        if text:
            print(text, flush=True)          # even with --quiet: the answer of the run
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=2, default=_jsonable, allow_nan=False) + "\n")
        log(f"wrote {a.json}")
    return 0


def main(argv: list[str] | None = None) -> int:
    if any(x.split("=")[0] == "--openpi-clients" for x in (sys.argv[1:] if argv is None else argv)):
        from oxygen_ros.serve.bench_openpi import main as openpi_main     # openpi clients (docs/openpi.md)
        return openpi_main(argv)
    parser = build_parser()
    a = parser.parse_args(argv)
    names = _check_args(parser, a)
    log = (lambda *_: None) if a.quiet else (lambda msg: print(msg, flush=True))
    if a.threads:
        torch.set_num_threads(a.threads)
    load_start = _load()
    started = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    from oxygen_ros.engine.factory import build_model, model_config
    from oxygen_ros.model.config import num_parameters

    cfg = model_config(a.preset)
    t = time.perf_counter()
    model = build_model(cfg, a.checkpoint, a.device, _dtype(a.dtype), a.seed)
    log(f"model {a.preset}: {num_parameters(cfg) / 1e6:.1f} M parameters, {model.dtype} on {model.device} "
        f"(built in {time.perf_counter() - t:.1f} s)")
    if a.robots:
        return main_fleet(a, cfg, model, started, load_start, argv, log)
    if a.adversarial:
        return main_adversarial(a, cfg, model, started, load_start, argv, log)
    engines = {s: make_engine(model, s, a, a.reply_tokens, a.tokens_per_frame) for s in names}
    first = engines[names[0]]
    common = dict(robot=a.robot, arrival=a.arrival, denoise_steps=a.denoise_steps,
                  budget="deadline" if a.deadline else "fixed", tokens_per_frame=a.tokens_per_frame,
                  action_rate_hz=a.action_rate_hz, seed=a.seed, action_horizon=cfg.action_horizon,
                  action_dim=cfg.action_dim, prompt=a.prompt, question=a.question)
    wl = make_workload(frames=a.frames, reply_tokens=a.reply_tokens, **common)

    if a.warmup_frames:
        warm = make_workload(frames=a.warmup_frames, reply_tokens=a.reply_tokens, offset=1,
                             **{**common, "arrival": "every"})
        t = time.perf_counter()
        for s, engine in engines.items():
            run_workload(engine, warm, s, -1)
        log(f"warm-up: {a.warmup_frames} frames per setting in {time.perf_counter() - t:.1f} s (not counted)")
    for engine in engines.values():   # peak pool use of the timed runs only
        engine.reset_pool_peak()

    records = run_settings(engines, wl, a.repeat, log)
    result = summarize(records, engines, wl, cfg.action_horizon)
    if a.check_frames:
        sa = standalone_check(model, first, wl, records[names[0]][0], a.check_frames)
        result["equivalence"]["standalone"] = sa
        result["equivalence"]["max_action_diff"] = max(result["equivalence"]["max_action_diff"], sa["max_action_diff"])
        result["equivalence"]["replies_match"] = bool(result["equivalence"]["replies_match"] and sa["replies_match"])
    result["pool_empty_at_end"] = all(e.stats.snapshot()["pool_blocks_used"] == 0 for e in engines.values())

    if a.sweep:
        knob, values = a.sweep
        points = []
        for v in values:
            T = v if knob == "reply-tokens" else a.reply_tokens
            k = v if knob == "tokens-per-frame" else a.tokens_per_frame
            if (T, k) == (a.reply_tokens, a.tokens_per_frame):
                res, reps = result, a.repeat          # the main run is this point
            else:
                sw_engines = {s: make_engine(model, s, a, T, k) for s in names}
                sw_wl = make_workload(frames=a.frames, reply_tokens=T, **{**common, "tokens_per_frame": k})
                recs = run_settings(sw_engines, sw_wl, a.sweep_repeat, log, label=f"sweep {knob}={v} ")
                res, reps = summarize(recs, sw_engines, sw_wl, cfg.action_horizon), a.sweep_repeat
                result["pool_empty_at_end"] &= all(e.stats.snapshot()["pool_blocks_used"] == 0
                                                   for e in sw_engines.values())
            st = res["settings"]
            ox = st.get("oxygen", {})
            points.append({"value": v, "repetitions": reps, "speedup_vs_isolated": ox.get("speedup_vs_isolated"),
                           "speedup_best_of_reps": ox.get("speedup_best_of_reps"),
                           "ideal_speedup": ox.get("ideal_speedup"), "fraction_of_ideal": ox.get("fraction_of_ideal"),
                           "shared_kv_speedup": st.get("shared_kv", {}).get("speedup_vs_isolated"),
                           "oxygen_tokens_per_s": ox.get("tokens_per_s"), "oxygen_action_hz": ox.get("action_hz"),
                           "isolated_tokens_per_s": st["isolated"]["tokens_per_s"],
                           "avg_batch": ox.get("avg_batch"),
                           "replies_match": res["equivalence"]["replies_match"],
                           "max_action_diff": res["equivalence"]["max_action_diff"]})
        result["sweep"] = {"knob": knob, "repetitions": a.sweep_repeat, "points": points,
                           "note": "the point equal to the main workload reuses the main run"}

    if a.rtc_repeats:
        from . import rtc_cost

        result["rtc_cost"] = rtc_cost.measure(model, cfg, repeats=a.rtc_repeats, kv_budget_mb=a.kv_budget_mb,
                                              denoise_steps=a.denoise_steps,
                                              cuda_graphs=False if a.no_cuda_graphs else None)
    result["meta"] = _meta(a, cfg, model, first.info, started, load_start, argv)
    result["meta"].update(workload=wl.params(), settings=names)
    result = {k: result[k] for k in ("settings", "equivalence", "pool_empty_at_end", "meta", "limit",
                                     "steady_from_frame", "sweep", "rtc_cost") if k in result}
    print(report.table(result), flush=True)
    if a.json:
        Path(a.json).parent.mkdir(parents=True, exist_ok=True)
        Path(a.json).write_text(json.dumps(result, indent=2, default=_jsonable, allow_nan=False) + "\n")
        log(f"wrote {a.json}")
    if a.plot:
        Path(a.plot).parent.mkdir(parents=True, exist_ok=True)
        report.plot(result, a.plot)
        log(f"wrote {a.plot}")
    return 0


def _jsonable(x):
    if isinstance(x, (np.floating, np.integer)):
        return x.item()
    if isinstance(x, np.ndarray):
        return x.tolist()
    return str(x)


if __name__ == "__main__":
    raise SystemExit(main())
