"""The frame's tasks: what one camera frame's KV is used for, one module each. The engine's cycle prefills
each robot's frame once and calls them in this order, each reading the frame through the same handle
(`cycle.Frame.cache`):

- `subtask`      (π0.5 subtask mode, optional) conditions the frame's action prompt on a generated subtask
                 text; it runs before the prefill because it changes the prompt;
- `actions`      denoises every frame's action chunk (first, so that it meets its deadline) and delivers it;
- `captions`     asks for a scene caption of a delivered frame when one is due (the robot's memory);
- `conversation` admits language requests onto the cycle's frames and decodes all running ones together,
                 in the time the cycle has left.
"""
from .actions import ActionsTask, ChunkResult
from .captions import Caption, CaptionsTask
from .conversation import ConversationTask
from .subtask import SubtaskTask

__all__ = ["ActionsTask", "CaptionsTask", "ConversationTask", "SubtaskTask", "ChunkResult", "Caption"]
