"""PPO arithmetic: KL estimators, token rewards, GAE, advantage normalisation, the losses.

Tensors are ``[batch, response_len]`` with a 0/1 ``mask`` over real response tokens (right
padding). Pure functions, no communication except where a ``group`` is passed for DP-global
statistics.
"""

from __future__ import annotations

import torch
import torch.distributed as dist


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "kl") -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from log-probs of the sampled tokens.

    ``kl``: log r (k1); ``abs``: |log r|; ``mse``: ½ (log r)² (k2); ``low_var_kl``: the
    unbiased, non-negative k3 = r' − log r' − 1 with r' = π_ref / π, clamped to [-10, 10]."""
    log_ratio = logp - ref_logp
    if kind == "kl":
        return log_ratio
    if kind == "abs":
        return log_ratio.abs()
    if kind == "mse":
        return 0.5 * log_ratio.square()
    if kind == "low_var_kl":
        inv = -log_ratio
        return (inv.exp() - inv - 1).clamp(-10, 10)
    raise ValueError(f"kl estimator {kind!r}: use kl, abs, mse or low_var_kl")


def token_rewards(scores: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, beta: float) -> torch.Tensor:
    """``−β·kl`` at every response token, plus the sequence's score at its last response token."""
    rewards = -beta * kl * mask
    last = (mask.cumsum(-1) == mask.sum(-1, keepdim=True)) & mask.bool()
    return rewards + last * scores[:, None]


def gae(rewards: torch.Tensor, values: torch.Tensor, mask: torch.Tensor, gamma: float, lam: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalised advantage estimation over each response; returns (advantages, returns).
    Positions after the last real token contribute nothing (next value 0)."""
    adv = torch.zeros_like(rewards)
    next_value = torch.zeros_like(rewards[:, 0])
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        m = mask[:, t]
        delta = rewards[:, t] + gamma * next_value - values[:, t]
        running = (delta + gamma * lam * running) * m
        adv[:, t] = running
        next_value = values[:, t] * m
    return adv, (adv + values) * mask


def masked_mean(x: torch.Tensor, mask: torch.Tensor, group=None) -> torch.Tensor:
    total = torch.stack([(x * mask).sum(), mask.sum()]).double()
    if group is not None:
        dist.all_reduce(total, group=group)
    return (total[0] / total[1].clamp(min=1)).to(x.dtype)


def whiten(x: torch.Tensor, mask: torch.Tensor, group=None, eps: float = 1e-8) -> torch.Tensor:
    """Normalise to mean 0, variance 1 over the masked entries (over DP when ``group`` is given)."""
    mean = masked_mean(x, mask, group)
    var = masked_mean((x - mean).square(), mask, group)
    return (x - mean) * torch.rsqrt(var + eps) * mask


def grpo_advantages(scores: torch.Tensor, groups: list, mask: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """GRPO: each response's score normalised within its prompt's group of samples, on every token."""
    adv = torch.zeros_like(scores)
    for g in set(groups):
        idx = torch.tensor([i for i, x in enumerate(groups) if x == g])
        s = scores[idx]
        adv[idx] = (s - s.mean()) / (s.std(unbiased=len(idx) > 1) + eps) if len(idx) > 1 else torch.zeros_like(s)
    return adv[:, None] * mask


def sequence_index(mask: torch.Tensor) -> torch.Tensor:
    """The row of every masked position of ``[batch, len]``, −1 elsewhere: which sequence a token
    belongs to, still known once the tokens are packed (flattened) for the model."""
    rows = torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)
    return torch.where(mask.bool(), rows, torch.full_like(rows, -1))


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, denominator: float,
              seq: torch.Tensor | None = None, sequences: int | None = None) -> torch.Tensor:
    """Sum of this micro-batch's share of a mini-batch loss.

    ``token-mean``: Σ loss·mask / (tokens in the whole mini-batch) — ``denominator``;
    ``seq-mean-token-mean``: Σ_seq mean_tokens(loss) / (sequences in the mini-batch).
    Summing these over micro-batches and DP ranks gives the mini-batch mean.

    ``loss`` and ``mask`` are ``[batch, len]``, or packed tokens of any shape with ``seq`` their
    ``sequence_index`` packed alike and ``sequences`` the micro-batch's rows. The caller knows
    that number on the host: reading it off ``seq`` would stall the GPU once per micro-batch."""
    if mode == "token-mean":
        return (loss * mask).sum() / denominator
    if mode == "seq-mean-token-mean":
        if seq is None:
            seq, sequences = sequence_index(mask), mask.shape[0]
        elif sequences is None:
            raise ValueError("seq-mean-token-mean over packed tokens needs their number of sequences")
        # Tokens outside the mask go to one bin past the last, dropped: a fixed-size scatter with
        # no boolean indexing (which would wait for the device to count the selected tokens). The
        # mask decides, not only ``seq``: packing pads ``seq`` with 0 (sequence-parallel padding).
        bins = torch.where(mask.bool() & (seq >= 0), seq, sequences).reshape(-1)
        loss = loss.reshape(-1)
        zeros = torch.zeros(sequences + 1, dtype=loss.dtype, device=loss.device)
        sums = zeros.index_add(0, bins, loss)[:sequences]
        counts = zeros.index_add(0, bins, torch.ones_like(loss))[:sequences]
        return (sums / counts.clamp(min=1)).sum() / denominator
    raise ValueError(f"loss aggregation {mode!r}: use token-mean or seq-mean-token-mean")


def policy_loss(logp, old_logp, advantages, clip_eps: float, dual_clip: float | None = None):
    """Per-token clipped surrogate (with dual clip ``c`` for negative advantages); also returns the
    per-token clipped indicator and the approximate KL (old − new)."""
    ratio = (logp - old_logp).exp()
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_eps, 1 + clip_eps)
    loss = torch.maximum(unclipped, clipped)
    was_clipped = (clipped > unclipped).float()
    if dual_clip is not None:
        bound = -advantages * dual_clip
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    return loss, was_clipped, old_logp - logp


def value_loss(values, old_values, returns, clip: float | None):
    """Per-token ½·max((v − R)², (v_clipped − R)²), v_clipped within ``clip`` of the old value."""
    loss = (values - returns).square()
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped - returns).square())
    return 0.5 * loss
