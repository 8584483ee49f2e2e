"""Every fusion against the unfused path it replaces.

* The compiled regions of ``lib.layers`` (RMSNorm, residual add + RMSNorm, rotary, SwiGLU): a
  model with ``fused=True`` against ``fused=False``, logits and every gradient, on CPU (inductor's
  C++ backend; ~40 s of compilation on a cold cache) and on CUDA (``gpu``: bf16, both measured
  against fp32).
* Gradient accumulation fusion (``lib.layers.linear``: the weight-gradient GEMM adds into the fp32
  ``main_grad``): against F.linear's gradient added by ``GradBuffer``'s hook, one linear against
  float64 and a whole bf16 model over two micro-batches; on CPU by upcasting, on CUDA through
  torch's mixed-dtype ``addmm`` (``gpu``).
* The Triton vocabulary kernels of ``lib.vocab_parallel`` (log-probs, entropy, both; at TP 1 and 2):
  against the torch ops. On CPU through Triton's interpreter when Triton is installed (it is not
  a dependency: skipped otherwise), on CUDA compiled (``gpu``).
"""

from __future__ import annotations

import os

import pytest
import torch

import tiny
from distpool import interpreter_pool, triton_available
from llamarl.lib.model import attention, layers, swiglu_kernel, vocab_parallel
from llamarl.lib.rl import optim
from llamarl.lib.distributed import parallel
from llamarl.lib.model.config import ParallelLayout, pad_vocab
from llamarl.lib.model.llama import ParallelLlamaForCausalLM

CUDA = torch.cuda.is_available()
gpu = [pytest.mark.gpu, pytest.mark.skipif(not CUDA, reason="needs a CUDA device")]


# ---- compiled regions: a whole model, fused against eager -------------------------------------


def _loss(model, ids, mask, pos):
    batch = model.make_batch(ids, mask, pos)
    labels = batch.flat(torch.roll(ids, -1, 1))
    logits = model(batch)
    lp, ent = vocab_parallel.log_probs_and_entropy(logits, labels)
    w = torch.linspace(-1, 1, lp.numel(), device=lp.device)
    ((lp * w).sum() + 0.1 * ent.sum()).backward()
    return logits.detach()


def fused_vs_eager(tp=1, sp=False, rmpad=True, device="cpu", dtype=torch.float32):
    """Max relative differences (logits, worst gradient) of fused against eager on the same weights,
    over two batches of different lengths (the token dimension is symbolic: one compilation)."""
    parallel.init(tp, 1)
    hf = tiny.hf_model()
    out = {}
    for fused in (False, True):
        with torch.device(device):
            model = ParallelLlamaForCausalLM(tiny.our_config(hf), ParallelLayout(tp=tp, sequence_parallel=sp,
                                                                                 remove_padding=rmpad),
                                             dtype=dtype, fused=fused)
        model.load_hf_state_dict(hf.state_dict())
        logits = []
        for side, lengths in (("left", (7, 12, 3)), ("right", (5, 9, 16, 2))):
            ids, mask, pos = (t.to(device) for t in tiny.batch(side, lengths=lengths))
            logits.append(_loss(model, ids, mask, pos))
        out[fused] = logits, {n: p.grad.float() for n, p in model.named_parameters()}
    (l0, g0), (l1, g1) = out[False], out[True]
    real = [torch.isfinite(a) & (a > torch.finfo(a.dtype).min) for a in l0]
    return {
        "logits": max(((a - b)[r].abs().max() / a[r].abs().max()).item() for a, b, r in zip(l0, l1, real)),
        "grads": max(((g0[n] - g1[n]).abs().max() / g0[n].abs().max()).item() for n in g0),
    }


def count_swiglu_backwards(monkeypatch) -> list:
    """The calls of the regions' SwiGLU backward op (on CPU, its reference formula)."""
    calls, reference = [], swiglu_kernel.backward_reference
    monkeypatch.setattr(swiglu_kernel, "backward_reference", lambda *a: calls.append(a[0].shape) or reference(*a))
    return calls


def test_fused_regions_match_eager_on_cpu(monkeypatch):
    # Inductor's CPU code computes the regions in fp32 like the eager ops: agreement to rounding.
    monkeypatch.setenv(layers.FUSED_LAYERS_ENV, "0")  # the four small regions (TP > 1's)
    swiglu_backwards = count_swiglu_backwards(monkeypatch)
    errs = fused_vs_eager(rmpad=True)
    assert swiglu_backwards, "the SwiGLU region's backward is lib.model.swiglu_kernel's op"
    assert max(errs.values()) < 1e-5, errs
    errs = fused_vs_eager(rmpad=False)  # the padded (SDPA) path; the regions are already compiled
    assert max(errs.values()) < 1e-5, errs


