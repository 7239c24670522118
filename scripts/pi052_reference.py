"""Reference data for pi052 checkpoints: what LeRobot's own pi052 code computes (test/data/pi052/).

Runs against LeRobot's pi052 branch (`codex/pi052-language-policy` at f2c8867df1f8; not a dependency of this
package, it needs Python 3.12):

    python3.12 -m venv ../pi052 && ../pi052/bin/pip install 'torch>=2.7,<2.12' 'transformers>=5.4,<5.6' \
        'numpy>=2,<2.3' sentencepiece protobuf safetensors draccus==0.10.0 einops 'huggingface-hub>=1,<2' \
        packaging termcolor tqdm gymnasium Pillow 'torchvision>=0.22,<0.27' 'opencv-python-headless<4.14' \
        requests 'datasets>=4.7,<5' 'pandas>=2,<3' 'pyarrow>=21,<30' jsonlines pyyaml 'av>=15,<16'
    mkdir ../lerobot_pi052 && git -C <lerobot clone> archive f2c8867df1f8 | tar -x -C ../lerobot_pi052
    ../pi052/bin/pip install --no-deps -e ../lerobot_pi052
    ../pi052/bin/python scripts/pi052_reference.py --vqa-source <lerobot clone>

Measured: transformers 5.5.4, torch 2.11.0 (CPU), about 30 s; a second run writes the same bytes.

The PaliGemma tokenizer is gated, so both sides use the package's shipped small SentencePiece model
(PaliGemma's special ids: pad 0, eos 1, bos 2): here loaded as transformers' GemmaTokenizer (the class the
PaliGemma checkpoint names), with BOS added, `</s>` its EOS text, "\\n" an ordinary (not special) piece, and
LeRobot's <loc> registration on top, loaded wherever the branch loads "google/paligemma-3b-pt-224".

Written:
- formats.json: every prompt shape of the branch's language runtime, as its own code builds it
  (`PI052PolicyAdapter.build_messages` -> `_build_text_batch`: `_flatten_say_tool_calls`, `_strip_blocks`,
  `_format_messages` + "Assistant:", the tokenizer call; the default action prompt; the joint recipe's
  `encode_prompt_with_targets` with its causal marks), with the prompt text and token ids; `<say>` splits
  (`runtime.adapter.split_plan_and_say`); `<loc>` answers parsed by the branch's earlier parser
  (`pi052/inference/vqa.py` at d099ac91b, read from the clone with --vqa-source); and the FAST/<loc> masks
  as `select_message` applies them, on logits with planted peaks over PaliGemma's 257152 ids.
- model/: a shrunk pi052 checkpoint the branch writes itself (PI052Policy.save_pretrained: the native
  layout, separate lm_head and embed_tokens; its pre/post-processors with random dataset statistics), at the
  sizes of scripts/lerobot_reference.py's small pi05 (LeRobot's own code, get_gemma_config and the SigLIP/
  vocabulary sizes shrunk), reloaded as LeRobot serves it (PI052Policy.from_pretrained,
  make_pre_post_processors), and run through the branch's runtime adapter for one observation: the subtask,
  memory and interjection requests (`select_message`, greedy, 128 tokens at most) and the action chunk
  (`predict_action_chunk` with fixed noise) for the default and the joint recipe. reference.npz holds the
  inputs, every prompt's token ids, the generated ids and text, the causal marks and the actions.
"""
from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import tempfile
import types
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).parent))
from lerobot_reference import (MODEL_SIZES, dataset_stats, image_stats, random_weights,  # noqa: E402
                               shrink_lerobot_pi05)

BRANCH_COMMIT = "f2c8867df1f8"
VQA_COMMIT = "d099ac91b"
TASK = "put the cups away"
IMAGE = 56                   # the model's image size (4x4 patches), also the camera's: no resize involved
CHUNK, TOKENS = 10, 48
STATE_DIM, ACTION_DIM = 6, 6
VOCAB = 257152               # PaliGemma's


