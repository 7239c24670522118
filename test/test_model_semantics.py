"""Semantics of the π0.5 model layer on a small random model, through oxygen_ros.model.inference (the
standalone path the oracle tool and the engine equivalence tests use): masked cameras, batching, the two
prefix attention rules, text generation, image preprocessing and the Euler loop."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from oxygen_ros.model import inference
from oxygen_ros.model.attention import CachedAttention, CachedRow, Segment
from oxygen_ros.model.checkpoint import init_random_weights
from oxygen_ros.model.config import GemmaConfig, Pi05Config, VisionConfig
from oxygen_ros.model.pi05 import Pi05, PrefixRow
from oxygen_ros.model.preprocess import resize_with_pad, to_pixels

BACKEND = "torch"
# Same float32 maths in a different grouping (rows packed together vs alone): rounding-level differences.
BATCH_ATOL = 1e-5
# Logits (|logit| up to ~10) of the same tokens computed as one multi-token extension vs one at a time.
TEXT_ATOL = 1e-4
IMAGE_TOKENS = 256                                            # 224 px / 14 px patches = 16 x 16

CFG = Pi05Config(
    vlm=GemmaConfig(width=32, depth=2, mlp_dim=64, num_heads=4, num_kv_heads=1, head_dim=8),
    expert=GemmaConfig(width=16, depth=2, mlp_dim=32, num_heads=4, num_kv_heads=1, head_dim=8),
    vision=VisionConfig(width=16, depth=1, mlp_dim=32, num_heads=2),  # 224 px, patch 14: 256 tokens
    vocab_size=64, action_dim=8, action_horizon=4, max_token_len=32, num_denoise_steps=10)
MODES = ["bidirectional", "causal"]


@pytest.fixture(scope="module", params=MODES)
def model(request) -> Pi05:
    cfg = CFG.replace(prefix_language_attention=request.param)
    return init_random_weights(Pi05(cfg), seed=3).eval().requires_grad_(False)


def images(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, 224, 224, generator=g) * 2 - 1


def tokens(n: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.cat([torch.tensor([2]), torch.randint(3, CFG.vocab_size, (n - 1,), generator=g)])


def cache_for(model: Pi05, rows: list[PrefixRow], extra: int = 64) -> inference.ContiguousCache:
    return inference.ContiguousCache(model, sum(model.prefix_length(r) + 16 for r in rows) + extra)


def segment_kv(cache: inference.ContiguousCache, seg: Segment, layer: int, start: int = 0, end: int | None = None):
    """K and V [n, kv_heads, head_dim] of tokens start..end-1 of a segment."""
    bs = cache.kv.block_size
    end = seg.length if end is None else end
    slots = torch.tensor([seg.blocks[j // bs] * bs + j % bs for j in range(start, end)])
    kvh, hd = cache.kv.k.shape[-2:]
    return cache.kv.k[layer].reshape(-1, kvh, hd)[slots], cache.kv.v[layer].reshape(-1, kvh, hd)[slots]


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).abs().max())


# ------------------------------------------------------------------------------------------ (a) masked cameras
def test_a_masked_camera_has_no_tokens(model):
    """A prefix row holds only its valid cameras: an absent camera contributes no token, no K/V and no
    position, so its pixels cannot change anything (by construction)."""
    n_tokens = 9
    row = PrefixRow(images(2, 0), tokens(n_tokens, 0))       # cameras 0 and 2 valid, camera 1 masked
    assert model.prefix_length(row) == 2 * IMAGE_TOKENS + n_tokens
    expected_bidir = 2 * IMAGE_TOKENS + (n_tokens if model.cfg.prefix_language_attention == "bidirectional" else 0)
    assert model.prefix_bidir(row) == expected_bidir
    assert model.embed_prefix([row]).shape == (2 * IMAGE_TOKENS + n_tokens, CFG.vlm.width)
    cache = cache_for(model, [row])
    pre = inference.prefill(model, cache, [row], BACKEND)
    assert pre.segments[0].length == 2 * IMAGE_TOKENS + n_tokens
    # Nothing is written beyond the row's tokens: no slot for the absent camera.
    bs = cache.kv.block_size
    used = set(pre.segments[0].blocks[j // bs] * bs + j % bs for j in range(pre.segments[0].length))
    flat = cache.kv.k.reshape(CFG.vlm.depth, -1, CFG.vlm.num_kv_heads, CFG.vlm.head_dim)
    untouched = [s for s in range(flat.shape[1]) if s not in used]
    assert untouched and bool((flat[:, untouched] == 0).all())
    # The same cameras give the same prefix whatever a third (absent) camera would have shown: the only
    # way to pass a camera is to make it valid, which changes the length.
    three = PrefixRow(torch.cat([images(2, 0), images(1, 99)]), row.tokens)
    assert model.prefix_length(three) == model.prefix_length(row) + IMAGE_TOKENS


def test_a_camera_less_row(model):
    row = PrefixRow(torch.zeros(0, 3, 224, 224), tokens(5, 1))
    assert model.prefix_length(row) == 5
    cache = cache_for(model, [row])
    pre = inference.prefill(model, cache, [row], BACKEND)
    assert pre.hidden.shape == (1, CFG.vlm.width) and torch.isfinite(pre.hidden).all()


# ------------------------------------------------------------------------------------------ (b) batching
ROWS = [(1, 7), (3, 12), (2, 3)]                              # (cameras, prompt tokens) per row


def batch_rows() -> list[PrefixRow]:
    return [PrefixRow(images(n_cam, 10 + i), tokens(n_tok, 20 + i)) for i, (n_cam, n_tok) in enumerate(ROWS)]


def test_b_batched_prefill_equals_rows_alone(model):
    rows = batch_rows()
    cache = cache_for(model, rows)
    batched = inference.prefill(model, cache, rows, BACKEND)
    assert [s.length for s in batched.segments] == [c * IMAGE_TOKENS + t for c, t in ROWS]
    for i, row in enumerate(rows):
        own_cache = cache_for(model, [row])
        alone = inference.prefill(model, own_cache, [row], BACKEND)
        assert max_diff(batched.hidden[i], alone.hidden[0]) <= BATCH_ATOL, f"row {i} hidden"
        for layer in range(CFG.vlm.depth):
            kb, vb = segment_kv(cache, batched.segments[i], layer)
            ka, va = segment_kv(own_cache, alone.segments[0], layer)
            assert max_diff(kb, ka) <= BATCH_ATOL, f"row {i} layer {layer} K"
            assert max_diff(vb, va) <= BATCH_ATOL, f"row {i} layer {layer} V"


def test_b_batched_sample_actions_equals_rows_alone(model):
    rows = batch_rows()
    cache = cache_for(model, rows)
    pre = inference.prefill(model, cache, rows, BACKEND)
    noise = torch.randn(3, CFG.action_horizon, CFG.action_dim, generator=torch.Generator().manual_seed(5))
    batched = inference.sample_actions(model, cache, pre.segments, noise, steps=4, backend=BACKEND)
    assert batched.shape == noise.shape and batched.dtype == torch.float32
    for i in range(3):
        alone = inference.sample_actions(model, cache, [pre.segments[i]], noise[i:i + 1], steps=4, backend=BACKEND)
        assert max_diff(batched[i], alone[0]) <= BATCH_ATOL, f"row {i}"
    # The rows differ (each row reads its own prefix).
    assert max_diff(batched[0], batched[1]) > 1e-3
    # Reading the prefix does not modify it.
    again = inference.sample_actions(model, cache, pre.segments, noise, steps=4, backend=BACKEND)
    assert torch.equal(again, batched)


# ------------------------------------------------------------------------------------------ (c) prefix modes
def test_c_image_kv_depends_on_the_prompt_only_in_bidirectional_mode(model):
    ims = images(2, 7)
    n_img = 2 * IMAGE_TOKENS
    prompts = [tokens(10, 30), tokens(10, 31), tokens(4, 32)]
    kvs = []
    for prompt in prompts:
        row = PrefixRow(ims, prompt)
        cache = cache_for(model, [row])
        seg = inference.prefill(model, cache, [row], BACKEND).segments[0]
        kvs.append([segment_kv(cache, seg, layer, 0, n_img) for layer in range(CFG.vlm.depth)])
    causal = model.cfg.prefix_language_attention == "causal"
    for other in kvs[1:]:
        for layer in range(CFG.vlm.depth):
            dk = max_diff(kvs[0][layer][0], other[layer][0])
            dv = max_diff(kvs[0][layer][1], other[layer][1])
            if causal or layer == 0:          # layer 0 K/V come straight from the image embeddings
                # Unchanged up to float32 rounding (the masked softmax runs over a longer key row).
                assert dk <= BATCH_ATOL and dv <= BATCH_ATOL, (layer, dk, dv)
            else:                             # images attend to the language tokens
                assert dk > 1e-3 and dv > 1e-3, (layer, dk, dv)


def test_c_language_tokens_are_causal_only_in_causal_mode(model):
    """Changing the last prompt token changes earlier language tokens' K/V only when they can see it."""
    ims = images(1, 8)
    a = tokens(8, 40)
    b = a.clone()
    b[-1] = (b[-1] + 1 - 3) % (CFG.vocab_size - 3) + 3
    kv = []
    for prompt in (a, b):
        row = PrefixRow(ims, prompt)
        cache = cache_for(model, [row])
        seg = inference.prefill(model, cache, [row], BACKEND).segments[0]
        kv.append(segment_kv(cache, seg, CFG.vlm.depth - 1, IMAGE_TOKENS, IMAGE_TOKENS + 7))
    d = max_diff(kv[0][0], kv[1][0])
    if model.cfg.prefix_language_attention == "causal":
        assert d <= BATCH_ATOL
    else:
        assert d > 1e-3


