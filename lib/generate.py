"""Generation on lib/'s CausalLM: bucketed batches, packed prefill, KV-cache decode, sampling.

Prompts are sorted by length and cut into batches of at most ``max_batch`` sequences. Each batch
allocates a KV cache for its longest prompt plus ``max_new_tokens``, prefills all prompts in one
packed (remove-padding) forward, then decodes one token per unfinished sequence per step;
sequences leave the step as they stop. Under TP every rank runs the same steps and draws the same
tokens (identical gathered logits, identically seeded generator).

Sampling needs the whole distribution of the rows being sampled, so the *last* position of each
active sequence is gathered over TP (``[batch, vocab]``, never ``[tokens, vocab]``).
The log-prob returned for each sampled token is under ``softmax(logits / temperature)`` —
temperature 1 for greedy — without top-k / top-p truncation: the distribution PPO trains.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from .attention import Decode, KVCache, Prefill
from .model import ParallelLlamaForCausalLM
from .parallel import group_size


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 1.0  # 0 = greedy
    top_p: float = 1.0
    top_k: int = 0  # 0 = no top-k
    max_new_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()  # EOS and any other stop tokens

    def check(self) -> None:
        from .errors import UserError

        if self.temperature < 0:
            raise UserError(f"temperature={self.temperature} must be >= 0 (0 = greedy)")
        if not 0 < self.top_p <= 1:
            raise UserError(f"top_p={self.top_p} must be in (0, 1]")
        if self.top_k < 0:
            raise UserError(f"top_k={self.top_k} must be >= 0 (0 = off)")
        if self.max_new_tokens < 1:
            raise UserError(f"max_new_tokens={self.max_new_tokens} must be >= 1")


@dataclass
class Completion:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" (a stop token, included) or "length"


@dataclass(frozen=True)
class _Step:
    input_ids: torch.Tensor
    positions: torch.Tensor
    meta: Prefill | Decode


def gather_vocab(local_logits: torch.Tensor, tp_group: ProcessGroup | None) -> torch.Tensor:
    """``[rows, vocab / tp]`` → ``[rows, padded vocab]`` (sampling rows only)."""
    tp = group_size(tp_group)
    if tp == 1:
        return local_logits
    parts = [torch.empty_like(local_logits) for _ in range(tp)]
    dist.all_gather(parts, local_logits.contiguous(), group=tp_group)
    return torch.cat(parts, dim=-1)


def sample(logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of full-vocabulary ``logits``; returns (tokens, fp32 log-probs)."""
    x = logits.float()
    greedy = params.temperature == 0
    if not greedy:
        x = x / params.temperature
    logp = torch.log_softmax(x, dim=-1)
    if greedy:
        tokens = x.argmax(-1)
    elif not params.top_k and params.top_p >= 1.0:
        tokens = torch.multinomial(logp.exp(), 1, generator=generator).squeeze(-1)
    else:
        filtered = x
        if params.top_k:
            kth = torch.topk(filtered, min(params.top_k, x.shape[-1]), dim=-1).values[:, -1:]
            filtered = filtered.masked_fill(filtered < kth, float("-inf"))
        if params.top_p < 1.0:
            sorted_x, order = torch.sort(filtered, dim=-1, descending=True)
            probs = torch.softmax(sorted_x, dim=-1)
            # Drop a token when the mass before it already reaches top_p (the first always stays).
            drop = probs.cumsum(-1) - probs >= params.top_p
            sorted_x = sorted_x.masked_fill(drop, float("-inf"))
            filtered = torch.full_like(filtered, float("-inf")).scatter(-1, order, sorted_x)
        probs = torch.softmax(filtered, dim=-1)
        tokens = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)


@torch.no_grad()
def generate(model: ParallelLlamaForCausalLM, prompts: list[list[int]], params: SamplingParams,
             generator: torch.Generator | None = None, *, max_batch: int = 64, on_tokens=None) -> list[Completion]:
    """Complete every prompt (a list of token ids). ``on_tokens(n)`` reports progress."""
    params.check()
    out: list[Completion | None] = [None] * len(prompts)
    order = sorted(range(len(prompts)), key=lambda i: (len(prompts[i]), i))
    for b in range(0, len(order), max_batch):
        idx = order[b : b + max_batch]
        for i, c in zip(idx, _generate_batch(model, [prompts[i] for i in idx], params, generator, on_tokens)):
            out[i] = c
    return out


def _generate_batch(model: ParallelLlamaForCausalLM, prompts, params, generator, on_tokens,
                    check_every: int = 16) -> list[Completion]:
    """Every slot decodes every step (static shapes: the steps differ only in their values), and
    tokens, log-probs and stop flags stay on the device: the host looks every ``check_every`` steps
    (progress, all stopped?) and reads the results once at the end. A finished sequence's slot runs
    on until the batch ends; what it makes after its stop token is cut off here."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("a prompt has no tokens")
    dev = next(model.parameters()).device
    attn = model.model.layers[str(model.model.layer_range[0])].self_attn
    n, longest, max_new = len(prompts), max(len(p) for p in prompts), params.max_new_tokens
    lens = torch.tensor([len(p) for p in prompts], device=dev)
    cache = KVCache.allocate(model.model.layer_range, n, longest + max_new, attn.kv_heads, attn.head_dim, model.dtype, dev)
    stop = torch.tensor(sorted(set(params.stop_token_ids)) or [-1], device=dev)

    ids = torch.tensor([t for p in prompts for t in p], device=dev)
    slot = torch.repeat_interleave(torch.arange(n, device=dev), lens)
    cu = torch.zeros(n + 1, dtype=torch.int32, device=dev)
    cu[1:] = lens.cumsum(0)
    pos = torch.arange(len(ids), device=dev) - cu[:-1].long().repeat_interleave(lens)
    logits = model(_Step(ids, pos, Prefill(cu, longest, cache, slot, pos)), rows=cu[1:].long() - 1)

    out_tokens = torch.zeros(n, max_new, dtype=torch.long, device=dev)
    out_logps = torch.zeros(n, max_new, dtype=torch.float32, device=dev)
    live = torch.ones(n, dtype=torch.bool, device=dev)
    made = torch.zeros(n, dtype=torch.long, device=dev)  # tokens each sequence really generated
    lengths, reported = lens.clone(), 0
    for t in range(max_new):
        tokens, logps = sample(gather_vocab(logits, model.tp_group), params, generator)
        out_tokens[:, t], out_logps[:, t] = tokens, logps
        made += live
        live &= ~torch.isin(tokens, stop)
        last = t == max_new - 1
        if last or (t + 1) % check_every == 0:
            total, alive = torch.stack([made.sum(), live.sum()]).tolist()  # the one sync per check
            if on_tokens is not None:
                on_tokens(total - reported)
            reported = total
            if last or not alive:
                break
        logits = model(_Step(tokens, lengths, Decode(cache, lengths, span=longest + t + 1)))
        lengths += 1

    done = []
    for toks, lps, k in zip(out_tokens.tolist(), out_logps.tolist(), made.tolist()):
        stopped = k > 0 and toks[k - 1] in set(params.stop_token_ids)
        done.append(Completion(toks[:k], lps[:k], "stop" if stopped else "length"))
    return done
