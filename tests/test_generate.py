"""The generation engine: HF parity (greedy), log-probs, keyed sampling (the same responses at any
batch size and TP), continuous batching, and the sampler's definitions."""

from __future__ import annotations

import pytest
import torch

import tiny
from distpool import interpreter_pool, triton_available
from llamarl.lib.distributed import parallel
from llamarl.lib.model import vocab_parallel
from llamarl.lib.model.config import ParallelLayout
from llamarl.lib.engine.generate import Engine, SamplingParams
from llamarl.lib.engine.sampling import sample, sequence_keys
from llamarl.lib.model.llama import ParallelLlamaForCausalLM

EOS = 2
PROMPTS = [[5, 17, 33, 9], [101, 7], [44, 45, 46, 47, 48, 49, 50, 51, 52], [200]]


def _model(tp):
    parallel.init(tp, 1)
    hf = tiny.hf_model()
    model = ParallelLlamaForCausalLM(tiny.our_config(hf), ParallelLayout(tp=tp))
    model.load_hf_state_dict(hf.state_dict())
    return hf, model


def greedy_vs_hf(tp, max_batch, samples):
    hf, model = _model(tp)
    params = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(EOS,))
    ours = Engine(model, params, max_batch=max_batch).generate(PROMPTS, samples_per_prompt=samples)
    mismatches = []
    for i, c in enumerate(ours):
        p = PROMPTS[i // samples]
        ref = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12, eos_token_id=EOS, pad_token_id=0)
        ref = ref[0, len(p):].tolist()
        if ref != c.tokens:
            mismatches.append((p, ref, c.tokens))
        if c.finish_reason != ("stop" if c.tokens[-1] == EOS else "length"):
            mismatches.append(("finish_reason", c))
    return mismatches


# tp2-small-batches: 2 slots for 8 sequences, so slots are refilled as sequences finish and the
# second sample of each prompt gets its KV prefix copied from the first's prefill.
@pytest.mark.parametrize("tp,max_batch,samples", [(1, 64, 1), (2, 64, 1), (2, 2, 2)],
                         ids=["tp1", "tp2", "tp2-small-batches"])
def test_greedy_matches_hf_generate(pool2, tp, max_batch, samples):
    for mismatches in pool2.run(greedy_vs_hf, tp, max_batch, samples):
        assert not mismatches, mismatches


def logprobs_vs_teacher_forcing(tp, seed):
    _, model = _model(tp)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, stop_token_ids=(EOS,))
    completions = Engine(model, params).generate(PROMPTS, seed=seed)
    worst = 0.0
    for p, c in zip(PROMPTS, completions):
        seq = torch.tensor([p + c.tokens])
        with torch.no_grad():
            logits = model.run(seq)[0]
        lp = vocab_parallel.log_probs(logits[len(p) - 1 : -1], seq[0, len(p):])
        worst = max(worst, (lp - torch.tensor(c.logprobs)).abs().max().item())
    return worst, [c.tokens for c in completions]


def test_logprobs_equal_teacher_forced_forward_and_seed_fixes_samples(pool2):
    (err0, toks0), (err1, toks1) = pool2.run(logprobs_vs_teacher_forcing, 2, 123)
    assert err0 < 1e-4 and err1 < 1e-4
    assert toks0 == toks1  # TP ranks drew the same tokens
    again = pool2.run(logprobs_vs_teacher_forcing, 2, 123)[0][1]
    other = pool2.run(logprobs_vs_teacher_forcing, 2, 124)[0][1]
    assert again == toks0 and other != toks0


# ---- the sampler, statistically, over a tiny vocabulary --------------------------------------

LOGITS = torch.log(torch.tensor([0.4, 0.3, 0.2, 0.1, 0.0 + 1e-9]))
N = 100_000


def _freqs(params, seed=0):
    tokens, logp = sample(LOGITS.expand(N, -1), params, sequence_keys(seed, range(N)))
    return torch.bincount(tokens, minlength=5).float() / N, logp


