"""Camera images -> model pixels, exactly as openpi's PyTorch path prepares them.

uint8 RGB [H, W, 3] -> float32 in [-1, 1] ([3, H, W]), then, when the image is not already the model's
size, an aspect-preserving bilinear resize (align_corners=False, no antialias) that fits inside the
target, clamped to [-1, 1] and centre-padded with -1 (black), the odd pixel going bottom/right.
"""
from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F


def to_pixels(image: np.ndarray | torch.Tensor, size: int = 224) -> torch.Tensor:
    """One RGB uint8 image [H, W, 3] -> [3, size, size] float32 in [-1, 1]."""
    x = torch.as_tensor(np.ascontiguousarray(image) if isinstance(image, np.ndarray) else image)
    if x.dtype != torch.uint8 or x.ndim != 3 or x.shape[-1] != 3:
        raise ValueError(f"expected an RGB uint8 image [H, W, 3], got {x.dtype} {list(x.shape)}")
    x = x.to(torch.float32).permute(2, 0, 1) / 255.0 * 2.0 - 1.0
    if x.shape[1:] != (size, size):
        x = resize_with_pad(x[None], size, size)[0]
    return x


def resize_with_pad(images: torch.Tensor, height: int, width: int) -> torch.Tensor:
    """[B, 3, h, w] float in [-1, 1] -> [B, 3, height, width]."""
    _, _, h, w = images.shape
    ratio = max(w / width, h / height)
    rh, rw = int(h / ratio), int(w / ratio)
    resized = F.interpolate(images, size=(rh, rw), mode="bilinear", align_corners=False).clamp(-1.0, 1.0)
    top, left = (height - rh) // 2, (width - rw) // 2
    return F.pad(resized, (left, width - rw - left, top, height - rh - top), value=-1.0)
