"""The model end to end with the Triton kernels against the torch path (CPU: Triton's interpreter; GPU:
OXYGEN_KERNEL_TEST_DEVICE=cuda)."""

import numpy as np
import pytest
import torch

from conftest import KERNEL_TEST_DEVICE as DEVICE
from conftest import ORACLE
from oxygen_ros.model import inference
from oxygen_ros.model.checkpoint import init_random_weights, load_pi05
from oxygen_ros.model.config import GemmaConfig, Pi05Config, VisionConfig, from_oracle_json
from oxygen_ros.model.pi05 import Pi05, PrefixRow
from oxygen_ros.model.preprocess import to_pixels

CASE_A = ORACLE / "case_a"
# float32 model, Triton vs torch: only the summation order differs (measured: actions ~2e-6, logits ~8e-6,
# prefix K/V ~2e-5 on case_a). The bounds are the oracle's float32 tolerances (shared/oracle/README.md).
ACTIONS_ATOL = 1e-4
LOGITS_ATOL = 2e-4
KV_ATOL = 2e-4
# bfloat16 model (GPU only): the attention rounds P to bf16 and every op rounds its output, on a model whose
# hidden states reach O(10): a few bf16 ulps, compounded over the layers and the denoise steps.
BF16_ACTIONS_ATOL = 1e-1
BF16_LOGITS_ATOL = 1e-1






def run(model: Pi05, rows, noise, backend, steps, questions, n_text):
    """prefill -> sample_actions -> greedy_generate (per row), as the oracle tool chains them."""
    model.backend = backend  # the norms / activation
    total = sum(model.prefix_length(r) for r in rows)
    cache = inference.ContiguousCache(model, total + len(rows) * (max(map(len, questions)) + n_text + 16))
    pre = inference.prefill(model, cache, rows, backend)
    kv = (cache.kv.k.clone(), cache.kv.v.clone())
    actions = inference.sample_actions(model, cache, pre.segments, noise, steps, backend)
    texts, logits = [], []
    for b, seg in enumerate(pre.segments):
        rec: list = []
        texts.append(inference.greedy_generate(model, cache, seg, pre.hidden[b], questions[b], n_text, None,
                                               backend, rec))
        logits.append(torch.stack(rec))
    model.backend = "torch"
    return dict(actions=actions.cpu(), kv=[t.cpu() for t in kv], texts=texts,
                logits=[x.cpu() for x in logits], first=model.logits(pre.hidden).cpu())


def compare(a, b, actions_atol, logits_atol, kv_atol):
    torch.testing.assert_close(b["actions"], a["actions"], atol=actions_atol, rtol=0)
    torch.testing.assert_close(b["first"], a["first"], atol=logits_atol, rtol=0)
    for la, lb in zip(a["logits"], b["logits"]):
        torch.testing.assert_close(lb, la, atol=logits_atol, rtol=0)
    for ta, tb in zip(a["kv"], b["kv"]):
        torch.testing.assert_close(tb.float(), ta.float(), atol=kv_atol, rtol=0)
    assert b["texts"] == a["texts"]


def small_config(mode: str, kv_heads: int) -> Pi05Config:
    # 56-pixel images: 16 tokens per camera, so the interpreter runs the whole model in a few seconds.
    return Pi05Config(
        vlm=GemmaConfig(width=64, depth=2, mlp_dim=128, num_heads=4, num_kv_heads=kv_heads, head_dim=32),
        expert=GemmaConfig(width=32, depth=2, mlp_dim=64, num_heads=4, num_kv_heads=kv_heads, head_dim=32),
        vision=VisionConfig(width=32, depth=1, mlp_dim=64, num_heads=2, patch_size=14, image_size=56),
        vocab_size=256, action_dim=8, action_horizon=5, max_token_len=16, num_denoise_steps=3,
        prefix_language_attention=mode)


