"""pi052 against LeRobot's own pi052 code (branch codex/pi052-language-policy at f2c8867df1f8).

test/data/pi052/ was written by that code (scripts/pi052_reference.py, run where the branch is installed;
it is not needed here), with the package's small SentencePiece tokenizer standing in for PaliGemma's on
both sides:
- formats.json: the branch's prompt text and token ids for every message shape of its runtime (subtask,
  memory, interjection, say-flattened turns, default and joint action prompts with the joint recipe's causal
  marks), its plan/speech split, its earlier parser's reading of <loc> answers, and the ids its
  select_message generates under its FAST/<loc> masks (planted logit peaks over 257152 ids);
- model/: a small random pi052 checkpoint the branch saved in its native layout (separate lm_head and
  embed_tokens) with its processors, and what the branch's runtime adapter computed from it for one
  observation: greedy subtask/memory/interjection ids and text, the action prompts, the actions for fixed noise
  (default and joint recipe).

Tolerance: 1e-5 absolute on model-space actions (float32, CPU; LeRobot's time grid), exact equality on
token ids, prompt text and parsed coordinates.
"""
from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from oxygen_ros.model import pi052
from oxygen_ros.model.attention import CachedAttention, CachedRow, Segment, default_backend
from oxygen_ros.model.checkpoint import lerobot_policy, load_pi05
from oxygen_ros.model.config import GemmaConfig, Pi05Config, VisionConfig
from oxygen_ros.model.inference import ContiguousCache, greedy_generate, prefill, sample_actions
from oxygen_ros.model.pi05 import PrefixRow
from oxygen_ros.model.pi052 import Located, Pi052Format
from oxygen_ros.model.tokenizer import Tokenizer
from oxygen_ros.robot.policy_io import RobotIOConfig, build_policy_io

DATA = Path(__file__).parent / "data" / "pi052"
CASES = json.loads((DATA / "formats.json").read_text())
TOK = Tokenizer.tiny()
TOLERANCE = 1e-5
# scripts/lerobot_reference.py's MODEL_SIZES (scripts/pi052_reference.py builds the same); long prompts:
# the default recipe re-encodes the decoded subtask (128 tokens of a random model's text).
CONFIG = Pi05Config(vlm=GemmaConfig(width=64, depth=2, mlp_dim=128, num_heads=4, num_kv_heads=1, head_dim=16),
                    expert=GemmaConfig(width=32, depth=2, mlp_dim=64, num_heads=4, num_kv_heads=1, head_dim=16),
                    vision=VisionConfig(width=32, depth=1, mlp_dim=64, num_heads=2, image_size=56),
                    vocab_size=1000, action_dim=32, action_horizon=10, max_token_len=256, num_denoise_steps=10)


def encode(text: str) -> list[int]:
    return TOK.encode(text, bos=True)


# ------------------------------------------------------------------------------------------ formats
@pytest.mark.parametrize("case", CASES["prompts"], ids=lambda c: c["kind"])
def test_text_prompts_are_the_branchs(case):
    messages = {"subtask": lambda: pi052.subtask_messages(case["task"]),
                "memory": lambda: pi052.memory_messages(case["task"], case["memory"], case["completed_subtask"]),
                "interjection": lambda: pi052.interjection_messages(case["task"], case["plan"], case["text"]),
                }[case["kind"]]()
    text = pi052.render(messages)
    assert text == case["prompt"]
    assert encode(text) == case["tokens"]


@pytest.mark.parametrize("case", CASES["actions"], ids=lambda c: f"state={c['state'] is not None}")
def test_default_action_prompts_are_the_branchs(case):
    bins = None if case["state"] is None else pi052.state_text(np.array(case["state"], dtype=np.float32))
    assert bins == case["bins"]
    text = pi052.action_prompt(case["subtask"], bins)
    assert text == case["prompt"] and encode(text) == case["tokens"]


