"""State/action (un)normalisation, by the rule of the statistics' origin.

openpi (`norm_stats.json`, openpi `normalize.save`): {"norm_stats": {"state": {"mean", "std", "q01", "q99"},
"actions": {...}}}. π0.5 normalises with quantiles to [-1, 1] (openpi's `use_quantile_norm`):
    x_norm = (x - q01) / (q99 - q01 + 1e-6) * 2 - 1,   x = (x_norm + 1) / 2 * (q99 - q01 + 1e-6) + q01;
π0 used z-scores ((x - mean) / (std + 1e-6)). Statistics may cover fewer dimensions than the model's
padded action_dim: only those are (un)normalised, as upstream. Arithmetic in float64.

LeRobot (a policy directory saved by LeRobot 0.6.1): its pre-processor's `normalizer_processor` step and
its post-processor's `unnormalizer_processor` step, as `policy_preprocessor.json` / `policy_postprocessor.json`
describe them (features, `norm_map` feature type -> mode, `eps`) with their statistics in
`policy_{pre,post}processor_step_<i>_{normalizer,unnormalizer}_processor.safetensors` (flat keys
`observation.state.q01`, `action.std`, `observation.images.<cam>.mean`, ...). Each mode is computed as
LeRobot's `_NormalizationMixin._apply_transform` computes it (`FeatureNorm`): float32 statistics and
float32 arithmetic in its operation order, `eps` (1e-8) only where LeRobot adds it:
    MEAN_STD    (x - mean) / (std + eps)                 x = x_n * std + mean
    MIN_MAX     2 * (x - min) / d - 1, d = max - min     x = (x_n + 1) / 2 * d + min
    QUANTILES   2 * (x - q01) / d - 1, d = q99 - q01     x = (x_n + 1) * d / 2 + q01
    QUANTILE10  as QUANTILES with q10, q90
    IDENTITY    x
with d = eps where it is 0 (a joint that never moved: its value normalises to exactly -1).
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from .files import (LEROBOT_POSTPROCESSOR, LEROBOT_PREPROCESSOR, CheckpointError, JsonObject, is_file_name,
                    present, processor_steps, regular_file)

EPS = 1e-6
LEROBOT_NORMALIZER = "policy_preprocessor_step_*_normalizer_processor.safetensors"
LEROBOT_UNNORMALIZER = "policy_postprocessor_step_*_unnormalizer_processor.safetensors"
# LeRobot 0.6.1's NormalizationMode values and the statistics each needs (lerobot/configs/types.py).
LEROBOT_MODES = {"IDENTITY": (), "MEAN_STD": ("mean", "std"), "MIN_MAX": ("min", "max"),
                 "QUANTILES": ("q01", "q99"), "QUANTILE10": ("q10", "q90")}
LEROBOT_EPS = 1e-8                  # NormalizerProcessorStep's default
# PI05Config.normalization_mapping's default: what a pi05 config.json without the field means.
PI05_NORMALIZATION = {"VISUAL": "IDENTITY", "STATE": "QUANTILES", "ACTION": "QUANTILES"}
LEROBOT_STATE, LEROBOT_ACTION = "observation.state", "action"

log = logging.getLogger(__name__)


@dataclass(frozen=True, eq=False)  # holds arrays: compared by identity
class Stats:
    mean: np.ndarray
    std: np.ndarray
    q01: np.ndarray | None
    q99: np.ndarray | None


def _stats(stats: JsonObject, name: str) -> Stats:
    """One feature's statistics (`state` or `actions` of a norm_stats.json); a CheckpointError naming the file
    and the key when one is missing, not a list of finite numbers, of another length, or out of order (a
    negative std, q99 below q01: no data has them, and they would turn the actions around or divide by 0)."""
    d = stats.object(name)

    def arr(key, required=True):
        values = d.numbers(key)
        if values is None and required:
            raise d.error(key, "is missing")
        return None if values is None else np.asarray(values, dtype=np.float64)

    s = Stats(arr("mean"), arr("std"), arr("q01", False), arr("q99", False))
    dims = {len(x) for x in (s.mean, s.std, s.q01, s.q99) if x is not None}
    if len(dims) != 1:
        raise CheckpointError(f"{d.file}: {d.where.rstrip('.')} has fields of different lengths {sorted(dims)}")
    if np.any(s.std < 0):
        raise d.error("std", "has negative values")
    if s.q01 is not None and s.q99 is not None and np.any(s.q99 < s.q01):
        raise d.error("q99", "is below q01 in some dimensions")
    return s


def is_lerobot_directory(path: str | Path) -> bool:
    """A LeRobot policy directory: its processors' files, and no openpi norm_stats.json."""
    path = Path(path)
    if not path.is_dir() or list(path.glob("**/norm_stats.json")):
        return False
    return any(list(path.glob(pattern)) for pattern in
               (LEROBOT_PREPROCESSOR, LEROBOT_POSTPROCESSOR, LEROBOT_NORMALIZER, LEROBOT_UNNORMALIZER))


