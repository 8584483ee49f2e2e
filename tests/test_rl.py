"""PPO arithmetic against hand-computed cases, masking edge cases included."""

from __future__ import annotations

import math

import pytest
import torch

from llamarl.lib import rl


def t(*rows):
    return torch.tensor(rows, dtype=torch.float32)


def test_kl_estimators():
    logp, ref = t([-1.0, -2.0]), t([-1.5, -1.0])
    # log r = logp - ref = [0.5, -1.0]
    assert torch.allclose(rl.kl_estimate(logp, ref, "kl"), t([0.5, -1.0]))
    assert torch.allclose(rl.kl_estimate(logp, ref, "abs"), t([0.5, 1.0]))
    assert torch.allclose(rl.kl_estimate(logp, ref, "mse"), t([0.125, 0.5]))
    # k3 with r' = exp(ref - logp): [e^-0.5 + 0.5 - 1, e^1 - 1 - 1]
    expected = t([math.exp(-0.5) + 0.5 - 1, math.e - 2])
    assert torch.allclose(rl.kl_estimate(logp, ref, "low_var_kl"), expected)
    assert (rl.kl_estimate(logp, ref, "low_var_kl") >= 0).all()
    with pytest.raises(ValueError, match="kl estimator 'bogus'"):
        rl.kl_estimate(logp, ref, "bogus")


def test_token_rewards_score_on_last_real_token_only():
    kl = t([0.1, 0.2, 0.3, 0.4], [0.5, 0.5, 0.5, 0.5])
    mask = t([1, 1, 1, 0], [0, 1, 1, 0])  # row 2: response starts late (label space), padded end
    r = rl.token_rewards(torch.tensor([2.0, -1.0]), kl, mask, beta=0.1)
    assert torch.allclose(r, t([-0.01, -0.02, -0.03 + 2.0, 0.0], [0.0, -0.05, -0.05 - 1.0, 0.0]))


def test_gae_hand_computed():
    # One sequence of 3 tokens, gamma 0.9, lambda 0.8; values 0.5, 0.4, 0.3; reward 1 at the end.
    rewards, values, mask = t([0.0, 0.0, 1.0]), t([0.5, 0.4, 0.3]), t([1, 1, 1])
    adv, ret = rl.gae(rewards, values, mask, gamma=0.9, lam=0.8)
    d2 = 1.0 - 0.3
    d1 = 0.0 + 0.9 * 0.3 - 0.4
    d0 = 0.0 + 0.9 * 0.4 - 0.5
    a2 = d2
    a1 = d1 + 0.72 * a2
    a0 = d0 + 0.72 * a1
    assert torch.allclose(adv, t([a0, a1, a2]), atol=1e-6)
    assert torch.allclose(ret, adv + values)


def test_gae_ignores_padding_and_prompt_positions():
    rewards = t([0.0, 0.0, 1.0, 0.0, 0.0])
    values = t([9.0, 0.5, 0.3, 7.0, 7.0])  # garbage outside the mask must not leak in
    mask = t([0, 1, 1, 0, 0])
    adv, ret = rl.gae(rewards, values, mask, gamma=1.0, lam=1.0)
    assert adv[0, 0] == 0 and adv[0, 3] == 0 and adv[0, 4] == 0 and ret[0, 3] == 0
    # terminal at position 2: a2 = 1 - 0.3; a1 = (0 + 0.3 - 0.5) + a2
    assert torch.allclose(adv[0, 1:3], torch.tensor([0.5, 0.7]))


def test_whiten_uses_only_masked_entries():
    x, mask = t([1.0, 2.0, 3.0, 100.0]), t([1, 1, 1, 0])
    w = rl.whiten(x, mask)
    assert torch.allclose(w[0, :3], (t([1.0, 2.0, 3.0])[0] - 2) / math.sqrt(2 / 3), atol=1e-5)
    assert w[0, 3] == 0


