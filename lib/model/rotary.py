"""Rotary position embedding (RoPE): the frequencies, with Llama-3 or linear scaling, and the
rotation of queries and keys (HF's half-split convention), eager or as one compiled region.
"""

from __future__ import annotations

import math

import torch
from llamarl.lib.model.config import LlamaConfig
from llamarl.lib.model.layers import compiled_region


def rope_cos_sin(positions: torch.Tensor, inv_freq: torch.Tensor,
                 dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """RoPE ``cos``/``sin`` for given positions (``inv_freq``: ``rope_inv_freq``'s). Positions come
    from the data (not restarted per packed sequence), so left padding and packed sequences get
    the positions the checkpoint was trained with."""
    freqs = positions.float()[:, None] * inv_freq.to(positions.device)[None, :]
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """RoPE's inverse frequencies, with ``rope_theta`` and Llama-3 / linear scaling."""
    dim = cfg.head_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))
    scaling = cfg.rope_scaling
    if scaling is None:
        return inv_freq
    factor = scaling["factor"]
    if scaling["rope_type"] == "linear":
        return inv_freq / factor
    # llama3: long wavelengths are slowed by `factor`, short ones kept, the band between blended.
    low, high = scaling["low_freq_factor"], scaling["high_freq_factor"]
    old_len = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate ``x [tokens, heads, head_dim]`` (HF's half-split convention)."""
    cos, sin = cos[:, None, :], sin[:, None, :]
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


def rotary_qk(q, k, cos, sin, *, fused: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """``apply_rotary`` to queries and keys; ``fused``: both in one compiled kernel, and only
    ``cos``/``sin`` kept for backward (rotation is linear in q and k)."""
    rotate = compiled_region(region_rotary_qk, 0, 1, 2, 3) if fused else region_rotary_qk
    return rotate(q, k, cos, sin)


def region_rotary_qk(q, k, cos, sin):
    return apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
