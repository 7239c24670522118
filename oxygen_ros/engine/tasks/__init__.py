"""The frame's tasks: what one camera frame's KV is used for, one module each. The engine's cycle prefills
each robot's frame once and calls them in this order, each reading the frame through the same handle
(`cycle.Frame.cache`):

- `hierarchy`    (hierarchical π0.5, pi052 formats) writes each frame's prompt with its robot's newest subtask
                 (before the prefill) and, in the joint format, the causal subtask span the actions read
                 (after it); its texts (subtask, progress memory, interjection) are language requests;
- `actions`      denoises every frame's action chunk (first, so that it meets its deadline) and delivers it;
- `captions`     asks for a scene caption of a delivered frame when one is due (the robot's memory);
- `conversation` admits language requests onto the cycle's frames and decodes all running ones together,
                 in the time the cycle has left.
"""
from .actions import ActionsTask, ChunkResult
from .captions import Caption, CaptionsTask
from .conversation import ConversationTask
from .hierarchy import HierarchyTask, LanguageUpdate

__all__ = ["ActionsTask", "CaptionsTask", "ConversationTask", "HierarchyTask", "ChunkResult", "Caption",
           "LanguageUpdate"]
