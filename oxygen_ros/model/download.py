"""Naming a checkpoint as its community does, and fetching it once.

A checkpoint is named, wherever one is accepted (the engine's `checkpoint` parameter: oxygen_bringup,
oxygen_serve, a params file), by one of:
- a local folder or weights file (used as it is);
- a Hugging Face hub id, `org/name` or `org/name@revision` (a branch, tag or commit), as LeRobot's
  `from_pretrained` takes it: fetched with huggingface_hub into its own cache (HF_HOME, HF_HUB_CACHE,
  HF_HUB_OFFLINE and HF_ENDPOINT honoured; files already fetched are kept). A local folder of the same name wins,
  as in LeRobot;
- a `gs://bucket/path` URL (a folder, or one object such as openpi's `gs://big_vision/paligemma_tokenizer.model`),
  as openpi's `download.maybe_download` takes it: fetched anonymously with fsspec (gcsfs) into openpi's cache
  layout (`$OPENPI_DATA_HOME` or ~/.cache/openpi, `<bucket>/<path>`), under the same file lock, through
  `<path>.partial`, so that an openpi user's cache is reused and shared.

Only the files the loader reads are fetched from the hub (CHECKPOINT's, or NORM_STATS' for statistics alone).
Nothing is used before it is verified:
every file's size against the listing, and a hub file's sha256 (git-lfs) or a bucket object's md5 when this
call downloaded it. Problems are one-line CheckpointErrors: a missing or gated repo, a wrong revision, no
network (with the cache folder to fill by hand), too little disk. Whoever shows the fetch elsewhere (the engine
node's /diagnostics) passes `watch`: it gets a DownloadState when the download begins, every WATCH_PERIOD_S
from a thread of its own while it runs (the caller is blocked in the download) and once at the end.
"""
from __future__ import annotations

import base64
import contextlib
import errno
import fnmatch
import hashlib
import logging
import os
import re
import shutil
import sys
import threading
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from .files import CheckpointError

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Wanted:
    """What a name is fetched for: the hub files fetched (`files`, fnmatch patterns, `*` spans folders), and
    what must be among them (one of `required`, else a refusal that says `holds`)."""
    files: tuple[str, ...]
    required: tuple[str, ...]
    holds: str


# The statistics a norm_stats name reads: openpi's norm_stats.json (assets/<asset_id>/, an asset id may hold a
# slash), a LeRobot policy folder's processor configs and statistics, its config.json (the modes it names).
STATISTICS_FILES = ("norm_stats.json", "assets/*/norm_stats.json", "policy_preprocessor.json",
                    "policy_postprocessor.json", "policy_*processor*.safetensors")
# A checkpoint: LeRobot's policy folder (weights, config, processors), a PEFT adapter, openpi's statistics and
# params/ (a JAX checkpoint on the hub).
CHECKPOINT = Wanted(
    files=("config.json", "model.safetensors", "model.safetensors.index.json", "model-*-of-*.safetensors",
           "adapter_config.json", "adapter_model.safetensors", "params/*", "_CHECKPOINT_METADATA") + STATISTICS_FILES,
    required=("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors", "params/*"),
    holds="π0.5 weights (model.safetensors, a PEFT adapter or openpi's params/)")
# Norm statistics alone (the weights stay on the hub: a robot's statistics never cost a checkpoint's download).
NORM_STATS = Wanted(files=("config.json",) + STATISTICS_FILES, required=STATISTICS_FILES,
                    holds="norm statistics (norm_stats.json, assets/<asset_id>/norm_stats.json or LeRobot's "
                          "processor statistics)")
PROGRESS_PERIOD_S = 5.0      # one progress line this often in logs (a terminal shows the bar instead)
WATCH_PERIOD_S = 2.5         # a DownloadState this often to `watch` (PROGRESS_PERIOD_S is a multiple of it)
OPENPI_DATA_HOME = "OPENPI_DATA_HOME"
_HUB_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*/[\w.-]+)(@(?P<revision>[\w./-]+))?$")


@dataclass(frozen=True)
class CheckpointName:
    kind: str                 # "local" | "hub" | "bucket"
    location: str             # the path, the hub repo id, or the URL
    revision: str | None = None

    def __str__(self) -> str:
        return self.location + (f"@{self.revision}" if self.revision else "")


