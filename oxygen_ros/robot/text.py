"""Prompts and questions from outside -> clean text for the tokenizer, or a precise InputError."""

from __future__ import annotations

import re

from .errors import ConfigError, TextError

# Unicode category Cc without \t (0x09) and \n (0x0a): C0 controls, DEL and C1 controls.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
# Lone surrogates: what undecodable bytes become in a str (Python's surrogateescape, some middlewares).
_SURROGATE = re.compile("[\ud800-\udfff]")
# Raw text may carry whitespace and control characters that cleaning removes, but not without bound: a
# payload longer than this many times the limit is refused before it is decoded or scanned.
RAW_FACTOR = 4


def validate_text(text: str | bytes, *, what: str, max_chars: int) -> str:
    """Decode, drop control characters (keeping newline and tab), strip, and check the length.

    `what` names the text in error messages ("question", "prompt"); max_chars counts code points
    after cleaning.
    """
    if max_chars <= 0:
        raise ConfigError(f"max_chars {max_chars} for {what} must be positive")
    if isinstance(text, (str, bytes, bytearray, memoryview)) and len(text) > RAW_FACTOR * max_chars:
        raise TextError(f"{what} has {len(text)} characters before cleaning, more than {RAW_FACTOR} x the limit "
                        f"of {max_chars}")
    if isinstance(text, (bytes, bytearray, memoryview)):
        try:
            text = bytes(text).decode("utf-8")
        except UnicodeDecodeError as e:
            raise TextError(f"{what} is not valid UTF-8 at byte {e.start}") from e
    elif isinstance(text, str):
        bad = _SURROGATE.search(text)
        if bad:
            # Everything before the first surrogate is valid, so its UTF-8 length is the byte offset.
            offset = len(text[: bad.start()].encode("utf-8"))
            raise TextError(f"{what} is not valid UTF-8 at byte {offset}")
    else:
        raise TextError(f"{what} must be text, got {type(text).__name__}")
    text = _CONTROL.sub("", text).strip()
    if not text:
        raise TextError(f"{what} is empty")
    if len(text) > max_chars:
        raise TextError(f"{what} has {len(text)} characters, the limit is {max_chars}")
    return text
