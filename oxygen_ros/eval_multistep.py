"""Closed-loop evaluation of the hierarchical demo model on multi-step tasks (`python -m oxygen_ros.eval_multistep`;
docs/demo_model.md).

Per seeded episode (a scene of `draw_episode`, a 2-3 step task of `sim.tasks.draw_multistep_episode`), the same
model twice on the same scene, start and chunk noise:
- **hierarchy**: the model writes the subtask from the frame (pi052's joint recipe: the frame's prompt ends with
  the open `"Assistant:"` header), re-writes its progress memory when the subtask changes, and the actions read
  the prompt plus the newest subtask in the recipe's attention blocks (`JointReference`);
- **task only**: the actions read the task in the subtask's place (what the engine serves before a robot's
  first subtask, as LeRobot falls back), no text.
Every `--replan` ticks a chunk is computed from the current camera image and joint state and its first
`--replan` rows are executed; a step is done when the tip touches its cube (`sim.tasks.StepJudge`), and the
episode succeeds when every step is done within `--steps` ticks per step. The subtask is judged against the
simulator's current step at every frame, each progress memory against the steps done at the frame it was
written from. Success is compared episode by episode (`eval.paired_comparison`, the RTC evaluation's interval).

Served by the model's reference path (`model/inference.py`), serially: every frame generates its subtask
before its chunk (the engine's `subtask_sync` semantics).
"""
from __future__ import annotations

import argparse
import json
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch

from oxygen_ros.model import pi052
from oxygen_ros.model.attention import default_backend
from oxygen_ros.model.inference import ContiguousCache, greedy_generate, prefill, prefill_blocks, sample_actions
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
    """pi052's joint recipe on the model's reference path, one frame at a time, in the attention blocks the
    engine serves (`pi052.joint_tokens`). The frame's prompt `"User: {task}, State: ...;\\nAssistant:"` after
    the image is prefilled (bidirectional); the subtask is decoded greedily from its last position, the memory
    after pi052's memory turns continuing that header (`pi052.joint_request`), an answer after its question,
    each a causal continuation of that prefix; the actions read the image, that prompt, the subtask's tokens
    (causal) and [EOS, "\\n"] (a block that sees itself), each block one forward into the actions' cache."""

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

    def _state(self, state: np.ndarray) -> str:
        return pi052.state_text(self.norm.normalize_state(state))

    @torch.inference_mode()
    def generate(self, image: np.ndarray, state: np.ndarray, task: str, request: str, max_tokens: int) -> str:
        """The text after `request` (a fork at the end of the frame's prompt; "" for the subtask), greedy,
        decoded as the engine decodes it."""
        prompt = self.tok.encode(pi052.joint_prompt(task, self._state(state)) + pi052.GENERATION_PROMPT, bos=True)
        row = self._row(image, prompt)
        question = self.tok.encode(request)
        cache = ContiguousCache(self.model, self.model.prefix_length(row) + len(question) + max_tokens + 64)
        frame = prefill(self.model, cache, [row], self.backend)
        ids = greedy_generate(self.model, cache, frame.segments[0], frame.hidden, question, max_tokens,
                              self.tok.eos_id, self.backend)
        return pi052.decode_reply(self.tok, ids)

    @torch.inference_mode()
    def actions(self, image: np.ndarray, state: np.ndarray, task: str, conditioning: str,
                noise: np.ndarray) -> np.ndarray:
        joint = pi052.joint_tokens(self.tok, task, self._state(state), conditioning)
        blocks = [(joint.tokens[joint.bidir:-joint.tail], 0), (joint.tokens[-joint.tail:], joint.tail)]
        cache, prefix = prefill_blocks(self.model, self._row(image, joint.tokens[:joint.bidir]), blocks, self.backend)
        deltas = sample_actions(self.model, cache, [prefix], torch.from_numpy(noise)[None], backend=self.backend)
        return state + self.norm.unnormalize_actions(deltas[0].cpu().numpy())[:, :len(state)]

    def plan(self, image: np.ndarray, state: np.ndarray, task: str, noise: np.ndarray) -> Plan:
        if not self.hierarchy:
            return Plan(self.actions(image, state, task, task, noise), "", "", False)
        subtask = self.generate(image, state, task, pi052.joint_request(pi052.subtask_messages(task)),
                                SUBTASK_MAX_TOKENS)
        written = bool(self.subtask) and subtask != self.subtask
        if written:
            request = pi052.joint_request(pi052.memory_messages(task, self.memory, self.subtask))
            self.memory = self.generate(image, state, task, request, MEMORY_MAX_TOKENS)
        self.subtask = subtask
        return Plan(self.actions(image, state, task, subtask or task, noise), subtask, self.memory, written)

    def answer(self, image: np.ndarray, state: np.ndarray, task: str, question: str) -> str:
        return self.generate(image, state, task, f"{question}\n", ANSWER_MAX_TOKENS)