def parse_name(name: str | os.PathLike) -> CheckpointName:
    """What `name` names: an existing path is local; `org/name[@rev]` the hub; `gs://...` a bucket. Anything
    else is a local path (its absence is reported where it is used)."""
    text = str(name)
    scheme = urllib.parse.urlparse(text).scheme
    if scheme == "gs":
        parsed = urllib.parse.urlparse(text)
        if not parsed.netloc or not parsed.path.strip("/"):
            raise CheckpointError(f"{text}: a bucket checkpoint is named gs://<bucket>/<path>")
        return CheckpointName("bucket", text.rstrip("/"))
    if scheme == "file":
        return CheckpointName("local", urllib.parse.urlparse(text).path)
    if os.path.lexists(text) or text.startswith(("/", "./", "../", "~")):
        return CheckpointName("local", text)
    match = _HUB_ID.match(text)
    if match and ".." not in match["repo"]:
        return CheckpointName("hub", match["repo"], match["revision"])
    return CheckpointName("local", text)


def is_remote(name: str | os.PathLike) -> bool:
    """Whether `name` is fetched (a hub id or a gs:// URL, a malformed one too: fetching it says what is wrong)."""
    try:
        return parse_name(name).kind != "local"
    except CheckpointError:
        return True


@dataclass(frozen=True)
class DownloadState:
    """Where the fetch of one name stands."""
    name: str
    phase: str                # downloading | verifying | done (fetched, verified) | cached (nothing to fetch) | failed
    done: int = 0             # bytes this run fetched so far
    total: int = 0            # bytes this run fetches
    elapsed_s: float = 0.0    # since the download began
    idle_s: float = 0.0       # since the byte count last grew (a stalled connection grows this)
    error: str = ""           # why it failed (the CheckpointError's line)

    @property
    def bytes_per_s(self) -> float:
        return self.done / self.elapsed_s if self.elapsed_s > 0 else 0.0

    @property
    def left_s(self) -> float | None:
        """Seconds left at the mean rate so far; None before a byte came."""
        rate = self.bytes_per_s
        return max(self.total - self.done, 0) / rate if rate > 0 else None


def resolve_checkpoint(name: str | os.PathLike, say: Callable[[str], None] = log.info, *,
                       wanted: Wanted = CHECKPOINT, watch: Callable[[DownloadState], None] | None = None,
                       hub_cache: str | Path | None = None, endpoint: str | None = None,
                       openpi_cache: str | Path | None = None) -> Path:
    """The local folder (or file) of the checkpoint `name` (or, with `wanted=NORM_STATS`, of its statistics),
    fetched and verified first when it is remote. `say` gets what is fetched and, in logs, a progress line every
    PROGRESS_PERIOD_S; `watch` gets DownloadStates (module docstring). `hub_cache`, `endpoint` and
    `openpi_cache` default to huggingface_hub's and openpi's own settings (environment variables)."""
    parsed = parse_name(name)
    if parsed.kind == "local":
        return Path(parsed.location).expanduser()
    progress = _Progress(str(parsed), say, watch)
    try:
        if parsed.kind == "hub":
            path = _fetch_hub(parsed, wanted, say, progress, hub_cache, endpoint)
        else:
            path = _fetch_bucket(parsed.location, wanted, say, progress, openpi_cache)
    except Exception as e:
        progress.end(str(e) if isinstance(e, CheckpointError) else f"{parsed}: {type(e).__name__}: {e}")
        raise
    progress.end()
    return path


# ---------------------------------------------------------------------------------------------- the hub

