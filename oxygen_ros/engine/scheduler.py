"""How much language work a frame cycle does: the decode budget. Knows nothing of models or kernels.

- "fixed": exactly `tokens_per_frame` batched decode steps per cycle (the OxyGen paper's setting);
- "deadline": keep stepping while the predicted end of the next step stays before the cycle's deadline
  (the frame period after the cycle started: the next action chunk is due then), with at least
  `min_steps` per cycle so that every active request makes progress even when the frame is late.
Step times are predicted from measurements per batch size (exponential moving average).
"""
from __future__ import annotations


class DecodeBudget:
    def __init__(self, mode: str, tokens_per_frame: int, min_steps: int, smoothing: float = 0.3):
        if mode not in ("fixed", "deadline"):
            raise ValueError(f"unknown decode budget mode {mode!r}")
        self.mode, self.tokens_per_frame, self.min_steps = mode, tokens_per_frame, min_steps
        self.smoothing = smoothing
        self._step_s: dict[int, float] = {}

    def another_step(self, steps_done: int, now: float, deadline: float, batch: int) -> bool:
        if self.mode == "fixed":
            return steps_done < self.tokens_per_frame
        if steps_done < self.min_steps:
            return True
        return now + self.predict(batch) <= deadline

    def observe(self, batch: int, seconds: float) -> None:
        old = self._step_s.get(batch)
        self._step_s[batch] = seconds if old is None else old + self.smoothing * (seconds - old)

    def predict(self, batch: int) -> float:
        """Predicted step time at this batch size: its own average, else the nearest measured size's."""
        if batch in self._step_s:
            return self._step_s[batch]
        if not self._step_s:
            return 0.0
        nearest = min(self._step_s, key=lambda b: (abs(b - batch), -b))
        return self._step_s[nearest]
