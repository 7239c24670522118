"""Conversation sessions: the last turns of each conversation, prepended to its next question.

Every question is answered from the newest camera frame's KV; a session only adds the recent dialogue
as text in front of the question. Bounded: `max_turns` per session, `max_sessions` in total (the least
recently used is forgotten), and the history is cut from its oldest turns to fit `max_chars`.
"""
from __future__ import annotations

import collections
import threading


class Sessions:
    def __init__(self, max_turns: int = 4, max_sessions: int = 100, max_chars: int = 2000):
        self.max_turns, self.max_sessions, self.max_chars = max_turns, max_sessions, max_chars
        self._turns: collections.OrderedDict[str, collections.deque] = collections.OrderedDict()
        self._lock = threading.Lock()

    def question(self, session_id: str, text: str) -> str:
        """The text to ask: the session's recent turns, then this question."""
        if not session_id:
            return text
        with self._lock:
            turns = list(self._turns.get(session_id, ()))
        history = [f"{q}\n{a}\n" for q, a in turns]
        while history and sum(map(len, history)) + len(text) > self.max_chars:
            history.pop(0)
        return "".join(history) + text

    def record(self, session_id: str, question: str, reply: str) -> None:
        if not session_id:
            return
        with self._lock:
            turns = self._turns.pop(session_id, None) or collections.deque(maxlen=self.max_turns)
            turns.append((question, reply))
            self._turns[session_id] = turns
            while len(self._turns) > self.max_sessions:
                self._turns.popitem(last=False)

    def __len__(self) -> int:
        return len(self._turns)
