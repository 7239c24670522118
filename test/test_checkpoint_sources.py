"""Checkpoints named as their communities name them (model/download.py), without network: a hub id through
huggingface_hub's own code against a hub API served on 127.0.0.1 (HF_ENDPOINT), a gs:// URL through fsspec
against a local folder registered as the `gs` filesystem, and every refusal in one line."""
from __future__ import annotations

import contextlib
import hashlib
import http.server
import json
import os
import shutil
import subprocess
import sys
import threading
import urllib.parse
from dataclasses import replace
from pathlib import Path

import fsspec
import pytest
from fsspec.implementations.local import LocalFileSystem
from fsspec.registry import _registry

from oxygen_ros.model import download
from oxygen_ros.model.config import GemmaConfig, Pi05Config, VisionConfig
from oxygen_ros.model.download import (NORM_STATS, CheckpointName, is_remote, parse_name, progress_line,
                                      resolve_checkpoint)
from oxygen_ros.model.files import CheckpointError

DATA = Path(__file__).parent / "data"
LEROBOT = DATA / "lerobot_model"       # a tiny LeRobot pi05 folder (model, config, processors, reference)
LEROBOT_CONFIG = Pi05Config(
    vlm=GemmaConfig(width=64, depth=2, mlp_dim=128, num_heads=4, num_kv_heads=1, head_dim=16),
    expert=GemmaConfig(width=32, depth=2, mlp_dim=64, num_heads=4, num_kv_heads=1, head_dim=16),
    vision=VisionConfig(width=32, depth=1, mlp_dim=64, num_heads=2, image_size=56),
    vocab_size=1000, action_dim=32, action_horizon=10, max_token_len=48, num_denoise_steps=10)
COMMIT = "a" * 40
OTHER_COMMIT = "b" * 40


