import array

import numpy as np
import pytest

from oxygen_ros.robot.errors import ConfigError, StateError, TextError
from oxygen_ros.robot.state import StateReader
from oxygen_ros.robot.text import validate_text

JOINTS = ["shoulder", "elbow", "wrist", "gripper"]


# --- state ---------------------------------------------------------------------------------------

def test_joint_state_reordered_with_extras():
    reader = StateReader(JOINTS)
    names = ["wrist", "head_pan", "gripper", "shoulder", "elbow"]
    positions = array.array("d", [3.0, 99.0, 4.0, 1.0, 2.0])  # rclpy's type for float64[]
    out = reader.from_joint_state(names, positions)
    assert out.dtype == np.float64
    assert out.tolist() == [1.0, 2.0, 3.0, 4.0]
    positions[0] = -1.0  # the caller's buffer may be reused: the state must not change
    assert out.tolist() == [1.0, 2.0, 3.0, 4.0]


def test_joint_state_extra_joint_may_be_nan():
    out = StateReader(JOINTS).from_joint_state(JOINTS + ["broken"], [1, 2, 3, 4, float("nan")])
    assert out.tolist() == [1, 2, 3, 4]


def test_missing_joints_are_named():
    with pytest.raises(StateError) as e:
        StateReader(JOINTS).from_joint_state(["shoulder", "gripper", "head_pan"], [1, 2, 3])
    assert str(e.value) == (
        "joint state is missing joint(s) 'elbow', 'wrist' (it has: 'shoulder', 'gripper', 'head_pan')"
    )


def test_empty_joint_state_names_every_joint():
    with pytest.raises(StateError, match="missing joint.* 'shoulder', 'elbow', 'wrist', 'gripper' .*none"):
        StateReader(JOINTS).from_joint_state([], [])


def test_names_positions_length_mismatch():
    with pytest.raises(StateError, match="joint state has 4 names but 3 positions"):
        StateReader(JOINTS).from_joint_state(JOINTS, [1, 2, 3])


@pytest.mark.parametrize("names", [None, "shoulder"])
def test_names_not_a_list(names):
    with pytest.raises(StateError, match="joint state names must be a list of strings, got"):
        StateReader(JOINTS).from_joint_state(names, [1.0])


def test_duplicate_joint_in_message():
    with pytest.raises(StateError, match="joint state lists joint 'elbow' twice"):
        StateReader(JOINTS).from_joint_state(JOINTS + ["elbow"], [1, 2, 3, 4, 5])


@pytest.mark.parametrize("bad,shown", [(float("nan"), "nan"), (float("inf"), "inf"), (-float("inf"), "-inf")])
def test_non_finite_joint_is_named(bad, shown):
    with pytest.raises(StateError) as e:
        StateReader(JOINTS).from_joint_state(JOINTS, [1, bad, 3, bad])
    assert str(e.value) == f"state has non-finite values for joint(s) 'elbow' ({shown}), 'gripper' ({shown})"


def test_without_joint_order_positions_are_used_as_given():
    reader = StateReader(None, expected_dim=3)
    assert reader.from_joint_state(["c", "a", "b"], [3, 1, 2]).tolist() == [3, 1, 2]
    assert reader.from_joint_state([], [3, 1, 2]).tolist() == [3, 1, 2]  # names are optional here
    with pytest.raises(StateError, match="state has 2 values, expected 3"):
        reader.from_joint_state(["a", "b"], [1, 2])
    with pytest.raises(StateError, match=r"non-finite values for joint\(s\) 'b' \(nan\)"):
        reader.from_joint_state(["a", "b", "c"], [1, float("nan"), 2])


def test_from_array():
    reader = StateReader(expected_dim=4)
    assert reader.from_array([1, 2, 3, 4]).tolist() == [1, 2, 3, 4]
    with pytest.raises(StateError, match="state has 5 values, expected 4"):
        reader.from_array([1, 2, 3, 4, 5])
    with pytest.raises(StateError) as e:
        reader.from_array([1, float("nan"), 3, float("inf")])
    assert str(e.value) == "state has non-finite values at indices [1, 3] (nan, inf)"


def test_from_array_any_length_without_expected_dim():
    assert StateReader().from_array(np.arange(7.0)).tolist() == list(range(7))


@pytest.mark.parametrize("data,message", [
    ("abc", "state array values are not numbers"),
    ([[1, 2], [3, 4]], r"must be a flat sequence of numbers, got shape \(2, 2\)"),
    (None, r"must be a flat sequence of numbers, got shape \(\)"),
])
def test_from_array_rejects_non_vectors(data, message):
    with pytest.raises(StateError, match=message):
        StateReader().from_array(data)