@pytest.mark.parametrize("case", CASES["joint"], ids=lambda c: f"bins={c['bins'] is not None}")
def test_joint_prompts_and_attention_are_the_branchs(case):
    ours = pi052.joint_tokens(TOK, case["task"], case["bins"], case["subtask"])
    assert ours.tokens == case["tokens"]
    assert ours.bidir + ours.causal + ours.tail == len(case["tokens"])
    # They begin with the frame's prompt, the subtask request's tokens (the engine prefills it once per frame).
    frame = encode(pi052.joint_prompt(case["task"], case["bins"]) + pi052.GENERATION_PROMPT)
    assert case["tokens"][:len(frame)] == frame and ours.bidir - len(frame) in (0, 1)
    # The actions' blocks after the prompt: the subtask's tokens, which decode to the subtask, then EOS, "\n".
    assert pi052.decode_reply(TOK, case["tokens"][ours.bidir:ours.bidir + ours.causal]) == case["subtask"].strip()
    assert case["tokens"][len(case["tokens"]) - ours.tail:] == [TOK.eos_id] + TOK.encode("\n")
    # The branch marks the subtask's tokens and EOS (each a block of its own: causal); the unmarked newline
    # after EOS joins EOS's block; everything before the first mark is one bidirectional block.
    marks = [0] * ours.bidir + [1] * (ours.causal + 1) + [0] * (ours.tail - 1)
    assert marks == case["causal_marks"]
    if case["subtask"]:
        # The bidirectional block is the subtask request's prompt (a fork of its K/V is exact), unless the
        # subtask's first piece lacks its leading space: the lone space piece then joins the block.
        request = encode(pi052.render([("user", case["task"] if case["bins"] is None
                                        else f"{case['task']}, State: {case['bins']};")]))
        block = ours.tokens[:ours.bidir]
        assert block[:len(request)] == request
        assert all(TOK.sp.id_to_piece(t) == "\u2581" for t in block[len(request):]) and len(block) - len(request) <= 1


@pytest.mark.parametrize("case", CASES["flatten_say"], ids=lambda c: str(len(c["speech"])))
def test_spoken_turns_are_flattened_as_the_branch_does(case):
    text = pi052.render([("user", "tidy"), ("assistant", pi052.speech_turn(case["content"], case["speech"]))],
                        generation_prompt=False)
    assert text == case["prompt"] and encode(text) == case["tokens"]


@pytest.mark.parametrize("case", CASES["split_plan_and_say"], ids=lambda c: c["reply"][:12])
def test_plan_and_speech_split_as_the_branch_does(case):
    assert pi052.split_plan_and_say(case["reply"]) == (case["plan"], case["speech"])


def as_branch(items: list[Located]) -> dict | None:
    """Our items in the branch parser's result form (its several bare points are zero-area boxes)."""
    if not items:
        return None
    if len(items) == 1 and items[0].kind == "point":
        return {"kind": "keypoint", "payload": {"label": items[0].label, "point_format": "xy",
                                                "point": list(items[0].xy)}, "normalized": True}
    boxes = [list(i.xy) if i.kind == "box" else list(i.xy) * 2 for i in items]
    return {"kind": "bbox", "payload": {"detections": [{"label": i.label, "bbox_format": "xyxy", "bbox": b}
                                                       for i, b in zip(items, boxes)]}, "normalized": True}


@pytest.mark.parametrize("case", CASES["parse_loc_answer"], ids=lambda c: c["answer"][:16])
def test_loc_answers_parse_as_the_branchs_parser(case):
    assert as_branch(pi052.parse_loc_answer(case["answer"])) == case["parsed"]


@pytest.mark.parametrize("case", CASES["masks"], ids=lambda c: f"skip{c['fast_skip_tokens']}-loc{c['allow_loc']}")
def test_masks_generate_what_select_message_generates(case):
    ranges = Pi052Format(joint=False, fast_skip_tokens=case["fast_skip_tokens"]).masked_ranges(
        case["vocab_size"], allow_loc=case["allow_loc"])
    generated = []
    for peaks in case["peaks"]:
        logits = torch.zeros(case["vocab_size"])
        for token, value in peaks.items():
            logits[int(token)] = value
        for lo, hi in ranges:
            logits[lo:hi] = float("-inf")
        generated.append(int(torch.argmax(logits)))
        if generated[-1] == TOK.eos_id:
            break
    assert generated == case["generated"]


