"""Progress a person can see on long work (model loading, CUDA graph capture, replay...).

    with LongTask("loading model tiny (12.3 MB) on cpu", log.info):
        build()

prints `loading model ... ` at once, `... still loading model ... (10 s)` every `every_s` while the work
runs (from a small thread: the work itself need not cooperate), and `... done in 3.2 s` or `... failed
after 3.2 s: <error>` at the end.
"""
from __future__ import annotations

import os
import threading
import time
from pathlib import Path
from typing import Callable


def size_of(path: str | os.PathLike | None) -> int:
    """Bytes of a file, or of every file under a directory (0 when there is nothing)."""
    if not path:
        return 0
    p = Path(path)
    if p.is_file():
        return p.stat().st_size
    if p.is_dir():
        return sum(f.stat().st_size for f in p.rglob("*") if f.is_file())
    return 0


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1000 or unit == "GB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


class LongTask:
    def __init__(self, what: str, say: Callable[[str], None] = print, every_s: float = 5.0):
        self.what, self.say, self.every_s = what, say, every_s
        self._done = threading.Event()
        self._start = 0.0
        self.elapsed_s = 0.0

    def __enter__(self) -> LongTask:
        self._start = time.monotonic()
        self.say(f"{self.what} ...")
        threading.Thread(target=self._heartbeat, name="progress", daemon=True).start()
        return self

    def _heartbeat(self) -> None:
        while not self._done.wait(self.every_s):
            self.say(f"... still {self.what} ({time.monotonic() - self._start:.0f} s)")

    def __exit__(self, exc_type, exc, tb) -> None:
        self._done.set()
        self.elapsed_s = time.monotonic() - self._start
        if exc is None:
            self.say(f"{self.what}: done in {self.elapsed_s:.1f} s")
        else:
            self.say(f"{self.what}: failed after {self.elapsed_s:.1f} s: {exc}")
