"""PPO arithmetic: KL estimators, token rewards, advantage estimators, truncated importance
weights, the policy and value losses and their aggregation (the formulas, and which options give
which peer's algorithm: docs/rl.md).

Tensors are ``[batch, response_len]`` with a 0/1 ``mask`` over real response tokens (right
padding). Pure functions, no communication except where a ``group`` is passed for DP-global
statistics.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

MAX_ABS_SCORE = 1e6
"""The largest |score| ppo trains on; score refuses larger ones. ppo computes in fp32 and squares
the scores' scale in places (whitening, value loss, gradient norms): docs/rl.md, "Scores", says why
this bound."""


def kl_estimate(logp: torch.Tensor, ref_logp: torch.Tensor, kind: str = "kl") -> torch.Tensor:
    """Per-token estimate of KL(π ‖ π_ref) from log-probs of the sampled tokens, by ``kind``
    (the estimators: docs/rl.md)."""
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
    """Generalised advantage estimation over each response; returns (advantages, returns). The
    advantages are the TD errors' returns-to-go discounted by γλ; positions outside the response
    contribute nothing (their value counts as 0)."""
    next_values = torch.cat([values[:, 1:] * mask[:, 1:], torch.zeros_like(values[:, :1])], 1)
    adv = returns_to_go(rewards + gamma * next_values - values, mask, gamma * lam)
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


def _groups(groups: list) -> list[list[int]]:
    """The rows of each group, groups in order of first appearance."""
    rows: dict = {}
    for i, g in enumerate(groups):
        rows.setdefault(g, []).append(i)
    return list(rows.values())


def grpo_advantages(scores: torch.Tensor, groups: list, mask: torch.Tensor, eps: float = 1e-6,
                    norm_by_std: bool = True) -> torch.Tensor:
    """GRPO: each response's score minus its prompt's mean score, divided by the group's standard
    deviation (+ ``eps``) unless ``norm_by_std`` is off (Dr. GRPO), on every token. A group of one
    sample has no baseline: 0."""
    adv = torch.zeros_like(scores)
    for idx in map(torch.tensor, _groups(groups)):
        if len(idx) < 2:
            continue
        s = scores[idx]
        adv[idx] = (s - s.mean()) / (s.std() + eps) if norm_by_std else s - s.mean()
    return adv[:, None] * mask


def group_baseline(scores: torch.Tensor, groups: list, kind: str) -> torch.Tensor:
    """Per response, the baseline its score is compared with: ``mean``, the mean score of its
    prompt's group (REINFORCE++-baseline); ``loo``, the mean of the *other* samples of the group
    (RLOO's leave-one-out). A group of one sample is its own baseline (advantage 0)."""
    base = scores.clone()
    for idx in map(torch.tensor, _groups(groups)):
        n = len(idx)
        if n < 2:
            continue
        total = scores[idx].sum()
        if kind == "mean":
            base[idx] = total / n
        elif kind == "loo":
            base[idx] = (total - scores[idx]) / (n - 1)
        else:
            raise ValueError(f"group baseline {kind!r}: use mean or loo")
    return base


def returns_to_go(rewards: torch.Tensor, mask: torch.Tensor, gamma: float) -> torch.Tensor:
    """G_t = r_t + γ·G_{t+1} within each response (0 outside it): REINFORCE's advantage."""
    out = torch.zeros_like(rewards)
    running = torch.zeros_like(rewards[:, 0])
    for t in reversed(range(rewards.shape[1])):
        running = (rewards[:, t] + gamma * running) * mask[:, t]
        out[:, t] = running
    return out


def equal_score_groups(scores: list[float], groups: list) -> set:
    """The groups (their names in ``groups``) whose scores are all equal, a single sample's
    included: no comparison within them, so no signal for a group baseline (DAPO drops them)."""
    return {groups[rows[0]] for rows in _groups(groups)
            if max(scores[i] for i in rows) == min(scores[i] for i in rows)}


def tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling: per token w = min(π_old / π_rollout, ``cap``), the policy
    the update starts from over the one that sampled the token; and where the cap truncated it.
    Equal log-probs give exactly 1 (for cap ≥ 1): the loss is then unchanged."""
    ratio = (old_logp - rollout_logp).exp()
    return ratio.clamp(max=cap), (ratio > cap).float()


def sequence_tis_weights(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                         cap: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Truncated importance sampling per response: w = min(Π_t π_old(y_t) / π_rollout(y_t), ``cap``)
    over the response's tokens (``mask``), the importance weight of the whole sequence, on each of
    its tokens; and where the cap truncated it. Equal log-probs give exactly 1."""
    ratio = ((old_logp - rollout_logp) * mask).sum(-1, keepdim=True).exp().expand_as(old_logp)
    return ratio.clamp(max=cap), (ratio > cap).float()


def sequence_index(mask: torch.Tensor) -> torch.Tensor:
    """The row of every masked position of ``[batch, len]``, −1 elsewhere: which sequence a token
    belongs to, still known once the tokens are packed (flattened) for the model."""
    rows = torch.arange(mask.shape[0], device=mask.device)[:, None].expand_as(mask)
    return torch.where(mask.bool(), rows, torch.full_like(rows, -1))


def _sequence_sums(x: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor | None,
                   sequences: int | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per sequence, the sum of ``x`` over its masked tokens and their number; and each token's bin
    (its sequence, or ``sequences`` outside the mask), flat. ``seq``/``sequences`` as in ``aggregate``."""
    if seq is None:
        seq, sequences = sequence_index(mask), mask.shape[0]
    elif sequences is None:
        raise ValueError("a sequence mean over packed tokens needs their number of sequences")
    # Tokens outside the mask go to one bin past the last, dropped: a fixed-size scatter with
    # no boolean indexing (which would wait for the device to count the selected tokens). The
    # mask decides, not only ``seq``: packing pads ``seq`` with 0 (sequence-parallel padding).
    bins = torch.where(mask.bool() & (seq >= 0), seq, sequences).reshape(-1)
    x = x.reshape(-1)
    zeros = torch.zeros(sequences + 1, dtype=x.dtype, device=x.device)
    sums = zeros.index_add(0, bins, x)[:sequences]
    counts = zeros.index_add(0, bins, torch.ones_like(x))[:sequences]
    return sums, counts, bins


def sequence_mean(x: torch.Tensor, mask: torch.Tensor, seq: torch.Tensor | None = None,
                  sequences: int | None = None) -> torch.Tensor:
    """At every masked token, the mean of ``x`` over its sequence's masked tokens; 0 elsewhere
    (``seq``/``sequences`` as in ``aggregate``). A sequence lies whole in one call, so the mean
    needs no communication."""
    sums, counts, bins = _sequence_sums(x, mask, seq, sequences)
    means = torch.cat([sums / counts.clamp(min=1), sums.new_zeros(1)])
    return means[bins].reshape(x.shape)


def aggregate(loss: torch.Tensor, mask: torch.Tensor, mode: str, denominator: float,
              seq: torch.Tensor | None = None, sequences: int | None = None) -> torch.Tensor:
    """This micro-batch's share of a mini-batch loss in ``mode`` (docs/rl.md's table), over the
    mini-batch's ``denominator`` (tokens, or sequences, × a constant for ``-sum-norm``): summed over
    micro-batches and DP ranks, the mini-batch's loss.

    ``loss`` and ``mask`` are ``[batch, len]``, or packed tokens of any shape with ``seq`` their
    ``sequence_index`` packed alike and ``sequences`` the micro-batch's rows. The caller knows
    that number on the host: reading it off ``seq`` would stall the GPU once per micro-batch."""
    if mode in ("token-mean", "seq-mean-token-sum-norm"):
        return (loss * mask).sum() / denominator
    if mode == "seq-mean-token-mean":
        sums, counts, _ = _sequence_sums(loss, mask, seq, sequences)
        return (sums / counts.clamp(min=1)).sum() / denominator
    raise ValueError(f"loss aggregation {mode!r}: use token-mean, seq-mean-token-mean or "
                     "seq-mean-token-sum-norm")


def _clipped_surrogate(ratio, advantages, clip_eps: float, clip_eps_high: float | None):
    """max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)) and where the clip took over."""
    high = clip_eps if clip_eps_high is None else clip_eps_high
    unclipped = -advantages * ratio
    clipped = -advantages * ratio.clamp(1 - clip_eps, 1 + high)
    return torch.maximum(unclipped, clipped), (clipped > unclipped).float()


def policy_loss(logp, old_logp, advantages, clip_eps: float, dual_clip: float | None = None,
                clip_eps_high: float | None = None):
    """PPO: the per-token clipped surrogate max(−A·r, −A·clip(r, 1 − ε_low, 1 + ε_high)) with
    r = π/π_old, ε_low = ``clip_eps`` and ε_high = ``clip_eps_high`` (clip-higher; default ε_low),
    then for negative advantages at most −A·c (dual clip ``c``). Also returns the per-token clipped
    indicator and the approximate KL (old − new)."""
    ratio = (logp - old_logp).exp()
    loss, was_clipped = _clipped_surrogate(ratio, advantages, clip_eps, clip_eps_high)
    if dual_clip is not None:
        bound = -advantages * dual_clip
        loss = torch.where(advantages < 0, torch.minimum(loss, bound), loss)
    return loss, was_clipped, old_logp - logp


# The log of GSPO's sequence ratio is held at most this (verl's bound): a response far more likely
# now than when sampled would otherwise overflow exp() where the clip does not apply (A < 0).
GSPO_MAX_LOG_RATIO = 10.0


def gspo_loss(logp, old_logp, advantages, mask, clip_eps: float, clip_eps_high: float | None = None,
              seq: torch.Tensor | None = None, sequences: int | None = None):
    """GSPO (arXiv:2507.18071, docs/rl.md): PPO's clipped surrogate of the *sequence* ratio
    s = exp(mean over the response's tokens of (log π − log π_old)) in the token form
    s_t = sg(s)·π(y_t)/sg(π(y_t)). ``mask`` (and, for packed tokens, ``seq``/``sequences`` as in
    ``aggregate``) tells the sequences apart. Returns the loss, where the clip took over, and the
    approximate KL."""
    seq_log_ratio = sequence_mean((logp - old_logp).detach(), mask, seq, sequences)
    ratio = (logp - logp.detach() + seq_log_ratio).clamp(max=GSPO_MAX_LOG_RATIO).exp()
    loss, was_clipped = _clipped_surrogate(ratio, advantages, clip_eps, clip_eps_high)
    return loss, was_clipped, old_logp - logp


def cispo_loss(logp, old_logp, advantages, cap: float):
    """CISPO (arXiv:2506.13585, docs/rl.md): −sg(min(r, C))·A·log π with r = π/π_old: the clip
    bounds the weight, never the gradient. Returns the loss, where the weight was capped, and the
    approximate KL."""
    ratio = (logp - old_logp).detach().exp()
    return -ratio.clamp(max=cap) * advantages * logp, (ratio > cap).float(), old_logp - logp


# SAPO's log ratio is held within ±this (verl's bound): the gate is flat far out, and exp() there
# would overflow into a 0·inf gradient.
SAPO_MAX_LOG_RATIO = 20.0


def sapo_loss(logp, old_logp, advantages, tau_pos: float, tau_neg: float):
    """SAPO (arXiv:2511.20347, docs/rl.md): −f(r)·A with the soft gate f(r) = σ(τ·(r − 1))·4/τ in
    place of the clip, τ = ``tau_pos`` where A > 0, else ``tau_neg``. Returns the loss, no clip
    indicator (zeros: the gate never clips), and the approximate KL."""
    ratio = (logp - old_logp).clamp(-SAPO_MAX_LOG_RATIO, SAPO_MAX_LOG_RATIO).exp()
    tau = torch.full_like(ratio, tau_neg).masked_fill(advantages > 0, tau_pos)
    gate = torch.sigmoid(tau * (ratio - 1)) * (4 / tau)
    return -gate * advantages, torch.zeros_like(ratio), old_logp - logp


def value_loss(values, old_values, returns, clip: float | None):
    """Per-token ½·max((v − R)², (v_clipped − R)²), v_clipped within ``clip`` of the old value."""
    loss = (values - returns).square()
    if clip is not None:
        clipped = old_values + (values - old_values).clamp(-clip, clip)
        loss = torch.maximum(loss, (clipped - returns).square())
    return 0.5 * loss
