"""SentencePiece tokenizer and the π0.5 prompt format.

Real checkpoints use PaliGemma's tokenizer (`paligemma_tokenizer.model`, 257152 pieces; pad 0, eos 1,
bos 2), loaded from a path the user gives. The `tiny` and `bench` presets use a small tokenizer shipped in
assets/ (trained from assets/tiny_corpus.txt with the same special ids; `python -m
oxygen_ros.model.tokenizer --train` rebuilds it).

Prompt formats (openpi `PaligemmaTokenizer.tokenize`):
- discrete state (π0.5 default): BOS + "Task: <task>, State: <s_0 s_1 ...>;\\nAction: " where s_i is the
  normalised state discretised into 256 bins over [-1, 1];
- no state in the prompt (π0.5 LIBERO): BOS + "<task>" + "\\n".
The task text is stripped, with "_" and newlines turned into spaces. A prompt longer than max_len is
truncated and the truncation is reported (`Prompt.truncated`), never silent.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from importlib import resources
from pathlib import Path

import numpy as np
import sentencepiece as spm

from .files import MAX_TOKENIZER_BYTES, CheckpointError, read_bytes

TINY_TOKENIZER = "tiny_tokenizer.model"


@dataclass(frozen=True)
class Prompt:
    tokens: list[int]
    truncated: int  # how many tokens were cut off the end (0 = none)


def discretize_state(state: np.ndarray) -> np.ndarray:
    """openpi's 256-bin discretisation of a normalised state (values outside [-1, 1] are not clipped,
    exactly as upstream)."""
    return np.digitize(np.asarray(state, dtype=np.float64), bins=np.linspace(-1, 1, 256 + 1)[:-1]) - 1


class Tokenizer:
    def __init__(self, model_file: str | Path):
        path = Path(model_file)
        # Read here, bounded (a CheckpointError naming it: missing, a folder, a FIFO, too large), and handed to
        # sentencepiece as bytes: it never opens the file itself. A SentencePiece model is a protobuf:
        # parsing it executes nothing.
        proto = read_bytes(path, MAX_TOKENIZER_BYTES)
        try:
            self.sp = spm.SentencePieceProcessor(model_proto=proto)
        except (RuntimeError, OSError) as e:  # sentencepiece reports a bad protobuf as RuntimeError
            raise CheckpointError(f"{path}: not a SentencePiece model ({e})") from None
        self.path = path
        self.bos_id, self.eos_id, self.pad_id = self.sp.bos_id(), self.sp.eos_id(), self.sp.pad_id()

    @classmethod
    def tiny(cls) -> "Tokenizer":
        return cls(resources.files("oxygen_ros.model") / "assets" / TINY_TOKENIZER)

    @property
    def vocab_size(self) -> int:
        return self.sp.get_piece_size()

    def encode(self, text: str, bos: bool = False) -> list[int]:
        return ([self.bos_id] if bos else []) + self.sp.encode(text)

    def decode(self, tokens: list[int]) -> str:
        return self.sp.decode([t for t in tokens if 0 <= t < self.vocab_size])

    def action_prompt(self, task: str, state: np.ndarray | None, max_len: int) -> Prompt:
        """The prefix prompt of a frame. `state` (already normalised) goes into the text when given."""
        cleaned = task.strip().replace("_", " ").replace("\n", " ")
        if state is not None:
            state_str = " ".join(map(str, discretize_state(state)))
            tokens = self.encode(f"Task: {cleaned}, State: {state_str};\nAction: ", bos=True)
        else:
            tokens = self.encode(cleaned, bos=True) + self.encode("\n")
        return Prompt(tokens[:max_len], max(0, len(tokens) - max_len))


def train_tiny(out_dir: Path, corpus: Path, vocab_size: int = 1000) -> Path:
    """Train the shipped small tokenizer (PaliGemma's special ids; byte fallback so any text encodes)."""
    out_dir = Path(out_dir).resolve()
    prefix = out_dir / TINY_TOKENIZER.removesuffix(".model")
    # The model file records the trainer's input and output paths: train from inside the output folder
    # with relative paths so the file is byte-for-byte reproducible wherever the repo lives.
    corpus_data = Path(corpus).read_bytes()
    corpus_name = "tiny_corpus.txt"
    cwd = os.getcwd()
    os.chdir(out_dir)
    try:
        if not (out_dir / corpus_name).exists() or (out_dir / corpus_name).read_bytes() != corpus_data:
            (out_dir / corpus_name).write_bytes(corpus_data)
        _train(corpus_name, prefix.name, vocab_size)
    finally:
        os.chdir(cwd)
    prefix.with_suffix(".vocab").unlink(missing_ok=True)
    return prefix.with_suffix(".model")


def _train(corpus: str, prefix: str, vocab_size: int) -> None:
    spm.SentencePieceTrainer.train(
        input=corpus, model_prefix=prefix, vocab_size=vocab_size, model_type="bpe",
        pad_id=0, eos_id=1, bos_id=2, unk_id=3, byte_fallback=True, character_coverage=1.0,
        split_digits=True, num_threads=1, minloglevel=2,
        # Keep "\n" as a token (the prompt format ends its state with ";\nAction: ") and the text as is.
        normalization_rule_name="identity", remove_extra_whitespaces=False, user_defined_symbols=["\n"],
        # Like Gemma's tokenizer: no space prepended to the text ("\n" encodes as the one token "\n").
        add_dummy_prefix=False)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Rebuild the shipped tiny tokenizer from its corpus.")
    parser.add_argument("--train", action="store_true", help="train assets/tiny_tokenizer.model")
    args = parser.parse_args(argv)
    if args.train:
        assets = Path(__file__).parent / "assets"
        print(train_tiny(assets, assets / "tiny_corpus.txt"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
