"""The subtask task (π0.5 subtask mode): before a frame's actions, the model writes a subtask text about
the frame ("pick up the cup" -> "grasp the handle"), and the action prompt is conditioned on it.

It runs before the cycle's prefill because it changes the prompt the frame is prefilled with: a greedy
decode on a prefill of its own (the images with the subtask prompt), whose blocks are released at once.
"""
from __future__ import annotations

import torch

from oxygen_ros.model.pi05 import PrefixRow
from oxygen_ros.model.sampler import sample
from oxygen_ros.model.tokenizer import Tokenizer

from ..config import EngineConfig
from ..cycle import Frame
from ..model_runner import EngineFault, ModelRunner, TextRow


class SubtaskTask:
    def __init__(self, runner: ModelRunner, tokenizer: Tokenizer, config: EngineConfig):
        self.runner, self.tokenizer, self.config = runner, tokenizer, config
        self.text = ""                          # the last subtask text (one per engine)

    def condition(self, frames: list[Frame], faults: list[tuple[Frame, str]]) -> list[Frame]:
        """Each frame's prompt conditioned on its subtask text; a frame that fails goes to `faults`."""
        kept = []
        for f in frames:
            try:
                f.prepared = self._with_subtask(f)
                kept.append(f)
            except Exception as e:  # noqa: BLE001 - this frame only
                faults.append((f, f"{type(e).__name__}: {e}"))
        return kept

    def _with_subtask(self, f: Frame):
        c = self.config
        prompt = f.preparer.prompt_tokens(c.subtask_template.format(task=f.task))[:self.runner.cfg.max_token_len]
        row = PrefixRow(f.prepared.row.images, torch.tensor(prompt, dtype=torch.long))
        blocks = self.runner.pool.blocks
        with self.runner.prefill_one(row, f.index, f.prepared.stamp) as frame:
            own = blocks.allocate(max(1, blocks.blocks_for(c.subtask_max_tokens - 1)))
            try:
                logits, tokens = self.runner.frame_logits(frame), []
                while True:
                    (token,), (ok,) = sample(logits, [0.0], [1.0], [None])
                    if not ok:
                        raise EngineFault(f"frame {f.index}: non-finite logits in the subtask text")
                    if token == self.tokenizer.eos_id:
                        break
                    tokens.append(token)
                    if len(tokens) >= c.subtask_max_tokens or "\n" in self.tokenizer.decode([token]):
                        break
                    logits = self.runner.extend([TextRow(frame.segment, own, len(tokens) - 1, [token])])
            finally:
                blocks.decref(own)
        self.text = self.tokenizer.decode(tokens).strip()
        return f.preparer.retokenize(f.prepared, c.action_task_template.format(task=f.task, subtask=self.text))
