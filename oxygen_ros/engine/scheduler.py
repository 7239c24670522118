"""The scheduler: which language work a frame cycle does. Knows nothing of models or kernels.

`Scheduler` owns the waiting queue (sequences submitted from any thread), admission (attach to a frame,
own blocks from the block manager, room kept free for the next frame's prefix), the running set, expiry
(cancel, timeout counted from submission), the decode budget and the post-processing of sampled tokens
(EOS, stop strings, max_tokens, partial replies). `Scheduler.finish` is the one place a sequence ends:
it releases the sequence's blocks and frame reference and answers its handle, on every path.

The decode budget (`DecodeBudget`):
- "fixed": exactly `tokens_per_frame` batched decode steps per cycle (the OxyGen paper's setting);
- "deadline": keep stepping while the predicted end of the next step stays before the cycle's deadline
  (the frame period after the cycle started: the next action chunk is due then), with at least
  `min_steps` per cycle so that every active request makes progress even when the frame is late.
Step times are predicted from measurements per batch size (exponential moving average).

Robots (issue #17): a request's `owner` is the robot whose camera it asks about; admission attaches it to
that robot's frame of the current cycle (a robot without a frame this cycle keeps its requests queued).
Owner "" means the engine's only robot; an engine serving several robots refuses owner "" unless one of
them is named "" (a caller must say which robot it asks about). Admission round-robins between owners,
continuing after the owner served last, so one robot's burst cannot starve another's replies.
"""
from __future__ import annotations

import collections
import itertools
import logging
import math
import threading
from dataclasses import replace
from typing import Callable, Mapping

import numpy as np
import torch

from oxygen_ros.model.sampler import sample
from oxygen_ros.model.tokenizer import Tokenizer
from oxygen_ros.robot.errors import InputError
from oxygen_ros.robot.text import validate_text

from .block_manager import BlockManager
from .config import EngineConfig
from .kv_pool import FrameCache
from .requests import Reply, RequestHandle, Sequence, StopMatcher, TextRequest, refused
from .stats import EngineStats

log = logging.getLogger("oxygen_ros.engine")

KINDS = ("conversation", "memory")
HIERARCHY_KINDS = ("subtask", "progress", "interjection")     # the engine's own requests (tasks/hierarchy.py)
# Kept free before a cycle's deadline when its prefill is planned: the fitted coefficients carry rounding
# error (~1e-16 s a token), and a plan that fills the time exactly must not end a femtosecond late.
PLAN_MARGIN_S = 1e-6


class ForwardCost:
    """The online cost model of a text forward (a decode step or a question prefill): time = a + b x rows +
    c x tokens with a, b, c >= 0, fitted by non-negative least squares over the last `window` decode steps
    and the last `window` question prefills measured (kept apart, so that a run of decode steps never pushes
    the prefills that make the token cost identifiable out of the window), plus the exact moving average of
    decode steps per batch size (rows = tokens), which wins where it exists.

    A coefficient is never negative: an unconstrained fit of a forward that is faster than linear (its
    per-token cost falls as it grows) can come out with a negative intercept or row cost, and predict that a
    large forward fits where a small one does not, or that nothing fits at all. Before a token cost is
    known (`tokens_within` None), the budget's guaranteed minimum does the work, which then measures it."""

    def __init__(self, window: int = 32, smoothing: float = 0.3):
        self.smoothing = smoothing
        self._step_s: dict[int, float] = {}                       # decode steps: batch size -> moving average
        self._steps: collections.deque = collections.deque(maxlen=window)      # (rows, tokens, seconds)
        self._prefills: collections.deque = collections.deque(maxlen=window)
        self._coef: np.ndarray | None = None                      # (a, b, c), each >= 0

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        if not (math.isfinite(seconds) and seconds >= 0 and rows >= 1 and tokens >= rows):
            return                                                  # a clock step back, a bogus figure
        if rows == tokens:
            self._step_s[rows] = _ema(self._step_s.get(rows), seconds, self.smoothing)
            self._steps.append((rows, tokens, seconds))
        else:
            self._prefills.append((rows, tokens, seconds))
        seen = list(self._steps) + list(self._prefills)
        self._coef = _nonnegative_fit(np.array([(1.0, r, t) for r, t, _ in seen]), np.array([s for _, _, s in seen]))

    @property
    def coefficients(self) -> tuple[float, float, float] | None:
        """(a, b, c) of time = a + b x rows + c x tokens, or None before any measurement."""
        return None if self._coef is None else tuple(float(x) for x in self._coef)

    def step(self, batch: int) -> float:
        """A decode step of `batch` rows: its own average, else the linear model (0 before any measurement:
        the guaranteed minimum measures it)."""
        if batch in self._step_s:
            return self._step_s[batch]
        return self.forward(batch, batch)

    def forward(self, rows: int, tokens: int) -> float:
        return 0.0 if self._coef is None else float(self._coef @ (1.0, rows, tokens))

    def tokens_within(self, seconds: float, rows: int) -> int | None:
        """Most tokens a forward over `rows` rows is predicted to take in `seconds`: the largest n with
        forward(rows, n) <= seconds (0 when not even the rows fit); None while the token cost is unknown."""
        if self._coef is None or self._coef[2] <= 0:
            return None
        a, b, c = self._coef
        return max(0, math.floor((seconds - a - b * rows) / c))


