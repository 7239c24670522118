"""SigLIP vision tower as PaliGemma uses it: 14 px patches, learned positions, pre-LN encoder, post-LN.

No pooling head: every patch token goes to the projector and then into the VLM prefix.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from .config import VisionConfig


class SiglipLayer(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        w = cfg.width
        self.num_heads = cfg.num_heads
        self.layer_norm1 = nn.LayerNorm(w, eps=cfg.layer_norm_eps)
        self.q_proj = nn.Linear(w, w)
        self.k_proj = nn.Linear(w, w)
        self.v_proj = nn.Linear(w, w)
        self.out_proj = nn.Linear(w, w)
        self.layer_norm2 = nn.LayerNorm(w, eps=cfg.layer_norm_eps)
        self.fc1 = nn.Linear(w, cfg.mlp_dim)
        self.fc2 = nn.Linear(cfg.mlp_dim, w)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, tokens, width]: every image token sees every token of its own image."""
        n, t, w = x.shape
        h = self.layer_norm1(x)
        split = lambda y: y.view(n, t, self.num_heads, w // self.num_heads).transpose(1, 2)  # noqa: E731
        a = F.scaled_dot_product_attention(split(self.q_proj(h)), split(self.k_proj(h)), split(self.v_proj(h)))
        x = x + self.out_proj(a.transpose(1, 2).reshape(n, t, w))
        return x + self.fc2(F.gelu(self.fc1(self.layer_norm2(x)), approximate="tanh"))


class SiglipVision(nn.Module):
    def __init__(self, cfg: VisionConfig):
        super().__init__()
        self.cfg = cfg
        self.patch_embedding = nn.Conv2d(3, cfg.width, kernel_size=cfg.patch_size, stride=cfg.patch_size)
        self.position_embedding = nn.Parameter(torch.zeros(cfg.num_patches, cfg.width))
        self.layers = nn.ModuleList(SiglipLayer(cfg) for _ in range(cfg.depth))
        self.post_layernorm = nn.LayerNorm(cfg.width, eps=cfg.layer_norm_eps)

    def forward(self, pixels: torch.Tensor) -> torch.Tensor:
        """pixels [N, 3, H, W] in [-1, 1] -> patch features [N, num_patches, width] (row-major patches)."""
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))
        # The embeddings may be float32 islands in a bfloat16 tower: the encoder runs in its own dtype.
        x = (x.flatten(2).transpose(1, 2) + self.position_embedding).to(self.post_layernorm.weight.dtype)
        for layer in self.layers:
            x = layer(x)
        return self.post_layernorm(x)
