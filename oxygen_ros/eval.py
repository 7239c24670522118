"""Closed-loop evaluation of the demo model in the MuJoCo reach scene, through the engine (in-process),
or through the whole ROS path (--ros).

    python -m oxygen_ros.eval --episodes 50 --json eval.json
    python -m oxygen_ros.eval --ros --episodes 30 --json eval_ros.json
    python -m oxygen_ros.eval --frameless --episodes 12      # language without frames (180 questions)
    python -m oxygen_ros.eval_multistep --episodes 100 --checkpoint DIR     # multi-step: hierarchy vs task only

For each seeded episode (a random layout of 2-3 cubes and a random named cube): the scripted expert, then
the model under each engine policy (isolated, shared_kv, oxygen: the same episodes, the same noise), then
the *swap test* (same scene and start, another cube named), and the scene questions asked about the first
frame. Control: the engine's chunk is computed from the current camera image and joint state every
`--replan` control ticks (70 Hz) and its next `--replan` rows are executed (receding horizon, as openpi
evaluates). Success: the tip touches the named cube (scene.TOUCH_RADIUS) within `--steps` ticks.

--ros: `oxygen_bringup --demo` in a subprocess on a private DDS domain: the engine node, the observation
node (camera and joint-state topics synchronised), the 70 Hz action publisher (chunks sampled by time,
velocity limit) and the simulated robot node in wall time, as the demo runs. The robot's episodes are
the in-process episodes of the same seed (ReachEpisodes draws episode k as `evaluate` does), each lasting
`--steps` ticks of simulated time; success is judged by the simulator and read from its log lines.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import re
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import yaml

from oxygen_ros.engine.config import POLICIES, EngineConfig
from oxygen_ros.engine.engine import ChunkResult
from oxygen_ros.robot.configs import demo_checkpoint
from oxygen_ros.engine.factory import build_engine, build_model, model_config
from oxygen_ros.engine.requests import Reply, TextRequest
from oxygen_ros.engine.tasks.actions import PREFIX_UNTRAINED
from oxygen_ros.model import rtc
from oxygen_ros.model.checkpoint import checkpoint_settings
from oxygen_ros.robot.chunks import EXECUTIONS, ChunkFollower
from oxygen_ros.robot.policy_io import RobotIOConfig
from oxygen_ros.robot.sync import Observation
from oxygen_ros.sim.expert import expert_chunk, inverse_kinematics
from oxygen_ros.sim.questions import scene_questions
from oxygen_ros.sim.scene import CONTROL_PERIOD_S, Layout, ReachScene, draw_episode, task_prompt, touch_point

CAMERA_SLOT = "base_0_rgb"


class EnginePolicy:
    """The engine's public API in one place: an observation in, the chunk's robot actions out; questions
    in, replies out. Synchronous (run_cycle), so every policy sees exactly the same inputs."""

    def __init__(self, policy: str, model, checkpoint: Path):
        self.engine = build_engine(built_model=model, norm_stats=str(checkpoint / "norm_stats.json"),
                                   robot_io=RobotIOConfig(robot_action_dim=model.cfg.action_dim,
                                                          delta_action_mask=(True,) * model.cfg.action_dim),
                                   engine=EngineConfig(policy=policy), kv_budget_mb=8.0)

    def act(self, image: np.ndarray, state: np.ndarray, prompt: str, noise: np.ndarray, stamp: float) -> np.ndarray:
        obs = Observation(stamp, {CAMERA_SLOT: image}, {CAMERA_SLOT: True}, state, prompt)
        report = self.engine.run_cycle(obs, noise)
        if report.fault:
            raise RuntimeError(f"engine fault: {report.fault}")
        return self.engine.latest_chunk().plan.actions

    def ask(self, image: np.ndarray, state: np.ndarray, prompt: str, questions: list[str],
            max_tokens: int = 16) -> tuple[list[Reply], int]:
        """The questions, then the frame they are about, then cycles without a frame until every one has
        ended (a reply, or its timeout): (the replies, the frame-less cycles it took)."""
        handles = [self.engine.submit(TextRequest(q, max_tokens=max_tokens)) for q in questions]
        self.engine.run_cycle(Observation(0.0, {CAMERA_SLOT: image}, {CAMERA_SLOT: True}, state, prompt))
        cycles = 0
        while not all(h.done() for h in handles):
            self.engine.run_cycle(None)
            cycles += 1
        return [h.result() for h in handles], cycles


def answer_text(reply: Reply) -> str | None:
    """A reply's answer, or None when the question got none (timeout, error: not a wrong answer)."""
    return reply.text.strip() if reply.success else None


@dataclass
class EpisodeResult:
    success: bool
    steps: int              # ticks until the touch (or the limit)
    touched_other: bool     # touched another cube before the named one
    final_distance: float


def demo_model_config(checkpoint: Path):
    """The demo model's sizes with what its checkpoint records (config.json: e.g. prefix_conditioning)."""
    return model_config("demo", **checkpoint_settings(checkpoint))


