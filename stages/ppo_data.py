"""PPO's data: the rollout joined with its scores, and what the losses read, by sample.

Tensors are in *label space*, right-padded: position t holds what concerns token t + 1 (its
log-prob, value, advantage), so a response occupies positions ``prompt_len - 1 … len(ids) - 2``.
"""

from __future__ import annotations

import heapq
import zlib
from dataclasses import dataclass

import torch
from torch.nn.utils.rnn import pad_sequence

from llamarl.lib.files import publish
from llamarl.lib.rl import core as rl
from llamarl.lib.errors import UserError
from llamarl.stages import contract
from llamarl.stages.config import GROUP_ADVANTAGES, PPOConfig


@dataclass
class Sample:
    ids: list[int]
    prompt_len: int
    rollout_logp: list[float]  # what the rollout recorded: the sampling policy's log-probs
    score: float
    group: str

    @property
    def response_len(self) -> int:
        return len(self.ids) - self.prompt_len


def load_samples(rollout: str, scores: str) -> list[Sample]:
    """The rollout's responses with their scores, both verified against their manifests, and the
    scores checked to be of this very rollout and within ±``rl.MAX_ABS_SCORE``."""
    rollout_m = publish.require_verified(rollout, contract.ROLLOUT, f"{contract.PARTS}/")
    scores_m = publish.require_verified(scores, contract.SCORES, f"{contract.PARTS}/")
    scored = scores_m.get("request", {}).get("rollout_id")
    if scored != publish.output_id(rollout):
        raise UserError(f"{scores} scores another rollout (id {scored}) than {rollout} (id {publish.output_id(rollout)}); "
                        "score this rollout first")

    key = contract.row_key
    by_key = {key(r): r for r in contract.read_rows(scores, scores_m)}
    samples = []
    for r in contract.read_rows(rollout, rollout_m):
        if key(r) not in by_key:
            raise UserError(f"{scores}: no score for {key(r)}; score this rollout first")
        if not r[contract.RESPONSE_TOKEN_IDS]:
            continue
        prompt, response = r[contract.PROMPT_TOKEN_IDS], r[contract.RESPONSE_TOKEN_IDS]
        score = float(by_key.pop(key(r))[contract.SCORE])
        if not abs(score) <= rl.MAX_ABS_SCORE:  # a scores output from before score held them to it
            raise UserError(f"{scores}: the score of {key(r)} is {score:g}, beyond ±{rl.MAX_ABS_SCORE:g}, where "
                            "ppo's float32 arithmetic overflows; score the rollout again with its rules scaled down")
        samples.append(Sample(list(prompt) + list(response), len(prompt), list(r[contract.RESPONSE_LOGPROBS]),
                              score, str(r[contract.PROMPT_ID])))
    if by_key:
        raise UserError(f"{scores}: {len(by_key)} scores have no rollout row (first: {next(iter(by_key))}); "
                        "scores and rollout do not belong together")
    if not samples:
        raise UserError(f"{rollout}: no responses to train on")
    return samples


def dynamic_sampling(cfg: PPOConfig, samples: list[Sample], start_step: int) -> tuple[list[Sample], dict | None]:
    """DAPO's dynamic sampling (docs/rl.md §1): the samples of the prompts whose scores are not all
    equal, at most ``cfg.train_groups`` of them drawn by (seed, the actor's step), in rollout
    order, so a rerun trains on the same; and the counts for the manifest."""
    if not cfg.dynamic_sampling:
        return samples, None
    groups = list(dict.fromkeys(s.group for s in samples))
    equal = rl.equal_score_groups([s.score for s in samples], [s.group for s in samples])
    kept = [g for g in groups if g not in equal]
    if not kept:
        raise UserError(f"{cfg.rollout}: every one of its {len(groups)} prompts has equal scores over its samples, so "
                        "dynamic_sampling leaves nothing to train on; give the rollout more prompts or "
                        "sampling.samples_per_prompt, or set dynamic_sampling: false")
    chosen = kept
    if cfg.train_groups is not None and len(kept) > cfg.train_groups:
        g = torch.Generator().manual_seed(zlib.crc32(f"dynamic_sampling {cfg.seed} {start_step}".encode()))
        picked = set(torch.randperm(len(kept), generator=g)[: cfg.train_groups].tolist())
        chosen = [x for i, x in enumerate(kept) if i in picked]
    train = set(chosen)
    stats = {"groups": len(groups), "dropped": len(equal), "kept": len(kept), "trained": len(chosen),
             "short": max(0, (cfg.train_groups or 0) - len(kept))}
    return [s for s in samples if s.group in train], stats


