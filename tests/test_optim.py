"""The global gradient norm is the same at every layout (replicated pieces counted once)."""

from __future__ import annotations

import pytest
import torch

import tiny
from llamarl.lib import optim, parallel, vocab_parallel
from llamarl.lib.config import ParallelLayout
from llamarl.lib.model import ParallelLlamaForCausalLM


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
    norm = grads.clip(None)
    parallel.destroy_model_parallel()
    return norm


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
def test_grad_norm_does_not_depend_on_tp_even_past_the_kv_heads(pool4, tied):
    tp1 = pool4.run(grad_norm, 1, tied)[0]
    for tp in (2, 4):  # tp 4 > 2 kv heads: each kv head lives on two ranks
        norms = pool4.run(grad_norm, tp, tied)
        assert max(abs(n - tp1) for n in norms) < 1e-5 * tp1, (tp, norms, tp1)
