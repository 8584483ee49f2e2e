"""The global gradient norm is the same at every layout (replicated pieces counted once)."""

from __future__ import annotations

import pytest
import torch

import tiny
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