def test_c_the_two_modes_give_different_actions():
    row = PrefixRow(images(2, 9), tokens(6, 50))
    noise = torch.randn(1, CFG.action_horizon, CFG.action_dim, generator=torch.Generator().manual_seed(9))
    out = []
    for mode in MODES:
        m = init_random_weights(Pi05(CFG.replace(prefix_language_attention=mode)), seed=3)
        m = m.eval().requires_grad_(False)
        cache = cache_for(m, [row])
        pre = inference.prefill(m, cache, [row], BACKEND)
        out.append(inference.sample_actions(m, cache, pre.segments, noise, steps=3, backend=BACKEND))
    assert max_diff(out[0], out[1]) > 1e-3


# ------------------------------------------------------------------------------------------ (d) text
def test_d_greedy_generate_with_question_equals_manual_extension(model):
    row = PrefixRow(images(2, 11), tokens(6, 60))
    question = [5, 17, 33, 9]
    n_new = 6
    cache = cache_for(model, [row], extra=64)
    pre = inference.prefill(model, cache, [row], BACKEND)
    prefix = pre.segments[0]
    logits: list = []
    got = inference.greedy_generate(model, cache, prefix, None, question, n_new, backend=BACKEND,
                                    record_logits=logits)
    assert len(got) == n_new == len(logits)

    # By hand: one token at a time (question, then each argmax), each appended after the prefix.
    manual_cache = cache_for(model, [row], extra=64)
    seg = inference.prefill(model, manual_cache, [row], BACKEND).segments[0]
    blocks = manual_cache.allocate(len(question) + n_new)
    fed, out, manual_logits = list(question), [], []
    own = 0
    hidden = None
    for token in fed:
        own += 1
        attn = CachedAttention(manual_cache.kv, [CachedRow(1, Segment(blocks, own), seg)], BACKEND, model.device)
        with torch.inference_mode():
            hidden = model.extend(torch.tensor([token]), attn)
    for _ in range(n_new):
        lg = model.logits(hidden)[0]
        manual_logits.append(lg)
        token = int(torch.argmax(lg))
        out.append(token)
        own += 1
        attn = CachedAttention(manual_cache.kv, [CachedRow(1, Segment(blocks, own), seg)], BACKEND, model.device)
        with torch.inference_mode():
            hidden = model.extend(torch.tensor([token]), attn)
    assert got == out
    for step, (a, b) in enumerate(zip(logits, manual_logits)):
        assert max_diff(a, b) <= TEXT_ATOL, f"step {step}"
    # The question's RoPE positions follow the prefix.
    attn = CachedAttention(manual_cache.kv, [CachedRow(len(question), Segment(blocks, len(question)), seg)],
                           BACKEND, model.device)
    assert attn.positions.tolist() == list(range(prefix.length, prefix.length + len(question)))


