"""pi052 formats: the rules of oxygen_ros.model.pi052 on their own (prompt shapes, masks, parsing, config).
Parity with LeRobot's own code, run on the same inputs, is test_pi052_reference.py."""
import json

import numpy as np
import pytest

from oxygen_ros.model import pi052
from oxygen_ros.model.checkpoint import lerobot_policy
from oxygen_ros.model.files import CheckpointError
from oxygen_ros.model.pi052 import Located, Pi052Format
from oxygen_ros.model.tokenizer import Tokenizer


def test_turns_and_generation_prompt():
    messages = pi052.interjection_messages("tidy up", "1. cups\n2. plates", "skip the plates")
    text = pi052.render(messages)
    assert text.endswith("\nAssistant:")                       # no trailing space
    assert text.startswith("User: tidy up\nAssistant: Previous plan:\n1. cups\n2. plates\nUser: skip")
    assert pi052.render(messages, generation_prompt=False).endswith("skip the plates\n")


def test_empty_optional_turns_are_left_out():
    assert pi052.memory_messages("t", "", "") == [("user", "t")]
    assert pi052.memory_messages("t", "", "pick") == [("user", "t"), ("user", "Completed subtask: pick")]
    assert pi052.interjection_messages("t", "", "") == [("user", "t")]
    assert pi052.subtask_messages("t") == [("user", "t")]


def test_bad_messages_are_refused_with_their_fault():
    with pytest.raises(ValueError, match="role"):
        pi052.render([("system", "x")])
    with pytest.raises(ValueError, match="content must be a string"):
        pi052.render([("user", None)])
    with pytest.raises(ValueError, match="finite"):
        pi052.state_text([0.0, float("nan")])


def test_state_bins_follow_the_256_bin_convention():
    assert pi052.state_text(np.array([-1.0, 0.0, 0.99, 1.0, -1.5])) == "0 128 254 255 -1"
    assert pi052.action_prompt("pick the cup", "3 4") == "User: pick the cup, State: 3 4;\n"
    assert pi052.action_prompt("pick the cup", None) == "User: pick the cup\n"
    assert pi052.joint_prompt("tidy", "3") == "User: tidy, State: 3;\n"


def test_joint_tokens_are_the_frame_prompt_the_subtask_then_eos_and_newline():
    tok = Tokenizer.tiny()
    newline = tok.encode("\n")
    frame = tok.encode(pi052.joint_prompt("tidy", "3") + pi052.GENERATION_PROMPT, bos=True)
    joint = pi052.joint_tokens(tok, "tidy", "3", "pick the cup")
    ids = joint.tokens
    assert (joint.bidir, joint.tail) == (len(frame), 1 + len(newline)) and ids[:joint.bidir] == frame
    assert joint.bidir + joint.causal + joint.tail == len(ids)
    assert ids[-joint.tail] == tok.eos_id and ids[-len(newline):] == newline
    assert tok.decode(ids[:-joint.tail]) == "User: tidy, State: 3;\nAssistant: pick the cup"
    assert tok.decode(ids[joint.bidir:joint.bidir + joint.causal]) == " pick the cup"   # its first piece: the space
    # A subtask whose first piece does not carry its leading space: the lone space piece joins the first block.
    digit = pi052.joint_tokens(tok, "tidy", "3", "3 cups")
    assert digit.tokens[:digit.bidir] == frame + [tok.sp.piece_to_id("\u2581")]
    assert tok.decode(digit.tokens[digit.bidir:digit.bidir + digit.causal]) == "3 cups"


def test_masks_fast_codes_always_and_locs_in_prose():
    fmt = Pi052Format(joint=False, fast_skip_tokens=1152)
    assert fmt.masked_ranges(257152, allow_loc=False) == [(254976, 256000), (256000, 257024)]
    assert fmt.masked_ranges(257152, allow_loc=True) == [(254976, 256000)]
    # A checkpoint of the 128-skip era run with the 1024-code rule: the codes start at 256000, nothing masked
    # (the branch's own behaviour, kept so that the two agree).
    assert Pi052Format(joint=False, fast_skip_tokens=128).masked_ranges(257152, allow_loc=True) == []
    # A small vocabulary (test models) has neither range.
    assert fmt.masked_ranges(1000, allow_loc=False) == []


def test_format_from_config():
    fmt = Pi052Format.from_config({"type": "pi052", "joint_subtask_conditioning": True, "fast_skip_tokens": 128,
                                   "recipe_path": "recipes/subtask_joint.yaml"})
    assert (fmt.joint, fmt.fast_skip_tokens, fmt.memory, fmt.max_new_tokens) == (True, 128, False, 128)
    default = Pi052Format.from_config({"type": "pi052"})
    assert (default.joint, default.fast_skip_tokens, default.memory) == (False, 1152, True)
    assert not Pi052Format.from_config({"type": "pi052", "recipe_path": None}).memory
    with pytest.raises(ValueError, match="not a pi052 config"):
        Pi052Format.from_config({"type": "pi05"})
    with pytest.raises(ValueError, match="joint_subtask_conditioning"):
        Pi052Format.from_config({"type": "pi052", "joint_subtask_conditioning": "yes"})
    with pytest.raises(ValueError, match="fast_skip_tokens"):
        Pi052Format.from_config({"type": "pi052", "fast_skip_tokens": -1})
    with pytest.raises(ValueError, match="memory_scratchpad"):
        Pi052Format.from_config({"type": "pi052", "memory_scratchpad": True})


def test_plan_and_speech():
    assert pi052.split_plan_and_say('go left <SAY> "on it" </say> then right') == ("go left  then right", "on it")
    assert pi052.split_plan_and_say("just a plan ") == ("just a plan", "")
    assert pi052.split_plan_and_say("") == ("", "")


def test_loc_answers():
    assert pi052.parse_loc_answer("no locations here") == []
    (point,) = pi052.parse_loc_answer("<loc1023><loc0000> red cup")      # y first, label after the locs
    assert point == Located("red cup", "point", (0.0, 1.0))
    boxes = pi052.parse_loc_answer("cup <loc0100><loc0200><loc0300><loc0400><loc0500> ; tip <loc0001><loc0002>")
    assert boxes == [Located("cup", "box", (200 / 1023, 100 / 1023, 400 / 1023, 300 / 1023))]   # points dropped
    assert pi052.parse_loc_answer("a <loc0001><loc0002><loc0003>") == []     # three locs are nothing
    assert pi052.parse_loc_answer("a <loc9999><loc0002>")[0].xy == (2 / 1023, 1.0)   # clamped
    assert len(pi052.parse_loc_answer("a <loc0001><loc0002>; b <loc0003><loc0004>")) == 2


def test_a_pi052_directory_carries_its_format_and_a_bad_one_is_named(tmp_path):
    config = {"type": "pi052", "input_features": {"observation.images.base": {"type": "VISUAL", "shape": [3, 56, 56]}},
              "output_features": {"action": {"type": "ACTION", "shape": [6]}}, "joint_subtask_conditioning": True}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert lerobot_policy(tmp_path).pi052 == Pi052Format(joint=True, fast_skip_tokens=1152, memory=True)
    (tmp_path / "config.json").write_text(json.dumps(config | {"fast_skip_tokens": "many"}))
    with pytest.raises(CheckpointError, match=r"config\.json: pi052 fast_skip_tokens must be a non-negative integer"):
        lerobot_policy(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(config | {"type": "pi05"}))
    assert lerobot_policy(tmp_path).pi052 is None
