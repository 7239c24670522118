"""Closed-loop evaluation of the hierarchical demo model on multi-step tasks (`python -m oxygen_ros.eval
--multistep`; docs/demo_model.md).

Per seeded episode (a scene of `draw_episode`, a 2-3 step task of `sim.tasks.draw_multistep_episode`), the same
model twice on the same scene, start and chunk noise:
- **hierarchy**: the model writes the subtask from the frame (pi052's joint format: `"Assistant:"` after the
  frame's prompt), re-writes its progress memory when the subtask changes, and the actions read the prompt plus
  the causal span of the newest subtask;
- **task only**: the actions read the task's span (what the engine serves before a robot's first subtask, as
  LeRobot falls back), no text.
Every `--replan` ticks a chunk is computed from the current camera image and joint state and its first
`--replan` rows are executed; a step is done when the tip touches its cube (`sim.tasks.StepJudge`), and the
episode succeeds when every step is done within `--steps` ticks per step. The subtask is judged against the
simulator's current step at every frame, each progress memory against the steps done at the frame it was
written from. Success is compared episode by episode (`eval.paired_comparison`, the RTC evaluation's interval).

Served by the model's reference path (`model/inference.py`), serially: every frame generates its subtask
before its chunk (the engine's `subtask_sync` semantics).
"""
from __future__ import annotations

import platform
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from oxygen_ros.model import pi052
from oxygen_ros.model.attention import CachedAttention, CachedRow, Segment, default_backend
from oxygen_ros.model.inference import ContiguousCache, greedy_generate, prefill, sample_actions
from oxygen_ros.model.normalize import Normalizer
from oxygen_ros.model.pi05 import Pi05, PrefixRow
from oxygen_ros.model.preprocess import to_pixels
from oxygen_ros.model.tokenizer import Tokenizer
from oxygen_ros.sim.questions import scene_questions
from oxygen_ros.sim.scene import ReachScene
from oxygen_ros.sim.tasks import (MultiStepTask, StepJudge, draw_multistep_episode, progress_memory,
                                  subtask_text)

ARMS = ("hierarchy", "task_only")
SUBTASK_MAX_TOKENS = 16
MEMORY_MAX_TOKENS = 32
ANSWER_MAX_TOKENS = 16


@dataclass
class Plan:
    actions: np.ndarray     # [H, joints] joint targets
    subtask: str            # what conditioned the actions ("" for the task only)
    memory: str             # the progress memory after this frame
    memory_written: bool    # this frame wrote a new memory