def test_d_greedy_generate_without_question_starts_from_the_prefix(model):
    row = PrefixRow(images(1, 12), tokens(5, 61))
    cache = cache_for(model, [row], extra=64)
    pre = inference.prefill(model, cache, [row], BACKEND)
    logits: list = []
    got = inference.greedy_generate(model, cache, pre.segments[0], pre.hidden[0], [], 4, backend=BACKEND,
                                    record_logits=logits)
    assert len(got) == 4
    assert got[0] == int(torch.argmax(model.logits(pre.hidden)[0]))
    assert torch.equal(logits[0], model.logits(pre.hidden)[0])
    # EOS stops early (the EOS token is returned).
    stop = inference.greedy_generate(model, cache, pre.segments[0], pre.hidden[0], [], 4, eos_id=got[1],
                                     backend=BACKEND)
    assert stop == got[:2]


# ------------------------------------------------------------------------------------------ (e) preprocessing
def test_e_square_224_image_passes_unchanged():
    img = np.random.default_rng(0).integers(0, 256, size=(224, 224, 3), dtype=np.uint8)
    x = to_pixels(img)
    assert x.shape == (3, 224, 224) and x.dtype == torch.float32
    expected = torch.from_numpy(img).to(torch.float32).permute(2, 0, 1) / 255.0 * 2.0 - 1.0
    assert torch.equal(x, expected)
    assert float(x.min()) >= -1.0 and float(x.max()) <= 1.0
    assert to_pixels(np.zeros((224, 224, 3), np.uint8)).eq(-1).all()
    assert to_pixels(np.full((224, 224, 3), 255, np.uint8)).eq(1).all()
    assert torch.equal(to_pixels(torch.from_numpy(img)), x)                      # torch input too