def test_grpo_normalizes_within_groups():
    scores = torch.tensor([1.0, 3.0, 5.0, 5.0])
    mask = torch.ones(4, 2)
    adv = rl.grpo_advantages(scores, ["a", "a", "b", "b"], mask)
    std_a = torch.tensor([1.0, 3.0]).std()
    assert torch.allclose(adv[:2, 0], torch.tensor([-1.0, 1.0]) / (std_a + 1e-6))
    assert torch.allclose(adv[2:], torch.zeros(2, 2))  # equal scores: no signal
    single = rl.grpo_advantages(torch.tensor([4.0]), ["x"], torch.ones(1, 3))
    assert torch.equal(single, torch.zeros(1, 3))


def test_policy_loss_clip_and_dual_clip():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.5, 0.5, 5.0, 1.0]))  # ratios 1.5, 0.5, 5.0, 1.0
    adv = torch.tensor([1.0, -1.0, -1.0, 2.0])
    loss, clipped, approx_kl = rl.policy_loss(logp, old, adv, clip_eps=0.2, dual_clip=3.0)
    # r=1.5, A=1: max(-1.5, -1.2) = -1.2 (clipped); r=0.5, A=-1: max(0.5, 0.8) = 0.8 (clipped)
    # r=5, A=-1: max(5, 1.2) = 5, dual clip min(5, 3) = 3; r=1, A=2: -2
    assert torch.allclose(loss, torch.tensor([-1.2, 0.8, 3.0, -2.0]))
    assert clipped.tolist() == [1.0, 1.0, 0.0, 0.0]
    assert torch.allclose(approx_kl, -logp)
    no_dual, _, _ = rl.policy_loss(logp, old, adv, clip_eps=0.2, dual_clip=None)
    assert no_dual[2] == pytest.approx(5.0)


def test_value_loss_clipped():
    v, old, ret = torch.tensor([1.0, 0.0]), torch.tensor([0.5, 0.5]), torch.tensor([1.0, 1.0])
    loss = rl.value_loss(v, old, ret, clip=0.2)
    # v=1: clipped 0.7 -> max(0, 0.09) / 2; v=0: clipped 0.3 -> max(1, 0.49) / 2
    assert torch.allclose(loss, torch.tensor([0.045, 0.5]))
    assert torch.allclose(rl.value_loss(v, old, ret, clip=None), torch.tensor([0.0, 0.5]))


def test_aggregation_modes_over_micro_batches():
    loss = t([1.0, 2.0, 0.0], [4.0, 0.0, 0.0])
    mask = t([1, 1, 0], [1, 0, 0])
    # token-mean over the whole mini-batch of 3 tokens, computed in two micro-batches
    parts = [rl.aggregate(loss[i : i + 1], mask[i : i + 1], "token-mean", 3.0) for i in range(2)]
    assert torch.allclose(sum(parts), torch.tensor(7.0 / 3))
    # seq-mean-token-mean: mean(1.5, 4) = 2.75
    parts = [rl.aggregate(loss[i : i + 1], mask[i : i + 1], "seq-mean-token-mean", 2.0) for i in range(2)]
    assert torch.allclose(sum(parts), torch.tensor(2.75))
    # a sequence with no response tokens contributes nothing
    assert rl.aggregate(t([5.0, 5.0]), t([0, 0]), "seq-mean-token-mean", 1.0) == 0