def test_temperature_follows_softmax_of_scaled_logits():
    for t in (0.5, 1.0, 2.0):
        freq, logp = _freqs(SamplingParams(temperature=t))
        expected = torch.softmax(LOGITS / t, -1)
        assert (freq - expected).abs().max() < 0.01, (t, freq, expected)


def test_top_k_keeps_only_the_k_most_likely():
    freq, _ = _freqs(SamplingParams(top_k=2))
    assert freq[2:].sum() == 0
    assert abs(freq[0] - 0.4 / 0.7) < 0.01 and abs(freq[1] - 0.3 / 0.7) < 0.01


def test_top_p_keeps_the_smallest_nucleus_reaching_p():
    # p = 0.5: 0.4 alone is short of 0.5, so {0.4, 0.3} is the nucleus.
    freq, _ = _freqs(SamplingParams(top_p=0.5))
    assert freq[2:].sum() == 0 and abs(freq[0] - 0.4 / 0.7) < 0.01
    # p = 0.75: {0.4, 0.3, 0.2} (0.7 < 0.75 before the third token).
    freq, _ = _freqs(SamplingParams(top_p=0.75))
    assert freq[3:].sum() == 0 and abs(freq[2] - 0.2 / 0.9) < 0.01


def test_greedy_is_argmax_and_logprob_is_at_temperature_one():
    tokens, logp = sample(LOGITS.expand(3, -1), SamplingParams(temperature=0), sequence_keys(0, range(3)))
    assert tokens.tolist() == [0, 0, 0]
    assert torch.allclose(logp, torch.log(torch.tensor(0.4)).expand(3), atol=1e-6)


def test_reported_logprob_is_of_the_drawn_token():
    tokens, logp = sample(LOGITS.expand(1000, -1), SamplingParams(temperature=0.7, top_k=3), sequence_keys(1, range(1000)))
    assert torch.allclose(logp, torch.log_softmax(LOGITS / 0.7, -1)[tokens])


def test_bad_sampling_params_are_clear_errors():
    from llamarl.lib.errors import UserError

    for bad, needle in ((dict(temperature=-1), "temperature"), (dict(top_p=0), "top_p"), (dict(top_k=-2), "top_k"),
                        (dict(max_new_tokens=0), "max_new_tokens")):
        with pytest.raises(UserError, match=needle):
            SamplingParams(**bad).check()


def widest_logits_in_generate() -> tuple[int, int]:
    from test_vocab_parallel import _ShapeRecorder

    _, model = _model(1)
    prompts = [list(range(3, 3 + n)) for n in (40, 25, 33)]  # 98 prompt tokens, 3 sequences
    with _ShapeRecorder() as rec:
        Engine(model, SamplingParams(temperature=0, max_new_tokens=2)).generate(prompts)
    vocab = model.lm_head.weight.shape[0]  # this rank's (padded) vocabulary
    assert vocab not in (model.cfg.hidden_size, 2 * model.cfg.intermediate_size)  # unambiguous widths
    # (the head weight's transpose [hidden, vocab] is not a logits block)
    rows = [s[0] for _, s in rec.shapes if len(s) == 2 and s[-1] == vocab and s[0] != model.cfg.hidden_size]
    return max(rows, default=0), len(prompts)


def test_prefill_runs_the_head_on_each_prompts_last_token_only(pool1):
    widest, sequences = pool1.run(widest_logits_in_generate)[0]
    assert widest == sequences  # [3, vocab] logits, never [98, vocab]


# ---- keyed sampling: a response depends on its key only ------------------------------------

STOPS = tuple(range(40, 70))  # ~12 % of the tiny vocabulary: sequences stop at random lengths


def responses(tp, max_batch, check_every=16, prefill_tokens=16384):
    _, model = _model(tp)
    prompts = [[5, 17, 33, 9], [101, 7], [44, 45, 46, 47, 48, 49, 50, 51, 52], [200], [9, 8, 7, 6, 5, 4], [77, 78]]
    params = SamplingParams(temperature=1.0, max_new_tokens=16, stop_token_ids=STOPS)
    engine = Engine(model, params, max_batch=max_batch, check_every=check_every, prefill_tokens=prefill_tokens)
    out = engine.generate(prompts, seed=5, keys=[10 * i for i in range(len(prompts))], samples_per_prompt=3)
    return [(c.tokens, c.logprobs, c.finish_reason) for c in out]


