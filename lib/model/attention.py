"""Causal self-attention, and the metadata that says how a batch's tokens form sequences:
``Padded`` rows with a key mask, ``Packed`` sequences back to back (remove-padding; the backends:
docs/lib.md, "Attention backends"), or generation's ``Prefill`` / ``Decode`` over a ``KVCache``.
All paths take ``q [tokens, heads, head_dim]`` and ``k, v [tokens, kv_heads, head_dim]`` and
compute the same function (tested).
"""

from __future__ import annotations

import functools
import inspect
import warnings
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from llamarl.lib.model import decode_kernel


@dataclass(frozen=True)
class Padded:
    """``batch × seqlen`` token rows; ``mask [batch, seqlen]`` is True at real tokens.
    Tokens beyond ``batch * seqlen`` (sequence-parallel padding) attend to nothing and give 0."""

    mask: torch.Tensor


@dataclass(frozen=True)
class Packed:
    """Sequences packed back to back: sequence i is tokens ``cu_seqlens[i]:cu_seqlens[i+1]``."""

    cu_seqlens: torch.Tensor  # int32 [num_seqs + 1]
    max_seqlen: int


@dataclass
class KVCache:
    """Preallocated keys and values, per decoder layer ``[slots, kv_heads, max_len, head_dim]``
    (this rank's kv heads). A slot holds one sequence being generated; with the length axis third,
    a slot's first ``span`` keys are a strided view that attention reads in place."""

    k: dict[int, torch.Tensor]
    v: dict[int, torch.Tensor]

    @classmethod
    def allocate(cls, layers, slots: int, max_len: int, kv_heads: int, head_dim: int, dtype, device) -> KVCache:
        shape = (slots, kv_heads, max_len, head_dim)
        return cls({i: torch.zeros(shape, dtype=dtype, device=device) for i in layers},
                   {i: torch.zeros(shape, dtype=dtype, device=device) for i in layers})

    def copy_rows(self, src_cache: KVCache, src: torch.Tensor | slice, dst: torch.Tensor | slice) -> None:
        """Slot ``dst[i]`` gets the first ``src_cache``-length positions of ``src_cache``'s slot
        ``src[i]``, every layer (a prompt prefilled once, copied to each of its samples' slots;
        ``slice(None)``: every slot, into a longer cache)."""
        for mine, theirs in ((self.k, src_cache.k), (self.v, src_cache.v)):
            for i, t in mine.items():
                rows = theirs[i][src]
                t[dst, :, : rows.shape[2]] = rows

    def move_slots(self, src: torch.Tensor, dst: torch.Tensor) -> None:
        """Slot ``dst[i]`` becomes a copy of slot ``src[i]`` (whole rows; compacts live sequences)."""
        for cache in (self.k, self.v):
            for t in cache.values():
                t[dst] = t[src]


@dataclass(frozen=True)
class Prefill(Packed):
    """Packed prompts whose keys and values are also stored in ``cache`` at ``(slot[t], pos[t])``
    for each token t."""

    cache: KVCache
    slot: torch.Tensor  # [N]
    pos: torch.Tensor  # [N]


@dataclass(frozen=True)
class Decode:
    """One new token for each of the first ``len(lengths)`` slots of ``cache``, in slot order. Slot
    i already holds ``lengths[i]`` tokens, no live one more than ``span - 1`` (a free slot keeps
    its last length; its output is not used). ``span`` is fixed on the host (a CUDA graph is
    captured per span): every slot attends over ``span`` positions, those past its own length
    masked out by ``bias``, which is built once per step, not per layer."""

    cache: KVCache
    lengths: torch.Tensor  # [slots]
    span: int
    bias: torch.Tensor = field(init=False, repr=False)  # [slots, 1, 1, span]: 0 or -inf

    def __post_init__(self):
        dtype = next(iter(self.cache.k.values())).dtype
        allowed = torch.arange(self.span, device=self.lengths.device)[None, :] <= self.lengths[:, None]
        bias = torch.zeros(allowed.shape, dtype=dtype, device=allowed.device).masked_fill_(~allowed, float("-inf"))
        object.__setattr__(self, "bias", bias[:, None, None, :])


AttentionMetadata = Padded | Packed | Prefill | Decode


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, meta: AttentionMetadata,
              layer: int | None = None) -> torch.Tensor:
    """``layer`` (the global decoder-layer index) selects the KV cache of ``Prefill`` and ``Decode``."""
    if isinstance(meta, Padded):
        return _padded_sdpa(q, k, v, meta)
    if isinstance(meta, Prefill):
        meta.cache.k[layer][meta.slot, :, meta.pos] = k
        meta.cache.v[layer][meta.slot, :, meta.pos] = v
    if isinstance(meta, Decode):
        return _decode_attention(q, k, v, meta, layer)
    return varlen_attention(q, k, v, meta.cu_seqlens, meta.max_seqlen)