# ------------------------------------------------------------------------------------------ tokenizer
def stand_in_tokenizer(model_file: Path, folder: Path):
    """The shipped SentencePiece model as a transformers GemmaTokenizer saved in `folder` (loadable with
    AutoTokenizer.from_pretrained, as the branch loads its tokenizer)."""
    from transformers import AddedToken, GemmaTokenizer

    folder.mkdir(parents=True, exist_ok=True)
    shutil.copy(model_file, folder / "tokenizer.model")
    tok = GemmaTokenizer.from_pretrained(str(folder), bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                         unk_token="<unk>", add_bos_token=True, add_eos_token=False)
    # SentencePiece user-defined pieces come through as special tokens; PaliGemma's "\n" is ordinary text
    # (decode keeps it), so make it so here too.
    tok.add_tokens([AddedToken("\n", special=False, normalized=False)])
    tok.save_pretrained(str(folder))
    return tok


def check_stand_in(tok, model_file: Path) -> None:
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=str(model_file))
    for text in ("User: pick up the red cup, State: 12 255 -1 0;\nAssistant:", "a\n\nb  c_d ü ☕"):
        assert tok(text)["input_ids"] == [sp.bos_id()] + sp.encode(text), text
    assert tok.eos_token_id == sp.eos_id() == 1 and tok.bos_token_id == sp.bos_id() == 2


class Recorder:
    """Wraps a tokenizer: records each call's text and every decode's ids."""

    def __init__(self, tok):
        self.tok, self.calls, self.decoded = tok, [], []

    def __getattr__(self, name):
        return getattr(self.tok, name)

    def __call__(self, text, *args, **kwargs):
        self.calls.append(text)
        return self.tok(text, *args, **kwargs)

    def decode(self, ids, *args, **kwargs):
        self.decoded.append([int(i) for i in ids])
        return self.tok.decode(ids, *args, **kwargs)


def patch_tokenizer_loading(folder: Path) -> list[Recorder]:
    """Every AutoTokenizer.from_pretrained (whatever the name: PaliGemma's is gated) loads the stand-in."""
    import transformers

    made: list[Recorder] = []

    def load(name, *args, **kwargs):
        made.append(Recorder(transformers.GemmaTokenizer.from_pretrained(str(folder))))
        return made[-1]

    transformers.AutoTokenizer.from_pretrained = staticmethod(load)
    return made


