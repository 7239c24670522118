"""Unit tests of the engine's small parts: the sampler, stop strings, the block manager, EngineStats, and
the package's import graph."""
import ast
import time
from pathlib import Path

import pytest
import torch

from oxygen_ros.engine.block_manager import BlockManager, PoolExhausted
from oxygen_ros.engine.requests import StopMatcher
from oxygen_ros.engine.stats import EngineStats
from oxygen_ros.model.sampler import greedy, sample

REPO = Path(__file__).resolve().parents[1]


# ---------------------------------------------------------------------------------------------- sampler
def test_greedy_rows_take_the_argmax_lowest_id_on_ties():
    logits = torch.tensor([[0.0, 3.0, 3.0, 1.0], [5.0, 0.0, 0.0, 5.0]])
    tokens, ok = sample(logits, [0.0, 0.0], [1.0, 1.0], [None, None])
    assert tokens == [1, 0] and ok == [True, True]
    assert greedy(logits).tolist() == [1, 0]


def test_a_non_finite_row_fails_alone_whatever_its_sampling():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    clean = logits.clone()
    logits[1, 7] = float("nan")
    logits[2, 3] = float("inf")
    temps, top_ps = [0.0, 1.0, 0.7, 1.3], [1.0, 0.9, 1.0, 0.5]
    gens = [None] + [torch.Generator().manual_seed(s) for s in (1, 2, 3)]
    tokens, ok = sample(logits, temps, top_ps, gens)
    assert ok == [True, False, False, True] and tokens[1] == tokens[2] == -1
    ref, _ = sample(clean[[0, 3]], [temps[0], temps[3]], [top_ps[0], top_ps[3]],
                    [None, torch.Generator().manual_seed(3)])
    assert [tokens[0], tokens[3]] == ref, "the good rows do not depend on the bad ones"


def test_sampling_follows_temperature_and_top_p():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    draws = [sample(logits, [1.0], [1.0], [torch.Generator().manual_seed(s)])[0][0] for s in range(2000)]
    freq = torch.bincount(torch.tensor(draws), minlength=4).float() / len(draws)
    assert torch.allclose(freq, torch.tensor([0.5, 0.3, 0.15, 0.05]), atol=0.04)
    top = [sample(logits, [1.0], [0.6], [torch.Generator().manual_seed(s)])[0][0] for s in range(300)]
    assert set(top) == {0, 1}, "top_p 0.6 keeps the two most likely tokens (0.5 + 0.3 reaches it)"
    same = [sample(logits, [1.0], [1.0], [torch.Generator().manual_seed(7)])[0][0] for _ in range(5)]
    assert len(set(same)) == 1


# ---------------------------------------------------------------------------------------------- stop strings
def test_stop_matcher_finds_the_earliest_stop_across_updates():
    m = StopMatcher(["lo w", "world", "", "xyz"])
    assert m.find("hel") == -1
    assert m.find("hello wo") == 3                   # "lo w" ends inside the new part, starts in the old
    m = StopMatcher(["world", "o"])
    assert m.find("hello world") == 4


@pytest.mark.timing
def test_stop_check_cost_does_not_grow_with_the_number_of_stop_strings():
    text = "the quick brown fox jumps over the lazy dog " * 4

    def cost(stops) -> float:
        best = float("inf")
        for _ in range(3):
            m = StopMatcher(stops)
            t = time.perf_counter()
            for end in range(1, len(text) + 1):      # one update per character, as tokens arrive
                m.find(text[:end])
            best = min(best, time.perf_counter() - t)
        return best

    few = cost([f"{i:08d}" for i in range(1)])
    many = cost([f"{i:08d}" for i in range(20_000)])  # same lengths: the cost depends on lengths, not count
    assert many < 5 * few + 2e-3, (few, many)


# ---------------------------------------------------------------------------------------------- block manager
def test_block_manager_refuses_atomically_and_never_double_frees():
    bm = BlockManager(6, 4)
    a = bm.allocate(4)
    with pytest.raises(PoolExhausted):
        bm.allocate(3)
    assert bm.num_used == 4
    with pytest.raises(RuntimeError, match="decref of free block"):
        bm.decref((a[0], 5))                         # 5 is free: nothing is released
    assert bm.num_used == 4 and bm.refcount(a[0]) == 1
    bm.decref(a)
    assert bm.num_free == 6 and bm.blocks_for(9) == 3


@pytest.mark.timing
def test_allocation_cost_is_independent_of_pool_size_and_fragmentation():
    def cost(num_blocks: int) -> float:
        bm = BlockManager(num_blocks, 16)
        held = [bm.allocate(1) for _ in range(num_blocks)]
        for h in held[::2]:                          # fragment: every other block free
            bm.decref(h)
        t = time.perf_counter()
        for _ in range(200):
            bm.decref(bm.allocate(8))
        return time.perf_counter() - t

    small, large = min(cost(64) for _ in range(3)), min(cost(60_000) for _ in range(3))
    assert large < 5 * small + 5e-3, (small, large)