# ------------------------------------------------------------------------------------------ the model
@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """A small model's 500 decode steps: one thread (two threads on a loaded 2-core machine took 40x longer)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def ref() -> dict:
    ref = dict(np.load(DATA / "model" / "reference.npz"))
    assert str(ref["branch_commit"]) == "f2c8867df1f8"
    return ref


@pytest.fixture(scope="module")
def model():
    return load_pi05(DATA / "model", CONFIG)


def images(ref) -> torch.Tensor:
    return torch.from_numpy(ref["pixels"])[None]


def generate(model, ref, tokens: list[int]) -> list[int]:
    fmt = lerobot_policy(DATA / "model").pi052
    assert fmt.masked_ranges(CONFIG.vocab_size, allow_loc=False) == []   # PaliGemma's ranges lie beyond this vocabulary
    cache = ContiguousCache(model, CONFIG.image_tokens + len(tokens) + fmt.max_new_tokens + 16)
    pre = prefill(model, cache, [PrefixRow(images(ref), torch.tensor(tokens))])
    return greedy_generate(model, cache, pre.segments[0], pre.hidden, [], fmt.max_new_tokens, eos_id=TOK.eos_id)


def test_the_checkpoint_loads_natively_with_its_format(model):
    policy = lerobot_policy(DATA / "model")
    assert policy.pi052 == Pi052Format(joint=False, fast_skip_tokens=1152, memory=True)
    assert model.lm_head is not None and not torch.equal(model.lm_head, model.embed_tokens.weight)
    assert model.time_grid == "lerobot"


def test_processors_are_the_branchs(ref):
    io = build_policy_io(RobotIOConfig(), checkpoint=DATA / "model", image_size=CONFIG.vision.image_size,
                         camera_slots=CONFIG.camera_slots)
    inputs = io.model_inputs({CONFIG.camera_slots[0]: ref["image"]}, ref["state"])
    np.testing.assert_allclose(inputs.state_normalized, ref["state_normalized"], rtol=0, atol=1e-6)
    assert pi052.state_text(inputs.state_normalized) == pi052.state_text(ref["state_normalized"])
    pixels = inputs.images[CONFIG.camera_slots[0]].numpy()
    np.testing.assert_allclose(pixels.reshape(ref["pixels"].shape), ref["pixels"], rtol=0, atol=1e-6)
    for recipe in ("default", "joint"):
        model_actions = np.zeros((CONFIG.action_horizon, CONFIG.action_dim), np.float32)
        model_actions[:, :6] = ref[f"{recipe}_model_actions"]
        np.testing.assert_allclose(io.robot_actions(model_actions, ref["state"]), ref[f"{recipe}_robot_actions"],
                                   rtol=0, atol=TOLERANCE)


@pytest.mark.parametrize("name,messages", [
    ("default_subtask", pi052.subtask_messages("put the cups away")),
    ("memory", pi052.memory_messages("put the cups away", "one cup is away", "pick up the red cup")),
    ("interjection", pi052.interjection_messages("put the cups away", "1. cups\n2. plates", "plates first")),
])
def test_text_requests_generate_the_branchs_ids(model, ref, name, messages):
    prompt = encode(pi052.render(messages))
    assert prompt == ref[f"{name}_prompt"].tolist()
    ids = generate(model, ref, prompt)
    assert ids == ref[f"{name}_ids"].tolist()
    assert pi052.decode_reply(TOK, ids) == str(ref[f"{name}_text"])


def test_default_recipe_actions_are_the_branchs(model, ref):
    subtask = pi052.decode_reply(TOK, ref["default_subtask_ids"].tolist())
    tokens = encode(pi052.action_prompt(subtask, pi052.state_text(ref["state_normalized"])))
    assert tokens == ref["default_action_tokens"].tolist()
    cache = ContiguousCache(model, CONFIG.image_tokens + len(tokens) + 16)
    pre = prefill(model, cache, [PrefixRow(images(ref), torch.tensor(tokens))])
    actions = sample_actions(model, cache, pre.segments, torch.from_numpy(ref["noise"])[None])
    np.testing.assert_allclose(actions[0, :, :6].numpy(), ref["default_model_actions"], rtol=0, atol=TOLERANCE)


def actions_over(model, ref, tokens: list[int], blocks: list[tuple[int, int]]) -> np.ndarray:
    """Actions over the images and `tokens`, prefilled block by block: each (n, bidir) appends n tokens, the
    first `bidir` of them seeing each other (the first block's with the images), the rest causal."""
    n_image = CONFIG.image_tokens
    total = n_image + len(tokens)
    cache = ContiguousCache(model, total + 16)
    pool = cache.allocate(total)
    backend = default_backend(model.device)
    (n, _), done = blocks[0], n_image + blocks[0][0]
    model.prefill([PrefixRow(images(ref), torch.tensor(tokens[:n]))],
                  CachedAttention(cache.kv, [CachedRow(done, Segment(pool, done), bidir=done)], backend, model.device))
    for n, bidir in blocks[1:]:
        new = tokens[done - n_image:done - n_image + n]
        model.extend(torch.tensor(new), CachedAttention(cache.kv, [CachedRow(n, Segment(pool, done + n), bidir=bidir)],
                                                        backend, model.device))
        done += n
    assert done == total
    return sample_actions(model, cache, [Segment(pool, total)], torch.from_numpy(ref["noise"])[None])[0, :, :6].numpy()


def joint_actions(model, ref, prompt: pi052.JointPrompt) -> np.ndarray:
    """The joint recipe's prefix built as the engine can fork it: the prompt's bidirectional block (a
    prefill), the subtask's tokens (causal, as decoded), then EOS and the newline (one block)."""
    return actions_over(model, ref, prompt.tokens, [(prompt.bidir, prompt.bidir), (prompt.causal, 0),
                                                    (prompt.tail, prompt.tail)])


def test_joint_recipe_subtask_and_actions_are_the_branchs(model, ref):
    state = pi052.state_text(ref["state_normalized"])
    request = encode(pi052.joint_prompt("put the cups away", state) + pi052.GENERATION_PROMPT)
    assert request == ref["joint_subtask_prompt"].tolist()
    ids = generate(model, ref, request)
    assert ids == ref["joint_subtask_ids"].tolist()
    subtask = pi052.decode_reply(TOK, ids)
    assert subtask == str(ref["joint_subtask_text"])
    prompt = pi052.joint_tokens(TOK, "put the cups away", state, subtask)
    assert prompt.tokens == ref["joint_action_tokens"].tolist()
    marks = [0] * prompt.bidir + [1] * (prompt.causal + 1) + [0] * (prompt.tail - 1)
    assert marks == ref["joint_causal_marks"].tolist()
    np.testing.assert_allclose(joint_actions(model, ref, prompt), ref["joint_model_actions"], rtol=0, atol=TOLERANCE)


def test_a_plain_causal_span_is_not_the_joint_recipe(model, ref):
    """The branch's tokens with the span `"Assistant: {subtask}" EOS "\\n"` attended purely causally after a
    bidirectional `"User: ...;\\n"` (the header outside the prompt's block, EOS blind to the newline): not what
    the branch computes."""
    state = pi052.state_text(ref["state_normalized"])
    tokens = pi052.joint_tokens(TOK, "put the cups away", state, str(ref["joint_subtask_text"])).tokens
    assert tokens == ref["joint_action_tokens"].tolist()
    prompt = len(encode(pi052.joint_prompt("put the cups away", state)))
    actions = actions_over(model, ref, tokens, [(prompt, prompt), (len(tokens) - prompt, 0)])
    assert np.abs(actions - ref["joint_model_actions"]).max() > 10 * TOLERANCE


@pytest.mark.parametrize("sync", [True, False], ids=["subtask_sync", "async"])
def test_the_engine_serves_the_joint_recipe_as_the_branch(ref, sync):
    """The engine on this checkpoint in the joint recipe: one prefill per frame (images + the prompt through
    "Assistant:"), the subtask a request with no question on that frame's K/V (sync: decoded on the frame
    before its actions; async: by the batched decode, used from the next frame on), the actions reading the
    prefix plus the subtask (causal) plus [EOS, "\\n"] (one block). Subtask ids and actions: the branch's."""
    from oxygen_ros.engine.config import EngineConfig
    from oxygen_ros.engine.factory import build_engine
    from oxygen_ros.robot.sync import Observation

    engine = build_engine(CONFIG, checkpoint=str(DATA / "model"), robot_io=RobotIOConfig(), kv_budget_mb=8.0,
                          engine=EngineConfig(hierarchy="joint", subtask_sync=sync, subtask_period_s=0.0,
                                              progress_memory=False))
    slot = CONFIG.camera_slots[0]
    obs = Observation(stamp_s=0.0, images={slot: ref["image"]}, image_masks={slot: True}, state=ref["state"],
                      prompt="put the cups away")
    replies = []
    replied = engine.hierarchy._subtask_replied
    engine.hierarchy._subtask_replied = lambda robot, generation, reply: (replies.append(reply),
                                                                          replied(robot, generation, reply))
    engine.run_cycle(obs, ref["noise"])
    if not sync:
        assert engine.latest_chunk().subtask == "put the cups away"      # no subtask yet: the task
        for i in range(1, 200):
            if replies:
                break
            engine.run_cycle()
        assert replies and replies[0].tokens == ref["joint_subtask_ids"].tolist()
        engine.run_cycle(Observation(stamp_s=1.0, images=obs.images, image_masks=obs.image_masks,
                                     state=obs.state, prompt=obs.prompt), ref["noise"])
    chunk = engine.latest_chunk()
    assert chunk.subtask == str(ref["joint_subtask_text"]) == engine.language_state()["subtask"]
    # this subtask begins with a byte piece: the lone space piece is in the actions' bidirectional block; sync
    # mode prefills the frame with the subtask request's prompt (the actions: an own prefill), async mode with
    # the actions' block (read as it is)
    assert engine.stats.counter("joint_own_prefill") == int(sync)
    np.testing.assert_allclose(chunk.model_actions[:, :6], ref["joint_model_actions"], rtol=0, atol=TOLERANCE)