# ------------------------------------------------------------------------------------------ formats
def format_cases(folder: Path, vqa_source: Path) -> dict:
    from transformers import AutoTokenizer

    from lerobot.policies.pi052.inference import pi052_adapter as pa
    from lerobot.policies.pi052.text_processor_pi052 import (discretize_state_str, encode_prompt_with_targets,
                                                               register_paligemma_loc_tokens)
    from lerobot.runtime import RuntimeState
    from lerobot.runtime.adapter import split_plan_and_say

    pa._LOC_TOKENIZER_CACHE.clear()
    config = types.SimpleNamespace(tokenizer_name="stand-in", device=None, joint_subtask_conditioning=False)
    policy = types.SimpleNamespace(config=config)
    adapter = pa.PI052PolicyAdapter(policy)

    def text_batch(messages, generation_prompt=True):
        batch = pa._build_text_batch(policy, messages, add_generation_prompt=generation_prompt)
        return batch["tokenizer"].calls[-1], batch["lang_tokens"][0].tolist()

    prompts = []
    tasks = ["put the cups away", "  Pick_up the RED cup!  ", "tidy up\nthen rest", "ü ☕ «quoted» 'x'", ""]
    for task in tasks:
        for kind, context, extra, user_text in [
            ("subtask", {}, {}, None),
            ("memory", {}, {}, None),
            ("memory", {"memory": "cup 1 is away"}, {}, None),
            ("memory", {}, {"prior_subtask": "pick up the red cup"}, None),
            ("memory", {"memory": "cups: 1\nplates: 0"}, {"prior_subtask": "place the cup"}, None),
            ("interjection", {}, {}, "skip the plates"),
            ("interjection", {"plan": "1. cups\n2. plates"}, {}, "no, plates first"),
            ("interjection", {"plan": "1. cups"}, {}, None),
        ]:
            state = RuntimeState(task=task, language_context=dict(context), extra=dict(extra))
            messages = adapter.build_messages(kind, state, user_text=user_text)
            text, ids = text_batch(messages)
            prompts.append({"kind": kind, "task": task, "memory": context.get("memory", ""),
                            "plan": context.get("plan", ""), "completed_subtask": extra.get("prior_subtask", ""),
                            "text": user_text or "", "prompt": text, "tokens": ids})

    # Action prompts, default recipe (select_action's non-joint branch) and joint recipe (its joint branch,
    # encode_prompt_with_targets with causal marks on the subtask span), on normalised states.
    rng = np.random.default_rng(5)
    tokenizer = register_paligemma_loc_tokens(AutoTokenizer.from_pretrained("stand-in"))
    actions, joint = [], []
    for subtask in ["pick up the red cup", "Place_it  on the shelf.", "ü ☕", ""]:
        for state_row in (rng.uniform(-1.2, 1.2, 7), None):
            bins = None if state_row is None else discretize_state_str(torch.tensor(state_row, dtype=torch.float32))
            content = subtask if bins is None else f"{subtask}, State: {bins};"
            text, ids = text_batch([{"role": "user", "content": content}], generation_prompt=False)
            state_list = None if state_row is None else state_row.astype(np.float32).tolist()
            actions.append({"subtask": subtask, "state": state_list, "bins": bins, "prompt": text, "tokens": ids})
            for task in ("put the cups away", "ü  two  spaces"):
                task_content = task if bins is None else f"{task}, State: {bins};"
                ids, mask, marks = encode_prompt_with_targets(
                    tokenizer, [{"role": "user", "content": task_content}, {"role": "assistant", "content": subtask}],
                    target_indices=[1])
                joint.append({"task": task, "subtask": subtask, "bins": bins, "prompt": tokenizer.calls[-1],
                              "tokens": ids[0].tolist(), "causal_marks": marks[0].int().tolist()})

    # say tool calls flattened into an assistant turn's text (training targets, history turns).
    flatten = []
    for content, says in [("go to the sink", ["on my way"]), ("", ["ok", "then the plates"]), ("plan", []),
                          ("  spaced  ", ["'quoted'"])]:
        message = {"role": "assistant", "content": content,
                   "tool_calls": [{"type": "function", "function": {"name": "say", "arguments": json.dumps({"text": s})}}
                                  for s in says]}
        text, ids = text_batch([{"role": "user", "content": "tidy"}, message], generation_prompt=False)
        flatten.append({"content": content, "speech": says, "prompt": text, "tokens": ids})

    say = []
    for reply in ['1. cups\n2. plates <say>"On it!"</say>', "<SAY> first </say> rest <say>second</say>",
                  "no speech here ", "", "<say>only speech</say>", "< say >'x'</ say > tail"]:
        plan, speech = split_plan_and_say(reply)
        say.append({"reply": reply, "plan": plan, "speech": speech})

    vqa = _load_vqa_parser(vqa_source)
    loc = []
    for answer in ["red cup <loc0100><loc0200>", "<loc1023><loc0000> cup", "box <loc0010><loc0020><loc0030><loc0040>",
                   "a <loc0001><loc0002> ; b <loc0003><loc0004>",
                   "cup <loc0100><loc0200><loc0300><loc0400> ; tip <loc0005><loc0006>",
                   "x <loc0001><loc0002><loc0003>", "y <loc9999><loc0000><loc0512><loc0513><loc0007>",
                   "no locations", "", "<loc12345>", "cup <loc0100><loc0200>;;plate<loc0300><loc0400><loc0500><loc0600>",
                   "   <loc0000><loc0000>   "]:
        loc.append({"answer": answer, "parsed": vqa.parse_loc_answer(answer)})

    return {"branch_commit": BRANCH_COMMIT, "vqa_commit": VQA_COMMIT, "prompts": prompts, "actions": actions,
            "joint": joint, "flatten_say": flatten, "split_plan_and_say": say, "parse_loc_answer": loc,
            "masks": mask_cases()}