def run_episode(scene: ReachScene, layout: Layout, target: int, act, steps: int, replan: int,
                frames: list | None = None) -> EpisodeResult:
    """`act(scene) -> [H, 3]` joint targets; the first `replan` rows are executed before asking again.
    `frames`: collects a large base-camera render at each replan (the README's strip)."""
    scene.reset(layout)
    other = False
    chunk = None
    for k in range(steps):
        if k % replan == 0:
            chunk = act(scene)
            if frames is not None:
                frames.append(scene.render("base", 192))
        scene.step(chunk[k % replan])
        touched = scene.touching()
        if touched == target:
            return EpisodeResult(True, k + 1, other, scene.distance_to(target))
        other |= touched is not None
    return EpisodeResult(False, steps, other, scene.distance_to(target))


def expert_actor(goal: np.ndarray, horizon: int):
    return lambda scene: expert_chunk(scene.joints(), goal, horizon)


def model_actor(policy: EnginePolicy, prompt: str, rng: np.random.Generator, horizon: int, action_dim: int,
                chunks: list):
    def act(scene):
        noise = rng.standard_normal((horizon, action_dim)).astype(np.float32)
        actions = policy.act(scene.render("base"), scene.joints(), prompt, noise, scene.time)
        chunks.append(actions)
        return actions
    return act


def save_strip(frames: list, path: Path, count: int = 5) -> None:
    """Evenly spaced frames of an episode side by side (PNG)."""
    import cv2

    picks = [frames[round(i * (len(frames) - 1) / (count - 1))] for i in range(count)]
    cv2.imwrite(str(path), cv2.cvtColor(np.concatenate(picks, axis=1), cv2.COLOR_RGB2BGR))


def evaluate(episodes: int, seed: int = 0, steps: int = 210, replan: int = 10, policies=POLICIES,
             checkpoint: Path | None = None, questions: bool = True, strip: Path | None = None,
             log=print) -> dict:
    torch.set_num_threads(1)
    checkpoint = Path(checkpoint or demo_checkpoint())
    cfg = demo_model_config(checkpoint)
    model = build_model(cfg, str(checkpoint))
    engines = {p: EnginePolicy(p, model, checkpoint) for p in policies}
    main = "oxygen" if "oxygen" in engines else next(iter(engines))
    scene = ReachScene(cfg.vision.image_size)
    h, dim = cfg.action_horizon, cfg.action_dim
    results = {p: [] for p in engines}
    expert, swap, answers = [], [], []          # answers: (question, reply text or None: no reply)
    unanswered = []                              # questions that got no reply (timeout, error): not wrong answers
    max_chunk_diff = 0.0
    start = time.monotonic()
    for ep in range(episodes):
        episode = draw_episode(seed, ep)
        layout, target, prompt, noise_seed, rng = (episode.layout, episode.target, episode.prompt,
                                                   episode.noise_seed, episode.rng)
        goal = inverse_kinematics(touch_point(layout.positions[target]))
        expert.append(run_episode(scene, layout, target, expert_actor(goal, h), steps, replan))
        chunks = {}
        for p, engine in engines.items():
            chunks[p] = []
            act = model_actor(engine, prompt, np.random.default_rng(noise_seed), h, dim, chunks[p])
            frames = [] if strip is not None and ep == 0 and p == main else None
            results[p].append(run_episode(scene, layout, target, act, steps, replan, frames))
            if frames:
                save_strip(frames, strip)
        for p in engines:
            if len(chunks[p]) == len(chunks[main]):
                max_chunk_diff = max([max_chunk_diff] + [float(np.abs(a - b).max())
                                                         for a, b in zip(chunks[p], chunks[main])])
            else:
                max_chunk_diff = float("inf")
        swapped = (target + 1) % len(layout.colours)
        act = model_actor(engines[main], task_prompt(layout.colours[swapped]), np.random.default_rng(noise_seed),
                          h, dim, [])
        swap.append(run_episode(scene, layout, swapped, act, steps, replan))
        if questions:
            scene.reset(layout)
            asked = scene_questions(layout, scene.tip(), rng)
            replies, _ = engines[main].ask(scene.render("base"), scene.joints(), prompt, [q.text for q in asked])
            answers += [(q, answer_text(r)) for q, r in zip(asked, replies)]
            unanswered += [{"question": q.text, "finish_reason": r.finish_reason, "error": r.error}
                           for q, r in zip(asked, replies) if not r.success]
        last = answers[-len(asked):] if questions else []
        log(f"[eval] episode {ep + 1}/{episodes}: {prompt!r} ({len(layout.colours)} cubes) "
            + " ".join(f"{p}={'ok' if results[p][-1].success else 'FAIL'}" for p in engines)
            + f" swap={'ok' if swap[-1].success else 'FAIL'}"
            + (f" answers {sum(q.answer == r for q, r in last)}/{len(last)}" if questions else "")
            + (f" ({sum(r is None for _, r in last)} unanswered)" if any(r is None for _, r in last) else ""))

    def rate(rs):
        return float(np.mean([r.success for r in rs])) if rs else 0.0

    def mean_steps(rs):
        ok = [r.steps for r in rs if r.success]
        return float(np.mean(ok)) if ok else None

    kinds = sorted({q.kind for q, _ in answers})
    replied = [(q, r) for q, r in answers if r is not None]
    out = {
        "episodes": episodes, "seed": seed, "steps": steps, "replan": replan, "control_hz": 70,
        "success_rate": rate(results[main]),
        "expert_success_rate": rate(expert),
        "swap_success_rate": rate(swap),
        # accuracy over the questions replied to; those without a reply are counted apart (questions_unanswered)
        "answer_accuracy": float(np.mean([q.answer == r for q, r in replied])) if replied else None,
        "chance_accuracy": float(np.mean([q.chance for q, _ in replied])) if replied else None,
        "answer_accuracy_by_kind": {k: float(np.mean([q.answer == r for q, r in replied if q.kind == k]))
                                    for k in kinds if any(q.kind == k for q, _ in replied)},
        "questions_asked": len(answers),
        "questions_unanswered": len(unanswered),
        "unanswered": unanswered[:20],
        "policies": {p: {"success_rate": rate(rs), "mean_steps_to_touch": mean_steps(rs),
                         "touched_other_first": float(np.mean([r.touched_other for r in rs])),
                         "failures_final_distance_cm": sorted(round(r.final_distance * 100, 1)
                                                              for r in rs if not r.success)}
                     for p, rs in results.items()},
        "max_action_difference_across_policies": max_chunk_diff,
        "expert_mean_steps_to_touch": mean_steps(expert),
        "wrong_answers": [{"question": q.text, "answer": q.answer, "reply": r} for q, r in replied
                          if q.answer != r][:20],
        "wall_s": round(time.monotonic() - start, 1),
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread",
    }
    scene.close()
    return out


