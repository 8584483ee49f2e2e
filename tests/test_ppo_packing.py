"""ppo's micro-batches: packed to a token budget (first-fit decreasing, or a balanced split into
fewer), and an update that does not depend on the packing."""

from __future__ import annotations

import random

import pytest
import torch

from llamarl.stages import ppo_data
from llamarl.stages.ppo_data import Sample, micro_batches, packing_stats


def _samples(lengths: list[int]) -> list[Sample]:
    return [Sample([5] * n, 1, [0.0] * (n - 1), 0.0, str(i)) for i, n in enumerate(lengths)]


def _ragged(n: int = 16, seq: int = 2048) -> list[int]:
    """bench/train_step.py's ppo-ragged lengths: n from seq/4 to 3·seq/4, shuffled."""
    lengths = [seq // 4 + round((seq // 2) * i / (n - 1)) for i in range(n)]
    return [lengths[i] for i in torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()]


def test_micro_batches_fill_the_budget_longest_first():
    samples = _samples([3, 9, 4, 12, 2, 7, 5])
    groups = micro_batches([0, 1, 2, 3, 4, 5, 6], samples, budget=12)
    # 12 alone; 9 then 3 (the first with room); 7, 5; 4, 2 — each listed in the given order.
    assert groups == [[3], [0, 1], [5, 6], [2, 4]]
    assert sorted(i for g in groups for i in g) == list(range(7))
    assert micro_batches([6, 5, 4, 3, 2, 1, 0], samples, 12) == [[3], [1, 0], [6, 5], [4, 2]]
    # A sequence longer than the budget is a micro-batch of its own; the rest still pack.
    assert micro_batches([0, 1, 2], _samples([20, 5, 6]), 12) == [[0], [1, 2]]


def test_ragged_batches_pack_into_fewer_fuller_micro_batches():
    samples = _samples(_ragged())  # 16384 tokens
    stats = packing_stats(micro_batches(list(range(16)), samples, 4096), samples, 4096)
    # First-fit decreasing leaves 5; the balanced split finds the exact fit into 4.
    assert stats["tokens"] == 16384 and stats["micro_batches"] == 4 and stats["budget_unused"] == 0
    # Equal lengths pack as before: two of 2048 a micro-batch.
    assert micro_batches(list(range(8)), _samples([2048] * 8), 4096) == [[0, 1], [2, 3], [4, 5], [6, 7]]


def test_a_balanced_split_is_taken_only_where_it_saves_micro_batches_within_the_budget():
    rng = random.Random(0)
    saved = 0
    for _ in range(400):
        lengths = [rng.randint(1, 60) for _ in range(rng.randint(1, 40))]
        budget = rng.randint(60, 130)
        samples = _samples(lengths)
        order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
        first_fit = ppo_data._first_fit(order, dict(enumerate(lengths)), budget)
        groups = micro_batches(list(range(len(lengths))), samples, budget)
        assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
        assert all(sum(lengths[i] for i in g) <= budget for g in groups)
        assert all(g == sorted(g) for g in groups)  # each in the given order
        assert -(-sum(lengths) // budget) <= len(groups) <= len(first_fit)
        if len(groups) == len(first_fit):
            assert groups == [sorted(g) for g in first_fit]  # nothing saved: first-fit's, unchanged
        saved += len(groups) < len(first_fit)
    assert saved, "no case where the balanced split saved a micro-batch: the test tests nothing"


def test_no_balanced_split_is_tried_beyond_its_host_budget(monkeypatch):
    # 16 ragged samples need 4 micro-batches where first-fit takes 5: past BALANCE_WORK, 5 stay.
    monkeypatch.setattr(ppo_data, "BALANCE_WORK", 16 * 5 - 1)
    samples = _samples(_ragged())
    assert len(micro_batches(list(range(16)), samples, 4096)) == 5


def _one_step(cfg_json: dict, lengths: list[int], budget: int) -> dict:
    """One ppo optimizer step of a tiny fp32 actor (TP1) on samples of ``lengths`` in micro-batches
    of ``budget`` tokens: the clipped gradient, the weights after the step, the metrics."""
    import tiny
    from llamarl.lib.distributed import parallel
    from llamarl.lib.model.config import ParallelLayout
    from llamarl.lib.model.llama import ParallelLlamaForCausalLM
    from llamarl.stages.config import PPOConfig
    from llamarl.stages.ppo_data import advantages
    from llamarl.stages.ppo_trainer import Trainer, train_step

    cfg = PPOConfig(**{**cfg_json, "micro_batch_tokens": budget})
    parallel.init(1, 1)
    hf = tiny.hf_model()
    model = ParallelLlamaForCausalLM(tiny.our_config(hf), ParallelLayout())
    model.load_hf_state_dict(hf.state_dict())
    g = torch.Generator().manual_seed(3)
    samples = []
    for i, n in enumerate(lengths):
        ids = torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist()
        prompt = 2 + i % 3
        samples.append(Sample(ids, prompt, (-2 * torch.rand(n - prompt, generator=g)).tolist(),
                              float(torch.rand((), generator=g)), str(i // 2)))
    ref = {i: [x - 0.05 * (1 + j % 3) for j, x in enumerate(s.rollout_logp)] for i, s in enumerate(samples)}
    data = advantages(cfg, samples, ref, None, "cpu")
    trainer = Trainer(model, cfg.actor_lr, cfg, None, None, 0)
    metrics = train_step(cfg, {"actor": trainer}, samples, data, list(range(len(samples))), 0, "cpu", 16).result()
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    out = {"grad": trainer.grads.buffer.clone(), "weights": weights, "metrics": metrics,
           "micro_batches": len(micro_batches(list(range(len(samples))), samples, budget))}
    parallel.destroy_model_parallel()
    return out


CASES = {
    "ppo-token-mean": dict(advantage="grpo", use_kl_loss=True, entropy_coef=0.01),
    "gspo-seq-mean": dict(advantage="grpo", policy_loss="gspo", clip_eps=3e-4, clip_eps_high=4e-4,
                          loss_agg="seq-mean-token-mean"),
    "cispo-sum-norm": dict(advantage="rloo", policy_loss="cispo", loss_agg="seq-mean-token-sum-norm", tis="on"),
}


@pytest.mark.parametrize("case", CASES)
def test_the_update_does_not_depend_on_the_packing(pool1, case):
    # The same mini-batch of ragged samples in one micro-batch, in many, and in one a sample: each
    # micro-batch's loss is its share of the mini-batch's (token weights are the mini-batch's), so
    # the gradient, the step and the metrics agree to fp32 rounding.
    lengths = [5, 17, 9, 30, 12, 7, 22, 14]
    cfg = dict(rollout="r", scores="s", actor="a", out="o", mini_batch_size=8, actor_lr=1e-3, kl_coef=0.1,
               grad_clip=None, dtype="fp32", **CASES[case])
    runs = [pool1.run(_one_step, cfg, lengths, budget)[0] for budget in (10_000, 40, 1)]
    assert [r["micro_batches"] for r in runs] == [1, 3, 8]
    one = runs[0]
    assert one["grad"].abs().max() > 0
    for other in runs[1:]:
        err = ((other["grad"] - one["grad"]).norm() / one["grad"].norm()).item()
        print(f"{case}, {other['micro_batches']} micro-batches against 1: gradient {err:.1e} apart, weights "
              f"{(other['weights'] - one['weights']).abs().max().item():.1e}")
        assert err < 1e-6, err
        # Adam's first step is lr·g/(|g| + eps): where |g| is near eps, rounding shows; elsewhere none.
        assert (other["weights"] - one["weights"]).abs().max() < 1e-3 * 1e-2
        for k in ("policy_loss", "entropy", "approx_kl", "clip_fraction", "actor_grad_norm"):
            assert other["metrics"][k] == pytest.approx(one["metrics"][k], rel=1e-6, abs=1e-9), k


def _two_steps(ahead: bool) -> dict:
    """Two ppo optimizer steps of a tiny fp32 actor, each step's micro-batches built one step ahead
    (as stages/ppo.py runs them) or when the step starts; the weights, metrics and builds."""
    import tiny
    from llamarl.lib.distributed import parallel
    from llamarl.lib.model.config import ParallelLayout
    from llamarl.lib.model.llama import ParallelLlamaForCausalLM
    from llamarl.stages.config import PPOConfig
    from llamarl.stages.ppo_data import advantages, mini_batch
    from llamarl.stages.ppo_batches import StepBatches
    from llamarl.stages.ppo_trainer import Trainer, train_step

    cfg = PPOConfig(rollout="r", scores="s", actor="a", out="o", advantage="grpo", use_kl_loss=True, kl_coef=0.1,
                    mini_batch_size=4, micro_batch_tokens=30, actor_lr=1e-3, dtype="fp32")
    parallel.init(1, 1)
    hf = tiny.hf_model()
    model = ParallelLlamaForCausalLM(tiny.our_config(hf), ParallelLayout())
    model.load_hf_state_dict(hf.state_dict())
    g = torch.Generator().manual_seed(4)
    samples = [Sample(torch.randint(3, hf.config.vocab_size, (n,), generator=g).tolist(), 2,
                      (-2 * torch.rand(n - 2, generator=g)).tolist(), float(i % 3), str(i // 2))
               for i, n in enumerate([5, 17, 9, 30, 12, 7, 22, 14])]
    data = advantages(cfg, samples, {i: s.rollout_logp for i, s in enumerate(samples)}, None, "cpu")
    trainer = Trainer(model, cfg.actor_lr, cfg, None, None, 0)
    batches, built = StepBatches(cfg, model, samples, data, "cpu"), []
    build = batches._build
    batches._build = lambda idx: built.append(idx) or build(idx)
    metrics = [train_step(cfg, {"actor": trainer}, samples, data, mini_batch(cfg, 8, k)[1], k, "cpu", None, None,
                          batches, mini_batch(cfg, 8, k + 1)[1] if ahead and k == 0 else None).result()
               for k in range(2)]
    weights = torch.cat([p.detach().flatten() for p in model.parameters()])
    parallel.destroy_model_parallel()
    return {"weights": weights, "metrics": metrics, "built": built, "steps": [mini_batch(cfg, 8, k)[1] for k in (0, 1)]}


def test_micro_batches_built_a_step_ahead_update_the_same(pool1):
    # stages/ppo.py builds step k+1's micro-batches before it waits for step k: the same update,
    # bit for bit, and each step's micro-batches built once.
    ahead, plain = pool1.run(_two_steps, True)[0], pool1.run(_two_steps, False)[0]
    assert torch.equal(ahead["weights"], plain["weights"]) and ahead["metrics"] == plain["metrics"]
    assert ahead["built"] == plain["built"] == ahead["steps"]


class _Builder:
    """What the micro-batch builders read of a model: its layout and its two batch makers."""

    from llamarl.lib.model.llama import ParallelLlama

    make_batch = ParallelLlama.make_batch
    make_batch_of_rows = ParallelLlama.make_batch_of_rows
    _token_multiple = ParallelLlama._token_multiple

    def __init__(self, **layout):
        from llamarl.lib.model.config import ParallelLayout

        self.layout = ParallelLayout(**layout)


def _padded_reference(model, samples, groups, data):
    """The micro-batches as the padded path builds them: ``padded_micro_batch``, then each data
    tensor's rows cut to the micro-batch's width and flattened in its token order."""
    from llamarl.stages.ppo_batches import padded_micro_batch

    out = []
    for g in groups:
        batch, per_token, width = padded_micro_batch(model, [samples[i] for i in g], "cpu")
        per_token.update({k: batch.flat(t[torch.tensor(g), :width]) for k, t in data.items()})
        out.append((batch, per_token))
    return out


@pytest.mark.parametrize("multiple", [1, 2, 3], ids=["tp1", "sp2", "sp3"])
def test_a_micro_batch_built_from_lengths_is_the_one_built_through_padding(multiple):
    from llamarl.stages.ppo_batches import step_batches

    g = torch.Generator().manual_seed(multiple)
    lengths = [int(x) for x in torch.randint(2, 40, (13,), generator=g)] + [40, 40]  # two as wide as their batch
    samples = [Sample(torch.randint(1, 500, (n,), generator=g).tolist(), int(torch.randint(1, n, (1,), generator=g)),
                      [], 0.0, str(i)) for i, n in enumerate(lengths)]
    data = {"adv": torch.randn(len(samples), 41, generator=g), "old_logp": torch.randn(len(samples), 41, generator=g),
            "values": torch.randn(len(samples), 43, generator=g)}  # another width: its own index
    groups = micro_batches(list(range(len(samples)))[::-1], samples, budget=64)
    assert any(max(len(samples[i].ids) for i in grp) == 40 and len(grp) > 1 for grp in groups)  # a full row wraps
    layout = {"tp": multiple, "sequence_parallel": multiple > 1}
    packed, extras = step_batches(_Builder(**layout), samples, groups, data, "cpu")
    reference = _padded_reference(_Builder(**layout), samples, groups, data)
    for batch, x, (ref, ref_x) in zip(packed, extras, reference, strict=True):
        for f in ("input_ids", "positions", "mask", "valid_index"):
            a, b = getattr(batch, f), getattr(ref, f)
            assert a.dtype == b.dtype and a.equal(b), f
        assert batch.meta.cu_seqlens.equal(ref.meta.cu_seqlens) and batch.meta.max_seqlen == ref.meta.max_seqlen
        assert batch.meta.cu_seqlens.dtype == torch.int32 and batch.num_real == ref.num_real
        assert (batch.num_tokens - batch.num_real < multiple) and batch.num_tokens % multiple == 0
        assert x.keys() == ref_x.keys()
        for k, v in ref_x.items():
            assert v == x[k] if k == "sequences" else (x[k].dtype == v.dtype and x[k].equal(v)), k


def test_the_one_copy_views_back_every_dtype_shape_and_empty_tensor():
    from llamarl.stages.ppo_batches import _one_copy

    tensors = [torch.arange(5, dtype=torch.int64), torch.tensor([[True, False, True]]), torch.zeros(0, dtype=torch.int64),
               torch.tensor([1, 2, 3], dtype=torch.int32), torch.tensor([0.5, -1.0], dtype=torch.float32),
               torch.arange(6, dtype=torch.int64).view(2, 3).t()]  # not contiguous
    for a, b in zip(_one_copy("cpu", tensors), tensors, strict=True):
        assert a.dtype == b.dtype and a.shape == b.shape and a.equal(b)