def test_fused_layers_match_eager_on_cpu(monkeypatch):
    # LLAMARL_FUSED_LAYERS=1 (the default at TP 1): a layer as two regions with its matmuls inside.
    monkeypatch.setenv(layers.FUSED_LAYERS_ENV, "1")
    swiglu_backwards = count_swiglu_backwards(monkeypatch)
    errs = fused_vs_eager(rmpad=True)
    assert swiglu_backwards, "the SwiGLU in the layer's second region has lib.model.swiglu_kernel's backward"
    assert max(errs.values()) < 1e-5, errs


@pytest.mark.slow
def test_generation_through_the_fused_regions_draws_what_eager_draws(monkeypatch):
    # Without gradients the regions run too (prefill, decode steps, frozen forwards): the two
    # layer regions in every pass, and the engine's draws and log-probs equal eager's.
    from llamarl.lib.engine.generate import Engine, SamplingParams
    from llamarl.lib.model import llama

    monkeypatch.setenv(layers.FUSED_LAYERS_ENV, "1")
    ran = []

    def spy(fn, *token_args):
        compiled = layers.compiled_region(fn, *token_args)
        return lambda *args: ran.append((fn.__name__, torch.is_grad_enabled())) or compiled(*args)

    monkeypatch.setattr(llama, "compiled_region", spy)
    parallel.init(1, 1)
    hf = tiny.hf_model()
    model = ParallelLlamaForCausalLM(tiny.our_config(hf), ParallelLayout(), fused=False)
    model.load_hf_state_dict(hf.state_dict())
    prompts = [[5, 17, 33, 9], [101, 7], [44, 45, 46, 47, 48], [200]]
    out = {}
    for fused in (False, True):
        model.model.fused = fused
        out[fused] = Engine(model, SamplingParams(temperature=1.0, max_new_tokens=8), max_batch=4).generate(prompts, seed=3)
    assert {name for name, _ in ran} == {"_attention_in", "_attention_out_and_mlp"}
    assert not any(grad for _, grad in ran)
    for eager, fused in zip(out[False], out[True]):
        assert eager.tokens == fused.tokens
        assert max(abs(a - b) for a, b in zip(eager.logprobs, fused.logprobs)) < 1e-5


def test_warming_compiles_every_region_that_a_model_then_runs(monkeypatch):
    """``warm_regions`` (the rollout's warm-up thread, a resident ppo worker's head start) compiles,
    on a one-layer model, the very graphs a whole model's forwards without gradients run and, with
    ``backward``, its training pass: on other lengths, nothing compiles again."""
    from torch._dynamo.utils import counters

    from llamarl.lib.model.llama import warm_regions

    monkeypatch.setenv(layers.FUSED_ENV, "1")  # the regions on CPU too
    torch._dynamo.reset()
    hf = tiny.hf_model()
    cfg = tiny.our_config(hf)
    assert cfg.num_layers > 1
    model = ParallelLlamaForCausalLM(cfg, ParallelLayout(), dtype=torch.float32)
    model.load_hf_state_dict(hf.state_dict())

    def compiled():
        return counters["stats"]["unique_graphs"], counters["aot_autograd"]["total"]

    assert warm_regions(cfg, ParallelLayout(), torch.float32, "cpu", backward=False)
    warmed = compiled()
    assert warmed[0] > 0
    for lengths in ((7, 12, 3), (5, 9, 16, 2)):
        with torch.no_grad():  # generation's and the frozen passes' graphs
            model(model.make_batch(*tiny.batch("left", lengths=lengths)))
    assert compiled() == warmed
    assert warm_regions(cfg, ParallelLayout(), torch.float32, "cpu", backward=True)
    warmed = compiled()
    for lengths in ((7, 12, 3), (5, 9, 16, 2)):
        _loss(model, *tiny.batch("right", lengths=lengths))
    assert compiled() == warmed
    # Nothing to warm where no region runs: TP > 1 here, or the regions switched off.
    assert not warm_regions(cfg, ParallelLayout(tp=2), torch.float32, "cpu", backward=True)
    monkeypatch.setenv(layers.FUSED_ENV, "0")
    assert not warm_regions(cfg, ParallelLayout(), torch.float32, "cpu", backward=True)


@pytest.mark.slow
def test_fused_regions_match_eager_tp2_sp(pool2):
    # Sequence parallel: the norms' weights are mapped (gradient summed over TP) outside the region.
    for errs in pool2.run(fused_vs_eager, 2, True):
        assert max(errs.values()) < 1e-5, errs