# ---------------------------------------------------------------------------------- language without frames
# Issue 33: after a few frames, FRAMELESS_SHORT short questions and one of the longest length allowed, asked
# about the frame that follows them, then only cycles without a frame (a paused camera, a client waiting for
# its reply). Every question must end by itself (EOS, stop, length), none by its timeout.

FRAMELESS_SHORT = 14


def frameless_check(episodes: int, seed: int = 1000, checkpoint: Path | None = None, log=print) -> dict:
    """Per scene a fresh engine (its cost model learns from nothing, as after a start), three frames, then
    the scene's questions repeated to FRAMELESS_SHORT and one of max_question_chars characters."""
    torch.set_num_threads(1)
    checkpoint = Path(checkpoint or demo_checkpoint())
    cfg = demo_model_config(checkpoint)
    model = build_model(cfg, str(checkpoint))
    scene = ReachScene(cfg.vision.image_size)
    reasons: dict[str, int] = {}
    stuck, cycles, start = [], [], time.monotonic()
    for ep in range(episodes):
        episode = draw_episode(seed, ep)
        policy = EnginePolicy("oxygen", model, checkpoint)
        scene.reset(episode.layout)
        image, state = scene.render("base"), scene.joints()
        for i in range(3):
            policy.act(image, state, episode.prompt, np.zeros((cfg.action_horizon, cfg.action_dim), np.float32), 0.1 * i)
        texts = [q.text for q in scene_questions(episode.layout, scene.tip(), episode.rng)]
        limit = policy.engine.config.max_question_chars
        texts = (texts * FRAMELESS_SHORT)[:FRAMELESS_SHORT] + [((" ".join(texts) + " ") * limit)[:limit]]
        replies, n = policy.ask(image, state, episode.prompt, texts)
        cycles.append(n)
        for text, r in zip(texts, replies):
            reasons[r.finish_reason] = reasons.get(r.finish_reason, 0) + 1
            if not r.success:
                stuck.append({"episode": ep, "question_chars": len(text), "finish_reason": r.finish_reason,
                              "error": r.error})
        log(f"[frameless] scene {ep + 1}/{episodes}: {sum(r.success for r in replies)}/{len(replies)} replied "
            f"after {n} cycles without a frame")
    scene.close()
    return {"scenes": episodes, "seed": seed, "questions": episodes * (FRAMELESS_SHORT + 1),
            "questions_stuck": len(stuck), "stuck": stuck[:20], "finish_reasons": reasons,
            "frameless_cycles_max": max(cycles), "frameless_cycles_mean": float(np.mean(cycles)),
            "wall_s": round(time.monotonic() - start, 1)}


# ---------------------------------------------------------------------------------- execution under delay
# Issue #22: how a new chunk takes over when it arrives d ticks after its observation (naive, blend, rtc).
# Simulation time, deterministic: the chunk computed from the observation at tick t is first used at tick
# t + d; until then the robot keeps executing what it has (the start pose before the first chunk).

EXECUTION_DELAYS = (0, 3, 6, 10)


_ENGINE_DEFAULTS = EngineConfig()


@dataclass(frozen=True)
class RtcSettings:
    """The engine's RTC settings for the evaluation; defaults: the engine's (docs/rtc.md)."""
    schedule: str = _ENGINE_DEFAULTS.rtc_schedule
    max_guidance: float = _ENGINE_DEFAULTS.rtc_max_guidance
    execution_horizon: int = _ENGINE_DEFAULTS.rtc_execution_horizon   # where the weights end; 0: H - s
    correction: str = _ENGINE_DEFAULTS.rtc_correction                 # "error": LeRobot 0.6.1's; "vjp": the paper's
    margin_rows: int = _ENGINE_DEFAULTS.rtc_margin_rows              # rows pinned beyond the delay