@pytest.mark.parametrize("h, w", [(224, 448), (112, 224), (480, 960)])
def test_e_wide_2_to_1_image_is_padded_top_and_bottom(h, w):
    img = np.random.default_rng(1).integers(1, 255, size=(h, w, 3), dtype=np.uint8)
    x = to_pixels(img)
    assert x.shape == (3, 224, 224)
    # 2:1 -> resized to 112 x 224, 56 rows of -1 above and below, exactly.
    assert bool((x[:, :56] == -1.0).all()) and bool((x[:, 168:] == -1.0).all())
    assert bool((x[:, 56:168] > -1.0).any())
    assert float(x.min()) >= -1.0 and float(x.max()) <= 1.0
    if h == 112:                                                                  # no resize needed
        direct = torch.from_numpy(img).to(torch.float32).permute(2, 0, 1) / 255.0 * 2.0 - 1.0
        assert torch.equal(x[:, 56:168], direct)


def _jax_linear_weights(in_size: int, out_size: int) -> np.ndarray:
    """jax.image.scale_and_translate's LINEAR weights [out, in] (antialias=True, no translation), written
    out from jax's source: the reference openpi's resize_with_pad runs."""
    inv_scale = in_size / out_size
    sample = (np.arange(out_size) + 0.5) * inv_scale - 0.5
    w = np.maximum(0.0, 1.0 - np.abs(sample[:, None] - np.arange(in_size)[None]) / max(inv_scale, 1.0))
    return w / w.sum(axis=1, keepdims=True)


@pytest.mark.parametrize("h, w", [(180, 320), (480, 640), (720, 1280), (101, 224), (300, 160), (50, 75)])
def test_e_resize_with_pad_matches_openpi(h, w):
    """openpi resize_with_pad on uint8: jax LINEAR with antialiasing, rounded, black padding centred
    (odd pixel bottom/right). Within one uint8 level (float32 vs this float64 reference: values near .5
    round either way), >= 99.8% of pixels exact on noise; case_e checks against openpi's own output."""
    img = np.random.default_rng(h * w).integers(0, 256, size=(h, w, 3), dtype=np.uint8)
    ratio = max(w / 224, h / 224)
    rh, rw = int(h / ratio), int(w / ratio)
    ref = np.einsum("oh,hwc->owc", _jax_linear_weights(h, rh), img.astype(np.float64))
    ref = np.einsum("ow,hwc->hoc", _jax_linear_weights(w, rw), ref)
    ref = np.clip(np.round(ref), 0, 255)
    top, left = (224 - rh) // 2, (224 - rw) // 2
    expected = np.zeros((224, 224, 3))
    expected[top:top + rh, left:left + rw] = ref
    got = resize_with_pad(img, 224, 224)
    assert got.dtype == np.uint8 and got.shape == (224, 224, 3)
    diff = np.abs(got.astype(np.float64) - expected)
    assert diff.max() <= 1 and (diff == 0).mean() >= 0.998, (diff.max(), (diff == 0).mean())
    # The padding is exactly black, the odd row/column going to the bottom/right.
    assert not got[:top].any() and not got[top + rh:].any()
    assert not got[:, :left].any() and not got[:, left + rw:].any()


def test_e_plain_bilinear_would_be_far_off():
    """Why antialiasing matters: shrinking 720x1280 noise without it lands tens of levels away."""
    img = np.random.default_rng(3).integers(0, 256, size=(720, 1280, 3), dtype=np.uint8)
    x = torch.from_numpy(img).permute(2, 0, 1)[None].float()
    plain = torch.nn.functional.interpolate(x, size=(126, 224), mode="bilinear", align_corners=False)
    ours = resize_with_pad(img, 224, 224)[49:175].astype(np.float32)
    assert np.abs(plain[0].permute(1, 2, 0).numpy() - ours).max() > 20


