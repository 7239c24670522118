"""Reading a checkpoint's files defensively: weights, config.json, statistics, processor configs, tokenizer.

Every problem is a `CheckpointError` whose message starts with the file's path, names the key when a value
is wrong, and says what is wrong, on one line.

- Only regular files are opened (a symlink to one is fine): opening a FIFO for reading blocks until a writer
  comes, so a FIFO named norm_stats.json would hang the start with no message. `read_bytes` opens without
  blocking and checks the opened file itself; `regular_file` checks a path handed to a library that opens it.
- JSON files are bounded in size (a checkpoint's are a few kB) and in nesting (the parser's recursion limit,
  reported as bad JSON), and decoded as UTF-8.
- `JsonObject` reads typed values: absent or null is "not given"; a value of the wrong type, a boolean where
  a number is needed, a non-integer, NaN, or a number outside its bounds is an error naming the key.
"""
from __future__ import annotations

import json
import math
import os
import stat
from pathlib import Path
from typing import Any

MAX_JSON_BYTES = 16 << 20
# A SentencePiece model: PaliGemma's (257,152 pieces) is 4.3 MB, the largest public ones (Gemma 3, 262k
# pieces) under 5 MB; 32 MiB leaves room for any real one and refuses a huge file before sentencepiece,
# which reads any size whole (a sparse 2 GiB file ends the process with SIGSEGV), is handed it.
MAX_TOKENIZER_BYTES = 32 << 20
LEROBOT_PREPROCESSOR = "policy_preprocessor.json"
LEROBOT_POSTPROCESSOR = "policy_postprocessor.json"


class CheckpointError(ValueError):
    """A checkpoint, statistics or tokenizer file that cannot be used: the message names the file."""


def _kind(mode: int) -> str | None:
    """What a file that is not a regular file is (None for a regular file)."""
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISFIFO(mode):
        return "a FIFO"
    if stat.S_ISSOCK(mode):
        return "a socket"
    if stat.S_ISCHR(mode) or stat.S_ISBLK(mode):
        return "a device"
    return "not a plain file"


def present(path: str | Path) -> bool:
    """Whether anything is at `path` (a broken link too: reading it then says so)."""
    return os.path.lexists(path)


def regular_file(path: str | Path) -> Path:
    """`path`, when it is a regular file; a CheckpointError naming it otherwise. Stat only: opens nothing."""
    path = Path(path)
    try:
        mode = os.stat(path).st_mode
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found" + (" (a broken link)" if os.path.islink(path) else "")) from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror})") from None
    kind = _kind(mode)
    if kind:
        raise CheckpointError(f"{path}: is {kind}, not a regular file")
    return path