def test_aggregation_of_packed_tokens_as_ppo_calls_it():
    # ppo aggregates the model's packed tokens (padding removed, sequences end to end), telling
    # sequences apart by their sequence_index packed alike: the same means as over padded rows.
    loss = t([1.0, 2.0, 9.0], [4.0, 9.0, 9.0], [9.0, 5.0, 7.0])
    mask = t([1, 1, 0], [1, 0, 0], [0, 1, 1])  # response tokens; the 9s are prompt or padding
    real = torch.tensor([[1, 1, 1], [1, 1, 0], [1, 1, 1]]).bool()  # what the model sees
    seq = rl.sequence_index(mask)
    assert seq.tolist() == [[0, 0, -1], [1, -1, -1], [-1, 2, 2]]
    packed = {"loss": loss[real], "mask": mask[real], "seq": seq[real]}
    token_mean = rl.aggregate(packed["loss"], packed["mask"], "token-mean", 5.0, seq=packed["seq"], sequences=3)
    assert torch.allclose(token_mean, torch.tensor((1 + 2 + 4 + 5 + 7) / 5))
    seq_mean = rl.aggregate(packed["loss"], packed["mask"], "seq-mean-token-mean", 3.0, seq=packed["seq"], sequences=3)
    assert torch.allclose(seq_mean, torch.tensor((1.5 + 4 + 6) / 3))
    for mode, denominator in (("token-mean", 5.0), ("seq-mean-token-mean", 3.0)):
        padded = rl.aggregate(loss, mask, mode, denominator)
        assert torch.allclose(padded, rl.aggregate(packed["loss"], packed["mask"], mode, denominator, seq=packed["seq"],
                                                   sequences=3))
    with pytest.raises(ValueError, match="needs their number of sequences"):
        rl.aggregate(packed["loss"], packed["mask"], "seq-mean-token-mean", 3.0, seq=packed["seq"])
    with pytest.raises(ValueError, match="loss aggregation 'sum'"):
        rl.aggregate(loss, mask, "sum", 1.0)


