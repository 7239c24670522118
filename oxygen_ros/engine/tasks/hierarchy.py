"""The hierarchy task (hierarchical π0.5, LeRobot's pi052 formats): per robot, the model writes a subtask for
its task ("put the cups away" -> "pick up the red cup"), the actions are conditioned on the robot's newest
finished subtask, a progress memory is re-written when the subtask changes, and an operator's interjection
gets a plan and a spoken reply (its first `<say>...</say>`).

Every text is a language request of the engine's own kinds (subtask, progress, interjection): the scheduler
admits it onto the robot's frame and it is decoded in the same batched decode steps as every other request,
within the language budget, never ahead of a chunk. So a frame's actions never wait for text: they use the
robot's newest finished subtask (the task itself until one exists, as LeRobot falls back). A subtask is
asked for every `subtask_period_s` (LeRobot's runtime: 1 Hz) and/or `subtask_every_chunks`, one at a time per
robot. `subtask_sync` is the serial reference (LeRobot's order): a frame whose subtask is due waits for it,
decoded greedily at once on that frame before its actions.

The two formats (model/pi052.py) share what their attention allows:
- joint: the frame's prefix is images + "User: {task}, State: ...;\\nAssistant:", all bidirectional, one
  prefill per frame: the same tokens as the subtask request, so the subtask is a request with no question
  (its first token from the frame's last position). The memory and interjection turns are causal forks
  continuing that header (`pi052.joint_request`). The actions read the prefix plus the span in the
  branch's blocks (`pi052.joint_tokens`): the subtask's tokens, causal, then EOS and "\\n", which see each
  other, extended onto the frame before the denoise (`ModelRunner.extend_spans`: a few tokens, the
  prefix's partly filled last block copied on write). When the newest subtask's first piece has no leading
  space, the lone space piece belongs to the actions' bidirectional block: the frame's prefill is that block
  (the actions never pay a second prefill), and a text continuing the header on such a frame is given a
  prefill of its own of the header when admitted, in the language time (`PreparedFrame.text_prompt`).
- pi052 (the default recipe): the frame's prefix is images + "User: {subtask}, State: ...;\\n"; the prefix is
  bidirectional, so each text needs a prefill of its own (images + its messages), admitted like a question
  when it fits the cycle's language time: once per refresh, never per frame.
"""
from __future__ import annotations

import collections
import logging
import math
import threading
from dataclasses import dataclass, field, replace
from typing import Callable

import torch

from oxygen_ros.model import pi052
from oxygen_ros.model.pi05 import PrefixRow
from oxygen_ros.model.sampler import sample
from oxygen_ros.model.tokenizer import Tokenizer
from oxygen_ros.robot.errors import InputError
from oxygen_ros.robot.text import validate_text

from ..config import EngineConfig
from ..cycle import Frame
from ..kv_pool import FrameCache
from ..model_runner import EngineFault, ModelRunner, TextRow
from ..requests import Reply, RequestHandle, TextRequest, refused
from ..stats import EngineStats

log = logging.getLogger("oxygen_ros.engine")

TEXT_KINDS = ("subtask", "memory", "plan", "speech")        # what `language_state` and the listeners report
TEXT_TIMEOUT_S = 30.0                                       # a subtask or memory request not answered by then


@dataclass(frozen=True)
class LanguageUpdate:
    """A robot's subtask, progress memory, plan or speech changed (`kind`); `frame_index`/`stamp`: the frame
    whose KV the text was decoded from."""

    robot: str
    kind: str
    text: str
    frame_index: int
    stamp: float


@dataclass
class _RobotLanguage:
    task: str = ""
    texts: dict = field(default_factory=lambda: {k: ("", -1, 0.0) for k in TEXT_KINDS})   # (text, frame, stamp)
    asking: bool = False                  # a subtask request is in flight
    asked_at: float = -math.inf           # engine clock of the last subtask request
    chunks: int = 0                       # chunks delivered since then
    generation: int = 0                   # +1 per new task: replies about an older task are dropped