def read_bytes(path: str | Path, limit: int) -> bytes:
    """The content of the regular file `path`, at most `limit` bytes (a larger file is an error)."""
    path = Path(path)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)   # a FIFO opens without a writer
    except FileNotFoundError:
        raise CheckpointError(f"{path}: not found") from None
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror})") from None
    try:
        st = os.fstat(fd)
        kind = _kind(st.st_mode)
        if kind:
            raise CheckpointError(f"{path}: is {kind}, not a regular file")
        if st.st_size > limit:
            raise CheckpointError(f"{path}: {st.st_size} bytes, more than the {limit} such a file may have")
        with os.fdopen(fd, "rb", closefd=False) as f:
            data = f.read(limit + 1)
    except OSError as e:
        raise CheckpointError(f"{path}: cannot be read ({e.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > limit:                       # grew since fstat
        raise CheckpointError(f"{path}: more than the {limit} bytes such a file may have")
    return data


def read_json(path: str | Path) -> Any:
    """The JSON value in the file `path` (UTF-8, at most MAX_JSON_BYTES)."""
    data = read_bytes(path, MAX_JSON_BYTES)
    try:
        return json.loads(data.decode("utf-8"))
    except (ValueError, RecursionError) as e:   # JSONDecodeError, UnicodeDecodeError; nesting too deep
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def json_type(value: Any) -> str:
    """A JSON value's type in JSON's words (what an error says it got)."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "a boolean"
    if isinstance(value, (int, float)):
        return "a number"
    if isinstance(value, str):
        return "a string"
    if isinstance(value, list):
        return "a list"
    return "an object"


class JsonObject:
    """A JSON object from `file` and typed reads of its keys. `where` is the object's place in the file
    (`input_features.observation.state.`), so that an error names the key as the file spells it."""

    def __init__(self, data: dict, file: Path, where: str = ""):
        self.data, self.file, self.where = data, Path(file), where

    @classmethod
    def load(cls, path: str | Path) -> "JsonObject":
        data = read_json(path)
        if not isinstance(data, dict):
            raise CheckpointError(f"{path}: must hold a JSON object, got {json_type(data)}")
        return cls(data, Path(path))

    def error(self, key: str, what: str) -> CheckpointError:
        return CheckpointError(f"{self.file}: {self.where}{key} {what}")

    def given(self, key: str) -> bool:
        return self.data.get(key) is not None

    def raw(self, key: str) -> Any:
        return self.data.get(key)

    def keys(self) -> list[str]:
        return list(self.data)

    def object(self, key: str) -> "JsonObject | None":
        value = self.data.get(key)
        if value is None:
            return None
        if not isinstance(value, dict):
            raise self.error(key, f"must be an object, got {json_type(value)}")
        return JsonObject(value, self.file, f"{self.where}{key}.")

    def objects(self, key: str) -> list["JsonObject"] | None:
        """A list of objects."""
        value = self.data.get(key)
        if value is None:
            return None
        if not isinstance(value, list) or not all(isinstance(v, dict) for v in value):
            raise self.error(key, f"must be a list of objects, got {_shown(value)}")
        return [JsonObject(v, self.file, f"{self.where}{key}[{i}].") for i, v in enumerate(value)]

    def string(self, key: str) -> str | None:
        value = self.data.get(key)
        if value is not None and not isinstance(value, str):
            raise self.error(key, f"must be a string, got {_shown(value)}")
        return value

    def strings(self, key: str) -> list[str] | None:
        value = self.data.get(key)
        if value is not None and not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            raise self.error(key, f"must be a list of strings, got {_shown(value)}")
        return value

    def boolean(self, key: str) -> bool | None:
        value = self.data.get(key)
        if value is not None and not isinstance(value, bool):
            raise self.error(key, f"must be true or false, got {_shown(value)}")
        return value

    def integer(self, key: str, minimum: int, maximum: int) -> int | None:
        value = self.data.get(key)
        if value is not None and not _integer_within(value, minimum, maximum):
            raise self.error(key, f"must be an integer in [{minimum}, {maximum}], got {_shown(value)}")
        return value

    def integers(self, key: str, length: int, minimum: int, maximum: int) -> list[int] | None:
        """A list of `length` integers, each in [minimum, maximum]."""
        value = self.data.get(key)
        if value is not None and not (isinstance(value, list) and len(value) == length
                                      and all(_integer_within(v, minimum, maximum) for v in value)):
            raise self.error(key, f"must be a list of {length} integer(s) in [{minimum}, {maximum}], "
                                  f"got {_shown(value)}")
        return value

    def number(self, key: str, minimum: float, maximum: float) -> float | None:
        value = self.data.get(key)
        if value is not None and not (isinstance(value, (int, float)) and not isinstance(value, bool)
                                      and math.isfinite(value) and minimum <= value <= maximum):
            raise self.error(key, f"must be a number in [{minimum:g}, {maximum:g}], got {_shown(value)}")
        return value

    def numbers(self, key: str) -> list[float] | None:
        """A non-empty list of finite numbers."""
        value = self.data.get(key)
        if value is not None and not (isinstance(value, list) and value and all(
                isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in value)):
            raise self.error(key, f"must be a non-empty list of finite numbers, got {_shown(value)}")
        return value


def is_file_name(name: Any) -> bool:
    """A bare file name (never `../`, a folder or an absolute path): what a checkpoint may name beside itself."""
    return isinstance(name, str) and name not in ("", ".", "..") and Path(name).name == name and "\\" not in name


def processor_steps(pipeline: str | Path, registry_name: str) -> list[JsonObject]:
    """The steps named `registry_name` of a LeRobot processor config (policy_preprocessor.json, ...)."""
    steps = JsonObject.load(pipeline).objects("steps")
    if steps is None:
        raise CheckpointError(f"{pipeline}: has no steps list (not a LeRobot processor config)")
    return [step for step in steps if step.string("registry_name") == registry_name]


def _integer_within(value: Any, minimum: int, maximum: int) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and minimum <= value <= maximum


def _shown(value: Any, limit: int = 60) -> str:
    """A value as an error quotes it, cut to `limit` characters (a hostile file's value may be huge)."""
    try:
        text = repr(value)
    except RecursionError:
        text = json_type(value)
    return text if len(text) <= limit else text[:limit] + "..."
