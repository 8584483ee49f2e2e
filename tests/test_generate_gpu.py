"""The generation engine on a GPU (marked ``gpu``: skipped without CUDA): decode captured as CUDA
graphs computes what the eager decode computes, and the sampler's Triton kernel what the eager torch code draws.

``python -m pytest -m gpu tests/test_generate_gpu.py`` on a GPU machine (one GPU, in-process).
"""

from __future__ import annotations

import os

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def model():
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29561")
    from llamarl.lib.distributed import parallel
    from llamarl.lib.model.config import LlamaConfig, ParallelLayout
    from llamarl.lib.model.llama import ParallelLlamaForCausalLM

    parallel.init(1, 1)
    cfg = LlamaConfig.from_hf(dict(model_type="llama", vocab_size=32000, hidden_size=512, intermediate_size=1024, num_hidden_layers=4,
                                   num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=2048,
                                   rms_norm_eps=1e-5, rope_theta=10000.0, tie_word_embeddings=False))
    with torch.device("cuda"):
        m = ParallelLlamaForCausalLM(cfg, ParallelLayout(), dtype=torch.bfloat16)
    m.init_random(seed=0, std=0.05)  # peakier than 0.02, so greedy argmaxes are not near-ties
    yield m
    parallel.shutdown()


def _prompts(n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, 32000, (int(torch.randint(4, 60, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


def _run(model, params, *, graphs, fused, max_batch, samples=1):
    from llamarl.lib.engine.generate import Engine

    engine = Engine(model, params, max_batch=max_batch, cuda_graphs=graphs, fused=fused, check_every=8)
    out = engine.generate(_prompts(20), seed=3, samples_per_prompt=samples)
    return out, engine


def test_graph_decode_equals_eager_decode_greedy(model):
    from llamarl.lib.engine.generate import SamplingParams

    params = SamplingParams(temperature=0, max_new_tokens=40, stop_token_ids=tuple(range(3, 300)))
    graph, engine = _run(model, params, graphs=True, fused=True, max_batch=8, samples=2)
    eager, _ = _run(model, params, graphs=False, fused=False, max_batch=8, samples=2)
    assert len(engine._graphs) > 1  # several buckets / spans were captured and replayed
    assert [c.tokens for c in graph] == [c.tokens for c in eager]
    worst = max(abs(a - b) for g, e in zip(graph, eager) for a, b in zip(g.logprobs, e.logprobs))
    assert worst < 1e-3, worst


@pytest.mark.parametrize("options", [dict(), dict(top_k=50, top_p=0.9), dict(top_p=0.8, temperature=0.7)],
                         ids=["plain", "top_k_top_p", "top_p"])
def test_graph_decode_equals_eager_decode_sampling(model, options):
    from llamarl.lib.engine.generate import SamplingParams

    params = SamplingParams(max_new_tokens=32, stop_token_ids=tuple(range(3, 600)), **options)
    graph, _ = _run(model, params, graphs=True, fused=True, max_batch=8, samples=3)
    eager, _ = _run(model, params, graphs=False, fused=True, max_batch=8, samples=3)
    assert [c.tokens for c in graph] == [c.tokens for c in eager]
    assert [c.logprobs for c in graph] == [c.logprobs for c in eager]  # the same kernels, replayed


def test_logprobs_equal_a_teacher_forced_pass(model):
    from llamarl.lib.model import vocab_parallel
    from llamarl.lib.engine.generate import SamplingParams

    out, _ = _run(model, SamplingParams(max_new_tokens=24), graphs=True, fused=True, max_batch=8)
    errors = []
    for p, c in zip(_prompts(20), out):
        seq = torch.tensor([p + c.tokens], device="cuda")
        with torch.no_grad():
            logits = model.run(seq)[0]
        lp = vocab_parallel.log_probs(logits[len(p) - 1 : -1], seq[0, len(p):])
        errors.append((lp.cpu() - torch.tensor(c.logprobs)).abs())
    errors = torch.cat(errors)
    print(f"log-prob vs teacher forcing (bf16): mean {errors.mean():.4f}, max {errors.max():.4f}")
    # bf16: the decode and the padded forward round differently (fp32 CPU agrees to 1e-4, test_generate)
    assert errors.mean() < 0.02 and errors.max() < 0.25


def test_a_batch_invariant_stream_gives_each_batch_the_bits_it_gives_alone(model):
    # What a resumed rollout relies on (docs/generation.md, batch invariance): random stop lengths,
    # so the stream runs sequences of two batches side by side, at other slots and decode spans.
    from llamarl.lib.engine.generate import Batch, Engine, SamplingParams

    params = SamplingParams(max_new_tokens=40, stop_token_ids=tuple(range(3, 300)))
    prompts = _prompts(24, seed=1)
    batches = [Batch(prompts[i:i + 6], list(range(i, i + 6)), tag=i // 6) for i in range(0, 24, 6)]

    def engine():
        return Engine(model, params, max_batch=8, batch_invariant=True, check_every=4)

    streamed = {b.tag: [(c.tokens, c.logprobs) for c in out] for b, out in engine().stream(batches, seed=3, samples_per_prompt=2)}
    for b in batches:
        alone = engine().generate(b.prompts, seed=3, keys=b.keys, samples_per_prompt=2)
        assert streamed[b.tag] == [(c.tokens, c.logprobs) for c in alone], b.tag


@pytest.mark.parametrize("rows", [1, 64, 512])
def test_the_samplers_kernel_draws_what_the_torch_code_draws_on_llamas_vocabulary(rows):
    # The kernel compiled for the GPU (not the interpreter): Llama 3's vocabulary, bf16 logits.
    from llamarl.lib.engine.sampling import SamplingParams, sample, sequence_keys

    g = torch.Generator(device="cuda").manual_seed(rows)
    logits = (torch.randn(rows, 128256, device="cuda", generator=g) * 2).bfloat16()
    keys, steps = sequence_keys(0, range(rows), device="cuda"), torch.arange(rows, device="cuda") * 7
    for params in (SamplingParams(), SamplingParams(temperature=0.6, top_k=50), SamplingParams(temperature=0)):
        tok, lp = sample(logits, params, keys, steps, fused=True)
        tok_eager, lp_eager = sample(logits, params, keys, steps)
        # GPU logarithms may differ in the last bit from torch's: a token on a knife's edge may flip.
        assert (tok == tok_eager).float().mean() >= (1.0 if params.greedy else 0.98), params
        same = tok == tok_eager
        assert (lp - lp_eager)[same].abs().max() < 1e-4, params


def test_attention_warm_up_leaves_no_imports_for_the_first_prefill():
    # The rollout stage warms attention up in a thread while it loads: the model's first varlen
    # call (another shape) must then import nothing (the first call imports torch._dynamo).
    import subprocess
    import sys

    code = """
import sys, torch
from llamarl.lib.model import attention
attention.warm_up(torch.device("cuda"), torch.bfloat16, 32, 8, 64)
before = set(sys.modules)
q = torch.randn(300, 32, 64, device="cuda", dtype=torch.bfloat16)
kv = torch.randn(300, 8, 64, device="cuda", dtype=torch.bfloat16)
cu = torch.tensor([0, 100, 300], dtype=torch.int32, device="cuda")
with torch.no_grad():  # as generation runs it
    attention.varlen_attention(q, kv, kv, cu, 200)
print(sorted(set(sys.modules) - before))
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]


def test_varlen_attention_without_gradients_computes_what_torchs_op_computes():
    # Without gradients the varlen path calls the flash kernel's aten op itself (no custom-op
    # wrapper): the very bits torch's varlen_attn gives.
    from llamarl.lib.model import attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(700, 32, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    k, v = (torch.randn(700, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g) for _ in range(2))
    cu = torch.tensor([0, 5, 300, 700], dtype=torch.int32, device="cuda")
    with torch.no_grad():
        direct = attention.varlen_attention(q, k, v, cu, 400, backend="torch_varlen")
    assert attention._direct_flash_ok
    fn, has_gqa = attention._torch_varlen()
    kv = (k, v) if has_gqa else (attention.repeat_kv(k, 4), attention.repeat_kv(v, 4))
    through_op = fn(q, *kv, cu, cu, 400, 400, window_size=(-1, 0), **({"enable_gqa": True} if has_gqa else {}))
    assert torch.equal(direct, through_op)


def test_varlen_attention_with_gradients_computes_what_torchs_op_computes():
    # Training calls the flash kernels' aten ops too (GQA in the kernel: keys and values are not
    # repeated): the output bits of torch's varlen_attn, gradients within bf16 rounding of its.
    from llamarl.lib.model import attention

    g = torch.Generator(device="cuda").manual_seed(0)
    q = torch.randn(700, 32, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_()
    k, v = (torch.randn(700, 8, 64, device="cuda", dtype=torch.bfloat16, generator=g).requires_grad_() for _ in range(2))
    dout = torch.randn(700, 32, 64, device="cuda", dtype=torch.bfloat16, generator=g)
    cu = torch.tensor([0, 5, 300, 700], dtype=torch.int32, device="cuda")
    out = attention.varlen_attention(q, k, v, cu, 400, backend="torch_varlen")
    assert out.grad_fn.name() == "_FlashVarlenBackward"
    grads = torch.autograd.grad(out, (q, k, v), dout)
    fn, has_gqa = attention._torch_varlen()
    kv = (k, v) if has_gqa else (attention.repeat_kv(k, 4), attention.repeat_kv(v, 4))
    ref = fn(q, *kv, cu, cu, 400, 400, window_size=(-1, 0), **({"enable_gqa": True} if has_gqa else {}))
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    assert torch.equal(out, ref)
    for name, a, b in zip("qkv", grads, ref_grads):
        assert a.shape == b.shape and (a - b).abs().max() <= 1e-2 * b.abs().max(), name