class HierarchyTask:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, config: EngineConfig,
                 text_format: pi052.Pi052Format | None, submit: Callable[..., RequestHandle], stats: EngineStats,
                 clock: Callable[[], float], notify: Callable[[LanguageUpdate], None]):
        """`text_format`: the checkpoint's pi052 format, if it is one (config hierarchy "auto" follows it; "off"
        or no format: the task does nothing)."""
        self.runner, self.tokenizer, self.config = runner, tokenizer, config
        self.submit, self.stats, self.clock, self.notify = submit, stats, clock, notify
        self.mode = config.hierarchy if config.hierarchy != "auto" else \
            "off" if text_format is None else "joint" if text_format.joint else "pi052"
        self.format = replace(text_format or pi052.Pi052Format(False, pi052.DEFAULT_FAST_SKIP_TOKENS),
                              joint=self.mode == "joint")
        self.joint = self.format.joint
        self.masked = tuple(self.format.masked_ranges(runner.cfg.vocab_size, allow_loc=False))
        self._robots: dict[str, _RobotLanguage] = {}
        self._lock = threading.Lock()                # language_state is read from any thread
        # submitted -> finished of the recent subtask and memory replies (diagnostics, the benchmark)
        self.latency_s = {"subtask": collections.deque(maxlen=256), "memory": collections.deque(maxlen=256)}

    # ------------------------------------------------------------------ the cycle (engine thread)
    def prompt(self, frames: list[Frame], faults: list[tuple[Frame, str]]) -> list[Frame]:
        """Before the prefill: each frame's prompt in the checkpoint's format (a new task resets the robot's
        texts); the default recipe's prompt carries the subtask (serially decoded first when due in sync mode).
        Joint recipe: the prompt through "Assistant:", the subtask request's; outside sync mode the actions'
        bidirectional block for the robot's newest subtask (`pi052.joint_tokens`), which differs from it by
        the lone space piece when the subtask's first piece does not carry its leading space: the actions then
        always read the frame's prefill, and a text continuing the prompt gets a prefill of its own of the
        plain prompt when it is admitted (`PreparedFrame.text_prompt`), in the language time after the chunk."""
        if self.mode == "off":
            return frames
        kept = []
        for f in frames:
            try:
                r = self._robot(f.robot, f.task)
                if self.config.subtask_sync and not self.joint and self._due(r):
                    with self.runner.prefill_one(self._own_prefix(f, pi052.subtask_messages(r.task)), f.index,
                                                 f.prepared.stamp) as own:
                        self._subtask_decoded(f.robot, r.generation, self._decode_now(own, []), f)
                f.subtask = self._subtask(r)
                if not self.joint:
                    f.prepared = f.preparer.reprompt(f.prepared, self.tokenizer.encode(
                        pi052.action_prompt(f.subtask, _state(f)), bos=True))
                else:
                    plain = self.tokenizer.encode(pi052.joint_prompt(r.task, _state(f)) + pi052.GENERATION_PROMPT,
                                                  bos=True)
                    if self.config.subtask_sync:        # the subtask is decoded on the frame's prefill first
                        f.prepared = f.preparer.reprompt(f.prepared, plain)
                    else:
                        span = pi052.joint_tokens(self.tokenizer, r.task, _state(f), f.subtask)
                        f.prepared = f.preparer.reprompt(f.prepared, span.tokens[:span.bidir], plain)
                kept.append(f)
            except Exception as e:  # noqa: BLE001 - this frame only
                faults.append((f, f"{type(e).__name__}: {e}"))
        return kept

    def spans(self, frames: list[Frame], cycle) -> None:
        """Joint format, after the prefill: each frame's subtask span extended onto its prefix for its actions
        (sync mode: the subtask decoded on the frame first when due). Raises as the frames' prefill does.
        The frame's prefix is the span's bidirectional block (`prompt`), except in sync mode when the subtask's
        first piece does not carry its leading space (pi052.JointPrompt): the frame's prefix is then the
        subtask request's prompt, and that frame's actions read an own prefill of the prompt with the lone
        space piece (counted: joint_own_prefill)."""
        if not self.joint or not frames:
            return
        for f in frames:
            r = self._robots[f.robot]
            if self.config.subtask_sync and self._due(r):
                self._subtask_decoded(f.robot, r.generation, self._decode_now(f.cache, []), f)
                f.subtask = self._subtask(r)
        prefixes, causal, tails = [], [], []
        for f in frames:
            span = pi052.joint_tokens(self.tokenizer, f.task, _state(f), f.subtask)
            prefix, head, end = f.cache, len(f.prepared.row.tokens), len(span.tokens) - span.tail
            if span.tokens[:span.bidir] != f.prepared.row.tokens.tolist() and not f.prepared.prompt_truncated:
                # (A prompt cut to max_token_len, reported with the chunk, goes on causally from the cut.)
                self.stats.count("joint_own_prefill")
                row = PrefixRow(f.prepared.row.images, torch.tensor(span.tokens[:span.bidir], dtype=torch.long))
                prefix, head = cycle.enter_context(self.runner.prefill_one(row, f.index, f.prepared.stamp)), span.bidir
            prefixes.append(prefix)
            causal.append(span.tokens[head:end])
            tails.append(span.tokens[end:])
        forks = self.runner.extend_spans(prefixes, causal, tails)
        for f, fork in zip(frames, forks):
            f.action_cache = cycle.enter_context(fork)

    def after_chunk(self, f: Frame) -> None:
        """A robot's chunk was delivered: ask for its next subtask on this frame when one is due."""
        if (r := self._robots.get(f.robot)) is None:
            return
        r.chunks += 1
        if self.config.subtask_sync or not self._due(r):
            return
        r.asking, r.asked_at, r.chunks = True, self.clock(), 0
        generation = r.generation
        self._ask(f.robot, "subtask", pi052.subtask_messages(r.task), TEXT_TIMEOUT_S,
                  lambda reply: self._subtask_replied(f.robot, generation, reply))

    # ------------------------------------------------------------------ operators (any thread)
    def interject(self, text: str, robot: str, timeout_s: float) -> RequestHandle:
        """The operator's interjection about `robot`'s task: when its reply finishes, the robot's plan and speech
        are updated (before the handle's waiters wake); the Reply's text is the raw reply."""
        request = TextRequest(str(text), kind="interjection", owner=robot, timeout_s=timeout_s)
        if self.mode == "off":
            return refused(request, "interjections need hierarchical language (hierarchy: pi052 or joint)",
                           self.clock())
        try:
            text = validate_text(text, what="interjection", max_chars=self.config.max_question_chars)
            if not (isinstance(timeout_s, (int, float)) and 0 < timeout_s <= self.config.max_timeout_s):
                raise ValueError(f"timeout_s must be in (0, {self.config.max_timeout_s:g}] seconds, got {timeout_s!r}")
        except (InputError, ValueError) as e:
            return refused(request, str(e), self.clock())
        with self._lock:
            r = self._robots.get(robot)
            task, plan, generation = (r.task, r.texts["plan"][0], r.generation) if r else ("", "", 0)
        if not task:
            whose = f"robot {robot!r}" if robot else "the robot"
            return refused(request, f"no task yet from {whose}: an interjection re-plans a task its frames carry",
                           self.clock())
        return self._ask(robot, "interjection", pi052.interjection_messages(task, plan, text), timeout_s,
                         lambda reply: self._interjection_replied(robot, generation, reply))

    def language_state(self, robot: str) -> dict:
        with self._lock:
            r = self._robots.get(robot) or _RobotLanguage()
            state = {"task": r.task}
            for kind, (text, index, stamp) in r.texts.items():
                state.update({kind: text, f"{kind}_frame": index, f"{kind}_stamp": stamp})
            return state

    def forget(self, robot: str) -> None:
        with self._lock:
            self._robots.pop(robot, None)

    # ------------------------------------------------------------------ internals
    def _robot(self, robot: str, task: str) -> _RobotLanguage:
        with self._lock:
            r = self._robots.get(robot)
            if r is None or r.task != task:
                r = self._robots[robot] = _RobotLanguage(task=task, generation=(r.generation + 1) if r else 0)
            return r

    @staticmethod
    def _subtask(r: _RobotLanguage) -> str:
        return r.texts["subtask"][0] or r.task          # LeRobot's fallback: the task until a subtask exists

    def _due(self, r: _RobotLanguage) -> bool:
        c = self.config
        if r.asking:
            return False
        if r.asked_at == -math.inf:
            return True
        return (c.subtask_period_s > 0 and self.clock() - r.asked_at >= c.subtask_period_s) or \
            (c.subtask_every_chunks > 0 and r.chunks >= c.subtask_every_chunks)

    def _question(self, messages: list[pi052.Message]) -> list[int]:
        """Joint format: a text's tokens after the frame's prompt (the task's turn, with the state, and the
        open "Assistant:" header)."""
        return self.tokenizer.encode(pi052.joint_request(messages))

    def _own_prefix(self, f: Frame, messages: list[pi052.Message]) -> PrefixRow:
        return PrefixRow(f.prepared.row.images, torch.tensor(self._prefix_tokens(messages), dtype=torch.long))

    def _prefix_tokens(self, messages: list[pi052.Message]) -> list[int]:
        return self.tokenizer.encode(pi052.render(messages), bos=True)[:self.runner.cfg.max_token_len]

    def _ask(self, robot: str, kind: str, messages: list[pi052.Message], timeout_s: float,
             settle: Callable[[Reply], None]) -> RequestHandle:
        request = TextRequest(pi052.render(messages), max_tokens=self.format.max_new_tokens, kind=kind, owner=robot,
                              timeout_s=timeout_s)
        if self.joint:       # the task's turn and the header are the frame's prompt: the fork continues after it
            return self.submit(request, question=self._question(messages), masked=self.masked, settle=settle)
        return self.submit(request, own_prefix=self._prefix_tokens(messages), masked=self.masked, settle=settle)

    def _decode_now(self, prefix: FrameCache, question: list[int]) -> str:
        """Sync mode: greedy text after `prefix` (and `question`) decoded at once, as the branch's
        select_message does: masked ids never sampled, EOS ends it, at most max_new_tokens."""
        blocks, n = self.runner.pool.blocks, self.format.max_new_tokens
        own = blocks.allocate(max(1, blocks.blocks_for(len(question) + n - 1)))
        try:
            logits = self.runner.extend([TextRow(prefix.segment, own, 0, question)]) if question else \
                self.runner.frame_logits(prefix)
            own_len, tokens = len(question), []
            while True:
                logits = logits.clone()
                for lo, hi in self.masked:
                    logits[:, lo:hi] = -math.inf
                (token,), (ok,) = sample(logits, [0.0], [1.0], [None])
                if not ok:
                    raise EngineFault(f"frame {prefix.frame_index}: non-finite logits in the subtask text")
                if token == self.tokenizer.eos_id and not self.config.ignore_eos:
                    break
                tokens.append(token)
                if len(tokens) >= n:
                    break
                logits = self.runner.extend([TextRow(prefix.segment, own, own_len, [token])])
                own_len += 1
        finally:
            blocks.decref(own)
        return pi052.decode_reply(self.tokenizer, tokens)

    def _subtask_replied(self, robot: str, generation: int, reply: Reply) -> None:
        with self._lock:
            r = self._robots.get(robot)
            if r is not None and r.generation == generation:
                r.asking = False
        self.latency_s["subtask"].append(reply.latency_s)
        if not reply.success:
            self.stats.count("subtask_failed")
            return
        self._subtask_decoded(robot, generation, pi052.decode_reply(self.tokenizer, reply.tokens), reply)

    def _subtask_decoded(self, robot: str, generation: int, text: str, source) -> None:
        """A subtask text of frame `source` (a Reply or a Frame): the robot's newest, and on a change its
        progress memory is re-written (pi052's memory prompt, the previous subtask completed). An empty text
        is dropped (the previous subtask stays), as LeRobot's runtime does; the text is otherwise kept as
        decoded (`pi052.decode_reply`), since the joint recipe's actions read it re-encoded as the branch does."""
        text = text.strip()
        index, stamp = (source.frame_index, source.frame_stamp) if isinstance(source, Reply) else \
            (source.index, source.prepared.stamp)
        with self._lock:
            r = self._robots.get(robot)
            if r is None or r.generation != generation:
                return
            if self.config.subtask_sync:
                r.asked_at, r.chunks = self.clock(), 0
            if not text:
                return
            previous = r.texts["subtask"][0]
            r.texts["subtask"] = (text, index, stamp)
            task, memory = r.task, r.texts["memory"][0]
        if text == previous:
            return
        self.notify(LanguageUpdate(robot, "subtask", text, index, stamp))
        if self.config.progress_memory and self.format.memory:
            self._ask(robot, "progress", pi052.memory_messages(task, memory, previous), TEXT_TIMEOUT_S,
                      lambda reply: (self.latency_s["memory"].append(reply.latency_s),
                                     self._set(robot, generation, {"memory": reply.text}, reply)))

    def _interjection_replied(self, robot: str, generation: int, reply: Reply) -> None:
        plan, speech = pi052.split_plan_and_say(reply.text)
        self._set(robot, generation, {"plan": plan, "speech": speech}, reply)

    def _set(self, robot: str, generation: int, texts: dict[str, str], reply: Reply) -> None:
        if not reply.success:
            self.stats.count("language_failed")
            return
        changed = []
        with self._lock:
            r = self._robots.get(robot)
            if r is None or r.generation != generation:
                return
            for kind, text in texts.items():
                text = text.strip()
                if kind != "speech" and not text:
                    continue                 # an empty memory or plan keeps the previous one
                if text != r.texts[kind][0]:
                    changed.append(kind)
                r.texts[kind] = (text, reply.frame_index, reply.frame_stamp)
        for kind in changed:
            self.notify(LanguageUpdate(robot, kind, texts[kind].strip(), reply.frame_index, reply.frame_stamp))


def _state(f: Frame) -> str | None:
    """The state's bins as the frame's prompt carries them (None when the robot's prompt has no state)."""
    return pi052.state_text(f.prepared.model_state) if f.preparer.state_in_prompt else None