def load_normalizer(path: str | Path, asset_id: str | None = None,
                    use_quantiles: bool = True) -> "Normalizer | LeRobotNormalizer":
    """The statistics at `path` with their origin's rule: a LeRobot policy directory -> LeRobot's
    (un)normaliser; otherwise an openpi norm_stats.json or a checkpoint directory holding
    assets/<asset_id>/norm_stats.json -> openpi's (quantiles unless `use_quantiles` is False)."""
    if is_lerobot_directory(path):
        return LeRobotNormalizer.load(path)
    return Normalizer.load(path, asset_id, use_quantiles)


@dataclass(frozen=True, eq=False)
class Normalizer:
    """openpi's rule (float64)."""

    state: Stats | None
    actions: Stats | None
    use_quantiles: bool = True
    source: str = ""                # where the statistics came from (the log's words)

    @classmethod
    def identity(cls) -> "Normalizer":
        return cls(None, None, source="none (no normalisation)")

    def describe(self) -> str:
        return f"{self.source} (openpi rule, {'quantiles' if self.use_quantiles else 'mean/std'})"

    @classmethod
    def load(cls, path: str | Path, asset_id: str | None = None, use_quantiles: bool = True) -> "Normalizer":
        """`path`: an openpi norm_stats.json, or a checkpoint directory holding assets/<asset_id>/norm_stats.json."""
        path = Path(path)
        if is_lerobot_directory(path):
            raise CheckpointError(f"{path}: a LeRobot policy directory, not openpi statistics (load_normalizer "
                                  f"reads it with LeRobot's rule)")
        if path.is_dir():
            # openpi asset ids may contain a slash (assets/physical-intelligence/libero/norm_stats.json).
            found = sorted(path.glob("assets/**/norm_stats.json")) + sorted(path.glob("norm_stats.json"))
            if asset_id is not None:
                found = [f for f in found if f.parent == path / "assets" / asset_id]
            if len(found) != 1:
                raise CheckpointError(f"{path}: expected one norm_stats.json (asset_id={asset_id!r}), found "
                                      f"{[str(f.relative_to(path)) for f in found] or 'none'}")
            path = found[0]
        data = JsonObject.load(path)
        stats = data.object("norm_stats") if "norm_stats" in data.data else data
        if stats is None:
            raise CheckpointError(f"{path}: norm_stats is null, not the statistics")
        unknown = sorted(set(stats.keys()) - {"state", "actions"})
        if unknown:
            raise CheckpointError(f"{path}: unknown norm stats keys {unknown} (expected 'state' and 'actions')")
        norm = cls(_stats(stats, "state") if stats.given("state") else None,
                   _stats(stats, "actions") if stats.given("actions") else None, use_quantiles, str(path))
        if norm.state is None and norm.actions is None:
            raise CheckpointError(f"{path}: no state or action statistics found")
        if norm.use_quantiles:
            for name, s in (("state", norm.state), ("actions", norm.actions)):
                if s is not None and (s.q01 is None or s.q99 is None):
                    raise CheckpointError(f"{path}: quantile normalisation (π0.5) needs q01 and q99 for '{name}'")
        return norm

    def normalize_state(self, x: np.ndarray) -> np.ndarray:
        return self._apply(self.state, np.asarray(x, dtype=np.float64), forward=True)

    def unnormalize_actions(self, x: np.ndarray) -> np.ndarray:
        return self._apply(self.actions, np.asarray(x, dtype=np.float64), forward=False)

    def _apply(self, s: Stats | None, x: np.ndarray, forward: bool) -> np.ndarray:
        if s is None:
            return x
        dim = min(len(s.mean), x.shape[-1])
        head, tail = x[..., :dim], x[..., dim:]
        if self.use_quantiles:
            lo, span = s.q01[:dim], s.q99[:dim] - s.q01[:dim] + EPS
            head = (head - lo) / span * 2.0 - 1.0 if forward else (head + 1.0) / 2.0 * span + lo
        else:
            mean, std = s.mean[:dim], s.std[:dim] + EPS
            head = (head - mean) / std if forward else head * std + mean
        return np.concatenate([head, tail], axis=-1)