class JointReference:
    """pi052's joint format on the model's reference path, one frame at a time. The frame's prompt
    `"User: {task}, State: ...;\\n"` after the image is prefilled (bidirectional); the subtask is decoded
    greedily after `"Assistant:"` and the memory after pi052's memory turns, each a causal continuation of that
    prefix; the actions read the prompt and the span `"Assistant: {subtask}" EOS "\\n"`, prefilled with the
    prompt with the span causal (the engine extends the frame's prefix with it: the same attention)."""

    def __init__(self, model: Pi05, checkpoint: Path, hierarchy: bool = True):
        self.model, self.hierarchy = model, hierarchy
        self.tok = Tokenizer.tiny()
        self.norm = Normalizer.load(Path(checkpoint) / "norm_stats.json")
        self.backend = default_backend(model.device)
        self.reset()

    def reset(self) -> None:
        self.subtask, self.memory = "", ""

    def _row(self, image: np.ndarray, tokens: list[int]) -> PrefixRow:
        return PrefixRow(to_pixels(image, self.model.cfg.vision.image_size)[None], torch.tensor(tokens))

    def _prompt(self, task: str, state: np.ndarray) -> list[int]:
        text = pi052.joint_prompt(task, pi052.state_text(self.norm.normalize_state(state)))
        return self.tok.encode(text, bos=True)

    @torch.inference_mode()
    def generate(self, image: np.ndarray, state: np.ndarray, task: str, request: str, max_tokens: int) -> str:
        """The text after `request` (a fork at the end of the frame's prompt), greedy, stripped."""
        row = self._row(image, self._prompt(task, state))
        cache = ContiguousCache(self.model, self.model.prefix_length(row) + len(request) + max_tokens + 64)
        frame = prefill(self.model, cache, [row], self.backend)
        ids = greedy_generate(self.model, cache, frame.segments[0], frame.hidden, self.tok.encode(request),
                              max_tokens, self.tok.eos_id, self.backend)
        return self.tok.decode([t for t in ids if t != self.tok.eos_id]).strip()

    @torch.inference_mode()
    def actions(self, image: np.ndarray, state: np.ndarray, task: str, conditioning: str,
                noise: np.ndarray) -> np.ndarray:
        prompt = self._prompt(task, state)
        row = self._row(image, prompt + pi052.joint_span_tokens(self.tok, conditioning))
        n = self.model.prefix_length(row)
        cache = ContiguousCache(self.model, n)
        own = CachedRow(n_new=n, own=Segment(cache.allocate(n), n),
                        bidir=self.model.cfg.image_tokens + len(prompt))
        self.model.prefill([row], CachedAttention(cache.kv, [own], self.backend, self.model.device))
        deltas = sample_actions(self.model, cache, [own.own], torch.from_numpy(noise)[None], backend=self.backend)
        return state + self.norm.unnormalize_actions(deltas[0].cpu().numpy())[:, :len(state)]

    def plan(self, image: np.ndarray, state: np.ndarray, task: str, noise: np.ndarray) -> Plan:
        if not self.hierarchy:
            return Plan(self.actions(image, state, task, task, noise), "", "", False)
        subtask = self.generate(image, state, task, pi052.GENERATION_PROMPT, SUBTASK_MAX_TOKENS)
        written = bool(self.subtask) and subtask != self.subtask
        if written:
            request = pi052.render(pi052.memory_messages(task, self.memory, self.subtask)[1:])
            self.memory = self.generate(image, state, task, request, MEMORY_MAX_TOKENS)
        self.subtask = subtask
        return Plan(self.actions(image, state, task, subtask or task, noise), subtask, self.memory, written)

    def answer(self, image: np.ndarray, state: np.ndarray, task: str, question: str) -> str:
        return self.generate(image, state, task, f"{question}\n", ANSWER_MAX_TOKENS)


@dataclass
class MultiStepResult:
    success: bool
    steps_done: int
    steps: int
    ticks: int
    wrong_touches: int
    subtask_right: list[bool] = field(default_factory=list)     # per frame: the subtask that drove it vs the truth
    memories: list[tuple[str, str]] = field(default_factory=list)   # (written, true) per memory written


def run_multistep_episode(scene: ReachScene, layout, task: MultiStepTask, planner: JointReference,
                          noise_seed: int, ticks_per_step: int, replan: int) -> MultiStepResult:
    scene.reset(layout)
    planner.reset()
    judge = StepJudge(task)
    noise = np.random.default_rng(noise_seed)
    cfg = planner.model.cfg
    result = MultiStepResult(False, 0, task.steps, 0, 0)
    chunk = None
    for k in range(ticks_per_step * task.steps):
        if k % replan == 0:
            plan = planner.plan(scene.render("base"), scene.joints(), task.text,
                                noise.standard_normal((cfg.action_horizon, cfg.action_dim)).astype(np.float32))
            chunk = plan.actions
            if planner.hierarchy:
                result.subtask_right.append(plan.subtask == subtask_text(layout, task, judge.done))
                if plan.memory_written:
                    result.memories.append((plan.memory, progress_memory(layout, task, judge.done)))
        scene.step(chunk[k % replan])
        if judge.update(scene.touching(), k):
            scene.mark_touched(task.order[judge.done - 1])
        if judge.finished:
            result.success, result.ticks = True, k + 1
            break
    result.steps_done, result.wrong_touches = judge.done, judge.wrong_touches
    result.ticks = result.ticks or ticks_per_step * task.steps
    return result


