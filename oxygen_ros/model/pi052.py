"""LeRobot pi052 ("PI0.5 v2", hierarchical language) prompt formats, masks and answer parsing.

What a pi052 checkpoint was trained to read and write, following LeRobot's branch
`codex/pi052-language-policy` at f2c8867 (`policies/pi052/text_processor_pi052.py`,
`policies/pi052/inference/pi052_adapter.py`, `runtime/adapter.py`) and, for spatial answers, the same
branch's earlier `pi052/inference/vqa.py` (d099ac91b). Pure Python: the engine tokenises the strings.

- Turns are `"User: {content}\\n"` / `"Assistant: {content}\\n"` after BOS (added by the tokenizer call),
  no system prompt, no chat template. A text request ends with `"Assistant:"` (no trailing space: the
  first generated piece carries its own space).
- Text kinds and their messages (`PI052PolicyAdapter.build_messages`): subtask `[user task]`; memory
  `[user task, assistant "Previous memory: {m}"?, user "Completed subtask: {s}"?]`; interjection
  `[user task, assistant "Previous plan:\\n{plan}"?, user text?]` (empty parts left out).
- Actions, default recipe: `"User: {subtask}, State: {bins};\\n"` (task, memory and plan never reach it).
  Joint recipe (`joint_subtask_conditioning`): `"User: {task}, State: {bins};\\nAssistant:"` with the
  images, bidirectional (the subtask request's prompt too), then the subtask's tokens, causal, then EOS and
  `"\\n"` as one last block (`joint_tokens`: the exact ids and attention), so the prompt's K/V does not
  depend on the subtask.
- Generated text is decoded as transformers' Gemma tokenizer does (`decode_reply`); spoken turns are
  flattened to `<say>` markers (`speech_turn`).
- Greedy decoding, at most 128 new tokens, stop at EOS; the FAST action-code ids are always masked, the
  `<loc0000>`-`<loc1023>` ids (256000-257023) in all prose (`Pi052Format.masked_ranges`).
- Interjection replies: the first `<say>...</say>` is speech, the rest the plan (`split_plan_and_say`).
- Spatial answers (VQA recipe): `label <locY><locX>` (point) or `label <locY1><locX1><locY2><locX2>`
  (box), `;` between items; `parse_loc_answer` reads them into [0, 1] image coordinates.
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Literal, Protocol, Sequence

Message = tuple[str, str]          # (role "user" | "assistant", content)

ROLES = ("user", "assistant")
GENERATION_PROMPT = "Assistant:"
MAX_NEW_TOKENS = 128               # the branch's select_message default; no runtime caller changes it
LOC_IDS = (256000, 257024)         # PaliGemma's reserved <loc0000>..<loc1023> ids
FAST_ACTION_VOCAB_SIZE = 1024      # modeling_pi052._FAST_ACTION_VOCAB_SIZE at f2c8867
DEFAULT_FAST_SKIP_TOKENS = 1152    # PI052Config.fast_skip_tokens at f2c8867 (128 before 2026-07-19)


def subtask_messages(task: str) -> list[Message]:
    """The subtask request (also the branch's "plan" kind)."""
    return [("user", task)]


def memory_messages(task: str, memory: str, completed_subtask: str) -> list[Message]:
    """The progress-memory request, made when the subtask changed (`completed_subtask` is the previous one)."""
    messages = [("user", task)]
    if memory:
        messages.append(("assistant", f"Previous memory: {memory}"))
    if completed_subtask:
        messages.append(("user", f"Completed subtask: {completed_subtask}"))
    return messages


def interjection_messages(task: str, plan: str, text: str) -> list[Message]:
    """The operator's interjection; the reply is a plan and a `<say>` speech (`split_plan_and_say`)."""
    messages = [("user", task)]
    if plan:
        messages.append(("assistant", f"Previous plan:\n{plan}"))
    if text:
        messages.append(("user", text))
    return messages


def render(messages: Sequence[Message], generation_prompt: bool = True) -> str:
    """The prompt text of `messages` (`_format_messages`), with `"Assistant:"` appended for a text request."""
    parts = []
    for role, content in messages:
        if role not in ROLES:
            raise ValueError(f"pi052 message role must be one of {ROLES}, got {role!r}")
        if not isinstance(content, str):
            raise ValueError(f"pi052 message content must be a string, got {type(content).__name__}")
        parts.append(f"{role.capitalize()}: {content}\n")
    return "".join(parts) + (GENERATION_PROMPT if generation_prompt else "")


def state_text(normalized_state: Any) -> str:
    """The state as the prompt carries it (`discretize_state_str`): the normalised values, 256 bins over
    [-1, 1], joined by spaces (not clipped: below -1 gives -1, as upstream)."""
    import numpy as np  # numpy only where the state is formatted: the rest of the module is pure Python

    values = np.asarray(normalized_state, dtype=np.float64).reshape(-1)
    if not np.all(np.isfinite(values)):
        raise ValueError("pi052 state must be finite (NaN or inf in the normalised state)")
    bins = np.digitize(values, bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1
    return " ".join(str(int(b)) for b in bins)


def _with_state(content: str, state: str | None) -> str:
    return content if state is None else f"{content}, State: {state};"


def action_prompt(subtask: str, state: str | None) -> str:
    """The default recipe's action prompt: `"User: {subtask}, State: {bins};\\n"` (no state: `"User: {subtask}\\n"`)."""
    return render([("user", _with_state(subtask, state))], generation_prompt=False)


def joint_prompt(task: str, state: str | None) -> str:
    """The joint recipe's task turn, `"User: {task}, State: {bins};\\n"`: followed by `"Assistant:"`, the
    frame's bidirectional prompt (the subtask request, and the first of the actions' blocks: `joint_tokens`)."""
    return render([("user", _with_state(task, state))], generation_prompt=False)


def joint_request(messages: Sequence[Message]) -> str:
    """A text request of the joint recipe, forked from the frame's prompt, which holds the task's turn and the
    open `"Assistant:"` header (`joint_prompt(...) + GENERATION_PROMPT`): the messages after the task's turn
    rendered on from that header. A next assistant turn fills the header; a next user turn leaves it an empty
    assistant turn. The subtask request (the task's turn alone) is empty: its first token is the frame's."""
    rest = list(messages[1:])
    if not rest:
        return ""
    if rest[0][0] == "assistant":
        return f" {rest[0][1]}\n" + render(rest[1:])
    return "\n" + render(rest)


class _SentencePiece(Protocol):
    sp: Any            # a sentencepiece.SentencePieceProcessor (model.tokenizer.Tokenizer has one)
    bos_id: int
    eos_id: int

    def encode(self, text: str, bos: bool = False) -> list[int]: ...


@dataclass(frozen=True)
class JointPrompt:
    """The joint recipe's prompt tokens and their attention, as the branch's `encode_prompt_with_targets` and
    causal marks make them (`_apply_causal_language_marks` on openpi's cumulative attention blocks):
    `tokens[:bidir]` (BOS, `"User: {task}, State: ...;\\n"` and the span's `"Assistant:"`) attend to each other
    and to the images: the same tokens, so the same K/V, as the subtask request `joint_prompt(...) +
    "Assistant:"`, except when the subtask's first piece does not carry its leading space (a lone space piece
    then joins the bidirectional block, and the request's K/V is not the prompt's); the next `causal` tokens
    (the subtask's) attend causally, as decoded tokens do; the last `tail` tokens (EOS, then `"\\n"`) are one
    more block: they see each other, so EOS sees the newline after it (not a plain causal span)."""
    tokens: list[int]
    bidir: int
    causal: int
    tail: int


def joint_tokens(tokenizer: _SentencePiece, task: str, state: str | None, subtask: str) -> JointPrompt:
    """The joint recipe's action prompt for `subtask` (the decoded text, re-encoded as the branch does). The
    tokenizer call splits the text at the `<eos>` string: the text before it is encoded in one piece, then
    EOS, then `"\\n"`. A token is the subtask's when its bytes overlap the subtask's (the branch's
    offset-overlap rule): a piece joining the space after `"Assistant:"` to the first word is the subtask's."""
    head = joint_prompt(task, state) + "Assistant: "
    text = head + subtask
    ids = tokenizer.sp.encode(text)
    start, end = len(head.encode()), len(text.encode())
    marked, begin = [], 0
    for i in ids:               # each piece's bytes in the text (identity normalisation, byte fallback: no unk)
        size = 1 if tokenizer.sp.is_byte(i) else len(tokenizer.sp.id_to_piece(i).replace("\u2581", " ").encode())
        marked.append(not (begin + size <= start or begin >= end))
        begin += size
    if begin != end:
        raise ValueError(f"pi052 joint prompt: the tokenizer does not keep the text as is ({begin} != {end} bytes)")
    bidir = 1 + (marked.index(True) if True in marked else len(ids))
    newline = tokenizer.sp.encode("\n")
    return JointPrompt([tokenizer.bos_id] + ids + [tokenizer.eos_id] + newline, bidir, sum(marked), 1 + len(newline))


def speech_turn(content: str, speech: Sequence[str]) -> str:
    """An assistant turn that spoke, as the branch flattens its `say` tool calls (`_flatten_say_tool_calls`):
    the content stripped, a newline, then `<say>{text}</say>` per utterance (the markers alone when there is
    no content); unchanged when nothing was said. Empty utterances are dropped, as there."""
    said = "".join(f"<say>{text}</say>" for text in speech if text)
    if not said:
        return content
    base = content.strip()
    return f"{base}\n{said}" if base else said


def decode_reply(tokenizer: _SentencePiece, ids: Sequence[int]) -> str:
    """Generated ids to text as the branch decodes them (transformers' Gemma tokenizer,
    `decode(ids, skip_special_tokens=True).strip()`): control and unknown ids dropped, "\u2581" read as a
    space, each run of byte pieces read as UTF-8, or as one U+FFFD per byte when the run is not valid UTF-8
    (SentencePiece's own decode keeps the valid bytes of such a run: the two differ there)."""
    sp = tokenizer.sp
    out, run, run_pieces = [], bytearray(), 0

    def flush():
        nonlocal run_pieces
        if run_pieces:
            try:
                out.append(run.decode("utf-8"))
            except UnicodeDecodeError:
                out.append("\ufffd" * run_pieces)
            run.clear()
            run_pieces = 0

    for i in map(int, ids):
        if not 0 <= i < sp.get_piece_size() or sp.is_control(i) or sp.is_unknown(i):
            continue                      # special ids are skipped before the byte runs are read, as there
        if sp.is_byte(i):
            run.append(int(sp.id_to_piece(i)[3:-1], 16))     # "<0xAB>"
            run_pieces += 1
            continue
        flush()
        out.append(sp.id_to_piece(i).replace("\u2581", " "))
    flush()
    return "".join(out).strip()


def split_plan_and_say(text: str) -> tuple[str, str]:
    """`(plan, speech)` of an interjection reply: the first `<say>...</say>` is the speech (stripped of spaces
    and quotes), the rest, stripped, the plan (`runtime.adapter.split_plan_and_say`)."""
    if not text:
        return "", ""
    match = _SAY.search(text)
    if not match:
        return text.strip(), ""
    speech = match.group(1).strip().strip('"').strip("'")
    return (text[:match.start()] + text[match.end():]).strip(), speech


_SAY = re.compile(r"<\s*say\s*>(.*?)<\s*/\s*say\s*>", re.IGNORECASE | re.DOTALL)
_LOC = re.compile(r"<loc(\d{1,4})>")


@dataclass(frozen=True)
class Located:
    """One spatial answer item in [0, 1] image coordinates: a point (x, y) or a box (x1, y1, x2, y2)."""
    label: str
    kind: Literal["point", "box"]
    xy: tuple[float, ...]


def _loc_to_unit(index: int) -> float:
    return max(0.0, min(1023.0, float(index))) / 1023.0


def parse_loc_answer(text: str) -> list[Located]:
    """The located items of a `<locNNNN>` answer, as the branch's parser reads them (vqa.parse_loc_answer):
    `;`-separated items; the label is an item's text without its loc tokens (either order); two locs are a
    point (y, x), four or more a box (y1, x1, y2, x2; further locs ignored), other counts nothing; each index
    clamped to [0, 1023] and divided by 1023. When any box is present the points are dropped, as there.
    The one difference is the form: where the branch returns several bare points as zero-area boxes, they
    are returned here as points (the same coordinates). No `<loc` in the text: []."""
    if not text or "<loc" not in text:
        return []
    points: list[Located] = []
    boxes: list[Located] = []
    for item in text.split(";"):
        if "<loc" not in item:
            continue
        locs = [int(m) for m in _LOC.findall(item)]
        label = _LOC.sub("", item).strip()
        if len(locs) == 2:
            y, x = (_loc_to_unit(v) for v in locs)
            points.append(Located(label, "point", (x, y)))
        elif len(locs) >= 4:
            y1, x1, y2, x2 = (_loc_to_unit(v) for v in locs[:4])
            boxes.append(Located(label, "box", (x1, y1, x2, y2)))
    return boxes if boxes else points


@dataclass(frozen=True)
class Pi052Format:
    """How a pi052 checkpoint is prompted and decoded (read from its config.json: `from_config`)."""
    joint: bool                      # joint_subtask_conditioning: the joint recipe
    fast_skip_tokens: int            # where the FAST action codes sit at the top of the text vocabulary
    max_new_tokens: int = MAX_NEW_TOKENS
    memory: bool = True              # progress memory trained (the recipe has a memory turn)

    def __post_init__(self):
        if not isinstance(self.fast_skip_tokens, int) or isinstance(self.fast_skip_tokens, bool) \
                or self.fast_skip_tokens < 0:
            raise ValueError(f"pi052 fast_skip_tokens must be a non-negative integer, got {self.fast_skip_tokens!r}")
        if not isinstance(self.max_new_tokens, int) or isinstance(self.max_new_tokens, bool) \
                or self.max_new_tokens < 1:
            raise ValueError(f"pi052 max_new_tokens must be a positive integer, got {self.max_new_tokens!r}")

    def masked_ranges(self, vocab_size: int, allow_loc: bool) -> list[tuple[int, int]]:
        """Half-open id ranges set to -inf before the argmax (`select_message`): the FAST action codes
        `[V - fast_skip_tokens - 1024, 256000)` always (nothing when that start is not in (0, 256000), as
        there), the <loc> ids `[256000, 257024)` unless `allow_loc`; clipped to the vocabulary."""
        ranges = []
        fast_lo = vocab_size - 1 - self.fast_skip_tokens - (FAST_ACTION_VOCAB_SIZE - 1)
        if 0 < fast_lo < LOC_IDS[0]:
            ranges.append((fast_lo, min(LOC_IDS[0], vocab_size)))
        if not allow_loc and vocab_size > LOC_IDS[0]:
            ranges.append((LOC_IDS[0], min(LOC_IDS[1], vocab_size)))
        return ranges

    @classmethod
    def from_config(cls, config: dict) -> "Pi052Format":
        """The format of a pi052 checkpoint from its config.json (`type` "pi052"): `joint_subtask_conditioning`,
        `fast_skip_tokens` (default 1152, the branch's), and whether its recipe trains progress memory
        (`recipe_path` naming a `*_mem*` recipe, or an embedded `recipe` with a memory turn)."""
        if not isinstance(config, dict):
            raise ValueError(f"pi052 config must be a JSON object, got {type(config).__name__}")
        if config.get("type", "pi052") != "pi052":
            raise ValueError(f"not a pi052 config: type {config.get('type')!r}")
        if config.get("memory_scratchpad"):
            raise ValueError("pi052 config: memory_scratchpad checkpoints (one Memory/Subtask reply) are not "
                             "supported")
        joint = config.get("joint_subtask_conditioning", False)
        if not isinstance(joint, bool):
            raise ValueError(f"pi052 config: joint_subtask_conditioning must be true or false, got {joint!r}")
        return cls(joint=joint, fast_skip_tokens=config.get("fast_skip_tokens", DEFAULT_FAST_SKIP_TOKENS),
                   memory=_recipe_has_memory(config))


def _recipe_has_memory(config: dict) -> bool:
    recipe = config.get("recipe")
    if isinstance(recipe, dict):
        return "Previous memory" in str(recipe) or "memory_update" in str(recipe)
    path = config.get("recipe_path", "recipes/subtask_mem.yaml")   # the branch's default recipe
    if path is None:
        return False
    if not isinstance(path, str):
        raise ValueError(f"pi052 config: recipe_path must be a string, got {path!r}")
    return "_mem" in path.rsplit("/", 1)[-1]


def checkpoint_format(config: dict) -> Pi052Format | None:
    """The language format of a LeRobot checkpoint's config.json: a Pi052Format for `"type": "pi052"`, None for
    any other type (a pi05 has no trained text). ValueError when a pi052 config's fields are wrong."""
    return Pi052Format.from_config(config) if isinstance(config, dict) and config.get("type") == "pi052" else None