def _load_vqa_parser(clone: Path):
    """The branch's earlier VQA parser module (removed at f2c8867), read from the clone at d099ac91b."""
    source = subprocess.run(["git", "-C", str(clone), "show", f"{VQA_COMMIT}:src/lerobot/policies/pi052/inference/vqa.py"],
                            check=True, capture_output=True, text=True).stdout
    module = types.ModuleType("pi052_vqa")
    exec(compile(source, "vqa.py", "exec"), module.__dict__)   # noqa: S102 - LeRobot's own file, for the reference
    return module


def mask_cases() -> list[dict]:
    """select_message's masks, run by the branch's own select_message on a stand-in model whose lm_head gives
    logits with planted peaks over PaliGemma's 257152 ids (0 elsewhere): which ids it generates."""
    from lerobot.policies.pi052.modeling_pi052 import PI052Policy

    peaks_per_step = [
        {254976: 9.0, 255999: 8.0, 256000: 7.0, 257023: 6.0, 1000: 5.0, 257100: 4.0},   # FAST, loc, text, seg
        {256500: 9.0, 254975: 8.5, 2: 1.0},
        {255500: 9.0, 257030: 8.0, 7: 0.5},
        {256000: 3.0, 1: 2.0},                                      # <loc> first, then EOS
    ]
    cases = []
    for fast_skip in (1152, 128, 0):
        for suppress_loc in (True, False):
            step = {"i": 0}

            def lm_head(hidden, _step=step):
                logits = torch.zeros(hidden.shape[0], hidden.shape[1], VOCAB)
                for token, value in peaks_per_step[min(_step["i"], len(peaks_per_step) - 1)].items():
                    logits[..., token] = value
                _step["i"] += 1
                return logits

            lm_head.weight = torch.zeros(1)
            q_proj = types.SimpleNamespace(weight=torch.zeros(1))
            layer = types.SimpleNamespace(self_attn=types.SimpleNamespace(q_proj=q_proj))
            backbone = types.SimpleNamespace(
                paligemma=types.SimpleNamespace(lm_head=lm_head, model=types.SimpleNamespace(
                    language_model=types.SimpleNamespace(layers=[layer]))),
                forward=lambda **kw: ((torch.zeros(1, 1, 4), None), "cache"),
                embed_language_tokens=lambda ids: torch.zeros(1, 1, 4))
            model = types.SimpleNamespace(
                embed_prefix=lambda *a: (torch.zeros(1, 3, 4), torch.ones(1, 3, dtype=torch.bool),
                                         torch.zeros(1, 3, dtype=torch.bool)),
                paligemma_with_expert=backbone, _prepare_attention_masks_4d=lambda m, dtype: m)
            stub = types.SimpleNamespace(
                eval=lambda: None, config=types.SimpleNamespace(fast_skip_tokens=fast_skip), model=model,
                _preprocess_images=lambda batch: ([], []), _sample_next_token=PI052Policy._sample_next_token)
            decoded = []
            tokenizer = types.SimpleNamespace(eos_token_id=1, all_special_ids=[0, 1, 2, 3],
                                              decode=lambda ids, skip_special_tokens=True: decoded.append(list(ids)) or "")
            PI052Policy.select_message(stub, {"observation.language.tokens": torch.zeros(1, 1, dtype=torch.long),
                                              "observation.language.attention_mask": torch.ones(1, 1, dtype=torch.bool)},
                                       tokenizer=tokenizer, max_new_tokens=len(peaks_per_step),
                                       suppress_loc_tokens=suppress_loc)
            cases.append({"fast_skip_tokens": fast_skip, "allow_loc": not suppress_loc, "vocab_size": VOCAB,
                          "peaks": [{str(k): v for k, v in p.items()} for p in peaks_per_step],
                          "generated": [int(t) for t in decoded[0]]})
    return cases


