"""Language requests: what a caller submits, the handle it gets back, and the scheduler's record of one.

A `RequestHandle` is the caller's side (any thread): a future for the final `Reply`, a stream of partial
replies, `cancel()`. The engine thread fills it; a slow caller never blocks the engine (the stream is an
unbounded queue of small strings, the future a threading.Event), and a done-callback that raises is
logged and counted, never able to stop the others or the engine.
"""
from __future__ import annotations

import itertools
import logging
import math
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

from .kv_pool import FrameCache

log = logging.getLogger("oxygen_ros.engine")


@dataclass(frozen=True)
class Sampling:
    """temperature 0 = greedy (argmax, lowest id on ties). Otherwise softmax(logits / temperature), restricted
    to the smallest set of tokens whose probability reaches top_p, drawn with a per-request seed."""

    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0

    def __post_init__(self):
        if not (self.temperature >= 0.0 and self.temperature <= 100.0):
            raise ValueError(f"temperature must be in [0, 100], got {self.temperature}")
        if not (0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")


@dataclass(frozen=True)
class TextRequest:
    """What a caller asks. kind: "conversation" (a question about the current scene) or "memory" (a scene
    caption); the engine's own hierarchical-language requests are "subtask", "progress" and "interjection".
    `owner` names who asked (a robot, a client): carried through for per-owner scheduling.
    `not_before_stamp`: answered only about a frame of the owner whose observation is stamped at or after this
    (a question sent together with an observation is about that observation, never the frame before it)."""

    text: str
    max_tokens: int = 32
    sampling: Sampling = Sampling()
    stop: tuple[str, ...] = ()
    timeout_s: float = 30.0
    kind: str = "conversation"
    session_id: str = ""
    owner: str = ""
    not_before_stamp: float = float("-inf")


@dataclass(frozen=True)
class Reply:
    success: bool
    text: str
    tokens: list[int]
    finish_reason: str
    error: str = ""
    frame_index: int = -1
    frame_stamp: float = 0.0
    queue_s: float = 0.0      # submitted -> admitted
    latency_s: float = 0.0    # submitted -> finished


@dataclass(frozen=True)
class Partial:
    text: str       # the reply so far
    tokens: int     # tokens generated so far


_ids = itertools.count(1)


class RequestHandle:
    def __init__(self, request: TextRequest, submitted_at: float):
        self.id = next(_ids)
        self.request = request
        self.submitted_at = submitted_at
        self._done = threading.Event()
        self._reply: Reply | None = None
        self._cancel = threading.Event()
        self._stream: queue.SimpleQueue = queue.SimpleQueue()
        self._callbacks: list[Callable[[Reply], None]] = []
        self._lock = threading.Lock()
        # The engine's own bookkeeping of the reply (a robot's plan after an interjection), applied before
        # anyone waiting for the reply wakes: the engine's state is never behind a reply its caller holds.
        self._settle: Callable[[Reply], None] | None = None

    # -- caller side
    def cancel(self) -> None:
        """Ask the engine to stop this request; its reply comes back with finish_reason "cancelled"."""
        self._cancel.set()

    @property
    def cancelled(self) -> bool:
        return self._cancel.is_set()

    def done(self) -> bool:
        return self._done.is_set()

    def result(self, timeout: float | None = None) -> Reply:
        if not self._done.wait(timeout):
            raise TimeoutError(f"request {self.id} has no reply after {timeout} s")
        return self._reply

    def partials(self, timeout: float | None = None):
        """Yield Partial(text, tokens) as the reply grows, until the request finishes. `timeout` bounds the
        wait for each update (None or inf: no bound; the request's own timeout still ends it). A NaN or
        negative timeout cancels the request and raises ValueError."""
        if timeout is not None and not timeout >= 0:
            self.cancel()
            raise ValueError(f"partials timeout must be >= 0 seconds or None, got {timeout}")
        if timeout is not None and math.isinf(timeout):
            timeout = None
        while True:
            try:
                item = self._stream.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.id}: no progress for {timeout} s") from None
            if item is None:
                return
            yield item

    def add_done_callback(self, fn: Callable[[Reply], None]) -> None:
        """fn(reply) runs on the engine thread (or at once if already done): keep it short. An exception
        it raises is logged and counted in `callback_errors`, and stops nothing else."""
        with self._lock:
            if self._reply is None:
                self._callbacks.append(fn)
                return
        _run_callback(fn, self._reply, self.id)

    # -- engine side
    def _publish_partial(self, text: str, tokens: int) -> None:
        self._stream.put(Partial(text, tokens))

    def _finish(self, reply: Reply) -> None:
        with self._lock:
            if self._reply is not None:
                return
            self._reply = reply
            callbacks, self._callbacks = self._callbacks, []
        if self._settle is not None:
            _run_callback(self._settle, reply, self.id)
        self._stream.put(None)
        self._done.set()
        for fn in callbacks:
            _run_callback(fn, reply, self.id)