def _fetch_hub(name: CheckpointName, wanted: Wanted, say, progress: _Progress, cache_dir, endpoint) -> Path:
    import httpx2
    from huggingface_hub import HfApi, constants, snapshot_download, try_to_load_from_cache
    from huggingface_hub.errors import (GatedRepoError, HfHubHTTPError, LocalEntryNotFoundError,
                                        OfflineModeIsEnabled, RepositoryNotFoundError, RevisionNotFoundError)

    cache_dir = str(cache_dir or constants.HF_HUB_CACHE)
    endpoint = endpoint or os.environ.get("HF_ENDPOINT") or None
    repo_folder = Path(cache_dir) / f"models--{name.location.replace('/', '--')}"
    by_hand = (f"fill {repo_folder} on a machine with network (`hf download {name.location}"
               f"{' --revision ' + name.revision if name.revision else ''} --cache-dir <its HF_HUB_CACHE>`, then copy)")
    offline = constants.is_offline_mode() if hasattr(constants, "is_offline_mode") else constants.HF_HUB_OFFLINE
    listing = None
    if not offline:
        try:
            listing = HfApi(endpoint=endpoint).model_info(name.location, revision=name.revision, files_metadata=True)
        except GatedRepoError:
            raise CheckpointError(f"{name}: a gated repo on the hub: accept its terms on its page and log in "
                                  f"(`hf auth login` or HF_TOKEN)") from None
        except RevisionNotFoundError:
            raise CheckpointError(f"{name}: revision {name.revision!r} not found in {name.location} on the hub "
                                  f"(a branch, tag or commit)") from None
        except RepositoryNotFoundError:
            raise CheckpointError(f"{name}: no such repo on the hub (or a private one: log in), and no local "
                                  f"folder {Path(name.location).resolve()}") from None
        except (httpx2.ConnectError, httpx2.TimeoutException, OfflineModeIsEnabled, HfHubHTTPError) as e:
            say(f"{name}: the hub cannot be reached ({type(e).__name__}); looking in the cache {cache_dir}")
    if listing is None:      # offline: the cache as huggingface_hub left it (sizes were checked when fetched)
        try:
            folder = snapshot_download(name.location, revision=name.revision, cache_dir=cache_dir,
                                       allow_patterns=list(wanted.files), local_files_only=True)
        except LocalEntryNotFoundError:
            raise CheckpointError(f"{name}: not in the hub cache and the hub cannot be reached: {by_hand}") from None
        _require(name, wanted, [str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file()])
        return Path(folder)

    files = {s.rfilename: s for s in listing.siblings if _matches(s.rfilename, wanted.files)}
    _require(name, wanted, list(files))
    cached = {f for f in files
              if isinstance(try_to_load_from_cache(name.location, f, cache_dir=cache_dir, revision=listing.sha), str)}
    missing = sum(files[f].size or 0 for f in files if f not in cached)
    _check_space(Path(cache_dir), missing, name)
    if missing:
        say(f"{name}: downloading {len(files) - len(cached)} file(s), {_human(missing)}, revision "
            f"{listing.sha[:12]} into {repo_folder}")
    try:
        before = _bytes_under(repo_folder / "blobs")
        fetching = progress.downloading(missing, lambda: _bytes_under(repo_folder / "blobs") - before)
        with fetching if missing else contextlib.nullcontext():      # (all cached: the snapshot's folder only)
            # By the name given (not the commit), so that huggingface_hub records the branch or tag in the
            # cache's refs/ for later offline starts.
            folder = Path(snapshot_download(name.location, revision=name.revision, cache_dir=cache_dir,
                                            allow_patterns=sorted(files), endpoint=endpoint))
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise CheckpointError(f"{name}: the disk of {cache_dir} is full ({_human(missing)} needed): free "
                                  f"space or set HF_HUB_CACHE elsewhere") from None
        if isinstance(e, (HfHubHTTPError, LocalEntryNotFoundError)):
            raise CheckpointError(f"{name}: download failed ({type(e).__name__}: {str(e).splitlines()[0]}): "
                                  f"run again to resume, or {by_hand}") from None
        raise
    if folder.name != listing.sha:
        raise CheckpointError(f"{name}: the revision moved from {listing.sha[:12]} to {folder.name[:12]} during the "
                              f"download: run again")
    if missing:
        progress.verifying()
    for file, entry in files.items():
        path = folder / file
        lfs = getattr(entry, "lfs", None)
        expected_size = lfs.size if lfs is not None else entry.size
        _verify(str(name), path, expected_size,
                ("sha256", lfs.sha256) if lfs is not None and file not in cached else None)
    return folder


def _matches(file: str, patterns: tuple[str, ...]) -> bool:
    return any(fnmatch.fnmatch(file, pattern) for pattern in patterns)


def _require(name: CheckpointName, wanted: Wanted, files: list[str]) -> None:
    if not any(_matches(f, wanted.required) for f in files):
        shown = ", ".join(sorted(files)[:8]) or "nothing the loader reads"
        raise CheckpointError(f"{name}: holds no {wanted.holds}; it has {shown}")


# ------------------------------------------------------------------------------------- openpi's bucket

def openpi_cache_dir(openpi_cache: str | Path | None = None) -> Path:
    """openpi's cache folder: `$OPENPI_DATA_HOME`, else ~/.cache/openpi."""
    return Path(openpi_cache or os.environ.get(OPENPI_DATA_HOME, "~/.cache/openpi")).expanduser().resolve()


