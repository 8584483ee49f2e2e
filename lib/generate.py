"""Generation on lib/'s CausalLM: continuous batching over a fixed set of slots, one prefill per
prompt, static-shape decode (captured as CUDA graphs on GPU), keyed sampling on the device.

An ``Engine`` owns ``max_batch`` slots: a KV cache ``[slots, kv_heads, max_len, head_dim]`` per
layer and the per-slot state (last token, length, tokens made, live flag, random-stream key,
tokens and log-probs so far), all on the device. Sequences (prompt × sample index) wait in a
queue; free slots take the next ones:

* **Prefill, ahead** — prompts run in packed (remove-padding) prefills of up to
  ``prefill_tokens`` tokens into a *prompt store* (a second KV cache, a row per prompt), through
  the head at each prompt's last token only; every sample's first token is drawn there. One eager
  forward serves many admissions.
* **Admission** — a free slot gets its sequence's prompt keys and values copied from the store
  (so the samples of a prompt share its one prefill) and its first token: device copies only.
* **Decode** — one token for every slot of a bucket ``[:b]`` (b a power of two, or all slots),
  attending over a span rounded up to ``SPAN_QUANTUM`` with a length mask: static shapes whose
  steps differ only in values. On CUDA each (b, span) step is captured once as a CUDA graph and
  replayed; the host never waits on a step.
* **Check** — every ``check_every`` steps the host reads the live flags and token counts (copied
  to pinned memory behind the window, read one window later), copies the finished sequences'
  tokens out (on the device), frees their slots and admits the next sequences. Once the queue is
  empty the live sequences are moved to the lowest slots so the step shrinks to a smaller bucket.

Sampling (``lib.sampling``) gives each sequence its own counter-based stream keyed by (seed,
prompt key, sample index), so a response does not depend on ``max_batch``, DP, TP or the order
sequences run in. Under TP every rank runs the same steps and draws the same tokens, without
gathering the vocabulary.
"""

from __future__ import annotations

