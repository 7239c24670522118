"""scripts/measure_checkpoint_load.py on the tiny preset: it writes a LeRobot-layout checkpoint, loads it as
configure does and runs the engine's first cycle; the figures it reports are of one run (docs/robots.md)."""
from __future__ import annotations

import json
import subprocess
import sys

from conftest import REPO

SCRIPT = REPO / "scripts" / "measure_checkpoint_load.py"


def run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(SCRIPT), *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600)


def test_the_load_is_measured_to_the_first_chunk(tmp_path):
    folder = tmp_path / "tiny"
    written = run("write", str(folder), "--preset", "tiny", "--dtype", "float32")
    assert written.returncode == 0, written.stderr
    loaded = run("load", str(folder), "--preset", "tiny", "--dtype", "float32")
    assert loaded.returncode == 0, loaded.stderr
    figures = json.loads(loaded.stdout.strip().splitlines()[-1])
    assert (figures["preset"], figures["dtype"], figures["file_bytes"]) == \
        ("tiny", "float32", (folder / "model.safetensors").stat().st_size)
    assert figures["action_horizon"] == 50                  # config.json's chunk_size, as configure reads it
    # One clock from the start: the first chunk comes after the load and the first cycle (and the engine's
    # construction between them).
    assert figures["first_chunk_s"] >= figures["load_s"] + figures["first_cycle_s"] - 0.02
    assert 0 < figures["peak_rss_after_load_bytes"] <= figures["peak_rss_after_first_chunk_bytes"] \
        <= figures["peak_rss_bytes"]
