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

Only the files the loader reads are fetched from the hub (HUB_FILES). Nothing is used before it is verified:
every file's size against the listing, and a hub file's sha256 (git-lfs) or a bucket object's md5 when this
call downloaded it. Problems are one-line CheckpointErrors: a missing or gated repo, a wrong revision, no
network (with the cache folder to fill by hand), too little disk.
"""
from __future__ import annotations

import base64
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
from dataclasses import dataclass
from pathlib import Path

from .files import CheckpointError

log = logging.getLogger(__name__)

# The files of a hub checkpoint the loader reads: LeRobot's policy folder (weights, config, processor configs
# and their statistics), a PEFT adapter, openpi's norm statistics and params/ (a JAX checkpoint on the hub).
HUB_FILES = ("config.json", "model.safetensors", "model.safetensors.index.json", "model-*-of-*.safetensors",
             "policy_preprocessor.json", "policy_postprocessor.json", "policy_*processor*.safetensors",
             "adapter_config.json", "adapter_model.safetensors", "norm_stats.json", "assets/*/norm_stats.json",
             "params/*", "_CHECKPOINT_METADATA")
WEIGHT_FILES = ("model.safetensors", "model.safetensors.index.json", "adapter_model.safetensors", "params/*")
PROGRESS_PERIOD_S = 5.0      # one progress line this often in logs (a terminal shows the bar instead)
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
    return parse_name(name).kind != "local"


def resolve_checkpoint(name: str | os.PathLike, say: Callable[[str], None] = log.info, *,
                       hub_cache: str | Path | None = None, endpoint: str | None = None,
                       openpi_cache: str | Path | None = None) -> Path:
    """The local folder (or file) of the checkpoint `name`, fetched and verified first when it is remote.
    `say` gets what is fetched and, in logs, a progress line every PROGRESS_PERIOD_S. `hub_cache`, `endpoint`
    and `openpi_cache` default to huggingface_hub's and openpi's own settings (environment variables)."""
    parsed = parse_name(name)
    if parsed.kind == "local":
        return Path(parsed.location).expanduser()
    if parsed.kind == "hub":
        return _fetch_hub(parsed, say, hub_cache, endpoint)
    return _fetch_bucket(parsed.location, say, openpi_cache)


# ---------------------------------------------------------------------------------------------- the hub

def _fetch_hub(name: CheckpointName, say, cache_dir, endpoint) -> Path:
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
                                       allow_patterns=list(HUB_FILES), local_files_only=True)
        except LocalEntryNotFoundError:
            raise CheckpointError(f"{name}: not in the hub cache and the hub cannot be reached: {by_hand}") from None
        _require_weights(name, [str(p.relative_to(folder)) for p in Path(folder).rglob("*") if p.is_file()])
        return Path(folder)

    wanted = {s.rfilename: s for s in listing.siblings if _needed(s.rfilename)}
    _require_weights(name, list(wanted))
    cached = {f for f in wanted
              if isinstance(try_to_load_from_cache(name.location, f, cache_dir=cache_dir, revision=listing.sha), str)}
    missing = sum(wanted[f].size or 0 for f in wanted if f not in cached)
    _check_space(Path(cache_dir), missing, name)
    if missing:
        say(f"{name}: downloading {len(wanted) - len(cached)} file(s), {_human(missing)}, revision "
            f"{listing.sha[:12]} into {repo_folder}")
    try:
        before = _bytes_under(repo_folder / "blobs")
        with _Progress(str(name), missing, lambda: _bytes_under(repo_folder / "blobs") - before, say):
            # By the name given (not the commit), so that huggingface_hub records the branch or tag in the
            # cache's refs/ for later offline starts.
            folder = Path(snapshot_download(name.location, revision=name.revision, cache_dir=cache_dir,
                                            allow_patterns=sorted(wanted), endpoint=endpoint))
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
    for file, entry in wanted.items():
        path = folder / file
        lfs = getattr(entry, "lfs", None)
        expected_size = lfs.size if lfs is not None else entry.size
        _verify(str(name), path, expected_size,
                ("sha256", lfs.sha256) if lfs is not None and file not in cached else None)
    return folder


def _needed(file: str) -> bool:
    return any(fnmatch.fnmatch(file, pattern) for pattern in HUB_FILES)


def _require_weights(name: CheckpointName, files: list[str]) -> None:
    if not any(fnmatch.fnmatch(f, p) for f in files for p in WEIGHT_FILES):
        shown = ", ".join(sorted(files)[:8]) or "nothing the loader reads"
        raise CheckpointError(f"{name}: holds no π0.5 weights (model.safetensors, a PEFT adapter or openpi's "
                              f"params/); it has {shown}")


# ------------------------------------------------------------------------------------- openpi's bucket

def openpi_cache_dir(openpi_cache: str | Path | None = None) -> Path:
    """openpi's cache folder: `$OPENPI_DATA_HOME`, else ~/.cache/openpi."""
    return Path(openpi_cache or os.environ.get(OPENPI_DATA_HOME, "~/.cache/openpi")).expanduser().resolve()


def _fetch_bucket(url: str, say, openpi_cache) -> Path:
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
        if not single:
            _require_weights(CheckpointName("bucket", url), list(files))
        total = sum(int(info.get("size") or 0) for info in files.values())
        _check_space(cache, total - _bytes_under(scratch), CheckpointName("bucket", url))
        say(f"{url}: downloading {len(files)} file(s), {_human(total)} into {local}")
        try:
            with _Progress(url, total, lambda: _bytes_under(scratch), say):
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


def progress_line(name: str, done: int, total: int, elapsed_s: float) -> str:
    """One progress line of a download: bytes, share, rate and the time left at that rate."""
    share = f" ({100 * done / total:.0f}%)" if total else ""
    rate = done / elapsed_s if elapsed_s > 0 else 0.0
    left = f", {(total - done) / rate:.0f} s left" if rate > 0 and total > done else ""
    return f"{name}: {_human(done)} of {_human(total)}{share}, {_human(rate)}/s{left}"


class _Progress:
    """A progress line every PROGRESS_PERIOD_S while a download runs, when stderr is not a terminal (a
    terminal shows the fetching library's bar)."""

    def __init__(self, name: str, total: int, done: Callable[[], int], say: Callable[[str], None],
                 period_s: float = PROGRESS_PERIOD_S, terminal: bool | None = None):
        self.name, self.total, self.done, self.say, self.period_s = name, total, done, say, period_s
        self.quiet = total <= 0 or (sys.stderr.isatty() if terminal is None else terminal)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="checkpoint-download-progress", daemon=True)

    def __enter__(self):
        self._start = time.monotonic()
        if not self.quiet:
            self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join()

    def _run(self):
        while not self._stop.wait(self.period_s):
            self.say(progress_line(self.name, min(self.done(), self.total), self.total,
                                   time.monotonic() - self._start))