import time
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
    to on for CUDA and off elsewhere; ``check_every``: decode steps between host checks (a
    finished sequence's slot idles about 1.5 windows before its next sequence starts; small
    windows are cheap since the host runs behind the device);
    ``prefill_tokens``: prompt tokens per prefill forward (bounds its activations)."""

    def __init__(self, model: ParallelLlamaForCausalLM, params: SamplingParams, *, max_batch: int = 64,
                 check_every: int = 4, cuda_graphs: bool | None = None, compiled: bool | None = None,
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
        # A lookup table, not torch.isin: isin over a large stop set sorts and syncs, which no
        # CUDA graph can hold.
        self._stop_ids = set(params.stop_token_ids)
        self.is_stop = torch.zeros(max(model.cfg.vocab_size, *self._stop_ids, 0) + 1, dtype=torch.bool, device=self.device)
        self.is_stop[sorted(self._stop_ids)] = True
        self.slots, self.max_len, self.cache, self.store = 0, 0, None, None
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.stats: dict = {}  # the last generate call's: windows, decode steps, slot-steps, admissions, ...

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
        live &= ~self.is_stop[tok] & (made < new)

    def _step(self, b: int, span: int) -> None:
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

    # ---- prefill and admission ------------------------------------------------------------

    def _prefill(self, batch: list[int], prompts, n: int, seq_keys: torch.Tensor, first: torch.Tensor) -> None:
        """One packed prefill of prompts ``batch`` into their rows of the prompt store (row
        ``prompt % store slots``), through the head at each prompt's last token only; every
        sample's first token is drawn there and kept in ``first`` (token, log-prob)."""
        rows = self.store.k[next(iter(self.store.k))].shape[0]
        lens = [len(prompts[p]) for p in batch]
        ids = self._tensor([t for p in batch for t in prompts[p]])
        pos = self._tensor([i for n_ in lens for i in range(n_)])
        row = self._tensor([p % rows for p, n_ in zip(batch, lens) for _ in range(n_)])
        ends = torch.tensor(lens).cumsum(0).tolist()
        cu = self._tensor([0, *ends], torch.int32)
        logits = self.model(_Step(ids, pos, Prefill(cu, max(lens), self.store, row, pos)), rows=self._tensor(ends) - 1)
        seqs = self._tensor([p * n + k for p in batch for k in range(n)])
        tok, logp = self._sample(logits.repeat_interleave(n, 0), seq_keys[seqs], torch.zeros_like(seqs))
        first[0, seqs], first[1, seqs] = tok.double(), logp.double()

    def _admit(self, slots: list[int], seqs: list[int], prompts, n: int, seq_keys: torch.Tensor,
               first: torch.Tensor) -> None:
        """Sequences ``seqs`` into free ``slots``: their prompt's keys and values copied from the
        store (a prompt's samples share its one prefill), their first token set. Device copies
        only — a few dozen launches, no forward pass."""
        rows = self.store.k[next(iter(self.store.k))].shape[0]
        sl, sq = self._tensor(slots), self._tensor(seqs)
        self.cache.copy_rows(self.store, self._tensor([q // n % rows for q in seqs]), sl)
        self.keys[sl] = seq_keys[sq]
        self.lengths[sl] = self._tensor([len(prompts[q // n]) for q in seqs])
        tok, logp = first[0, sq].long(), first[1, sq].float()
        self.out_tokens[sl, 0], self.out_logps[sl, 0] = tok, logp
        self.tokens[sl], self.made[sl] = tok, 1
        self.live[sl] = ~self.is_stop[tok] & (self.params.max_new_tokens > 1)

    def _store_for(self, prompts, n: int) -> None:
        """The prompt store: a KV cache with a row per prompt being admitted, as long as the
        longest prompt. Enough rows to fill every slot, and to prefill ``prefill_tokens`` tokens
        at once (one eager forward per group of prompts, not per admission)."""
        length = _round_up(max(len(p) for p in prompts), SPAN_QUANTUM)
        rows = min(len(prompts), max(-(-self.slots // n) + 1, self.prefill_tokens // length))
        have = self.store.k[next(iter(self.store.k))].shape if self.store is not None else None
        if have is None or have[0] < rows or have[2] < length:
            self.store = None
            m = self.model
            self.store = KVCache.allocate(m.model.layer_range, rows, length, *self._kv_shape, m.dtype, self.device)

    # ---- the loop --------------------------------------------------------------------------

    def _tensor(self, values, dtype=torch.long) -> torch.Tensor:
        """A host list on the device without waiting for the device: through pinned memory, so
        the host prepares the next admission while the GPU still decodes (a copy from pageable
        memory would synchronise with the stream)."""
        t = torch.tensor(values, dtype=dtype)
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def _compact(self, slot_seq: list[int], ages: list[int], prompt_len: list[int], where: dict[int, int]) -> None:
        """Move the live sequences into the lowest slots (cache rows and state), so that the
        decode step can run on a smaller bucket."""
        active = [s for s, q in enumerate(slot_seq) if q >= 0]
        holes = [s for s in range(len(active)) if slot_seq[s] < 0]
        movers = [s for s in active if s >= len(active)]
        if not movers:
            return
        src, dst = self._tensor(movers), self._tensor(holes)
        self.cache.move_slots(src, dst)
        for t in (self.tokens, self.lengths, self.made, self.live, self.keys, self.out_tokens, self.out_logps):
            t[dst] = t[src]
        self.live[src] = False
        for a, b in zip(movers, holes):
            for lst in (slot_seq, ages, prompt_len):
                lst[b], lst[a] = lst[a], lst[b]
            where[slot_seq[b]] = b

    def _snapshot(self, buf: torch.Tensor, b: int, seqs: list[int]):
        """Queue a copy of slots ``[:b]``'s live flags and token counts to the host; read it with
        ``_read`` later, after more work has been queued behind it."""
        host = buf[:, :b]
        host.copy_(torch.stack([self.live[:b].long(), self.made[:b]]), non_blocking=True)
        event = None
        if self.device.type == "cuda":
            event = torch.cuda.Event()
            event.record()
        return host, event, seqs

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, seed: int = 0, keys: list[int] | None = None,
                 samples_per_prompt: int = 1, on_tokens=None) -> list[Completion]:
        """As the module function ``generate``.

        The host runs one window behind the device: it queues window k's decode steps, then
        reads the flags of window k-1 (finished by then or soon), copies the finished sequences
        out, and admits new ones into their slots — all queued behind window k, so that the GPU
        decodes while the host prepares the next prefill. A slot freed in window k-1 idles
        (masked) through window k."""
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
        pinned = self.device.type == "cuda"
        bufs = [torch.zeros(2, S, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        self.stats = stats = {"windows": 0, "steps": 0, "slot_steps": 0, "admissions": 0, "prefills": 0,
                              "prefill_tokens": 0, "host_wait_s": 0.0}
        queue = deque(range(total))
        # The host's view: which sequence each slot holds (-1: free), decode steps since its
        # admission, its prompt's length; and where each sequence is.
        slot_seq, ages, prompt_len = [-1] * S, [0] * S, [0] * S
        where: dict[int, int] = {}
        done: set[int] = set()
        reported = done_tokens = 0

        self._store_for(prompts, n)
        store_rows = self.store.k[next(iter(self.store.k))].shape[0]
        first = torch.zeros(2, total, dtype=torch.float64, device=dev)  # each sequence's first token, log-prob
        prefilled = 0  # prompts [0, prefilled) are in the store (or done)

        def fill():
            nonlocal prefilled
            free = [s for s in range(S) if slot_seq[s] < 0]
            seqs = [queue[i] for i in range(min(len(free), len(queue)))]
            if not seqs:
                return
            # Prefill ahead, in groups of up to prefill_tokens tokens, into store rows whose
            # prompts have all been admitted (those before the first waiting sequence's).
            while prefilled <= seqs[-1] // n:
                room = store_rows - (prefilled - seqs[0] // n)
                batch, used = [], 0
                for p in range(prefilled, min(len(prompts), prefilled + room)):
                    if batch and used + len(prompts[p]) > self.prefill_tokens:
                        break
                    batch.append(p)
                    used += len(prompts[p])
                self._prefill(batch, prompts, n, seq_keys, first)
                stats["prefills"] += 1
                stats["prefill_tokens"] += used
                prefilled += len(batch)
            for _ in seqs:
                queue.popleft()
            self._admit(free[: len(seqs)], seqs, prompts, n, seq_keys, first)
            stats["admissions"] += 1
            for s, q in zip(free, seqs):
                slot_seq[s], ages[s], prompt_len[s], where[q] = q, 0, len(prompts[q // n]), s

        fill()
        it, snap = 0, None
        while True:
            it += 1
            active = [s for s in range(S) if slot_seq[s] >= 0]
            new_snap = None
            if active:
                if not queue:
                    self._compact(slot_seq, ages, prompt_len, where)
                    active = [s for s in range(S) if slot_seq[s] >= 0]
                b = next(x for x in buckets if x > max(active))
                # Steps until every active sequence has hit max_new_tokens at the latest, at
                # most check_every; the span covers the longest any of them can get meanwhile.
                window = min(self.check_every, max(new - min(1 + ages[s], new) for s in active))
                longest = max(prompt_len[s] + min(ages[s] + window, new - 1) for s in active)
                span = min(_round_up(longest + 1, SPAN_QUANTUM), self.max_len)
                for _ in range(window):
                    self._step(b, span)
                for s in active:
                    ages[s] += window
                stats["windows"] += 1
                stats["steps"] += window
                stats["slot_steps"] += window * b
                new_snap = self._snapshot(bufs[it % 2], b, slot_seq[:b])
            if snap is not None:
                host, event, seqs = snap
                t0 = time.perf_counter()
                if event is not None:
                    event.synchronize()
                stats["host_wait_s"] += time.perf_counter() - t0
                live, made = host.tolist()
                finished = [(s, q) for s, q in enumerate(seqs) if q >= 0 and q not in done and not live[s]]
                if finished:
                    qs = [q for _, q in finished]
                    src, dst = self._tensor([where[q] for q in qs]), self._tensor(qs)
                    res_tokens[dst], res_logps[dst], res_made[dst] = self.out_tokens[src], self.out_logps[src], self.made[src]
                    done_tokens += sum(made[s] for s, _ in finished)
                    for q in qs:
                        done.add(q)
                        slot_seq[where.pop(q)] = -1
                if on_tokens is not None:
                    running = sum(made[s] for s, q in enumerate(seqs) if q >= 0 and q not in done)
                    on_tokens(done_tokens + running - reported)
                    reported = done_tokens + running
            fill()
            snap = new_snap
            if snap is None and not queue and all(q < 0 for q in slot_seq):
                break
        out = []
        for toks, lps, k in zip(res_tokens.tolist(), res_logps.tolist(), res_made.tolist()):
            stopped = k > 0 and toks[k - 1] in self._stop_ids
            out.append(Completion(toks[:k], lps[:k], "stop" if stopped else "length"))
        return out
