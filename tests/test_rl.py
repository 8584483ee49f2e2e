"""PPO arithmetic against hand-computed cases, masking edge cases included."""

from __future__ import annotations

import math

import pytest
import torch

from llamarl.lib.rl import core as rl


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
    # Nor do the policy losses, GSPO's sequence ratio included.
    logp, old, adv = -loss.detach().flatten() / 10, -torch.ones(9), torch.ones(9)
    logp.requires_grad_()
    with Reads() as mode:
        for pg in (rl.gspo_loss(logp, old, adv, mask.flatten(), 0.2, None, seq.flatten(), 3)[0],
                   rl.cispo_loss(logp, old, adv, 2.0)[0], rl.sapo_loss(logp, old, adv, 1.0, 1.05)[0],
                   rl.policy_loss(logp, old, adv, 0.2, 3.0)[0]):
            pg.sum().backward()
    assert mode.seen == [], mode.seen


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


# ---- the policy losses: GSPO, CISPO, SAPO, and the sequence-level importance weights ---------------------
# One small batch for every loss: three responses (label space, right padding), their token log-probs
# now and at π_old, one advantage per response. Expected values are written from the papers' formulas
# in plain Python, never from lib/rl/core.py.

DELTAS = [[0.1, 0.3, 0.0], [-0.5, 0.2, 0.0], [0.0, 0.0, 0.0]]  # log π − log π_old per token (0 on padding)
MASK = [[1, 1, 0], [1, 1, 1], [1, 0, 0]]
ADV = [1.0, -1.0, 2.0]


def _batch():
    old = t([-1.0, -2.0, -0.5], [-1.5, -0.7, -3.0], [-0.2, -9.0, -9.0])
    logp = (old + t(*DELTAS)).requires_grad_()
    adv = torch.tensor(ADV)[:, None].expand(3, 3) * t(*MASK)
    return logp, old, adv, t(*MASK)


def _hand_aggregates(per_token: list[list[float]], norm: int = 4) -> dict[str, float]:
    """token-mean, seq-mean-token-mean and seq-mean-token-sum-norm of per-token values over MASK."""
    rows = [[v for v, m in zip(r, mr) if m] for r, mr in zip(per_token, MASK)]
    tokens = sum(len(r) for r in rows)
    return {"token-mean": sum(map(sum, rows)) / tokens,
            "seq-mean-token-mean": sum(sum(r) / len(r) for r in rows) / len(rows),
            "seq-mean-token-sum-norm": sum(map(sum, rows)) / (len(rows) * norm)}


def _check_aggregates(loss: torch.Tensor, mask: torch.Tensor, expected: list[list[float]]):
    hand = _hand_aggregates(expected)
    denominators = {"token-mean": float(mask.sum()), "seq-mean-token-mean": 3.0, "seq-mean-token-sum-norm": 12.0}
    for mode, value in hand.items():
        assert rl.aggregate(loss, mask, mode, denominators[mode]).item() == pytest.approx(value, rel=1e-6), mode