def _nonnegative_fit(x: np.ndarray, y: np.ndarray) -> np.ndarray:
    """Least squares of x @ coef ~ y with every coefficient >= 0 (three columns: the exact answer is the best
    of the unconstrained fits over the subsets of columns whose coefficients all come out non-negative;
    Lawson and Hanson's active set, enumerated)."""
    best, best_residual = np.zeros(x.shape[1]), float(np.sum(y * y))
    # Largest subsets first, ties kept: measurements that cannot tell the columns apart (one forward size
    # seen so far) give the minimum-norm fit, which shares the time out (token cost > 0), not an intercept
    # alone (no token cost: nothing would be predicted to fit).
    for k in range(x.shape[1], 0, -1):
        for cols in itertools.combinations(range(x.shape[1]), k):
            sub = np.linalg.lstsq(x[:, cols], y, rcond=None)[0]
            if (sub < 0).any():
                continue
            residual = float(np.sum((x[:, cols] @ sub - y) ** 2))
            if residual < best_residual - 1e-15 * max(1.0, best_residual):
                best, best_residual = np.zeros(x.shape[1]), residual
                best[list(cols)] = sub
    return best


class LanguageBudget:
    """How much language work a cycle does, from the online cost model (`ForwardCost`) of what the forwards
    measured. The cycle's deadline is the earlier of its robots' next chunk due and the next camera frame
    expected (actions first); a cycle without a frame has a frame period (the engine sets its deadline).

    Question prefill, chunked (as Sarathi-Serve and vLLM do): each cycle prefills the next tokens of the
    questions admitted so far, in one batched forward, and a long question spreads over cycles (its partial
    KV stays in its own blocks). "deadline": as many question tokens as fit before the deadline after
    `min_steps` decode steps of the running batch, predicted for the rows the forward really takes (the
    questions that get tokens, not all that wait), and at least `chunk_tokens` in every cycle while questions
    wait, frame or no frame (language is slowed, never starved; a cost model that predicts nothing fits
    cannot stall it, and the minimum it does is measured); "fixed": exactly up to `chunk_tokens`.
    Decode steps: "fixed": exactly `tokens_per_frame` per cycle (the OxyGen paper's setting); "deadline":
    while the predicted end of the next step stays before the deadline, and at least `min_steps` (at least
    one in a cycle without a frame: nothing else is waiting for the time)."""

    def __init__(self, mode: str, tokens_per_frame: int, min_steps: int, chunk_tokens: int):
        if mode not in ("fixed", "deadline"):
            raise ValueError(f"unknown decode budget mode {mode!r}")
        self.mode, self.tokens_per_frame, self.min_steps = mode, tokens_per_frame, min_steps
        self.chunk_tokens = chunk_tokens
        self.cost = ForwardCost()

    def another_step(self, steps_done: int, now: float, deadline: float, batch: int, frame: bool = True) -> bool:
        if self.mode == "fixed":
            return steps_done < self.tokens_per_frame
        if steps_done < (self.min_steps if frame else max(1, self.min_steps)):
            return True
        return now + self.cost.step(batch) <= deadline

    def prefill_tokens(self, now: float, deadline: float, decode_batch: int, remaining: list[int]) -> list[int]:
        """Question tokens to prefill in this cycle's forward: per question waiting (`remaining`: the tokens
        each has left, first admitted first), how many it gets now, with `decode_batch` requests decoding
        after the forward (and the questions it completes: they decode too). First come first served: a
        question gets tokens only once every question before it has all of its own; the total is at least
        `chunk_tokens` (or what is left)."""
        budget = self.chunk_tokens
        if self.mode == "deadline":
            budget = max(budget, self._fit(deadline - now - PLAN_MARGIN_S, decode_batch, remaining))
        counts = []
        for n in remaining:
            take = min(n, budget)
            if take <= 0:
                break
            counts.append(take)
            budget -= take
        return counts

    def _fit(self, seconds: float, decode_batch: int, remaining: list[int]) -> int:
        """Most question tokens one forward can take in `seconds` followed by `min_steps` decode steps, for
        the rows it would really have: the tokens that fit over k rows, k the questions those tokens reach; a
        question the forward completes decodes in those steps too. 0 while the token cost is unknown."""
        def within(rows: int, decoding: int) -> int | None:
            return self.cost.tokens_within(seconds - self.min_steps * self.cost.step(decoding), rows)

        best, before = 0, 0
        for rows, n in enumerate(remaining, start=1):
            partial = within(rows, decode_batch + rows - 1)        # the k-th question left unfinished
            if partial is None or partial <= before:
                break                                               # this row's question would get no token
            if partial < before + n:
                return partial
            complete = within(rows, decode_batch + rows)           # it completes and decodes
            if complete < before + n:
                return before + n - 1
            best = before = before + n
        return best

    def observe(self, rows: int, tokens: int, seconds: float) -> None:
        self.cost.observe(rows, tokens, seconds)