def _decode_attention(q, k, v, meta: Decode, layer: int) -> torch.Tensor:
    """Store the new keys/values, then attend each query over its own slot's cache where it lies
    (a strided view: no gather, no copy). The query heads of one kv head are the rows of one
    problem (GQA without repeating keys); static shapes, captured in the decode graph. On CUDA the
    split-KV kernels of ``decode_kernel`` (each slot read to its own length), elsewhere one SDPA
    call with the step's length mask."""
    b, heads, d = q.shape
    kc, vc = meta.cache.k[layer][:b], meta.cache.v[layer][:b]
    keys, values = kc[:, :, : meta.span], vc[:, :, : meta.span]  # [B, kv, span, d] views
    if decode_kernel.wanted(keys):
        return decode_kernel.decode_attention(q, k, v, keys, values, meta.lengths)
    slots = torch.arange(b, device=q.device)
    kc[slots, :, meta.lengths] = k
    vc[slots, :, meta.lengths] = v
    kv = keys.shape[1]
    out = F.scaled_dot_product_attention(q.view(b, kv, heads // kv, d), keys, values, attn_mask=meta.bias)
    return out.reshape(b, heads, d)


def _padded_sdpa(q, k, v, meta: Padded) -> torch.Tensor:
    b, s = meta.mask.shape
    n = b * s

    def rows(t):  # [n, h, d] -> [b, h, s, d]
        return t[:n].view(b, s, *t.shape[1:]).transpose(1, 2)

    causal = torch.ones(s, s, dtype=torch.bool, device=q.device).tril()
    # A padding query may see no key at all (left padding): let it see itself, so its (ignored)
    # output stays finite instead of NaN, which would poison gradients through 0 * NaN.
    allowed = causal & (meta.mask[:, None, None, :] | torch.eye(s, dtype=torch.bool, device=q.device))
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


def warm_up(device: torch.device, dtype: torch.dtype, heads: int, kv_heads: int, head_dim: int) -> None:
    """Run the varlen path once on a few tokens, so that a model's first forward does not pay for
    its first call (a kernel's first launch loads it; through torch's ``varlen_attn``, the custom
    op's first call also imports ``torch._dynamo``). Safe in a thread: the rollout stage runs it
    while it loads the weights."""
    if device.type == "cuda" and device.index is not None:
        torch.cuda.set_device(device)  # the thread's current device
    with torch.no_grad():
        q = torch.zeros(8, heads, head_dim, dtype=dtype, device=device)
        kv = torch.zeros(8, kv_heads, head_dim, dtype=dtype, device=device)
        cu_seqlens = torch.tensor([0, 3, 8], dtype=torch.int32, device=device)  # unequal: not the dense path
        varlen_attention(q, kv, kv, cu_seqlens, 5)
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def equal_lengths(num_tokens: int, cu_seqlens: torch.Tensor, max_seqlen: int) -> bool:
    """Whether every packed sequence is ``max_seqlen`` long, read from host numbers only (the
    sequences' count and the longest): lengths summing to count × longest are all the longest."""
    return max_seqlen > 0 and (cu_seqlens.shape[0] - 1) * max_seqlen == num_tokens


DENSE_SHAPES_MAX = 16
"""cuDNN builds a plan for every new attention shape (a tenth of a second of host time or so,
forward and backward), so the dense path takes at most this many distinct (sequences,
length) shapes per process; the rest go varlen. Single sequences always do: micro-batches of one
sequence of any length (ragged data) would each have built one."""
_dense_shapes: set[tuple[int, int]] = set()


def attention_backend(device: torch.device, dtype: torch.dtype, num_tokens: int, cu_seqlens: torch.Tensor,
                      max_seqlen: int) -> str:
    """The fastest backend for these packed sequences, from host numbers only: ``sdpa_dense``
    for two or more sequences of one length (a shape seen before, or one of the first
    ``DENSE_SHAPES_MAX``) where a varlen kernel runs, else ``varlen_backend``'s."""
    backend = varlen_backend(device, dtype)
    seqs = cu_seqlens.shape[0] - 1
    if backend != "sdpa" and seqs >= 2 and equal_lengths(num_tokens, cu_seqlens, max_seqlen):
        shape = (seqs, max_seqlen)
        if shape in _dense_shapes or len(_dense_shapes) < DENSE_SHAPES_MAX:
            _dense_shapes.add(shape)
            return "sdpa_dense"
    return backend


def varlen_attention(q, k, v, cu_seqlens: torch.Tensor, max_seqlen: int, backend: str | None = None) -> torch.Tensor:
    """Causal attention within each packed sequence. ``backend`` (None: ``attention_backend``'s
    choice): one of ``varlen_backend``'s, or ``sdpa_dense`` (equal-length sequences as one SDPA
    batch: cuDNN on Hopper, faster than the varlen kernels, docs/benchmarks.md)."""
    if backend is None:
        backend = attention_backend(q.device, q.dtype, q.shape[0], cu_seqlens, max_seqlen)
    if backend == "sdpa_dense":
        return _sdpa_dense(q, k, v, cu_seqlens.shape[0] - 1, max_seqlen)
    if backend == "flash_attn":
        return _flash_attn_varlen()(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, causal=True)
    if backend == "torch_varlen":
        if _direct_flash_ok:
            out = _direct_flash(q, k, v, cu_seqlens, max_seqlen)
            if out is not None:
                return out
        fn, has_gqa = _torch_varlen()
        if not has_gqa:
            rep = q.shape[1] // k.shape[1]  # torch 2.11's varlen_attn has no GQA
            k, v = repeat_kv(k, rep), repeat_kv(v, rep)
        gqa = {"enable_gqa": True} if has_gqa else {}
        return fn(q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, window_size=(-1, 0), **gqa)
    return _sdpa_per_sequence(q, k, v, cu_seqlens)


_direct_flash_ok = True


def _direct_flash(q, k, v, cu_seqlens, max_seqlen) -> torch.Tensor | None:
    """The flash kernels torch's ``varlen_attn`` runs, called as the aten ops themselves
    (``_FlashVarlen``): that custom op's Python wrapper costs host time on every call (about a
    tenth of a ms, forward and backward; ragged ppo updates are host-bound), its first call
    imports ``torch._dynamo`` (~1 s a process), and torch 2.11's has no GQA (keys and values
    repeated to every query head, and summed back in backward). The same bits
    (``tests/test_generate_gpu.py``). None (and ``varlen_attn`` from then on) if this torch's aten
    ops take other arguments."""
    global _direct_flash_ok
    try:
        return _FlashVarlen.apply(q, k, v, cu_seqlens, max_seqlen)
    except torch.OutOfMemoryError:  # a RuntimeError, but no sign of other ops: the direct path stays
        raise
    except (AttributeError, TypeError, RuntimeError) as e:
        _direct_flash_ok = False
        warnings.warn(f"torch's flash aten ops refused llamarl's call ({type(e).__name__}: {e}); varlen attention "
                      "goes through torch.nn.attention.varlen.varlen_attn from now on (slower on the host)")
        return None


class _FlashVarlen(torch.autograd.Function):
    """Causal attention within packed sequences: torch's flash forward and backward aten ops, as
    ``varlen_attn`` calls them (no dropout; GQA in the kernel)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_seqlens, max_seqlen):
        out, lse, seed, offset, _ = torch.ops.aten._flash_attention_forward(
            q, k, v, cu_seqlens, cu_seqlens, max_seqlen, max_seqlen, 0.0, True, False,
            window_size_left=-1, window_size_right=0)
        ctx.save_for_backward(q, k, v, out, lse, cu_seqlens, seed, offset)
        ctx.max_seqlen = max_seqlen
        return out

    @staticmethod
    def backward(ctx, dout):
        q, k, v, out, lse, cu_seqlens, seed, offset = ctx.saved_tensors
        n = ctx.max_seqlen
        dq, dk, dv = torch.ops.aten._flash_attention_backward(
            dout.contiguous(), q, k, v, out, lse, cu_seqlens, cu_seqlens, n, n, 0.0, True, seed, offset,
            window_size_left=-1, window_size_right=0)
        return dq, dk, dv, None, None


def _sdpa_dense(q, k, v, seqs: int, seqlen: int) -> torch.Tensor:
    """Equal-length packed sequences as one causal SDPA batch (views in, a view out: the packed
    ``[tokens, heads, d]`` layout is SDPA's ``[batch, seq, heads, d]`` transposed)."""

    def rows(t):
        return t.view(seqs, seqlen, *t.shape[1:]).transpose(1, 2)

    out = F.scaled_dot_product_attention(rows(q), rows(k), rows(v), is_causal=True, enable_gqa=True)
    return out.transpose(1, 2).reshape(q.shape)


def repeat_kv(x: torch.Tensor, rep: int) -> torch.Tensor:
    """``[tokens, kv_heads, d]`` -> ``[tokens, kv_heads * rep, d]``, each kv head repeated for its
    ``rep`` query heads (``repeat_interleave``'s result, as a broadcast copy: no index tensor;
    its backward is a plain sum over the repeats)."""
    if rep == 1:
        return x
    n, kv, d = x.shape
    return x[:, :, None, :].expand(n, kv, rep, d).reshape(n, kv * rep, d)


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
