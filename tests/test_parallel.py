"""Process groups and seeding."""

from __future__ import annotations

import torch

import tiny
from llamarl.lib import parallel
from llamarl.lib.config import ParallelLayout
from llamarl.lib.model import ParallelLlamaForCausalLM


def seeded_draws(tp):
    topo = parallel.init(tp, 1)
    gen = parallel.manual_seed(1234)
    return topo.tp_rank, torch.rand(3).tolist(), torch.rand(3, generator=gen).tolist()


def test_seeding_same_default_stream_distinct_tp_streams(pool2):
    (r0, shared0, own0), (r1, shared1, own1) = pool2.run(seeded_draws, 2)
    assert (r0, r1) == (0, 1)
    assert shared0 == shared1  # replicated work (sampling, replicated init) agrees across TP
    assert own0 != own1  # per-shard work (dropout on sharded activations) differs


def random_init_logits(tp, sp):
    parallel.init(tp, 1)
    cfg = tiny.our_config(tiny.hf_model())
    model = ParallelLlamaForCausalLM(cfg, ParallelLayout(tp=tp, sequence_parallel=sp))
    model.init_random(seed=7)
    ids, mask, pos = tiny.batch("left")
    with torch.no_grad():
        return tiny.gather_tp(model.run(ids, mask, pos))[mask.bool()][:, : cfg.vocab_size]


def test_random_init_does_not_depend_on_layout(pool2):
    tp1 = pool2.run(random_init_logits, 1, False)[0]
    tp2 = pool2.run(random_init_logits, 2, True)[0]
    assert tp1.abs().max() > 0.01
    assert (tp1 - tp2).abs().max() < 1e-5


def layout_mismatch():
    parallel.init(1, 1)
    try:
        ParallelLlamaForCausalLM(tiny.our_config(tiny.hf_model()), ParallelLayout(tp=2))
    except ValueError as e:
        return str(e)
    return None


def test_model_layout_must_match_process_groups(pool2):
    msg = pool2.run(layout_mismatch)[0]
    assert msg and "tp=2" in msg and "lib.parallel.init" in msg