class EnginePlanner:
    """The engine in process (synchronous cycles, as `eval.EnginePolicy`) with its joint hierarchy: each frame's
    chunk reads the robot's newest finished subtask (the task's span until one exists) and never waits for a
    new one; a subtask is asked for every `every_chunks` chunks (7 x 143 ms: LeRobot's 1 Hz on the simulated
    clock), decoded in the engine's language budget, and the progress memory is re-written on a change."""

    hierarchy = True

    def __init__(self, model: Pi05, checkpoint: Path, every_chunks: int = 7):
        from oxygen_ros.engine.engine import EngineConfig
        from oxygen_ros.engine.factory import build_engine
        from oxygen_ros.robot.policy_io import RobotIOConfig

        self.model = model
        config = EngineConfig(hierarchy="joint", subtask_period_s=0.0, subtask_every_chunks=every_chunks)
        self.engine = build_engine(built_model=model, norm_stats=str(Path(checkpoint) / "norm_stats.json"),
                                   robot_io=RobotIOConfig(robot_action_dim=model.cfg.action_dim,
                                                          delta_action_mask=(True,) * model.cfg.action_dim),
                                   engine=config, kv_budget_mb=8.0)
        self.tick = 0
        self.memory_frame = -1

    def reset(self) -> None:
        self.engine.actions.forget()

    def plan(self, image: np.ndarray, state: np.ndarray, task: str, noise: np.ndarray) -> Plan:
        from oxygen_ros.eval import CAMERA_SLOT
        from oxygen_ros.robot.sync import Observation
        from oxygen_ros.sim.scene import CONTROL_PERIOD_S

        self.tick += 10
        report = self.engine.run_cycle(Observation(self.tick * CONTROL_PERIOD_S, {CAMERA_SLOT: image},
                                                   {CAMERA_SLOT: True}, state, task), noise)
        if report.fault:
            raise RuntimeError(f"engine fault: {report.fault}")
        chunk, language = self.engine.latest_chunk(), self.engine.language_state()
        written = language["memory_frame"] != self.memory_frame and language["memory_frame"] >= 0
        self.memory_frame = language["memory_frame"]
        return Plan(chunk.plan.actions, chunk.subtask, language["memory"], written)


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
                       checkpoint: Path | None = None, questions: bool = True, engine: bool = False,
                       log=print) -> dict:
    """`engine`: the hierarchy arm through the engine's joint hierarchy (EnginePlanner); the task-only arm
    stays on the reference path (the engine's hierarchy "off" serves a checkpoint's plain prompt instead)."""
    from oxygen_ros.engine.factory import build_model
    from oxygen_ros.eval import demo_model_config
    from oxygen_ros.robot.configs import demo_checkpoint

    torch.set_num_threads(1)
    checkpoint = Path(checkpoint or demo_checkpoint())
    cfg = demo_model_config(checkpoint)
    model = build_model(cfg, str(checkpoint))
    planners = {arm: JointReference(model, checkpoint, arm == "hierarchy") for arm in ARMS}
    if engine:
        planners["hierarchy"] = EnginePlanner(model, checkpoint)
    served_by = ("hierarchy: the engine (joint hierarchy, a subtask every 7 chunks, never waited for); task only: "
                 "the model reference path" if engine else
                 "model reference path (model/inference.py), serial: every frame's subtask before its chunk")
    scene = ReachScene(cfg.vision.image_size)
    details = []
    start = time.monotonic()
    for ep in range(episodes):
        episode = draw_multistep_episode(seed, ep)
        results = {arm: run_multistep_episode(scene, episode.layout, episode.task, planner, episode.noise_seed,
                                              ticks_per_step, replan) for arm, planner in planners.items()}
        answers = []
        if questions:
            scene.reset(episode.layout)
            rng = np.random.default_rng([seed, ep, 3])
            image, state = scene.render("base"), scene.joints()
            for q in scene_questions(episode.layout, scene.tip(), rng):
                reply = planners["task_only"].answer(image, state, episode.task.text, q.text)
                answers.append({"kind": q.kind, "question": q.text, "answer": q.answer, "reply": reply})
        details.append({"seed": seed, "episode": ep, "task": episode.task.text, "steps": episode.task.steps,
                        **{arm: asdict(r) for arm, r in results.items()}, "answers": answers})
        h, t = results["hierarchy"], results["task_only"]
        log(f"[eval multistep] episode {ep + 1}/{episodes}: {episode.task.text!r} hierarchy "
            f"{h.steps_done}/{h.steps}{' ok' if h.success else ''} task-only {t.steps_done}/{t.steps}"
            f"{' ok' if t.success else ''}; subtasks right {np.mean(h.subtask_right):.0%}")
    scene.close()
    return {"seed": seed, "ticks_per_step": ticks_per_step, "replan": replan, "control_hz": 70,
            "checkpoint": checkpoint.name,
            "served_by": served_by, **summarize(details), "wall_s": round(time.monotonic() - start, 1),
            "machine": f"{platform.processor() or platform.machine()}, torch {torch.__version__}, 1 thread",
            "details": details}