# ---- gradient accumulation fusion: the weight gradient added into main_grad by its GEMM ---------


def _linear_wgrad_errors(device, fused: bool, n=96, d_in=48, d_out=80, seed=0):
    """One bf16 linear run twice (two micro-batches) into an fp32 ``main_grad`` that starts random:
    relative errors of ``main_grad``, ``dx`` and the bias gradient against float64."""
    g = torch.Generator().manual_seed(seed)
    w = torch.nn.Parameter(torch.randn(d_out, d_in, generator=g).bfloat16().to(device))
    b = torch.nn.Parameter(torch.randn(d_out, generator=g).bfloat16().to(device))
    start = torch.randn(d_out, d_in, generator=g)
    w.main_grad = start.clone().to(device)
    if not fused:
        w.register_post_accumulate_grad_hook(optim._accumulate)
    ref_w, ref_dx, errs = start.double(), [], {}
    for mb in range(2):
        x = torch.randn(n, d_in, generator=g).bfloat16().to(device).requires_grad_()
        dy = torch.randn(n, d_out, generator=g).bfloat16().to(device)
        y = layers.linear(x, w, b) if fused else torch.nn.functional.linear(x, w, b)
        assert (y.grad_fn.name() == "_LinearGradIntoMainBackward") == fused
        y.backward(dy)
        assert w.grad is None  # fused: never materialised; unfused: freed by the hook
        ref_w = ref_w + dy.double().cpu().t() @ x.double().cpu()
        ref_dx = dy.double().cpu() @ w.double().cpu()
        errs[f"dx{mb}"] = ((x.grad.double().cpu() - ref_dx).norm() / ref_dx.norm()).item()
    errs["main_grad"] = ((w.main_grad.double().cpu() - ref_w).norm() / (ref_w - start.double()).norm()).item()
    return errs


def test_linear_adds_its_weight_gradient_into_main_grad(monkeypatch):
    monkeypatch.setenv(layers.WGRAD_ENV, "1")
    fused = _linear_wgrad_errors("cpu", True)
    monkeypatch.setenv(layers.WGRAD_ENV, "0")
    unfused = _linear_wgrad_errors("cpu", False)
    # CPU: dyᵀx from the bf16 operands in fp32, added in fp32 (no bf16 rounding of the gradient).
    assert fused["main_grad"] < 1e-6, fused
    assert unfused["main_grad"] > 1e-3, unfused  # the bf16 gradient the fusion avoids
    for k in ("dx0", "dx1"):
        assert fused[k] == unfused[k], (fused, unfused)  # the input's gradient: the same GEMM


def test_wgrad_fusion_only_where_asked(monkeypatch):
    w = torch.nn.Parameter(torch.zeros(4, 3, dtype=torch.bfloat16))
    x = torch.zeros(2, 3, dtype=torch.bfloat16)
    w.main_grad = torch.zeros(4, 3)
    monkeypatch.setenv(layers.WGRAD_ENV, "auto")
    assert not layers.wgrad_fusion_on(torch.device("cpu"))  # auto: CUDA only
    assert layers.linear(x, w).grad_fn.name() != "_LinearGradIntoMainBackward"
    monkeypatch.setenv(layers.WGRAD_ENV, "1")
    assert layers.linear(x, w).grad_fn.name() == "_LinearGradIntoMainBackward"
    with torch.no_grad():
        assert layers.linear(x, w).grad_fn is None
    del w.main_grad  # no buffer (raw training, after free_gradients): F.linear
    assert layers.linear(x, w).grad_fn.name() != "_LinearGradIntoMainBackward"
    w32 = torch.nn.Parameter(torch.zeros(4, 3))
    w32.main_grad = w32.grad = torch.zeros(4, 3)  # fp32: autograd accumulates in place already
    assert layers.linear(x.float(), w32).grad_fn.name() != "_LinearGradIntoMainBackward"


