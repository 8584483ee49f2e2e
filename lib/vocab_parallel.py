"""Log-probs, entropy and cross-entropy from vocab-parallel logits ``[N, vocab / tp]``.

Each rank touches only its vocabulary slice; the softmax normaliser (max and sum of exps) and
the label's logit are combined with all-reduces of ``[N]`` vectors, so no rank ever holds a
``[N, full vocab]`` tensor. Computed in fp32 whatever the logits' dtype; gradients are returned
in the logits' dtype. Padded vocabulary entries must already be at the dtype's minimum (the
CausalLM head does that): they then carry zero probability.

``group`` is the TP group the vocabulary is split over: the ``tp_group`` of the model that made
the logits. Left out (None), it is the current topology's, ``parallel.tp_group()`` — the same
group unless the groups were rebuilt after the model.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from . import parallel
from .parallel import group_rank, group_size


def _or_current(group: ProcessGroup | None) -> ProcessGroup | None:
    return parallel.tp_group() if group is None else group


def _all_reduce(x: torch.Tensor, group: ProcessGroup | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _softmax_stats(logits: torch.Tensor, group: ProcessGroup | None) -> tuple[torch.Tensor, torch.Tensor]:
    """(fp32 probabilities of this rank's slice, global log-sum-exp per token)."""
    x = logits.float()
    m = _all_reduce(x.amax(-1), group, dist.ReduceOp.MAX)
    exp = (x - m[:, None]).exp_()
    total = _all_reduce(exp.sum(-1), group)
    return exp.div_(total[:, None]), total.log() + m


def _label_logit(logits: torch.Tensor, labels: torch.Tensor, group: ProcessGroup | None):
    """(the label's logit in fp32, all-reduced; its local column; whether this rank holds it)."""
    local = labels - group_rank(group) * logits.shape[-1]
    mine = (local >= 0) & (local < logits.shape[-1])
    idx = local.clamp(0, logits.shape[-1] - 1)
    return _all_reduce(logits.gather(-1, idx[:, None]).squeeze(-1).float() * mine, group), idx, mine


class _LogProb(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, group):
        probs, lse = _softmax_stats(logits, group)
        label_logit, idx, mine = _label_logit(logits, labels, group)
        ctx.save_for_backward(probs, idx, mine)
        ctx.dtype = logits.dtype
        return label_logit - lse

    @staticmethod
    def backward(ctx, g):
        probs, idx, mine = ctx.saved_tensors
        # d logp / d x = onehot(label) - softmax; probs is reused in place (single backward).
        grad = probs.mul_(-g[:, None])
        grad.scatter_add_(-1, idx[:, None], (g * mine)[:, None])
        return grad.to(ctx.dtype), None, None


class _Entropy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, group):
        probs, lse = _softmax_stats(logits, group)
        x = logits.float()
        # Padded entries: p = 0 and x = dtype min, so p * x is 0, never 0 * -inf.
        mean_logit = _all_reduce((probs * x).sum(-1), group)
        ctx.save_for_backward(probs, logits, mean_logit)
        return lse - mean_logit

    @staticmethod
    def backward(ctx, g):
        probs, logits, mean_logit = ctx.saved_tensors
        # dH/dx_j = p_j (E_p[x] - x_j)
        grad = probs * (mean_logit[:, None] - logits.float()) * g[:, None]
        return grad.to(logits.dtype), None


class _LogProbEntropy(torch.autograd.Function):
    """Both from one softmax: one pass over the vocabulary and one fp32 ``[N, vocab / tp]`` tensor
    kept for backward, where the two separate ops keep two."""

    @staticmethod
    def forward(ctx, logits, labels, group):
        probs, lse = _softmax_stats(logits, group)
        label_logit, idx, mine = _label_logit(logits, labels, group)
        mean_logit = _all_reduce((probs * logits.float()).sum(-1), group)
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
        return grad.to(logits.dtype), None, None


def log_probs_and_entropy(logits: torch.Tensor, labels: torch.Tensor,
                          group: ProcessGroup | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``log_probs`` and ``entropy`` together (the PPO actor loss needs both), fp32 ``[N]`` each."""
    return _LogProbEntropy.apply(logits, labels, _or_current(group))


def log_probs(logits: torch.Tensor, labels: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """``log softmax(logits)[label]`` per token, fp32 ``[N]``; labels are global vocabulary ids."""
    return _LogProb.apply(logits, labels, _or_current(group))


def entropy(logits: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` per token, fp32 ``[N]``."""
    return _Entropy.apply(logits, _or_current(group))


def cross_entropy(logits: torch.Tensor, labels: torch.Tensor, group: ProcessGroup | None = None) -> torch.Tensor:
    """Per-token cross-entropy, fp32 ``[N]`` (no reduction)."""
    return -log_probs(logits, labels, group)
