"""Build an Engine from user-level choices: a model preset or config file, an optional checkpoint,
tokenizer and norm stats, the device, and the robot(s) it serves (each its policy I/O and norm stats). The one place that wires model, pool, runner and engine together
(the bringup, the benchmark and the tests all come through here)."""
from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path

import torch

from oxygen_ros.model.checkpoint import check_weights, init_random_weights, lerobot_policy, load_pi05
from oxygen_ros.model.config import Pi05Config, load_config, preset
from oxygen_ros.model.files import present
from oxygen_ros.model.pi05 import Pi05
from oxygen_ros.model.tokenizer import Tokenizer
from oxygen_ros.robot.policy_io import RobotIOConfig, build_policy_io

from .config import EngineConfig
from .engine import Engine
from .frames import FramePreparer
from .kv_pool import KVPool
from .model_runner import ModelRunner

DEFAULT_DTYPE = {"cpu": torch.float32, "cuda": torch.bfloat16}


def model_config(model: str | Pi05Config, **overrides) -> Pi05Config:
    """A preset name (tiny, bench, pi05), a config file path, or a config; then field overrides."""
    if isinstance(model, Pi05Config):
        cfg = model
    elif Path(model).suffix in (".json", ".yaml", ".yml"):
        cfg = load_config(model)
    else:
        cfg = preset(model)
    overrides = {k: v for k, v in overrides.items() if v is not None}
    return cfg.replace(**overrides) if overrides else cfg


def build_model(cfg: Pi05Config, checkpoint: str | None = None, device: str = "cpu",
                dtype: torch.dtype | None = None, seed: int = 0, stop=None, checkpoint_base: str | None = None) -> Pi05:
    """Weights from the checkpoint, or deterministic random weights (demo and tests) when none is given.
    `stop`: load_pi05's (a threading.Event that ends the load between tensors)."""
    dtype = dtype or DEFAULT_DTYPE[torch.device(device).type]
    if checkpoint:
        return load_pi05(checkpoint, cfg, device, dtype, stop=stop, base=checkpoint_base)
    model = init_random_weights(Pi05(cfg), seed)
    return model.to(device=device).to_serving_dtype(dtype).eval().requires_grad_(False)


def build_engine(model: str | Pi05Config = "tiny", *, checkpoint: str | None = None,
                 checkpoint_base: str | None = None, tokenizer: str | None = None, norm_stats: str | Mapping[str, str | None] | None = None,
                 asset_id: str | Mapping[str, str | None] | None = None,
                 engine: EngineConfig | None = None, device: str = "cpu", dtype: torch.dtype | None = None,
                 kv_budget_mb: float = 256.0, block_size: int = 16, backend: str | None = None,
                 robot_io: RobotIOConfig | None = None, robots: Mapping[str, RobotIOConfig] | None = None,
                 state_in_prompt: bool = True, seed: int = 0,
                 built_model: Pi05 | None = None, make_runner: Callable[[Pi05, KVPool, str], ModelRunner] = ModelRunner,
                 stop=None, **config_overrides) -> Engine:
    """`robots`: {name: its RobotIOConfig} for an engine serving several robots (the model and the KV pool
    are shared; {} for none yet: add them with `Engine.add_robot` and `robot_preparer`); without it the
    engine serves one robot, "", with `robot_io`. `norm_stats` and `asset_id`: one source for every robot,
    or {robot: source} (None: a LeRobot checkpoint's own statistics, else identity) — a fleet may mix
    embodiments, each with its own norm_stats.json. `make_runner(model, pool, backend)`: the engine's door to
    the model; a subclass of ModelRunner may stand for a device (the preparer benchmark's device-bound cycle,
    bench/preparer.py). `stop`: build_model's. Every problem is listed before refusing."""
    from oxygen_ros.model.attention import default_backend

    robots = _robots(robot_io, robots)
    norm_sources = _per_robot(robots, norm_stats=norm_stats, asset_id=asset_id)

    if built_model is not None and config_overrides:
        # They would be ignored: the built model has its config (a misspelt keyword must not vanish either).
        raise TypeError(f"build_engine: model config overrides {sorted(config_overrides)} with a built model")
    cfg = built_model.cfg if built_model is not None else model_config(model, **config_overrides)
    if tokenizer is None and checkpoint and cfg.vocab_size > 50_000:
        # Real weights need their own tokenizer; random weights (benchmarks) run with the shipped small one.
        raise ValueError("a full-vocabulary checkpoint needs its tokenizer: give the PaliGemma tokenizer path")
    tok = Tokenizer(tokenizer) if tokenizer else Tokenizer.tiny()
    net = built_model if built_model is not None else \
        build_model(cfg, checkpoint, device, dtype, seed, stop, checkpoint_base)
    backend = backend or default_backend(net.device)
    net.backend = backend
    pool = KVPool.from_budget(int(kv_budget_mb * 2**20), cfg.vlm.depth, cfg.vlm.num_kv_heads, cfg.vlm.head_dim,
                              block_size, net.dtype, net.device)
    preparers = {name: robot_preparer(cfg, tok, io_cfg, norm_sources["norm_stats"][name],
                                      norm_sources["asset_id"][name], state_in_prompt, checkpoint)
                 for name, io_cfg in robots.items()}
    # A pi052 checkpoint's prompt format: hierarchy "auto" serves its recipe (tasks/hierarchy.py).
    lerobot = lerobot_policy(checkpoint) if checkpoint else None
    return Engine(make_runner(net, pool, backend), preparers, tok, engine or EngineConfig(),
                  text_format=lerobot.pi052 if lerobot else None)


