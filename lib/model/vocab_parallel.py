"""Log-probs, entropy and cross-entropy from vocab-parallel logits ``[N, vocab / tp]``: the
softmax normaliser and the label's logit are combined with all-reduces of ``[N]`` vectors, so no
rank holds ``[N, full vocab]``. fp32 inside, gradients in the logits' dtype. Padded vocabulary
entries must already be at the dtype's minimum (the CausalLM head does that): they then carry zero
probability. ``group``: the TP group of the model that made the logits (None: the current one).

On CUDA (unless ``LLAMARL_FUSED=0``) two Triton kernels (``_Kernel``); elsewhere, and as their
reference, torch ops (``_Eager``): docs/training.md.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from llamarl.lib.distributed import parallel
from llamarl.lib.kernel_switch import triton_kernels
from llamarl.lib.model import mappings
from llamarl.lib.model.layers import fusions_on
from llamarl.lib.distributed.parallel import group_rank, group_size


def _softmax_stats(logits: torch.Tensor, group: ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 probabilities of this rank's slice, global log-sum-exp per token)."""
    x = logits.float()
    m = mappings.all_reduce(x.amax(-1), group, dist.ReduceOp.MAX)
    exp = (x - m[:, None]).exp_()
    total = mappings.all_reduce(exp.sum(-1), group)
    return exp.div_(total[:, None]), total.log() + m


def _label_logit(logits: torch.Tensor, labels: torch.Tensor, group: ProcessGroup | None):
    """(the label's logit in fp32, all-reduced; its local column; whether this rank holds it)."""
    local = labels - group_rank(group) * logits.shape[-1]
    mine = (local >= 0) & (local < logits.shape[-1])
    idx = local.clamp(0, logits.shape[-1] - 1)
    return mappings.all_reduce(logits.gather(-1, idx[:, None]).squeeze(-1).float() * mine, group), idx, mine


class _Eager(torch.autograd.Function):
    """The log-probs of ``labels`` (None: not asked for) and, ``with_entropy``, the entropy, from
    one softmax: one pass over the vocabulary and one fp32 ``[N, vocab / tp]`` tensor kept for
    backward, whichever of the two are asked for."""

    @staticmethod
    def forward(ctx, logits, labels, group, with_entropy):
        probs, lse = _softmax_stats(logits, group)
        outs, idx, mine, mean_logit = [], None, None, None
        if labels is not None:
            label_logit, idx, mine = _label_logit(logits, labels, group)
            outs.append(label_logit - lse)
        if with_entropy:
            # Padded entries: p = 0 and x = dtype min, so p * x is 0, never 0 * -inf.
            mean_logit = mappings.all_reduce((probs * logits.float()).sum(-1), group)
            outs.append(lse - mean_logit)
        ctx.save_for_backward(probs, logits if with_entropy else None, mean_logit, idx, mine)
        ctx.dtype = logits.dtype
        return tuple(outs) if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        probs, logits, mean_logit, idx, mine = ctx.saved_tensors
        g_logp, g_ent = _split_grads(grads, idx is not None, logits is not None)
        # d logp / dx = onehot(label) - p;  dH/dx_j = p_j (E_p[x] - x_j). p times (E_p[x] - x)
        # first: at padded columns (x = dtype min, p = 0) that is 0, where (E_p[x] - x) * g_ent
        # alone would overflow to inf for |g_ent| > 1 and make 0 * inf = NaN.
        if g_ent is None:
            grad = probs.mul_(-g_logp[:, None])  # probs is reused in place (a single backward)
        else:
            grad = (mean_logit[:, None] - logits.float()).mul_(probs).mul_(g_ent[:, None])
            if g_logp is not None:
                grad.addcmul_(probs, g_logp[:, None], value=-1)
        if g_logp is not None:
            grad.scatter_add_(-1, idx[:, None], (g_logp * mine)[:, None])
        return grad.to(ctx.dtype), None, None, None


def _split_grads(grads, with_logp: bool, with_entropy: bool):
    """(gradient of the log-probs, of the entropy), None where that output was not asked for."""
    grads = iter(grads)
    return next(grads) if with_logp else None, next(grads) if with_entropy else None


# ---- the Triton kernels (CUDA) ---------------------------------------------------------------