class FakeHub:
    """The part of the hub's HTTP API huggingface_hub's snapshot_download and model_info use: repo info with
    file metadata, the recursive tree, and files under /resolve/ (HEAD, GET, Range). Repos are folders;
    `gated` answer 403 GatedRepo, unknown ones 404 RepoNotFound, unknown revisions 404 RevisionNotFound.
    `damage` serves a file with other bytes than its listed hash (same size); `hold`: file -> an Event its GET
    waits for before it is answered (a download still running)."""

    def __init__(self, repos: dict[str, Path], gated=(), damage=(), hold=None):
        self.repos, self.gated, self.damage, self.hold = repos, set(gated), set(damage), dict(hold or {})
        self.revisions = {"main": COMMIT, COMMIT: COMMIT, "v1": OTHER_COMMIT, OTHER_COMMIT: OTHER_COMMIT}
        self.downloads: list[str] = []
        hub = self

        class Handler(http.server.BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_HEAD(self):
                hub.answer(self, body=False)

            def do_GET(self):
                hub.answer(self, body=True)

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()

    def files(self, repo: str) -> dict[str, Path]:
        root = self.repos[repo]
        return {str(p.relative_to(root)): p for p in sorted(root.rglob("*")) if p.is_file()}

    def content(self, repo: str, name: str) -> bytes:
        data = self.files(repo)[name].read_bytes()
        if name in self.damage:
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        return data

    def entry(self, repo: str, name: str) -> dict:
        data = self.files(repo)[name].read_bytes()         # the listing holds the true hash
        return {"size": len(data), "sha256": hashlib.sha256(data).hexdigest(),
                "blob": hashlib.sha1(data).hexdigest()}

    def error(self, handler, status: int, code: str):
        handler.send_response(status)
        handler.send_header("X-Error-Code", code)
        handler.send_header("Content-Length", "0")
        handler.end_headers()

    def answer(self, handler, body: bool):
        url = urllib.parse.urlparse(handler.path)
        parts = url.path.strip("/").split("/")
        api = parts[0] == "api"
        if api:
            parts = parts[2:]                        # api/models/<org>/<name>/...
        repo = "/".join(parts[:2])
        if api and len(parts) == 2:
            parts += ["revision", "main"]            # the repo's info at its default branch
        if repo in self.gated:
            return self.error(handler, 403, "GatedRepo")
        if repo not in self.repos:
            return self.error(handler, 404, "RepoNotFound")
        kind, revision, rest = parts[2], urllib.parse.unquote(parts[3]), "/".join(parts[4:])
        if revision not in self.revisions:
            return self.error(handler, 404, "RevisionNotFound")
        commit = self.revisions[revision]
        if api and kind == "revision":
            siblings = [{"rfilename": n, "size": e["size"], "blobId": e["blob"],
                         "lfs": {"sha256": e["sha256"], "size": e["size"], "pointerSize": 130}}
                        for n in self.files(repo) for e in [self.entry(repo, n)]]
            return self.json(handler, {"id": repo, "modelId": repo, "sha": commit, "private": False,
                                       "siblings": siblings})
        if api and kind == "tree":
            tree = [{"type": "file", "path": n, "size": e["size"], "oid": e["blob"],
                     "lfs": {"oid": e["sha256"], "size": e["size"], "pointerSize": 130}}
                    for n in self.files(repo) for e in [self.entry(repo, n)]]
            return self.json(handler, tree)
        if kind != "resolve" or rest not in self.files(repo):
            return self.error(handler, 404, "EntryNotFound")
        if body and rest in self.hold:
            self.hold[rest].wait(60)
        data = self.content(repo, rest)
        start = 0
        if handler.headers.get("Range", "").startswith("bytes="):
            start = int(handler.headers["Range"][6:].split("-")[0])
        handler.send_response(206 if start else 200)
        handler.send_header("X-Repo-Commit", commit)
        handler.send_header("ETag", f'"{self.entry(repo, rest)["sha256"]}"')
        handler.send_header("Content-Length", str(len(data) - start))
        handler.end_headers()
        if body:
            self.downloads.append(rest)
            handler.wfile.write(data[start:])

    def json(self, handler, value):
        data = json.dumps(value).encode()
        handler.send_response(200)
        handler.send_header("Content-Type", "application/json")
        handler.send_header("Content-Length", str(len(data)))
        handler.end_headers()
        handler.wfile.write(data)


@pytest.fixture
def hub_repo(tmp_path):
    repo = tmp_path / "repo"
    shutil.copytree(LEROBOT, repo)
    (repo / "README.md").write_text("a model card\n")
    return repo


@pytest.fixture
def hub(hub_repo):
    fake = FakeHub({"someone/pi05_tiny": hub_repo, "lerobot/gated_pi05": hub_repo})
    fake.gated.add("lerobot/gated_pi05")
    yield fake
    fake.close()


def test_names_parse_as_their_communities_write_them(tmp_path):
    assert parse_name("lerobot/pi05_base") == CheckpointName("hub", "lerobot/pi05_base")
    assert parse_name("someone/pi05_so101@v1.0") == CheckpointName("hub", "someone/pi05_so101", "v1.0")
    assert parse_name("gs://openpi-assets/checkpoints/pi05_droid/") == \
        CheckpointName("bucket", "gs://openpi-assets/checkpoints/pi05_droid")
    assert parse_name("/models/pi05_droid_pytorch").kind == "local"
    assert parse_name("file:///models/x") == CheckpointName("local", "/models/x")
    local = tmp_path / "org" / "name"
    local.mkdir(parents=True)
    os.chdir(tmp_path)
    assert parse_name("org/name").kind == "local"           # a folder of that name wins, as in LeRobot
    assert not is_remote(str(local)) and is_remote("org/other")
    with pytest.raises(CheckpointError, match="gs://<bucket>/<path>"):
        parse_name("gs://openpi-assets")


def test_a_hub_id_is_fetched_once_with_only_the_loaders_files_and_verified(hub, tmp_path):
    cache, said = tmp_path / "hf", []
    folder = resolve_checkpoint("someone/pi05_tiny", said.append, hub_cache=cache, endpoint=hub.endpoint)
    assert folder == cache / "models--someone--pi05_tiny" / "snapshots" / COMMIT
    wanted = sorted(p.name for p in LEROBOT.iterdir() if p.name != "reference.npz")
    assert sorted(p.name for p in folder.iterdir()) == wanted          # no README, no reference.npz
    for name in wanted:
        assert (folder / name).read_bytes() == (LEROBOT / name).read_bytes()
    assert set(hub.downloads) <= set(wanted)           # (the two processors' equal statistics: one blob)
    assert any("downloading 6 file(s)" in line for line in said)
    # Again: nothing downloaded, the same folder.
    hub.downloads.clear()
    assert resolve_checkpoint("someone/pi05_tiny", said.append, hub_cache=cache, endpoint=hub.endpoint) == folder
    assert hub.downloads == []


def test_a_revision_is_fetched_at_its_commit(hub, tmp_path):
    folder = resolve_checkpoint("someone/pi05_tiny@v1", hub_cache=tmp_path, endpoint=hub.endpoint)
    assert folder.name == OTHER_COMMIT
    assert (tmp_path / "models--someone--pi05_tiny" / "refs" / "v1").read_text() == OTHER_COMMIT


def test_a_fetched_checkpoint_serves_like_the_local_folder(hub, tmp_path):
    import torch

    from oxygen_ros.model.checkpoint import load_pi05

    folder = resolve_checkpoint("someone/pi05_tiny", hub_cache=tmp_path, endpoint=hub.endpoint)
    a, b = load_pi05(LEROBOT, LEROBOT_CONFIG), load_pi05(folder, LEROBOT_CONFIG)
    for (name, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(pa, pb), name


@pytest.mark.parametrize("name, message", [
    ("nobody/nothing", "no such repo on the hub"),
    ("lerobot/gated_pi05", "a gated repo on the hub: accept its terms"),
    ("someone/pi05_tiny@v9", "revision 'v9' not found in someone/pi05_tiny"),
])
def test_hub_refusals_are_one_line(hub, tmp_path, name, message):
    with pytest.raises(CheckpointError, match=message) as e:
        resolve_checkpoint(name, hub_cache=tmp_path, endpoint=hub.endpoint)
    assert "\n" not in str(e.value)


def test_a_repo_without_weights_is_refused_before_downloading(hub_repo, tmp_path):
    (hub_repo / "model.safetensors").unlink()
    fake = FakeHub({"someone/pi05_tiny": hub_repo})
    try:
        with pytest.raises(CheckpointError, match="holds no π0.5 weights"):
            resolve_checkpoint("someone/pi05_tiny", hub_cache=tmp_path, endpoint=fake.endpoint)
        assert fake.downloads == []
    finally:
        fake.close()


def test_a_damaged_download_is_removed_and_refused(hub_repo, tmp_path):
    fake = FakeHub({"someone/pi05_tiny": hub_repo}, damage={"config.json"})
    try:
        with pytest.raises(CheckpointError, match="config.json sha256 .* where the listing says"):
            resolve_checkpoint("someone/pi05_tiny", hub_cache=tmp_path, endpoint=fake.endpoint)
        blob = hashlib.sha256((hub_repo / "config.json").read_bytes()).hexdigest()
        assert not (tmp_path / "models--someone--pi05_tiny" / "blobs" / blob).exists()
    finally:
        fake.close()


def test_too_little_disk_is_refused_before_downloading(hub, tmp_path, monkeypatch):
    monkeypatch.setattr(shutil, "disk_usage", lambda p: shutil._ntuple_diskusage(10 ** 9, 10 ** 9, 1000))
    with pytest.raises(CheckpointError, match=r"needs 1\.\d MB but .* has 1\.0 kB free"):
        resolve_checkpoint("someone/pi05_tiny", hub_cache=tmp_path, endpoint=hub.endpoint)
    assert hub.downloads == []


def test_no_network_uses_the_cache_or_names_the_folder_to_fill(hub, tmp_path):
    cache = tmp_path / "hf"
    dead = "http://127.0.0.1:9"                    # the discard port: connection refused
    with pytest.raises(CheckpointError, match=r"not in the hub cache and the hub cannot be reached: fill "
                                              r".*models--someone--pi05_tiny") as e:
        resolve_checkpoint("someone/pi05_tiny", hub_cache=cache, endpoint=dead)
    assert "\n" not in str(e.value)
    folder = resolve_checkpoint("someone/pi05_tiny", hub_cache=cache, endpoint=hub.endpoint)
    said = []
    assert resolve_checkpoint("someone/pi05_tiny", said.append, hub_cache=cache, endpoint=dead) == folder
    assert any("cannot be reached" in line for line in said)


def test_the_hubs_environment_variables_are_honoured(hub, tmp_path):
    """HF_ENDPOINT and HF_HUB_CACHE, then HF_HUB_OFFLINE, read by huggingface_hub at import (a new process)."""
    code = ("import sys; from oxygen_ros.model.download import resolve_checkpoint; "
            "print(resolve_checkpoint(sys.argv[1], lambda s: None))")
    env = dict(os.environ, HF_ENDPOINT=hub.endpoint, HF_HUB_CACHE=str(tmp_path / "c"), HF_HUB_OFFLINE="0")
    run = subprocess.run([sys.executable, "-c", code, "someone/pi05_tiny"], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == str(tmp_path / "c" / "models--someone--pi05_tiny" / "snapshots" / COMMIT)
    hub.downloads.clear()
    env.update(HF_HUB_OFFLINE="1")
    run = subprocess.run([sys.executable, "-c", code, "someone/pi05_tiny"], env=env, capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert hub.downloads == []
    run = subprocess.run([sys.executable, "-c", code, "someone/other"], env=env, capture_output=True, text=True)
    assert run.returncode != 0 and "not in the hub cache" in run.stderr


def test_progress_lines():
    assert progress_line("x/y", 500_000_000, 2_000_000_000, 10.0) == \
        "x/y: 500.0 MB of 2.0 GB (25%), 50.0 MB/s, 30 s left"
    assert progress_line("x/y", 0, 0, 0.0) == "x/y: 0 B of 0 B, 0 B/s"


def test_progress_is_logged_while_a_download_runs_and_quiet_on_a_terminal():
    said, done = [], threading.Event()

    def count():
        done.set()
        return 1000

    with download._Progress("x/y", said.append, period_s=0.01, terminal=False).downloading(4000, count):
        assert done.wait(10)
    assert said and said[0].startswith("x/y: 1.0 kB of 4.0 kB (25%)")
    said.clear()
    with download._Progress("x/y", said.append, period_s=0.01, terminal=True).downloading(4000, count):
        pass
    assert said == []


def test_a_watcher_sees_the_download_begin_progress_from_its_own_thread_and_end():
    """`watch` gets the start at once, then states from the progress thread while the caller is blocked in
    the download (here: until the watcher has seen two of them), then the end; a watcher that raises is
    logged and the download goes on."""
    states, seen_twice, fetched = [], threading.Event(), [0]

    def watch(state):
        states.append((state, threading.current_thread().name))
        if sum(s.phase == "downloading" and s.done > 0 for s, _ in states) >= 2:
            seen_twice.set()
        if state.phase == "verifying":
            raise RuntimeError("a watcher's own problem")

    progress = download._Progress("org/name", lambda line: None, watch, watch_period_s=0.01, terminal=True)
    with progress.downloading(4000, lambda: fetched[0]):
        fetched[0] = 1000
        assert seen_twice.wait(10)                 # the caller still in the download
        fetched[0] = 4000
    progress.verifying()
    progress.end()
    first, during, (last, _) = states[0], states[1:-2], states[-1]
    assert first[0] == download.DownloadState("org/name", "downloading", 0, 4000)
    assert first[1] == threading.current_thread().name
    assert {thread for _, thread in during} == {"checkpoint-download-progress"}
    assert all(s.phase == "downloading" and s.total == 4000 and s.done in (0, 1000, 4000) for s, _ in during)
    assert any(s.done == 1000 and s.bytes_per_s > 0 for s, _ in during)
    assert states[-2][0].phase == "verifying"
    assert (last.phase, last.done, last.total) == ("done", 4000, 4000)


def test_a_fetch_tells_its_watcher_its_end(hub, tmp_path):
    """From the hub: began, done (with its bytes); again: in the cache; a refusal: failed, with its line."""
    seen = []
    resolve_checkpoint("someone/pi05_tiny", watch=seen.append, hub_cache=tmp_path, endpoint=hub.endpoint)
    phases = [s.phase for s in seen]
    assert phases[0] == "downloading" and phases[-2:] == ["verifying", "done"], phases
    total = sum(p.stat().st_size for p in LEROBOT.iterdir() if p.name != "reference.npz")
    assert 0 < seen[-1].done == seen[-1].total <= total          # (equal statistics files: one blob)
    seen.clear()
    resolve_checkpoint("someone/pi05_tiny", watch=seen.append, hub_cache=tmp_path, endpoint=hub.endpoint)
    assert [s.phase for s in seen] == ["cached"]
    seen.clear()
    with pytest.raises(CheckpointError) as e:
        resolve_checkpoint("nobody/nothing", watch=seen.append, hub_cache=tmp_path, endpoint=hub.endpoint)
    assert [(s.phase, s.error) for s in seen] == [("failed", str(e.value))]


# ----------------------------------------------------------------------------------------- the bucket

class LocalBucket(LocalFileSystem):
    """The `gs` protocol served from a local folder (`gs://bucket/path` -> <root>/bucket/path), so that the
    bucket path runs through fsspec as it does against Google Cloud Storage."""

    root = ""
    protocol = ("gs", "gcs")

    def __init__(self, token=None, **kwargs):
        assert token == "anon"                   # the published buckets are read anonymously
        super().__init__(**kwargs)

    def _strip_protocol(cls, path):
        path = str(path)
        for prefix in ("gs://", "gcs://"):
            if path.startswith(prefix):
                path = path[len(prefix):]
        if not path.startswith(LocalBucket.root):     # fsspec strips an already stripped path again
            path = os.path.join(LocalBucket.root, path.lstrip("/"))
        return LocalFileSystem._strip_protocol(path)

    _strip_protocol = classmethod(_strip_protocol)

    def get_file(self, rpath, lpath, **kwargs):
        shutil.copyfile(self._strip_protocol(rpath), lpath)      # lpath is this machine's, not the bucket's


@pytest.fixture
def bucket(tmp_path, monkeypatch):
    root = tmp_path / "bucket_root"
    checkpoint = root / "openpi-assets" / "checkpoints" / "pi05_tiny"
    shutil.copytree(LEROBOT, checkpoint)
    (checkpoint / "assets" / "tiny").mkdir(parents=True)
    (checkpoint / "assets" / "tiny" / "norm_stats.json").write_text("{}")
    monkeypatch.setattr(LocalBucket, "root", str(root))
    fsspec.register_implementation("gs", LocalBucket, clobber=True)
    yield checkpoint
    _registry.pop("gs", None)


def test_a_bucket_url_is_fetched_into_openpis_cache_layout(bucket, tmp_path, monkeypatch):
    monkeypatch.setenv("OPENPI_DATA_HOME", str(tmp_path / "openpi"))
    said = []
    folder = resolve_checkpoint("gs://openpi-assets/checkpoints/pi05_tiny", said.append)
    assert folder == tmp_path / "openpi" / "openpi-assets" / "checkpoints" / "pi05_tiny"
    expected = sorted(str(p.relative_to(bucket)) for p in bucket.rglob("*") if p.is_file())
    assert sorted(str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()) == expected
    assert not folder.with_suffix(".partial").exists()
    assert any("downloading 8 file(s)" in line for line in said)
    # An existing cache entry (openpi's own, or ours) is used as it is: no bucket access.
    _registry.pop("gs", None)
    assert resolve_checkpoint("gs://openpi-assets/checkpoints/pi05_tiny", said.append,
                              openpi_cache=tmp_path / "openpi") == folder


def test_a_bucket_object_is_fetched_as_a_file(bucket, tmp_path):
    """openpi's tokenizer, gs://big_vision/paligemma_tokenizer.model: one object, cached as openpi caches it."""
    tokenizer = bucket.parents[2] / "big_vision" / "paligemma_tokenizer.model"
    tokenizer.parent.mkdir(parents=True)
    tokenizer.write_bytes(b"sentencepiece bytes")
    path = resolve_checkpoint("gs://big_vision/paligemma_tokenizer.model", openpi_cache=tmp_path / "openpi")
    assert path == tmp_path / "openpi" / "big_vision" / "paligemma_tokenizer.model"
    assert path.read_bytes() == b"sentencepiece bytes"


def test_an_interrupted_bucket_download_resumes_and_is_never_used_half_done(bucket, tmp_path):
    cache = tmp_path / "openpi"
    target = cache / "openpi-assets" / "checkpoints" / "pi05_tiny"
    partial = target.with_suffix(".partial")
    partial.mkdir(parents=True)
    shutil.copy(bucket / "config.json", partial / "config.json")             # one file done
    (partial / "model.safetensors").write_bytes(b"cut short")                  # one cut short
    assert not target.exists()                                                  # not usable yet
    folder = resolve_checkpoint("gs://openpi-assets/checkpoints/pi05_tiny", openpi_cache=cache)
    assert (folder / "model.safetensors").read_bytes() == (bucket / "model.safetensors").read_bytes()


@pytest.mark.parametrize("url, message", [
    ("gs://openpi-assets/checkpoints/nothing", "nothing in the bucket under this path|not found in the bucket"),
    ("gs://openpi-assets/checkpoints/pi05_tiny/assets", "holds no π0.5 weights"),
])
def test_bucket_refusals_are_one_line(bucket, tmp_path, url, message):
    with pytest.raises(CheckpointError, match=message) as e:
        resolve_checkpoint(url, openpi_cache=tmp_path / "openpi")
    assert "\n" not in str(e.value)


def test_an_unreachable_bucket_names_the_folder_to_fill(tmp_path, monkeypatch):
    class Offline(LocalBucket):
        def find(self, *args, **kwargs):
            raise ConnectionError("no network")

    fsspec.register_implementation("gs", Offline, clobber=True)
    try:
        with pytest.raises(CheckpointError, match=r"cannot be reached \(ConnectionError\): fill .*pi05_droid"):
            resolve_checkpoint("gs://openpi-assets/checkpoints/pi05_droid", openpi_cache=tmp_path)
    finally:
        _registry.pop("gs", None)


def test_a_damaged_bucket_object_is_refused(bucket, tmp_path, monkeypatch):
    real_find = LocalBucket.find

    def find_with_md5(self, path, **kwargs):
        listing = real_find(self, path, **kwargs)
        for name, info in listing.items():        # what GCS lists: the object's md5, base64
            info["md5Hash"] = __import__("base64").b64encode(hashlib.md5(b"other bytes").digest()).decode()
        return listing

    monkeypatch.setattr(LocalBucket, "find", find_with_md5)
    with pytest.raises(CheckpointError, match="md5 .* where the listing says"):
        resolve_checkpoint("gs://openpi-assets/checkpoints/pi05_tiny", openpi_cache=tmp_path)
    assert not (tmp_path / "openpi-assets" / "checkpoints" / "pi05_tiny").exists()


# ------------------------------------------------------------------------------- where names are accepted

@contextlib.contextmanager
def engine_node(params: dict):
    """An EngineNode (tiny model, no nodes around it) with these parameters, in a context of its own."""
    import rclpy
    from rclpy.context import Context
    from rclpy.parameter import Parameter

    from oxygen_ros.nodes.engine_node import EngineNode

    context = Context()
    rclpy.init(context=context, args=["test"])
    params = dict({"model": "tiny", "kv_budget_mb": 8.0}, **params)
    node = EngineNode(context=context, check_capacity=False,
                      parameter_overrides=[Parameter(k, value=v) for k, v in params.items()])
    try:
        yield node
    finally:
        node.destroy_node()
        rclpy.shutdown(context=context)


def configure_engine_node(checkpoint: str):
    with engine_node({"checkpoint": checkpoint}) as node:
        node.trigger_configure()
        return node.engine is not None, node.failure


def test_the_engine_node_takes_a_hub_id_as_its_checkpoint(tmp_path, monkeypatch):
    """The `checkpoint` parameter (oxygen_bringup, oxygen_serve, a params file) names a hub repo: fetched into
    the hub cache and served; a missing repo is the node's one-line refusal before anything loads."""
    from huggingface_hub import constants

    from oxygen_ros.model.checkpoint import init_random_weights, save_checkpoint
    from oxygen_ros.model.config import preset
    from oxygen_ros.model.pi05 import Pi05

    save_checkpoint(init_random_weights(Pi05(preset("tiny"))), tmp_path / "repo", fmt="lerobot")
    fake = FakeHub({"someone/pi05_tiny": tmp_path / "repo"})
    monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    try:
        assert configure_engine_node("someone/pi05_tiny") == (True, "")
        assert (tmp_path / "hf" / "models--someone--pi05_tiny" / "snapshots" / COMMIT / "model.safetensors").is_file()
        served, failure = configure_engine_node("someone/nothing")
    finally:
        fake.close()
    assert not served
    assert failure.startswith("someone/nothing: no such repo on the hub") and "\n" not in failure, failure


def test_a_disk_filling_up_during_the_download_is_one_line(hub, tmp_path, monkeypatch):
    import errno

    import huggingface_hub

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(huggingface_hub, "snapshot_download", full)
    with pytest.raises(CheckpointError, match=r"someone/pi05_tiny: the disk of .* is full \(1\.\d MB needed\): "
                                              r"free space or set HF_HUB_CACHE elsewhere") as e:
        resolve_checkpoint("someone/pi05_tiny", hub_cache=tmp_path, endpoint=hub.endpoint)
    assert "\n" not in str(e.value)


# ------------------------------------------------------------------------- the fetch in /diagnostics

def test_a_fetch_reads_in_diagnostics_as_an_operator_needs_it():
    from diagnostic_msgs.msg import DiagnosticStatus

    from oxygen_ros.model.download import DownloadState
    from oxygen_ros.nodes.download_status import Downloads, report

    running = DownloadState("org/name", "downloading", 3_200_000_000, 14_500_000_000, 78.0, 1.0)
    level, message, values = report(running)
    assert level == DiagnosticStatus.OK
    assert message == "downloading org/name: 3.2 GB of 14.5 GB (22%), 41.0 MB/s, ETA 5 min"
    assert (values["bytes_done"], values["bytes_total"], values["bytes_per_s"], values["seconds_left"]) == \
        (3_200_000_000, 14_500_000_000, 41_025_641, 275)
    level, message, _ = report(replace(running, idle_s=45.0))
    assert level == DiagnosticStatus.WARN and message == "downloading org/name: no data for 45 s (3.2 GB of 14.5 GB)"
    level, message, _ = report(replace(running, phase="done", done=14_500_000_000, elapsed_s=354.0))
    assert level == DiagnosticStatus.OK and message == "downloaded org/name: 14.5 GB in 6 min (41.0 MB/s)"
    assert report(DownloadState("org/name", "cached"))[1] == "org/name: in the cache, nothing to download"
    level, message, _ = report(replace(running, phase="failed", error="org/name: download failed (...)"))
    assert level == DiagnosticStatus.ERROR and message == "org/name: download failed (...)"
    downloads = Downloads()
    downloads.update("oxygen_ros: checkpoint download", running)
    downloads.update("oxygen_ros: norm_stats download", DownloadState("org/stats", "cached"))
    downloads.update("oxygen_ros: checkpoint download", replace(running, done=3_300_000_000))
    assert [(name, values["bytes_done"]) for name, _, _, values in downloads.reports()] == [
        ("oxygen_ros: checkpoint download", 3_300_000_000), ("oxygen_ros: norm_stats download", 0)]


class Published:
    """Stands in for the engine node's /diagnostics publisher: each message's download statuses, with the
    thread that published it."""

    def __init__(self):
        self.messages, self.lock = [], threading.Lock()

    def publish(self, msg):
        downloads = [(s.name, s.level, s.message, {v.key: v.value for v in s.values})
                     for s in msg.status if s.name.endswith(" download")]
        with self.lock:
            self.messages.append((threading.current_thread().name, downloads))

    def statuses(self, name: str):
        with self.lock:
            return [(thread, s) for thread, statuses in self.messages for s in statuses if s[0] == name]


def test_the_engine_node_publishes_the_download_while_configure_blocks(tmp_path, monkeypatch):
    """configure holds the executor (and oxygen_bringup configures before any executor spins): the download's
    progress reaches /diagnostics from the download's own thread, while configure is still in the download
    (the hub holds the weights until the test has seen it), then its end, kept after configure."""
    from diagnostic_msgs.msg import DiagnosticStatus
    from huggingface_hub import constants

    from oxygen_ros.model.checkpoint import init_random_weights, save_checkpoint
    from oxygen_ros.model.config import preset
    from oxygen_ros.model.pi05 import Pi05

    save_checkpoint(init_random_weights(Pi05(preset("tiny"))), tmp_path / "repo", fmt="lerobot")
    weights = threading.Event()
    fake = FakeHub({"someone/pi05_tiny": tmp_path / "repo"}, hold={"model.safetensors": weights})
    monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setattr(download, "WATCH_PERIOD_S", 0.05)
    name = "oxygen_ros: checkpoint download"
    try:
        with engine_node({"checkpoint": "someone/pi05_tiny"}) as node:
            node._diag_pub = published = Published()
            configure = threading.Thread(target=node.trigger_configure)
            configure.start()
            try:
                for _ in range(600):          # a guard against a hang, not a timing: 60 s
                    if len([t for t, s in published.statuses(name) if t == "checkpoint-download-progress"]) >= 2:
                        break
                    weights.wait(0.1)
                during = published.statuses(name)
                assert configure.is_alive()
            finally:
                weights.set()
                configure.join(120)
            assert node.engine is not None, node.failure
            node._publish_diagnostics()                     # the timer's publication after configure
    finally:
        fake.close()
    assert len([t for t, _ in during if t == "checkpoint-download-progress"]) >= 2, during
    for _, (_, level, message, values) in during:
        assert level == DiagnosticStatus.OK and message.startswith("downloading someone/pi05_tiny: "), message
        assert values["phase"] == "downloading" and int(values["bytes_total"]) > 0
    final = [s for _, s in published.statuses(name)][-2:]
    size = (tmp_path / "hf" / "models--someone--pi05_tiny" / "snapshots" / COMMIT / "model.safetensors").stat().st_size
    for _, level, message, values in final:                 # configure's own last, then the timer's
        assert level == DiagnosticStatus.OK and message.startswith("downloaded someone/pi05_tiny: ")
        assert values["phase"] == "done" and int(values["bytes_done"]) == size


def norm_stats_json(value: float, dims: int = 8) -> str:
    return json.dumps({"norm_stats": {"actions": {"mean": [value] * dims, "std": [0.0] * dims,
                                                  "q01": [value] * dims, "q99": [value] * dims}}})


def test_a_fleet_robots_own_remote_norm_stats_are_fetched_as_the_engines(bucket, tmp_path, monkeypatch):
    """A fleet robot's norm_stats named by a hub id (a repo of statistics: its weights stay on the hub) or a
    gs:// URL (openpi's statistics of an asset) is fetched as the engine's own norm_stats, its download in
    /diagnostics as that robot's; a refusal is the download's line, named with its robot."""
    from huggingface_hub import constants

    stats_repo = tmp_path / "stats_repo"
    (stats_repo / "assets" / "droid").mkdir(parents=True)
    (stats_repo / "assets" / "droid" / "norm_stats.json").write_text(norm_stats_json(0.25))
    (stats_repo / "model.safetensors").write_bytes(b"weights the statistics do not need")
    (bucket / "assets" / "tiny" / "norm_stats.json").write_text(norm_stats_json(0.5))
    fake = FakeHub({"someone/droid_stats": stats_repo})
    monkeypatch.setenv("HF_ENDPOINT", fake.endpoint)
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("OPENPI_DATA_HOME", str(tmp_path / "openpi"))
    fleet = {"robots": ["arm_a", "arm_b"], "arm_a.robot_config": "droid", "arm_a.norm_stats": "someone/droid_stats",
             "arm_b.robot_config": "droid",
             "arm_b.norm_stats": "gs://openpi-assets/checkpoints/pi05_tiny/assets/tiny/norm_stats.json"}
    try:
        with engine_node(fleet) as node:
            node._diag_pub = published = Published()
            node.trigger_configure()
            assert node.engine is not None, node.failure
            io = {robot: node.engine.preparers[robot].io.description for robot in ("arm_a", "arm_b")}
            downloads = {robot: [s[2] for _, s in published.statuses(f"oxygen_ros: {robot} norm_stats download")]
                         for robot in ("arm_a", "arm_b")}
        assert fake.downloads == ["assets/droid/norm_stats.json"]
        with engine_node(dict(fleet, **{"arm_b.norm_stats": "nobody/nothing"})) as node:
            node.trigger_configure()
            failure = node.failure
    finally:
        fake.close()
    assert str(tmp_path / "hf" / "models--someone--droid_stats" / "snapshots" / COMMIT) in io["arm_a"]
    assert str(tmp_path / "openpi" / "openpi-assets" / "checkpoints" / "pi05_tiny" / "assets" / "tiny") in io["arm_b"]
    assert downloads["arm_a"][-1].startswith("downloaded someone/droid_stats: ")
    assert downloads["arm_b"][-1].startswith("downloaded gs://openpi-assets/checkpoints/pi05_tiny/assets/tiny/")
    assert node.engine is None
    assert failure.startswith("arm_b.norm_stats: nobody/nothing: no such repo on the hub") and "\n" not in failure


def test_norm_stats_alone_are_refused_where_a_repo_has_none(hub_repo, tmp_path):
    """The statistics' own refusal (not "no weights"), before anything is downloaded."""
    for f in list(hub_repo.iterdir()):
        if f.name != "model.safetensors":
            f.unlink()
    fake = FakeHub({"someone/weights_only": hub_repo})
    try:
        with pytest.raises(CheckpointError, match=r"someone/weights_only: holds no norm statistics \(norm_stats.json, "
                                                  r"assets/<asset_id>/norm_stats.json or LeRobot's processor "
                                                  r"statistics\); it has nothing the loader reads"):
            resolve_checkpoint("someone/weights_only", wanted=NORM_STATS, hub_cache=tmp_path, endpoint=fake.endpoint)
        assert fake.downloads == []
    finally:
        fake.close()


def test_oxygen_serve_serves_a_checkpoint_named_on_the_hub(tmp_path):
    """`oxygen_serve --robot demo --checkpoint someone/demo` as a user types it: the checkpoint and its
    statistics fetched from the hub (served on 127.0.0.1) with what it downloads said, then served: a client's
    chunk equals the one the shipped folder gives."""
    import numpy as np
    from openpi_client.websocket_client_policy import WebsocketClientPolicy

    from oxygen_ros.robot.configs import demo_checkpoint

    def serve(*args: str, env: dict | None = None):
        proc = subprocess.Popen([sys.executable, "-m", "oxygen_ros.serve", "--robot", "demo", "--port", "0", *args],
                                cwd=tmp_path, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                env=dict(os.environ, PYTHONUNBUFFERED="1", OMP_NUM_THREADS="1", **(env or {})))
        lines = []
        for line in proc.stdout:                   # ends at the port line, or when the process ends
            lines.append(line.rstrip())
            if "listening on ws://" in line:
                return proc, int(line.rsplit(":", 1)[1]), lines
        proc.wait(10)
        raise AssertionError("\n".join(lines))

    def chunk(port: int):
        rng = np.random.default_rng(4)
        obs = {"observation/image": rng.integers(0, 256, (64, 64, 3), dtype=np.uint8),
               "observation/state": rng.uniform(-1, 1, 3), "prompt": "touch the red cube"}
        return WebsocketClientPolicy("127.0.0.1", port).infer(obs)

    fake = FakeHub({"someone/demo": demo_checkpoint()})
    served = []
    try:
        env = {"HF_ENDPOINT": fake.endpoint, "HF_HUB_CACHE": str(tmp_path / "hf")}
        proc, port, lines = serve("--checkpoint", "someone/demo", env=env)
        served.append(proc)
        said = "\n".join(lines)
        assert "someone/demo: downloading 3 file(s), 6.1 MB" in said, said       # what it fetches, how much
        hub_chunk = chunk(port)
        proc, port, _ = serve()                                                   # the shipped folder
        served.append(proc)
        local_chunk = chunk(port)
    finally:
        fake.close()
        for proc in served:
            proc.send_signal(2)
            proc.wait(30)
    np.testing.assert_array_equal(hub_chunk["actions"], local_chunk["actions"])
