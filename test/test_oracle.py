"""The package's π0.5 against the reference outputs of the public PyTorch implementations (oracle cases).

Each case is run exactly as a user would run it: `python -m oxygen_ros.tools.oracle CASE --out OUT.npz`
in a fresh interpreter, through the real checkpoint loader and the real preprocessing.

- case_a: OxyGen `PI05Pytorch` (language-causal prefix), a masked third camera, greedy text;
- case_c: upstream openpi `PI0Pytorch(pi05=True)` (bidirectional prefix), a masked middle camera.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
ORACLE = REPO / ".." / "shared" / "oracle"
CASES = ["case_a", "case_c"]

# Tolerances stated by ../shared/oracle/README.md ("Suggested comparison tolerances"): the reference is
# bitwise reproducible, and its measured sensitivity to float32-rounding-sized weight noise puts a correct
# float32 port with a different operation order within these bounds.
# Actions and flow velocities (|v| <= ~4): 1e-4 absolute.
ACTION_ATOL = 1e-4
# Prefix K/V (RoPE applied), hidden states and log-probs (values reach ~10): 2e-4 absolute.
PREFIX_ATOL = 2e-4
# Greedy text tokens: exact (smallest top-1/top-2 gap along the corrected path is 0.0153, three orders of
# magnitude above the float32 noise).


def _case(name: str) -> Path:
    path = ORACLE / name
    # Not skipped when absent: CI has the cases at this path, and a silently skipped oracle is no test.
    assert (path / "expected.npz").exists(), f"oracle case not found at {path.resolve()}"
    return path


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Run the oracle tool once per case, as a user would, in a fresh interpreter."""
    out_dir = tmp_path_factory.mktemp("oracle")
    results = {}
    for name in CASES:
        out = out_dir / f"{name}.npz"
        proc = subprocess.run(
            [sys.executable, "-m", "oxygen_ros.tools.oracle", str(_case(name)), "--out", str(out)],
            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300)
        results[name] = (proc.returncode, proc.stdout, out)
    return results


@pytest.fixture(params=CASES)
def case(request, runs):
    path = _case(request.param)
    rc, log, out = runs[request.param]
    assert rc == 0, f"oracle tool failed on {request.param}:\n{log}"
    assert "wrote" in log
    with np.load(out) as got, np.load(path / "expected.npz") as expected:
        yield request.param, dict(got), dict(expected)


def _max_diff(a, b) -> float:
    return float(np.max(np.abs(a.astype(np.float64) - b.astype(np.float64)))) if a.size else 0.0


def test_every_written_array_has_the_expected_name_shape_and_dtype(case):
    name, got, expected = case
    unknown = sorted(set(got) - set(expected))
    assert not unknown, f"{name}: arrays the case does not define: {unknown}"
    for key, value in got.items():
        assert value.shape == expected[key].shape, (name, key, value.shape, expected[key].shape)
        assert value.dtype == expected[key].dtype, (name, key, value.dtype, expected[key].dtype)
    # Everything the task asks to reproduce is written.
    depth = sum(1 for k in expected if k.startswith("prefix_kv_key_"))
    required = {"actions", "first_step_velocity", "denoise_v_t", "denoise_x_t", "denoise_time",
                "prefix_pad_mask", "prefix_last_valid_logits", "prefill_len", "prefix_position_ids",
                "prefix_last_valid_index"}
    required |= {f"prefix_kv_{kind}_{layer}" for kind in ("key", "value") for layer in range(depth)}
    if "text_tokens_correct" in expected:
        required |= {"text_tokens_correct", "text_logprobs_correct"}
    missing = sorted(required - set(got))
    assert not missing, f"{name}: missing arrays {missing}"


def test_actions_and_velocities(case):
    name, got, expected = case
    for key in ("actions", "first_step_velocity", "denoise_v_t", "denoise_x_t"):
        diff = _max_diff(got[key], expected[key])
        assert diff <= ACTION_ATOL, f"{name} {key}: max |diff| {diff:.3g} > {ACTION_ATOL}"
    # Every denoise call, one by one (the Euler loop's 10 velocities).
    assert got["denoise_v_t"].shape[0] == expected["denoise_v_t"].shape[0]
    for k in range(expected["denoise_v_t"].shape[0]):
        diff = _max_diff(got["denoise_v_t"][k], expected["denoise_v_t"][k])
        assert diff <= ACTION_ATOL, f"{name} denoise call {k}: max |v diff| {diff:.3g}"
    # The float32 time grid is reproduced bitwise (same t += dt arithmetic).
    np.testing.assert_array_equal(got["denoise_time"], expected["denoise_time"])


def test_prefix_layout_is_exact(case):
    name, got, expected = case
    for key in ("prefix_pad_mask", "prefix_position_ids", "prefill_len", "prefix_last_valid_index"):
        np.testing.assert_array_equal(got[key], expected[key], err_msg=f"{name} {key}")


def test_prefix_kv_at_valid_positions(case):
    name, got, expected = case
    valid = expected["prefix_pad_mask"]                                  # [B, P]
    layers = sorted(int(k.rsplit("_", 1)[1]) for k in expected if k.startswith("prefix_kv_key_"))
    assert layers == list(range(len(layers))) and layers
    for layer in layers:
        for kind in ("key", "value"):
            key = f"prefix_kv_{kind}_{layer}"
            for b in range(valid.shape[0]):
                # [kv_heads, P, head_dim] -> valid positions only (masked ones are reference garbage).
                diff = _max_diff(got[key][b][:, valid[b]], expected[key][b][:, valid[b]])
                assert diff <= PREFIX_ATOL, f"{name} {key} row {b}: max |diff| {diff:.3g} > {PREFIX_ATOL}"


def test_last_valid_logits(case):
    name, got, expected = case
    diff = _max_diff(got["prefix_last_valid_logits"], expected["prefix_last_valid_logits"])
    assert diff <= PREFIX_ATOL, f"{name}: prefix_last_valid_logits max |diff| {diff:.3g}"


def test_greedy_text_is_the_corrected_reference(case):
    name, got, expected = case
    if "text_tokens_correct" not in expected:
        # case_c: upstream PI0Pytorch has no text path; the tool must not invent text arrays.
        assert "text_tokens_correct" not in got and "text_logprobs_correct" not in got
        return
    np.testing.assert_array_equal(got["text_tokens_correct"], expected["text_tokens_correct"])
    # Not the quirk's tokens (OxyGen reads the first logits inside the masked camera slot).
    assert not np.array_equal(got["text_tokens_correct"], expected["text_tokens"])
    diff = _max_diff(got["text_logprobs_correct"], expected["text_logprobs_correct"])
    assert diff <= PREFIX_ATOL, f"{name}: text_logprobs_correct max |diff| {diff:.3g}"
