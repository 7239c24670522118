"""Progress on long work: a start line, a heartbeat while it runs, the time it took or why it failed."""
import threading
import time

import pytest

from oxygen_ros.progress import LongTask, human_bytes, size_of


def test_long_work_says_it_started_is_still_running_and_finished():
    lines = []
    with LongTask("loading model x (1.2 GB) on cpu", lines.append, every_s=0.05) as task:
        time.sleep(0.3)
    assert lines[0] == "loading model x (1.2 GB) on cpu ..."
    assert any(line.startswith("... still loading model x (1.2 GB) on cpu (") for line in lines[1:-1])
    assert lines[-1] == f"loading model x (1.2 GB) on cpu: done in {task.elapsed_s:.1f} s"
    assert task.elapsed_s >= 0.3


def test_failed_work_says_why_and_the_heartbeat_stops():
    lines = []
    with pytest.raises(ValueError):
        with LongTask("loading", lines.append, every_s=0.05):
            raise ValueError("corrupt header")
    assert lines[-1].startswith("loading: failed after ") and lines[-1].endswith("s: corrupt header")
    count = len(lines)
    time.sleep(0.2)
    assert len(lines) == count and not [t for t in threading.enumerate() if t.name == "progress" and t.is_alive()]


def test_sizes(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 1500)
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "b").write_bytes(b"x" * 500)
    assert size_of(tmp_path / "a") == 1500 and size_of(tmp_path) == 2000 and size_of("") == 0
    assert human_bytes(2000) == "2.0 KB" and human_bytes(999) == "999 B" and human_bytes(3.2e9) == "3.2 GB"