def _fetch_bucket(url: str, wanted: Wanted, say, progress: _Progress, openpi_cache) -> Path:
    import filelock
    import fsspec

    parsed = urllib.parse.urlparse(url)
    cache = openpi_cache_dir(openpi_cache)
    local = (cache / parsed.netloc / parsed.path.strip("/")).resolve()
    if local.exists():                        # complete: only a finished download is moved here
        return local
    by_hand = f"fill {local} on a machine with network (`gsutil -m cp -r {url}/* {local}`, then copy)"
    try:
        local.parent.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise CheckpointError(f"{url}: the cache folder {local.parent} cannot be made ({e.strerror})") from None
    with filelock.FileLock(str(local.with_suffix(".lock"))):      # openpi's lock: one download at a time
        if local.exists():
            return local
        scratch = local.with_suffix(".partial")
        try:
            fs, root = fsspec.core.url_to_fs(url, token="anon")
            listing = fs.find(root, detail=True)
        except (FileNotFoundError, PermissionError) as e:
            raise CheckpointError(f"{url}: not found in the bucket, or not public ({type(e).__name__})") from None
        except Exception as e:  # noqa: BLE001 - gcsfs raises aiohttp/HTTP errors of its own when offline
            raise CheckpointError(f"{url}: the bucket cannot be reached ({type(e).__name__}): {by_hand}") from None
        files = {path[len(root):].strip("/"): info for path, info in listing.items()
                 if info.get("type") == "file" and not path.endswith("/")}
        if not files:
            raise CheckpointError(f"{url}: nothing in the bucket under this path")
        single = set(files) == {""}                # the URL names one object (a tokenizer, a weights file)
        if not single:        # fetched whole, as openpi does (its cache holds complete folders only)
            _require(CheckpointName("bucket", url), wanted, list(files))
        total = sum(int(info.get("size") or 0) for info in files.values())
        kept = _bytes_under(scratch)              # from an interrupted run
        _check_space(cache, total - kept, CheckpointName("bucket", url))
        say(f"{url}: downloading {len(files)} file(s), {_human(total)} into {local}")
        try:
            with progress.downloading(total - kept, lambda: _bytes_under(scratch) - kept):
                for rel, info in sorted(files.items()):
                    target = scratch / rel if rel else scratch
                    size = int(info.get("size") or 0)
                    if target.is_file() and target.stat().st_size == size:
                        continue                      # kept from an interrupted run: resumed per file
                    target.parent.mkdir(parents=True, exist_ok=True)
                    fs.get_file(root.rstrip("/") + "/" + rel if rel else root, str(target))
                    md5 = info.get("md5Hash")
                    _verify(url, target, size, ("md5", base64.b64decode(md5).hex()) if md5 else None)
        except OSError as e:
            if e.errno == errno.ENOSPC:
                raise CheckpointError(f"{url}: the disk of {cache} is full ({_human(total)} needed): free space or "
                                      f"set {OPENPI_DATA_HOME} elsewhere") from None
            raise CheckpointError(f"{url}: download failed ({e}): run again to resume, or {by_hand}") from None
        shutil.move(str(scratch), str(local))
    return local


# ------------------------------------------------------------------------------------------- shared

def _verify(name: str, path: Path, size: int | None, digest: tuple[str, str] | None) -> None:
    """`path` has `size` bytes and, when given, the (algorithm, hex) digest; else it is removed (so that the
    next run fetches it again) and a CheckpointError says so."""
    found = path.stat().st_size if path.is_file() else None
    problem = None
    if found is None:
        problem = "missing after the download"
    elif size is not None and found != size:
        problem = f"{found} bytes where the listing says {size}"
    elif digest is not None:
        h = hashlib.new(digest[0])
        with open(path, "rb") as f:
            while chunk := f.read(1 << 24):
                h.update(chunk)
        if h.hexdigest() != digest[1].lower():
            problem = f"{digest[0]} {h.hexdigest()[:16]}... where the listing says {digest[1][:16]}..."
    if problem:
        if found is not None:
            Path(os.path.realpath(path)).unlink(missing_ok=True)
        raise CheckpointError(f"{name}: {path.name} {problem}: the damaged file was removed, run again to fetch it")