# ---------------------------------------------------------------------------------------------- stats
class _Blocks:
    num_used, num_blocks, peak_used = 3, 10, 7


def _report(frame_index, duration, tokens=0, batches=(), fault="", missed=False, prefill=0.0):
    from oxygen_ros.engine.engine import CycleReport

    good = frame_index is not None and not fault
    return CycleReport(frame_index, 0.0, prefill_s=prefill, tokens=tokens, batch_sizes=list(batches),
                       duration_s=duration, fault=fault, deadline_missed=missed,
                       robots=[""] if frame_index is not None else [], chunks=int(good))


def test_engine_stats_counts_frames_tokens_and_faults():
    stats = EngineStats(horizon=10, frame_period=0.1, blocks=_Blocks(), window=3)
    stats.record(_report(0, 0.05, tokens=4, batches=(2, 2), prefill=0.01), {"": 0}, 1, 0)
    stats.record(_report(1, 0.15, tokens=2, batches=(1,), missed=True, prefill=0.03), {"": 1}, 1, 2)
    stats.record(_report(2, 0.2, fault="boom"), {"": 1}, 0, 0)
    stats.record(_report(None, 0.05, tokens=3, batches=(3,)), {"": 1}, 0, 0)
    stats.record_chunk("", 0.04, missed=False)
    stats.record_chunk("", 0.12, missed=True)
    stats.count("faults")
    stats.note_error("boom")
    s = stats.snapshot()
    assert s["frames"] == 2 and s["counters"]["cycles"] == 4 and s["faults"] == 1
    # the window holds the last 3 cycles: frame 1 (0.15 s) is its only good frame
    assert s["frame_ms_mean"] == pytest.approx(150.0) and s["prefill_ms_mean"] == pytest.approx(30.0)
    assert s["action_hz"] == pytest.approx(10 / 0.15)
    assert s["tokens_per_s"] == pytest.approx(5 / 0.4) and s["avg_batch"] == pytest.approx(2.0)
    assert s["deadline_misses"] == 1 and s["dropped_frames"] == 1 and s["last_error"] == "boom"
    assert (s["pool_blocks_used"], s["pool_blocks_total"], s["pool_peak_blocks"]) == (3, 10, 7)
    assert s["pool_occupancy"] == pytest.approx(0.3)
    robot = s["robots"][""]      # per robot: frames taken into cycles, chunks delivered, their latency
    assert (robot["frames"], robot["chunks"], robot["deadline_misses"], robot["dropped_observations"]) == (3, 2, 1, 1)
    assert robot["chunk_ms_mean"] == pytest.approx(80.0)


def test_engine_stats_of_an_idle_engine_are_zero_not_nan():
    s = EngineStats(10, 0.1, _Blocks()).snapshot()
    assert s["frames"] == 0 and s["frame_ms_mean"] == 0.0 and s["action_hz"] == 0.0 and s["tokens_per_s"] == 0.0


# ---------------------------------------------------------------------------------------------- imports
def _module_imports() -> dict[str, set[str]]:
    """Every import (module level or inside functions) between the package's modules."""
    files = {p: "oxygen_ros." + ".".join(p.relative_to(REPO / "oxygen_ros").with_suffix("").parts)
             for p in (REPO / "oxygen_ros").rglob("*.py")}
    files.update({p: "oxygen_ros.kernels." + p.stem for p in (REPO / "kernels").glob("*.py")})
    names = {m.removesuffix(".__init__") for m in files.values()}
    graph = {}
    for path, mod in files.items():
        mod = mod.removesuffix(".__init__")
        package = mod if path.name == "__init__.py" else mod.rpartition(".")[0]
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parts = package.split(".")
                    base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
                for alias in node.names:
                    target = f"{base}.{alias.name}"
                    deps.add(target if target in names else base)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names)
        graph[mod] = {d for d in deps if d in names and d != mod}
    return graph


def _cycle(graph, nodes) -> list | None:
    state, stack = {}, []

    def visit(n):
        state[n] = 1
        stack.append(n)
        for d in sorted(graph.get(n, ())):
            if d not in nodes:
                continue
            if state.get(d) == 1:
                return stack[stack.index(d):] + [d]
            if d not in state:
                found = visit(d)
                if found:
                    return found
        stack.pop()
        state[n] = 2
        return None

    for n in sorted(nodes):
        if n not in state:
            found = visit(n)
            if found:
                return found
    return None


def test_no_import_cycles_between_modules_or_packages():
    graph = _module_imports()
    assert "oxygen_ros.engine.scheduler" in graph and graph["oxygen_ros.engine.engine"], "the walk sees the package"
    assert _cycle(graph, set(graph)) is None, _cycle(graph, set(graph))
    package = lambda m: ".".join(m.split(".")[:2])  # noqa: E731
    packages: dict[str, set[str]] = {}
    for mod, deps in graph.items():
        packages.setdefault(package(mod), set()).update(package(d) for d in deps if package(d) != package(mod))
    assert _cycle(packages, set(packages)) is None, _cycle(packages, set(packages))
