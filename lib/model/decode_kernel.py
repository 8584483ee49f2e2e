"""Decode attention as two Triton passes (split-KV, "flash decoding"): one new query per slot
against that slot's cached keys and values, read where they lie and only up to the slot's own
length. SDPA over the step's span reads every slot's keys to the longest one's length under a
mask, and cuDNN's kernel tiles 64 query rows where a kv head has 4: at 256 slots over a span of
384 it takes 1.80 of a 4.58 ms decode step on an H200 (``bench/results/rollout-h200-2026-12-03.json``).

The first pass runs one program per (slot, kv head, chunk of ``CHUNK`` positions): the query
heads of that kv head together (GQA without repeating keys), an online softmax over the chunk,
and a partial result (running max, sum, weighted values) in fp32. The second folds one slot's
chunks in order, up to its own length. Chunks sit at fixed positions and a slot's result reads
only its own chunks, so its bits do not depend on the span, the batch or the slots beside it:
the batch invariance of docs/generation.md holds as it does with SDPA.

``LLAMARL_FUSED_DECODE`` (``auto``: bf16 and fp16 caches with a power-of-two head size, ``0``:
SDPA everywhere, ``1``) switches it, as lib/kernel_switch.py says.
"""

from __future__ import annotations

import math

import torch

from llamarl.lib.kernel_switch import kernel_wanted, triton_kernels

ENV = "LLAMARL_FUSED_DECODE"
# Positions a first-pass program reads; a slot of length n runs ceil((n + 1) / CHUNK) of them. 256
# decodes 2-3 % faster than 128 on an H200, and 512 no faster (``bench/results/rollout-h200-2026-12-04.json``).
CHUNK = 256
BLOCK_N = 64  # positions a program loads at once
WARPS, STAGES = 4, 3  # the first pass's launch (bench/decode_kernel.py compares others)