def check_groups(cfg: PPOConfig, samples: list[Sample]) -> None:
    """Estimators with a group baseline need prompts of several samples; refused before any weights."""
    if cfg.advantage in GROUP_ADVANTAGES and len({s.group for s in samples}) == len(samples):
        raise UserError(f"{cfg.rollout}: every prompt has one sample, and advantage={cfg.advantage!r} compares a "
                        "prompt's samples with each other; set the rollout's sampling.samples_per_prompt >= 2, or "
                        "use advantage gae or reinforce++")


def mini_batch(cfg: PPOConfig, n: int, k: int) -> tuple[int, list[int]]:
    """(epoch, sample indices) of optimizer step ``k``: each epoch a fresh permutation drawn from the
    seed alone, so the data order never depends on the layout or on an interruption."""
    steps_per_epoch = -(-n // cfg.mini_batch_size)
    epoch, j = divmod(k, steps_per_epoch)
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)).tolist()
    return epoch, perm[j * cfg.mini_batch_size : (j + 1) * cfg.mini_batch_size]


# samples × micro-batches up to which a balanced split is tried: ~30 ms of host time at most,
# spent while the device runs the step before (stages/ppo_batches.py).
BALANCE_WORK = 100_000


def micro_batches(indices: list[int], samples: list[Sample], budget: int) -> list[list[int]]:
    """``indices`` packed into micro-batches of at most ``budget`` tokens each (a longer sequence
    alone), each listing its samples in ``indices``' order. The model packs a micro-batch's
    sequences back to back, so its cost is its tokens, not rows × longest, and each micro-batch costs
    the host its launches whatever its size: as few as fit. First-fit decreasing; where that leaves
    more than the tokens need, a balanced split into fewer (``_balanced``) when every part fits.
    The packing depends only on the lengths; the update depends on it only by rounding."""
    size = {i: len(samples[i].ids) for i in indices}
    order = sorted(indices, key=lambda i: -size[i])  # stable: ties keep their order
    groups = _first_fit(order, size, budget)
    fewest = -(-sum(size.values()) // budget)
    if max(size.values(), default=0) <= budget and len(order) * len(groups) <= BALANCE_WORK:
        for k in range(len(groups) - 1, fewest - 1, -1):  # one fewer at a time, while they fit
            parts = _balanced(order, size, k)
            if max(sum(size[i] for i in p) for p in parts) > budget:
                break
            groups = parts
    place = {i: k for k, i in enumerate(indices)}
    return [sorted(g, key=place.__getitem__) for g in groups]


def _first_fit(order: list[int], size: dict[int, int], budget: int) -> list[list[int]]:
    """Each of ``order`` into the first micro-batch with room, a new one where none has."""
    bins: list[list[int]] = []
    room: list[int] = []
    for i in order:
        b = next((b for b, r in enumerate(room) if size[i] <= r), None)
        if b is None:
            bins.append([])
            room.append(budget)
            b = len(bins) - 1
        bins[b].append(i)
        room[b] -= size[i]
    return bins


def _balanced(order: list[int], size: dict[int, int], k: int) -> list[list[int]]:
    """``order`` (longest first) split into ``k`` parts of near-equal tokens by the largest
    differencing method (Karmarkar–Karp): the two partial splits that differ most are merged, the
    heaviest part of one with the lightest of the other, until one split is left. Parts longest
    first; ties broken by arrival, so the split depends only on the lengths."""
    heap = []
    for n, i in enumerate(order):
        parts = [(size[i], [i])] + [(0, []) for _ in range(k - 1)]
        heapq.heappush(heap, (-size[i], n, parts))
    n = len(heap)
    while len(heap) > 1:
        _, _, a = heapq.heappop(heap)
        _, _, b = heapq.heappop(heap)
        merged = sorted(((sa + sb, pa + pb) for (sa, pa), (sb, pb) in zip(a, reversed(b))), key=lambda t: -t[0])
        heapq.heappush(heap, (merged[-1][0] - merged[0][0], n, merged))
        n += 1
    return [p for _, p in heap[0][2] if p]


def packing_stats(groups: list[list[int]], samples: list[Sample], budget: int) -> dict:
    """How well ``groups`` use their budget: micro-batches, the share of their budget left empty, and
    the share of their padded shape (rows × longest) that is padding."""
    tokens = sum(len(samples[i].ids) for g in groups for i in g)
    shape = sum(len(g) * max(len(samples[i].ids) for i in g) for g in groups)
    return {"micro_batches": len(groups), "tokens": tokens, "budget_unused": 1 - tokens / (len(groups) * budget),
            "padding": 1 - tokens / shape}


def padded(samples: list[Sample], device) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """ids, attention mask, labels and the response mask, right-padded."""
    ids = pad_sequence([torch.tensor(s.ids, dtype=torch.long) for s in samples], batch_first=True)
    mask = pad_sequence([torch.ones(len(s.ids), dtype=torch.long) for s in samples], batch_first=True)
    labels = torch.roll(ids, -1, dims=1)
    return ids.to(device), mask.to(device), labels.to(device), response_mask(samples, ids.shape[1], device)


def response_mask(samples: list[Sample], width: int, device) -> torch.Tensor:
    """1 at each response token's label position, [B, width]. Built for every micro-batch: a slice
    filled per sample, not ``label_space``'s tensor made from a list of values."""
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


def advantages(cfg: PPOConfig, samples: list[Sample], ref_logp: dict[int, list[float]] | None,
               old_values: dict[int, list[float]] | None, dev, actor_logp: dict[int, list[float]] | None = None) -> dict:
    """Everything the losses read, per sample in label space: π_old's log-probs (the actor's,
    ``actor_logp``, when recomputed, else the rollout's), the reference's (none without
    ``ref_logp``: kl_coef 0), advantages, old values and returns (zero without a critic), the
    response mask, the truncated importance weights (``tis``, when ``cfg.uses_tis()``, per token or,
    ``tis_level`` sequence, the response's weight on each of its tokens); the mean KL (None without
    a reference) and the weights' statistics."""
    n = len(samples)
    width = max(len(s.ids) for s in samples)
    rollout = label_space(samples, [s.rollout_logp for s in samples], width, dev)
    old = label_space(samples, [actor_logp[i] for i in range(n)], width, dev) if actor_logp is not None else rollout
    ref = label_space(samples, [ref_logp[i] for i in range(n)], width, dev) if ref_logp is not None else None
    resp = response_mask(samples, width, dev)
    scores = torch.tensor([s.score for s in samples], device=dev)
    groups = [s.group for s in samples]
    kl = rl.kl_estimate(old, ref, cfg.kl_estimator) * resp if ref is not None else torch.zeros_like(resp)
    beta = 0.0 if cfg.use_kl_loss else cfg.kl_coef
    values = returns = torch.zeros_like(resp)
    if cfg.advantage == "gae":
        values = label_space(samples, [old_values[i] for i in range(n)], width, dev)
        adv, returns = rl.gae(rl.token_rewards(scores, kl, resp, beta), values, resp, cfg.gamma, cfg.lam)
    elif cfg.advantage == "grpo":
        adv = rl.grpo_advantages(scores, groups, resp, norm_by_std=cfg.grpo_norm_by_std)
    else:  # rloo, reinforce++, reinforce++-baseline: returns of the KL-penalised rewards of baselined scores
        base = {"rloo": "loo", "reinforce++-baseline": "mean"}.get(cfg.advantage)
        if base:
            scores = scores - rl.group_baseline(scores, groups, base)
        adv = rl.returns_to_go(rl.token_rewards(scores, kl, resp, beta), resp, cfg.gamma)
    if cfg.whiten_advantages and cfg.advantage in ("gae", "reinforce++", "reinforce++-baseline"):
        adv = rl.whiten(adv, resp)
    data = {"old_logp": old, "adv": adv, "values": values, "returns": returns, "resp": resp,
            "kl": rl.masked_mean(kl, resp).item() if ref is not None else None}
    if ref is not None:
        data["ref_logp"] = ref
    if cfg.uses_tis():
        if cfg.tis_level == "sequence":  # the whole batch is here: every response's tokens at once
            data["tis"], data["tis_truncated"] = rl.sequence_tis_weights(old, rollout, resp, cfg.tis_cap)
        else:
            data["tis"], data["tis_truncated"] = rl.tis_weights(old, rollout, cfg.tis_cap)
        reads = tis_reads(data, list(range(n)))
        data["tis_stats"] = dict(zip(reads, torch.stack(list(reads.values())).tolist()))  # one wait for the device
    return data


def tis_reads(data: dict, rows: list[int]) -> dict[str, torch.Tensor]:
    """The importance weights of ``rows``' response tokens: mean, max, and the fraction truncated
    (per token, also at ``tis_level`` sequence, where a response's weight is on each of its tokens);
    0-d tensors on the device, for the caller to read with whatever else it reads."""
    idx = torch.tensor(rows, device=data["resp"].device)
    m = data["resp"][idx]
    w, cut = data["tis"][idx] * m, data["tis_truncated"][idx] * m
    tokens = m.sum().clamp(min=1)
    return {"tis_weight_mean": w.sum() / tokens, "tis_weight_max": w.max(), "tis_truncated": cut.sum() / tokens}
