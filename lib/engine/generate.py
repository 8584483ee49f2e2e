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
  to pinned memory behind the window, read one window later), queues the copy of the finished
  sequences' tokens to the host (read one window later too), frees their slots and admits the
  next sequences. Once the queue is empty the live sequences are moved to the lowest slots so the
  step shrinks to a smaller bucket.
* **Stream** — ``Engine.stream`` takes batches of prompts lazily, one stream of sequences for all
  of them: the next batch's sequences take the slots as the last batch's free them (no drain at a
  batch boundary), and each batch comes back as soon as its last sequence finishes.
  ``generate`` is a stream of one batch.

Sampling (``lib.sampling``) gives each sequence its own counter-based stream keyed by (seed,
prompt key, sample index), so a response does not depend on ``max_batch``, DP, TP or the order
sequences run in. Under TP every rank runs the same steps and draws the same tokens, without
gathering the vocabulary.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from llamarl.lib.model.attention import Decode, KVCache, Prefill
from llamarl.lib.model.llama import ParallelLlamaForCausalLM
from llamarl.lib.engine.sampling import SamplingParams, fused_available, sample, sequence_keys

__all__ = ["SPAN_QUANTUM", "Batch", "Completion", "Engine", "SamplingParams", "generate"]

SPAN_QUANTUM = 64  # decode spans (and the cache length) are multiples of this: few graphs, aligned masks
# Batch-invariant slots are a multiple of this: CPU matmul kernels take rows in groups (of 4 on
# AVX2), and the rows of a last, partial group are computed another way, which rounds otherwise.
ROW_GROUP = 8


@dataclass
class Completion:
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    finish_reason: str = "length"  # "stop" (a stop token, included) or "length"