@triton_kernels
def _kernels(triton):
    """(forward stats kernel, backward gradient kernel)."""

    @triton.jit
    def stats_kernel(x_ptr, stride, n_cols, m_ptr, s_ptr, t_ptr, WITH_T: tl.constexpr, BLOCK: tl.constexpr):
        # One row per program, online over column blocks: m = max, s = sum exp(x - m), t = sum
        # exp(x - m) * x. The first block holds a real column, so m is finite from then on.
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(base + cols, mask=mask, other=float("-inf")).to(tl.float32)
        m = tl.max(x, 0)
        e = tl.where(mask, tl.exp(x - m), 0.0)
        s = tl.sum(e, 0)
        t = tl.sum(tl.where(mask, e * x, 0.0), 0)
        for start in range(BLOCK, n_cols, BLOCK):
            c = start + cols
            mask = c < n_cols
            x = tl.load(base + c, mask=mask, other=float("-inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(x, 0))
            alpha = tl.exp(m - m_new)
            e = tl.where(mask, tl.exp(x - m_new), 0.0)
            s = s * alpha + tl.sum(e, 0)
            if WITH_T:
                t = t * alpha + tl.sum(tl.where(mask, e * x, 0.0), 0)
            m = m_new
        tl.store(m_ptr + row, m)
        tl.store(s_ptr + row, s)
        if WITH_T:
            tl.store(t_ptr + row, t)

    @triton.jit
    def grad_kernel(x_ptr, stride, g_ptr, g_stride, n_cols, lse_ptr, mean_ptr, glogp_ptr, gent_ptr, target_ptr,
                    HAS_LOGP: tl.constexpr, HAS_ENT: tl.constexpr, BLOCK: tl.constexpr):
        # grad = g_logp * (onehot(target) - p) + g_ent * p * (mean - x), p = exp(x - lse).
        # p * (mean - x) first: at padded columns (x = dtype min) p is 0 and the product stays 0.
        row = tl.program_id(0).to(tl.int64)
        base = x_ptr + row * stride
        out = g_ptr + row * g_stride
        lse = tl.load(lse_ptr + row)
        if HAS_LOGP:
            g_logp = tl.load(glogp_ptr + row)
            target = tl.load(target_ptr + row)
        if HAS_ENT:
            g_ent = tl.load(gent_ptr + row)
            mean = tl.load(mean_ptr + row)
        cols = tl.arange(0, BLOCK)
        for start in range(0, n_cols, BLOCK):
            c = start + cols
            mask = c < n_cols
            x = tl.load(base + c, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(x - lse)
            grad = tl.zeros([BLOCK], tl.float32)
            if HAS_ENT:
                grad += p * (mean - x) * g_ent
            if HAS_LOGP:
                grad += tl.where(c == target, g_logp, 0.0) - p * g_logp
            tl.store(out + c, grad.to(g_ptr.dtype.element_ty), mask=mask)

    return stats_kernel, grad_kernel


def _block(n_cols: int) -> int:
    return min(4096, 1 << max(n_cols - 1, 1).bit_length())


def _k_stats(x: torch.Tensor, group: ProcessGroup | None, with_mean: bool):
    """(log-sum-exp, E_p[logit] or None) per row over the whole (TP-split) vocabulary."""
    n, v = x.shape
    m, s = x.new_empty(n, dtype=torch.float32), x.new_empty(n, dtype=torch.float32)
    t = x.new_empty(n, dtype=torch.float32) if with_mean else s
    if n:
        _kernels()[0][(n,)](x, x.stride(0), v, m, s, t, WITH_T=with_mean, BLOCK=_block(v), num_warps=8)
    if group_size(group) > 1:
        top = mappings.all_reduce(m.clone(), group, dist.ReduceOp.MAX)
        scale = (m - top).exp()
        st = mappings.all_reduce(torch.stack([s * scale, t * scale]) if with_mean else (s * scale)[None], group)
        m, s, t = top, st[0], st[-1]
    return m + s.log(), (t / s if with_mean else None)


def _k_grad(x, lse, mean, target, g_logp, g_ent) -> torch.Tensor:
    grad = torch.empty_like(x)
    n, v = x.shape
    if n:
        _kernels()[1][(n,)](x, x.stride(0), grad, grad.stride(0), v, lse, mean if mean is not None else lse,
                            g_logp if g_logp is not None else lse, g_ent if g_ent is not None else lse,
                            target if target is not None else lse, HAS_LOGP=g_logp is not None,
                            HAS_ENT=g_ent is not None, BLOCK=_block(v), num_warps=8)
    return grad


class _Kernel(torch.autograd.Function):
    """``_Eager``'s outputs from the Triton kernels: forward reads the logits once (an online
    softmax) and keeps them and ``[N]`` vectors; backward reads them once more."""

    @staticmethod
    def forward(ctx, logits, labels, group, with_entropy):
        x = logits if logits.stride(-1) == 1 else logits.contiguous()
        lse, mean = _k_stats(x, group, with_entropy)
        outs, target = [], None
        if labels is not None:
            label_logit, idx, mine = _label_logit(x, labels, group)
            target = torch.where(mine, idx, -1).contiguous()  # -1: the label is on another rank
            outs.append(label_logit - lse)
        if with_entropy:
            outs.append(lse - mean)
        ctx.save_for_backward(x, lse, mean, target)
        ctx.set_materialize_grads(False)
        return tuple(outs) if len(outs) > 1 else outs[0]

    @staticmethod
    def backward(ctx, *grads):
        x, lse, mean, target = ctx.saved_tensors
        grads = [None if g is None else g.float().contiguous() for g in grads]
        g_logp, g_ent = _split_grads(grads, target is not None, mean is not None)
        if g_logp is None and g_ent is None:
            return None, None, None, None
        return _k_grad(x, lse, mean, target, g_logp, g_ent), None, None, None


# ---- the functions ---------------------------------------------------------------------------


def _apply(logits, labels, group, with_entropy: bool):
    kernels = logits.is_cuda and fusions_on(logits.device) and _kernels() is not None
    return (_Kernel if kernels else _Eager).apply(logits, labels, parallel.tp_group() if group is None else group,
                                                  with_entropy)


def log_probs_and_entropy(logits: torch.Tensor, labels: torch.Tensor,
                          group: ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_probs`` and ``entropy`` together (the PPO actor loss needs both), fp32 ``[N]`` each."""
    return _apply(logits, labels, group, True)


def log_probs(logits: torch.Tensor, labels: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """``log softmax(logits)[label]`` per token, fp32 ``[N]``; labels are global vocabulary ids."""
    return _apply(logits, labels, group, False)


def entropy(logits: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per token, fp32 ``[N]``."""
    return _apply(logits, None, group, True)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Per-token cross-entropy, fp32 ``[N]`` (no reduction)."""
    return -log_probs(logits, labels, group)
