"""openpi normalisation statistics (`norm_stats.json`) and the state/action (un)normalisation.

File format (openpi `normalize.save`): {"norm_stats": {"state": {"mean", "std", "q01", "q99"},
"actions": {...}}}. π0.5 normalises with quantiles to [-1, 1]:
    x_norm = (x - q01) / (q99 - q01 + 1e-6) * 2 - 1,   x = (x_norm + 1) / 2 * (q99 - q01 + 1e-6) + q01;
π0 used z-scores ((x - mean) / (std + 1e-6)). Statistics may cover fewer dimensions than the model's
padded action_dim: only those are (un)normalised, as upstream.

LeRobot directories keep the same statistics in their processors' state:
`policy_preprocessor_step_<i>_normalizer_processor.safetensors` (and the post-processor's
`..._unnormalizer_processor.safetensors`), flat keys `observation.state.q01`, `action.q99`, ...; LeRobot's
quantile formula agrees with openpi's to ~1e-6, and openpi's is the one applied here.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

EPS = 1e-6
LEROBOT_NORMALIZER = "policy_preprocessor_step_*_normalizer_processor.safetensors"
LEROBOT_UNNORMALIZER = "policy_postprocessor_step_*_unnormalizer_processor.safetensors"


@dataclass(frozen=True, eq=False)  # holds arrays: compared by identity
class Stats:
    mean: np.ndarray
    std: np.ndarray
    q01: np.ndarray | None
    q99: np.ndarray | None


def _stats(name: str, d: dict) -> Stats:
    def arr(key, required=True):
        if key not in d or d[key] is None:
            if required:
                raise ValueError(f"norm stats '{name}' lacks '{key}'")
            return None
        a = np.asarray(d[key], dtype=np.float64)
        if a.ndim != 1 or not np.all(np.isfinite(a)):
            raise ValueError(f"norm stats '{name}.{key}' must be a finite 1-D list")
        return a

    s = Stats(arr("mean"), arr("std"), arr("q01", False), arr("q99", False))
    dims = {len(x) for x in (s.mean, s.std, s.q01, s.q99) if x is not None}
    if len(dims) != 1:
        raise ValueError(f"norm stats '{name}' have fields of different lengths {sorted(dims)}")
    return s


@dataclass(frozen=True, eq=False)
class Normalizer:
    state: Stats | None
    actions: Stats | None
    use_quantiles: bool = True

    @classmethod
    def identity(cls) -> "Normalizer":
        return cls(None, None)

    @classmethod
    def load(cls, path: str | Path, asset_id: str | None = None, use_quantiles: bool = True) -> "Normalizer":
        """`path`: a norm_stats.json, a checkpoint directory holding assets/<asset_id>/norm_stats.json, or a
        LeRobot policy directory (its normaliser processors' safetensors)."""
        path = Path(path)
        lerobot = [f for pattern in (LEROBOT_NORMALIZER, LEROBOT_UNNORMALIZER)
                   for f in sorted(path.glob(pattern))] if path.is_dir() else []
        if lerobot and not list(path.glob("**/norm_stats.json")):
            return cls._check(cls._from_lerobot(lerobot, use_quantiles), path)
        if path.is_dir():
            # openpi asset ids may contain a slash (assets/physical-intelligence/libero/norm_stats.json).
            found = sorted(path.glob("assets/**/norm_stats.json")) + sorted(path.glob("norm_stats.json"))
            if asset_id is not None:
                found = [f for f in found if f.parent == path / "assets" / asset_id]
            if len(found) != 1:
                raise ValueError(f"{path}: expected one norm_stats.json (asset_id={asset_id!r}), found "
                                 f"{[str(f.relative_to(path)) for f in found] or 'none'}")
            path = found[0]
        try:
            data = json.loads(path.read_text())
        except ValueError as e:  # JSONDecodeError, UnicodeDecodeError
            raise ValueError(f"{path}: not valid JSON ({e})") from None
        stats = data.get("norm_stats", data) if isinstance(data, dict) else None
        if not isinstance(stats, dict):
            raise ValueError(f"{path}: not an openpi norm_stats.json")
        unknown = sorted(set(stats) - {"state", "actions"})
        if unknown:
            raise ValueError(f"{path}: unknown norm stats keys {unknown} (expected 'state' and 'actions')")
        norm = cls(_stats("state", stats["state"]) if "state" in stats else None,
                   _stats("actions", stats["actions"]) if "actions" in stats else None, use_quantiles)
        return cls._check(norm, path)

    @classmethod
    def _from_lerobot(cls, files: list[Path], use_quantiles: bool) -> "Normalizer":
        """State and action statistics from LeRobot processor files (the first file holding each wins:
        the pre-processor's normaliser, then the post-processor's unnormaliser)."""
        from safetensors.numpy import load_file

        found: dict[str, dict] = {}
        for f in files:
            flat = load_file(str(f))
            for feature, ours in (("observation.state", "state"), ("action", "actions")):
                stats = {k[len(feature) + 1:]: v.tolist() for k, v in flat.items() if k.startswith(feature + ".")
                         and "." not in k[len(feature) + 1:]}
                if stats and ours not in found:
                    found[ours] = stats
        return cls(_stats("state", found["state"]) if "state" in found else None,
                   _stats("actions", found["actions"]) if "actions" in found else None, use_quantiles)

    @staticmethod
    def _check(norm: "Normalizer", path: Path) -> "Normalizer":
        if norm.state is None and norm.actions is None:
            raise ValueError(f"{path}: no state or action statistics found")
        if norm.use_quantiles:
            for name, s in (("state", norm.state), ("actions", norm.actions)):
                if s is not None and (s.q01 is None or s.q99 is None):
                    raise ValueError(f"{path}: quantile normalisation (π0.5) needs q01 and q99 for '{name}'")
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
