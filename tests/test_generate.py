"""The generation engine: HF parity (greedy), log-probs, seeding, and the sampler's definitions."""

from __future__ import annotations

import pytest
import torch

import tiny
from llamarl.lib import parallel, vocab_parallel
from llamarl.lib.config import ParallelLayout
from llamarl.lib.generate import SamplingParams, generate, sample
from llamarl.lib.model import ParallelLlamaForCausalLM

EOS = 2
PROMPTS = [[5, 17, 33, 9], [101, 7], [44, 45, 46, 47, 48, 49, 50, 51, 52], [200]]


def _model(tp):
    parallel.init(tp, 1)
    hf = tiny.hf_model()
    model = ParallelLlamaForCausalLM(tiny.our_config(hf), ParallelLayout(tp=tp))
    model.load_hf_state_dict(hf.state_dict())
    return hf, model


def greedy_vs_hf(tp, max_batch):
    hf, model = _model(tp)
    params = SamplingParams(temperature=0, max_new_tokens=12, stop_token_ids=(EOS,))
    ours = generate(model, PROMPTS, params, max_batch=max_batch)
    mismatches = []
    for p, c in zip(PROMPTS, ours):
        ref = hf.generate(torch.tensor([p]), do_sample=False, max_new_tokens=12, eos_token_id=EOS, pad_token_id=0)
        ref = ref[0, len(p):].tolist()
        if ref != c.tokens:
            mismatches.append((p, ref, c.tokens))
        if c.finish_reason != ("stop" if c.tokens[-1] == EOS else "length"):
            mismatches.append(("finish_reason", c))
    return mismatches


@pytest.mark.parametrize("tp,max_batch", [(1, 64), (2, 64), (2, 2)], ids=["tp1", "tp2", "tp2-small-batches"])
def test_greedy_matches_hf_generate(pool2, tp, max_batch):
    for mismatches in pool2.run(greedy_vs_hf, tp, max_batch):
        assert not mismatches, mismatches


def logprobs_vs_teacher_forcing(tp, seed):
    _, model = _model(tp)
    gen = torch.Generator().manual_seed(seed)
    params = SamplingParams(temperature=1.0, max_new_tokens=10, stop_token_ids=(EOS,))
    completions = generate(model, PROMPTS, params, gen)
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
    gen = torch.Generator().manual_seed(seed)
    tokens, logp = sample(LOGITS.expand(N, -1), params, gen)
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
    tokens, logp = sample(LOGITS.expand(3, -1), SamplingParams(temperature=0), None)
    assert tokens.tolist() == [0, 0, 0]
    assert torch.allclose(logp, torch.log(torch.tensor(0.4)).expand(3), atol=1e-6)


def test_reported_logprob_is_of_the_drawn_token():
    gen = torch.Generator().manual_seed(1)
    tokens, logp = sample(LOGITS.expand(1000, -1), SamplingParams(temperature=0.7, top_k=3), gen)
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
        generate(model, prompts, SamplingParams(temperature=0, max_new_tokens=2))
    vocab = model.lm_head.weight.shape[0]  # this rank's (padded) vocabulary
    assert vocab not in (model.cfg.hidden_size, 2 * model.cfg.intermediate_size)  # unambiguous widths
    # (the head weight's transpose [hidden, vocab] is not a logits block)
    rows = [s[0] for _, s in rec.shapes if len(s) == 2 and s[-1] == vocab and s[0] != model.cfg.hidden_size]
    return max(rows, default=0), len(prompts)


def test_prefill_runs_the_head_on_each_prompts_last_token_only(pool1):
    widest, sequences = pool1.run(widest_logits_in_generate)[0]
    assert widest == sequences  # [3, vocab] logits, never [98, vocab]
