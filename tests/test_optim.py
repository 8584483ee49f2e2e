"""The global gradient norm is the same at every layout (replicated pieces counted once)."""

from __future__ import annotations

import pytest
import torch

import tiny
from distpool import interpreter_pool, triton_available
from llamarl.lib.rl import optim
from llamarl.lib.distributed import parallel
from llamarl.lib.model import vocab_parallel
from llamarl.lib.model.config import ParallelLayout
from llamarl.lib.model.llama import ParallelLlamaForCausalLM


def grad_norm(tp: int, tied: bool) -> float:
    parallel.init(tp, 1)
    cfg = tiny.our_config(tiny.hf_model(tie_word_embeddings=tied))  # 4 heads, 2 kv heads
    model = ParallelLlamaForCausalLM(cfg, ParallelLayout(tp=tp))
    model.init_random(seed=3)
    grads = optim.GradBuffer(model)
    ids, mask, pos = tiny.batch("right")
    batch = model.make_batch(ids, mask, pos)
    labels = batch.flat(torch.roll(ids, -1, 1))
    vocab_parallel.log_probs(model(batch), labels).sum().backward()  # each DP rank: the same batch, no reduce
    norm = float(grads.clip(None))
    parallel.destroy_model_parallel()
    return norm


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_grad_norm_does_not_depend_on_tp_even_past_the_kv_heads(pool4, tied):
    tp1 = pool4.run(grad_norm, 1, tied)[0]
    for tp in (2, 4):  # tp 4 > 2 kv heads: each kv head lives on two ranks
        norms = pool4.run(grad_norm, tp, tied)
        assert max(abs(n - tp1) for n in norms) < 1e-5 * tp1, (tp, norms, tp1)


def clip_and_largest_master() -> dict:
    parallel.init(1, 1)
    model = ParallelLlamaForCausalLM(tiny.our_config(tiny.hf_model()), ParallelLayout())
    model.init_random(seed=3)
    grads = optim.GradBuffer(model)
    opt = optim.ShardedAdamW(model, lr=1e-3)
    torch.manual_seed(0)
    grads.buffer.normal_()
    before = grads.buffer.clone()
    norm = grads.clip(1e9)  # below the bound: the gradients stay as they are, bit for bit
    out = {"norm": norm, "unchanged": torch.equal(grads.buffer, before)}
    grads.clip(1.0)
    out["clipped"] = float(grads.clip(None))
    out["largest"] = float(opt.largest_master())
    out["true_largest"] = max(float(p.detach().abs().max()) for p in model.parameters())
    with torch.no_grad():
        next(model.parameters())[0, 0] = float("nan")  # fp32: the parameters are the masters
    out["nan"] = float(opt.largest_master())
    parallel.destroy_model_parallel()
    return out


def test_clip_reads_nothing_back_and_largest_master_sees_nan(pool1):
    (out,) = pool1.run(clip_and_largest_master)
    # The norm stays a device tensor (read with the step's checks, once); clipping scales to the bound.
    assert isinstance(out["norm"], torch.Tensor) and out["norm"].dtype == torch.float64 and out["unchanged"]
    assert abs(out["clipped"] - 1.0) < 1e-5
    assert out["largest"] == out["true_largest"] and out["nan"] != out["nan"]


# ---- the one-pass step (lib/rl/adamw_kernel.py): torch's AdamW, in Triton's interpreter on CPU ----


def one_pass_kernel_against_torch(device: str = "cpu") -> dict:
    """Three AdamW steps of a few tensors by the kernel and by torch's AdamW (the per-tensor loop;
    on CUDA the fused kernel), with weight decay and a clip factor; bf16 parameters written from
    the masters; then a NaN."""
    from llamarl.lib.rl import adamw_kernel

    torch.manual_seed(0)
    shapes = [(37, 5), (3001,), (7,), (1 << 14,)]  # the last over several of the kernel's blocks
    masters = [torch.randn(s, device=device) * 3 for s in shapes]
    ref = [m.clone().requires_grad_(True) for m in masters]
    kind = {"fused": True} if device == "cuda" else {"foreach": False}
    torch_opt = torch.optim.AdamW(ref, lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, **kind)
    avgs, sqs = [torch.zeros_like(m) for m in masters], [torch.zeros_like(m) for m in masters]
    # The third is its own master (an fp32 parameter).
    params = [None if i == 2 else torch.empty(s, dtype=torch.bfloat16, device=device) for i, s in enumerate(shapes)]
    largest, out = torch.zeros((), device=device), {"masters": [], "moments": []}
    for t in (1, 2, 3):
        grads = [torch.randn(s, device=device) for s in shapes]
        factor = torch.tensor(0.25 * t, device=device)
        for r, g in zip(ref, grads):
            r.grad = g * factor
        torch_opt.step()
        adamw_kernel.step(masters, grads, avgs, sqs, params, factor, largest, t, 1e-2, (0.9, 0.95), 1e-8, 0.1)
        # fp32 rounding of the same arithmetic (FMAs or not): a few units in the last place of the master.
        out["masters"].append(max(float(((m - r.detach()).abs() / (r.detach().abs() * 2 ** -23 + 1e-9)).max())
                                  for m, r in zip(masters, ref)))
        st = [torch_opt.state[r] for r in ref]
        out["moments"].append(max(float((a - s["exp_avg"]).abs().max() / s["exp_avg"].abs().max()) +
                                  float((q - s["exp_avg_sq"]).abs().max() / s["exp_avg_sq"].abs().max())
                                  for a, q, s in zip(avgs, sqs, st)))
    out["rounded"] = all(torch.equal(p, m.to(torch.bfloat16)) for p, m in zip(params, masters) if p is not None)
    out["largest"] = (float(largest), max(float(m.abs().max()) for m in masters))
    masters[2][3] = float("nan")
    adamw_kernel.step(masters, [torch.zeros(s, device=device) for s in shapes], avgs, sqs, params, None, largest, 4,
                      1e-2, (0.9, 0.95), 1e-8, 0.1)
    out["nan_largest"] = float(largest)
    return out