def summarize(details: list[dict]) -> dict:
    """The figures of per-episode results (`details`: one evaluation's, or several pooled)."""
    from oxygen_ros.eval import paired_comparison

    def arm_summary(rs: list[dict]) -> dict:
        ok = [r["ticks"] for r in rs if r["success"]]
        return {"episode_success_rate": float(np.mean([r["success"] for r in rs])),
                "step_success_rate": sum(r["steps_done"] for r in rs) / sum(r["steps"] for r in rs),
                "by_steps": {str(n): float(np.mean([r["success"] for r in rs if r["steps"] == n]))
                             for n in sorted({r["steps"] for r in rs})},
                "mean_ticks_to_finish": float(np.mean(ok)) if ok else None,
                "wrong_touches_per_episode": float(np.mean([r["wrong_touches"] for r in rs]))}

    arms = {arm: [d[arm] for d in details] for arm in ARMS}
    paired = paired_comparison([_Success(r["success"]) for r in arms["hierarchy"]],
                               [_Success(r["success"]) for r in arms["task_only"]])
    paired["only_hierarchy"], paired["only_task_only"] = paired.pop("only_this"), paired.pop("only_naive")
    frames = [ok for r in arms["hierarchy"] for ok in r["subtask_right"]]
    memories = [m for r in arms["hierarchy"] for m in r["memories"]]
    answers = [a for d in details for a in d["answers"]]
    kinds = sorted({a["kind"] for a in answers})
    return {
        "episodes": len(details),
        "arms": {arm: arm_summary(rs) for arm, rs in arms.items()},
        "hierarchy_vs_task_only": paired,     # episode success, the RTC evaluation's paired interval
        "subtask_accuracy": float(np.mean(frames)) if frames else None, "subtask_frames": len(frames),
        "memory_accuracy": float(np.mean([w == t for w, t in memories])) if memories else None,
        "memories_written": len(memories),
        "wrong_memories": [{"written": w, "true": t} for w, t in memories if w != t][:20],
        "answer_accuracy": float(np.mean([a["answer"] == a["reply"] for a in answers])) if answers else None,
        "answer_accuracy_by_kind": {k: float(np.mean([a["answer"] == a["reply"] for a in answers if a["kind"] == k]))
                                    for k in kinds},
        "questions_asked": len(answers),
    }


def pool(paths: list[Path]) -> dict:
    """Several evaluations' JSON (e.g. one per seed, run side by side) as one: their episodes pooled."""
    runs = [json.loads(Path(p).read_text()) for p in paths]
    details = [d for run in runs for d in run["details"]]
    return {"seeds": [run["seed"] for run in runs], "checkpoint": runs[0]["checkpoint"],
            "served_by": runs[0]["served_by"], "ticks_per_step": runs[0]["ticks_per_step"],
            "replan": runs[0]["replan"], **summarize(details),
            "wall_s": [run["wall_s"] for run in runs], "machine": runs[0]["machine"], "details": details}


@dataclass
class _Success:
    """What paired_comparison reads of an episode."""
    success: bool


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m oxygen_ros.eval_multistep",
                                description="The hierarchical demo model on multi-step tasks: the model's subtask "
                                            "and memory vs the task alone, paired on the same episodes; or --pool "
                                            "evaluations run side by side (e.g. one per seed).")
    p.add_argument("--episodes", type=int, default=50, help="episodes (default 50)")
    p.add_argument("--seed", type=int, default=1000, help="episode seed (training data uses 0)")
    p.add_argument("--steps", type=int, default=210, help="control ticks per task step (70 Hz)")
    p.add_argument("--replan", type=int, default=10, help="ticks executed from each chunk")
    p.add_argument("--checkpoint", type=Path, default=None, help="the hierarchical model's folder")
    p.add_argument("--engine", action="store_true",
                   help="the hierarchy through the engine's joint hierarchy (its own schedule) instead of the serial "
                        "reference path")
    p.add_argument("--pool", type=Path, nargs="+", default=None, help="pool these evaluations' JSON files instead")
    p.add_argument("--json", type=Path, default=None, help="also write the result here")
    a = p.parse_args(argv)
    if a.pool is None:
        out = evaluate_multistep(a.episodes, a.seed, a.steps, a.replan, a.checkpoint, engine=a.engine)
        text = json.dumps(out, indent=1)
        if a.json:
            a.json.write_text(text + "\n")
        print(text)
        return 0
    missing = [str(x) for x in a.pool if not x.is_file()]
    if missing:
        p.error(f"--pool: no such file {', '.join(missing)}")
    out = pool(a.pool)
    text = json.dumps(out, indent=1)
    if a.json:
        a.json.write_text(text + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "details"}, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
