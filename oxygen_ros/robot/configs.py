"""Robot configs (config/<robot>.yaml): where they are installed, and their parameters per node.

Installed data is found the ROS way first: the package's share directory in the ament index
(`get_package_share_directory`), where colcon and the ROS packages put `share/oxygen_ros/config`; then
a source checkout (`config/` next to the package) and a pip install's `<prefix>/share/oxygen_ros/config`.
"""
from __future__ import annotations

import sys
from pathlib import Path

import yaml

PACKAGE = "oxygen_ros"


def config_dirs() -> list[Path]:
    dirs = []
    try:
        from ament_index_python.packages import get_package_share_directory

        dirs.append(Path(get_package_share_directory(PACKAGE)) / "config")
    except (ImportError, LookupError, OSError):   # no ament index, or the package is not in it
        pass
    dirs += [Path(__file__).resolve().parents[2] / "config", Path(sys.prefix) / "share" / PACKAGE / "config"]
    return list(dict.fromkeys(dirs))


def find_config(name: str) -> Path:
    """config/<name>.yaml; FileNotFoundError with one line naming the places looked in."""
    dirs = config_dirs()
    for d in dirs:
        f = d / f"{name}.yaml"
        if f.is_file():
            return f
    raise FileNotFoundError(f"no robot config {name}.yaml in {', '.join(map(str, dirs))}")


def demo_checkpoint(name: str = "demo") -> Path:
    """Shipped demo weights (model.safetensors, norm_stats.json, config.json): "demo", or "demo_rtc" (its
    action expert fine-tuned on the model's own episodes, then with prefix conditioning for real-time
    chunking, docs/rtc.md)."""
    from importlib import resources

    if name not in ("demo", "demo_rtc"):
        raise ValueError(f"no shipped weights {name!r}: demo or demo_rtc")
    return Path(str(resources.files("oxygen_ros.model") / "assets" / name))


def demo_weights_params() -> Path:
    """A parameters file pointing the engine at the shipped demo weights (their path depends on where the
    package is installed, so config/demo.yaml cannot name it)."""
    import hashlib
    import tempfile

    weights = demo_checkpoint()
    digest = hashlib.sha1(str(weights).encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"oxygen_demo_weights_{digest}.yaml"
    path.write_text(f"oxygen_engine:\n  ros__parameters:\n    checkpoint: '{weights}'\n"
                    f"    norm_stats: '{weights / 'norm_stats.json'}'\n")
    return path


def node_params(path: Path, node: str) -> dict:
    """The parameters a node gets from a ROS params file: its section over the `/**` wildcard."""
    data = yaml.safe_load(Path(path).read_text()) or {}
    params = dict((data.get("/**") or {}).get("ros__parameters") or {})
    params.update((data.get(node) or {}).get("ros__parameters") or {})
    return params