def grad_buffer_fused_vs_hook(device="cpu", dtype=torch.bfloat16, fused=False, fused_layers="0"):
    """A bf16 model's ``main_grad`` after two micro-batches, wgrad fusion on against off: the
    largest relative difference over parameters. ``fused``/``fused_layers``: the compiled regions
    (small, or the layer's two with the linears inside)."""
    parallel.init(1, 1)
    hf = tiny.hf_model()
    out, calls = {}, []
    real = layers.accumulate_wgrad

    def counted(*args):
        calls.append(1)
        return real(*args)

    for mode in ("0", "1"):
        os.environ.update({layers.WGRAD_ENV: mode, layers.FUSED_LAYERS_ENV: fused_layers})
        layers.accumulate_wgrad = counted
        calls.clear()
        try:
            with torch.device(device):
                model = ParallelLlamaForCausalLM(tiny.our_config(hf), ParallelLayout(), dtype=dtype, fused=fused)
            model.load_hf_state_dict(hf.state_dict())
            grads = optim.GradBuffer(model)
            for side, lengths in (("left", (7, 12, 3)), ("right", (5, 9, 16, 2))):
                ids, mask, pos = (t.to(device) for t in tiny.batch(side, lengths=lengths))
                _loss(model, ids, mask, pos)
        finally:
            layers.accumulate_wgrad = real
            os.environ.pop(layers.WGRAD_ENV)
            os.environ.pop(layers.FUSED_LAYERS_ENV)
        assert all(p.grad is None for p in grads.params)
        # fused: 4 linears a layer and the head, per micro-batch, through accumulate_wgrad
        assert len(calls) == (2 * (4 * model.cfg.num_layers + 1) if mode == "1" else 0), (mode, len(calls))
        out[mode] = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    a, b = out["0"], out["1"]
    assert all(a[n].abs().max() > 0 for n in a)  # every parameter got its gradient either way
    return max(((a[n] - b[n]).norm() / a[n].norm()).item() for n in a)


def test_grad_buffer_with_wgrad_fusion_matches_the_hook_path():
    # The same bf16 forward and input gradients; only the weights' gradients are rounded to bf16
    # (unfused) or not (fused) before the fp32 sum: a difference of bf16's rounding, no more.
    assert grad_buffer_fused_vs_hook() < 1e-2


def test_embedding_adds_its_tokens_rows_into_main_grad(monkeypatch):
    # With the fusion on, the embedding's backward adds each token's gradient, in fp32, into its
    # row of main_grad (a repeated token's summed) and writes no dense .grad: the rows no token
    # touches keep what they held.
    monkeypatch.setenv(layers.WGRAD_ENV, "1")
    emb = layers.VocabParallelEmbedding(10, 4, tp_group=None, sequence_parallel=False, dtype=torch.bfloat16)
    torch.nn.init.normal_(emb.weight)
    emb.weight.main_grad = torch.ones(10, 4)
    ids = torch.tensor([[1, 3, 1], [7, 1, 0]])
    dy = torch.randn(2, 3, 4, dtype=torch.bfloat16)
    out = emb(ids)
    assert torch.equal(out, emb.weight.detach()[ids])
    out.backward(dy)
    assert emb.weight.grad is None
    expected = torch.ones(10, 4).index_add_(0, ids.flatten(), dy.reshape(-1, 4).float())
    torch.testing.assert_close(emb.weight.main_grad, expected, rtol=0, atol=1e-6)


def embedding_grad_fused_vs_hook(tp=1, pp=1, sp=False, tie=False, fused=False) -> dict[str, float]:
    """A bf16 model's ``main_grad`` (GradBuffer's, reduced as a step reduces it) after two
    micro-batches through the pipeline schedule, the gradient fusion on against off: per parameter
    the relative difference. The embedding's rows are split over TP (each rank masks the ids
    outside its slice), its output scattered over tokens under SP, its weight shared with the head
    at PP 1 or its copy's gradient summed over the first and last stage at PP 2 (``tie``)."""
    from llamarl.lib.model import schedule

    parallel.init(tp, pp)
    hf = tiny.hf_model(num_hidden_layers=2 * pp, tie_word_embeddings=tie)
    out = {}
    for mode in ("0", "1"):
        os.environ[layers.WGRAD_ENV] = mode
        try:
            model = ParallelLlamaForCausalLM(tiny.our_config(hf), ParallelLayout(tp=tp, pp=pp, sequence_parallel=sp),
                                             dtype=torch.bfloat16, fused=fused)
            model.load_hf_state_dict(hf.state_dict())
            grads = optim.GradBuffer(model)
            batches, labels = [], []
            for i, side in enumerate(("left", "right")):
                ids, mask, pos = tiny.batch(side, seed=i, lengths=(7, 12, 3) if i else (5, 9, 16, 2))
                batches.append(model.make_batch(ids, mask, pos))
                labels.append(batches[-1].flat(torch.roll(ids, -1, 1)))
            schedule.forward_backward(model, batches, lambda lg, lb: vocab_parallel.log_probs(lg, lb).sum(), labels)
            grads.reduce()
        finally:
            os.environ.pop(layers.WGRAD_ENV)
        assert all(p.grad is None for p in grads.params if p.dtype != torch.float32)
        out[mode] = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    parallel.destroy_model_parallel()
    a, b = out["0"], out["1"]
    assert all(a[n].abs().max() > 0 for n in a)
    return {n: ((a[n] - b[n]).norm() / a[n].norm()).item() for n in a}