@pytest.mark.parametrize("mode,kv_heads", [("causal", 1), ("bidirectional", 2)])
def test_small_pi05_triton_matches_torch(mode, kv_heads):
    """Batch of 2 rows (2 cameras + 7 tokens, 1 camera + 12 tokens), both prefix modes, a question on one
    row (extend with a prefix) and none on the other (first token from the prefill)."""
    cfg = small_config(mode, kv_heads)
    model = init_random_weights(Pi05(cfg), seed=5).eval().requires_grad_(False).to(DEVICE)
    g = torch.Generator().manual_seed(0)
    rows = [PrefixRow(torch.rand(2, 3, 56, 56, generator=g) * 2 - 1,
                      torch.cat([torch.tensor([2]), torch.randint(3, 256, (6,), generator=g)])),
            PrefixRow(torch.rand(1, 3, 56, 56, generator=g) * 2 - 1,
                      torch.cat([torch.tensor([2]), torch.randint(3, 256, (11,), generator=g)]))]
    noise = torch.randn(2, cfg.action_horizon, cfg.action_dim, generator=g)
    args = (rows, noise)
    ref = run(model, *args, "torch", 3, [[5, 6, 7], []], 4)
    got = run(model, *args, "triton", 3, [[5, 6, 7], []], 4)
    compare(ref, got, ACTIONS_ATOL, LOGITS_ATOL, KV_ATOL)


def case_a_inputs(cfg, cameras: int | None):
    inp = dict(np.load(CASE_A / "inputs.npz"))
    slots = [s for s in cfg.camera_slots if bool(inp[f"image_mask_{s}"][0])][:cameras]
    images = torch.stack([to_pixels(inp[f"image_{s}"][0], cfg.vision.image_size) for s in slots])
    mask = inp["tokenized_prompt_mask"][0].astype(bool)
    tokens = torch.tensor(inp["tokenized_prompt"][0][mask], dtype=torch.long)
    return [PrefixRow(images, tokens)], torch.from_numpy(inp["noise"]).float()


def test_case_a_triton_matches_torch():
    """The oracle case_a checkpoint (OxyGen causal prefix, 8 heads on 1 kv head, head_dim 16), one camera
    (256 image tokens + 19 prompt tokens; the interpreter needs ~10 s), 3 denoise steps, 3 text tokens after a
    3-token question."""
    cfg = from_oracle_json(CASE_A / "config.json")
    model = load_pi05(CASE_A, cfg, device=DEVICE)
    rows, noise = case_a_inputs(cfg, cameras=1)
    ref = run(model, rows, noise, "torch", 3, [[5, 6, 7]], 3)
    got = run(model, rows, noise, "triton", 3, [[5, 6, 7]], 3)
    compare(ref, got, ACTIONS_ATOL, LOGITS_ATOL, KV_ATOL)


def test_case_a_full_triton_matches_oracle():
    """The whole oracle case through the Triton backend against the reference's outputs."""
    cfg = from_oracle_json(CASE_A / "config.json")
    model = load_pi05(CASE_A, cfg, device=DEVICE)
    rows, noise = case_a_inputs(cfg, cameras=None)
    got = run(model, rows, noise, "triton", cfg.num_denoise_steps, [[]], 12)
    expected = np.load(CASE_A / "expected.npz")
    np.testing.assert_allclose(got["actions"].numpy(), expected["actions"], atol=1e-4, rtol=0)
    assert got["texts"][0] == expected["text_tokens_correct"][0].tolist()


@pytest.mark.skipif(DEVICE != "cuda", reason="bfloat16 end to end: compiled kernels only (CUDA)")
def test_small_pi05_bf16_triton_matches_torch():
    cfg = small_config("causal", 1)
    model = init_random_weights(Pi05(cfg), seed=5).eval().requires_grad_(False).to(DEVICE, torch.bfloat16)
    g = torch.Generator().manual_seed(0)
    rows = [PrefixRow(torch.rand(2, 3, 56, 56, generator=g) * 2 - 1,
                      torch.cat([torch.tensor([2]), torch.randint(3, 256, (6,), generator=g)]))]
    noise = torch.randn(1, cfg.action_horizon, cfg.action_dim, generator=g)
    ref = run(model, rows, noise, "torch", 3, [[5, 6, 7]], 1)
    got = run(model, rows, noise, "triton", 3, [[5, 6, 7]], 1)
    torch.testing.assert_close(got["actions"], ref["actions"], atol=BF16_ACTIONS_ATOL, rtol=0)
    torch.testing.assert_close(got["first"], ref["first"], atol=BF16_LOGITS_ATOL, rtol=0)