def test_gspo_hand_computed_with_each_aggregation():
    logp, old, adv, mask = _batch()
    loss, clipped, _ = rl.gspo_loss(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    # Sequence ratios: e^mean(0.1, 0.3) = e^0.2 = 1.2214 (A = 1, within 1 + 0.28: not clipped);
    # e^mean(−0.5, 0.2, 0) = e^−0.1 = 0.9048 (A = −1, within 0.8: not clipped); e^0 = 1 (A = 2).
    s = [math.exp(0.2), math.exp(-0.1), 1.0]
    expected = [[-s[0], -s[0], 0.0], [s[1], s[1], s[1]], [-2.0, 0.0, 0.0]]
    assert torch.allclose(loss * mask, t(*expected))
    assert not (clipped * mask).any()
    _check_aggregates(loss, mask, expected)
    # The clip acts on the sequence's ratio, for all its tokens: 1.2214 > 1 + 0.2.
    loss, clipped, _ = rl.gspo_loss(logp, old, adv, mask, clip_eps=0.2)
    assert torch.allclose(loss[0, :2], torch.tensor([-1.2, -1.2])) and clipped[0, :2].tolist() == [1.0, 1.0]


def test_gspo_gradient_is_the_sequence_ratios():
    # GSPO's gradient of −A·s_i with s_i = exp(mean_t (log π − log π_old)): every token of response i
    # gets −A·s_i·(1/|y_i|) through the mean; in the token form each token carries −A·s_i itself, and
    # seq-mean-token-mean divides by |y_i| — the same gradient. Clipped sequences get none.
    logp, old, adv, mask = _batch()
    loss, _, _ = rl.gspo_loss(logp, old, adv, mask, clip_eps=0.2, clip_eps_high=0.28)
    rl.aggregate(loss, mask, "seq-mean-token-mean", 3.0).backward()
    s = [math.exp(0.2), math.exp(-0.1), 1.0]
    lens = [2, 3, 1]
    expected = [[-ADV[i] * s[i] / lens[i] / 3 * m for m in MASK[i]] for i in range(3)]
    assert torch.allclose(logp.grad, t(*expected), atol=1e-7)


def test_gspo_sequence_ratio_does_not_depend_on_packing_or_grouping():
    # ppo computes the loss over packed tokens (padding removed, sequences end to end, an extra
    # sequence-parallel padding token), a micro-batch at a time: any grouping of whole sequences
    # gives each token the same loss and gradient as the padded batch at once.
    from llamarl.lib.model.batch import TokenBatch

    g = torch.Generator().manual_seed(3)
    lens = [(2, 5), (4, 1), (1, 3), (3, 6), (2, 2)]  # (prompt, response) tokens
    width = max(p + r for p, r in lens)
    mask = torch.zeros(len(lens), width)
    real = torch.zeros(len(lens), width, dtype=torch.long)
    for i, (p, r) in enumerate(lens):
        mask[i, p - 1 : p - 1 + r] = 1
        real[i, : p + r] = 1
    old = -torch.rand(len(lens), width, generator=g) * 3
    logp0 = old + torch.randn(len(lens), width, generator=g) * 0.1
    adv = torch.randn(len(lens), 1, generator=g).expand(-1, width) * mask

    def run(groups):
        logp = logp0.clone().requires_grad_()
        losses = torch.zeros(len(lens), width)
        for rows in groups:
            idx = torch.tensor(rows)
            batch = TokenBatch.from_padded(real[idx], real[idx], pad_to_multiple=4)
            flat = {k: batch.flat(v[idx]) for k, v in (("logp", logp), ("old", old), ("adv", adv), ("mask", mask))}
            seq = batch.flat(rl.sequence_index(mask[idx]))
            loss, _, _ = rl.gspo_loss(flat["logp"], flat["old"], flat["adv"], flat["mask"], 3e-4, 4e-4, seq, len(rows))
            rl.aggregate(loss, flat["mask"], "seq-mean-token-mean", float(len(lens)), seq, len(rows)).backward()
            losses[idx] = batch.to_padded(loss.detach()).float()
        return losses * mask, logp.grad

    whole = run([[0, 1, 2, 3, 4]])
    for groups in ([[0], [1, 2], [3, 4]], [[4, 2], [0, 3, 1]]):
        other = run(groups)
        assert torch.allclose(other[0], whole[0], rtol=1e-6, atol=1e-7) and torch.allclose(other[1], whole[1], atol=1e-8)
    # ... and the same as over the padded rows.
    logp = logp0.clone().requires_grad_()
    loss, _, _ = rl.gspo_loss(logp, old, adv, mask, 3e-4, 4e-4)
    assert torch.allclose(loss.detach() * mask, whole[0], rtol=1e-6, atol=1e-7)


def test_cispo_hand_computed_with_each_aggregation():
    logp, old, adv, mask = _batch()
    loss, capped, _ = rl.cispo_loss(logp, old, adv, cap=1.2)
    # −sg(min(r, 1.2))·A·log π per token: r = e^δ, so e^0.1, e^0.3 → 1.2 (capped), e^−0.5, e^0.2 → 1.2, 1, 1.
    w = [[math.exp(0.1), 1.2, 1.0], [math.exp(-0.5), 1.2, 1.0], [1.0, 1.0, 1.0]]
    lp = (old + t(*DELTAS)).tolist()
    expected = [[-w[i][j] * ADV[i] * lp[i][j] * MASK[i][j] for j in range(3)] for i in range(3)]
    assert torch.allclose(loss * mask, t(*expected))
    assert (capped * mask).tolist() == [[0, 1, 0], [0, 1, 0], [0, 0, 0]]
    _check_aggregates(loss, mask, expected)


def test_cispo_keeps_the_gradient_of_a_clipped_token():
    # A token whose ratio is past the clip: PPO's surrogate gives it no gradient, CISPO the capped
    # weight times −A (the weight is a constant: no gradient through it).
    old = torch.zeros(2)
    logp = torch.log(torch.tensor([3.0, 0.5])).requires_grad_()
    adv = torch.tensor([1.0, 1.0])
    ppo, clipped, _ = rl.policy_loss(logp, old, adv, clip_eps=0.2)
    (ppo_grad,) = torch.autograd.grad(ppo.sum(), logp)
    assert clipped[0] == 1 and ppo_grad[0] == 0
    cispo, capped, _ = rl.cispo_loss(logp, old, adv, cap=2.0)
    (grad,) = torch.autograd.grad(cispo.sum(), logp)
    assert capped.tolist() == [1.0, 0.0]
    assert torch.allclose(grad, torch.tensor([-2.0, -0.5]))  # −min(r, 2)·A: 2 for r = 3, 0.5 for r = 0.5


def test_sapo_hand_computed_with_each_aggregation():
    logp, old, adv, mask = _batch()
    loss, clipped, _ = rl.sapo_loss(logp, old, adv, tau_pos=1.0, tau_neg=1.05)

    def gate(r, tau):  # the paper's f(r) = σ(τ(r − 1))·4/τ
        return 4 / tau / (1 + math.exp(-tau * (r - 1)))

    expected = [[-gate(math.exp(DELTAS[i][j]), 1.0 if ADV[i] > 0 else 1.05) * ADV[i] * MASK[i][j] for j in range(3)]
                for i in range(3)]
    assert torch.allclose(loss * mask, t(*expected))
    assert not clipped.any()
    _check_aggregates(loss, mask, expected)


def _sapo_grad(ratio: float, adv: float, tau: float) -> float:
    logp = torch.tensor([math.log(ratio)], dtype=torch.float64, requires_grad=True)
    loss, _, _ = rl.sapo_loss(logp, torch.zeros(1, dtype=torch.float64), torch.tensor([adv], dtype=torch.float64),
                              tau_pos=tau, tau_neg=tau)
    loss.sum().backward()
    return logp.grad.item()


def test_sapo_gate_between_no_clip_and_a_closed_trust_region():
    # d(−A·f(r))/d log π = −A·sech²(τ(r − 1)/2)·r: the unclipped surrogate's −A·r scaled by a weight
    # that is 1 on-policy and falls smoothly as r leaves 1, faster for a larger τ.
    for r, a, tau in ((1.3, 1.0, 1.0), (0.7, -1.0, 1.05), (2.0, 0.5, 3.0)):
        assert _sapo_grad(r, a, tau) == pytest.approx(-a * r / math.cosh(tau * (r - 1) / 2) ** 2, rel=1e-12)
    for tau in (1e-3, 1.0, 100.0):  # on-policy: exactly the unclipped gradient, whatever τ
        assert _sapo_grad(1.0, 2.0, tau) == pytest.approx(-2.0, rel=1e-12)
    # τ → 0: no clip at all — the gradient of −A·r at every ratio, also where PPO's clip gives none.
    for r in (0.5, 1.1, 1.5, 3.0):
        assert _sapo_grad(r, 1.0, 1e-4) == pytest.approx(-r, rel=1e-6)
    # τ → ∞: the gate closes to the ratio 1 — no gradient once r leaves it by more than a few 1/τ.
    assert abs(_sapo_grad(1.2, 1.0, 100.0)) < 1e-6 and abs(_sapo_grad(0.9, -1.0, 100.0)) < 1e-3
    # Its half-gradient band is |r − 1| < 2·arccosh(√2)/τ ≈ 1.763/τ: a smooth trust region of that width.
    edge = 1 + 2 * math.acosh(math.sqrt(2)) / 10.0
    assert _sapo_grad(edge, 1.0, 10.0) == pytest.approx(-0.5 * edge, rel=1e-9)


def test_sequence_tis_weights_hand_computed():
    old = t([-1.0, -1.0, 0.0], [-1.0, -2.0, -3.0], [-1.0, 0.0, 0.0])
    rollout = t([-1.0, -1.5, 0.0], [-2.0, -1.5, -3.0], [-0.2, 0.0, 0.0])
    mask = t([1, 1, 0], [1, 1, 1], [1, 0, 0])
    w, cut = rl.sequence_tis_weights(old, rollout, mask, cap=2.0)
    # Π π_old/π_rollout over each response: e^0.5; e^(1 − 0.5) = e^0.5; e^−0.8 — then min(·, 2)
    assert torch.allclose(w, t(*[[x] * 3 for x in (math.exp(0.5), math.exp(0.5), math.exp(-0.8))]))
    assert not cut.any()
    w, cut = rl.sequence_tis_weights(old, rollout, mask, cap=1.5)
    assert torch.allclose(w[:, 0], torch.tensor([1.5, 1.5, math.exp(-0.8)])) and cut[:, 0].tolist() == [1, 1, 0]
    # The product over a response is not the mean: the token weights here are 1, e^0.5 and e, e^−0.5, 1.
    tok, _ = rl.tis_weights(old, rollout, cap=10.0)
    assert torch.allclose((tok * mask)[1], torch.tensor([math.e, math.exp(-0.5), 1.0]))
    same, cut = rl.sequence_tis_weights(old, old.clone(), mask, cap=1.0)
    assert torch.equal(same, torch.ones_like(same)) and not cut.any()


@pytest.mark.parametrize("loss", ["ppo", "gspo", "cispo", "sapo"])
def test_each_policy_loss_learns_a_bandit(loss):
    # A policy over 8 tokens, responses of 4 tokens scored by their tokens' mean value k/7, GRPO
    # advantages over groups of 8, two epochs over each batch (the second off-policy): every loss
    # moves the expected value from 0.5 towards 1 within 15 batches.
    g = torch.Generator().manual_seed(0)
    value = torch.linspace(0, 1, 8)
    logits = torch.zeros(8, requires_grad=True)
    opt = torch.optim.Adam([logits], lr=0.1)
    losses = {"ppo": lambda lp, old, a, m: rl.policy_loss(lp, old, a, 0.2, 3.0),
              "gspo": lambda lp, old, a, m: rl.gspo_loss(lp, old, a, m, 3e-4, 4e-4),
              "cispo": lambda lp, old, a, m: rl.cispo_loss(lp, old, a, 5.0),
              "sapo": lambda lp, old, a, m: rl.sapo_loss(lp, old, a, 1.0, 1.05)}
    mask = torch.ones(32, 4)
    for _ in range(15):
        with torch.no_grad():
            tokens = torch.multinomial(logits.softmax(-1), 32 * 4, replacement=True, generator=g).view(32, 4)
            old = logits.log_softmax(-1)[tokens]
        scores = value[tokens].mean(-1)
        adv = rl.grpo_advantages(scores, [i // 8 for i in range(32)], mask)
        for _ in range(2):
            pg, _, _ = losses[loss](logits.log_softmax(-1)[tokens], old, adv, mask)
            opt.zero_grad()
            rl.aggregate(pg, mask, "seq-mean-token-mean", 32.0).backward()
            opt.step()
    assert (logits.softmax(-1) * value).sum().item() > 0.8
