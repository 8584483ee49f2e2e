"""Log-probs, entropy and cross-entropy from vocab-parallel logits ``[N, vocab / tp]``.

Each rank touches only its vocabulary slice; the softmax normaliser (max and sum of exps) and
the label's logit are combined with all-reduces of ``[N]`` vectors, so no rank ever holds a
``[N, full vocab]`` tensor. Computed in fp32 whatever the logits' dtype; gradients are returned
in the logits' dtype. Padded vocabulary entries must already be at the dtype's minimum (the
CausalLM head does that): they then carry zero probability.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from . import parallel


def _all_reduce(x: torch.Tensor, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if parallel.topology().tp > 1:
        dist.all_reduce(x, op=op, group=parallel.tp_group())
    return x


def _softmax_stats(logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 probabilities of this rank's slice, global log-sum-exp per token)."""
    x = logits.float()
    m = _all_reduce(x.amax(-1), dist.ReduceOp.MAX)
    exp = (x - m[:, None]).exp_()
    total = _all_reduce(exp.sum(-1))
    return exp.div_(total[:, None]), total.log() + m


def _vocab_start(logits: torch.Tensor) -> int:
    return parallel.topology().tp_rank * logits.shape[-1]


def _label_logit(logits: torch.Tensor, labels: torch.Tensor):
    """(the label's logit in fp32, all-reduced; its local column; whether this rank holds it)."""
    local = labels - _vocab_start(logits)
    mine = (local >= 0) & (local < logits.shape[-1])
    idx = local.clamp(0, logits.shape[-1] - 1)
    return _all_reduce(logits.gather(-1, idx[:, None]).squeeze(-1).float() * mine), idx, mine


class _LogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels):
        probs, lse = _softmax_stats(logits)
        label_logit, idx, mine = _label_logit(logits, labels)
        ctx.save_for_backward(probs, idx, mine)
        ctx.dtype = logits.dtype
        return label_logit - lse

    @staticmethod
    def backward(ctx, g):
        probs, idx, mine = ctx.saved_tensors
        # d logp / d x = onehot(label) - softmax; probs is reused in place (single backward).
        grad = probs.mul_(-g[:, None])
        grad.scatter_add_(-1, idx[:, None], (g * mine)[:, None])
        return grad.to(ctx.dtype), None


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits):
        probs, lse = _softmax_stats(logits)
        x = logits.float()
        # Padded entries: p = 0 and x = dtype min, so p * x is 0, never 0 * -inf.
        mean_logit = _all_reduce((probs * x).sum(-1))
        ctx.save_for_backward(probs, logits, mean_logit)
        return lse - mean_logit

    @staticmethod
    def backward(ctx, g):
        probs, logits, mean_logit = ctx.saved_tensors
        # dH/dx_j = p_j (E_p[x] - x_j)
        grad = probs * (mean_logit[:, None] - logits.float()) * g[:, None]
        return grad.to(logits.dtype)


class _LogProbEntropy(torch.autograd.Function):
    """Both from one softmax: one pass over the vocabulary and one fp32 ``[N, vocab / tp]`` tensor
    kept for backward, where the two separate ops keep two."""

    @staticmethod
    def forward(ctx, logits, labels):
        probs, lse = _softmax_stats(logits)
        label_logit, idx, mine = _label_logit(logits, labels)
        mean_logit = _all_reduce((probs * logits.float()).sum(-1))
        ctx.save_for_backward(probs, logits, mean_logit, idx, mine)
        return label_logit - lse, lse - mean_logit

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        probs, logits, mean_logit, idx, mine = ctx.saved_tensors
        g_logp = torch.zeros_like(mean_logit) if g_logp is None else g_logp
        g_ent = torch.zeros_like(mean_logit) if g_ent is None else g_ent
        # d logp / dx = onehot(label) - p;  dH/dx_j = p_j (E_p[x] - x_j)
        grad = probs * ((mean_logit[:, None] - logits.float()) * g_ent[:, None] - g_logp[:, None])
        grad.scatter_add_(-1, idx[:, None], (g_logp * mine)[:, None])
        return grad.to(logits.dtype), None


def log_probs_and_entropy(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_probs`` and ``entropy`` together (the PPO actor loss needs both), fp32 ``[N]`` each."""
    return _LogProbEntropy.apply(logits, labels)


def log_probs(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """``log softmax(logits)[label]`` per token, fp32 ``[N]``; labels are global vocabulary ids."""
    return _LogProb.apply(logits, labels)


def entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per token, fp32 ``[N]``."""
    return _Entropy.apply(logits)


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy, fp32 ``[N]`` (no reduction)."""
    return -log_probs(logits, labels)