# ------------------------------------------------------------------------------------------ model
def model_case(out: Path, folder: Path, made: list, seed: int) -> None:
    import lerobot.policies.pi052.inference.pi052_adapter as pa
    from lerobot.configs import FeatureType, NormalizationMode, PolicyFeature
    from lerobot.configs.policies import PreTrainedConfig
    from lerobot.policies.factory import make_pre_post_processors
    from lerobot.policies.pi052.configuration_pi052 import PI052Config
    from lerobot.policies.pi052.modeling_pi052 import PI052Policy
    from lerobot.policies.pi052.processor_pi052 import make_pi052_pre_post_processors
    from lerobot.policies.utils import prepare_observation_for_inference
    from lerobot.runtime import RuntimeState
    from lerobot.utils.constants import OBS_LANGUAGE_CAUSAL_MARKS, OBS_LANGUAGE_TOKENS

    shrink_lerobot_pi05()
    rng = np.random.default_rng(seed)
    camera = "observation.images.base"
    config = PI052Config(
        input_features={camera: PolicyFeature(FeatureType.VISUAL, (3, IMAGE, IMAGE)),
                        "observation.state": PolicyFeature(FeatureType.STATE, (STATE_DIM,))},
        output_features={"action": PolicyFeature(FeatureType.ACTION, (ACTION_DIM,))},
        normalization_mapping={"VISUAL": NormalizationMode.IDENTITY, "STATE": NormalizationMode.QUANTILES,
                               "ACTION": NormalizationMode.QUANTILES},
        image_resolution=(IMAGE, IMAGE), chunk_size=CHUNK, n_action_steps=CHUNK, tokenizer_max_length=TOKENS,
        device="cpu", dtype="float32", enable_fast_action_loss=False)
    action_stats = dataset_stats(rng, ACTION_DIM)
    action_stats |= {"q01": 4.0 + rng.uniform(0, 1, ACTION_DIM), "q99": 20.0 - rng.uniform(0, 1, ACTION_DIM)}
    stats = {"observation.state": dataset_stats(rng, STATE_DIM), "action": action_stats, camera: image_stats(rng)}

    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    torch.manual_seed(seed)
    policy = PI052Policy(config)
    random_weights(policy, seed)
    backbone = policy.model.paligemma_with_expert.paligemma
    assert backbone.lm_head.weight.data_ptr() != backbone.model.language_model.embed_tokens.weight.data_ptr()
    assert not torch.equal(backbone.lm_head.weight, backbone.model.language_model.embed_tokens.weight)
    policy.save_pretrained(out)
    pre, post = make_pi052_pre_post_processors(config, dataset_stats=stats)
    pre.save_pretrained(out)
    post.save_pretrained(out)

    # Served as LeRobot serves a checkpoint directory.
    config = PreTrainedConfig.from_pretrained(out)
    policy = PI052Policy.from_pretrained(out, config=config).eval()
    pre, post = make_pre_post_processors(config, pretrained_path=str(out))
    policy.config.tokenizer_name = "stand-in"

    state_raw = stats["observation.state"]["q01"] + rng.uniform(-0.1, 1.1, STATE_DIM) * (
        stats["observation.state"]["q99"] - stats["observation.state"]["q01"])
    image = rng.integers(0, 256, (IMAGE, IMAGE, 3), dtype=np.uint8)
    noise = rng.standard_normal((CHUNK, config.max_action_dim)).astype(np.float32)
    observation = {"observation.state": state_raw.astype(np.float32), camera: image.copy()}
    batch = pre(prepare_observation_for_inference(observation, torch.device("cpu"), TASK))
    policy.model.sample_noise = lambda shape, device: torch.from_numpy(noise)[None].clone()
    pixels, _ = policy._preprocess_images(batch)

    seen: dict[str, list] = {}
    select_message, predict = policy.select_message, policy.predict_action_chunk

    def record_message(b, **kw):
        seen["text_tokens"] = b[OBS_LANGUAGE_TOKENS][0].tolist()
        return select_message(b, **kw)

    def record_actions(b, **kw):
        seen["action_tokens"] = b[OBS_LANGUAGE_TOKENS][0].tolist()
        marks = b.get(OBS_LANGUAGE_CAUSAL_MARKS)
        seen["causal_marks"] = [] if marks is None else marks[0].int().tolist()
        return predict(b, **kw)

    policy.select_message, policy.predict_action_chunk = record_message, record_actions
    adapter = pa.PI052PolicyAdapter(policy)
    arrays = {"task": np.array(TASK), "state": state_raw, "image": image, "noise": noise,
              "state_normalized": batch["observation.state"][0].numpy(), "pixels": pixels[0][0].numpy(),
              "branch_commit": np.array(BRANCH_COMMIT)}

    def text(name: str, kind: str, state: RuntimeState, user_text: str | None = None) -> str:
        made.clear()
        pa._LOC_TOKENIZER_CACHE.clear()
        reply = adapter.generate_text(kind, batch, state, user_text=user_text)
        arrays[f"{name}_prompt"] = np.array(seen["text_tokens"])
        arrays[f"{name}_ids"] = np.array(made[-1].decoded[-1])
        arrays[f"{name}_text"] = np.array(reply)
        return reply

    for recipe in ("default", "joint"):
        policy.config.joint_subtask_conditioning = recipe == "joint"
        state = RuntimeState(task=TASK)
        subtask = text(f"{recipe}_subtask", "subtask", state)
        state.set_context("subtask", subtask)
        pa._LOC_TOKENIZER_CACHE.clear()
        chunk = adapter.select_action(batch, state)
        arrays[f"{recipe}_action_tokens"] = np.array(seen["action_tokens"])
        arrays[f"{recipe}_causal_marks"] = np.array(seen["causal_marks"], dtype=np.int64)
        arrays[f"{recipe}_model_actions"] = chunk[0].numpy()
        arrays[f"{recipe}_robot_actions"] = post(chunk)[0].numpy()
    policy.config.joint_subtask_conditioning = False
    state = RuntimeState(task=TASK, language_context={"memory": "one cup is away"},
                         extra={"prior_subtask": "pick up the red cup"})
    text("memory", "memory", state)
    state = RuntimeState(task=TASK, language_context={"plan": "1. cups\n2. plates"})
    text("interjection", "interjection", state, user_text="plates first")
    np.savez_compressed(out / "reference.npz", **arrays)
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"model: {sum(p.numel() for p in policy.parameters())} parameters, {size} bytes in {out}; subtask "
          f"{len(arrays['default_subtask_ids'])} ids, actions in [{arrays['default_robot_actions'].min():.2f}, "
          f"{arrays['default_robot_actions'].max():.2f}]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="test/data/pi052", help="output folder")
    parser.add_argument("--tokenizer", default="oxygen_ros/model/assets/tiny_tokenizer.model",
                        help="SentencePiece model standing in for PaliGemma's tokenizer")
    parser.add_argument("--vqa-source", required=True, help="a git clone of huggingface/lerobot holding "
                        f"{VQA_COMMIT} (the branch's earlier VQA parser)")
    args = parser.parse_args(argv)
    import lerobot.policies.pi052  # noqa: F401 - the branch must be installed

    assert MODEL_SIZES["vocab_size"] == 1000   # the stand-in tokenizer's
    torch.set_num_threads(1)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "stand_in"
        tok = stand_in_tokenizer(Path(args.tokenizer), folder)
        check_stand_in(tok, Path(args.tokenizer))
        made = patch_tokenizer_loading(folder)
        cases = format_cases(folder, Path(args.vqa_source))
        (out / "formats.json").write_text(json.dumps(cases, indent=1, ensure_ascii=False) + "\n")
        print(f"formats: {len(cases['prompts'])} text prompts, {len(cases['actions'])} action prompts, "
              f"{len(cases['joint'])} joint, {len(cases['parse_loc_answer'])} loc answers")
        model_case(out / "model", folder, made, seed=300)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