PAPER_RTC = RtcSettings("exp", rtc.DEFAULT_MAX_GUIDANCE, 0, "vjp", 0)      # the paper's weights and correction


class DelayedEngine:
    """The engine, in process and synchronous (run_cycle), for one execution and delay. With execution rtc
    its actions task guides each chunk by the chunk it delivered last (the one playing when the new one is
    observed, as d <= the re-plan period), with the delay fixed at the simulated d (rtc_delay_rows)."""

    def __init__(self, model, checkpoint: Path, execution: str, delay: int, settings: RtcSettings):
        config = EngineConfig(rtc=execution == "rtc", rtc_delay_rows=delay, rtc_schedule=settings.schedule,
                              rtc_max_guidance=settings.max_guidance,
                              rtc_execution_horizon=settings.execution_horizon, rtc_correction=settings.correction,
                              rtc_margin_rows=settings.margin_rows)
        self.engine = build_engine(built_model=model, norm_stats=str(checkpoint / "norm_stats.json"),
                                   robot_io=RobotIOConfig(robot_action_dim=model.cfg.action_dim,
                                                          delta_action_mask=(True,) * model.cfg.action_dim),
                                   engine=config, kv_budget_mb=8.0)
        self.horizon, self.dim = model.cfg.action_horizon, model.cfg.action_dim

    def reset(self) -> None:
        """A new episode: nothing plays, nothing to continue."""
        self.engine.actions.forget()

    def plan(self, image: np.ndarray, state: np.ndarray, prompt: str, noise: np.ndarray, tick: int) -> ChunkResult:
        obs = Observation(tick * CONTROL_PERIOD_S, {CAMERA_SLOT: image}, {CAMERA_SLOT: True}, state, prompt)
        report = self.engine.run_cycle(obs, noise)
        if report.fault:
            raise RuntimeError(f"engine fault at tick {tick}: {report.fault}")
        return self.engine.latest_chunk()


@dataclass
class DelayedEpisode:
    success: bool
    steps: int
    commands: np.ndarray        # [T, joints] commanded joint positions, one per tick
    chunk_of_tick: np.ndarray   # [T] frame index of the chunk each command came from (-1: start pose held)
    blending: np.ndarray        # [T] bool: a mixture of two chunks (execution blend)
    switches: list              # ticks at which a chunk took over from another chunk
    rtc_delays: list            # per chunk, the delay RTC guided it with (None: plain)
    closest: float = float("nan")   # m: the tip's closest approach to the named cube's touch point


def run_delayed_episode(scene: ReachScene, layout: Layout, target: int, planner: DelayedEngine, prompt: str,
                        noise: int | np.random.Generator, steps: int, replan: int, delay: int, execution: str,
                        blend_steps: int, disturb=None, stop_at_touch: bool = True) -> DelayedEpisode:
    """One episode: every `replan` ticks a chunk from the current observation (its noise drawn from `noise`,
    a seed or a generator), first used `delay` ticks later through the ChunkFollower with `execution`.
    `disturb(tick, command) -> command`: what the arm is sent instead (training data: noise, samples)."""
    scene.reset(layout)
    planner.reset()
    follower = ChunkFollower(execution, blend_steps if execution == "blend" else 0)
    noise = np.random.default_rng(noise) if isinstance(noise, int) else noise
    pending: list[tuple[int, ChunkResult]] = []
    commands, chunk_of_tick, blending, switches, delays = [], [], [], [], []
    closest = scene.distance_to(target)

    def outcome(success: bool, ticks: int) -> DelayedEpisode:
        return DelayedEpisode(success, ticks, np.array(commands), np.array(chunk_of_tick), np.array(blending),
                              switches, delays, closest)

    touched = None
    for k in range(steps):
        if pending and pending[0][0] == k:
            follower.push(pending.pop(0)[1].plan)
        if k % replan == 0:
            chunk_noise = noise.standard_normal((planner.horizon, planner.dim)).astype(np.float32)
            chunk = planner.plan(scene.render("base"), scene.joints(), prompt, chunk_noise, k)
            delays.append(chunk.rtc_delay_rows)
            if delay == 0:
                follower.push(chunk.plan)
            else:
                pending.append((k + delay, chunk))
        cmd = follower.next(k * CONTROL_PERIOD_S)
        action = layout.start if cmd.action is None else cmd.action
        if cmd.switched and chunk_of_tick and chunk_of_tick[-1] >= 0:
            switches.append(k)
        commands.append(np.array(action, dtype=np.float64))
        chunk_of_tick.append(cmd.frame_index)
        blending.append(cmd.status == "blending")
        scene.step(action if disturb is None else disturb(k, action))
        closest = min(closest, scene.distance_to(target))
        if touched is None and scene.touching() == target:
            touched = k + 1
            if stop_at_touch:
                break
    return outcome(touched is not None, touched or steps)


