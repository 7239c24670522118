"""Approximate time synchronisation: camera slots + robot state + prompt -> one Observation.

The robot state is the pivot: an observation is stamped with its state's time (t0, which the action
chunk is later aligned to), and each camera slot contributes its buffered image nearest to t0 if that
is within `slop_s`. The newest state that can be completed now wins; older states are dropped and
counted. Usually that is simply the newest state, but when the cameras lag the state stream (a camera
pipeline is slower than joint encoders), the newest state has no images yet and only an earlier one
can pair, so waiting on the newest alone would never emit.

Every input carries its own stamp and `poll` takes `now_s`; there is no wall clock inside, so a node
passes ROS time (the clock of the message stamps) and the tests pass a simulated clock.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np

from .errors import ConfigError, SyncError

_EPS = 1e-9  # an image exactly slop_s away pairs despite float rounding of the stamps


@dataclass
class Observation:
    stamp_s: float  # the pivot state's stamp: the time the observation describes
    images: dict[str, np.ndarray | None]  # every slot, in slot order; None where masked
    image_masks: dict[str, bool]  # True where the slot has an image
    state: np.ndarray
    prompt: str


@dataclass
class _Stamped:
    stamp_s: float
    value: np.ndarray
    used: bool = field(default=False)


class ObservationAssembler:
    """Pairs camera images with robot states; see the module docstring for the rules.

    slots: camera slot names, in the model's order. required_slots: slots an observation cannot do
    without (no image within slop: wait). An optional slot without an image within slop is masked
    once its newest image is more than `missing_after_s` older than now (camera gone); until then
    the assembler waits for it. buffer: how many images per slot and states are kept; the state
    buffer must span the cameras' latency (state rate x latency, e.g. 100 Hz x 0.15 s = 15), or a
    lagging camera finds no state left to pair with. max_image_bytes: each slot's image buffer also
    stays within this many bytes (the newest images that fit; at least one), so a high-resolution camera
    cannot make the buffer hold gigabytes.
    """

    def __init__(
        self,
        slots: Iterable[str],
        required_slots: Iterable[str],
        slop_s: float,
        missing_after_s: float,
        buffer: int = 16,
        max_image_bytes: int = 256 << 20,
    ):
        slots = list(slots)
        required = set(required_slots)
        if not slots:
            raise ConfigError("no camera slots given")
        if len(set(slots)) != len(slots):
            raise ConfigError(f"camera slots {slots} contain a duplicate")
        if not required <= set(slots):
            unknown = sorted(required - set(slots))
            raise ConfigError(f"required slots {unknown} are not camera slots {slots}")
        if not slop_s >= 0 or not missing_after_s >= 0:  # `not >=` also rejects NaN
            raise ConfigError(f"slop_s {slop_s} and missing_after_s {missing_after_s} must be >= 0")
        if buffer < 1:
            raise ConfigError(f"buffer {buffer} must be at least 1")
        if max_image_bytes <= 0:
            raise ConfigError(f"max_image_bytes {max_image_bytes} must be positive")
        self.slots = slots
        self.required_slots = required
        self.slop_s = float(slop_s)
        self.missing_after_s = float(missing_after_s)
        self.buffer = buffer
        self.max_image_bytes = max_image_bytes
        self._images: dict[str, deque[_Stamped]] = {s: deque() for s in slots}
        self._newest_image_s: dict[str, float | None] = {s: None for s in slots}
        self._states: deque[_Stamped] = deque()  # increasing stamps
        self._emitted_s: float | None = None  # stamp of the last observation emitted
        self._first_poll_s: float | None = None  # a never-seen optional slot counts as missing from here
        self._prompt = ""
        self.stats = {
            "images_received": 0,
            "states_received": 0,
            "observations": 0,
            "images_dropped": 0,  # discarded without being part of any observation
            "states_dropped": 0,  # discarded without being an observation's pivot
            "slots_masked": 0,  # optional slots masked in emitted observations
        }

    def add_image(self, slot: str, stamp_s: float, rgb: np.ndarray) -> None:
        if slot not in self._images:
            raise SyncError(f"unknown camera slot {slot!r} (slots: {', '.join(self.slots)})")
        stamp_s = _stamp(stamp_s, f"image {slot!r}")
        is_rgb = isinstance(rgb, np.ndarray) and rgb.ndim == 3 and rgb.shape[2] == 3
        if not (is_rgb and rgb.dtype == np.uint8):
            raise SyncError(f"image {slot!r}: expected an HxWx3 uint8 array, got {_describe(rgb)}")
        self.stats["images_received"] += 1
        newest = self._newest_image_s[slot]
        self._newest_image_s[slot] = stamp_s if newest is None else max(newest, stamp_s)
        if self._emitted_s is not None and stamp_s < self._emitted_s - self.slop_s:
            self.stats["images_dropped"] += 1  # too old for any pivot still to come
            return
        images = self._images[slot]
        if len(images) == self.buffer:
            self._count_dropped_image(images.popleft())
        images.append(_Stamped(stamp_s, rgb))
        while len(images) > 1 and sum(im.value.nbytes for im in images) > self.max_image_bytes:
            self._count_dropped_image(images.popleft())

    def add_state(self, stamp_s: float, vec: np.ndarray) -> None:
        stamp_s = _stamp(stamp_s, "state")
        if not (isinstance(vec, np.ndarray) and vec.ndim == 1 and vec.dtype == np.float64):
            raise SyncError(f"state: expected a 1-D float64 array, got {_describe(vec)}")
        self.stats["states_received"] += 1
        newest = self._states[-1].stamp_s if self._states else self._emitted_s
        if newest is not None and stamp_s <= newest:
            self.stats["states_dropped"] += 1  # out of order or already emitted: never a pivot
            return
        if len(self._states) == self.buffer:
            self._states.popleft()
            self.stats["states_dropped"] += 1
        self._states.append(_Stamped(stamp_s, vec))

    def set_prompt(self, text: str) -> None:
        """The task prompt for observations emitted from now on (validate it with text.validate_text)."""
        if not isinstance(text, str):
            raise SyncError(f"prompt must be str, got {type(text).__name__}")
        self._prompt = text

    def poll(self, now_s: float) -> Observation | None:
        """The newest observation that can be completed now, once; None while there is none."""
        now_s = _stamp(now_s, "now")
        if self._first_poll_s is None:
            self._first_poll_s = now_s
        for pivot in reversed(self._states):
            picked = self._pick_images(pivot.stamp_s, now_s)
            if picked is not None:
                return self._emit(pivot, picked)
        return None

    def _pick_images(self, pivot_s: float, now_s: float) -> dict[str, _Stamped | None] | None:
        picked: dict[str, _Stamped | None] = {}
        for slot, images in self._images.items():
            nearest = min(images, key=lambda im: abs(im.stamp_s - pivot_s), default=None)
            if nearest is not None and abs(nearest.stamp_s - pivot_s) <= self.slop_s + _EPS:
                picked[slot] = nearest
            elif slot in self.required_slots or not self._is_missing(slot, now_s):
                return None
            else:
                picked[slot] = None
        return picked

    def _is_missing(self, slot: str, now_s: float) -> bool:
        newest = self._newest_image_s[slot]
        since = newest if newest is not None else self._first_poll_s
        return now_s - since > self.missing_after_s

    def _emit(self, pivot: _Stamped, picked: dict[str, _Stamped | None]) -> Observation:
        for image in picked.values():
            if image is not None:
                image.used = True
        # States up to the pivot can no longer be pivots; images older than pivot - slop can no
        # longer pair with any later pivot.
        while self._states and self._states[0].stamp_s <= pivot.stamp_s:
            if self._states.popleft() is not pivot:
                self.stats["states_dropped"] += 1
        for images in self._images.values():
            while images and images[0].stamp_s < pivot.stamp_s - self.slop_s:
                self._count_dropped_image(images.popleft())
        self._emitted_s = pivot.stamp_s
        self.stats["observations"] += 1
        self.stats["slots_masked"] += sum(image is None for image in picked.values())
        return Observation(
            stamp_s=pivot.stamp_s,
            images={slot: None if im is None else im.value for slot, im in picked.items()},
            image_masks={slot: im is not None for slot, im in picked.items()},
            state=pivot.value,
            prompt=self._prompt,
        )

    def _count_dropped_image(self, image: _Stamped) -> None:
        if not image.used:
            self.stats["images_dropped"] += 1


def _stamp(value: float, what: str) -> float:
    try:
        value = float(value)
    except (TypeError, ValueError) as e:
        raise SyncError(f"{what}: stamp {value!r} is not a number") from e
    if not math.isfinite(value):
        raise SyncError(f"{what}: stamp {value} is not finite")
    return value


def _describe(value: object) -> str:
    if isinstance(value, np.ndarray):
        return f"shape {value.shape} of {value.dtype}"
    return type(value).__name__
