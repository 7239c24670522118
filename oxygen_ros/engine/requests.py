"""Language requests: what a caller submits, the handle it gets back, and the engine's record of one.

A `RequestHandle` is the caller's side (any thread): a future for the final `Reply`, a stream of partial
replies, `cancel()`. The engine thread fills it; a slow caller never blocks the engine (the stream is an
unbounded queue of small strings, the future a threading.Event).
"""
from __future__ import annotations

import itertools
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable

import torch

FINISH_REASONS = ("stop", "length", "eos", "cancelled", "timeout", "error", "refused")


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
    """What a caller asks. kind: "conversation" (a question about the current scene), "memory" (a scene
    caption) or "subtask" (π0.5 subtask text)."""

    text: str
    max_tokens: int = 32
    sampling: Sampling = Sampling()
    stop: tuple[str, ...] = ()
    timeout_s: float = 30.0
    kind: str = "conversation"
    session_id: str = ""


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
        """Yield Partial(text, tokens) as the reply grows, until the request finishes."""
        while True:
            try:
                item = self._stream.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"request {self.id}: no progress for {timeout} s") from None
            if item is None:
                return
            yield item

    def add_done_callback(self, fn: Callable[[Reply], None]) -> None:
        """fn(reply) runs on the engine thread (or at once if already done): keep it short."""
        with self._lock:
            if self._reply is None:
                self._callbacks.append(fn)
                return
        fn(self._reply)

    # -- engine side
    def _publish_partial(self, text: str, tokens: int) -> None:
        self._stream.put(Partial(text, tokens))

    def _finish(self, reply: Reply) -> None:
        with self._lock:
            if self._reply is not None:
                return
            self._reply = reply
            callbacks, self._callbacks = self._callbacks, []
        self._stream.put(None)
        self._done.set()
        for fn in callbacks:
            fn(reply)


def refused(request: TextRequest, reason: str, now: float | None = None) -> RequestHandle:
    """A handle that is already finished with an error (queue full, invalid input, engine stopped)."""
    h = RequestHandle(request, time.monotonic() if now is None else now)
    h._finish(Reply(False, "", [], "refused", error=reason))
    return h


@dataclass(eq=False)
class ActiveRequest:
    """The engine's record of an admitted request."""

    handle: RequestHandle
    question: list[int]                    # prompt tokens appended after the frame prefix
    frame: object                          # FrameCache it attends to (holds one reference)
    blocks: tuple[int, ...]                # own blocks: question + reply
    admitted_at: float
    generator: torch.Generator | None
    tokens: list[int] = field(default_factory=list)
    own_len: int = 0                       # tokens of this request stored in its own blocks
    text: str = ""

    @property
    def request(self) -> TextRequest:
        return self.handle.request


def sample_tokens(logits: torch.Tensor, samplings: list[Sampling], generators: list) -> list[int]:
    """One token per row of logits [R, vocab] (float32)."""
    out = []
    greedy = [s.temperature == 0.0 for s in samplings]
    if any(greedy):
        arg = torch.argmax(logits, dim=-1).tolist()
    for r, s in enumerate(samplings):
        if greedy[r]:
            out.append(arg[r])
            continue
        probs = torch.softmax(logits[r].double() / s.temperature, dim=-1)
        if s.top_p < 1.0:
            sorted_p, order = torch.sort(probs, descending=True)
            keep = torch.cumsum(sorted_p, 0) - sorted_p < s.top_p   # always keeps the most likely token
            probs = torch.zeros_like(probs).scatter(0, order[keep], sorted_p[keep])
        out.append(int(torch.multinomial(probs, 1, generator=generators[r])))
    return out