@pytest.mark.skipif(not triton_available(), reason="needs triton (a dev dependency) for its interpreter")
def test_the_one_pass_step_is_torchs_adamw_in_one_pass():
    with interpreter_pool(1) as pool:
        (out,) = pool.run(one_pass_kernel_against_torch)
    assert max(out["masters"]) <= 8 and max(out["moments"]) < 1e-6, out
    assert out["rounded"], "bf16 parameters are the masters rounded to nearest even, as torch's copy_ rounds"
    assert out["largest"][0] == out["largest"][1] and out["nan_largest"] == float("inf"), out


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_one_pass_step_is_torchs_fused_adamw_on_cuda():
    out = one_pass_kernel_against_torch("cuda")
    assert max(out["masters"]) <= 8 and max(out["moments"]) < 1e-6, out
    assert out["rounded"] and out["largest"][0] == out["largest"][1] and out["nan_largest"] == float("inf"), out


def ppo_update_one_pass(one_pass: bool, root: str) -> dict:
    """At DP 2, bf16 weights: two clipped optimizer steps from the same weights and gradients, the
    state saved, a new optimizer resumed from it for a third step; the weights after each."""
    import os

    from llamarl.lib.rl import adamw_kernel
    from llamarl.lib.files import checkpoint

    os.environ[adamw_kernel.ENV] = "1" if one_pass else "0"
    topo = parallel.init(1, 1, dp=2)
    cfg = tiny.our_config(tiny.hf_model())
    model = ParallelLlamaForCausalLM(cfg, ParallelLayout(), dtype=torch.bfloat16)
    model.init_random(seed=3)
    grads = optim.GradBuffer(model)
    opt = optim.ShardedAdamW(model, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    opt.load_state(None, 0)
    out = {"one_pass": opt.one_pass, "weights": []}
    g = torch.Generator().manual_seed(7)  # the same gradients on every rank and in both runs
    for _ in range(2):
        grads.buffer.copy_(torch.randn(grads.buffer.shape, generator=g))
        norm, factor = grads.clip_factor(1.0)
        opt.step(factor)
        out["weights"].append(torch.cat([p.detach().float().flatten() for p in model.parameters()]))
    out["largest"] = float(opt.largest_master())
    checkpoint.save(opt.state(), f"{root}/optim")
    resumed = optim.ShardedAdamW(model, lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    resumed.load_state(f"{root}/optim", 2)
    grads.buffer.copy_(torch.randn(grads.buffer.shape, generator=g))
    resumed.step(grads.clip_factor(1.0)[1])
    out["weights"].append(torch.cat([p.detach().float().flatten() for p in model.parameters()]))
    out["rank"] = topo.dp_rank
    parallel.destroy_model_parallel()
    return out


@pytest.mark.slow
@pytest.mark.skipif(not triton_available(), reason="needs triton (a dev dependency) for its interpreter")
def test_a_zero1_update_with_the_one_pass_step_matches_torchs_and_resumes(tmp_path):
    with interpreter_pool(2) as pool:
        fused = pool.run(ppo_update_one_pass, True, str(tmp_path / "fused"))
        plain = pool.run(ppo_update_one_pass, False, str(tmp_path / "plain"))
    assert [o["one_pass"] for o in fused] == [True, True] and [o["one_pass"] for o in plain] == [False, False]
    for f, p in zip(fused, plain):
        for step, (a, b) in enumerate(zip(f["weights"], p["weights"])):
            # bf16 weights from fp32 masters that agree to rounding: at most one bf16 step apart.
            assert ((a - b).abs() <= 2 ** -7 * b.abs().clamp(min=1e-2)).all(), step
            assert (a != b).float().mean() < 1e-3, step
    assert fused[0]["weights"][-1].equal(fused[1]["weights"][-1])  # every DP rank holds every parameter
    assert abs(fused[0]["largest"] - plain[0]["largest"]) <= 1e-6 * plain[0]["largest"]


def test_the_one_pass_step_is_cudas_default_and_the_interpreters_only_when_asked(monkeypatch):
    from llamarl.lib.rl import adamw_kernel

    monkeypatch.setattr(adamw_kernel, "_kernel", lambda: object())  # as if Triton imported
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv(adamw_kernel.ENV, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert adamw_kernel.wanted(cuda) and not adamw_kernel.wanted(cpu)
    monkeypatch.setenv(adamw_kernel.ENV, "1")
    assert adamw_kernel.wanted(cpu)
    monkeypatch.setenv(adamw_kernel.ENV, "0")
    assert not adamw_kernel.wanted(cuda) and not adamw_kernel.wanted(cpu)
    monkeypatch.setattr(adamw_kernel, "_kernel", lambda: None)  # no Triton: torch's step
    monkeypatch.delenv(adamw_kernel.ENV)
    assert not adamw_kernel.wanted(cuda)
    monkeypatch.setenv(adamw_kernel.ENV, "yes")
    with pytest.raises(ValueError, match="LLAMARL_FUSED_ADAMW='yes': use 0 or 1"):
        adamw_kernel.wanted(cuda)
