"""The standalone reference for a few frames: `oxygen_ros.model.inference` (contiguous cache, no engine)
computes the action chunk and the greedy reply the engines must reproduce exactly."""
from __future__ import annotations

import numpy as np
import torch

from oxygen_ros.model import inference


def standalone_check(model, engine, wl, record, max_frames: int) -> dict:
    """Compare `record` (one engine run of `wl` on `model`) with standalone inference on its first
    `max_frames` frames that have requests: max |action difference| and whether the replies are identical.
    From the engine it takes only the inputs: the prepared prefix row and the question's tokens."""
    backend = engine.info.attention_backend
    question = engine.question_tokens(wl.question)
    frames = [i for i in range(wl.frames) if wl.schedule[i]][:max_frames]
    max_diff, match, checked = 0.0, True, 0
    for i in frames:
        row = engine.preparer.prepare(wl.observations[i]).row
        n = model.prefix_length(row)
        cache = inference.ContiguousCache(model, n + 2 * (len(question) + wl.reply_tokens) + 64)
        pre = inference.prefill(model, cache, [row], backend)
        noise = torch.as_tensor(wl.noise[i])[None]
        actions = inference.sample_actions(model, cache, pre.segments, noise, wl.denoise_steps, backend)
        max_diff = max(max_diff, float(np.max(np.abs(actions[0].cpu().numpy().astype(np.float64) - record.actions[i]))))
        tokens = inference.greedy_generate(model, cache, pre.segments[0], pre.hidden[0], question, wl.reply_tokens,
                                           eos_id=None, backend=backend)
        for _, _, reply in record.replies:
            if record.reply_frame(reply) == i:
                checked += 1
                match &= reply.tokens == tokens
    return {"frames": frames, "replies_checked": checked, "max_action_diff": max_diff, "replies_match": bool(match)}