def _same_responses(a, b):
    assert [r[0] for r in a] == [r[0] for r in b]
    assert [r[2] for r in a] == [r[2] for r in b]
    worst = max(abs(x - y) for ra, rb in zip(a, b) for x, y in zip(ra[1], rb[1]))
    assert worst < 1e-5, worst


def test_responses_do_not_depend_on_batch_size_or_tp(pool1, pool2):
    # 4 slots for 18 sequences, checked every 3 steps: slots are refilled as sequences stop,
    # sequences run in another order and next to others than with 64 slots. Prefills of at most
    # 8 tokens: prompts are prefilled a few at a time into a 3-row store, rows reused.
    small, = pool1.run(responses, 1, 4, 3, 8)
    big, = pool1.run(responses, 1, 64)
    _same_responses(small, big)
    reasons = [r[2] for r in big]
    assert "stop" in reasons and "length" in reasons  # random stop lengths, and some ran to the end
    assert len({tuple(r[0]) for r in big[:3]}) > 1  # a prompt's samples are different draws
    for tp2 in pool2.run(responses, 2, 4, 3, 8):
        _same_responses(tp2, big)


# ---- one stream over many batches ------------------------------------------------------------

def stream_vs_generate(tp, invariant):
    """Batches through one stream (6 slots, so sequences of the next batch take the slots the last
    ones free; an empty batch; a later batch with a prompt longer than the cache and the prompt
    store were made for) against each batch generated alone."""
    from llamarl.lib.engine.generate import Batch, Engine

    _, model = _model(tp)
    params = SamplingParams(temperature=1.0, max_new_tokens=16, stop_token_ids=STOPS)
    g = torch.Generator().manual_seed(0)
    sizes = [5, 7, 0, 3, 1, 6]
    lengths = [[int(x) for x in torch.randint(2, 40, (s,), generator=g)] for s in sizes]
    lengths[4] = [150]  # past the cache's 64 + 16 positions and the store's 64
    batches, key = [], 0
    for i, ls in enumerate(lengths):
        prompts = [[int(t) for t in torch.randint(3, 250, (n_,), generator=g)] for n_ in ls]
        batches.append(Batch(prompts, list(range(key, key + len(prompts))), tag=i))
        key += len(prompts)
    events = []

    def source():
        for b in batches:
            events.append(("pull", b.tag))
            yield b

    options = dict(max_batch=6, check_every=3, prefill_tokens=128, batch_invariant=invariant)
    engine = Engine(model, params, **options)
    streamed = {}
    for batch, out in engine.stream(source(), seed=5, samples_per_prompt=3):
        events.append(("done", batch.tag))
        streamed[batch.tag] = [(c.tokens, c.logprobs, c.finish_reason) for c in out]
    stream_steps = engine.stats["steps"]
    alone, drained_steps = {}, 0
    for b in batches:
        one = Engine(model, params, **options)
        out = one.generate(b.prompts, seed=5, keys=b.keys, samples_per_prompt=3)
        drained_steps += one.stats.get("steps", 0)
        alone[b.tag] = [(c.tokens, c.logprobs, c.finish_reason) for c in out]
    return streamed, alone, events, stream_steps, drained_steps


@pytest.mark.parametrize("invariant", [False, True], ids=["buckets", "batch-invariant"])
def test_a_stream_of_batches_gives_each_batch_what_it_gives_alone(pool1, pool2, invariant):
    for tp, pool in ((1, pool1), (2, pool2)):
        for streamed, alone, events, stream_steps, drained_steps in pool.run(stream_vs_generate, tp, invariant):
            assert sorted(streamed) == sorted(alone) == list(range(6))
            for tag in alone:
                assert len(streamed[tag]) == len(alone[tag])
                if alone[tag]:
                    _same_responses(streamed[tag], alone[tag])
            if invariant:  # to the bit, log-probs too
                assert streamed == alone
            assert streamed[2] == [] and len(streamed[4][0][0]) > 0
            # read lazily: the first batch is done before the last is read; and the slots were
            # kept busy across batches: fewer decode steps than batch after batch, each drained
            assert events.index(("done", 0)) < events.index(("pull", 5))
            assert stream_steps < drained_steps, (stream_steps, drained_steps)