@dataclass(frozen=True)
class Batch:
    """Prompts that ``Engine.stream`` hands back together: ``keys`` (one per prompt) name their
    random streams; ``tag``: anything the caller wants back with the completions."""

    prompts: list[list[int]]
    keys: list[int]
    tag: Any = None


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

    ``cuda_graphs`` / ``fused`` (the sampler's per-shard pass as one Triton kernel) default to on
    for CUDA (``fused`` where Triton is importable) and off elsewhere; ``check_every``: decode steps between host checks (a
    finished sequence's slot idles about 1.5 windows before its next sequence starts; small
    windows are cheap since the host runs behind the device);
    ``prefill_tokens``: prompt tokens per prefill forward, padded (bounds its activations and the
    prompt store).

    ``batch_invariant``: a sequence's numbers do not depend on the sequences beside it, to the
    bit: every decode step runs all slots (``max_batch`` rounded up to a multiple of
    ``ROW_GROUP``; no smaller buckets as a stream drains), so each matmul has the same shape
    whoever shares it and wherever the sequence sits; prefill groups are always a function of
    their batch alone. A batch then gives the same bits alone or in any stream, and a resumed
    rollout the bits of an uninterrupted one. (Otherwise only the random streams are independent
    of the neighbours, the log-probs equal to float rounding: another matmul shape rounds
    differently.) Attention reads each slot's own keys, masked past its length."""

    def __init__(self, model: ParallelLlamaForCausalLM, params: SamplingParams, *, max_batch: int = 64,
                 check_every: int = 4, cuda_graphs: bool | None = None, fused: bool | None = None,
                 prefill_tokens: int = 16384, batch_invariant: bool = False):
        params.check()
        if max_batch < 1 or check_every < 1:
            raise ValueError(f"max_batch={max_batch} and check_every={check_every} must be >= 1")
        self.model, self.params = model, params
        self.device = next(model.parameters()).device
        cuda = self.device.type == "cuda"
        self.cuda_graphs = cuda if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not cuda:
            raise ValueError("cuda_graphs needs the model on a CUDA device")
        self.fused = (cuda and fused_available()) if fused is None else fused
        self.max_batch, self.check_every, self.prefill_tokens = max_batch, check_every, prefill_tokens
        self.batch_invariant = batch_invariant
        attn = model.model.layers[str(model.model.layer_range[0])].self_attn
        self._kv_shape = (attn.kv_heads, attn.head_dim)
        # A lookup table, not torch.isin: isin over a large stop set sorts and syncs, which no
        # CUDA graph can hold.
        self._stop_ids = set(params.stop_token_ids)
        self.is_stop = torch.zeros(max(model.cfg.vocab_size, *self._stop_ids, 0) + 1, dtype=torch.bool, device=self.device)
        self.is_stop[sorted(self._stop_ids)] = True
        self.slots, self.max_len, self.cache, self.store, self._ring = 0, 0, None, None, None
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None
        self.stats: dict = {}  # the last generate call's: windows, decode steps, slot-steps, admissions, ...

    # ---- device state ----------------------------------------------------------------------

    def _ensure(self, slots: int, max_len: int) -> None:
        """Slots and cache for at least ``slots`` sequences of ``max_len`` tokens; reallocating
        drops the captured graphs (they hold the old buffers' addresses). More slots: everything
        anew (between streams only); only longer sequences (a stream met a longer prompt): a
        longer cache that keeps the running sequences' keys and values."""
        if slots <= self.slots and max_len <= self.max_len:
            return
        if self._graphs and self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # no replay of a graph being dropped is still queued
        self._graphs.clear()
        m, dev = self.model, self.device
        max_len = max(_round_up(max_len, SPAN_QUANTUM), self.max_len)
        if slots <= self.slots:
            old, self.cache = self.cache, None
            self.cache = KVCache.allocate(m.model.layer_range, self.slots, max_len, *self._kv_shape, m.dtype, dev)
            for mine, theirs in ((self.cache.k, old.k), (self.cache.v, old.v)):
                for i, t in mine.items():
                    t[:, :, : self.max_len] = theirs[i]
            self.max_len = max_len
            return
        slots = max(slots, self.slots)
        self.cache = None  # free the old cache before the new one is allocated
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
                      fused=self.fused)

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

    def _prefill(self, batch: list[int], prompts: dict[int, list[int]], n: int, keys: torch.Tensor,
                 ring: _Ring) -> None:
        """One packed prefill of prompts ``batch`` into their rows of the prompt store (row
        ``prompt % store rows``), through the head at each prompt's last token only; every
        sample's first token is drawn there (``keys``: the samples' stream keys, prompt-major)
        and kept in the ring with its key until the sample is admitted."""
        rows = ring.rows
        lens = [len(prompts[p]) for p in batch]
        ids = self._tensor([t for p in batch for t in prompts[p]])
        pos = self._tensor([i for n_ in lens for i in range(n_)])
        row = self._tensor([p % rows for p, n_ in zip(batch, lens) for _ in range(n_)])
        ends = torch.tensor(lens).cumsum(0).tolist()
        cu = self._tensor([0, *ends], torch.int32)
        logits = self.model(_Step(ids, pos, Prefill(cu, max(lens), self.store, row, pos)), rows=self._tensor(ends) - 1)
        at = self._tensor([p % rows * n + k for p in batch for k in range(n)])
        tok, logp = self._sample(logits.repeat_interleave(n, 0), keys, torch.zeros_like(at))
        ring.first[0, at], ring.first[1, at] = tok.double(), logp.double()
        ring.keys[at] = keys

    def _admit(self, slots: list[int], seqs: list[int], lengths: list[int], ring: _Ring) -> None:
        """Sequences ``seqs`` (prompt ``q // n``'s sample ``q % n``; ``lengths``: their prompts')
        into free ``slots``: their prompt's keys and values copied from the store (a prompt's
        samples share its one prefill), their first token set. Device copies only — a few dozen
        launches, no forward pass."""
        sl, at = self._tensor(slots), self._tensor([q % ring.size for q in seqs])
        self.cache.copy_rows(self.store, self._tensor([q // ring.n % ring.rows for q in seqs]), sl)
        self.keys[sl] = ring.keys[at]
        self.lengths[sl] = self._tensor(lengths)
        tok, logp = ring.first[0, at].long(), ring.first[1, at].float()
        self.out_tokens[sl, 0], self.out_logps[sl, 0] = tok, logp
        self.tokens[sl], self.made[sl] = tok, 1
        self.live[sl] = ~self.is_stop[tok] & (self.params.max_new_tokens > 1)

    def _store_for(self, rows: int, length: int, n: int, known: int) -> _Ring:
        """The prompt store (a KV cache with a row per prompt of a prefill group, until its samples
        are admitted) for ``rows`` prompts of up to ``length`` tokens, and its ring. Called only
        while no prompt waits in the store, so a store too small is simply replaced: by one of
        about ``prefill_tokens`` positions (fewer rows when fewer than that many prompts are
        ``known`` to come), at least ``rows × length``."""
        have = self.store.k[next(iter(self.store.k))].shape if self.store is not None else None
        if have is None or have[0] < rows or have[2] < length:
            self.store = self._ring = None
            m = self.model
            rows = max(rows, min(self.prefill_tokens // length, known))
            self.store = KVCache.allocate(m.model.layer_range, rows, length, *self._kv_shape, m.dtype, self.device)
        if self._ring is None or self._ring.n != n:
            self._ring = _Ring(self.store.k[next(iter(self.store.k))].shape[0], n, self.device)
        return self._ring

    # ---- the loop --------------------------------------------------------------------------

    def _tensor(self, values, dtype=torch.long) -> torch.Tensor:
        """A host list on the device without waiting for the device: through pinned memory, so
        the host prepares the next admission while the GPU still decodes (a copy from pageable
        memory would synchronise with the stream)."""
        return self._to_device(torch.tensor(values, dtype=dtype))

    def _to_device(self, t: torch.Tensor) -> torch.Tensor:
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

    def _fetch(self, slots: list[int], made: list[int], seqs: list[int]):
        """Queue a copy of finished sequences' tokens and log-probs (in ``slots``, ``made`` tokens
        each) to the host, before their slots are refilled; ``_delivered`` reads it a window later."""
        at, k = self._tensor(slots), max(made)
        tokens, logps = self.out_tokens[at, :k], self.out_logps[at, :k]
        event = None
        if self.device.type == "cuda":
            tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True).copy_(tokens, non_blocking=True)
            logps = torch.empty(logps.shape, dtype=logps.dtype, pin_memory=True).copy_(logps, non_blocking=True)
            event = torch.cuda.Event()
            event.record()
        return tokens, logps, event, made, seqs

    def _delivered(self, fetched) -> list[tuple[int, Completion]]:
        tokens, logps, event, made, seqs = fetched
        if event is not None:
            event.synchronize()
        out = []
        for q, toks, lps, k in zip(seqs, tokens.tolist(), logps.tolist(), made):
            stopped = k > 0 and toks[k - 1] in self._stop_ids
            out.append((q, Completion(toks[:k], lps[:k], "stop" if stopped else "length")))
        return out

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, seed: int = 0, keys: list[int] | None = None,
                 samples_per_prompt: int = 1, on_tokens=None) -> list[Completion]:
        """As the module function ``generate``: one batch through ``stream``."""
        batch = Batch(prompts, list(range(len(prompts))) if keys is None else list(keys))
        ((_, out),) = self.stream([batch], seed=seed, samples_per_prompt=samples_per_prompt, on_tokens=on_tokens)
        return out

    @torch.no_grad()
    def stream(self, batches: Iterable[Batch], *, seed: int = 0, samples_per_prompt: int = 1,
               on_tokens=None) -> Iterator[tuple[Batch, list[Completion]]]:
        """Complete the prompts of every batch ``samples_per_prompt`` times, all in one stream of
        sequences: a batch's sequences are queued behind the previous batch's, and free slots take
        the next ones whatever batch they belong to, so the slots stay full across batches. Yields
        ``(batch, completions)`` (prompt-major, as ``generate``) as each batch's last sequence
        finishes — in the order batches finish, which need not be the order they came in.

        ``batches`` is read lazily: the next batch when fewer sequences wait than there are slots
        (and before the first step, enough to fill them). Time spent in ``batches`` and in the
        consumer (between a yield and the next request) is not the engine's: ``stats["busy_s"]``
        is the rest, ``stats["source_s"]`` the time waiting for batches.

        The host runs one window behind the device: it queues window k's decode steps, then
        reads the flags of window k-1 (finished by then or soon), queues the copy of the finished
        sequences to the host (read one window later), and admits new ones into their slots — all
        queued behind window k, so that the GPU decodes while the host prepares the next prefill.
        A slot freed in window k-1 idles (masked) through window k."""
        n, new = samples_per_prompt, self.params.max_new_tokens
        if n < 1:
            raise ValueError(f"samples_per_prompt={n} must be >= 1")
        t_start, outside = time.perf_counter(), 0.0
        # drain_*: from the window in which the last sequence had a slot (nothing left to admit)
        # to the end — where a batch-invariant engine still runs every slot.
        self.stats = stats = {"windows": 0, "steps": 0, "slot_steps": 0, "admissions": 0, "prefills": 0,
                              "prefill_tokens": 0, "host_wait_s": 0.0, "batches": 0, "source_s": 0.0, "busy_s": 0.0,
                              "drain_steps": 0, "drain_slot_steps": 0, "drain_s": 0.0}
        drain_from = None  # (time, steps, slot_steps) when nothing was left to admit
        source = iter(batches)
        queue: deque[int] = deque()  # sequences waiting for a slot; sequence q is prompt q // n's sample q % n
        prompts: dict[int, list[int]] = {}  # prompt -> its token ids, until its last sample is admitted
        stream_keys: dict[int, int] = {}  # prompt -> its key, until prefilled
        ends: deque[int] = deque()  # where each batch's prompts end: no prefill group crosses one
        pending: list[_Pending] = []  # batches with sequences still running, in order
        ready: list[_Pending] = []  # finished, not yet yielded
        state = {"prompts": 0, "exhausted": False, "longest": 0}

        def pull() -> None:
            nonlocal outside
            t = time.perf_counter()
            try:
                batch = next(source)
            except StopIteration:
                state["exhausted"] = True
                return
            finally:
                dt = time.perf_counter() - t
                outside += dt
                stats["source_s"] += dt
            if any(len(p) == 0 for p in batch.prompts):
                raise ValueError("a prompt has no tokens")
            if len(batch.keys) != len(batch.prompts):
                raise ValueError(f"{len(batch.keys)} keys for {len(batch.prompts)} prompts")
            first = state["prompts"]
            state["prompts"] += len(batch.prompts)
            stats["batches"] += 1
            record = _Pending(batch, first * n, [None] * (len(batch.prompts) * n))
            (pending if batch.prompts else ready).append(record)
            if not batch.prompts:
                return
            for i, (ids, key) in enumerate(zip(batch.prompts, batch.keys)):
                prompts[first + i], stream_keys[first + i] = ids, key
            queue.extend(range(first * n, state["prompts"] * n))
            ends.append(state["prompts"])
            longest = max(len(p) for p in batch.prompts)
            if longest > state["longest"]:
                state["longest"] = longest
                if S:  # a longer prompt than the cache was made for: a longer cache, in place
                    self._ensure(S, longest + new)

        # Enough sequences to fill the slots (all of them when there are fewer).
        S = 0
        while not state["exhausted"] and len(queue) < self.max_batch:
            pull()
        if queue:
            if self.batch_invariant:
                slots = _round_up(self.max_batch, ROW_GROUP)
            else:
                slots = min(self.max_batch, len(queue)) if state["exhausted"] else self.max_batch
            self._ensure(slots, state["longest"] + new)
            S = self.slots
            self.live.zero_()
            self.lengths.zero_()  # free slots attend over position 0 only
        buckets = [S] if self.batch_invariant else self._buckets()
        pinned = self.device.type == "cuda"
        bufs = [torch.zeros(2, S, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        # The host's view: which sequence each slot holds (-1: free), decode steps since its
        # admission, its prompt's length; and where each running sequence is.
        slot_seq, ages, prompt_len = [-1] * S, [0] * S, [0] * S
        where: dict[int, int] = {}
        reported = done_tokens = 0
        prefilled = 0  # prompts [0, prefilled) are in the store (or done)

        def prefill() -> None:
            """The next group of prompts into the (empty) store: from the first not prefilled,
            within its batch, as many as fit ``prefill_tokens`` padded to the longest of them.
            So the groups are a function of the batch alone, not of what ran before it."""
            nonlocal prefilled
            while ends[0] <= prefilled:
                ends.popleft()
            group, length = [prefilled], _round_up(len(prompts[prefilled]), SPAN_QUANTUM)
            for p in range(prefilled + 1, ends[0]):
                longer = max(length, _round_up(len(prompts[p]), SPAN_QUANTUM))
                if (len(group) + 1) * longer > self.prefill_tokens:
                    break
                group.append(p)
                length = longer
            ring = self._store_for(len(group), length, n, state["prompts"] - prefilled)
            keys = sequence_keys(seed, [stream_keys.pop(p) for p in group], n)
            self._prefill(group, prompts, n, self._to_device(keys), ring)
            stats["prefills"] += 1
            stats["prefill_tokens"] += sum(len(prompts[p]) for p in group)
            prefilled += len(group)

        def fill() -> None:
            free = [s for s in range(S) if slot_seq[s] < 0]
            while free:
                while not state["exhausted"] and len(queue) < S:
                    pull()
                if not queue:
                    return
                if queue[0] // n == prefilled:  # every prompt in the store is admitted
                    prefill()
                take = min(len(free), prefilled * n - queue[0])
                seqs = [queue.popleft() for _ in range(take)]
                lengths = [len(prompts[q // n]) for q in seqs]
                self._admit(free[:take], seqs, lengths, self._ring)
                stats["admissions"] += 1
                for s, q, length in zip(free, seqs, lengths):
                    slot_seq[s], ages[s], prompt_len[s], where[q] = q, 0, length, s
                    if q % n == n - 1:
                        del prompts[q // n]
                free = free[take:]

        def deliver(fetched) -> None:
            for q, completion in self._delivered(fetched):
                record = next(r for r in pending if r.first <= q < r.first + len(r.completions))
                record.completions[q - record.first] = completion
                record.left -= 1
                if record.left == 0:
                    pending.remove(record)
                    ready.append(record)

        if S:
            fill()
        it, snap, fetched = 0, None, None
        while True:
            it += 1
            if drain_from is None and not queue and state["exhausted"]:
                drain_from = (time.perf_counter(), stats["steps"], stats["slot_steps"])
            active = [s for s in range(S) if slot_seq[s] >= 0]
            new_snap = None
            if active:
                if not queue and not self.batch_invariant:
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
            if fetched is not None:  # queued a window ago: done by now, or nearly
                deliver(fetched)
                fetched = None
            if snap is not None:
                host, event, seqs = snap
                t0 = time.perf_counter()
                if event is not None:
                    event.synchronize()
                stats["host_wait_s"] += time.perf_counter() - t0
                live, made = host.tolist()
                finished = [(s, q) for s, q in enumerate(seqs) if q >= 0 and q in where and not live[s]]
                if finished:
                    qs = [q for _, q in finished]
                    fetched = self._fetch([where[q] for q in qs], [made[s] for s, _ in finished], qs)
                    done_tokens += sum(made[s] for s, _ in finished)
                    for q in qs:
                        slot_seq[where.pop(q)] = -1
                if on_tokens is not None:
                    running = sum(made[s] for s, q in enumerate(seqs) if q >= 0 and q in where)
                    on_tokens(done_tokens + running - reported)
                    reported = done_tokens + running
            if S:
                fill()
            snap = new_snap
            ready.sort(key=lambda r: r.first)
            while ready:
                record = ready.pop(0)
                t0 = time.perf_counter()
                yield record.batch, record.completions
                outside += time.perf_counter() - t0
            stats["busy_s"] = time.perf_counter() - t_start - outside
            if drain_from is not None:
                stats["drain_s"] = time.perf_counter() - drain_from[0]
                stats["drain_steps"] = stats["steps"] - drain_from[1]
                stats["drain_slot_steps"] = stats["slot_steps"] - drain_from[2]
            if snap is None and fetched is None and not queue and state["exhausted"] and not where:
                return


@dataclass
class _Pending:
    """A batch of ``Engine.stream`` whose sequences ``first ..`` are not all finished."""

    batch: Batch
    first: int
    completions: list
    left: int = field(init=False)

    def __post_init__(self):
        self.left = len(self.completions)


class _Ring:
    """Per store row's samples (``rows × n`` entries, prompt p's sample k at ``p % rows * n + k``):
    the first token and its log-prob drawn at prefill, and the stream key, until it is admitted."""

    def __init__(self, rows: int, n: int, device):
        self.rows, self.n, self.size = rows, n, rows * n
        self.first = torch.zeros(2, self.size, dtype=torch.float64, device=device)
        self.keys = torch.zeros(self.size, 2, dtype=torch.long, device=device)