def _check_space(folder: Path, needed: int, name: CheckpointName) -> None:
    probe = folder
    while not probe.exists():
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if needed > free:
        raise CheckpointError(f"{name}: needs {_human(needed)} but {probe} has {_human(free)} free: free space or "
                              f"point the cache elsewhere (HF_HUB_CACHE / {OPENPI_DATA_HOME})")


def _bytes_under(folder: Path) -> int:
    if folder.is_file():
        return folder.stat().st_size
    if not folder.exists():
        return 0
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())


def _human(n: float) -> str:
    for unit in ("B", "kB", "MB", "GB"):
        if abs(n) < 1000:
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n:.1f} TB"


def duration(seconds: float) -> str:
    """A time left as a person reads it: 45 s, 4 min, 1.5 h."""
    if seconds < 90:
        return f"{seconds:.0f} s"
    if seconds < 90 * 60:
        return f"{seconds / 60:.0f} min"
    return f"{seconds / 3600:.1f} h"


def progress_line(name: str, done: int, total: int, elapsed_s: float) -> str:
    """One progress line of a download: bytes, share, rate and the time left at that rate."""
    state = DownloadState(name, "downloading", done, total, elapsed_s)
    share = f" ({100 * done / total:.0f}%)" if total else ""
    left = f", {duration(state.left_s)} left" if state.left_s is not None and total > done else ""
    return f"{name}: {_human(done)} of {_human(total)}{share}, {_human(state.bytes_per_s)}/s{left}"


class _Progress:
    """One fetch's progress: while it downloads, a line every PROGRESS_PERIOD_S to `say` when stderr is not a
    terminal (a terminal shows the fetching library's bar) and a DownloadState every WATCH_PERIOD_S to `watch`,
    both from a thread of its own (the download blocks its caller); its end once to `watch`. A `watch` that
    raises is logged and the download goes on."""

    def __init__(self, name: str, say: Callable[[str], None], watch: Callable[[DownloadState], None] | None = None,
                 period_s: float | None = None, watch_period_s: float | None = None, terminal: bool | None = None):
        self.name, self.say, self.watch = name, say, watch
        self.period_s = PROGRESS_PERIOD_S if period_s is None else period_s
        self.watch_period_s = WATCH_PERIOD_S if watch_period_s is None else watch_period_s
        self.terminal = sys.stderr.isatty() if terminal is None else terminal
        self.state = DownloadState(name, "cached")      # until a download begins: nothing to fetch

    @contextlib.contextmanager
    def downloading(self, total: int, done: Callable[[], int]):
        """Around the download of `total` bytes; `done()`: the bytes fetched so far (any thread may call it)."""
        start = time.monotonic()
        self._tell(DownloadState(self.name, "downloading", 0, total))
        stop = threading.Event()
        logs = total > 0 and not self.terminal
        thread = threading.Thread(target=self._run, args=(stop, start, total, done, logs), daemon=True,
                                  name="checkpoint-download-progress")
        if logs or self.watch is not None:
            thread.start()
        try:
            yield
        finally:
            stop.set()
            if thread.is_alive():
                thread.join()
            self.state = replace(self.state, done=min(max(done(), 0), total), elapsed_s=time.monotonic() - start)

    def verifying(self) -> None:
        self._tell(replace(self.state, phase="verifying", idle_s=0.0))

    def end(self, error: str = "") -> None:
        if error:
            self._tell(replace(self.state, phase="failed", error=error))
        else:
            self._tell(replace(self.state, phase="cached" if self.state.phase == "cached" else "done",
                               done=self.state.total, idle_s=0.0))

    def _run(self, stop: threading.Event, start: float, total: int, done: Callable[[], int], logs: bool) -> None:
        tick_s = self.watch_period_s if self.watch is not None else self.period_s
        say_every = max(1, round(self.period_s / tick_s))
        last, grew, ticks = 0, start, 0
        while not stop.wait(tick_s):
            now, ticks = time.monotonic(), ticks + 1
            count = min(max(done(), 0), total)
            if count > last:
                last, grew = count, now
            self._tell(DownloadState(self.name, "downloading", count, total, now - start, now - grew))
            if logs and ticks % say_every == 0:
                self.say(progress_line(self.name, count, total, now - start))

    def _tell(self, state: DownloadState) -> None:
        self.state = state
        if self.watch is None:
            return
        try:
            self.watch(state)
        except Exception as e:  # noqa: BLE001 - showing the progress must not end the download
            log.warning(f"{self.name}: the download's progress could not be shown: {type(e).__name__}: {e}")
