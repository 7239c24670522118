"""Shared test fixtures: a small π0.5 (56 px images = 16 tokens per camera) that makes engine tests fast,
observations, and a simulated clock."""
from __future__ import annotations

import os

# The Triton kernels run on the CPU through Triton's interpreter. TRITON_INTERPRET is read when a function
# is decorated with @triton.jit (Triton's own library at `import triton`), so it is set here, before any
# test module can import triton. OXYGEN_KERNEL_TEST_DEVICE=cuda runs the kernel tests compiled on a GPU.
KERNEL_TEST_DEVICE = os.environ.get("OXYGEN_KERNEL_TEST_DEVICE", "cpu")
if KERNEL_TEST_DEVICE == "cpu":
    os.environ["TRITON_INTERPRET"] = "1"

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import pytest  # noqa: E402
import torch  # noqa: E402

from oxygen_ros.model.config import GemmaConfig, Pi05Config, VisionConfig  # noqa: E402
from oxygen_ros.robot.policy_io import RobotIOConfig  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
SHARED = REPO.parent / "shared"
ORACLE = SHARED / "oracle"

# One torch thread per test worker when the suite runs in parallel workers (scripts/test.sh: one per core):
# more threads than cores make each worker spin against the other (a model test took 77 s instead of 7 s).
WORKERS = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
torch.set_num_threads(1 if WORKERS > 1 else min(2, torch.get_num_threads()))
if WORKERS > 1:
    os.environ.setdefault("OMP_NUM_THREADS", "1")         # the processes the tests start (bringup, tools)

# The files that take longest start first, so that parallel workers finish together (longest first); the
# order within a file and of the others is kept. Measured with `scripts/test.sh --durations=40`.
SLOW_FIRST = ("test_install.py", "test_bringup_params.py", "test_bench.py", "test_demo_model.py", "test_colcon.py",
              "test_console.py", "test_fleet_netns.py", "test_lifecycle.py", "test_fleet_ros.py", "test_nodes.py")


def pytest_collection_modifyitems(config, items):
    rank = {name: i for i, name in enumerate(SLOW_FIRST)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))


def small_config(**overrides) -> Pi05Config:
    cfg = Pi05Config(
        vlm=GemmaConfig(width=64, depth=2, mlp_dim=128, num_heads=4, num_kv_heads=1, head_dim=16),
        expert=GemmaConfig(width=32, depth=2, mlp_dim=64, num_heads=4, num_kv_heads=1, head_dim=16),
        vision=VisionConfig(width=32, depth=1, mlp_dim=64, num_heads=2, image_size=56),
        vocab_size=1000, action_dim=8, action_horizon=5, max_token_len=48, num_denoise_steps=4)
    return cfg.replace(**overrides) if overrides else cfg


class SimClock:
    """A clock the test advances by hand (engine decisions see only this time)."""

    def __init__(self, t: float = 100.0):
        self.t = t

    def __call__(self) -> float:
        return self.t

    def advance(self, dt: float) -> None:
        self.t += dt


# Simulated model costs (engine tests on a SimClock): what each runner operation advances the clock by.
PREFILL_S, ACTION_S = 0.040, 0.030
TOKEN_S = 0.0005          # each question token beyond one per row (chunked question prefill)


def decode_cost(batch: int) -> float:
    return 0.010 + 0.002 * batch


def extend_cost(rows) -> float:
    """A forward over text rows: a decode step of that many rows, plus the extra question tokens."""
    return decode_cost(len(rows)) + TOKEN_S * sum(len(r.tokens) - 1 for r in rows)


def simulate_costs(engine, clock: SimClock, calls: list | None = None):
    """Wrap the runner (tests only) so each operation advances the simulated clock by a known cost."""
    runner = engine.runner

    def wrap(name, cost):
        real = getattr(runner, name)

        def timed(*args, **kwargs):
            out = real(*args, **kwargs)
            clock.advance(cost(*args))
            if calls is not None:
                calls.append(name)
            return out
        setattr(runner, name, timed)

    wrap("prefill", lambda *a: PREFILL_S)
    wrap("actions", lambda *a: ACTION_S)
    wrap("extend", extend_cost)


def make_observation(i: int, size: int = 56, cameras=(True, True, False), prompt: str = "pick up the red cup",
                     state_dim: int = 8, seed: int = 0):
    from oxygen_ros.robot.sync import Observation

    rng = np.random.default_rng(seed * 100_003 + i)
    slots = ("base_0_rgb", "left_wrist_0_rgb", "right_wrist_0_rgb")
    images = {s: (rng.integers(0, 256, (size, size, 3), dtype=np.uint8) if on else None)
              for s, on in zip(slots, cameras)}
    return Observation(stamp_s=float(i) * 0.1, images=images, image_masks=dict(zip(slots, cameras)),
                       state=rng.uniform(-1, 1, state_dim), prompt=prompt)


@pytest.fixture(scope="session")
def small_model():
    from oxygen_ros.engine.factory import build_model

    return build_model(small_config(), seed=3)


@pytest.fixture
def engine_factory(small_model):
    """make(policy=..., clock=..., kv_budget_mb=..., **EngineConfig fields) -> Engine on the small model."""
    from oxygen_ros.engine.engine import EngineConfig
    from oxygen_ros.engine.factory import build_engine

    def make(kv_budget_mb: float = 4.0, block_size: int = 16, clock=None, model=None, **cfg):
        engine = build_engine(built_model=model or small_model, engine=EngineConfig(**cfg),
                              kv_budget_mb=kv_budget_mb, block_size=block_size,
                              robot_io=RobotIOConfig(robot_action_dim=7))
        if clock is not None:
            engine.clock = clock
        return engine

    return make


@pytest.fixture
def obs():
    return make_observation


@pytest.fixture
def ros():
    """A private rclpy context for nodes built in the test process: .context, .add(node) -> node (destroyed,
    with the context, after the test)."""
    import types

    import rclpy
    from rclpy.context import Context

    context = Context()
    rclpy.init(context=context)
    nodes = []

    def add(node):
        nodes.append(node)
        return node

    yield types.SimpleNamespace(context=context, add=add)
    for node in nodes:
        node.destroy_node()
    rclpy.shutdown(context=context)


def drain(engine, start: int = 100, limit: int = 200, frames=None) -> None:
    """Run synchronous cycles on fresh observations (`frames(i)` -> {robot: obs}; default the single robot's
    make_observation(i)) until no request is active or queued; fail after `limit` cycles."""
    frames = frames or (lambda i: {"": make_observation(i)})
    for i in range(start, start + limit):
        if not (engine.active_requests or engine.queued_requests):
            return
        engine.run_frames(frames(i))
    raise AssertionError("requests did not finish")


def pytest_configure(config):
    # Tests import the package from the checkout (editable install); make that explicit for subprocesses.
    sys.path.insert(0, str(REPO))
    # Rate-, timing- and RSS-bound tests: run in CI like the rest, with slack that a loaded 2-core machine
    # respects; `-m "not timing"` leaves them out, `-m timing` runs them alone (to rerun a failure in quiet).
    config.addinivalue_line("markers", "timing: bound by wall-clock rate, latency or memory (slack for a loaded machine)")