def test_aggregation_reads_nothing_back_from_the_device():
    # ppo aggregates every micro-batch: a value read back to the host there (.item(), int(), a
    # tensor's truth, a boolean mask's count) would stall the GPU each time. On CPU the reads show
    # as the operators that make them.
    from torch.utils._python_dispatch import TorchDispatchMode

    aten = torch.ops.aten
    reads = (aten._local_scalar_dense.default, aten.nonzero.default, aten.masked_select.default, aten.is_nonzero.default)

    class Reads(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.seen = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            boolean_index = func is aten.index.Tensor and any(i is not None and i.dtype == torch.bool for i in args[1])
            if func in reads or boolean_index:
                self.seen.append(str(func))
            return func(*args, **(kwargs or {}))

    loss = t([1.0, 2.0, 9.0], [4.0, 9.0, 9.0], [9.0, 5.0, 7.0]).requires_grad_()
    mask = t([1, 1, 0], [1, 0, 0], [0, 1, 1])
    seq = rl.sequence_index(mask)
    with Reads() as mode:
        out = rl.aggregate(loss.flatten(), mask.flatten(), "seq-mean-token-mean", 3.0, seq=seq.flatten(), sequences=3)
        out.backward()
    assert mode.seen == [], mode.seen
    assert torch.allclose(out, torch.tensor((1.5 + 4 + 6) / 3))


# ---- estimators: Dr. GRPO, RLOO, REINFORCE++ ------------------------------------------------------------


def test_grpo_without_std_is_dr_grpo():
    scores = torch.tensor([1.0, 3.0, 5.0, 5.0, 4.0])
    adv = rl.grpo_advantages(scores, ["a", "a", "b", "b", "c"], torch.ones(5, 2), norm_by_std=False)
    # score minus its group's mean, not divided by std; a group of one sample has no baseline
    assert torch.equal(adv, t([-1.0, -1.0], [1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [0.0, 0.0]))


def test_group_baselines_mean_and_leave_one_out():
    scores = torch.tensor([1.0, 2.0, 6.0, 4.0])
    groups = ["a", "a", "a", "b"]
    assert torch.allclose(rl.group_baseline(scores, groups, "mean"), torch.tensor([3.0, 3.0, 3.0, 4.0]))
    # RLOO: the mean of the other samples, (2+6)/2, (1+6)/2, (1+2)/2; alone: itself (advantage 0)
    loo = rl.group_baseline(scores, groups, "loo")
    assert torch.allclose(loo, torch.tensor([4.0, 3.5, 1.5, 4.0]))
    # the known identity: s − loo = n/(n−1)·(s − mean)
    assert torch.allclose((scores - loo)[:3], 1.5 * (scores[:3] - 3.0))
    with pytest.raises(ValueError, match="group baseline 'median'"):
        rl.group_baseline(scores, groups, "median")


def test_returns_to_go_hand_computed():
    rewards = t([0.1, 0.2, 1.0, 9.0], [9.0, 0.5, -1.0, 9.0])
    mask = t([1, 1, 1, 0], [0, 1, 1, 0])  # row 2 starts late (label space); 9s are outside the responses
    g = rl.returns_to_go(rewards, mask, gamma=0.5)
    # row 1: G2 = 1, G1 = 0.2 + 0.5·1, G0 = 0.1 + 0.5·0.7; row 2: G2 = −1, G1 = 0.5 − 0.5
    assert torch.allclose(g, t([0.45, 0.7, 1.0, 0.0], [0.0, 0.0, -1.0, 0.0]))
    # the same as GAE with no critic and λ = 1
    assert torch.allclose(g, rl.gae(rewards * mask, torch.zeros_like(rewards), mask, gamma=0.5, lam=1.0)[0])


def test_equal_score_groups():
    groups = ["a", "a", "b", "b", "c", "c", "d"]
    assert rl.equal_score_groups([1.0, 1.0, 2.0, 3.0, 5.0, 5.0, 7.0], groups) == {"a", "c", "d"}


# ---- clip-higher and truncated importance sampling ----------------------------------------------------


def test_policy_loss_clip_higher():
    old = torch.zeros(4)
    logp = torch.log(torch.tensor([1.25, 1.5, 0.7, 0.7]))
    adv = torch.tensor([1.0, 1.0, -1.0, 1.0])
    loss, clipped, _ = rl.policy_loss(logp, old, adv, clip_eps=0.2, dual_clip=None, clip_eps_high=0.28)
    # r=1.25, A=1: within 1.28, −1.25; r=1.5: clipped at 1.28; r=0.7, A=−1: max(0.7, 0.8) = 0.8
    # (the low bound stays 0.8); r=0.7, A=1: max(−0.7, −0.8) = −0.7, not clipped
    assert torch.allclose(loss, torch.tensor([-1.25, -1.28, 0.8, -0.7]))
    assert clipped.tolist() == [0.0, 1.0, 1.0, 0.0]
    symmetric, _, _ = rl.policy_loss(logp, old, adv, clip_eps=0.2, dual_clip=None)
    assert torch.allclose(symmetric, torch.tensor([-1.2, -1.2, 0.8, -0.7]))


def test_tis_weights_hand_computed():
    old, rollout = torch.tensor([-1.0, -1.0, -2.0]), torch.tensor([-1.0, -2.0, -1.0])
    w, cut = rl.tis_weights(old, rollout, cap=2.0)
    # π_old/π_rollout = 1, e (truncated to 2), 1/e
    assert torch.allclose(w, torch.tensor([1.0, 2.0, math.exp(-1)]))
    assert cut.tolist() == [0.0, 1.0, 0.0]


def test_tis_with_equal_logprobs_is_exactly_the_unweighted_loss():
    g = torch.Generator().manual_seed(0)
    logp, old, adv = (torch.randn(3, 7, generator=g) for _ in range(3))
    mask = (torch.rand(3, 7, generator=g) > 0.3).float()
    w, cut = rl.tis_weights(old, old.clone(), cap=1.0)
    assert torch.equal(w, torch.ones_like(w)) and not cut.any()
    pg, _, _ = rl.policy_loss(logp, old, adv, 0.2, 3.0, 0.28)
    for mode in ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"):
        assert torch.equal(rl.aggregate(pg * w, mask, mode, 11.0), rl.aggregate(pg, mask, mode, 11.0))


def test_aggregation_seq_mean_token_sum_norm():
    # Dr. GRPO: Σ loss / (sequences × a constant length), here 4 tokens per sequence, 2 sequences
    loss = t([1.0, 2.0, 0.0], [4.0, 0.0, 0.0])
    mask = t([1, 1, 0], [1, 0, 0])
    parts = [rl.aggregate(loss[i : i + 1], mask[i : i + 1], "seq-mean-token-sum-norm", 2 * 4.0) for i in range(2)]
    assert torch.allclose(sum(parts), torch.tensor(7.0 / 8))
    # packed alike
    seq = rl.sequence_index(mask)
    assert torch.allclose(rl.aggregate(loss.flatten(), mask.flatten(), "seq-mean-token-sum-norm", 8.0, seq=seq.flatten(),
                                       sequences=2), torch.tensor(7.0 / 8))
