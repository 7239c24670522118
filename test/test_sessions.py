"""Conversation sessions: recent turns prepended, bounded in turns, sessions and characters."""
from oxygen_ros.engine.sessions import Sessions


def test_history_is_prepended_and_bounded():
    s = Sessions(max_turns=2, max_sessions=2, max_chars=40)
    assert s.question("", "hi") == "hi" and s.question("a", "hi") == "hi"
    s.record("a", "q1", "r1")
    s.record("a", "q2", "r2")
    s.record("a", "q3", "r3")
    assert s.question("a", "q4") == "q2\nr2\nq3\nr3\nq4"          # the last 2 turns only
    assert s.question("a", "x" * 34) == "q3\nr3\n" + "x" * 34     # oldest turns dropped to fit 40 chars
    assert s.question("a", "x" * 40) == "x" * 40
    s.record("b", "q", "r")
    s.record("c", "q", "r")                                       # 3 sessions > 2: "a" is forgotten
    assert len(s) == 2 and s.question("a", "q") == "q" and s.question("b", "z") == "q\nr\nz"
    s.record("", "q", "r")
    assert len(s) == 2