@pytest.mark.parametrize("tie", [False, True])
def test_embedding_grad_fusion_matches_the_hook_path(tie):
    # TP 1, the embedding alone or tied to the head: its own rows and the head's GEMM both add
    # into the one main_grad, each once.
    errs = embedding_grad_fused_vs_hook(tie=tie)
    assert max(errs.values()) < 1e-2, errs


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True])
def test_embedding_grad_fusion_matches_the_hook_path_tp2(pool2, sp):
    # Vocab-parallel rows (ids outside a rank's slice add nothing, not even into row 0), under SP
    # the embedding's output scattered over tokens, tied to the head.
    for errs in pool2.run(embedding_grad_fused_vs_hook, 2, 1, sp, True):
        assert max(errs.values()) < 1e-2, errs


@pytest.mark.slow
def test_embedding_grad_fusion_matches_the_hook_path_pp2_tied(pool2):
    # PP 2 with tied embeddings: the first stage's embedding and the last stage's head copy each
    # add into their own main_grad, summed over the embedding group by GradBuffer.reduce.
    for errs in pool2.run(embedding_grad_fused_vs_hook, 1, 2, False, True):
        assert max(errs.values()) < 1e-2, errs


def test_wgrad_fusion_inside_the_fused_layer_regions():
    # LLAMARL_FUSED_LAYERS=1 with LLAMARL_FUSED_WGRAD=1: the linears inside the compiled regions
    # add into main_grad in their backward (lib.layers._RegionLinear, traced into the region; its
    # backward op llamarl::linear_grad_into_main_backward writes into main_grad's memory).
    assert grad_buffer_fused_vs_hook(fused=True, fused_layers="1") < 1e-2


_REGIONS_ONCE = """
import json, torch, tiny
from torch._dynamo.utils import counters
from llamarl.lib.distributed import parallel
from llamarl.lib.model.llama import ParallelLlamaForCausalLM
from llamarl.lib.model.config import ParallelLayout
from llamarl.lib.rl import optim
parallel.init(1, 1)
hf = tiny.hf_model()
model = ParallelLlamaForCausalLM(tiny.our_config(hf), ParallelLayout(), dtype=torch.bfloat16, fused=True)
optim.GradBuffer(model)
ids, mask, pos = tiny.batch("right", seed=0, lengths=(5, 9, 3))
model(model.make_batch(ids, mask, pos)).float().sum().backward()
print(json.dumps(dict(counters["aot_autograd"])))
"""


@pytest.mark.slow
def test_the_fused_layer_regions_are_cached_across_processes(tmp_path):
    # The regions with the gradient fusion inside trace an autograd.Function (_RegionLinear), which
    # AOTAutograd's cache refuses unless told (compiled_region tells it): their graphs are saved,
    # so the next process loads them instead of tracing them again.
    import json
    import subprocess
    import sys

    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(tmp_path), "LLAMARL_FUSED": "1", layers.WGRAD_ENV: "1",
           layers.FUSED_LAYERS_ENV: "1", "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([sys.executable, "-c", _REGIONS_ONCE], env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    counts = json.loads(out.stdout.strip().splitlines()[-1])
    assert not counts.get("autograd_cache_bypass") and counts.get("autograd_cache_saved", 0) >= 2, counts


def wgrad_fusion_under_1f1b(micro_batches=4) -> float:
    """PP 2, fused layers: main_grad with wgrad fusion against the hook path after a 1F1B pass (a
    micro-batch's backward runs between the next one's forward and backward)."""
    from llamarl.lib.model import schedule

    parallel.init(1, 2)
    hf = tiny.hf_model(num_hidden_layers=4)
    out = {}
    for mode in ("0", "1"):
        os.environ.update({layers.WGRAD_ENV: mode, layers.FUSED_LAYERS_ENV: "1"})
        try:
            model = ParallelLlamaForCausalLM(tiny.our_config(hf), ParallelLayout(pp=2), dtype=torch.bfloat16,
                                             fused=True)
            model.load_hf_state_dict(hf.state_dict())
            optim.GradBuffer(model)
            batches, labels = [], []
            for i in range(micro_batches):
                ids, mask, pos = tiny.batch("right", seed=i, lengths=(5 + i, 9, 3))
                batches.append(model.make_batch(ids, mask, pos))
                labels.append(batches[-1].flat(torch.roll(ids, -1, 1)))
            schedule.forward_backward(model, batches, lambda lg, lb: vocab_parallel.log_probs(lg, lb).sum(), labels)
        finally:
            os.environ.pop(layers.WGRAD_ENV)
            os.environ.pop(layers.FUSED_LAYERS_ENV)
        out[mode] = {n: p.main_grad.clone() for n, p in model.named_parameters()}
    parallel.destroy_model_parallel()
    a, b = out["0"], out["1"]
    return max(((a[n] - b[n]).norm() / a[n].norm()).item() for n in a)