def test_reader_config_errors():
    with pytest.raises(ConfigError, match="joint_order has 4 joints but the expected state dim is 5"):
        StateReader(JOINTS, expected_dim=5)
    with pytest.raises(ConfigError, match="joint_order lists 'elbow' more than once"):
        StateReader(JOINTS + ["elbow"])
    with pytest.raises(ConfigError, match="joint_order is empty"):
        StateReader([])
    with pytest.raises(ConfigError, match="expected state dim 0 must be positive"):
        StateReader(None, expected_dim=0)
    assert StateReader(JOINTS).expected_dim == 4


# --- text ----------------------------------------------------------------------------------------

def check(text, max_chars=2000):
    return validate_text(text, what="question", max_chars=max_chars)


def test_clean_text_passes_stripped():
    assert check("  What is on the table?\n") == "What is on the table?"
    assert check(b"pick up the cup") == "pick up the cup"
    assert check("line one\n\tline two") == "line one\n\tline two"
    assert check("caf\u00e9 \U0001f600".encode()) == "caf\u00e9 \U0001f600"


def test_control_characters_are_removed():
    assert check("pick\x00 up\x07 the\x1b[31m cup\x7f\x85\r\n") == "pick up the[31m cup"


def test_invalid_utf8_bytes():
    with pytest.raises(TextError) as e:
        check(b"hello\xff world")
    assert str(e.value) == "question is not valid UTF-8 at byte 5"


def test_truncated_multibyte_sequence():
    with pytest.raises(TextError, match="question is not valid UTF-8 at byte 3"):
        check("abc\u00e9".encode()[:-1])


def test_lone_surrogate_in_str():
    undecodable = b"caf\xc3\xa9 \xff!".decode("utf-8", "surrogateescape")  # how some middlewares pass it
    with pytest.raises(TextError) as e:
        check(undecodable)
    assert str(e.value) == "question is not valid UTF-8 at byte 6"  # same offset as in the raw bytes
    with pytest.raises(TextError, match="at byte 0"):
        check("\ud800abc")


@pytest.mark.parametrize("text", ["", "   ", "\n\t \n", b"", "\x00\x01", b" \x1b "])
def test_empty(text):
    with pytest.raises(TextError) as e:
        check(text)
    assert str(e.value) == "question is empty"


def test_too_long():
    with pytest.raises(TextError) as e:
        check("x" * 5000)
    assert str(e.value) == "question has 5000 characters, the limit is 2000"
    assert check("  " + "x" * 2000 + "  ") == "x" * 2000  # surrounding whitespace does not count
    assert check("\U0001f600" * 10, max_chars=10) == "\U0001f600" * 10  # characters, not bytes


def test_what_names_the_text():
    with pytest.raises(TextError, match="prompt is empty"):
        validate_text(" ", what="prompt", max_chars=10)


def test_not_text():
    with pytest.raises(TextError, match="question must be text, got int"):
        check(42)
    with pytest.raises(ConfigError, match="max_chars 0 for question must be positive"):
        check("hi", max_chars=0)


# ----------------------------------------------------------------------------- state length bound
def test_state_length_is_bounded_without_joint_names_or_state_dim():
    # Unset state_dim and joint names used to accept any length: 200,000 entries cost 0.27 s per frame on
    # the engine thread. The bound is the model's state size (ObservationNode passes its action_dim).
    reader = StateReader(max_dim=32)
    assert reader.from_array(np.arange(32.0)).size == 32
    with pytest.raises(StateError, match="state has 33 values, more than the model's 32"):
        reader.from_array(np.arange(33.0))
    with pytest.raises(StateError, match="state has 33 values, more than the model's 32"):
        reader.from_joint_state([], np.arange(33.0))


def test_huge_state_messages_are_refused_before_conversion():
    huge = array.array("d", bytes(8 * 200_000))
    for read in (lambda: StateReader().from_array(huge), lambda: StateReader(JOINTS).from_joint_state([], huge),
                 lambda: StateReader().from_joint_state([f"j{i}" for i in range(200_000)], huge)):
        with pytest.raises(StateError, match="200000 values, more than the limit of 4096"):
            read()


def test_expected_dim_above_the_bound_is_a_config_error():
    with pytest.raises(ConfigError, match="expected state dim 40 exceeds the model's 32"):
        StateReader(None, expected_dim=40, max_dim=32)
    with pytest.raises(ConfigError, match="max_dim 0 must be positive"):
        StateReader(max_dim=0)


def test_raw_text_is_bounded_before_cleaning():
    # "hi" + 10 MB of NULs cleaned to "hi": the whole payload was scanned (and kept, where the raw text
    # was stored). Raw text longer than 4x the limit is refused before any work.
    with pytest.raises(TextError, match="question has 10000002 characters before cleaning, more than 4 x the limit of 2000"):
        validate_text("hi" + "\x00" * 10_000_000, what="question", max_chars=2000)
    with pytest.raises(TextError, match="before cleaning"):
        validate_text(b"hi" + b"\x00" * 8001, what="prompt", max_chars=2000)
    assert validate_text("  hi" + "\x00" * 7990 + " ", what="question", max_chars=2000) == "hi"