def _ema(old: float | None, new: float, smoothing: float) -> float:
    return new if old is None else old + smoothing * (new - old)


class Scheduler:
    def __init__(self, config: EngineConfig, blocks: BlockManager, tokenizer: Tokenizer, reserve_blocks: int,
                 prefix_blocks: int, stats: EngineStats, clock: Callable[[], float], robots: tuple[str, ...] = ("",)):
        self.config, self.blocks, self.tokenizer, self.stats, self.clock = config, blocks, tokenizer, stats, clock
        self.robots = robots
        self.reserve_blocks = reserve_blocks          # kept free for the next cycle's prefills
        # isolated policy: each request also prefills its own copy of the frame
        self.request_prefix_blocks = prefix_blocks if config.policy == "isolated" else 0
        self.prefix_blocks = prefix_blocks            # a frame's prefix at most (a request's own prefill)
        self.budget = LanguageBudget(config.decode_budget, config.tokens_per_frame, config.min_tokens_per_frame,
                                     config.prefill_chunk_tokens)
        self.waiting: collections.deque[Sequence] = collections.deque()
        self.running: list[Sequence] = []
        self._lock = threading.Lock()                  # guards waiting and closed (submit runs on any thread)
        self.closed = ""                               # non-empty: new requests are refused with this reason
        self._last_owner: str | None = None            # round-robin position of admission
        self._gone: dict[str, str] = {}                 # robots removed: their running requests end at expire

    # ------------------------------------------------------------------ any thread
    def submit(self, request: TextRequest, *, question: list[int] | None = None, own_prefix: list[int] | None = None,
               masked: tuple[tuple[int, int], ...] = (), settle=None) -> RequestHandle:
        """Validate and queue. Whatever cannot be served comes back already finished (finish_reason
        "refused", the reason in `error`): invalid, never fitting the pool, queue full, engine closed.
        The engine's own requests (HIERARCHY_KINDS) come with their tokens made: `question` after the frame's
        prefix, or `own_prefix`, a prompt prefilled over the frame's images; `masked` id ranges are never
        sampled; `settle(reply)` runs before the reply is handed out."""
        now = self.clock()
        try:
            if question is None and own_prefix is None:
                question, request = self._validate(request)
            elif request.kind not in HIERARCHY_KINDS:
                raise ValueError(f"an engine request's kind must be one of {HIERARCHY_KINDS}, got {request.kind!r}")
            else:
                request = replace(request, owner=self._owner(request.owner))
        except (InputError, ValueError, TypeError) as e:
            self.stats.count("refused_invalid")
            return refused(request, str(e), now)
        question = question or []
        need = self.own_blocks(len(question), request.max_tokens) + (self.prefix_blocks if own_prefix else 0)
        # Admission happens while the current frame holds its prefix and must leave the next one's free.
        if need + self.request_prefix_blocks + 2 * self.reserve_blocks > self.blocks.num_blocks:
            self.stats.count("refused_invalid")
            return refused(request, f"can never fit: needs {need} KV blocks beside 2 x {self.reserve_blocks} for "
                                    f"frames, the pool has {self.blocks.num_blocks}", now)
        handle = RequestHandle(request, now)
        handle._settle = settle
        seq = Sequence(handle, question, None, (), math.nan,
                       torch.Generator().manual_seed(request.sampling.seed) if request.sampling.temperature > 0
                       else None, StopMatcher(request.stop), own_prefix=own_prefix, masked=tuple(masked))
        with self._lock:
            if self.closed:
                return refused(request, self.closed, now)
            busy = self._busy(request)
            if busy:
                self.stats.count("refused_busy")
                return refused(request, busy, now)
            self.waiting.append(seq)
        self.stats.count("submitted")
        return handle

    def waiting_of(self, owner: str, kind: str = "conversation") -> int:
        """Requests of this kind that this owner has waiting (its per-owner cap: max_queued_per_owner)."""
        with self._lock:
            return self._waiting_of(owner, kind)

    def waiting_owners(self) -> set[str]:
        """The owners with a request waiting for admission."""
        with self._lock:
            return {s.request.owner for s in self.waiting}

    def _waiting_of(self, owner: str, kind: str) -> int:
        return sum(1 for s in self.waiting if s.request.owner == owner and s.request.kind == kind)

    def _busy(self, r: TextRequest) -> str:
        """Under the lock: why the waiting queue cannot take `r` now, or "". Each owner (a robot, a client)
        has its own cap per kind, so one owner's flood of questions never refuses another owner's requests
        nor anyone's captions; conversation requests also share the total cap (captions are bounded by
        their own per-owner cap alone: they come at most one per caption period)."""
        c = self.config
        mine = self._waiting_of(r.owner, r.kind)
        if mine >= c.max_queued_per_owner:
            whose = f"robot {r.owner!r}" if r.owner else "the robot"
            return (f"busy: {whose} already has {mine} {r.kind} requests waiting "
                    f"(max_queued_per_owner={c.max_queued_per_owner})")
        total = sum(1 for s in self.waiting if s.request.kind == "conversation")
        if r.kind == "conversation" and total >= c.max_queued_requests:
            return f"busy: {total} requests already waiting (max_queued_requests={c.max_queued_requests})"
        return ""

    def _validate(self, r: TextRequest) -> tuple[list[int], TextRequest]:
        c = self.config
        if not isinstance(r, TextRequest):
            raise TypeError(f"a request must be a TextRequest, got {type(r).__name__}")
        if r.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {r.kind!r}")
        text = validate_text(r.text, what="question", max_chars=c.max_question_chars)
        if isinstance(r.max_tokens, bool) or not isinstance(r.max_tokens, int) \
                or not 1 <= r.max_tokens <= c.max_tokens_limit:
            raise ValueError(f"max_tokens must be in 1..{c.max_tokens_limit}, got {r.max_tokens!r}")
        if not isinstance(r.timeout_s, (int, float)) or not 0 < r.timeout_s <= c.max_timeout_s:
            raise ValueError(f"timeout_s must be in (0, {c.max_timeout_s:g}] seconds, got {r.timeout_s!r}")
        owner = self._owner(r.owner)
        if not isinstance(r.stop, (tuple, list)) or len(r.stop) > c.max_stop_strings:
            raise ValueError(f"at most {c.max_stop_strings} stop strings, got "
                             f"{len(r.stop) if isinstance(r.stop, (tuple, list)) else type(r.stop).__name__}")
        for s in r.stop:
            if not isinstance(s, str) or len(s) > c.max_stop_chars:
                raise ValueError(f"stop strings must be text of at most {c.max_stop_chars} characters, got "
                                 f"{type(s).__name__} of length {len(s) if isinstance(s, str) else '?'}")
        if text != r.text or isinstance(r.stop, list) or owner != r.owner:
            r = replace(r, text=text, stop=tuple(r.stop), owner=owner)
        return self.tokenizer.encode(c.question_template.format(text=text)), r

    def _owner(self, owner) -> str:
        """The robot a request is about (see the module docstring)."""
        if not isinstance(owner, str):
            raise ValueError(f"owner must be a robot name (text), got {type(owner).__name__}")
        if owner in self.robots:
            return owner
        if owner == "" and len(self.robots) == 1:
            return self.robots[0]
        if owner == "":
            raise ValueError(f"owner is empty but this engine serves several robots {list(self.robots)}: "
                             "say which robot's camera the request is about")
        raise ValueError(f"owner {owner!r} is not a robot of this engine {list(self.robots)}")

    def own_blocks(self, question_tokens: int, max_tokens: int) -> int:
        # The last sampled token is never fed back, so a reply of max_tokens stores max_tokens - 1 tokens.
        return max(1, self.blocks.blocks_for(question_tokens + max_tokens - 1))

    def set_robots(self, robots: tuple[str, ...], reserve_blocks: int) -> None:
        """The engine's robots changed (added or removed at run time) and with them the KV reserve."""
        with self._lock:
            self.robots, self.reserve_blocks = robots, reserve_blocks

    def drop_owner(self, robot: str, reason: str) -> None:
        """A robot left: its queued requests end now with `reason`; its running ones at the next `expire`
        (the engine thread owns the running set)."""
        with self._lock:
            gone = [seq for seq in self.waiting if seq.request.owner == robot]
            self._gone[robot] = reason
        for seq in gone:
            self.finish(seq, "error", reason)

    def close(self, reason: str) -> None:
        with self._lock:
            self.closed = reason

    def reopen(self) -> None:
        with self._lock:
            self.closed = ""

    @property
    def has_work(self) -> bool:
        return bool(self.running or self.waiting)

    # ------------------------------------------------------------------ engine thread
    def expire(self, now: float) -> None:
        """Cancelled requests and those past their timeout (counted from submission), queued or running;
        and those of robots removed since the last call."""
        with self._lock:
            gone, self._gone = self._gone, {}
        for seq in list(self.running):
            if seq.request.owner in gone and seq.request.owner not in self.robots:
                self.finish(seq, "error", gone[seq.request.owner])
                continue
            self._expire_one(seq, now)
        with self._lock:
            waiting = list(self.waiting)
        for seq in waiting:
            self._expire_one(seq, now, " in the queue")

    def _expire_one(self, seq: Sequence, now: float, where: str = "") -> None:
        if seq.handle.cancelled:
            self.finish(seq, "cancelled", "cancelled" + (" before admission" if where else ""))
        elif now - seq.handle.submitted_at > seq.request.timeout_s:
            self.finish(seq, "timeout", f"timed out after {seq.request.timeout_s:g} s{where}")

    def admit(self, frames: Mapping[str, object], attach: Callable[[object, Sequence], FrameCache],
              may_prefill: Callable[[], bool] = lambda: True) -> list[Sequence]:
        """Attach waiting sequences to their owner's frame ({robot: frame} of this cycle) while there is
        room: the batch cap, and KV blocks beyond the reserve. Owners take turns (round-robin, starting
        after the owner served last); within an owner, first come first served. One that does not fit now
        stays queued without blocking smaller ones behind it (none waits for ever: what can never fit was
        refused at submit, and timeouts are bounded). `attach(frame)` gives a sequence its frame reference
        (a retain, or its own prefill); a request with a prompt of its own on its frame (`Sequence.own_prompt`)
        is admitted only when `may_prefill` (its prefill fits the cycle's language time)."""
        admitted: list[Sequence] = []
        with self._lock:
            candidates = list(self.waiting)
        waited = False
        for seq in self._round_robin(candidates, frames):
            if len(self.running) >= self.config.max_active_requests:
                break
            if seq.handle.cancelled:
                self.finish(seq, "cancelled", "cancelled before admission")
                continue
            prepared = frames[seq.request.owner].prepared
            own_prompt = seq.own_prompt(prepared) is not None
            if own_prompt and not may_prefill():
                continue
            if prepared.stamp < seq.request.not_before_stamp:
                continue                                 # its observation's frame is still to come
            need = self.own_blocks(len(seq.question), seq.request.max_tokens)
            prefix = self.prefix_blocks if own_prompt else self.request_prefix_blocks
            if self.blocks.num_free - need - prefix < self.reserve_blocks:
                waited = True                            # back-pressure: it stays queued
                continue
            with self._lock:
                if seq not in self.waiting:              # ended meanwhile (its robot was removed)
                    continue
                self.waiting.remove(seq)
            self.running.append(seq)
            seq.admitted_at = self.clock()
            self._last_owner = seq.request.owner
            try:
                seq.blocks = self.blocks.allocate(need)
                seq.frame = attach(frames[seq.request.owner], seq)
            except Exception as e:  # noqa: BLE001 - e.g. a failed isolated prefill: this request only
                self.finish(seq, "error", f"could not admit: {e}")
                continue
            admitted.append(seq)
        if waited:
            self.stats.count("admission_waits")
        return admitted

    def _round_robin(self, candidates: list[Sequence], frames: Mapping[str, object]) -> list[Sequence]:
        """The candidates whose owner has a frame, interleaved one per owner at a time, starting with the
        owner after the one served last (robot order)."""
        queues: dict[str, list[Sequence]] = {r: [] for r in self.robots if r in frames}
        for seq in candidates:
            if seq.request.owner in queues:
                queues[seq.request.owner].append(seq)
        owners = list(queues)
        if self._last_owner in owners:
            i = owners.index(self._last_owner) + 1
            owners = owners[i:] + owners[:i]
        order = []
        for turn in range(max((len(q) for q in queues.values()), default=0)):
            order.extend(queues[o][turn] for o in owners if turn < len(queues[o]))
        return order

    def decode_batch(self) -> list[Sequence]:
        """The running sequences whose question is prefilled (each has its last sampled token to feed)."""
        return [s for s in self.running if not s.prefilling][:self.config.max_active_requests]

    def prefill_chunks(self, now: float, deadline: float) -> list[tuple[Sequence, int]]:
        """This cycle's question prefill: (sequence, tokens of its question to append now), first admitted
        first, within the budget's token count (chunked prefill; see LanguageBudget)."""
        prefilling = [s for s in self.running if s.prefilling]
        if not prefilling:
            return []
        counts = self.budget.prefill_tokens(now, deadline, len(self.running) - len(prefilling),
                                            [len(s.question) - s.own_len for s in prefilling])
        return list(zip(prefilling, counts))

    def postprocess(self, seqs: list[Sequence], fed: list[int], logits: torch.Tensor) -> int:
        """After a forward that appended fed[i] tokens to seqs[i]: record them; then for each sequence whose
        question is now complete, sample one token and apply it (a question prefilled only in part samples
        nothing). A row with non-finite logits fails its sequence alone. Returns the number of tokens produced."""
        for seq, n in zip(seqs, fed):
            seq.own_len += n
        rows = [i for i, seq in enumerate(seqs) if not seq.prefilling]
        if len(rows) < len(seqs):
            seqs, logits = [seqs[i] for i in rows], logits[rows]
        if not seqs:
            return 0
        if any(seq.masked for seq in seqs):
            logits = logits.clone()                 # the forward's output may be an inference-mode tensor
            for i, seq in enumerate(seqs):
                for lo, hi in seq.masked:
                    logits[i, lo:hi] = -math.inf
        s = [seq.request.sampling for seq in seqs]
        tokens, ok = sample(logits, [x.temperature for x in s], [x.top_p for x in s], [q.generator for q in seqs])
        produced = 0
        for seq, token, good in zip(seqs, tokens, ok):
            if not good:
                self.stats.count("faults")
                self.stats.count("nonfinite_logits")
                self.stats.note_error(f"request {seq.handle.id}: non-finite logits")
                self.finish(seq, "error", "the model produced non-finite logits")
                continue
            produced += 1
            self._apply(seq, token)
        return produced

    def _apply(self, seq: Sequence, token: int) -> None:
        if token == self.tokenizer.eos_id and not self.config.ignore_eos:
            self.finish(seq, "eos")
            return
        seq.tokens.append(token)
        text = self.tokenizer.decode(seq.tokens)
        stop_at = seq.stops.find(text)
        if stop_at >= 0:
            seq.text = text[:stop_at]
            self.finish(seq, "stop")
            return
        if text != seq.text:
            seq.text = text
            seq.handle._publish_partial(text, len(seq.tokens))
        if len(seq.tokens) >= seq.request.max_tokens:
            self.finish(seq, "length")
        elif seq.handle.cancelled:
            self.finish(seq, "cancelled", "cancelled")

    def finish(self, seq: Sequence, reason: str, error: str = "") -> None:
        """End a sequence (queued or running): release what it holds, answer its handle."""
        with self._lock:
            if seq in self.waiting:
                self.waiting.remove(seq)
        if seq in self.running:
            self.running.remove(seq)
        now = self.clock()
        frame = seq.frame
        h = seq.handle
        reply = Reply(reason in ("stop", "length", "eos"), seq.text, list(seq.tokens), reason, error,
                      frame.frame_index if frame is not None else -1, frame.stamp if frame is not None else 0.0,
                      (seq.admitted_at if not math.isnan(seq.admitted_at) else now) - h.submitted_at,
                      now - h.submitted_at)
        try:
            blocks, seq.blocks = seq.blocks, ()
            if blocks:
                self.blocks.decref(blocks)
            if frame is not None:
                seq.frame = None
                frame.release()
        finally:
            h._finish(reply)
            self.stats.count(f"finished_{reason}")

    def fail(self, seqs: list[Sequence], message: str) -> None:
        for seq in list(seqs):
            self.finish(seq, "error", message)

    def fail_waiting(self, owner: str, submitted_before: float, message: str) -> None:
        """End this owner's waiting requests submitted before `submitted_before` with `message`."""
        with self._lock:
            late = [s for s in self.waiting if s.request.owner == owner and s.handle.submitted_at < submitted_before]
        self.fail(late, message)

    def fail_all(self, message: str) -> None:
        with self._lock:
            waiting = list(self.waiting)
        self.fail(list(self.running) + waiting, message)
