"""Generation on lib/'s CausalLM: continuous batching over a fixed set of slots, one prefill per
prompt, static-shape decode (captured as CUDA graphs on GPU), keyed sampling on the device.

An ``Engine`` owns ``max_batch`` slots: a KV cache ``[slots, kv_heads, max_len, head_dim]`` per
layer and the per-slot state (last token, length, tokens made, live flag, random-stream key,
tokens and log-probs so far), all on the device. Sequences (prompt × sample index) wait in a
queue; free slots take the next ones:

* **Admission** — the new prompts run one packed (remove-padding) prefill through the head at
  each prompt's last token only; a prompt's other samples get copies of its KV prefix instead of
  their own prefill. Each sequence's first token is drawn from the prompt's logits.
* **Decode** — one token for every slot of a bucket ``[:b]`` (b a power of two, or all slots),
  attending over a span rounded up to ``SPAN_QUANTUM`` with a length mask: static shapes whose
  steps differ only in values. On CUDA each (b, span) step is captured once as a CUDA graph and
  replayed; the host never waits on a step.
* **Check** — every ``check_every`` steps the host reads the live flags (its only sync), copies
  the finished sequences' tokens out (on the device), frees their slots and admits the next
  sequences. Once the queue is empty the live sequences are moved to the lowest slots so the
  step shrinks to a smaller bucket.

Sampling (``lib.sampling``) gives each sequence its own counter-based stream keyed by (seed,
prompt key, sample index), so a response does not depend on ``max_batch``, DP, TP or the order
sequences run in. Under TP every rank runs the same steps and draws the same tokens, without
gathering the vocabulary.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

import torch

from .attention import Decode, KVCache, Prefill
from .model import ParallelLlamaForCausalLM
from .sampling import SamplingParams, sample, sequence_keys

__all__ = ["SPAN_QUANTUM", "Completion", "Engine", "SamplingParams", "generate"]

SPAN_QUANTUM = 64  # decode spans (and the cache length) are multiples of this: few graphs, aligned masks


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


def _round_up(n: int, q: int) -> int:
    return -(-n // q) * q


@torch.no_grad()
def generate(model: ParallelLlamaForCausalLM, prompts: list[list[int]], params: SamplingParams, *, seed: int = 0,
             keys: list[int] | None = None, samples_per_prompt: int = 1, max_batch: int = 64, on_tokens=None,
             **engine_options) -> list[Completion]:
    """Complete every prompt (a list of token ids) ``samples_per_prompt`` times; completions come
    prompt-major (prompt i's samples at ``i * samples_per_prompt + k``). ``keys``: one integer per
    prompt naming its random streams (default: its index); ``on_tokens(n)`` reports progress."""
    engine = Engine(model, params, max_batch=max_batch, **engine_options)
    return engine.generate(prompts, seed=seed, keys=keys, samples_per_prompt=samples_per_prompt, on_tokens=on_tokens)


class Engine:
    """Slots, cache and captured decode steps for one model and one ``SamplingParams``; reuse it
    across calls (the stage does, chunk after chunk) to keep the cache and the graphs.

    ``cuda_graphs`` / ``compiled`` (the sampler's per-shard pass through ``torch.compile``) default
    to on for CUDA and off elsewhere; ``check_every``: decode steps between host checks;
    ``prefill_tokens``: prompt tokens per prefill forward (bounds its activations)."""

    def __init__(self, model: ParallelLlamaForCausalLM, params: SamplingParams, *, max_batch: int = 64,
                 check_every: int = 16, cuda_graphs: bool | None = None, compiled: bool | None = None,
                 prefill_tokens: int = 16384):
        params.check()
        if max_batch < 1 or check_every < 1:
            raise ValueError(f"max_batch={max_batch} and check_every={check_every} must be >= 1")
        self.model, self.params = model, params
        self.device = next(model.parameters()).device
        cuda = self.device.type == "cuda"
        self.cuda_graphs = cuda if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not cuda:
            raise ValueError("cuda_graphs needs the model on a CUDA device")
        self.compiled = cuda if compiled is None else compiled
        self.max_batch, self.check_every, self.prefill_tokens = max_batch, check_every, prefill_tokens
        attn = model.model.layers[str(model.model.layer_range[0])].self_attn
        self._kv_shape = (attn.kv_heads, attn.head_dim)
        self.stop = torch.tensor(sorted(set(params.stop_token_ids)) or [-1], device=self.device)
        self._stop_ids = set(params.stop_token_ids)
        self.slots, self.max_len, self.cache = 0, 0, None
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.steps = 0  # decode steps run (for benchmarks: steps × slots vs tokens made)

    # ---- device state ----------------------------------------------------------------------

    def _ensure(self, slots: int, max_len: int) -> None:
        """Slots and cache for at least ``slots`` sequences of ``max_len`` tokens; reallocating
        drops the captured graphs (they hold the old buffers' addresses)."""
        if slots <= self.slots and max_len <= self.max_len:
            return
        slots, max_len = max(slots, self.slots), max(_round_up(max_len, SPAN_QUANTUM), self.max_len)
        self._graphs.clear()
        self.cache = None  # free the old cache before the new one is allocated
        m, dev = self.model, self.device
        self.cache = KVCache.allocate(m.model.layer_range, slots, max_len, *self._kv_shape, m.dtype, dev)
        self.slots, self.max_len = slots, max_len
        new = self.params.max_new_tokens
        self.tokens = torch.zeros(slots, dtype=torch.long, device=dev)  # last token, not yet in the cache
        self.lengths = torch.zeros(slots, dtype=torch.long, device=dev)  # tokens in the cache
        self.made = torch.zeros(slots, dtype=torch.long, device=dev)  # tokens generated
        self.live = torch.zeros(slots, dtype=torch.bool, device=dev)
        self.keys = torch.zeros(slots, 2, dtype=torch.long, device=dev)  # random-stream keys
        self.out_tokens = torch.zeros(slots, new, dtype=torch.long, device=dev)
        self.out_logps = torch.zeros(slots, new, dtype=torch.float32, device=dev)
        self.rows = torch.arange(slots, device=dev)

    def _buckets(self) -> list[int]:
        out, b = [], 1
        while b < self.slots:
            out.append(b)
            b *= 2
        return out + [self.slots]

    def _sample(self, logits, keys, steps):
        m = self.model
        return sample(logits, self.params, keys, steps, vocab_start=m.vocab_start, group=m.tp_group,
                      compiled=self.compiled)

    def _decode(self, b: int, span: int) -> None:
        """One decode step of slots ``[:b]``, entirely on the device (the graph's body)."""
        new = self.params.max_new_tokens
        tokens, lengths, made, live = self.tokens[:b], self.lengths[:b], self.made[:b], self.live[:b]
        logits = self.model(_Step(tokens, lengths, Decode(self.cache, lengths, span)))
        tok, logp = self._sample(logits, self.keys[:b], made)
        rows, at = self.rows[:b], made.clamp(max=new - 1)
        self.out_tokens[rows, at] = torch.where(live, tok, self.out_tokens[rows, at])
        self.out_logps[rows, at] = torch.where(live, logp, self.out_logps[rows, at])
        step = live.long()  # finished slots stay where they are (they run on, masked, until freed)
        made += step
        lengths += step
        tokens.copy_(tok)
        live &= ~torch.isin(tok, self.stop) & (made < new)

    def _step(self, b: int, span: int) -> None:
        self.steps += 1
        if not self.cuda_graphs:
            self._decode(b, span)
            return
        graph = self._graphs.get((b, span))
        if graph is not None:
            graph.replay()
            return
        # A new shape: this step runs eagerly on a side stream (lazy initialisation, the sampler's
        # compilation — nothing of that may happen during capture), then the same step is
        # captured (recorded, not run) for the next ones. Every graph writes only the engine's
        # persistent buffers, so the graphs can share one memory pool and replay in any order.
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            self._decode(b, span)
        torch.cuda.current_stream().wait_stream(side)
        if self._pool is None:
            self._pool = torch.cuda.graph_pool_handle()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            self._decode(b, span)
        self._graphs[(b, span)] = graph

    # ---- admission -------------------------------------------------------------------------

    def _admit(self, slots: list[int], seqs: list[int], prompts, n: int, keys: torch.Tensor) -> None:
        """Put sequences ``seqs`` (prompt ``seq // n``) into free ``slots``: one prefill per
        distinct prompt, its KV prefix copied to the slots of its other samples, and each
        sequence's first token drawn."""
        groups: dict[int, list[int]] = {}  # prompt -> its slots, in admission order
        for slot, seq in zip(slots, seqs):
            groups.setdefault(seq // n, []).append(slot)
        logits, batch, used = [], [], 0
        for prompt in groups:  # packed prefills of at most prefill_tokens tokens (or one prompt)
            if batch and used + len(prompts[prompt]) > self.prefill_tokens:
                logits.append(self._prefill(batch, groups, prompts))
                batch, used = [], 0
            batch.append(prompt)
            used += len(prompts[prompt])
        logits.append(self._prefill(batch, groups, prompts))
        row = {prompt: i for i, prompt in enumerate(groups)}
        dev, new = self.device, self.params.max_new_tokens
        sl = torch.tensor(slots, device=dev)
        self.keys[sl] = keys[torch.tensor(seqs, device=dev)]
        self.lengths[sl] = torch.tensor([len(prompts[q // n]) for q in seqs], device=dev)
        first = torch.cat(logits)[torch.tensor([row[q // n] for q in seqs], device=dev)]
        tok, logp = self._sample(first, self.keys[sl], torch.zeros_like(sl))
        self.out_tokens[sl, 0], self.out_logps[sl, 0] = tok, logp
        self.tokens[sl], self.made[sl] = tok, 1
        self.live[sl] = ~torch.isin(tok, self.stop) & (new > 1)

    def _prefill(self, batch: list[int], groups: dict[int, list[int]], prompts) -> torch.Tensor:
        """Prefill prompts ``batch`` into the first slot of their group, copy each prompt's KV to
        the group's other slots; returns the logits at each prompt's last token."""
        dev = self.device
        lens = [len(prompts[p]) for p in batch]
        ids = torch.tensor([t for p in batch for t in prompts[p]], device=dev)
        pos = torch.tensor([i for n in lens for i in range(n)], device=dev)
        slot = torch.tensor([groups[p][0] for p, n in zip(batch, lens) for _ in range(n)], device=dev)
        ends = torch.tensor(lens).cumsum(0).tolist()
        cu = torch.tensor([0, *ends], dtype=torch.int32, device=dev)
        logits = self.model(_Step(ids, pos, Prefill(cu, max(lens), self.cache, slot, pos)),
                            rows=torch.tensor(ends, device=dev) - 1)
        src, dst, at = [], [], []
        for p, n in zip(batch, lens):
            first, *others = groups[p]
            for s in others:
                src += [first] * n
                dst += [s] * n
                at += range(n)
        if dst:
            self.cache.copy_prefix(*(torch.tensor(x, device=dev) for x in (src, dst, at)))
        return logits

    # ---- the loop --------------------------------------------------------------------------

    def _compact(self, slot_seq: list[int], ages: list[int], prompt_len: list[int]) -> None:
        """Move the live sequences into the lowest slots (cache rows and state), so that the
        decode step can run on a smaller bucket."""
        active = [s for s, q in enumerate(slot_seq) if q >= 0]
        holes = [s for s in range(len(active)) if slot_seq[s] < 0]
        movers = [s for s in active if s >= len(active)]
        if not movers:
            return
        src, dst = (torch.tensor(x, device=self.device) for x in (movers, holes))
        self.cache.move_slots(src, dst)
        for t in (self.tokens, self.lengths, self.made, self.live, self.keys, self.out_tokens, self.out_logps):
            t[dst] = t[src]
        for a, b in zip(movers, holes):
            for lst in (slot_seq, ages, prompt_len):
                lst[b], lst[a] = lst[a], lst[b]

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, seed: int = 0, keys: list[int] | None = None,
                 samples_per_prompt: int = 1, on_tokens=None) -> list[Completion]:
        """As the module function ``generate``."""
        if any(len(p) == 0 for p in prompts):
            raise ValueError("a prompt has no tokens")
        if keys is not None and len(keys) != len(prompts):
            raise ValueError(f"{len(keys)} keys for {len(prompts)} prompts")
        n, new, dev = samples_per_prompt, self.params.max_new_tokens, self.device
        total = len(prompts) * n
        if total == 0:
            return []
        self._ensure(min(self.max_batch, total), max(len(p) for p in prompts) + new)
        seq_keys = sequence_keys(seed, range(len(prompts)) if keys is None else keys, n, device=dev)
        res_tokens = torch.zeros(total, new, dtype=torch.long, device=dev)
        res_logps = torch.zeros(total, new, dtype=torch.float32, device=dev)
        res_made = torch.zeros(total, dtype=torch.long, device=dev)
        self.live.zero_()
        self.lengths.zero_()  # free slots attend over position 0 only
        S, buckets = self.slots, self._buckets()
        queue = deque(range(total))
        slot_seq, ages, prompt_len = [-1] * S, [0] * S, [0] * S  # host view: who is where, steps since admitted
        reported = done_tokens = 0
        while True:
            free = [s for s in range(S) if slot_seq[s] < 0]
            if queue and free:
                seqs = [queue.popleft() for _ in range(min(len(free), len(queue)))]
                slots = free[: len(seqs)]
                self._admit(slots, seqs, prompts, n, seq_keys)
                for s, q in zip(slots, seqs):
                    slot_seq[s], ages[s], prompt_len[s] = q, 0, len(prompts[q // n])
            active = [s for s in range(S) if slot_seq[s] >= 0]
            if not active:
                break
            if not queue:
                self._compact(slot_seq, ages, prompt_len)
                active = [s for s in range(S) if slot_seq[s] >= 0]
            b = next(x for x in buckets if x > max(active))
            # Steps until every active sequence has hit max_new_tokens at the latest, at most
            # check_every; the span covers the longest any of them can get within the window.
            window = min(self.check_every, max(new - min(1 + ages[s], new) for s in active))
            longest = max(prompt_len[s] + min(ages[s] + window, new - 1) for s in active)
            span = min(_round_up(longest + 1, SPAN_QUANTUM), self.max_len)
            for _ in range(window):
                self._step(b, span)
            for s in active:
                ages[s] += window
            live, made = torch.stack([self.live[:b].long(), self.made[:b]]).tolist()  # the one sync
            finished = [s for s in active if not live[s]]
            if finished:
                src = torch.tensor(finished, device=dev)
                dst = torch.tensor([slot_seq[s] for s in finished], device=dev)
                res_tokens[dst], res_logps[dst], res_made[dst] = self.out_tokens[src], self.out_logps[src], self.made[src]
                done_tokens += sum(made[s] for s in finished)
                for s in finished:
                    slot_seq[s] = -1
            if on_tokens is not None:
                total_made = done_tokens + sum(made[s] for s in active if live[s])
                on_tokens(total_made - reported)
                reported = total_made
        out = []
        for toks, lps, k in zip(res_tokens.tolist(), res_logps.tolist(), res_made.tolist()):
            stopped = k > 0 and toks[k - 1] in self._stop_ids
            out.append(Completion(toks[:k], lps[:k], "stop" if stopped else "length"))
        return out