def stream_times():
    import time

    from llamarl.lib.engine.generate import Batch, Engine

    _, model = _model(1)

    def source():
        for i in range(3):
            time.sleep(0.3)  # a slow reader
            yield Batch([[5, 6, 7], [8, 9]], [2 * i, 2 * i + 1])

    engine = Engine(model, SamplingParams(max_new_tokens=4), max_batch=2)
    t0 = time.perf_counter()
    for _ in engine.stream(source()):
        time.sleep(0.3)  # a slow consumer
    return time.perf_counter() - t0, engine.stats


def test_the_engines_own_time_leaves_out_its_source_and_consumer(pool1):
    wall, stats = pool1.run(stream_times)[0]
    assert stats["source_s"] >= 0.9 and stats["batches"] == 3
    assert 0 < stats["busy_s"] <= wall - stats["source_s"] - 0.9 + 0.05, (wall, stats)


def drain_stats():
    from llamarl.lib.engine.generate import Batch, Engine

    _, model = _model(1)
    prompts = [[5 + i, 17, 33 + i] for i in range(24)]
    batches = [Batch(prompts[i:i + 6], list(range(i, i + 6))) for i in range(0, 24, 6)]
    params = SamplingParams(max_new_tokens=24, stop_token_ids=tuple(range(40, 90)))  # random lengths
    out = {}
    for invariant in (True, False):
        engine = Engine(model, params, max_batch=8, batch_invariant=invariant, check_every=2)
        tokens = [c.tokens for _, cs in engine.stream(batches, seed=1) for c in cs]
        out[invariant] = (tokens, dict(engine.stats))
    return out


def test_the_stream_reports_its_drain(pool1):
    # drain_*: from the window where nothing was left to admit to the stream's end; a batch-invariant
    # engine runs every slot there, the default one compacts and steps smaller buckets.
    out = pool1.run(drain_stats)[0]
    (tok_i, inv), (tok_d, base) = out[True], out[False]
    assert tok_i == tok_d and len({len(t) for t in tok_i}) > 1  # the same draws; lengths vary
    for st in (inv, base):
        assert 0 < st["drain_steps"] <= st["steps"] and 0 < st["drain_slot_steps"] <= st["slot_steps"]
        assert 0 < st["drain_s"] <= st["busy_s"] + st["source_s"] + 1e-3
    assert inv["drain_slot_steps"] == 8 * inv["drain_steps"]  # all slots, every step
    assert base["drain_slot_steps"] < inv["drain_slot_steps"]


def sampler_tp2_vs_tp1(params, seed):
    parallel.init(2, 1)
    group, rank = parallel.tp_group(), parallel.topology().tp_rank
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(64, 250, generator=g) * 3
    keys = sequence_keys(seed, range(64))
    steps = torch.arange(64) % 7
    local = logits[:, rank * 125 : (rank + 1) * 125]
    ours = sample(local, params, keys, steps, vocab_start=rank * 125, group=group)
    whole = sample(logits, params, keys, steps)
    return ours, whole


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.6, top_k=5),
                                    SamplingParams(top_p=0.8), SamplingParams(temperature=1.3, top_k=40, top_p=0.9),
                                    SamplingParams(temperature=0)], ids=["plain", "top_k", "top_p", "k_and_p", "greedy"])
def test_vocab_parallel_sampler_draws_what_the_whole_vocabulary_draws(pool2, params):
    for (tok, lp), (tok1, lp1) in pool2.run(sampler_tp2_vs_tp1, params, 3):
        assert torch.equal(tok, tok1)
        assert torch.allclose(lp, lp1, atol=1e-5)