callback_errors = 0      # done-callbacks that raised, process-wide (diagnostics)


def _run_callback(fn, reply: Reply, request_id: int) -> None:
    global callback_errors
    try:
        fn(reply)
    except Exception:  # noqa: BLE001 - a caller's bug must not leave other requests unanswered
        callback_errors += 1
        log.exception("done-callback of request %d raised", request_id)


def refused(request: TextRequest, reason: str, now: float | None = None) -> RequestHandle:
    """A handle that is already finished with an error (queue full, invalid input, engine stopped)."""
    h = RequestHandle(request, time.monotonic() if now is None else now)
    h._finish(Reply(False, "", [], "refused", error=reason))
    return h


@dataclass(eq=False)
class Sequence:
    """The scheduler's record of an admitted request: what it attends to and what it holds. `frame` and
    `blocks` are released by `Scheduler.finish`, the one place that ends a sequence."""

    handle: RequestHandle
    question: list[int]                    # prompt tokens appended after the frame prefix
    frame: FrameCache | None               # the frame it attends to (holds one reference)
    blocks: tuple[int, ...]                # own blocks: question + reply
    admitted_at: float
    generator: torch.Generator | None
    stops: "StopMatcher"
    tokens: list[int] = field(default_factory=list)
    own_len: int = 0                       # tokens of this sequence stored in its own blocks
    text: str = ""
    own_prefix: list[int] | None = None    # its own prefix prompt over its frame's images (pi052's default
                                           # recipe: a text request is a prefill of its own), else None
    masked: tuple[tuple[int, int], ...] = ()   # token id ranges never sampled (pi052: FAST codes, <loc>)

    @property
    def request(self) -> TextRequest:
        return self.handle.request

    def own_prompt(self, prepared) -> list[int] | torch.Tensor | None:
        """The prompt this sequence prefills of its own over the images of its frame (`prepared`, the frame's
        PreparedFrame), or None when it reads the frame's KV: its own prefix prompt; else, since it continues
        the frame's prompt, that prompt where the frame's prefill is not it (`PreparedFrame.text_prompt`)."""
        return self.own_prefix if self.own_prefix is not None else prepared.text_prompt

    @property
    def prefilling(self) -> bool:
        """Its question is not yet all in its blocks (chunked prefill spreads a long one over cycles)."""
        return self.own_len < len(self.question)


class StopMatcher:
    """Finds the earliest stop string in a growing text, looking only at what is new: per update it costs
    O(new characters x distinct stop lengths), independent of how many stop strings there are (both are
    bounded at submit: max_stop_strings, max_stop_chars)."""

    def __init__(self, stops):
        self._stops = frozenset(s for s in stops if s)
        self._lengths = sorted({len(s) for s in self._stops}, reverse=True)
        self._checked = 0          # ends of text up to here have been searched

    def find(self, text: str) -> int:
        """Start of the earliest stop string ending after the last call (or -1)."""
        best = -1
        for end in range(self._checked + 1, len(text) + 1):
            for n in self._lengths:             # longest first: the earliest start for this end
                if n <= end and text[end - n:end] in self._stops:
                    best = end - n if best < 0 else min(best, end - n)
                    break
        self._checked = len(text)
        return best