@pytest.mark.slow
def test_wgrad_fusion_in_fused_layers_under_1f1b(pool2):
    # main_grad is saved for backward by the compiled regions: writes into it between a forward
    # and its backward (another micro-batch's) must not trip autograd's version check.
    for err in pool2.run(wgrad_fusion_under_1f1b):
        assert err < 2e-2, err  # four micro-batches of bf16-rounded gradients on the hook path


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_wgrad_fusion_on_cuda():
    # torch's addmm(out_dtype=float32) into main_grad: as exact as the fp32 upcast (fp32
    # accumulation of the bf16 products), and the model-level sum as the hook's.
    assert layers._fp32_addmm_works(torch.cuda.current_device())
    fused = _linear_wgrad_errors("cuda", True, n=4096, d_in=512, d_out=768)
    unfused = _linear_wgrad_errors("cuda", False, n=4096, d_in=512, d_out=768)
    print({"fused": fused, "unfused": unfused})
    assert fused["main_grad"] < 1e-5 and unfused["main_grad"] > 1e-3, (fused, unfused)
    assert grad_buffer_fused_vs_hook("cuda") < 1e-2
    assert grad_buffer_fused_vs_hook("cuda", fused=True, fused_layers="1") < 1e-2


# ---- equal-length packed sequences as one dense SDPA batch ---------------------------------------