def fused_sampler_vs_eager(seed, split_cols):
    """Per params: (the kernel's draw at TP2, the eager code's at TP2, the kernel's on the whole
    vocabulary, the kernel's for the first 3 rows alone), in bf16 logits with a greedy tie;
    ``split_cols``: the columns of one program of the kernel."""
    from llamarl.lib.engine import sampling

    sampling.SPLIT_COLS = split_cols
    parallel.init(2, 1)
    group, rank = parallel.tp_group(), parallel.topology().tp_rank
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(24, 6000, generator=g) * 3).bfloat16()
    logits[0, 10] = logits[0, 5000] = 40  # a tie across column blocks and shards: the first wins
    keys, steps = sequence_keys(seed, range(24)), torch.arange(24) * 5 + 2**33  # steps past 2^32
    local = logits[:, rank * 3000 : (rank + 1) * 3000]
    out = []
    for params in (SamplingParams(), SamplingParams(temperature=0.7, top_k=50), SamplingParams(top_p=0.8),
                   SamplingParams(temperature=0)):
        out.append([sample(local, params, keys, steps, vocab_start=rank * 3000, group=group, fused=True),
                    sample(local, params, keys, steps, vocab_start=rank * 3000, group=group),
                    sample(logits, params, keys, steps, fused=True),
                    sample(logits[:3], params, keys[:3], steps[:3], fused=True)])
    return out


@pytest.mark.skipif(not triton_available(), reason="Triton is not installed (the kernel's CPU check runs in its interpreter)")
@pytest.mark.parametrize("split_cols", [16384, 1024], ids=["one-split-a-shard", "splits-of-1024"])
def test_the_samplers_kernel_draws_what_the_torch_code_draws(split_cols):
    # The Triton kernel (what a GPU runs) in Triton's interpreter: the same tokens as the eager code
    # (the hash bit for bit), on every layout and batch, log-probs to float rounding. Split in
    # 1024 columns, the greedy tie (columns 10 and 5000) lies across splits and shards.
    with interpreter_pool(2) as pool:
        per_rank = pool.run(fused_sampler_vs_eager, 5, split_cols)
    assert per_rank[0][3][0][0][0] == 10  # the greedy tie
    for draws in per_rank:
        for (tok, lp), (tok_eager, lp_eager), (tok_whole, lp_whole), (tok3, lp3) in draws:
            assert torch.equal(tok, tok_eager) and torch.equal(tok, tok_whole) and torch.equal(tok[:3], tok3)
            assert torch.allclose(lp, lp_eager, atol=1e-5) and torch.allclose(lp, lp_whole, atol=1e-5)
            assert torch.equal(lp[:3], lp3)  # a row's numbers do not depend on its batch


def test_top_p_threshold_by_bisection_equals_the_sorted_definition():
    from llamarl.lib.engine.sampling import _threshold

    g = torch.Generator().manual_seed(0)
    for t, p in ((1.0, 0.9), (0.5, 0.3), (2.0, 0.99)):
        x = torch.randn(32, 500, generator=g) * 2
        lo = _threshold(x, SamplingParams(temperature=t, top_p=p), None)
        s, _ = (x / t).sort(-1, descending=True)
        probs = s.softmax(-1)
        kept = ((probs.cumsum(-1) - probs) < p).sum(-1)  # tokens whose predecessors' mass is below p
        assert torch.equal((x >= lo[:, None]).sum(-1), kept)


def full_vocab_tensors_in_tp2_generate():
    from test_vocab_parallel import _ShapeRecorder

    _, model = _model(2)
    with _ShapeRecorder() as rec:
        Engine(model, SamplingParams(temperature=0.8, top_k=7, max_new_tokens=3)).generate(PROMPTS, samples_per_prompt=2)
    vocab, padded, local = model.cfg.vocab_size, model.lm_head.weight.shape[0] * 2, model.lm_head.weight.shape[0]
    # (a [vocab] table of stop flags is not a block of logits: only tensors with rows count)
    return [s for _, s in rec.shapes if len(s) > 1 and (vocab in s or padded in s)], any(local in s for _, s in rec.shapes)


def test_tp_sampling_never_holds_the_whole_vocabulary(pool2):
    for offending, local_seen in pool2.run(full_vocab_tensors_in_tp2_generate):
        assert local_seen and not offending, offending[:5]