def wanted(cache: torch.Tensor) -> bool:
    """Whether the kernels take decode attention over this cache (``[slots, kv, len, head_dim]``)."""
    d = cache.shape[-1]
    kernel_dtype = cache.dtype in (torch.bfloat16, torch.float16) or cache.device.type == "cpu"
    return (kernel_dtype and d >= 16 and d & (d - 1) == 0 and cache.stride(-1) == 1
            and kernel_wanted(ENV, cache.device, _kernels, ("auto", "0", "1")))


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, keys: torch.Tensor, values: torch.Tensor,
                     lengths: torch.Tensor) -> torch.Tensor:
    """``q [b, heads, d]`` (slot i's new query) over ``keys, values [b, kv, len, d]``, slot i's
    positions ``0 .. lengths[i]``, where its new key and value ``k, v [b, kv, d]`` go (stored
    there by the kernel); ``[b, heads, d]`` in ``q``'s dtype, softmax scale ``1 / sqrt(d)``. A
    length past the span (a free slot's) attends over the span and stores nothing."""
    b, heads, d = q.shape
    kv = keys.shape[1]
    group = heads // kv
    chunks = -(-keys.shape[2] // CHUNK)
    partial = torch.empty((b, heads, chunks, d + 2), dtype=torch.float32, device=q.device)  # acc | max | sum
    out = torch.empty((b, heads, d), dtype=q.dtype, device=q.device)
    if b == 0:
        return out
    q, k, v = (t if t.stride(-1) == 1 else t.contiguous() for t in (q, k, v))
    first, fold = _kernels()
    scale = math.log2(math.e) / math.sqrt(d)  # exp2 of log2-scaled scores
    first[(b, kv, chunks)](
        q, k, v, keys, values, lengths, partial, scale, keys.shape[2], chunks,
        *q.stride()[:2], *k.stride()[:2], *v.stride()[:2], *keys.stride()[:3], *values.stride()[:3],
        GROUP=group, GROUP_PAD=max(16, 1 << (group - 1).bit_length()), D=d, CHUNK=CHUNK, BLOCK_N=BLOCK_N,
        DOT_FP32=q.device.type == "cpu", num_warps=WARPS, num_stages=STAGES)  # DOT_FP32: Triton's
    # interpreter (3.9) multiplies bf16 wrongly in tl.dot
    fold[(b, heads)](partial, lengths, out, heads, chunks, D=d, CHUNK=CHUNK)
    return out


@triton_kernels
def _kernels(triton):
    """The two passes' kernels."""

    @triton.jit
    def decode_chunk_kernel(q_ptr, kn_ptr, vn_ptr, k_ptr, v_ptr, len_ptr, part_ptr, scale, span, chunks,
                            sq_b, sq_h, skn_b, skn_h, svn_b, svn_h, sk_b, sk_h, sk_n, sv_b, sv_h, sv_n,
                            GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, D: tl.constexpr,
                            CHUNK: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr):
        slot, kvh, c = tl.program_id(0).to(tl.int64), tl.program_id(1), tl.program_id(2)
        length = tl.load(len_ptr + slot)
        # Past the slot's length: no work. A free slot keeps its last length, which may lie past
        # the span: it attends over the span (its output is not used) and stores nothing.
        end = tl.minimum(tl.minimum(length + 1, (c + 1) * CHUNK), span)
        g, dims = tl.arange(0, GROUP_PAD), tl.arange(0, D)
        heads = kvh * GROUP + g
        q = tl.load(q_ptr + slot * sq_b + heads[:, None] * sq_h + dims[None, :], mask=(g < GROUP)[:, None], other=0.0)
        # The new key and value: the program whose chunk holds position ``length`` stores them
        # there and takes them from registers (its own loads of that row may not see the store).
        k_new = tl.load(kn_ptr + slot * skn_b + kvh * skn_h + dims)
        v_new = tl.load(vn_ptr + slot * svn_b + kvh * svn_h + dims)
        k_row, v_row = k_ptr + slot * sk_b + kvh * sk_h, v_ptr + slot * sv_b + kvh * sv_h
        if (length // CHUNK == c) & (length < span):
            tl.store(k_row + length * sk_n + dims, k_new)
            tl.store(v_row + length * sv_n + dims, v_new)
        if DOT_FP32:
            q, k_new, v_new = q.to(tl.float32), k_new.to(tl.float32), v_new.to(tl.float32)
        m = tl.full((GROUP_PAD,), float("-inf"), tl.float32)
        s = tl.zeros((GROUP_PAD,), tl.float32)
        acc = tl.zeros((GROUP_PAD, D), tl.float32)
        for start in range(c * CHUNK, end, BLOCK_N):
            pos = start + tl.arange(0, BLOCK_N)
            inside, new = pos < end, (pos == length)[:, None]
            k = tl.load(k_row + pos[:, None] * sk_n + dims[None, :], mask=inside[:, None], other=0.0)
            v = tl.load(v_row + pos[:, None] * sv_n + dims[None, :], mask=inside[:, None], other=0.0)
            if DOT_FP32:
                k, v = k.to(tl.float32), v.to(tl.float32)
            k, v = tl.where(new, k_new[None, :], k), tl.where(new, v_new[None, :], v)
            scores = tl.where(inside[None, :], tl.dot(q, tl.trans(k)) * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, 1))
            p = tl.exp2(scores - m_new[:, None])
            alpha = tl.exp2(m - m_new)
            s = s * alpha + tl.sum(p, 1)
            acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
            m = m_new
        row = part_ptr + ((slot * (GROUP * tl.num_programs(1)) + heads) * chunks + c) * (D + 2)
        ok = g < GROUP
        tl.store(row[:, None] + dims[None, :], acc, mask=ok[:, None])
        tl.store(row + D, m, mask=ok)
        tl.store(row + D + 1, s, mask=ok)

    @triton.jit
    def decode_fold_kernel(part_ptr, len_ptr, out_ptr, heads, chunks, D: tl.constexpr, CHUNK: tl.constexpr):
        slot, h = tl.program_id(0).to(tl.int64), tl.program_id(1)
        dims = tl.arange(0, D)
        m, s = float("-inf"), 0.0
        acc = tl.zeros((D,), tl.float32)
        row = part_ptr + (slot * heads + h) * chunks * (D + 2)
        for c in range(0, tl.minimum(tl.load(len_ptr + slot) // CHUNK + 1, chunks)):  # the slot's chunks, in order
            m_c, s_c = tl.load(row + c * (D + 2) + D), tl.load(row + c * (D + 2) + D + 1)
            m_new = tl.maximum(m, m_c)
            a, a_c = tl.exp2(m - m_new), tl.exp2(m_c - m_new)
            acc = acc * a + tl.load(row + c * (D + 2) + dims) * a_c
            s = s * a + s_c * a_c
            m = m_new
        tl.store(out_ptr + (slot * heads + h) * D + dims, (acc / s).to(out_ptr.dtype.element_ty))

    return decode_chunk_kernel, decode_fold_kernel