def file_problems(cfg: Pi05Config, *, checkpoint: str | None = None, checkpoint_base: str | None = None,
                  tokenizer: str | None = None,
                  norm_stats: str | Mapping[str, str | None] | None = None,
                  asset_id: str | Mapping[str, str | None] | None = None, robot_io: RobotIOConfig | None = None,
                  robots: Mapping[str, RobotIOConfig] | None = None) -> list[str]:
    """Every problem with the files an engine would be built from (build_engine's arguments), one line each,
    found as build_engine finds them but with nothing loaded: the weights' headers (names, shapes, dtypes
    against `cfg`), the tokenizer, each robot's statistics and policy I/O. The engine node lists these with
    its other parameter problems before anything starts. A source that is not there at all is left to the
    caller, which names it by its parameter."""
    problems: list[str] = []

    def check(run: Callable[[], object], robot: str = "") -> None:
        try:
            run()
        except ValueError as e:           # CheckpointError, the policy I/O's ConfigError
            for line in str(e).splitlines():
                line = f"{robot}: {line}" if robot else line
                if line not in problems:  # the checkpoint's own files, once for every robot
                    problems.append(line)

    there = (lambda source: source if source and present(source) else None)
    checkpoint, tokenizer = there(checkpoint), there(tokenizer)
    if checkpoint:
        check(lambda: check_weights(checkpoint, cfg, there(checkpoint_base)))
    if tokenizer:
        check(lambda: Tokenizer(tokenizer))
    try:
        robots = _robots(robot_io, robots)
        sources = _per_robot(robots, norm_stats=norm_stats, asset_id=asset_id)
    except ValueError as e:
        return problems + str(e).splitlines()
    for name, io_cfg in robots.items():
        check(lambda: build_policy_io(io_cfg, checkpoint=checkpoint, norm_stats=there(sources["norm_stats"][name]),
                                      asset_id=sources["asset_id"][name], model_action_dim=cfg.action_dim,
                                      image_size=cfg.vision.image_size, camera_slots=cfg.camera_slots), name)
    return problems


def robot_preparer(cfg: Pi05Config, tokenizer: Tokenizer, io_cfg: RobotIOConfig, norm_stats: str | None = None,
                   asset_id: str | None = None, state_in_prompt: bool = True,
                   checkpoint: str | None = None) -> FramePreparer:
    """One robot's side of an engine (also for `Engine.add_robot`): the policy I/O its checkpoint was
    trained with (LeRobot's or openpi's, robot/policy_io.build_policy_io) and its statistics, at the model's
    action width and image size."""
    io = build_policy_io(io_cfg, checkpoint=checkpoint, norm_stats=norm_stats, asset_id=asset_id,
                         model_action_dim=cfg.action_dim, image_size=cfg.vision.image_size,
                         camera_slots=cfg.camera_slots)
    return FramePreparer(cfg, tokenizer, io, state_in_prompt)


def _robots(robot_io: RobotIOConfig | None, robots: Mapping[str, RobotIOConfig] | None) -> dict[str, RobotIOConfig]:
    if robots is None:
        return {"": robot_io or RobotIOConfig()}
    problems = []
    if robot_io is not None:
        problems.append("give robot_io (one robot) or robots (several), not both")
    if not isinstance(robots, Mapping):
        problems.append(f"robots must be a mapping name -> RobotIOConfig, got {robots!r}")
    else:
        problems += [f"robot name {name!r} must be text" for name in robots if not isinstance(name, str)]
        problems += [f"robot {name!r}: expected a RobotIOConfig, got {type(c).__name__}"
                     for name, c in robots.items() if not isinstance(c, RobotIOConfig)]
    if problems:
        raise ValueError("build_engine: " + "; ".join(problems))
    return dict(robots)


def _per_robot(robots: dict[str, RobotIOConfig], **sources) -> dict[str, dict[str, str | None]]:
    """Each source (one value for every robot, or {robot: value}) as {robot: value}."""
    out, problems = {}, []
    for key, value in sources.items():
        if isinstance(value, Mapping):
            missing, unknown = [r for r in robots if r not in value], [r for r in value if r not in robots]
            if missing:
                problems.append(f"{key} names no source for robots {missing} (give None for identity)")
            if unknown:
                problems.append(f"{key} names robots {unknown} this engine does not serve {list(robots)}")
            out[key] = {r: value.get(r) for r in robots}
        else:
            out[key] = dict.fromkeys(robots, value)
    if problems:
        raise ValueError("build_engine: " + "; ".join(problems))
    return out
