"""PPO's data: the rollout joined with its scores, the order of mini-batches, micro-batches by a
token budget, padding, and the advantages the losses read.

Tensors are in *label space*, right-padded: position t holds what concerns token t + 1 (its
log-prob, value, advantage), so a response of a sample occupies positions
``prompt_len - 1 … len(ids) - 2``.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from llamarl.lib import publish, rl
from llamarl.lib.errors import UserError
from llamarl.stages import contract
from llamarl.stages.config import PPOConfig


@dataclass
class Sample:
    ids: list[int]
    prompt_len: int
    old_logp: list[float]
    score: float
    group: str

    @property
    def response_len(self) -> int:
        return len(self.ids) - self.prompt_len


def load_samples(rollout: str, scores: str) -> list[Sample]:
    """The rollout's responses with their scores, both verified against their manifests, and the
    scores checked to be of this very rollout."""
    rollout_m = publish.require_verified(rollout, contract.ROLLOUT, f"{contract.PARTS}/")
    scores_m = publish.require_verified(scores, contract.SCORES, f"{contract.PARTS}/")
    scored = scores_m.get("request", {}).get("rollout_id")
    if scored != publish.output_id(rollout):
        raise UserError(f"{scores} scores another rollout (id {scored}) than {rollout} (id {publish.output_id(rollout)}); "
                        "score this rollout first")

    def key(row: dict) -> tuple:
        return tuple(row[k] for k in contract.KEY)

    by_key = {key(r): r for r in contract.read_rows(scores, scores_m)}
    samples = []
    for r in contract.read_rows(rollout, rollout_m):
        if key(r) not in by_key:
            raise UserError(f"{scores}: no score for {key(r)}; score this rollout first")
        if not r[contract.RESPONSE_TOKEN_IDS]:
            continue
        prompt, response = r[contract.PROMPT_TOKEN_IDS], r[contract.RESPONSE_TOKEN_IDS]
        samples.append(Sample(list(prompt) + list(response), len(prompt), list(r[contract.RESPONSE_LOGPROBS]),
                              float(by_key.pop(key(r))[contract.SCORE]), str(r[contract.PROMPT_ID])))
    if by_key:
        raise UserError(f"{scores}: {len(by_key)} scores have no rollout row (first: {next(iter(by_key))}); "
                        "scores and rollout do not belong together")
    if not samples:
        raise UserError(f"{rollout}: no responses to train on")
    return samples


def mini_batch(cfg: PPOConfig, n: int, k: int) -> tuple[int, list[int]]:
    """(epoch, sample indices) of optimizer step ``k``: each epoch a fresh permutation drawn from the
    seed alone, so the data order never depends on the layout or on an interruption."""
    steps_per_epoch = -(-n // cfg.mini_batch_size)
    epoch, j = divmod(k, steps_per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)).tolist()
    return epoch, perm[j * cfg.mini_batch_size : (j + 1) * cfg.mini_batch_size]


def micro_batches(indices: list[int], samples: list[Sample], budget: int) -> list[list[int]]:
    """Consecutive groups whose padded size (rows × longest) stays within the token budget."""
    groups, current, longest = [], [], 0
    for i in indices:
        n = len(samples[i].ids)
        if current and max(longest, n) * (len(current) + 1) > budget:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups


def padded(samples: list[Sample], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, attention mask, labels and the response mask, right-padded."""
    width = max(len(s.ids) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(samples):
        ids[b, : len(s.ids)] = torch.tensor(s.ids)
        mask[b, : len(s.ids)] = 1
    labels = torch.roll(ids, -1, dims=1)
    return ids.to(device), mask.to(device), labels.to(device), response_mask(samples, width, device)


def response_mask(samples: list[Sample], width: int, device) -> torch.Tensor:
    resp = torch.zeros(len(samples), width)
    for b, s in enumerate(samples):
        resp[b, s.prompt_len - 1 : len(s.ids) - 1] = 1
    return resp.to(device)


def label_space(samples: list[Sample], values: list[list[float]], width: int, device) -> torch.Tensor:
    """Per-response-token values placed at their label positions, [B, width]."""
    out = torch.zeros(len(samples), width)
    for b, (s, v) in enumerate(zip(samples, values)):
        out[b, s.prompt_len - 1 : s.prompt_len - 1 + len(v)] = torch.tensor(v, dtype=torch.float32)
    return out.to(device)


def response_values(samples: list[Sample], padded_out: torch.Tensor) -> list[list[float]]:
    """The inverse of ``label_space``: each sample's response positions of a [B, width] output."""
    return [padded_out[b, s.prompt_len - 1 : len(s.ids) - 1].tolist() for b, s in enumerate(samples)]


def advantages(cfg: PPOConfig, samples: list[Sample], ref_logp: dict[int, list[float]],
               old_values: dict[int, list[float]] | None, dev) -> dict:
    """Everything the losses read, per sample in label space: old and reference log-probs,
    advantages, old values and returns (zero under GRPO), the response mask; and the mean KL."""
    n = len(samples)
    width = max(len(s.ids) for s in samples)
    old = label_space(samples, [s.old_logp for s in samples], width, dev)
    ref = label_space(samples, [ref_logp[i] for i in range(n)], width, dev)
    resp = response_mask(samples, width, dev)
    scores = torch.tensor([s.score for s in samples], device=dev)
    kl = rl.kl_estimate(old, ref, cfg.kl_estimator) * resp
    if cfg.advantage == "grpo":
        adv = rl.grpo_advantages(scores, [s.group for s in samples], resp)
        values = returns = torch.zeros_like(adv)
    else:
        values = label_space(samples, [old_values[i] for i in range(n)], width, dev)
        rewards = rl.token_rewards(scores, kl, resp, 0.0 if cfg.use_kl_loss else cfg.kl_coef)
        adv, returns = rl.gae(rewards, values, resp, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            adv = rl.whiten(adv, resp)
    return {"old_logp": old, "ref_logp": ref, "adv": adv, "values": values, "returns": returns, "resp": resp,
            "kl": rl.masked_mean(kl, resp).item()}
