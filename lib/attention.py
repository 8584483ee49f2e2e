"""Causal self-attention over a batch described either as padded rows or as packed sequences.

* ``Padded``: tokens are ``batch × seqlen`` rows with a key-padding mask (SDPA with a mask).
* ``Packed``: the valid tokens of all sequences back to back, delimited by ``cu_seqlens``
  (remove-padding). Backends, fastest first: flash-attn's ``flash_attn_varlen_func`` when it
  imports; ``torch.nn.attention.varlen.varlen_attn`` on CUDA; SDPA per sequence on CPU and for
  fp32 (the varlen kernels are fp16/bf16 only).
* ``Prefill`` / ``Decode``: generation over a preallocated ``KVCache`` — packed prompts that
  also fill the cache, then one token per sequence attending over its cache.

All paths take ``q [tokens, heads, head_dim]`` and ``k, v [tokens, kv_heads, head_dim]`` and
return ``[tokens, heads, head_dim]``; they compute the same function (tested).
"""

from __future__ import annotations

import functools
import inspect
from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class Padded:
    """``batch × seqlen`` token rows; ``mask [batch, seqlen]`` is True at real tokens.
    Tokens beyond ``batch * seqlen`` (sequence-parallel padding) attend to nothing and give 0."""

    mask: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return self.mask.numel()


@dataclass(frozen=True)
class Packed:
    """Sequences packed back to back: sequence i is tokens ``cu_seqlens[i]:cu_seqlens[i+1]``."""

    cu_seqlens: torch.Tensor  # int32 [num_seqs + 1]
    max_seqlen: int

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])


@dataclass
class KVCache:
    """Preallocated keys and values, per decoder layer ``[slots, max_len, kv_heads, head_dim]``
    (this rank's kv heads). A slot holds one sequence being generated."""

    k: dict[int, torch.Tensor]
    v: dict[int, torch.Tensor]

    @classmethod
    def allocate(cls, layers, slots: int, max_len: int, kv_heads: int, head_dim: int, dtype, device) -> KVCache:
        shape = (slots, max_len, kv_heads, head_dim)
        return cls({i: torch.zeros(shape, dtype=dtype, device=device) for i in layers},
                   {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers})


@dataclass(frozen=True)
class Prefill:
    """Packed prompts (as ``Packed``) whose keys and values are also stored in ``cache`` at
    ``(slot[t], pos[t])`` for each token t."""

    cu_seqlens: torch.Tensor
    max_seqlen: int
    cache: KVCache
    slot: torch.Tensor  # [N]
    pos: torch.Tensor  # [N]

    @property
    def num_tokens(self) -> int:
        return int(self.cu_seqlens[-1])


@dataclass(frozen=True)
class Decode:
    """One new token for each sequence in ``slots``, which already has ``lengths`` tokens cached."""

    cache: KVCache
    slots: torch.Tensor  # [B]
    lengths: torch.Tensor  # [B]

    @property
    def num_tokens(self) -> int:
        return len(self.slots)


Layout = Padded | Packed | Prefill | Decode


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layout: Layout, layer: int | None = None) -> torch.Tensor:
    """``layer`` (the global decoder-layer index) selects the cache of cached layouts."""
    if isinstance(layout, Padded):
        return _padded_sdpa(q, k, v, layout)
    if isinstance(layout, Prefill):
        layout.cache.k[layer][layout.slot, layout.pos] = k
        layout.cache.v[layer][layout.slot, layout.pos] = v
    if isinstance(layout, Decode):
        return _decode_sdpa(q, k, v, layout, layer)
    return varlen_attention(q, k, v, layout.cu_seqlens, layout.max_seqlen)


def _decode_sdpa(q, k, v, layout: Decode, layer: int) -> torch.Tensor:
    """Store the new keys/values, then attend each query over its own sequence's cache."""
    kc, vc = layout.cache.k[layer], layout.cache.v[layer]
    kc[layout.slots, layout.lengths] = k
    vc[layout.slots, layout.lengths] = v
    span = int(layout.lengths.max()) + 1
    keys = kc[layout.slots, :span].transpose(1, 2)  # [B, kv_heads, span, d]
    values = vc[layout.slots, :span].transpose(1, 2)
    allowed = torch.arange(span, device=q.device)[None, :] <= layout.lengths[:, None]
    out = F.scaled_dot_product_attention(q[:, :, None, :], keys, values, attn_mask=allowed[:, None, None, :],
                                         enable_gqa=True)
    return out[:, :, 0, :]


def _padded_sdpa(q, k, v, layout: Padded) -> torch.Tensor:
    b, s = layout.mask.shape
    n = b * s

    def rows(t):  # [n, h, d] -> [b, h, s, d]
        return t[:n].view(b, s, *t.shape[1:]).transpose(1, 2)

    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    # A padding query may see no key at all (left padding): let it see itself, so its (ignored)
    # output stays finite instead of NaN, which would poison gradients through 0 * NaN.
    allowed = causal & (layout.mask[:, None, None, :] | torch.eye(s, dtype=torch.bool, device=q.device))
    out = F.scaled_dot_product_attention(rows(q), rows(k), rows(v), attn_mask=allowed, enable_gqa=True)
    out = out.transpose(1, 2).reshape(n, *q.shape[1:])
    if q.shape[0] > n:
        out = torch.cat([out, out.new_zeros(q.shape[0] - n, *q.shape[1:])])
    return out


@functools.cache
def _flash_attn_varlen():
    try:
        from flash_attn import flash_attn_varlen_func
    except ImportError:
        return None
    return flash_attn_varlen_func


@functools.cache
def _torch_varlen():
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None, False
    return varlen_attn, "enable_gqa" in inspect.signature(varlen_attn).parameters


def varlen_backend(device: torch.device, dtype: torch.dtype = torch.bfloat16) -> str:
    """Which implementation ``varlen_attention`` uses for ``dtype`` tensors on ``device``. The
    varlen kernels take fp16/bf16 only; fp32 (a debugging or reference run on a GPU) takes SDPA."""
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16):
        if _flash_attn_varlen() is not None:
            return "flash_attn"
        if _torch_varlen()[0] is not None:
            return "torch_varlen"
    return "sdpa"


def varlen_attention(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, backend: str | None = None) -> torch.Tensor:
    backend = backend or varlen_backend(q.device, q.dtype)
    if backend == "flash_attn":
        return _flash_attn_varlen()(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True)
    if backend == "torch_varlen":
        fn, has_gqa = _torch_varlen()
        if has_gqa:
            return fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, window_size=(-1, 0), enable_gqa=True)
        rep = q.shape[1] // k.shape[1]  # torch 2.11's varlen_attn has no GQA
        k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
        return fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, window_size=(-1, 0))
    return _sdpa_per_sequence(q, k, v, cu_seqlens)


def _sdpa_per_sequence(q, k, v, cu_seqlens) -> torch.Tensor:
    """Reference/CPU path: one causal SDPA call per packed sequence."""
    bounds = cu_seqlens.tolist()
    outs = []
    for s, e in zip(bounds[:-1], bounds[1:]):
        qi, ki, vi = (t[s:e].transpose(0, 1)[None] for t in (q, k, v))
        outs.append(F.scaled_dot_product_attention(qi, ki, vi, is_causal=True, enable_gqa=True)[0].transpose(0, 1))
    out = torch.cat(outs) if outs else q[:0]
    if q.shape[0] > bounds[-1]:
        out = torch.cat([out, out.new_zeros(q.shape[0] - bounds[-1], *q.shape[1:])])
    return out
