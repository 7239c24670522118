"""Camera images -> model pixels, exactly as openpi serves them (`to_pixels`), or as LeRobot 0.6.1 serves a
pi05 checkpoint it trained (`lerobot_pixels`).

openpi's `ResizeImages` runs `shared/image_tools.resize_with_pad` on the uint8 images: `jax.image.resize`
LINEAR with its default antialiasing (when shrinking, the triangle kernel is widened by the shrink factor,
so every input pixel contributes), rounded back to uint8, then padded with black (0), centred, the odd
pixel going bottom/right. The model then scales uint8 to [-1, 1]. Plain bilinear resizing without
antialiasing differs from this by up to ~60 uint8 levels on camera-sized images; this matches it to one
level (float rounding before the uint8 rounding), tested against openpi's outputs in `test_policy_io.py`.

LeRobot resizes differently, and a checkpoint it trained saw its images: uint8 -> float32 / 255 first
(prepare_observation_for_inference), then, in PI05Policy._preprocess_images, only when the size is not the
model's, `resize_with_pad_torch`: bilinear *without* antialiasing on the float image, clamped to [0, 1],
not rounded, black padding centred the same way; then * 2 - 1. The two differ by up to ~0.4 on camera
images shrunk to 224 px; `lerobot_pixels` matches LeRobot's to 1e-6 (test_lerobot_reference.py).
"""
from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch
import torch.nn.functional as F


def resize_with_pad(image: np.ndarray, height: int, width: int) -> np.ndarray:
    """uint8 [h, w, C] -> uint8 [height, width, C]: aspect kept, antialiased linear, black centred padding.

    openpi's arithmetic, except that a side that would shrink to 0 px (an extreme aspect ratio such as
    1x500, where openpi fails inside jax) keeps 1 px."""
    img = np.asarray(image)
    if img.dtype != np.uint8 or img.ndim != 3 or 0 in img.shape:
        raise ValueError(f"expected a non-empty uint8 image [H, W, C], got {img.dtype} {list(img.shape)}")
    h, w = img.shape[:2]
    if (h, w) == (height, width):
        return img
    ratio = max(w / width, h / height)
    rh, rw = max(1, int(h / ratio)), max(1, int(w / ratio))
    # torch's antialiased bilinear is the same triangle filter, widened by the shrink factor, with the
    # same half-pixel centres and edge renormalisation as jax's scale_and_translate.
    x = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1)[None].to(torch.float32)
    resized = F.interpolate(x, size=(rh, rw), mode="bilinear", align_corners=False, antialias=True)
    resized = resized[0].permute(1, 2, 0).numpy()
    resized = np.clip(np.round(resized), 0, 255).astype(np.uint8)
    top, left = (height - rh) // 2, (width - rw) // 2
    out = np.zeros((height, width, img.shape[2]), np.uint8)
    out[top:top + rh, left:left + rw] = resized
    return out


def lerobot_pixels(image: np.ndarray, height: int, width: int,
                   normalize: Callable[[np.ndarray], np.ndarray] | None = None) -> torch.Tensor:
    """uint8 [h, w, 3] -> float32 [3, height, width] in [-1, 1] (with `normalize`: the checkpoint's VISUAL
    normalisation, applied to the [0, 1] image before resizing, as LeRobot's pre-processor does).

    LeRobot's arithmetic, except that a side that would shrink to 0 px keeps 1 px (LeRobot fails there)."""
    img = np.asarray(image)
    if img.dtype != np.uint8 or img.ndim != 3 or img.shape[-1] != 3 or 0 in img.shape:
        raise ValueError(f"expected a non-empty RGB uint8 image [H, W, 3], got {img.dtype} {list(img.shape)}")
    x = torch.from_numpy(np.ascontiguousarray(img)).permute(2, 0, 1).contiguous().to(torch.float32) / 255
    if normalize is not None:
        x = torch.from_numpy(np.ascontiguousarray(normalize(x.numpy())))
    h, w = img.shape[:2]
    if (h, w) != (height, width):
        ratio = max(w / width, h / height)
        rh, rw = max(1, int(h / ratio)), max(1, int(w / ratio))
        x = F.interpolate(x[None], size=(rh, rw), mode="bilinear", align_corners=False)[0].clamp(0.0, 1.0)
        top, left = (height - rh) // 2, (width - rw) // 2
        x = F.pad(x, (left, width - rw - left, top, height - rh - top), mode="constant", value=0.0)
    return x * 2.0 - 1.0


def to_pixels(image: np.ndarray | torch.Tensor, size: int = 224) -> torch.Tensor:
    """One RGB uint8 image [H, W, 3] -> [3, size, size] float32 in [-1, 1] (resized first when needed)."""
    x = image.numpy() if isinstance(image, torch.Tensor) else np.asarray(image)
    if x.dtype != np.uint8 or x.ndim != 3 or x.shape[-1] != 3:
        raise ValueError(f"expected an RGB uint8 image [H, W, 3], got {x.dtype} {list(x.shape)}")
    x = resize_with_pad(x, size, size)
    return torch.from_numpy(np.ascontiguousarray(x)).permute(2, 0, 1).to(torch.float32) / 255.0 * 2.0 - 1.0