def command_windows(ep: DelayedEpisode) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Per tick k >= 3: the jerk, mean over joints of |q[k] - 3 q[k-1] + 3 q[k-2] - q[k-3]| (the third
    difference of the commanded positions, rad per tick^3), and whether its window q[k-3..k] is a
    *boundary* window (its commands come from two chunks, or one is a blend of two) or a *within* window
    (one chunk, unblended). Windows that include the start pose held before the first chunk are neither."""
    q, src, mixed = ep.commands, ep.chunk_of_tick, ep.blending
    jerk, boundary, within = [], [], []
    for k in range(3, len(q)):
        window = src[k - 3:k + 1]
        jerk.append(float(np.abs(q[k] - 3 * q[k - 1] + 3 * q[k - 2] - q[k - 3]).mean()))
        held = (window < 0).any()
        one_chunk = (window == window[0]).all() and not mixed[k - 3:k + 1].any()
        boundary.append(not held and not one_chunk)
        within.append(not held and one_chunk)
    return np.array(jerk), np.array(boundary, dtype=bool), np.array(within, dtype=bool)


def execution_summary(episodes: list[DelayedEpisode]) -> dict:
    jerks, boundary, within, steps = [], [], [], []
    for ep in episodes:
        j, b, w = command_windows(ep)
        jerks.append(j)
        boundary.append(b)
        within.append(w)
        played = ep.chunk_of_tick >= 0
        both = played[1:] & played[:-1]       # consecutive commands from chunks (not the start pose)
        if both.any():
            steps.append(np.abs(np.diff(ep.commands, axis=0))[both].max())
    j, b, w = (np.concatenate(x) if x else np.zeros(0) for x in (jerks, boundary, within))
    ok = [ep.steps for ep in episodes if ep.success]
    return {
        "success_rate": float(np.mean([ep.success for ep in episodes])),
        "boundary_jerk": float(j[b].mean()) if b.any() else None,
        "within_jerk": float(j[w].mean()) if w.any() else None,
        "mean_jerk": float(j[b | w].mean()) if (b | w).any() else None,     # every window of chunk commands
        "max_command_step": float(max(steps)) if steps else None,
        "mean_steps_to_touch": float(np.mean(ok)) if ok else None,
        "switches": int(sum(len(ep.switches) for ep in episodes)),
        "rtc_guided_chunks": int(sum(d is not None for ep in episodes for d in ep.rtc_delays)),
        # How far each miss stayed from touching: near misses (0-2 cm) are the model's aim, not the execution.
        "misses_closest_cm": sorted(round(ep.closest * 100, 1) for ep in episodes if not ep.success),
    }


def paired_comparison(these: list[DelayedEpisode], naive: list[DelayedEpisode]) -> dict:
    """Success of an execution against naive's on the same episodes (same scenes, noise and delay): the
    episodes only one of them touched decide the difference. `ci95`: the Wald interval of a difference of
    paired proportions, (b - c) / n +- 1.96 sqrt(b + c - (b - c)^2 / n) / n (b: only this execution
    touched, c: only naive), for non-inferiority: "not below naive by more than x" where x = -ci95[0]."""
    this_ok = np.array([ep.success for ep in these])
    naive_ok = np.array([ep.success for ep in naive])
    n, b, c = len(this_ok), int((this_ok & ~naive_ok).sum()), int((naive_ok & ~this_ok).sum())
    diff = (b - c) / n
    half = 1.96 * np.sqrt(max(b + c - (b - c) ** 2 / n, 0.0)) / n
    return {"episodes": n, "only_this": b, "only_naive": c, "both": int((this_ok & naive_ok).sum()),
            "difference": diff, "ci95": [diff - half, diff + half]}


def delay_problems(delays, replan: int, horizon: int) -> list[str]:
    """A chunk must arrive before the next one is computed, and play until the next one arrives."""
    out = [f"delay {d} ticks must be >= 0" for d in delays if d < 0]
    if max(delays) > replan:
        out.append(f"delays up to {max(delays)} ticks need a re-plan period (--replan) >= {max(delays)}")
    if max(delays) + replan > horizon:
        out.append(f"delay + re-plan period must fit the chunk ({horizon} rows), got {max(delays)} + {replan}")
    return out


def evaluate_execution(episodes: int, seed: int | tuple[int, ...] = 1000, steps: int = 210, replan: int = 10,
                       delays=EXECUTION_DELAYS, executions=EXECUTIONS, blend_steps: int = 5,
                       settings: RtcSettings = RtcSettings(), checkpoint: Path | None = None,
                       traces: dict | None = None, log=print) -> dict:
    """Every (execution, delay) on the same seeded episodes and chunk noise as `evaluate`: `episodes` of each
    seed (several seeds pool their episodes). `traces`: filled with the first episode's DelayedEpisode per
    (execution, delay) (scripts/rtc_switch_plot.py). Every execution but naive is also compared with naive
    at the same delay, episode by episode (`vs_naive`, paired_comparison)."""
    seeds = (seed,) if isinstance(seed, int) else tuple(seed)
    checkpoint = Path(checkpoint or demo_checkpoint())
    cfg = demo_model_config(checkpoint)
    problems = delay_problems(delays, replan, cfg.action_horizon)
    if problems:
        raise ValueError("; ".join(problems))
    torch.set_num_threads(1)
    model = build_model(cfg, str(checkpoint))
    engines = {(e, d): DelayedEngine(model, checkpoint, e, d, settings) for e in executions for d in delays}
    scene = ReachScene(cfg.vision.image_size)
    results = {(e, d): [] for e in executions for d in delays}
    start = time.monotonic()
    for seed_ in seeds:
        for ep in range(episodes):
            episode = draw_episode(seed_, ep)
            for (e, d), rs in results.items():
                rs.append(run_delayed_episode(scene, episode.layout, episode.target, engines[(e, d)], episode.prompt,
                                              episode.noise_seed, steps, replan, d, e, blend_steps))
                if traces is not None and seed_ == seeds[0] and ep == 0:
                    traces[(e, d)] = rs[-1]
            log(f"[eval execution] seed {seed_} episode {ep + 1}/{episodes}: {episode.prompt!r} "
                + " ".join(f"{e}@{d}={'ok' if rs[-1].success else 'FAIL'}" for (e, d), rs in results.items()))
    scene.close()

    def summary(e: str, d: int) -> dict:
        out = execution_summary(results[(e, d)])
        if e != "naive" and ("naive", d) in results:
            out["vs_naive"] = paired_comparison(results[(e, d)], results[("naive", d)])
        return out

    return {
        "episodes": episodes * len(seeds), "seed": seeds[0] if len(seeds) == 1 else list(seeds),
        "steps": steps, "replan": replan, "control_hz": 70,
        "blend_steps": blend_steps, "checkpoint": checkpoint.name,
        "rtc": {"schedule": settings.schedule, "max_guidance": settings.max_guidance,
                "execution_horizon": settings.execution_horizon,
                "weights_end_row": min(settings.execution_horizon or cfg.action_horizon, cfg.action_horizon - replan),
                "correction": settings.correction, "margin_rows": settings.margin_rows},
        "execution": {e: {str(d): summary(e, d) for d in delays} for e in executions},
        "jerk_unit": "rad per tick^3 (mean over joints of |third difference| of commanded positions)",
        "wall_s": round(time.monotonic() - start, 1),
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread",
    }


# ---------------------------------------------------------------------------------------------- ROS path

_OUTCOME = re.compile(r"episode (\d+): '([^']*)': (?:touched in ([\d.]+) s|timed out ([\d.]+) cm away)")
_ANSWERS = re.compile(r"\[converse\] .*; (\d+)/(\d+) right\]")


def _ros_params(seed: int, episode_s: float, checkpoint: Path | None, execution: str | None = None,
                settings: RtcSettings = RtcSettings()) -> Path:
    """A parameters file for the bringup: the robot's episode seed and length, optionally other weights and
    how chunks take over (execution_params)."""
    nodes: dict[str, dict] = {"oxygen_sim_robot": {"seed": seed, "episode_s": episode_s}}
    if checkpoint is not None:
        checkpoint = Path(checkpoint).resolve()
        nodes["oxygen_engine"] = {"checkpoint": str(checkpoint), "norm_stats": str(checkpoint / "norm_stats.json")}
    for node, params in execution_params(execution, settings=settings).items():
        nodes.setdefault(node, {}).update(params)
    fd, path = tempfile.mkstemp(prefix="oxygen_eval_ros_", suffix=".yaml")
    with os.fdopen(fd, "w") as f:
        yaml.safe_dump({node: {"ros__parameters": params} for node, params in nodes.items()}, f)
    return Path(path)


def execution_params(execution: str | None, blend_steps: int = 5,
                     settings: RtcSettings = RtcSettings()) -> dict[str, dict]:
    """Node parameters for a way of taking chunks over (None: the demo's configuration, naive); the engine's
    real-time chunking is on exactly with execution rtc, with `settings` (the delay stays the engine's own)."""
    if execution is None:
        return {}
    engine: dict = {"rtc": execution == "rtc"}
    if execution == "rtc":
        engine.update(rtc_schedule=settings.schedule, rtc_max_guidance=settings.max_guidance,
                      rtc_execution_horizon=settings.execution_horizon, rtc_correction=settings.correction,
                      rtc_margin_rows=settings.margin_rows)
    return {"oxygen_action": {"execution": execution, "blend_steps": blend_steps if execution == "blend" else 0},
            "oxygen_engine": engine}


def evaluate_ros(episodes: int, seed: int = 1000, steps: int = 210, checkpoint: Path | None = None,
                 domain: int | None = None, startup_timeout_s: float = 120.0, log=print,
                 execution: str | None = None, settings: RtcSettings = RtcSettings()) -> dict:
    """Run the demo bringup until its robot has finished `episodes` episodes; their outcomes and the
    demo client's answers, as the simulator and the client judged them. `execution`: how the action
    publisher takes new chunks over (rtc: with the engine's real-time chunking, `settings`; None: as
    configured)."""
    episode_s = steps * CONTROL_PERIOD_S
    params = _ros_params(seed, episode_s, checkpoint, execution, settings)
    domain = domain if domain is not None else 1 + os.getpid() % 100
    env = dict(os.environ, ROS_DOMAIN_ID=str(domain), PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1")
    proc = subprocess.Popen([sys.executable, "-m", "oxygen_ros.bringup", "--demo", "--params-file", str(params)],
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    lines: list[str] = []
    reader = threading.Thread(target=lambda: lines.extend(line.rstrip("\n") for line in proc.stdout), daemon=True)
    reader.start()
    start = time.monotonic()
    deadline = start + startup_timeout_s + episodes * (episode_s + 2.0)
    outcomes: list[dict] = []
    try:
        while len(outcomes) < episodes:
            if proc.poll() is not None:
                raise RuntimeError(f"the bringup exited with {proc.returncode}:\n" + "\n".join(lines[-30:]))
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(outcomes)}/{episodes} episodes before the deadline:\n"
                                   + "\n".join(lines[-30:]))
            time.sleep(0.1)
            found = {}          # by episode (a log line may reach the output twice: console and /rosout)
            for m in filter(None, map(_OUTCOME.search, list(lines))):
                found.setdefault(int(m[1]), m)
            for m in list(found.values())[len(outcomes):episodes]:
                outcomes.append({"episode": int(m[1]), "prompt": m[2], "success": m[3] is not None,
                                 "seconds": float(m[3]) if m[3] else None,
                                 "distance_cm": float(m[4]) if m[4] else None})
                log(f"[eval --ros] episode {m[1]}: {m[2]!r} {'ok' if m[3] else 'FAIL ' + m[4] + ' cm'}")
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)         # the bringup's orderly shutdown
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait(5)
        reader.join(5)
        params.unlink(missing_ok=True)
    answers = [m for m in map(_ANSWERS.search, lines) if m]
    status = [line for line in lines if line.startswith("[status] actions")]
    ok = [o["seconds"] for o in outcomes if o["success"]]
    return {
        "path": "ros", "episodes": episodes, "seed": seed, "steps": steps, "control_hz": 70,
        "execution": execution or "as configured",
        "success_rate": float(np.mean([o["success"] for o in outcomes])),
        "mean_s_to_touch": float(np.mean(ok)) if ok else None,
        "failures_final_distance_cm": sorted(o["distance_cm"] for o in outcomes if not o["success"]),
        "outcomes": outcomes,
        "demo_client_answers": {"right": int(answers[-1][1]), "asked": int(answers[-1][2])} if answers else None,
        "last_status": status[-1] if status else None,
        "wall_s": round(time.monotonic() - start, 1),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores, engine 1 torch thread",
    }


def add_execution_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("execution under delay (issue #22, docs/rtc.md)")
    g.add_argument("--delay-ticks", default=None, help="comma-separated delays in ticks (default "
                   f"{','.join(map(str, EXECUTION_DELAYS))}): a chunk observed at tick t is first used at t + d")
    g.add_argument("--execution", default=None, help=f"comma-separated, of {', '.join(EXECUTIONS)} (default all)")
    g.add_argument("--blend-steps", type=int, default=5, help="ticks of linear blending (execution blend)")
    g.add_argument("--rtc-schedule", default=RtcSettings.schedule, choices=rtc.SCHEDULES,
                   help=f"prefix weights of the rows still to play (default {RtcSettings.schedule})")
    g.add_argument("--rtc-beta", type=float, default=RtcSettings.max_guidance, help="guidance weight clip")
    g.add_argument("--rtc-horizon", type=int, default=RtcSettings.execution_horizon,
                   help="row where the RTC weights end (LeRobot's execution_horizon; 0: the chunk's horizon, the "
                        "paper's H - s); cut to the previous chunk's remaining rows")
    g.add_argument("--rtc-correction", default=RtcSettings.correction, choices=rtc.CORRECTIONS,
                   help="error: LeRobot 0.6.1's (the model's Jacobian dropped); vjp: the paper's; prefix: the "
                        "pinned rows given to a checkpoint trained with prefix conditioning (--checkpoint)")
    g.add_argument("--rtc-margin", type=int, default=RtcSettings.margin_rows,
                   help="rows pinned beyond the delay (the first rows the new chunk plays); 0: the paper's weights")


def execution_main(p: argparse.ArgumentParser, a: argparse.Namespace) -> int:
    try:
        delays = tuple(int(d) for d in (a.delay_ticks or ",".join(map(str, EXECUTION_DELAYS))).split(","))
    except ValueError:
        p.error(f"--delay-ticks must be comma-separated integers, got {a.delay_ticks!r}")
    executions = tuple((a.execution or ",".join(EXECUTIONS)).split(","))
    problems = [f"--execution {e!r} is not one of {', '.join(EXECUTIONS)}" for e in executions if e not in EXECUTIONS]
    try:
        cfg = demo_model_config(Path(a.checkpoint or demo_checkpoint()))
    except ValueError as e:         # a checkpoint's config.json that says something unreadable
        p.error(str(e))
    if not a.ros:
        problems += delay_problems(delays, a.replan, cfg.action_horizon)
    if a.rtc_correction == "prefix" and "rtc" in executions and not cfg.prefix_conditioning:
        problems.append(f"--rtc-correction prefix: {PREFIX_UNTRAINED}")
    if a.ros and (a.delay_ticks is not None or len(executions) != 1 or a.replan != 10 or a.strip):
        problems.append("--ros takes one --execution and no --delay-ticks, --replan or --strip: through the real "
                        "nodes the delay and the re-planning are the engine's own")
    if a.blend_steps < 1 and "blend" in executions:
        problems.append(f"--blend-steps {a.blend_steps} must be >= 1 for execution blend")
    if not a.rtc_beta > 0 or a.rtc_horizon < 0 or a.rtc_margin < 0:
        problems.append(f"--rtc-beta {a.rtc_beta} must be > 0, --rtc-horizon {a.rtc_horizon} and --rtc-margin "
                        f"{a.rtc_margin} >= 0")
    if problems:
        p.error("; ".join(problems))
    settings = RtcSettings(a.rtc_schedule, a.rtc_beta, a.rtc_horizon, a.rtc_correction, a.rtc_margin)
    if a.ros:
        out = evaluate_ros(a.episodes, a.seed, a.steps, a.checkpoint, execution=executions[0], settings=settings)
    else:
        out = evaluate_execution(a.episodes, a.seeds, a.steps, a.replan, delays, executions, a.blend_steps,
                                 settings, a.checkpoint)
    print_json(out, a.json)
    return 0


def print_json(out: dict, path: Path | None) -> None:
    """An evaluation's result on stdout, and in `path` when given."""
    text = json.dumps(out, indent=1)
    if path:
        path.write_text(text + "\n")
    print(text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m oxygen_ros.eval",
                                description="Evaluate the demo model closed-loop in MuJoCo through the engine.")
    p.add_argument("--episodes", type=int, default=50, help="episodes per seed and setting (default 50)")
    p.add_argument("--seed", default="1000", help="episode seeds (training data uses 0); comma-separated seeds "
                   "pool --episodes of each (in-process --execution only)")
    p.add_argument("--steps", type=int, default=210, help="control ticks per episode (70 Hz)")
    p.add_argument("--replan", type=int, default=10, help="ticks executed from each chunk")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated serving policies to evaluate, of {', '.join(POLICIES)} (default all)")
    p.add_argument("--checkpoint", type=Path, default=None, help="default: the shipped demo weights")
    p.add_argument("--json", type=Path, default=None, help="also write the results (printed as JSON) to this file")
    p.add_argument("--strip", type=Path, default=None, help="PNG: frames of the first episode (README picture)")
    p.add_argument("--ros", action="store_true",
                   help="through oxygen_bringup --demo and the simulated robot node (ROS 2), in wall time")
    add_execution_arguments(p)
    p.add_argument("--openpi", action="store_true",
                   help="through oxygen_serve --robot demo and openpi-client's Runtime (serve/eval_openpi.py)")
    p.add_argument("--frameless", action="store_true",
                   help="language without frames: per scene (--episodes) 15 questions, one of the longest length, "
                        "then cycles without a frame; exit status 1 when one ends without a reply")
    a = p.parse_args(argv)
    try:
        a.seeds = tuple(int(x) for x in a.seed.split(","))
    except ValueError:
        p.error(f"--seed must be an integer or comma-separated integers, got {a.seed!r}")
    a.seed = a.seeds[0]
    if len(a.seeds) > 1 and (a.ros or a.openpi or (a.delay_ticks is None and a.execution is None)):
        p.error("several --seed values pool episodes in the in-process --execution evaluation only")
    if a.episodes < 1 or a.steps < 1 or a.replan < 1:
        p.error(f"--episodes {a.episodes}, --steps {a.steps} and --replan {a.replan} must be positive")
    if a.openpi and (a.ros or a.delay_ticks is not None or a.execution is not None):
        p.error("--openpi runs the demo through openpi-client's Runtime as served: not with --ros, "
                "--delay-ticks or --execution")
    if a.frameless:
        if a.ros or a.openpi or a.delay_ticks is not None or a.execution is not None or len(a.seeds) > 1:
            p.error("--frameless runs in process on its own: not with --ros, --openpi, --delay-ticks, --execution "
                    "or several --seed values")
        out = frameless_check(a.episodes, a.seed, a.checkpoint)
        print_json(out, a.json)
        return 1 if out["questions_stuck"] else 0
    if a.delay_ticks is not None or a.execution is not None:
        return execution_main(p, a)
    if a.ros and (a.strip or a.replan != 10 or a.policies != ",".join(POLICIES)):
        p.error("--ros runs the demo bringup as configured (config/demo.yaml): --strip, --replan and --policies "
                "apply to the in-process evaluation only")
    if a.openpi:
        from oxygen_ros.serve.eval_openpi import evaluate_openpi

        out = evaluate_openpi(a.episodes, a.seed, a.steps, a.replan, a.checkpoint)
    elif a.ros:
        out = evaluate_ros(a.episodes, a.seed, a.steps, a.checkpoint)
    else:
        out = evaluate(a.episodes, a.seed, a.steps, a.replan, tuple(a.policies.split(",")), a.checkpoint,
                       strip=a.strip)
    print_json(out, a.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