@pytest.mark.parametrize("h, w", [(1, 500), (500, 1), (1, 1), (2, 8000)])
def test_e_extreme_aspect_ratio_keeps_one_pixel(h, w):
    """A 1x500 image would shrink to 0 rows (openpi fails there); it keeps one row, centred."""
    img = np.full((h, w, 3), 200, np.uint8)
    got = resize_with_pad(img, 224, 224)
    assert got.shape == (224, 224, 3)
    content = np.argwhere(got.any(axis=2))
    assert content.size and (got[got.any(axis=2)] == 200).all()
    x = to_pixels(img)
    assert x.shape == (3, 224, 224) and bool(torch.isfinite(x).all())


@pytest.mark.parametrize("bad", [
    np.zeros((224, 224), np.uint8),                 # grayscale
    np.zeros((224, 224, 1), np.uint8),
    np.zeros((224, 224, 4), np.uint8),              # RGBA
    np.zeros((3, 224, 224), np.uint8),              # channels first
    np.zeros((224, 224, 3), np.float32),            # not uint8
    np.zeros((2, 224, 224, 3), np.uint8),           # a batch
])
def test_e_non_rgb_input_is_rejected(bad):
    with pytest.raises(ValueError, match="RGB uint8"):
        to_pixels(bad)


# ------------------------------------------------------------------------------------------ (f) Euler loop
# The reference's float32 times for 10 steps: t = 1.0, then t += float32(-0.1), while t >= -dt/2.
REFERENCE_TIMES_10 = np.array([1.0, 0.9, 0.79999995, 0.6999999, 0.5999999, 0.4999999, 0.39999992,
                               0.29999992, 0.19999993, 0.09999993], dtype=np.float32)


def reference_times(steps: int) -> list[float]:
    dt = np.float32(-1.0 / steps)
    t = np.float32(1.0)
    out = []
    while t >= -dt / np.float32(2):
        out.append(float(t))
        t = np.float32(t + dt)
    return out


@pytest.mark.parametrize("steps", [10, 3, 7, 1])
def test_f_euler_loop_calls_and_times(steps, monkeypatch):
    model = init_random_weights(Pi05(CFG), seed=3).eval().requires_grad_(False)
    row = PrefixRow(images(1, 13), tokens(4, 70))
    cache = cache_for(model, [row])
    pre = inference.prefill(model, cache, [row], BACKEND)
    calls = []
    original = model.denoise_step

    def counting(x_t, t, attn):
        calls.append(t.clone())
        return original(x_t, t, attn)

    monkeypatch.setattr(model, "denoise_step", counting)
    noise = torch.randn(1, CFG.action_horizon, CFG.action_dim, generator=torch.Generator().manual_seed(1))
    record: list = []
    actions = inference.sample_actions(model, cache, pre.segments, noise, steps=steps, backend=BACKEND,
                                       record=record)
    assert len(calls) == len(record) == steps
    times = [t for t, _, _ in record]
    assert times == reference_times(steps)
    assert all(c.dtype == torch.float32 and c.shape == (1,) for c in calls)
    assert [float(c[0]) for c in calls] == times
    if steps == 10:
        assert np.array(times, dtype=np.float32).tolist() == REFERENCE_TIMES_10.tolist()
        assert times[:3] == [1.0, float(np.float32(0.9)), float(np.float32(0.79999995))]
    # x_{k+1} = x_k + dt * v_k, starting from the noise; the result is the last update.
    dt = torch.tensor(-1.0 / steps, dtype=torch.float32)
    assert torch.equal(record[0][1], noise)
    for k in range(steps - 1):
        assert torch.equal(record[k + 1][1], record[k][1] + dt * record[k][2])
    assert torch.equal(actions, record[-1][1] + dt * record[-1][2])


def test_f_default_steps_come_from_the_config():
    model = init_random_weights(Pi05(CFG.replace(num_denoise_steps=4)), seed=3).eval().requires_grad_(False)
    row = PrefixRow(images(1, 14), tokens(3, 71))
    cache = cache_for(model, [row])
    pre = inference.prefill(model, cache, [row], BACKEND)
    record: list = []
    inference.sample_actions(model, cache, pre.segments, torch.zeros(1, CFG.action_horizon, CFG.action_dim),
                             backend=BACKEND, record=record)
    assert [t for t, _, _ in record] == reference_times(4)
