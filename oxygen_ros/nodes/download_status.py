"""What the engine node's /diagnostics says about the checkpoint, tokenizer and norm statistics it fetches.

The fetches run inside configure, which blocks the executor that would run the node's diagnostics timer (the
lifecycle services and the timer share the node's callback group; oxygen_bringup even configures before any
executor spins). So the download's own progress thread (model/download.py, `watch`) updates a Downloads and
the node publishes from there; this module is the plain-Python part: one status per fetched name, kept after
the fetch (its final state) until the next configure.

    downloading lerobot/pi05_base: 3.2 GB of 14.5 GB (22%), 41.0 MB/s, ETA 5 min       OK
    downloading lerobot/pi05_base: no data for 45 s (3.2 GB of 14.5 GB)                  WARN
    downloaded lerobot/pi05_base: 14.5 GB in 6 min (41.0 MB/s)                             OK
"""
from __future__ import annotations

import threading

from diagnostic_msgs.msg import DiagnosticStatus

from oxygen_ros.model.download import DownloadState, duration
from oxygen_ros.progress import human_bytes

STALLED_S = 30.0        # no byte for this long: WARN (huggingface_hub's own read timeout is 10 s per attempt)


def report(state: DownloadState, stalled_s: float = STALLED_S) -> tuple[bytes, str, dict]:
    """A fetch's diagnostic level, message and key-values."""
    name = state.name
    level = DiagnosticStatus.OK
    sizes = f"{human_bytes(state.done)} of {human_bytes(state.total)}"
    if state.phase == "downloading":
        if state.idle_s >= stalled_s:
            level, message = DiagnosticStatus.WARN, f"downloading {name}: no data for {state.idle_s:.0f} s ({sizes})"
        else:
            share = f" ({100 * state.done / state.total:.0f}%)" if state.total else ""
            eta = f", ETA {duration(state.left_s)}" if state.left_s is not None else ""
            message = f"downloading {name}: {sizes}{share}, {human_bytes(state.bytes_per_s)}/s{eta}"
    elif state.phase == "verifying":
        message = f"verifying {name}: {human_bytes(state.total)} downloaded, checking sizes and hashes"
    elif state.phase == "done":
        message = (f"downloaded {name}: {human_bytes(state.total)} in {duration(state.elapsed_s)} "
                   f"({human_bytes(state.bytes_per_s)}/s)")
    elif state.phase == "cached":
        message = f"{name}: in the cache, nothing to download"
    else:
        level, message = DiagnosticStatus.ERROR, state.error or f"downloading {name} failed"
    left = state.left_s if state.phase == "downloading" else None
    values = {"name": name, "phase": state.phase, "bytes_done": state.done, "bytes_total": state.total,
              "bytes_per_s": round(state.bytes_per_s), "elapsed_s": state.elapsed_s,
              "seconds_left": "" if left is None else round(left), "seconds_without_data": state.idle_s}
    return level, message, values


class Downloads:
    """The fetches of one configure, by the name of their diagnostic status (`oxygen_ros: checkpoint
    download`). Written from the download's progress thread, read by whoever publishes: thread-safe."""

    def __init__(self):
        self._lock = threading.Lock()
        self._states: dict[str, DownloadState] = {}

    def update(self, status_name: str, state: DownloadState) -> None:
        with self._lock:
            self._states[status_name] = state

    def clear(self) -> None:
        with self._lock:
            self._states.clear()

    def reports(self) -> list[tuple[str, bytes, str, dict]]:
        """(status name, level, message, values) of each fetch, in the order they began."""
        with self._lock:
            states = list(self._states.items())
        return [(name, *report(state)) for name, state in states]
