"""What one frame cycle carries: its frames (one per robot whose observation it took) and its report.

A `Frame` is the handle every task of the cycle reads: the robot's prepared inputs, the flow-matching noise,
the deadline, and — once the engine has prefilled it — `cache`, the frame's prefix KV in the pool. The
actions task denoises from `cache`; every language request of the frame retains the same `cache` (no
copy); the cycle's own reference is released when the cycle ends (a `with` block in the engine).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field

import torch

from .frames import FramePreparer, PreparedFrame
from .kv_pool import FrameCache

log = logging.getLogger("oxygen_ros.engine")


@dataclass
class Frame:
    """One robot's frame inside a cycle."""

    robot: str
    index: int
    preparer: FramePreparer                    # the robot's policy I/O (units, control period)
    prepared: PreparedFrame
    noise: torch.Tensor
    deadline: float                            # engine clock: the robot's chunk is due by then
    task: str                                  # the observation's prompt (the hierarchy's task)
    cache: FrameCache | None = None            # the frame's prefix KV, once prefilled
    subtask: str = ""                          # the subtask its actions are conditioned on (hierarchy)
    action_cache: FrameCache | None = None     # what the actions read when not `cache`: the prefix plus the
                                               # joint format's causal subtask span (tasks/hierarchy.py)


@dataclass
class CycleReport:
    frame_index: int | None        # the cycle's first frame (None: a decode-only cycle)
    start: float
    prefill_s: float = 0.0
    action_s: float = 0.0
    admit_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    batch_sizes: list = field(default_factory=list)
    tokens: int = 0
    admitted: int = 0
    question_tokens: int = 0       # question tokens prefilled this cycle (chunked prefill: a part of some)
    duration_s: float = 0.0
    deadline_missed: bool = False
    preempted: bool = False        # its language work ended early for a new observation
    fault: str = ""
    robots: list = field(default_factory=list)      # whose frames this cycle computed, in robot order
    chunks: int = 0                                 # action chunks it delivered
    deferred: list = field(default_factory=list)    # robots whose pending frame waits for the next cycle
    prepare_s: float = 0.0         # observations converted on the engine thread (inline preparation)
    prepared_ahead: int = 0        # frames whose inputs the preparer thread had made


class Listeners:
    """Callbacks of one kind (chunks, captions, frames), run on the engine thread: each must return at once;
    one that raises is logged and counted (listener_errors) and stops nothing — a listener's bug must not
    break the cycle or leak its frame."""

    def __init__(self, stats):
        self.stats = stats
        self._fns: list = []
        self._lock = threading.Lock()

    def add(self, fn) -> None:
        with self._lock:
            self._fns.append(fn)

    def __call__(self, *args) -> None:
        with self._lock:
            fns = list(self._fns)
        for fn in fns:
            try:
                fn(*args)
            except Exception:  # noqa: BLE001 - see the class docstring
                self.stats.count("listener_errors")
                log.exception("engine listener raised")