# --------------------------------------------------------------------------------------------- LeRobot
@dataclass(frozen=True, eq=False)
class FeatureNorm:
    """One feature's (un)normalisation as LeRobot 0.6.1 computes it (see the module docstring): float32
    statistics (as LeRobot stores and loads them) and float32 arithmetic (its tensors' dtype) in its
    operation order, so that the results agree bit for bit."""

    feature: str
    mode: str               # a LEROBOT_MODES key other than IDENTITY
    lo: np.ndarray          # float32: mean, min, q01 or q10
    hi: np.ndarray          # float32: std, max, q99 or q90
    eps: np.float32

    @property
    def dim(self) -> int:
        return self.lo.shape[0]

    def _span(self) -> np.ndarray:
        span = self.hi - self.lo
        return np.where(span == 0, self.eps, span)

    def forward(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        if self.mode == "MEAN_STD":
            return (x - self.lo) / (self.hi + self.eps)
        return 2.0 * (x - self.lo) / self._span() - 1.0

    def inverse(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        if self.mode == "MEAN_STD":
            return x * self.hi + self.lo
        if self.mode == "MIN_MAX":
            return (x + 1.0) / 2.0 * self._span() + self.lo
        return (x + 1.0) * self._span() / 2.0 + self.lo


@dataclass(frozen=True, eq=False)
class LeRobotNormalizer:
    """A LeRobot policy directory's normaliser (state, images) and unnormaliser (actions); None or absent:
    IDENTITY. Inputs are taken as float32, as LeRobot's dataset and inference frames are."""

    state: FeatureNorm | None
    actions: FeatureNorm | None
    images: dict[str, FeatureNorm] = field(default_factory=dict)   # VISUAL feature -> its normalisation
    modes: dict[str, str] = field(default_factory=dict)            # feature type -> mode, as the files say
    source: str = ""

    def describe(self) -> str:
        modes = ", ".join(f"{t} {m}" for t, m in self.modes.items())
        return f"{self.source} (LeRobot rule, float32: {modes})"

    def normalize_state(self, x: np.ndarray) -> np.ndarray:
        x = np.asarray(x, dtype=np.float32)
        if self.state is None:
            return x
        if x.shape[-1] != self.state.dim:
            raise ValueError(f"state has {x.shape[-1]} values, the LeRobot checkpoint's {self.state.feature} "
                             f"{self.state.dim}")
        return self.state.forward(x)

    def unnormalize_actions(self, x: np.ndarray) -> np.ndarray:
        """[..., A] -> float32; the first `actions.dim` dimensions (the action feature) un-normalised."""
        x = np.asarray(x, dtype=np.float32)
        if self.actions is None:
            return x
        if x.shape[-1] < self.actions.dim:
            raise ValueError(f"actions have {x.shape[-1]} dimensions, the LeRobot checkpoint's "
                             f"{self.actions.feature} {self.actions.dim}")
        head = self.actions.inverse(x[..., :self.actions.dim])
        return np.concatenate([head, x[..., self.actions.dim:]], axis=-1)

    def normalize_image(self, feature: str, x: np.ndarray) -> np.ndarray:
        """A camera's float32 [3, H, W] image in [0, 1] (before LeRobot's resize), normalised when its
        VISUAL mode says so."""
        norm = self.images.get(feature)
        return np.asarray(x, np.float32) if norm is None else norm.forward(x)

    @classmethod
    def load(cls, path: str | Path) -> "LeRobotNormalizer":
        """From the processor files LeRobot serves the directory with. Every feature's mode must be one
        LeRobot 0.6.1 defines and have its statistics: otherwise a one-line CheckpointError naming both."""
        path = Path(path)
        pre = _processor_step(path, LEROBOT_PREPROCESSOR, "normalizer_processor", LEROBOT_NORMALIZER)
        post = _processor_step(path, LEROBOT_POSTPROCESSOR, "unnormalizer_processor", LEROBOT_UNNORMALIZER)
        if pre is None and post is None:
            raise CheckpointError(f"{path}: no LeRobot normaliser or unnormaliser found (policy_preprocessor.json, "
                             f"policy_postprocessor.json or their statistics files)")
        # The state and images: the pre-processor's normaliser; the actions: the post-processor's
        # unnormaliser (LeRobot's own split), or the normaliser when the directory has no post-processor.
        action_step = post or pre
        for step in (s for s in (pre, post) if s is not None):
            for kind, mode in step.norm_map.items():
                if mode not in LEROBOT_MODES:
                    named = [f for f, t in step.features.items() if t == kind] or [f"(no {kind} feature)"]
                    raise CheckpointError(f"{step.config_file}: feature {', '.join(named)} ({kind}) has "
                                          f"normalisation mode '{mode}', not one of LeRobot 0.6.1's "
                                          f"{', '.join(LEROBOT_MODES)}")
        modes = dict(action_step.norm_map) | (dict(pre.norm_map) if pre else {})
        _check_config_mapping(path, modes)

        def norm(step: _Step, feature: str, kind: str) -> FeatureNorm | None:
            mode = step.norm_map.get(kind, "IDENTITY")        # LeRobot: a type not in norm_map is IDENTITY
            if mode == "IDENTITY" or not step.normalizes(feature):
                return None
            needs = LEROBOT_MODES[mode]
            missing = [k for k in needs if f"{feature}.{k}" not in step.stats]
            if missing:
                raise CheckpointError(f"{step.stats_file or step.config_file}: feature '{feature}' ({kind}) is "
                                      f"normalised with {mode}, but {step.stats_name} has no "
                                      f"{' or '.join(missing)} for it")
            lo, hi = (step.stats[f"{feature}.{k}"] for k in needs)
            if kind == "VISUAL" and lo.ndim == 1:         # per-channel stats broadcast over [C, H, W]
                lo, hi = lo.reshape(-1, 1, 1), hi.reshape(-1, 1, 1)
            if lo.shape != hi.shape or lo.size == 0 or (kind != "VISUAL" and lo.ndim != 1) \
                    or not (np.all(np.isfinite(lo)) and np.all(np.isfinite(hi))):
                raise CheckpointError(f"{step.stats_file}: feature '{feature}' ({kind}) {mode} statistics "
                                      f"{'/'.join(needs)} must be finite vectors of one length, got shapes "
                                      f"{list(lo.shape)} and {list(hi.shape)}")
            # A negative std or a maximum below its minimum comes from no data; it would turn the values
            # around (or, with eps, divide by 0).
            if np.any(hi < 0) if mode == "MEAN_STD" else np.any(hi < lo):
                raise CheckpointError(f"{step.stats_file}: feature '{feature}' {needs[1]} "
                                      + ("has negative values" if mode == "MEAN_STD" else f"is below {needs[0]}"))
            return FeatureNorm(feature, mode, lo, hi, np.float32(step.eps))

        # LeRobot normalises the observation features its normaliser lists (by their type); the action
        # by the ACTION mode alone.
        state_kind = pre.features.get(LEROBOT_STATE) if pre else None
        state = norm(pre, LEROBOT_STATE, state_kind) if state_kind else None
        actions = norm(action_step, LEROBOT_ACTION, "ACTION")
        images = {f: n for f, kind in (pre.features.items() if pre else ()) if kind == "VISUAL"
                  for n in [norm(pre, f, kind)] if n is not None}
        return cls(state, actions, images, {k: modes[k] for k in ("STATE", "ACTION", "VISUAL") if k in modes},
                   f"LeRobot processors in {path}")


@dataclass(frozen=True)
class _Step:
    """A LeRobot (un)normaliser step: its config and its statistics (float32, as LeRobot loads them)."""

    norm_map: dict[str, str]            # feature type -> mode
    features: dict[str, str]            # feature -> type
    eps: float
    only: frozenset[str] | None         # normalize_observation_keys (None: every observation feature)
    stats: dict[str, np.ndarray]
    stats_file: Path | None             # where the statistics are (None: the step names no state_file)
    config_file: Path                   # where the modes are

    @property
    def stats_name(self) -> str:
        return self.stats_file.name if self.stats_file else f"{self.config_file.name} (no state_file)"

    def normalizes(self, feature: str) -> bool:
        return feature == LEROBOT_ACTION or self.only is None or feature in self.only


def _stats_of(file: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    regular_file(file)                 # before safetensors opens it: opening a FIFO blocks
    try:
        return {k: v.astype(np.float32) for k, v in load_file(str(file)).items()}
    except Exception as e:  # noqa: BLE001 - SafetensorError (not exported), OSError: the file is unusable
        raise CheckpointError(f"{file}: not a readable safetensors file ({e})") from None


def _processor_step(path: Path, pipeline: str, registry_name: str, pattern: str) -> _Step | None:
    """The step `registry_name` of the processor JSON `pipeline`, with its statistics. A directory without
    the JSON (only the statistics files) is read as a pi05 config.json describes it: modes from its
    normalization_mapping (pi05's default when absent), eps 1e-8, features by LeRobot's names."""
    config_file = path / pipeline
    if present(config_file):
        entries = processor_steps(config_file, registry_name)
        if not entries:
            return None
        if len(entries) > 1:
            raise CheckpointError(f"{config_file}: {len(entries)} {registry_name} steps, expected one")
        step = entries[0]
        config = step.object("config") or JsonObject({}, config_file, f"{step.where}config.")
        state_file = step.string("state_file")
        if state_file is not None and not is_file_name(state_file):
            raise step.error("state_file", f"must be a file name in {path}, got {state_file!r}")
        stats = _stats_of(path / state_file) if state_file else {}
        only = config.strings("normalize_observation_keys")
        eps = config.number("eps", 0.0, 1.0)
        return _Step(_modes(config, "norm_map") or {}, _feature_types(config, "features"),
                     LEROBOT_EPS if eps is None else float(eps), None if only is None else frozenset(only), stats,
                     path / state_file if state_file else None, config_file)
    files = sorted(path.glob(pattern))
    if not files:
        return None
    if len(files) > 1:
        raise CheckpointError(f"{path}: several {pattern} files {[f.name for f in files]} and no {pipeline} to "
                              f"say which is used")
    stats = _stats_of(files[0])
    config = _config(path)
    features = _feature_types(config, "input_features") | _feature_types(config, "output_features")
    if not features:                    # no config.json features: LeRobot's names say what each one is
        names = {k.rsplit(".", 1)[0] for k in stats}
        features = {n: "STATE" if n == LEROBOT_STATE else "ACTION" if n == LEROBOT_ACTION else "VISUAL"
                    for n in names if n in (LEROBOT_STATE, LEROBOT_ACTION) or n.startswith("observation.images.")}
    return _Step(_config_mapping(path) or dict(PI05_NORMALIZATION), features, LEROBOT_EPS, None, stats,
                 files[0], path / "config.json")


def _feature_types(config: JsonObject, key: str) -> dict[str, str]:
    """{feature: its type} of a features object (config.json's input_features, a step's features)."""
    features = config.object(key)
    types = {}
    for name in features.keys() if features else ():
        feature = features.object(name)
        if feature is not None:
            types[name] = str(feature.string("type"))
    return types


def _modes(config: JsonObject, key: str) -> dict[str, str] | None:
    """A {feature type: mode} object (a step's norm_map, config.json's normalization_mapping)."""
    modes = config.object(key)
    return None if modes is None else {kind: modes.string(kind) for kind in modes.keys() if modes.given(kind)}


def _config(path: Path) -> JsonObject:
    """The directory's config.json (empty when there is none)."""
    config = path / "config.json"
    return JsonObject.load(config) if present(config) else JsonObject({}, config)


def _config_mapping(path: Path) -> dict[str, str] | None:
    """config.json's normalization_mapping (None: no config.json or no such field)."""
    return _modes(_config(path), "normalization_mapping")


def _check_config_mapping(path: Path, modes: dict[str, str]) -> None:
    """LeRobot serves a directory with its processor files' modes; config.json says which modes it was
    configured with. A difference (a hand-edited file) is served as LeRobot serves it, and said."""
    written = _config_mapping(path) or {}
    differ = [f"{t}: processors {modes.get(t, 'IDENTITY')}, config.json {m}" for t, m in written.items()
              if modes.get(t, "IDENTITY") != m]
    if differ:
        log.warning(f"{path}: config.json's normalization_mapping differs from the processor files ("
                    + "; ".join(differ) + "): the processor files' modes are applied, as LeRobot does")