def evaluate_multistep(episodes: int, seed: int = 1000, ticks_per_step: int = 210, replan: int = 10,
                       checkpoint: Path | None = None, questions: bool = True, log=print) -> dict:
    from oxygen_ros.engine.factory import build_model
    from oxygen_ros.eval import demo_model_config, paired_comparison
    from oxygen_ros.robot.configs import demo_checkpoint

    torch.set_num_threads(1)
    checkpoint = Path(checkpoint or demo_checkpoint())
    cfg = demo_model_config(checkpoint)
    model = build_model(cfg, str(checkpoint))
    planners = {"hierarchy": JointReference(model, checkpoint, True), "task_only": JointReference(model, checkpoint, False)}
    scene = ReachScene(cfg.vision.image_size)
    results = {arm: [] for arm in ARMS}
    answers = []
    start = time.monotonic()
    for ep in range(episodes):
        episode = draw_multistep_episode(seed, ep)
        for arm, planner in planners.items():
            results[arm].append(run_multistep_episode(scene, episode.layout, episode.task, planner,
                                                      episode.noise_seed, ticks_per_step, replan))
        if questions:
            scene.reset(episode.layout)
            rng = np.random.default_rng([seed, ep, 3])
            image, state = scene.render("base"), scene.joints()
            for q in scene_questions(episode.layout, scene.tip(), rng):
                answers.append((q, planners["hierarchy"].answer(image, state, episode.task.text, q.text)))
        h, t = results["hierarchy"][-1], results["task_only"][-1]
        log(f"[eval multistep] episode {ep + 1}/{episodes}: {episode.task.text!r} hierarchy "
            f"{h.steps_done}/{h.steps}{' ok' if h.success else ''} task-only {t.steps_done}/{t.steps}"
            f"{' ok' if t.success else ''}; subtasks right {np.mean(h.subtask_right):.0%}")
    scene.close()

    def arm_summary(rs: list[MultiStepResult]) -> dict:
        ok = [r.ticks for r in rs if r.success]
        return {"episode_success_rate": float(np.mean([r.success for r in rs])),
                "step_success_rate": sum(r.steps_done for r in rs) / sum(r.steps for r in rs),
                "by_steps": {str(n): float(np.mean([r.success for r in rs if r.steps == n]))
                             for n in sorted({r.steps for r in rs})},
                "mean_ticks_to_finish": float(np.mean(ok)) if ok else None,
                "wrong_touches_per_episode": float(np.mean([r.wrong_touches for r in rs]))}

    hier = results["hierarchy"]
    frames = [ok for r in hier for ok in r.subtask_right]
    memories = [m for r in hier for m in r.memories]
    kinds = sorted({q.kind for q, _ in answers})
    return {
        "episodes": episodes, "seed": seed, "ticks_per_step": ticks_per_step, "replan": replan, "control_hz": 70,
        "checkpoint": checkpoint.name, "served_by": "model reference path (model/inference.py), serial: every "
                                                   "frame's subtask before its chunk",
        "arms": {arm: arm_summary(rs) for arm, rs in results.items()},
        "hierarchy_vs_task_only": _paired(hier, results["task_only"], paired_comparison),
        "subtask_accuracy": float(np.mean(frames)) if frames else None, "subtask_frames": len(frames),
        "memory_accuracy": float(np.mean([w == t for w, t in memories])) if memories else None,
        "memories_written": len(memories),
        "wrong_memories": [{"written": w, "true": t} for w, t in memories if w != t][:20],
        "answer_accuracy": float(np.mean([q.answer == a for q, a in answers])) if answers else None,
        "answer_accuracy_by_kind": {k: float(np.mean([q.answer == a for q, a in answers if q.kind == k]))
                                    for k in kinds},
        "questions_asked": len(answers),
        "wall_s": round(time.monotonic() - start, 1),
        "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread",
    }


@dataclass
class _Success:
    """What paired_comparison reads of an episode."""
    success: bool


def _paired(hierarchy: list[MultiStepResult], task_only: list[MultiStepResult], compare) -> dict:
    """Episode success of the hierarchy against the task only on the same episodes (the RTC evaluation's
    paired interval, its "naive" being the task only here)."""
    out = compare([_Success(r.success) for r in hierarchy], [_Success(r.success) for r in task_only])
    out["only_hierarchy"], out["only_task_only"] = out.pop("only_this"), out.pop("only_naive")
    return out
