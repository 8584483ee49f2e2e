"""The device side of generation (docs/generation.md, "The engine"): the slots, the prompt store,
the decode step captured as a CUDA graph per shape, and host ↔ device copies queued so that the
host never waits on the step it has just queued.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llamarl.lib.engine.sampling import SamplingParams, fused_available, sample
from llamarl.lib.model.attention import Decode, KVCache, Prefill
from llamarl.lib.model.llama import ParallelLlamaForCausalLM

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


def round_up(n: int, q: int) -> int:
    return -(-n // q) * q


class Slots:
    """Slots, cache and captured decode steps for one model and one ``SamplingParams`` (options:
    ``Engine``'s). Every method queues device work and returns without waiting for it."""

    def __init__(self, model: ParallelLlamaForCausalLM, params: SamplingParams, *, max_batch: int,
                 cuda_graphs: bool | None, fused: bool | None, prefill_tokens: int):
        self.model, self.params = model, params
        self.device = next(model.parameters()).device
        cuda = self.device.type == "cuda"
        self.cuda_graphs = cuda if cuda_graphs is None else cuda_graphs
        if self.cuda_graphs and not cuda:
            raise ValueError("cuda_graphs needs the model on a CUDA device")
        self.fused = (cuda and fused_available()) if fused is None else fused
        self.max_batch, self.prefill_tokens = max_batch, prefill_tokens
        attn = model.model.layers[str(model.model.layer_range[0])].self_attn
        self._kv_shape = (attn.kv_heads, attn.head_dim)
        # A lookup table, not torch.isin: isin over a large stop set sorts and syncs, which no
        # CUDA graph can hold.
        self._stop_ids = set(params.stop_token_ids)
        self.is_stop = torch.zeros(max(model.cfg.vocab_size, *self._stop_ids, 0) + 1, dtype=torch.bool, device=self.device)
        self.is_stop[sorted(self._stop_ids)] = True
        self.slots, self.max_len, self.cache, self.store, self.ring = 0, 0, None, None, None
        self._graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self._pool = None

    def ensure(self, slots: int, max_len: int) -> None:
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
        max_len = max(round_up(max_len, SPAN_QUANTUM), self.max_len)
        if slots <= self.slots:
            old, self.cache = self.cache, None
            self.cache = KVCache.allocate(m.model.layer_range, self.slots, max_len, *self._kv_shape, m.dtype, dev)
            self.cache.copy_rows(old, slice(None), slice(None))
            self.max_len = max_len
            return
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

    def buckets(self) -> list[int]:
        """The slot counts a decode step runs on: powers of two below ``slots``, and ``slots``."""
        return [b for b in (1 << i for i in range(self.slots.bit_length())) if b < self.slots] + [self.slots]

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

    def step(self, b: int, span: int) -> None:
        """One decode step of slots ``[:b]`` over ``span`` cache positions: on CUDA a graph's
        replay, captured the first time a (b, span) comes."""
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

    # ---- the prompt store and admission ---------------------------------------------------------

    def store_for(self, rows: int, length: int, n: int, known: int) -> None:
        """The prompt store for ``rows`` prompts of up to ``length`` tokens, and its ring. Called
        only while no prompt waits in it, so a store too small is simply replaced: by one of about
        ``prefill_tokens`` positions (fewer rows for fewer ``known`` prompts), at least ``rows × length``."""
        have = self.store.k[next(iter(self.store.k))].shape if self.store is not None else None
        if have is None or have[0] < rows or have[2] < length:
            self.store = self.ring = None
            m = self.model
            rows = max(rows, min(self.prefill_tokens // length, known))
            self.store = KVCache.allocate(m.model.layer_range, rows, length, *self._kv_shape, m.dtype, self.device)
        if self.ring is None or self.ring.n != n:
            self.ring = _Ring(self.store.k[next(iter(self.store.k))].shape[0], n, self.device)

    def prefill(self, batch: list[int], prompts: dict[int, list[int]], n: int, keys: torch.Tensor) -> None:
        """One packed prefill of prompts ``batch`` into their rows of the prompt store (row
        ``prompt % store rows``), through the head at each prompt's last token only; every
        sample's first token is drawn there (``keys``: the samples' stream keys, prompt-major)
        and kept in the ring with its key until the sample is admitted."""
        ring = self.ring
        lens = [len(prompts[p]) for p in batch]
        ids = self.tensor([t for p in batch for t in prompts[p]])
        pos = self.tensor([i for n_ in lens for i in range(n_)])
        row = self.tensor([p % ring.rows for p, n_ in zip(batch, lens) for _ in range(n_)])
        ends = torch.tensor(lens).cumsum(0).tolist()
        cu = self.tensor([0, *ends], torch.int32)
        logits = self.model(_Step(ids, pos, Prefill(cu, max(lens), self.store, row, pos)), rows=self.tensor(ends) - 1)
        at = self.tensor([p % ring.rows * n + k for p in batch for k in range(n)])
        tok, logp = self._sample(logits.repeat_interleave(n, 0), keys, torch.zeros_like(at))
        ring.first[0, at], ring.first[1, at] = tok.double(), logp.double()
        ring.keys[at] = keys

    def admit(self, slots: list[int], seqs: list[int], lengths: list[int]) -> None:
        """Sequences ``seqs`` (prompt ``q // n``'s sample ``q % n``; ``lengths``: their prompts')
        into free ``slots``: their prompt's keys and values copied from the store (a prompt's
        samples share its one prefill), their first token set. Device copies only — a few dozen
        launches, no forward pass."""
        ring = self.ring
        sl, at = self.tensor(slots), self.tensor([q % ring.size for q in seqs])
        self.cache.copy_rows(self.store, self.tensor([q // ring.n % ring.rows for q in seqs]), sl)
        self.keys[sl] = ring.keys[at]
        self.lengths[sl] = self.tensor(lengths)
        tok, logp = ring.first[0, at].long(), ring.first[1, at].float()
        self.out_tokens[sl, 0], self.out_logps[sl, 0] = tok, logp
        self.tokens[sl], self.made[sl] = tok, 1
        self.live[sl] = ~self.is_stop[tok] & (self.params.max_new_tokens > 1)

    def compact(self, slot_seq: list[int], ages: list[int], prompt_len: list[int], where: dict[int, int]) -> None:
        """Move the live sequences into the lowest slots (cache rows and state, and the host's
        tables of them), so that the decode step can run on a smaller bucket."""
        active = [s for s, q in enumerate(slot_seq) if q >= 0]
        holes = [s for s in range(len(active)) if slot_seq[s] < 0]
        movers = [s for s in active if s >= len(active)]
        if not movers:
            return
        src, dst = self.tensor(movers), self.tensor(holes)
        self.cache.move_slots(src, dst)
        for t in (self.tokens, self.lengths, self.made, self.live, self.keys, self.out_tokens, self.out_logps):
            t[dst] = t[src]
        self.live[src] = False
        for a, b in zip(movers, holes):
            for lst in (slot_seq, ages, prompt_len):
                lst[b], lst[a] = lst[a], lst[b]
            where[slot_seq[b]] = b

    # ---- host ↔ device, without waiting --------------------------------------------------------

    def tensor(self, values, dtype=torch.long) -> torch.Tensor:
        """A host list on the device without waiting for the device: through pinned memory, so
        the host prepares the next admission while the GPU still decodes (a copy from pageable
        memory would synchronise with the stream)."""
        return self.to_device(torch.tensor(values, dtype=dtype))

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        return t.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else t

    def snapshot(self, buf: torch.Tensor, b: int, seqs: list[int]):
        """Queue a copy of slots ``[:b]``'s live flags and token counts to the host ``buf``; the
        caller reads it later (after its event), once more work has been queued behind it."""
        host = buf[:, :b]
        host.copy_(torch.stack([self.live[:b].long(), self.made[:b]]), non_blocking=True)
        return host, self._event(), seqs

    def fetch(self, slots: list[int], made: list[int], seqs: list[int]):
        """Queue a copy of finished sequences' tokens and log-probs (in ``slots``, ``made`` tokens
        each) to the host, before their slots are refilled; ``delivered`` reads it a window later."""
        at, k = self.tensor(slots), max(made)
        tokens, logps = self.out_tokens[at, :k], self.out_logps[at, :k]
        if self.device.type == "cuda":
            tokens = torch.empty(tokens.shape, dtype=tokens.dtype, pin_memory=True).copy_(tokens, non_blocking=True)
            logps = torch.empty(logps.shape, dtype=logps.dtype, pin_memory=True).copy_(logps, non_blocking=True)
        return tokens, logps, self._event(), made, seqs

    def _event(self) -> torch.cuda.Event | None:
        """An event recorded behind the work queued so far (None on CPU, where nothing is queued)."""
        if self.device.type != "cuda":
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    def delivered(self, fetched) -> list[tuple[int, Completion]]:
        tokens, logps, event, made, seqs = fetched
        if event is not None:
            event.synchronize()
        out = []
        for q, toks, lps, k in zip(seqs, tokens.tolist(), logps.tolist(), made):
            stopped = k > 0 and toks[k - 1] in self._stop_ids
            out.append((q, Completion(toks[:k], lps[:k], "stop" if stopped else "length")))
        return out


class _Ring:
    """Per store row's samples (``rows × n`` entries, prompt p's sample k at ``p % rows * n + k``):
    the first token and its log-prob drawn at prefill, and the stream key, until it is admitted."""

    def __init__(self, rows: int, n: int, device):
        self.rows, self.n, self.size = rows, n, rows * n
        self.first = torch.zeros(2, self.size, dtype=torch.float64, device=device)
        self.keys = torch.zeros(self.size, 2, dtype=torch.long, device=device)
