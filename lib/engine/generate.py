"""Generation on lib/'s CausalLM: ``Engine.stream`` takes batches of prompts lazily, one stream
of sequences for all of them, over a fixed set of slots (``lib.engine.slots``, the device side);
``Engine.generate`` is a stream of one batch. Each piece and why: docs/generation.md.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from llamarl.lib.engine.sampling import SamplingParams, sequence_keys
from llamarl.lib.engine.slots import SPAN_QUANTUM, Completion, Slots, round_up
from llamarl.lib.model.llama import ParallelLlamaForCausalLM

# Batch-invariant slots are a multiple of this: CPU matmul kernels take rows in groups (of 4 on
# AVX2), and the rows of a last, partial group are computed another way, which rounds otherwise.
ROW_GROUP = 8


@dataclass(frozen=True)
class Batch:
    """Prompts that ``Engine.stream`` hands back together: ``keys`` (one per prompt) name their
    random streams; ``tag``: anything the caller wants back with the completions."""

    prompts: list[list[int]]
    keys: list[int]
    tag: Any = None


class Engine(Slots):
    """``Slots`` for one model and one ``SamplingParams``, and the streams that run sequences
    through them; reuse it across calls to keep the cache and the graphs.

    ``cuda_graphs`` / ``fused`` (the sampler's Triton kernel) default to on for CUDA (``fused``
    where Triton is importable); ``check_every``: decode steps between host checks;
    ``prefill_tokens``: prompt tokens per prefill forward, padded (bounds its activations and the
    prompt store). ``batch_invariant``: every decode step runs all slots (``max_batch`` rounded up
    to a multiple of ``ROW_GROUP``), so a sequence's numbers do not depend on the sequences beside
    it, to the bit (docs/generation.md, "Batch invariance")."""

    def __init__(self, model: ParallelLlamaForCausalLM, params: SamplingParams, *, max_batch: int = 64,
                 check_every: int = 4, cuda_graphs: bool | None = None, fused: bool | None = None,
                 prefill_tokens: int = 16384, batch_invariant: bool = False):
        params.check()
        if max_batch < 1 or check_every < 1:
            raise ValueError(f"max_batch={max_batch} and check_every={check_every} must be >= 1")
        super().__init__(model, params, max_batch=max_batch, cuda_graphs=cuda_graphs, fused=fused,
                         prefill_tokens=prefill_tokens)
        self.check_every, self.batch_invariant = check_every, batch_invariant
        self.stats: dict = {}  # the last generate call's: windows, decode steps, slot-steps, admissions, ...

    @torch.no_grad()
    def generate(self, prompts: list[list[int]], *, seed: int = 0, keys: list[int] | None = None,
                 samples_per_prompt: int = 1, on_tokens=None) -> list[Completion]:
        """Complete every prompt (a list of token ids) ``samples_per_prompt`` times, as one batch
        through ``stream``; completions come prompt-major (prompt i's samples at
        ``i * samples_per_prompt + k``). ``keys``: one integer per prompt naming its random streams
        (default: its index); ``on_tokens(n)`` reports progress."""
        batch = Batch(prompts, list(range(len(prompts))) if keys is None else list(keys))
        ((_, out),) = self.stream([batch], seed=seed, samples_per_prompt=samples_per_prompt, on_tokens=on_tokens)
        return out

    @torch.no_grad()
    def stream(self, batches: Iterable[Batch], *, seed: int = 0, samples_per_prompt: int = 1,
               on_tokens=None) -> Iterator[tuple[Batch, list[Completion]]]:
        """Complete the prompts of every batch ``samples_per_prompt`` times, all in one stream of
        sequences (docs/generation.md, "stream"). Yields ``(batch, completions)`` (prompt-major, as
        ``generate``) as each batch's last sequence finishes — in the order batches finish, which
        need not be the order they came in. Time spent in ``batches`` and in the consumer is not
        the engine's: ``stats["busy_s"]`` is the rest, ``stats["source_s"]`` the time waiting for
        batches."""
        if samples_per_prompt < 1:
            raise ValueError(f"samples_per_prompt={samples_per_prompt} must be >= 1")
        yield from _Stream(self, batches, seed, samples_per_prompt, on_tokens).run()


class _Stream:
    """One ``Engine.stream`` call: the host's view of its sequences (waiting in the queue, in the
    prompt store, running in a slot, delivered) and the loop that moves them along a window of
    decode steps at a time. Sequence q is prompt q // n's sample q % n; prompts are numbered in the
    order they are read, across batches."""

    def __init__(self, engine: Engine, batches: Iterable[Batch], seed: int, n: int, on_tokens):
        self.engine, self.seed, self.n, self.on_tokens = engine, seed, n, on_tokens
        self.new = engine.params.max_new_tokens
        self.source = iter(batches)
        self.t_start, self.outside = time.perf_counter(), 0.0
        # drain_*: from the window in which the last sequence had a slot (nothing left to admit)
        # to the end — where a batch-invariant engine still runs every slot.
        self.stats = engine.stats = {"windows": 0, "steps": 0, "slot_steps": 0, "admissions": 0, "prefills": 0,
                                     "prefill_tokens": 0, "host_wait_s": 0.0, "batches": 0, "source_s": 0.0,
                                     "busy_s": 0.0, "drain_steps": 0, "drain_slot_steps": 0, "drain_s": 0.0}
        self.drain_from = None  # (time, steps, slot_steps) when nothing was left to admit
        self.queue: deque[int] = deque()  # sequences waiting for a slot
        self.prompts: dict[int, list[int]] = {}  # prompt -> its token ids, until its last sample is admitted
        self.keys: dict[int, int] = {}  # prompt -> its key, until prefilled
        self.ends: deque[int] = deque()  # where each batch's prompts end: no prefill group crosses one
        self.pending: list[_Pending] = []  # batches with sequences still running, in order
        self.ready: list[_Pending] = []  # finished, not yet yielded
        self.read = 0  # prompts read so far
        self.prefilled = 0  # prompts [0, prefilled) are in the store (or done)
        self.exhausted, self.longest, self.slots = False, 0, 0
        self.reported = self.done_tokens = 0

    def run(self) -> Iterator[tuple[Batch, list[Completion]]]:
        self._start()
        it, snap, fetched = 0, None, None
        while True:
            it += 1
            if self.drain_from is None and self._all_admitted():
                self.drain_from = (time.perf_counter(), self.stats["steps"], self.stats["slot_steps"])
            new_snap = self._decode_window(it)
            if fetched is not None:  # queued a window ago: done by now, or nearly
                self._deliver(fetched)
            fetched = self._check(snap) if snap is not None else None
            if self.slots:
                self._fill()
            snap = new_snap
            yield from self._hand_back()
            self._account()
            if snap is None and fetched is None and self._all_admitted() and not self.where:
                return

    def _all_admitted(self) -> bool:
        return not self.queue and self.exhausted

    def _pull(self) -> None:
        """The next batch from the source: its prompts numbered, its sequences queued."""
        t = time.perf_counter()
        try:
            batch = next(self.source)
        except StopIteration:
            self.exhausted = True
            return
        finally:
            dt = time.perf_counter() - t
            self.outside += dt
            self.stats["source_s"] += dt
        if any(len(p) == 0 for p in batch.prompts):
            raise ValueError("a prompt has no tokens")
        if len(batch.keys) != len(batch.prompts):
            raise ValueError(f"{len(batch.keys)} keys for {len(batch.prompts)} prompts")
        first, n = self.read, self.n
        self.read += len(batch.prompts)
        self.stats["batches"] += 1
        record = _Pending(batch, first * n, [None] * (len(batch.prompts) * n), len(batch.prompts) * n)
        (self.pending if batch.prompts else self.ready).append(record)
        if not batch.prompts:
            return
        for i, (ids, key) in enumerate(zip(batch.prompts, batch.keys)):
            self.prompts[first + i], self.keys[first + i] = ids, key
        self.queue.extend(range(first * n, self.read * n))
        self.ends.append(self.read)
        longest = max(len(p) for p in batch.prompts)
        if longest > self.longest:
            self.longest = longest
            if self.slots:  # a longer prompt than the cache was made for: a longer cache, in place
                self.engine.ensure(self.slots, longest + self.new)

    def _start(self) -> None:
        """Enough sequences read to fill the slots (all of them when there are fewer), the slots
        made for them, and filled."""
        e = self.engine
        while not self.exhausted and len(self.queue) < e.max_batch:
            self._pull()
        if self.queue:
            if e.batch_invariant:
                slots = round_up(e.max_batch, ROW_GROUP)
            else:
                slots = min(e.max_batch, len(self.queue)) if self.exhausted else e.max_batch
            e.ensure(slots, self.longest + self.new)
            self.slots = e.slots
            e.live.zero_()
            e.lengths.zero_()  # free slots attend over position 0 only
        S = self.slots
        self.buckets = [S] if e.batch_invariant else e.buckets()
        pinned = e.device.type == "cuda"
        self.bufs = [torch.zeros(2, S, dtype=torch.long, pin_memory=pinned) for _ in range(2)]
        # The host's view: which sequence each slot holds (-1: free), decode steps since its
        # admission, its prompt's length; and where each running sequence is.
        self.slot_seq, self.ages, self.prompt_len = [-1] * S, [0] * S, [0] * S
        self.where: dict[int, int] = {}
        if S:
            self._fill()

    def _prefill(self) -> None:
        """The next group of prompts into the (empty) store: from the first not prefilled,
        within its batch, as many as fit ``prefill_tokens`` padded to the longest of them.
        So the groups are a function of the batch alone, not of what ran before it."""
        e, first = self.engine, self.prefilled
        while self.ends[0] <= first:
            self.ends.popleft()
        group, length = [first], round_up(len(self.prompts[first]), SPAN_QUANTUM)
        for p in range(first + 1, self.ends[0]):
            longer = max(length, round_up(len(self.prompts[p]), SPAN_QUANTUM))
            if (len(group) + 1) * longer > e.prefill_tokens:
                break
            group.append(p)
            length = longer
        e.store_for(len(group), length, self.n, self.read - first)
        keys = sequence_keys(self.seed, [self.keys.pop(p) for p in group], self.n)
        e.prefill(group, self.prompts, self.n, e.to_device(keys))
        self.stats["prefills"] += 1
        self.stats["prefill_tokens"] += sum(len(self.prompts[p]) for p in group)
        self.prefilled += len(group)

    def _fill(self) -> None:
        """Free slots take the next sequences, prefilling their prompts as the store runs out."""
        n, queue = self.n, self.queue
        free = [s for s in range(self.slots) if self.slot_seq[s] < 0]
        while free:
            while not self.exhausted and len(queue) < self.slots:
                self._pull()
            if not queue:
                return
            if queue[0] // n == self.prefilled:  # every prompt in the store is admitted
                self._prefill()
            take = min(len(free), self.prefilled * n - queue[0])
            seqs = [queue.popleft() for _ in range(take)]
            lengths = [len(self.prompts[q // n]) for q in seqs]
            self.engine.admit(free[:take], seqs, lengths)
            self.stats["admissions"] += 1
            for s, q, length in zip(free, seqs, lengths):
                self.slot_seq[s], self.ages[s], self.prompt_len[s], self.where[q] = q, 0, length, s
                if q % n == n - 1:
                    del self.prompts[q // n]
            free = free[take:]

    def _active(self) -> list[int]:
        return [s for s in range(self.slots) if self.slot_seq[s] >= 0]

    def _decode_window(self, it: int):
        """Queue the next window of decode steps over the running sequences, and behind it the
        copy of their flags to the host (returned; None when no slot runs)."""
        e, new, ages = self.engine, self.new, self.ages
        active = self._active()
        if not active:
            return None
        if not self.queue and not e.batch_invariant:
            e.compact(self.slot_seq, ages, self.prompt_len, self.where)
            active = self._active()
        b = next(x for x in self.buckets if x > max(active))
        # Steps until every active sequence has hit max_new_tokens at the latest, at most
        # check_every; the span covers the longest any of them can get meanwhile.
        window = min(e.check_every, max(new - min(1 + ages[s], new) for s in active))
        longest = max(self.prompt_len[s] + min(ages[s] + window, new - 1) for s in active)
        span = min(round_up(longest + 1, SPAN_QUANTUM), e.max_len)
        for _ in range(window):
            e.step(b, span)
        for s in active:
            ages[s] += window
        self.stats["windows"] += 1
        self.stats["steps"] += window
        self.stats["slot_steps"] += window * b
        return e.snapshot(self.bufs[it % 2], b, self.slot_seq[:b])

    def _check(self, snap):
        """Read a window-old snapshot: the finished sequences' slots freed, the copy of their
        tokens to the host queued (returned; None when none finished), progress reported."""
        host, event, seqs = snap
        t0 = time.perf_counter()
        if event is not None:
            event.synchronize()
        self.stats["host_wait_s"] += time.perf_counter() - t0
        live, made = host.tolist()
        where = self.where
        finished = [(s, q) for s, q in enumerate(seqs) if q >= 0 and q in where and not live[s]]
        fetched = None
        if finished:
            qs = [q for _, q in finished]
            fetched = self.engine.fetch([where[q] for q in qs], [made[s] for s, _ in finished], qs)
            self.done_tokens += sum(made[s] for s, _ in finished)
            for q in qs:
                self.slot_seq[where.pop(q)] = -1
        if self.on_tokens is not None:
            running = sum(made[s] for s, q in enumerate(seqs) if q >= 0 and q in where)
            self.on_tokens(self.done_tokens + running - self.reported)
            self.reported = self.done_tokens + running
        return fetched

    def _deliver(self, fetched) -> None:
        """Completions into their batches; a batch whose last one came is ready."""
        for q, completion in self.engine.delivered(fetched):
            record = next(r for r in self.pending if r.first <= q < r.first + len(r.completions))
            record.completions[q - record.first] = completion
            record.left -= 1
            if record.left == 0:
                self.pending.remove(record)
                self.ready.append(record)

    def _hand_back(self) -> Iterator[tuple[Batch, list[Completion]]]:
        """The ready batches to the consumer, whose time is not the engine's."""
        self.ready.sort(key=lambda r: r.first)
        while self.ready:
            record = self.ready.pop(0)
            t0 = time.perf_counter()
            yield record.batch, record.completions
            self.outside += time.perf_counter() - t0

    def _account(self) -> None:
        stats, now = self.stats, time.perf_counter()
        stats["busy_s"] = now - self.t_start - self.outside
        if self.drain_from is not None:
            stats["drain_s"] = now - self.drain_from[0]
            stats["drain_steps"] = stats["steps"] - self.drain_from[1]
            stats["drain_slot_steps"] = stats["slot_steps"] - self.drain_from[2]


@dataclass
class _Pending:
    """A batch of ``Engine.stream`` whose sequences ``first ..`` are not all finished."""

    batch: Batch
    first: int
    completions: list
    left: int  # completions still to come
