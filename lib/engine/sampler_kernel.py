"""The sampler's per-shard pass (``sampling._row_stats``) as one Triton kernel (why a kernel:
docs/generation.md "Sampling"). A program per (row, split of the columns) reads that part of the
row alone, in a fixed order, and writes its own stats, combined later as the TP shards' are: the
splits depend on the vocabulary only, so a batch's size or company never changes a row's numbers
(and a row's columns are read by several programs at once: one program a row leaves most of the
GPU idle at 64 rows, each streaming 0.5 MB of Llama 3's vocabulary alone). The hash runs on uint32: a wrapping
multiply keeps the low 32 bits, what ``sampling._mix``'s ``& 2^32-1`` keeps, so the uniforms are
``sampling.uniforms``' bits. Imported only where Triton is (``sampling._kernel``).
"""

import triton
import triton.language as tl


@triton.jit
def mix(x):
    x = x ^ (x >> 16)
    x = x * 0x21F0AAAD
    x = x ^ (x >> 15)
    x = x * 0x735A2D97
    return x ^ (x >> 15)

@triton.jit
def row_stats_kernel(x_ptr, stride, n_cols, split_cols, keys_ptr, steps_ptr, lo_ptr, out_ptr, vocab_start,
                     temperature, GREEDY: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    split = tl.program_id(1)
    first = split * split_cols
    end = tl.minimum(first + split_cols, n_cols)
    base = x_ptr + row * stride
    lo = tl.load(lo_ptr + row)
    if not GREEDY:
        s = tl.load(steps_ptr + row).to(tl.uint32)  # the low 32 bits: ``steps & 2^32-1``
        r1 = mix(tl.load(keys_ptr + 2 * row).to(tl.uint32) ^ mix(s))
        r2 = mix(tl.load(keys_ptr + 2 * row + 1).to(tl.uint32) ^ mix(s ^ 0x5BD1E995))
    cols = tl.arange(0, BLOCK)
    best = float("-inf")
    arg = 0
    xa = 0.0
    m = float("-inf")
    total = 0.0
    for start in range(first, end, BLOCK):
        c = start + cols
        mask = c < end
        raw = tl.load(base + c, mask=mask, other=float("-inf")).to(tl.float32)
        if GREEDY:
            x = raw
            y = x
        else:
            x = raw / temperature
            h = mix(mix((vocab_start + c).to(tl.uint32) ^ r1) ^ r2)
            u = ((h >> 8).to(tl.float32) + 0.5) * (1.0 / 16777216.0)
            y = x - tl.log(-tl.log(u))
        y = tl.where(mask & (raw >= lo), y, float("-inf"))
        b_best = tl.max(y, 0)
        b_arg = tl.argmax(y, 0, tie_break_left=True)
        b_xa = tl.sum(tl.where(cols == b_arg, x, 0.0), 0)
        # Strictly greater: a tie keeps the earlier block's token, as torch's max does.
        take = (b_best > best) | (start == first)
        best = tl.where(take, b_best, best)
        arg = tl.where(take, start + b_arg, arg)
        xa = tl.where(take, b_xa, xa)
        m_new = tl.maximum(m, tl.max(x, 0))
        total = total * tl.exp(m - m_new) + tl.sum(tl.where(mask, tl.exp(x - m_new), 0.0), 0)
        m = m_new
    out = out_ptr + (split * tl.num_programs(0) + row) * 5
    tl.store(out, best.to(tl.float64))
    tl.store(out + 1, (arg + vocab_start).to(tl.float64))
    tl.store(out + 2, m.to(tl.float64))
    tl.store(out + 3, total.to(tl.float64))
    tl.store(out + 4, xa.to(tl.float64))
