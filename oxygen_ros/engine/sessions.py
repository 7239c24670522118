"""Conversation sessions: the last turns of each conversation, prepended to its next question.

Every question is answered from the newest camera frame's KV; a session only adds the recent dialogue
as text in front of the question. Bounded: `max_turns` per session, `max_sessions` in total (the least
recently used is forgotten), the history is cut from its oldest turns to fit `max_chars`, a session id
is at most `max_id_chars` long, and a turn is stored as cleaned text (validate_text), never the raw
request.
"""
from __future__ import annotations

import collections
import threading

from oxygen_ros.robot.errors import InputError
from oxygen_ros.robot.text import validate_text


class Sessions:
    def __init__(self, max_turns: int = 4, max_sessions: int = 100, max_chars: int = 2000,
                 max_id_chars: int = 128):
        self.max_turns, self.max_sessions, self.max_chars = max_turns, max_sessions, max_chars
        self.max_id_chars = max_id_chars
        self._turns: collections.OrderedDict[str, collections.deque] = collections.OrderedDict()
        self._lock = threading.Lock()

    def question(self, session_id: str, text: str) -> str:
        """The text to ask: the session's recent turns, then this question. A session id longer than
        max_id_chars raises InputError."""
        if not session_id:
            return text
        self._check_id(session_id)
        with self._lock:
            turns = list(self._turns.get(session_id, ()))
        history = [f"{q}\n{a}\n" for q, a in turns]
        while history and sum(map(len, history)) + len(text) > self.max_chars:
            history.pop(0)
        return "".join(history) + text

    def record(self, session_id: str, question: str, reply: str) -> None:
        if not session_id:
            return
        self._check_id(session_id)
        question = _clean(question, self.max_chars)
        reply = _clean(reply, self.max_chars)
        with self._lock:
            turns = self._turns.pop(session_id, None) or collections.deque(maxlen=self.max_turns)
            turns.append((question, reply))
            self._turns[session_id] = turns
            while len(self._turns) > self.max_sessions:
                self._turns.popitem(last=False)

    def __len__(self) -> int:
        return len(self._turns)

    def _check_id(self, session_id: str) -> None:
        if len(session_id) > self.max_id_chars:
            raise InputError(f"session_id has {len(session_id)} characters, the limit is {self.max_id_chars}")


def _clean(text: str, max_chars: int) -> str:
    try:
        return validate_text(text, what="turn", max_chars=max_chars)
    except InputError:
        return ""