def _attention_inputs(seqs, seqlen, device, dtype, heads=8, kv=2, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = seqs * seqlen
    q, k, v = (torch.randn(n, h, d, generator=g).to(device, dtype).requires_grad_() for h in (heads, kv, kv))
    cu = torch.arange(0, n + 1, seqlen, dtype=torch.int32, device=device)
    return q, k, v, cu


def _attend(q, k, v, cu, seqlen, backend):
    out = attention.varlen_attention(q, k, v, cu, seqlen, backend=backend)
    w = torch.linspace(-1, 1, out.numel(), device=out.device, dtype=out.dtype).view_as(out)
    (out * w).sum().backward()
    res = [out.detach().float()] + [t.grad.float() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    return res


def test_dense_attention_for_equal_lengths_matches_per_sequence():
    q, k, v, cu = _attention_inputs(4, 7, "cpu", torch.float32)
    assert attention.equal_lengths(q.shape[0], cu, 7)
    assert not attention.equal_lengths(27, torch.tensor([0, 7, 14, 20, 27]), 7)  # one of 6 tokens
    dense = _attend(q, k, v, cu, 7, "sdpa_dense")
    ref = _attend(q, k, v, cu, 7, "sdpa")
    for a, b in zip(dense, ref):
        assert (a - b).abs().max() < 1e-5


def test_dense_attention_only_for_several_sequences_and_a_bounded_set_of_shapes(monkeypatch):
    """cuDNN plans a new shape for ~0.1 s: single sequences (ragged micro-batches) go varlen, and
    past DENSE_SHAPES_MAX distinct shapes so does every new one; shapes seen keep the dense path.
    Chosen as for a CUDA device, from host numbers (runs on CPU)."""
    monkeypatch.setattr(attention, "_dense_shapes", set())
    monkeypatch.setattr(attention, "DENSE_SHAPES_MAX", 2)
    monkeypatch.setattr(attention, "varlen_backend", lambda device, dtype: "torch_varlen")

    def choose(seqs: int, length: int) -> str:
        cu = torch.arange(seqs + 1) * length
        return attention.attention_backend(torch.device("cuda"), torch.bfloat16, seqs * length, cu, length)

    assert choose(1, 2048) == "torch_varlen"  # one sequence: never a plan of its own
    assert choose(2, 2048) == "sdpa_dense" and choose(4, 384) == "sdpa_dense"
    assert choose(3, 100) == "torch_varlen"  # a third shape: over the bound
    assert choose(2, 2048) == "sdpa_dense"  # a shape seen keeps its plan
    ragged = torch.tensor([0, 7, 14, 20, 27])
    assert attention.attention_backend(torch.device("cuda"), torch.bfloat16, 27, ragged, 7) == "torch_varlen"


def test_direct_flash_falls_back_for_other_ops_not_for_out_of_memory(monkeypatch):
    # _direct_flash gives way to torch's varlen_attn, for the rest of the process, where this
    # torch's flash aten ops cannot be called as it calls them (here, on CPU: no kernel). An
    # out-of-memory error says nothing of that: it propagates, and the direct path stays (caught,
    # it would switch the process, a resident worker's later stages too, to the other kernels'
    # gradients for good, the retry allocating more). Runs the CUDA branch's logic on CPU.
    fallback = []
    monkeypatch.setattr(attention, "_torch_varlen", lambda: (lambda q, *a, **kw: fallback.append(1) or q, True))
    q, k, v, cu = _attention_inputs(2, 5, "cpu", torch.bfloat16)
    monkeypatch.setattr(attention, "_direct_flash_ok", True)
    with pytest.warns(UserWarning, match="varlen_attn from now on"):
        assert attention.varlen_attention(q, k, v, cu, 5, backend="torch_varlen") is q and fallback == [1]
    assert not attention._direct_flash_ok

    def out_of_memory(*args):
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    monkeypatch.setattr(attention, "_direct_flash_ok", True)
    monkeypatch.setattr(attention._FlashVarlen, "apply", out_of_memory)
    with pytest.raises(torch.OutOfMemoryError):
        attention.varlen_attention(q, k, v, cu, 5, backend="torch_varlen")
    assert attention._direct_flash_ok and fallback == [1]


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_dense_attention_on_cuda_as_close_to_fp32_as_varlen():
    # The 1B shape's heads (32 / 8, head_dim 64), 4 sequences of 512: the automatic choice (dense
    # SDPA, cuDNN on Hopper) against torch's varlen kernel, both in bf16, against fp32.
    q, k, v, cu = _attention_inputs(4, 512, "cuda", torch.float32, heads=32, kv=8, d=64)
    ref = _attend(q, k, v, cu, 512, "sdpa")
    qb, kb, vb = (t.detach().bfloat16().requires_grad_() for t in (q, k, v))
    errs = {}
    for backend in (None, "torch_varlen"):
        got = _attend(qb, kb, vb, cu, 512, backend)
        errs[backend or "auto"] = max(((a - b).norm() / b.norm()).item() for a, b in zip(got, ref))
    print(errs)
    assert errs["auto"] <= 1.5 * errs["torch_varlen"] + 1e-4, errs


# ---- Triton vocabulary kernels against the torch ops -------------------------------------------


def vocab_kernel_errors(tp, dtype=torch.float32, device="cpu", n=24, vocab=251, scale=3.0):
    """Max errors of the kernel functions against the torch ones at TP ``tp``, gradients included,
    with a padded vocabulary (padded columns at the dtype's minimum) and an out-of-range label."""
    parallel.init(tp, 1)
    g = torch.Generator().manual_seed(0)
    vp = pad_vocab(vocab, tp) + (tp if vocab % tp == 0 else 0)  # always some padding
    full = torch.randn(n, vocab, generator=g) * scale
    padded = torch.cat([full, full.new_full((n, vp - vocab), torch.finfo(dtype).min)], 1).to(dtype)
    per = vp // tp
    r = parallel.topology().tp_rank
    local = padded[:, r * per:(r + 1) * per].to(device)
    labels = torch.randint(0, vocab, (n,), generator=g)
    labels[1] = -100  # held by no rank
    labels = labels.to(device)
    w_lp, w_ent = (torch.randn(n, generator=g).to(device) * 3 for _ in range(2))
    errs = {}
    wanted = {"log_probs": (True, False), "entropy": (False, True), "both": (True, True)}
    group = parallel.tp_group()
    for name, (has_lp, has_ent) in wanted.items():
        outs, grads = [], []
        for fn in (vocab_parallel._Eager, vocab_parallel._Kernel):
            x = local.clone().requires_grad_()
            y = fn.apply(x, labels if has_lp else None, group, has_ent)
            y = y if isinstance(y, tuple) else (y,)
            loss = sum((t * w).sum() for t, w in zip(y, [w_lp] * has_lp + [w_ent] * has_ent))
            loss.backward()
            outs.append(torch.stack(y))
            grads.append(x.grad.float())
        (o_ref, o_k), (g_ref, g_k) = outs, grads
        assert torch.isfinite(g_k).all() and torch.isfinite(o_k).all(), name
        errs[f"{name}_value"] = (o_ref - o_k).abs().max().item()
        errs[f"{name}_grad"] = ((g_ref - g_k).norm() / g_ref.norm()).item()
        padded_cols = torch.arange(r * per, (r + 1) * per, device=device) >= vocab
        errs[f"{name}_grad_padding"] = g_k[:, padded_cols].abs().max().item() if padded_cols.any() else 0.0
    return errs


needs_triton = pytest.mark.skipif(not (CUDA or triton_available()),
                                  reason="Triton is not installed (the kernels' CPU check runs in its interpreter)")


@needs_triton
def test_vocab_kernels_match_torch():
    if CUDA:
        results = {d: [vocab_kernel_errors(1, d, "cuda")] for d in (torch.float32, torch.bfloat16)}
    else:
        with interpreter_pool(1) as pool:
            results = {d: pool.run(vocab_kernel_errors, 1, d) for d in (torch.float32, torch.bfloat16)}
    for dtype, per_rank in results.items():
        # bf16: the gradients are rounded to bf16 by both paths (a relative 2^-8 per element); the
        # interpreter rounds fp32 -> bf16 towards zero (a relative 2^-7), the GPU to nearest.
        tol = 1e-5 if dtype == torch.float32 else (4e-3 if CUDA else 1e-2)
        for errs in per_rank:
            assert all(v < (tol if k.endswith("grad") else 1e-5) for k, v in errs.items()), (dtype, errs)


@needs_triton
@pytest.mark.skipif(CUDA, reason="two ranks on one process group: the CPU (gloo) check")
def test_vocab_kernels_match_torch_tp2():
    with interpreter_pool(2) as pool:
        for errs in pool.run(vocab_kernel_errors, 2):
            assert max(errs.values()) < 1e-5, errs


# ---- on the GPU ----------------------------------------------------------------------------------


@pytest.mark.parametrize("n,vocab", [(64, 128256), (3, 50257)])
@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_vocab_kernels_on_cuda_llama_vocab(n, vocab):
    # The real shapes: many column blocks, a vocabulary no block size divides.
    errs = vocab_kernel_errors(1, torch.bfloat16, "cuda", n=n, vocab=vocab, scale=4.0)
    assert all(v < (4e-3 if k.endswith("grad") else 1e-4) for k, v in errs.items()), errs


def _errors_vs_fp32(fused: bool, fused_layers: str = "0"):
    """Relative errors of a bf16 CUDA model (fused or eager) against the fp32 CUDA eager model."""
    os.environ[layers.FUSED_LAYERS_ENV] = fused_layers
    try:
        return _errors_vs_fp32_in_env(fused)
    finally:
        os.environ.pop(layers.FUSED_LAYERS_ENV)


def _errors_vs_fp32_in_env(fused: bool):
    parallel.init(1, 1)
    hf = tiny.hf_model(hidden_size=256, intermediate_size=704, num_attention_heads=8, num_key_value_heads=2,
                       head_dim=32, vocab_size=1000)
    ids, mask, pos = (t.cuda() for t in tiny.batch("left", vocab=1000, lengths=(40, 77, 13, 64)))
    res = {}
    for name, dtype, f in (("fp32", torch.float32, False), ("bf16", torch.bfloat16, fused)):
        with torch.device("cuda"):
            model = ParallelLlamaForCausalLM(tiny.our_config(hf), ParallelLayout(), dtype=dtype, fused=f)
        model.load_hf_state_dict(hf.state_dict())
        res[name] = _loss(model, ids, mask, pos).float(), {n: p.grad.float() for n, p in model.named_parameters()}
    (l_ref, g_ref), (l, g) = res["fp32"], res["bf16"]
    return {"logits": ((l - l_ref).norm() / l_ref.norm()).item(),
            "grads": max(((g[n] - g_ref[n]).norm() / g_ref[n].norm()).item() for n in g_ref)}


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_fused_bf16_model_as_close_to_fp32_as_eager_bf16():
    """bf16 is not bit-exact either way (the regions round once, eager rounds after every op), so
    the fused model must be as close to fp32 as the eager bf16 model is: within 1.25x its error."""
    eager, fused, fused_layers = _errors_vs_fp32(False), _errors_vs_fp32(True), _errors_vs_fp32(True, "1")
    print({"eager": eager, "fused": fused, "fused_layers": fused_layers})
    for k in eager:
        assert fused[k] <= 1.25 * eager[k] + 1e-4, (k, eager, fused)
        assert fused_layers[k] <= 1.25 * eager[k] + 1e-4, (k, eager, fused_layers)
