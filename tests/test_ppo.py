"""Stage ppo: the layout does not change the math; interrupted and resumed equals uninterrupted."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from llamarl.lib.files import checkpoint, publish
from llamarl.lib.model import hf_mapping
from llamarl.lib.model.config import LlamaConfig
from llamarl.pipeline import toy
from llamarl.stages import ppo, rollout, score, shard
from llamarl.stages.config import PPOConfig, RewardTerm, RolloutConfig, Sampling, ScoreConfig, ShardConfig


@pytest.fixture(scope="module")
def iteration(tmp_path_factory, pool2):
    """An actor, a rollout of it and rule-based scores: the inputs of one PPO iteration."""
    root = tmp_path_factory.mktemp("ppo")
    toy.make_llama(str(root / "actor_hf"), num_layers=3)
    pool2.run(shard.run, ShardConfig(src=str(root / "actor_hf"), dst=str(root / "actor"), tp=2))
    prompts = toy.make_prompts(str(root / "prompts.jsonl"), n=6)
    pool2.run(rollout.run, RolloutConfig(
        actor=str(root / "actor"), prompts=prompts, out=str(root / "rollout"), id_column="id", chunk_size=3, tp=2,
        sampling=Sampling(samples_per_prompt=2, max_new_tokens=8, seed=5)))
    pool2.run(score.run, ScoreConfig(rollout=str(root / "rollout"), out=str(root / "scores"), tp=2,
                                           rewards=[RewardTerm(name="rules_for_tests:response_length", weight=0.1)]))
    return root


def _cfg(root, out, **kw):
    base = dict(rollout=str(root / "rollout"), scores=str(root / "scores"), actor=str(root / "actor"), out=str(out),
                mini_batch_size=4, micro_batch_tokens=40, ppo_epochs=2, actor_lr=1e-3, critic_lr=1e-3, kl_coef=0.1,
                entropy_coef=0.01, seed=1)
    base.update(kw)
    return PPOConfig(**base)


def _weights(ckpt: str) -> dict[str, torch.Tensor]:
    manifest = publish.require_published(ckpt, "checkpoint")
    cfg = LlamaConfig.from_dict(manifest["model_config"])
    state = {n: torch.empty(s) for n, s in hf_mapping.hf_shapes(cfg, manifest["head"]).items()}
    checkpoint.load(state, f"{ckpt}/model")
    return state


def _rel_diff(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-12)).item() for k in b)


@pytest.fixture(scope="module")
def reference_run(iteration, pool1, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "tp1"
    pool1.run(ppo.run, _cfg(iteration, out))
    return out


# Each policy loss with options that make its own part act within the 6 steps: GSPO's paper clip
# (3e-4 / 4e-4 of a sequence ratio), a CISPO cap that weighs many tokens, SAPO with sequence-level
# TIS over recomputed log-probs; and each with another estimator and aggregation.
POLICY_LOSSES = {
    "ppo": {},
    "gspo": dict(policy_loss="gspo", advantage="grpo", clip_eps=3e-4, clip_eps_high=4e-4, loss_agg="seq-mean-token-mean"),
    "cispo": dict(policy_loss="cispo", cispo_cap=1.001),
    "sapo": dict(policy_loss="sapo", advantage="rloo", loss_agg="seq-mean-token-sum-norm", old_logp="actor", tis="on",
                 tis_level="sequence"),
}
LAYOUTS = {"tp2": dict(tp=2), "pp2": dict(pp=2), "dp2": dict(dp=2), "tp2-sp": dict(tp=2, sequence_parallel=True)}
# PPO at every layout; the other losses differ from it only in the per-token loss on the last pipeline
# stage, so each runs where that loss meets the layout: packed tokens with sequence-parallel padding
# (tp2-sp: every TP rank's log-probs are whole, and TP2 without SP packs the same tokens), the last of
# two pipeline stages (pp2), and half of every mini-batch in other micro-batches (dp2).
LAYOUT_CASES = [("ppo", layout) for layout in LAYOUTS] + [(loss, layout) for loss in ("gspo", "cispo", "sapo")
                                                          for layout in ("tp2-sp", "pp2", "dp2")]


@pytest.fixture(scope="module")
def tp1_runs(iteration, pool1, reference_run, tmp_path_factory):
    """The TP1 run of each policy loss, made when first asked for."""
    runs = {"ppo": reference_run}

    def run(loss: str):
        if loss not in runs:
            runs[loss] = tmp_path_factory.mktemp(loss) / "tp1"
            pool1.run(ppo.run, _cfg(iteration, runs[loss], **POLICY_LOSSES[loss]))
        return runs[loss]
    return run


@pytest.mark.parametrize("loss,layout", LAYOUT_CASES, ids=[f"{loss}-{layout}" for loss, layout in LAYOUT_CASES])
def test_layout_does_not_change_the_update(pool2, iteration, tp1_runs, tmp_path, loss, layout):
    reference_run = tp1_runs(loss)
    pool2.run(ppo.run, _cfg(iteration, tmp_path / "run", **POLICY_LOSSES[loss], **LAYOUTS[layout]))
    before = _weights(str(iteration / "actor"))
    ref_actor, actor = _weights(str(reference_run / "actor")), _weights(str(tmp_path / "run" / "actor"))
    moved = max(((ref_actor[k] - before[k]).norm() / before[k].norm()).item() for k in before)
    assert moved > 1e-3  # the update did something
    # fp32 reduction order differs between layouts (step-1 gradients agree to 7e-8); Adam divides
    # by sqrt(v), which lifts that to ~1.4e-5 of the weights at lr 1e-3 (1.4e-6 at lr 1e-4), flat
    # over epochs. A wrong split or a missed all-reduce moves them by 1e-3 or more.
    assert _rel_diff(actor, ref_actor) < 5e-5
    if (reference_run / "critic").exists():
        assert _rel_diff(_weights(str(tmp_path / "run" / "critic")), _weights(str(reference_run / "critic"))) < 5e-5
    assert [x["clip_fraction"] for x in _steps(tmp_path / "run")] == pytest.approx(
        [x["clip_fraction"] for x in _steps(reference_run)], abs=1e-6)


def _sequence_ratios(tp: int, sp: bool, groups: list[list[int]]) -> list[float]:
    """GSPO's sequence ratio of each of three responses, their log-probs from a tiny Llama at ``tp``
    (sequence parallel ``sp``), the rows run as the micro-batches ``groups``; π_old is −3 a token."""
    import tiny
    from llamarl.lib.distributed import parallel
    from llamarl.lib.rl import core as rl
    from llamarl.lib.model import vocab_parallel
    from llamarl.lib.model.config import ParallelLayout
    from llamarl.lib.model.llama import ParallelLlamaForCausalLM

    parallel.init(tp, 1)
    hf = tiny.hf_model()
    model = ParallelLlamaForCausalLM(tiny.our_config(hf), ParallelLayout(tp=tp, sequence_parallel=sp))
    model.load_hf_state_dict(hf.state_dict())
    ids, mask, _ = tiny.batch("right")  # rows of 7, 12 and 3 tokens
    labels = torch.roll(ids, -1, 1)
    resp = (mask * torch.roll(mask, -1, 1)).float()
    resp[:, 0] = 0  # a one-token prompt, then the response's label positions
    ratios = torch.zeros(len(ids))
    for rows in groups:
        batch = model.make_batch(ids[rows], mask[rows])
        with torch.no_grad():
            logp = vocab_parallel.log_probs(model(batch), batch.flat(labels[rows]), model.tp_group)
        seq = batch.flat(rl.sequence_index(resp[rows]))
        loss, _, _ = rl.gspo_loss(logp, torch.full_like(logp, -3.0), torch.full_like(logp, -1.0), batch.flat(resp[rows]),
                                  1e9, None, seq, len(rows))  # A = −1, no clip: the loss is the ratio
        padded = batch.to_padded(loss)
        ratios[rows] = padded[:, 1]  # the first response token carries its sequence's ratio
    parallel.destroy_model_parallel()
    return ratios.tolist()


@pytest.mark.parametrize("tp,sp", [(2, False), (2, True)], ids=["tp2", "tp2-sp"])
def test_gspo_sequence_ratio_is_the_same_on_every_tp_rank_and_micro_batching(pool1, pool2, tp, sp):
    # Every TP rank holds every token's whole log-prob (vocab-parallel log-softmax, all tokens
    # gathered before the head under SP): each rank computes each sequence's ratio itself, the
    # same as TP1, whichever micro-batches hold the sequences (never split: micro_batches takes
    # whole samples).
    [alone] = pool1.run(_sequence_ratios, 1, False, [[0, 1, 2]])
    [split] = pool1.run(_sequence_ratios, 1, False, [[2], [0, 1]])
    ranks = pool2.run(_sequence_ratios, tp, sp, [[1], [2, 0]])
    assert ranks[0] == ranks[1]
    assert all(0.01 < abs(r - 1) < 1e9 for r in alone)  # off 1, and finite
    assert split == pytest.approx(alone, rel=1e-6) and ranks[0] == pytest.approx(alone, rel=1e-6)


def test_each_policy_loss_acts(tp1_runs):
    # The TP1 runs above: GSPO clips whole sequences and CISPO caps weights (clip_fraction, each
    # token counted), SAPO never clips; each update differs from PPO's.
    fractions = {loss: [x["clip_fraction"] for x in _steps(tp1_runs(loss))] for loss in POLICY_LOSSES}
    assert max(fractions["gspo"]) > 0.1 and max(fractions["cispo"]) > 0.1 and max(fractions["sapo"]) == 0
    ppo_actor = _weights(str(tp1_runs("ppo") / "actor"))
    for loss in ("gspo", "cispo", "sapo"):
        assert _rel_diff(_weights(str(tp1_runs(loss) / "actor")), ppo_actor) > 1e-2, loss
    tis = publish.require_published(str(tp1_runs("sapo")), "ppo")["summary"]["tis"]
    assert 0 < tis["tis_weight_mean"] <= 2 and tis["tis_weight_max"] <= 2, tis


def test_outputs_metrics_and_checkpoint_format(reference_run, iteration):
    lines = [json.loads(x) for x in open(reference_run / "metrics.jsonl")]
    assert len(lines) == 6  # 12 samples / 4 per mini-batch × 2 epochs
    for key in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "actor_grad_norm", "actor_lr",
                "mean_score", "mean_response_length", "kl"):
        assert key in lines[0], key
    # Wall times are the manifest's (each step's), not metrics.jsonl's, which a rerun writes byte for byte again.
    assert "seconds" not in lines[0]
    assert len(publish.require_published(str(reference_run), "ppo")["summary"]["step_seconds"]) == 6
    assert lines[0]["entropy"] > 0 and lines[0]["actor_lr"] == 1e-3
    m = publish.require_published(str(reference_run / "actor"), "checkpoint")
    # The weights alone; the training state beside them, in its own published output.
    assert m["train_state"] == {"step": 6, "url": "../train_state/actor"}
    assert not any(k.startswith("optim/") for k in m["files"])
    assert any(k.startswith("hf/tokenizer") for k in m["files"])  # rollout of the next iteration needs it
    for role in ("actor", "critic"):
        state = publish.require_published(str(reference_run / "train_state" / role), "train_state")
        assert state["step"] == 6 and state["role"] == role and state["files"]
        assert all(k.startswith("optim/") for k in state["files"])
        assert state["checkpoint_id"] == publish.output_id(str(reference_run / role))
    assert publish.require_published(str(reference_run / "critic"), "checkpoint")["head"] == "score"
    stage = publish.require_published(str(reference_run), "ppo")
    assert stage["final_step"] == 6
    assert stage["outputs"] == {p: publish.output_id(str(reference_run / p))
                                for p in ("actor", "critic", "train_state/actor", "train_state/critic")}


def test_next_iteration_continues_optimizer_state(pool1, iteration, reference_run, tmp_path):
    # The updated actor is a valid input: a second iteration loads its moments and step count.
    pool1.run(ppo.run, _cfg(iteration, tmp_path / "it2", actor=str(reference_run / "actor"),
                            critic=str(reference_run / "critic"), reference=str(iteration / "actor"), ppo_epochs=1,
                            off_policy=True))  # this rollout came from the iteration-1 actor
    lines = [json.loads(x) for x in open(tmp_path / "it2" / "metrics.jsonl")]
    assert lines[0]["step"] == 7
    assert publish.require_published(str(tmp_path / "it2" / "actor"))["train_state"]["step"] == 9
    # Off-policy: π_old is the actor's, recomputed before the update, so the first step's ratio is 1
    # (against the rollout's log-probs, an actor 6 steps older, it would not be); the samples are
    # weighed by min(π_old / π_rollout, 2), reported per step and in the manifest.
    assert abs(lines[0]["approx_kl"]) < 1e-6 and lines[0]["clip_fraction"] == 0
    summary = publish.require_published(str(tmp_path / "it2"), "ppo")["summary"]
    assert summary["old_logp"] == "actor" and summary["tis"]["tis_weight_max"] <= 2.0
    assert abs(summary["tis"]["tis_weight_mean"] - 1) > 1e-3  # another policy's samples
    assert all(0 < x["tis_weight_mean"] and x["tis_weight_max"] <= 2.0 and 0 <= x["tis_truncated"] <= 1 for x in lines)


def _steps(run) -> list[dict]:
    return [json.loads(x) for x in open(run / "metrics.jsonl")]


def test_tis_with_equal_logprobs_is_exactly_todays_update(pool1, iteration, reference_run, tmp_path):
    # On-policy, π_old the rollout's own log-probs: every weight is exactly 1, and the update is
    # today's bit for bit.
    pool1.run(ppo.run, _cfg(iteration, tmp_path / "tis", tis="on"))
    lines = _steps(tmp_path / "tis")
    tis_keys = ("tis_weight_mean", "tis_weight_max", "tis_truncated")
    assert all((x["tis_weight_mean"], x["tis_weight_max"], x["tis_truncated"]) == (1.0, 1.0, 0.0) for x in lines)
    assert [{k: v for k, v in x.items() if k not in tis_keys} for x in lines] == _steps(reference_run)
    for role in ("actor", "critic"):
        assert _rel_diff(_weights(str(tmp_path / "tis" / role)), _weights(str(reference_run / role))) == 0


@pytest.fixture(scope="module")
def recomputed_run(iteration, pool1, tmp_path_factory):
    out = tmp_path_factory.mktemp("recomputed") / "tp1"
    pool1.run(ppo.run, _cfg(iteration, out, old_logp="actor"))
    return out


def test_on_policy_recomputed_logprobs_agree_with_the_rollouts(iteration, reference_run, recomputed_run):
    # π_old recomputed by the training kernels, on-policy: the importance weights measure the
    # engine/trainer mismatch, near 1 in fp32 (a log-prob placed one token off would be far).
    summary = publish.require_published(str(recomputed_run), "ppo")["summary"]
    assert summary["old_logp"] == "actor"
    assert abs(summary["tis"]["tis_weight_mean"] - 1) < 1e-4 and summary["tis"]["tis_truncated"] == 0, summary["tis"]
    assert _rel_diff(_weights(str(recomputed_run / "actor")), _weights(str(reference_run / "actor"))) < 1e-3


def _ppo_counting_frozen_passes(cfg_json: dict, source: str | None = None) -> dict:
    """``ppo.run`` with its gradient-free forwards of the causal LM (the reference's and π_old's
    passes: a forward of each micro-batch) counted and the checkpoints it reads listed; ``source``,
    when given, stands in for ``reference_source``'s answer."""
    from llamarl.lib.files import checkpoint as ckpt
    from llamarl.lib.model.llama import ParallelLlamaForCausalLM

    counts = {"frozen_forwards": 0, "loads": []}
    forward, load, choose = ParallelLlamaForCausalLM.forward, ckpt.load_model, ppo.reference_source

    def counted_forward(self, *a, **kw):
        counts["frozen_forwards"] += not torch.is_grad_enabled()
        return forward(self, *a, **kw)

    def listed_load(model, url, *a, **kw):
        counts["loads"].append(url)
        return load(model, url, *a, **kw)

    ParallelLlamaForCausalLM.forward, ckpt.load_model = counted_forward, listed_load
    if source is not None:
        ppo.reference_source = lambda *a: source
    try:
        ppo.run(PPOConfig(**cfg_json))
    finally:
        ParallelLlamaForCausalLM.forward, ckpt.load_model, ppo.reference_source = forward, load, choose
    return counts


def _ppo_recording_heap_freezes(cfg_json: dict) -> list[str]:
    """``ppo.run`` with its step points and its heap freezes (with gc's frozen count) recorded in order."""
    import gc

    events, hook, freeze = [], ppo._test_hook, ppo.job.freeze_heap

    def hooked(point, trainers=None):
        events.append(point)
        hook(point, trainers)

    def recorded():
        freeze()
        events.append(f"froze {gc.get_freeze_count()}")

    ppo._test_hook, ppo.job.freeze_heap = hooked, recorded
    try:
        ppo.run(PPOConfig(**cfg_json))
    finally:
        ppo._test_hook, ppo.job.freeze_heap = hook, freeze
    return events


def test_the_heap_is_frozen_once_after_the_first_step(pool1, iteration, tmp_path):
    # The first optimizer step compiles the update's graphs (on a GPU); right after it ppo collects
    # and freezes the heap, once, so that full collections mid-update walk none of it.
    [events] = pool1.run(_ppo_recording_heap_freezes, _cfg(iteration, tmp_path / "run").to_json())
    froze = [e for e in events if e.startswith("froze ")]
    assert len(froze) == 1 and int(froze[0].split()[1]) > 0, events
    assert events.index("step 1") < events.index(froze[0]) == events.index("step 2") - 1, events


@pytest.mark.parametrize("old_logp", ["rollout", "actor"])
def test_iteration_one_runs_no_reference_forward(pool1, iteration, tmp_path, old_logp):
    # Iteration 1: the reference is the actor that sampled the rollout (their ids agree). With π_old
    # the rollout's, π_ref's log-probs are the rollout's too: no reference pass at all, and the KL
    # between the two, exactly 0 now, was the engine's difference from the training forward (in fp32
    # about 1e-7 a token). With π_old the actor's, its one forward gives both. The reference pass,
    # forced, gives the same update: bit for bit with π_old the actor's, else within fp32 rounding
    # amplified by Adam over 6 steps (as between layouts).
    runs = {}
    for name, source in (("skipped", None), ("forward", "forward")):
        cfg = _cfg(iteration, tmp_path / name, old_logp=old_logp)
        [runs[name]] = pool1.run(_ppo_counting_frozen_passes, cfg.to_json(), source)
    expected = "rollout" if old_logp == "rollout" else "actor"
    assert publish.require_published(str(tmp_path / "skipped"), "ppo")["summary"]["ref_logp"] == expected
    per_pass = runs["forward"]["frozen_forwards"] // (2 if old_logp == "actor" else 1)
    assert per_pass > 0
    assert runs["skipped"]["frozen_forwards"] == (per_pass if old_logp == "actor" else 0)
    actor_model = f"{iteration / 'actor'}/model"
    assert runs["forward"]["loads"] == [actor_model] * 2 and runs["skipped"]["loads"] == [actor_model]  # the reference's
    skipped, forced = _steps(tmp_path / "skipped"), _steps(tmp_path / "forward")
    print("kl of the forced reference pass, per step:", [x["kl"] for x in forced])
    assert all(x["kl"] == 0.0 for x in skipped)
    if old_logp == "actor":  # the reference's forward is the actor's, bit for bit
        assert skipped == forced
    else:
        assert all(0 < abs(x["kl"]) < 1e-5 for x in forced)
    for a, b in zip(skipped, forced):
        for k in ("policy_loss", "value_loss", "entropy", "actor_grad_norm", "critic_grad_norm"):
            assert a[k] == pytest.approx(b[k], rel=1e-4, abs=1e-6), (k, a[k], b[k])
    for role in ("actor", "critic"):
        diff = _rel_diff(_weights(str(tmp_path / "skipped" / role)), _weights(str(tmp_path / "forward" / role)))
        print(f"{role}: weights apart by {diff:.2e} (relative, largest tensor)")
        assert diff < 5e-5


def test_without_a_kl_no_reference_is_read(pool1, iteration, reference_run, tmp_path):
    # kl_coef 0: no KL in the rewards or the loss, so no reference log-probs at all — not the
    # rollout's, not a forward — and the kl metric is null; the update is the one the reference
    # pass, forced, gives (its KL multiplied by 0), bit for bit.
    runs = {}
    for name, source in (("none", None), ("forward", "forward")):
        cfg = _cfg(iteration, tmp_path / name, kl_coef=0.0, reference=str(reference_run / "actor"))
        [runs[name]] = pool1.run(_ppo_counting_frozen_passes, cfg.to_json(), source)
    assert publish.require_published(str(tmp_path / "none"), "ppo")["summary"]["ref_logp"] == "none"
    assert runs["none"] == {"frozen_forwards": 0, "loads": [f"{iteration / 'actor'}/model"]}
    assert runs["forward"]["frozen_forwards"] > 0
    lines = {name: _steps(tmp_path / name) for name in runs}
    assert all(x["kl"] is None for x in lines["none"]) and all(x["kl"] != 0 for x in lines["forward"])
    assert [{**x, "kl": None} for x in lines["forward"]] == lines["none"]
    for role in ("actor", "critic"):
        assert _rel_diff(_weights(str(tmp_path / "none" / role)), _weights(str(tmp_path / "forward" / role))) == 0


@pytest.mark.parametrize("layout", [dict(dp=2), dict(pp=2)], ids=["dp2", "pp2"])
def test_recomputed_logprobs_at_any_layout(pool2, iteration, recomputed_run, tmp_path, layout):
    # The actor's log-probs are gathered over DP and live on the last pipeline stage only.
    pool2.run(ppo.run, _cfg(iteration, tmp_path / "run", old_logp="actor", **layout))
    assert _rel_diff(_weights(str(tmp_path / "run" / "actor")), _weights(str(recomputed_run / "actor"))) < 5e-5
    tis = [publish.require_published(str(r), "ppo")["summary"]["tis"] for r in (tmp_path / "run", recomputed_run)]
    assert tis[0] == pytest.approx(tis[1], abs=1e-6)


def test_dynamic_sampling_trains_on_groups_of_differing_scores(pool1, pool2, iteration, tmp_path):
    # DAPO's dynamic sampling and clip-higher with Dr. GRPO's advantage and loss, on scores of 0 or
    # 1: whether a response has an "o" in it.
    from llamarl.stages.ppo_data import load_samples

    scores = tmp_path / "scores"
    pool2.run(score.run, ScoreConfig(rollout=str(iteration / "rollout"), out=str(scores), tp=2,
                                     rewards=[RewardTerm(name="regex", args={"pattern": "o"})]))
    samples = load_samples(str(iteration / "rollout"), str(scores))
    by: dict = {}
    for s in samples:
        by.setdefault(s.group, []).append(s.score)
    differing = [g for g, v in by.items() if len(set(v)) > 1]
    assert 1 < len(differing) < len(by), by  # the fixture has both kinds
    cfg = _cfg(iteration, tmp_path / "dapo", scores=str(scores), advantage="grpo", dynamic_sampling=True, train_groups=2,
               clip_eps_high=0.28, loss_agg="seq-mean-token-sum-norm", grpo_norm_by_std=False)
    pool1.run(ppo.run, cfg)
    summary = publish.require_published(str(tmp_path / "dapo"), "ppo")["summary"]
    assert summary["dynamic_sampling"] == {"groups": len(by), "dropped": len(by) - len(differing),
                                           "kept": len(differing), "trained": 2, "short": 0}
    assert summary["trained_samples"] == 4 and len(_steps(tmp_path / "dapo")) == 2  # 4 samples, 4 a step, 2 epochs
    assert summary["mean_score"] == pytest.approx(sum(s.score for s in samples) / len(samples))  # the rollout's
    # The first step, ratio 1 on every token: −Σ A·(response tokens) / (4 sequences × max_new_tokens 8),
    # A the score minus its prompt's mean (Dr. GRPO), over the 4 samples the stage chose.
    from llamarl.stages.ppo_data import dynamic_sampling

    trained, _ = dynamic_sampling(cfg, samples, start_step=0)
    mean = {g: sum(by[g]) / len(by[g]) for g in by}
    expected = -sum((s.score - mean[s.group]) * s.response_len for s in trained) / (4 * 8)
    assert abs(expected) > 0.05 and _steps(tmp_path / "dapo")[0]["policy_loss"] == pytest.approx(expected, abs=1e-4)


# ---- each policy loss against a plain PyTorch reference ----------------------------------------------
# ppo's first optimizer step (train_step, one mini-batch of the whole rollout in micro-batches of 40
# tokens) at TP1 in one process, against the formula written out here with transformers' Llama and
# torch autograd, nothing from lib/rl/core.py. The actor is the reference run's (6 steps on): the rollout
# is another policy's, so every ratio is off 1 and the clips, caps and gates act. What is compared
# is the gradient: the update AdamW makes of it in a first step is lr·g/(|g| + eps), about lr·sign(g)
# per weight, which would hide a loss with the same signs.

REFERENCE_CASES = {
    "ppo": dict(clip_eps_high=0.28),
    "gspo": dict(policy_loss="gspo", clip_eps=3e-4, clip_eps_high=4e-4, loss_agg="seq-mean-token-mean"),
    "cispo": dict(policy_loss="cispo", cispo_cap=1.05, loss_agg="seq-mean-token-sum-norm", loss_agg_norm=8),
    "sapo": dict(policy_loss="sapo", sapo_tau_pos=2.0, sapo_tau_neg=3.0, loss_agg="seq-mean-token-mean"),
    "ppo-sequence-tis": dict(old_logp="actor", tis="on", tis_level="sequence", tis_cap=1.5),
}


def _first_step_gradient(actor: str, cfg_json: dict) -> dict:
    """ppo's first optimizer step over every sample at TP1: the actor's gradient (HF names), the
    step's metrics and π_old's log-probs."""
    import tiny
    from llamarl.lib.distributed import parallel
    from llamarl.lib.model.config import ParallelLayout
    from llamarl.lib.model.llama import ParallelLlamaForCausalLM
    from llamarl.stages.ppo_data import advantages, load_samples, micro_batches, response_values
    from llamarl.stages.ppo_trainer import Trainer, token_outputs, train_step

    cfg = PPOConfig(**cfg_json)
    parallel.init(1, 1)
    model = ParallelLlamaForCausalLM(LlamaConfig.from_dict(publish.require_published(actor)["model_config"]),
                                     ParallelLayout())
    checkpoint.load_model(model, f"{actor}/model")
    samples = load_samples(cfg.rollout, cfg.scores)
    every = list(range(len(samples)))
    actor_logp = None
    if cfg.old_logp_source() == "actor":
        groups = micro_batches(every, samples, cfg.micro_batch_tokens)
        actor_logp = dict(zip([i for g in groups for i in g], token_outputs(model, samples, groups, cfg.temperature)))
    no_kl = {i: [0.0] * s.response_len for i, s in enumerate(samples)}
    data = advantages(cfg, samples, no_kl, None, "cpu", actor_logp)
    trainer = Trainer(model, cfg.actor_lr, cfg, None, f"{actor}/model", 0)
    metrics = train_step(cfg, {"actor": trainer}, samples, data, every, 0, "cpu", cfg.loss_agg_norm).result()
    grads = tiny.gather_hf_grads(model)
    parallel.destroy_model_parallel()
    return {"grads": grads, "metrics": metrics, "old_logp": response_values(samples, data["old_logp"])}


def _reference_loss(cfg: PPOConfig, model, samples, old_logp: list[list[float]]) -> torch.Tensor:
    """The mini-batch's policy loss of ``cfg`` over ``samples``, written from the papers' formulas;
    ``old_logp``: π_old's log-probs when they are the actor's."""
    import statistics

    by: dict = {}
    for s in samples:
        by.setdefault(s.group, []).append(s.score)
    per_token, lengths = [], []
    for i, s in enumerate(samples):
        scores = by[s.group]  # GRPO: the score against its prompt's samples
        a = (s.score - statistics.mean(scores)) / (statistics.stdev(scores) + 1e-6) if len(scores) > 1 else 0.0
        logits = model(torch.tensor([s.ids])).logits[0].float() / cfg.temperature
        lp = torch.log_softmax(logits, -1)[s.prompt_len - 1 : -1].gather(-1, torch.tensor(s.ids[s.prompt_len :])[:, None])[:, 0]
        rollout = torch.tensor(s.rollout_logp)
        old = torch.tensor(old_logp[i]) if cfg.old_logp_source() == "actor" else rollout
        r = (lp - old).exp()
        high = 1 + (cfg.clip_eps if cfg.clip_eps_high is None else cfg.clip_eps_high)
        if cfg.policy_loss == "ppo":
            loss = torch.maximum(-a * r, -a * r.clamp(1 - cfg.clip_eps, high))
            loss = torch.minimum(loss, torch.full_like(loss, -a * cfg.dual_clip)) if a < 0 else loss
        elif cfg.policy_loss == "gspo":  # one ratio, one clipped surrogate per sequence, on each token
            seq = (lp - old).mean().exp()
            loss = torch.maximum(-a * seq, -a * seq.clamp(1 - cfg.clip_eps, high)).expand(len(lp))
        elif cfg.policy_loss == "cispo":
            loss = -r.detach().clamp(max=cfg.cispo_cap) * a * lp
        else:
            tau = cfg.sapo_tau_pos if a > 0 else cfg.sapo_tau_neg
            loss = -torch.sigmoid(tau * (r - 1)) * 4 / tau * a
        if cfg.uses_tis():
            weight = (old - rollout).sum().exp() if cfg.tis_level == "sequence" else (old - rollout).exp()
            loss = loss * weight.clamp(max=cfg.tis_cap)
        per_token.append(loss)
        lengths.append(len(lp))
    if cfg.loss_agg == "token-mean":
        return torch.cat(per_token).sum() / sum(lengths)
    if cfg.loss_agg == "seq-mean-token-mean":
        return torch.stack([x.mean() for x in per_token]).mean()
    return torch.cat(per_token).sum() / (len(samples) * cfg.loss_agg_norm)


@pytest.fixture(scope="module")
def vowel_scores(iteration, pool2, tmp_path_factory):
    """The fixture rollout scored by its share of vowels: the samples of a prompt all score apart."""
    out = tmp_path_factory.mktemp("vowels") / "scores"
    pool2.run(score.run, ScoreConfig(rollout=str(iteration / "rollout"), out=str(out), tp=2,
                                     rewards=[RewardTerm(name="llamarl.pipeline.demo:vowel_ratio")]))
    return out


@pytest.mark.parametrize("case", REFERENCE_CASES)
def test_policy_loss_gradient_equals_a_plain_pytorch_reference(pool1, iteration, reference_run, vowel_scores, case):
    from transformers import LlamaConfig as HFLlamaConfig
    from transformers import LlamaForCausalLM

    from llamarl.stages.ppo_data import load_samples

    actor = str(reference_run / "actor")
    cfg = _cfg(iteration, iteration / "unused", **{
        "actor": actor, "scores": str(vowel_scores), "off_policy": True, "old_logp": "rollout", "advantage": "grpo", "kl_coef": 0.0, "entropy_coef": 0.0,
        "grad_clip": None, "mini_batch_size": 12, **REFERENCE_CASES[case]})
    [stage] = pool1.run(_first_step_gradient, actor, cfg.to_json())

    model = LlamaForCausalLM(HFLlamaConfig.from_pretrained(iteration / "actor_hf"))
    model.load_state_dict(_weights(actor))
    samples = load_samples(cfg.rollout, cfg.scores)
    # π_old, an input of the formula like π_rollout: the stage's own when it recomputes it (that
    # forward is tested against the rollout's log-probs above), since a sequence's TIS weight sums a
    # response's log-probs and would lift the two models' 1e-7 differences to 1e-6.
    loss = _reference_loss(cfg, model, samples, stage["old_logp"])
    loss.backward()
    ref = {n: p.grad for n, p in model.named_parameters()}
    assert set(stage["grads"]) == set(ref)
    err = sum((stage["grads"][n] - g).double().square().sum() for n, g in ref.items()) ** 0.5
    norm = sum(g.double().square().sum() for g in ref.values()) ** 0.5
    print(f"{case}: policy loss {loss.item():.6f} (stage {stage['metrics']['policy_loss']:.6f}), gradient norm "
          f"{norm:.4g}, relative error {err / norm:.2e}, clip_fraction {stage['metrics']['clip_fraction']:.3f}")
    # The loss sums ±A·r terms of order 1 that nearly cancel (advantages of a group sum to 0): its
    # fp32 rounding is ~1e-7 absolute, whatever its own size (5e-8 seen, micro-batches of 40 tokens).
    assert stage["metrics"]["policy_loss"] == pytest.approx(loss.item(), rel=1e-6, abs=1e-7)
    assert err / norm < 1e-6
    # The loss's own part acted: ratios past the clip (ppo, gspo), weights past the cap (cispo).
    if case in ("ppo", "gspo", "cispo"):
        assert stage["metrics"]["clip_fraction"] > 0.05
    if case == "ppo-sequence-tis":  # responses weighed apart, some capped
        m = stage["metrics"]
        assert 0 < m["tis_truncated"] < 1 and abs(m["tis_weight_mean"] - 1) > 0.05, m


# ---- loss aggregation against hand-computed means ----------------------------------------------------


@pytest.mark.parametrize("mode", ["seq-mean-token-mean", "token-mean", "seq-mean-token-sum-norm"])
def test_aggregation_of_micro_batches_is_the_hand_computed_mean(mode):
    # ppo's own path: samples cut into micro-batches by the token budget, right-padded, packed as
    # under TP2 sequence parallelism (a micro-batch of an odd token count gets a padding token, whose
    # loss is whatever the model computed there), each micro-batch's share summed.
    from llamarl.lib.model.batch import TokenBatch
    from llamarl.stages.ppo_data import Sample, micro_batches, padded
    from llamarl.stages.ppo_batches import per_token_masks
    from llamarl.stages.ppo_trainer import Aggregation

    # (prompt, response) tokens: packed longest first (1, 2, 0, 3) into [0, 1] and [2, 3], 11 and 9 tokens
    lens = [(3, 2), (2, 4), (4, 2), (1, 2)]
    losses = [[1.0, 3.0], [2.0, 4.0, 6.0, 8.0], [3.0, 5.0], [7.0, 0.5]]  # each response token's loss
    samples = [Sample(list(range(5, 5 + p + r)), p, [0.0] * r, 0.0, str(i)) for i, (p, r) in enumerate(lens)]
    if mode == "seq-mean-token-mean":  # each sequence's mean, then the mean over sequences
        expected = (2.0 + 5.0 + 4.0 + 3.75) / 4
    elif mode == "token-mean":  # the mean over all response tokens
        expected = 39.5 / 10
    else:  # Dr. GRPO: the sum over all response tokens / (4 sequences × 8 tokens)
        expected = 39.5 / 32

    agg = Aggregation(mode, [s.response_len for s in samples], norm=8)
    groups = micro_batches(list(range(4)), samples, budget=11)
    assert groups == [[0, 1], [2, 3]]
    total = torch.zeros(())
    for g in groups:
        ids, mask, _, resp = padded([samples[i] for i in g], "cpu")
        batch = TokenBatch.from_padded(ids, mask, pad_to_multiple=2)
        assert batch.num_tokens == batch.num_real + 1
        per_position = torch.full(ids.shape, 99.0)  # prompt tokens and right padding: no response
        for row, i in enumerate(g):
            start = samples[i].prompt_len - 1  # label space: position t holds token t + 1's loss
            per_position[row, start : start + len(losses[i])] = torch.tensor(losses[i])
        loss = batch.flat(per_position)
        loss[batch.num_real :] = 99.0
        total += agg(loss, per_token_masks(batch, resp))
    assert total.item() == pytest.approx(expected, rel=1e-6)


def test_seq_mean_policy_loss_is_minus_the_mean_advantage_of_the_sequences(pool2, iteration, tmp_path):
    # The stage end to end: GRPO with a KL loss at TP2 with sequence parallelism, on responses of
    # varied lengths (a fifth of the vocabulary stops them) and scores (their share of vowels). At
    # the first step the policy is the one that sampled (ratio 1), so each token's clipped surrogate
    # is −A of its sequence, and the step's policy loss, seq-mean-token-mean, is minus the mean of
    # the mini-batch's advantages: each sequence counted once, whatever its length.
    import statistics
    from collections import defaultdict

    from llamarl.stages.ppo_data import load_samples, mini_batch

    pool2.run(rollout.run, RolloutConfig(
        actor=str(iteration / "actor"), prompts=str(iteration / "prompts.jsonl"), out=str(tmp_path / "rollout"),
        id_column="id", chunk_size=3, tp=2,
        sampling=Sampling(samples_per_prompt=2, max_new_tokens=8, seed=5, stop_token_ids=list(range(3, 301, 5)))))
    pool2.run(score.run, ScoreConfig(rollout=str(tmp_path / "rollout"), out=str(tmp_path / "scores"), tp=2,
                                     rewards=[RewardTerm(name="llamarl.pipeline.demo:vowel_ratio")]))
    samples = load_samples(str(tmp_path / "rollout"), str(tmp_path / "scores"))
    by_prompt = defaultdict(list)
    for i, s in enumerate(samples):
        by_prompt[s.group].append(i)
    adv = {}
    for members in by_prompt.values():  # GRPO: each score normalised within its prompt's samples
        scores = [samples[i].score for i in members]
        for i in members:
            adv[i] = (samples[i].score - statistics.mean(scores)) / (statistics.stdev(scores) + 1e-6) if len(members) > 1 else 0.0

    def policy_losses(seed: int) -> tuple[float, float]:
        """(seq-mean, token-mean) of −A over the first mini-batch that ``seed`` draws."""
        _, first = mini_batch(_cfg(iteration, tmp_path / "grpo", seed=seed), len(samples), 0)
        return (-sum(adv[i] for i in first) / len(first),
                -sum(adv[i] * samples[i].response_len for i in first) / sum(samples[i].response_len for i in first))

    # A first mini-batch whose advantages neither cancel out nor weigh the same per token.
    seed = next(s for s in range(100) if abs(policy_losses(s)[0]) > 0.2 and abs(policy_losses(s)[0] - policy_losses(s)[1]) > 0.05)
    cfg = _cfg(iteration, tmp_path / "grpo", rollout=str(tmp_path / "rollout"), scores=str(tmp_path / "scores"), tp=2,
               sequence_parallel=True, advantage="grpo", use_kl_loss=True, kl_estimator="low_var_kl",
               loss_agg="seq-mean-token-mean", seed=seed)
    pool2.run(ppo.run, cfg)
    lines = [json.loads(x) for x in open(tmp_path / "grpo" / "metrics.jsonl")]
    assert lines[0]["policy_loss"] == pytest.approx(policy_losses(seed)[0], abs=1e-4)
    assert all(torch.isfinite(torch.tensor(x["policy_loss"])) for x in lines)


@pytest.mark.slow
@pytest.mark.parametrize("dtype", ["fp32", "bf16", "fp32-old_logp-actor"])
def test_interrupted_between_steps_then_resumed_equals_uninterrupted(iteration, reference_run, bf16_run, recomputed_run,
                                                                     tmp_path, dtype):
    # With old_logp: actor the resumed run recomputes π_old from the input actor, not the saved state.
    uninterrupted = {"fp32": reference_run, "bf16": bf16_run, "fp32-old_logp-actor": recomputed_run}[dtype]
    opts = tmp_path / "opts.yaml"
    opts.write_text("mini_batch_size: 4\nmicro_batch_tokens: 40\nppo_epochs: 2\nactor_lr: 0.001\ncritic_lr: 0.001\n"
                    f"kl_coef: 0.1\nentropy_coef: 0.01\nseed: 1\nsave_every: 1\ndtype: {dtype[:4]}\n"
                    + ("old_logp: actor\n" if dtype.endswith("actor") else ""))
    out = tmp_path / "killed"
    cmd = [sys.executable, "-m", "llamarl.pipeline.cli", "stage", "ppo", str(iteration / "rollout"),
           str(iteration / "scores"), str(iteration / "actor"), str(out), "--dp", "1", "--config", str(opts)]
    proc = subprocess.Popen(cmd, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline and not (out / ".state" / "step-000003" / "done.json").exists():
        time.sleep(0.02)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert (out / ".state" / "step-000003" / "done.json").exists(), "the run never reached step 3"
    assert publish.read_manifest(str(out)) is None
    resumed = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert "resuming after optimizer step" in resumed.stdout
    # Every step's metrics survive the kill (they live with the training state).
    def steps(run):
        return [json.loads(x) for x in open(run / "metrics.jsonl")]

    assert steps(out) == steps(uninterrupted) and len(steps(out)) == 6
    # Bit for bit: the masters and moments resume exactly, also under bf16.
    assert _rel_diff(_weights(str(out / "actor")), _weights(str(uninterrupted / "actor"))) == 0
    assert _rel_diff(_weights(str(out / "critic")), _weights(str(uninterrupted / "critic"))) == 0


# ---- what ppo writes, when ------------------------------------------------------------------------------
# Each role's weights (OUT/<role>) first, then each role's training state (OUT/train_state/<role>),
# then metrics.jsonl, then the stage's manifest. LLAMARL_TEST_PPO_AT kills the stage right after
# one of these points, as a preemption would.

PUBLISHED = ["actor", "critic", "train_state/actor", "train_state/critic"]  # in the order written
POINTS = [f"published {p}" for p in PUBLISHED] + ["wrote metrics"]


def _ppo_process(cfg: dict, at: str | None = None) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LLAMARL_TEST_PPO_AT")}
    if at:
        env["LLAMARL_TEST_PPO_AT"] = f"{at}:kill"
    return subprocess.run([sys.executable, "-m", "llamarl.stages.ppo", "--config-json", json.dumps(cfg)],
                          capture_output=True, text=True, timeout=300, env=env)


def _cfg_dict(root, out, **kw) -> dict:
    return json.loads(_cfg(root, out, **kw).model_dump_json(exclude_defaults=True))


_UUID = rb"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}"


def _output_bytes(out, like) -> dict[str, bytes]:
    """Every file the sub-outputs of the ppo output ``out`` list, read. A checkpoint's ``.metadata``
    also records its own path (written here as if it were under ``like``, a path of the same
    length) and a random id of each save (DCP's ``save_id``, blanked): nothing else differs."""
    import re

    found = {}
    for part in PUBLISHED:
        for name in publish.require_published(str(out / part))["files"]:
            data = (out / part / name).read_bytes()
            if name.endswith(".metadata"):
                data = re.sub(_UUID, b"<save_id>", data.replace(str(out).encode(), str(like).encode()))
            found[f"{part}/{name}"] = data
    return found


@pytest.mark.slow
@pytest.mark.parametrize("point", POINTS)
def test_killed_at_each_point_of_publication_then_rerun_gives_the_same_bytes(iteration, reference_run, point):
    # Same path length as the uninterrupted run's, so its checkpoints' .metadata differ only by the path.
    out = reference_run.parent.parent / f"k{POINTS.index(point)}".ljust(len(reference_run.parent.name), "x") / reference_run.name
    cfg = _cfg_dict(iteration, out)
    killed = _ppo_process(cfg, at=point)
    assert killed.returncode == -signal.SIGKILL, killed.stderr[-2000:]
    # What was published by then, in order; the stage itself is not.
    upto = len(PUBLISHED) if point == "wrote metrics" else PUBLISHED.index(point.removeprefix("published ")) + 1
    assert [publish.read_manifest(str(out / p)) is not None for p in PUBLISHED] == [True] * upto + [False] * (4 - upto)
    assert publish.read_manifest(str(out)) is None and (out / "metrics.jsonl").exists() == (point == "wrote metrics")
    if point == "published actor":
        # The actor is whole while its training state is not: the next ppo refuses it in one line.
        r = _ppo_process(_cfg_dict(iteration, out.parent / "next", actor=str(out / "actor"), off_policy=True))
        lines = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines) == 1, r.stderr[-2000:]
        assert lines[0] == (f"error: {out}/train_state/actor does not exist yet: the ppo stage writing {out}/actor "
                            f"stopped after its weights; rerun the ppo stage that writes {out} (it writes it again, whole)")
        assert not (out.parent / "next").exists()
    first = publish.read_manifest(str(out / "actor"))
    rerun = _ppo_process(cfg)
    assert rerun.returncode == 0, rerun.stderr[-2000:]
    # Written again, whole (a rollout started from the first weights is stale by their id) ...
    assert publish.read_manifest(str(out / "actor")) != first
    # ... to the same bytes as an uninterrupted run.
    assert _output_bytes(out, reference_run) == _output_bytes(reference_run, reference_run)
    assert _steps(out) == _steps(reference_run)
    assert not (out / ".state").exists()


def test_a_checkpoint_with_its_optimizer_state_inside_still_trains_the_same(pool1, iteration, reference_run, tmp_path):
    # ppo before train_state/: OUT/<role>/optim/ inside the checkpoint, the manifest's train_state
    # only {step}. Made here from the new layout (the optimizer files are the same files), then a
    # second iteration from each: the same update, bit for bit.
    import shutil

    old = tmp_path / "old"
    for role in ("actor", "critic"):
        shutil.copytree(reference_run / role, old / role)
        shutil.copytree(reference_run / "train_state" / role / "optim", old / role / "optim")
        m = publish.require_published(str(reference_run / role))
        state = publish.require_published(str(reference_run / "train_state" / role))
        body = {k: v for k, v in m.items() if k not in ("format_version", "created")}
        publish.publish(str(old / role), {**body, "files": {**m["files"], **state["files"]}, "train_state": {"step": 6}})
    runs = {}
    for name, src in (("old", old), ("new", reference_run)):
        runs[name] = tmp_path / f"it2-{name}"
        pool1.run(ppo.run, _cfg(iteration, runs[name], actor=str(src / "actor"), critic=str(src / "critic"),
                                reference=str(iteration / "actor"), ppo_epochs=1, off_policy=True))
    assert _steps(runs["old"]) == _steps(runs["new"]) and _steps(runs["new"])[0]["step"] == 7
    for role in ("actor", "critic"):
        assert _rel_diff(_weights(str(runs["old"] / role)), _weights(str(runs["new"] / role))) == 0
        a, b = (publish.require_published(str(r / "train_state" / role))["files"] for r in runs.values())
        assert {k: v for k, v in a.items() if not k.endswith(".metadata")} == \
            {k: v for k, v in b.items() if not k.endswith(".metadata")}


# ---- mixed precision ----------------------------------------------------------------------------------
# bf16 parameters and activations, fp32 gradients, masters and moments. On CPU bf16 runs too, so
# the whole mixed-precision path (and its layout independence) is tested here; tests/test_gpu.py
# repeats the layout test over NCCL.


def _update_error(run: str, ref: str, before: dict) -> float:
    """‖Δ_run − Δ_ref‖ / ‖Δ_ref‖ over the whole actor, Δ = weights after − before."""
    a, r = _weights(f"{run}/actor"), _weights(f"{ref}/actor")
    num = sum(((a[k] - r[k]).double().norm() ** 2).item() for k in r)
    den = sum(((r[k] - before[k]).double().norm() ** 2).item() for k in r)
    return (num / den) ** 0.5


@pytest.fixture(scope="module")
def bf16_run(iteration, pool1, tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16") / "tp1"
    pool1.run(ppo.run, _cfg(iteration, out, dtype="bf16"))
    return out


def test_bf16_keeps_fp32_state_and_the_stored_dtype(bf16_run, reference_run, iteration):
    m = publish.require_published(str(bf16_run / "actor"), "checkpoint")
    assert m["dtype"] == "float32"  # the toy actor is stored in fp32: so is the update
    from torch.distributed.checkpoint import FileSystemReader

    meta = FileSystemReader(str(bf16_run / "train_state" / "actor" / "optim")).read_metadata().state_dict_metadata
    masters = [k for k in meta if k.endswith(".master")]
    assert masters and all(meta[k].properties.dtype == torch.float32 for k in meta)
    assert publish.require_published(str(bf16_run), "ppo")["summary"]["dtype"] == "bfloat16"
    # The update is the fp32 one up to bf16 rounding of activations, not something else.
    err = _update_error(str(bf16_run), str(reference_run), _weights(str(iteration / "actor")))
    assert 0 < err < 0.1, err


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2), dict(dp=2)], ids=["tp2", "pp2", "dp2"])
def test_bf16_update_at_any_layout_is_within_bf16_noise(pool2, iteration, reference_run, bf16_run, tmp_path, layout):
    # The bound of bench/gpu_parity.py: against the fp32 reference, as close as TP1 in bf16 is.
    pool2.run(ppo.run, _cfg(iteration, tmp_path / "run", dtype="bf16", **layout))
    before = _weights(str(iteration / "actor"))
    noise = _update_error(str(bf16_run), str(reference_run), before)
    err = _update_error(str(tmp_path / "run"), str(reference_run), before)
    assert err <= 2.0 * noise, (err, noise)


def test_bf16_masters_round_trip_exactly(pool1, iteration, tmp_path):
    assert pool1.run(_masters_round_trip, str(iteration / "actor"), str(tmp_path)) == [True]


def _masters_round_trip(actor: str, tmp: str) -> bool:
    """A bf16 model's fp32 masters saved in optim/ load back bit for bit (not rounded through the
    bf16 weights), and the weights saved from them come back as the masters rounded."""
    from llamarl.lib.rl import optim
    from llamarl.lib.distributed import parallel
    from llamarl.lib.model.llama import ParallelLlamaForCausalLM

    parallel.init(1, 1)
    cfg = LlamaConfig.from_dict(publish.require_published(actor, "checkpoint")["model_config"])
    model = ParallelLlamaForCausalLM(cfg, dtype=torch.bfloat16)
    checkpoint.load_model(model, f"{actor}/model")
    optim.GradBuffer(model)  # its hooks on the parameters accumulate every backward into main_grad
    opt = optim.ShardedAdamW(model, lr=1e-2)
    opt.load_state(None, 0, f"{actor}/model")
    ids = torch.randint(3, cfg.vocab_size, (2, 9))
    model.run(ids).float().square().mean().backward()
    assert all(p.grad is None and p.main_grad.abs().sum() > 0 for p in model.parameters())  # fp32 accumulation
    opt.step()
    assert any((m.to(torch.bfloat16).float() != m).any() for m in opt.master.values())  # masters are finer
    checkpoint.save(opt.state(), f"{tmp}/optim")
    checkpoint.save(opt.model_state(torch.bfloat16), f"{tmp}/model")
    again = ParallelLlamaForCausalLM(cfg, dtype=torch.bfloat16)
    checkpoint.load_model(again, f"{tmp}/model")
    opt2 = optim.ShardedAdamW(again, lr=1e-2)
    opt2.load_state(f"{tmp}/optim", 1, f"{tmp}/model")
    exact = all(torch.equal(opt.master[n], opt2.master[n]) for n in opt.master)
    rounded = all(torch.equal(p, q) for p, q in zip(model.parameters(), again.parameters()))
    moments = all(torch.equal(opt.inner.state[opt.master[n]]["exp_avg_sq"], opt2.inner.state[opt2.master[n]]["exp_avg_sq"])
                  for n in opt.master)
    parallel.destroy_model_parallel()
    return exact and rounded and moments


def test_dtypes_a_device_cannot_run_are_refused_in_one_line(iteration, tmp_path):
    from llamarl.lib.model.config import compute_dtype
    from llamarl.lib.errors import UserError

    with pytest.raises(UserError, match="dtype=fp16 does not run on CPU"):
        compute_dtype("fp16", "cpu")
    assert compute_dtype("auto", "cpu") == torch.float32 and compute_dtype("auto", "cuda") == torch.bfloat16
    # ppo: no fp16 (it would need loss scaling); refused before any process group or weights.
    cmd = [sys.executable, "-m", "llamarl.stages.ppo", "--config-json",
           json.dumps({"rollout": str(iteration / "rollout"), "scores": str(iteration / "scores"),
                       "actor": str(iteration / "actor"), "out": str(tmp_path / "o"), "dtype": "fp16"})]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and r.stderr.strip() == "error: --config-json: dtype='fp16': Input should be 'auto', 'bf16' or 'fp32'", r.stderr
    assert not (tmp_path / "o").exists()


def test_fp32_on_a_gpu_takes_the_sdpa_path():
    from llamarl.lib.model.attention import varlen_backend

    assert varlen_backend(torch.device("cuda"), torch.float32) == "sdpa"
    assert varlen_backend(torch.device("cpu"), torch.bfloat16) == "sdpa"


def test_a_bad_dtype_is_refused_when_the_config_is_built():
    # `llamarl run` builds every stage's config before it runs any stage.
    from llamarl.lib.errors import UserError

    base = {"rollout": "r", "scores": "s", "actor": "a", "out": "o"}
    with pytest.raises(UserError, match=r"^spec: ppo: dtype='fp16': Input should be 'auto', 'bf16' or 'fp32'$"):
        PPOConfig.parse({**base, "dtype": "fp16"}, "spec: ppo")
    with pytest.raises(UserError, match=r"^spec: rollout: dtype='half': Input should be 'auto', 'bf16', 'fp16' or 'fp32'$"):
        RolloutConfig.parse({"actor": "a", "prompts": "p", "out": "o", "dtype": "half"}, "spec: rollout")


# ---- nothing wrong is read ------------------------------------------------------------------------------


def _stage(name: str, cfg: dict) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", f"llamarl.stages.{name}", "--config-json", json.dumps(cfg)],
                          capture_output=True, text=True, timeout=300)


def test_corrupt_rollout_parts_are_refused_by_score_and_ppo(iteration, tmp_path):
    import shutil

    bad = tmp_path / "rollout"
    shutil.copytree(iteration / "rollout", bad)
    part = sorted((bad / "parts").iterdir())[0]
    data = bytearray(part.read_bytes())
    mid = len(data) // 2
    data[mid : mid + 16] = bytes(b ^ 0xFF for b in data[mid : mid + 16])  # same size, altered bytes
    part.write_bytes(bytes(data))
    expect = f"error: {bad}/parts/{part.name} does not match its xxh3_128 checksum in the manifest"
    r = _stage("score", {"rollout": str(bad), "out": str(tmp_path / "scores"),
                         "rewards": [{"name": "rules_for_tests:response_length"}]})
    assert r.returncode == 2 and r.stderr.strip().startswith(expect), r.stderr
    assert not (tmp_path / "scores").exists()
    r = _stage("ppo", {"rollout": str(bad), "scores": str(iteration / "scores"), "actor": str(iteration / "actor"),
                       "out": str(tmp_path / "ppo")})
    assert r.returncode == 2 and r.stderr.strip().startswith(expect), r.stderr
    assert not (tmp_path / "ppo").exists()


def test_ppo_refuses_scores_of_another_rollout(pool2, iteration, tmp_path):
    # Same prompts, so the same (prompt_id, sample_index) keys: only the ids tell them apart.
    other = tmp_path / "rollout2"
    pool2.run(rollout.run, RolloutConfig(
        actor=str(iteration / "actor"), prompts=str(iteration / "prompts.jsonl"), out=str(other), id_column="id",
        chunk_size=3, tp=2, sampling=Sampling(samples_per_prompt=2, max_new_tokens=8, seed=6)))
    pool2.run(score.run, ScoreConfig(rollout=str(other), out=str(tmp_path / "scores2"), tp=2,
                                           rewards=[RewardTerm(name="rules_for_tests:response_length")]))
    r = _stage("ppo", {"rollout": str(iteration / "rollout"), "scores": str(tmp_path / "scores2"),
                       "actor": str(iteration / "actor"), "out": str(tmp_path / "ppo")})
    assert r.returncode == 2 and "scores another rollout" in r.stderr and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert not (tmp_path / "ppo").exists()


def test_a_corrupt_checkpoint_is_refused_by_its_readers(iteration, tmp_path):
    import shutil

    bad = tmp_path / "actor"
    shutil.copytree(iteration / "actor", bad)
    shard_file = sorted((bad / "model").glob("*.distcp"))[0]
    data = bytearray(shard_file.read_bytes())
    data[len(data) // 2] ^= 0xFF
    shard_file.write_bytes(bytes(data))
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29533"}
    expect = f"error: {bad}/model/{shard_file.name} does not match its xxh3_128 checksum"
    for stage, cfg in (("rollout", {"actor": str(bad), "prompts": str(iteration / "prompts.jsonl"), "out": str(tmp_path / "r")}),
                       ("ppo", {"rollout": str(iteration / "rollout"), "scores": str(iteration / "scores"),
                                "actor": str(bad), "out": str(tmp_path / "p")})):
        r = subprocess.run([sys.executable, "-m", f"llamarl.stages.{stage}", "--config-json", json.dumps(cfg)],
                           capture_output=True, text=True, timeout=300, env=env)
        assert r.returncode == 2 and r.stderr.strip().startswith(expect), (stage, r.stderr)
        assert publish.read_manifest(cfg["out"]) is None


def test_ppo_refuses_a_rollout_of_another_actor_unless_off_policy(iteration, reference_run, tmp_path):
    r = _stage("ppo", {"rollout": str(iteration / "rollout"), "scores": str(iteration / "scores"),
                       "actor": str(reference_run / "actor"), "out": str(tmp_path / "ppo")})
    assert r.returncode == 2 and "was sampled from another actor" in r.stderr and "off_policy: true" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and not (tmp_path / "ppo").exists()


def test_ppo_refuses_a_temperature_other_than_the_rollouts_naming_both(iteration, tmp_path):
    # The rollout's manifest says it sampled at temperature 1.0 (the default): log-probs at 0.7
    # would be of another policy. The stage checks it, not only a run spec.
    out = tmp_path / "ppo"
    r = _stage("ppo", {"rollout": str(iteration / "rollout"), "scores": str(iteration / "scores"),
                       "actor": str(iteration / "actor"), "out": str(out), "temperature": 0.7})
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert (f"{out}: temperature=0.7 differs from {iteration / 'rollout'}/llamarl.json, sampled at temperature=1.0"
            in r.stderr), r.stderr
    assert not out.exists()


# ---- estimators, importance weights and dynamic sampling as ppo composes them ---------------------------
# ppo_data.advantages on hand-made samples (no model): prompt of 1 token, so a response's tokens sit
# at label positions 0 … len − 1. Reference log-probs 0, so the KL (estimator kl) of a token is its
# log-prob: the rollout's, or the actor's when recomputed.

KLS = [[0.1, 0.2], [0.3, 0.0], [0.4], [0.0, 0.5]]  # per response token
SCORES, GROUPS = [1.0, 3.0, 2.0, 2.0], ["a", "a", "b", "b"]


def _hand_samples():
    from llamarl.stages.ppo_data import Sample

    return [Sample([7] * (1 + len(k)), 1, list(k), s, g) for k, s, g in zip(KLS, SCORES, GROUPS)]


def _advantages(samples=None, actor_logp=None, **kw):
    from llamarl.stages.ppo_data import advantages

    samples = samples or _hand_samples()
    cfg = PPOConfig(rollout="r", scores="s", actor="a", out="o", kl_coef=0.1, **kw)
    ref = {i: [0.0] * s.response_len for i, s in enumerate(samples)}
    return advantages(cfg, samples, ref, None, "cpu", actor_logp)


def _rows(x: torch.Tensor) -> list[list[float]]:
    return [x[b, : len(k)].tolist() for b, k in enumerate(KLS)]


def _whitened(rows: list[list[float]]) -> list[list[float]]:
    import statistics

    flat = [v for r in rows for v in r]
    mean, var = statistics.fmean(flat), statistics.pvariance(flat)
    return [[(v - mean) / (var + 1e-8) ** 0.5 for v in r] for r in rows]


def _close(a: list[list[float]], b: list[list[float]]) -> bool:
    return all(x == pytest.approx(y, abs=1e-5) for ra, rb in zip(a, b) for x, y in zip(ra, rb, strict=True))


def test_rloo_and_reinforce_advantages_hand_computed():
    # Token rewards −0.1·kl, plus the (baselined) score at the last token; the advantage is the
    # sum of the rewards to the end (γ = 1).
    # RLOO: baselines (leave-one-out) 3, 1, 2, 2 → scores −2, 2, 0, 0; not whitened.
    rloo = [[-0.01 - 0.02 - 2, -0.02 - 2], [-0.03 + 2, 2.0], [-0.04], [-0.05, -0.05]]
    assert _close(_rows(_advantages(advantage="rloo")["adv"]), rloo)
    # REINFORCE++: no baseline, whitened over the batch's 7 response tokens.
    plain = [[-0.03 + 1, -0.02 + 1], [-0.03 + 3, 3.0], [-0.04 + 2], [-0.05 + 2, -0.05 + 2]]
    assert _close(_rows(_advantages(advantage="reinforce++")["adv"]), _whitened(plain))
    assert _close(_rows(_advantages(advantage="reinforce++", whiten_advantages=False)["adv"]), plain)
    # REINFORCE++-baseline: the group's mean score (2, 2) subtracted first, then whitened.
    base = [[-0.03 - 1, -0.02 - 1], [-0.03 + 1, 1.0], [-0.04], [-0.05, -0.05]]
    assert _close(_rows(_advantages(advantage="reinforce++-baseline")["adv"]), _whitened(base))
    # With the KL as a loss term the rewards carry none: RLOO is the baselined score on every token.
    assert _close(_rows(_advantages(advantage="rloo", use_kl_loss=True)["adv"]), [[-2, -2], [2, 2], [0], [0, 0]])
    # Dr. GRPO: the group's mean subtracted, no std; GRPO divides by it (std of 1, 3 is √2).
    assert _close(_rows(_advantages(advantage="grpo", grpo_norm_by_std=False)["adv"]), [[-1, -1], [1, 1], [0], [0, 0]])
    r = 1 / (2**0.5 + 1e-6)
    assert _close(_rows(_advantages(advantage="grpo")["adv"]), [[-r, -r], [r, r], [0], [0, 0]])


def test_recomputed_old_logprobs_and_truncated_importance_weights():
    # The actor's log-probs differ from the rollout's by 0, ln 3, −1, 0, 0, 0, 0.
    import math

    delta = [[0.0, math.log(3)], [-1.0, 0.0], [0.0], [0.0, 0.0]]
    actor = {i: [k + d for k, d in zip(KLS[i], delta[i])] for i in range(4)}
    data = _advantages(advantage="rloo", actor_logp=actor, old_logp="actor", tis_cap=2.0)
    assert _close(_rows(data["old_logp"]), [actor[i] for i in range(4)])  # π_old: the actor's
    # w = min(π_old / π_rollout, 2): 1, 3 → 2 (truncated), e^−1, then 1s
    assert _close(_rows(data["tis"]), [[1, 2], [math.exp(-1), 1], [1], [1, 1]])
    stats = data["tis_stats"]
    assert stats["tis_weight_mean"] == pytest.approx((5 + 2 + math.exp(-1)) / 7)
    assert stats["tis_weight_max"] == 2.0 and stats["tis_truncated"] == pytest.approx(1 / 7)
    # the reward's KL is the actor's: sample 0's second token carries −0.1·(0.2 + ln 3)
    assert data["adv"][0, 1].item() == pytest.approx(-0.1 * (0.2 + math.log(3)) - 2, abs=1e-6)
    # TIS over the rollout's own log-probs: every weight exactly 1.
    same = _advantages(advantage="rloo", tis="on")
    assert torch.equal(same["tis"] * same["resp"], same["resp"]) and same["tis_stats"]["tis_truncated"] == 0
    assert "tis" not in _advantages(advantage="rloo")  # off by default on-policy


def test_old_logp_and_tis_resolve_from_off_policy():
    base = dict(rollout="r", scores="s", actor="a", out="o")
    on, off = PPOConfig(**base), PPOConfig(**base, off_policy=True)
    assert (on.old_logp_source(), on.uses_tis()) == ("rollout", False)
    assert (off.old_logp_source(), off.uses_tis()) == ("actor", True)
    assert PPOConfig(**base, old_logp="actor").uses_tis() and not PPOConfig(**base, off_policy=True, tis="off").uses_tis()


def test_dynamic_sampling_drops_equal_groups_and_takes_train_groups_by_seed():
    from llamarl.lib.errors import UserError
    from llamarl.stages.ppo_data import Sample, dynamic_sampling

    scores = {"p0": [1, 1], "p1": [0, 1], "p2": [2, 2], "p3": [0, 3], "p4": [5], "p5": [1, 0], "p6": [4, 2]}
    samples = [Sample([7, 7], 1, [0.0], float(s), g) for g, ss in scores.items() for s in ss]
    cfg = dict(rollout="r", scores="s", actor="a", out="o", dynamic_sampling=True)
    kept, stats = dynamic_sampling(PPOConfig(**cfg), samples, start_step=0)
    assert [s.group for s in kept] == ["p1", "p1", "p3", "p3", "p5", "p5", "p6", "p6"]
    assert stats == {"groups": 7, "dropped": 3, "kept": 4, "trained": 4, "short": 0}
    some, stats = dynamic_sampling(PPOConfig(**cfg, train_groups=2), samples, start_step=0)
    picked = list(dict.fromkeys(s.group for s in some))
    assert len(picked) == 2 and set(picked) <= {"p1", "p3", "p5", "p6"} and picked == sorted(picked)  # rollout order
    assert stats["trained"] == 2 and stats["kept"] == 4
    # the same choice on a rerun; another iteration (actor step) draws anew
    assert dynamic_sampling(PPOConfig(**cfg, train_groups=2), samples, start_step=0)[0] == some
    draws = {tuple(dict.fromkeys(s.group for s in dynamic_sampling(PPOConfig(**cfg, train_groups=2), samples, k)[0]))
             for k in range(0, 40, 4)}
    assert len(draws) > 1
    assert dynamic_sampling(PPOConfig(**cfg, train_groups=6), samples, 0)[1]["short"] == 2
    assert dynamic_sampling(PPOConfig(**{**cfg, "dynamic_sampling": False}), samples, 0) == (samples, None)
    with pytest.raises(UserError, match=r"every one of its 2 prompts has equal scores.*dynamic_sampling: false"):
        dynamic_sampling(PPOConfig(**cfg), samples[:2] + samples[4:6], 0)


@pytest.mark.parametrize("changes,needle", [
    ({"loss_agg_norm": 512}, "ppo: loss_agg_norm is read by loss_agg='seq-mean-token-sum-norm' only"),
    ({"grpo_norm_by_std": False}, "ppo: grpo_norm_by_std applies to advantage='grpo' only"),
    ({"train_groups": 8}, "ppo: train_groups is the batch of dynamic_sampling, which is off; set dynamic_sampling: true"),
    ({"tis_cap": 0.5}, "ppo: tis_cap=0.5: Input should be greater than or equal to 1"),
    ({"tis": "yes"}, "ppo: tis='yes': Input should be 'auto', 'on' or 'off'"),
    ({"policy_loss": "grpo"}, "ppo: policy_loss='grpo': Input should be 'ppo', 'gspo', 'cispo' or 'sapo'"),
    ({"policy_loss": "gspo", "dual_clip": None}, "ppo: dual_clip is read by policy_loss 'ppo' only (it is 'gspo'); "
                                                 "remove dual_clip or change policy_loss"),
    ({"policy_loss": "sapo", "clip_eps_high": 0.28}, "ppo: clip_eps_high is read by policy_loss 'ppo' or 'gspo' only"),
    ({"policy_loss": "cispo", "clip_eps": 0.1}, "ppo: clip_eps is read by policy_loss 'ppo' or 'gspo' only"),
    ({"cispo_cap": 2.0}, "ppo: cispo_cap is read by policy_loss 'cispo' only (it is 'ppo')"),
    ({"policy_loss": "gspo", "sapo_tau_neg": 2.0}, "ppo: sapo_tau_neg is read by policy_loss 'sapo' only"),
    ({"policy_loss": "cispo", "cispo_cap": 0.5}, "ppo: cispo_cap=0.5: Input should be greater than or equal to 1"),
    ({"policy_loss": "sapo", "sapo_tau_pos": float("inf")}, "ppo: sapo_tau_pos=inf: Input should be a finite number"),
    ({"policy_loss": "sapo", "sapo_tau_neg": 0}, "ppo: sapo_tau_neg=0: Input should be greater than 0"),
    ({"tis": "off", "tis_level": "sequence"}, "ppo: tis_level chooses what tis weighs, and tis is off"),
    ({"tis_level": "response"}, "ppo: tis_level='response': Input should be 'token' or 'sequence'"),
], ids=["agg-norm", "grpo-std", "train-groups", "tis-cap", "tis", "policy-loss", "dual-clip-gspo", "clip-high-sapo",
        "clip-cispo", "cispo-cap-ppo", "tau-gspo", "cispo-cap-low", "tau-inf", "tau-zero", "tis-level-off", "tis-level"])
def test_new_options_refuse_bad_values_in_one_line(changes, needle):
    from llamarl.lib.errors import UserError

    with pytest.raises(UserError) as e:
        PPOConfig.parse({"rollout": "r", "scores": "s", "actor": "a", "out": "o", **changes}, "spec: ppo")
    assert needle in str(e.value) and "\n" not in str(e.value)


# ---- a step that goes non-finite --------------------------------------------------------------------------


def _ppo_until_it_fails(cfg: PPOConfig, hook: str) -> str | None:
    """``ppo.run`` on this rank with ``LLAMARL_TEST_PPO_AT=hook``: its one-line error (None if it finished)."""
    from llamarl.lib.errors import UserError

    os.environ["LLAMARL_TEST_PPO_AT"] = hook
    try:
        ppo.run(cfg)
    except UserError as e:
        return str(e)
    finally:
        del os.environ["LLAMARL_TEST_PPO_AT"]
    return None


@pytest.mark.slow
@pytest.mark.parametrize("layout", [dict(pp=2), dict(dp=2)], ids=["pp2", "dp2"])
def test_a_non_finite_step_stops_every_rank_at_that_step(pool2, iteration, tmp_path, layout):
    # pp2: the losses live on the last stage alone; dp2: each rank owns half the masters (ZeRO-1).
    # The ranks agree on the step's flags in one all-reduce: every rank stops with the same line,
    # none is left waiting in a collective (the pool would time out), nothing is published.
    out = tmp_path / "run"
    lines = pool2.run(_ppo_until_it_fails, _cfg(iteration, out, **layout), "step 2:lr=inf")
    assert lines[0] == lines[1] and lines[0].startswith("ppo optimizer step 2: actor masters not finite"), lines
    assert publish.read_manifest(str(out)) is None and not (out / "actor").exists() and not (out / "metrics.jsonl").exists()


def _ppo_leaves_behind(cfg_json: dict, freeze: bool) -> list[str]:
    """``ppo.run`` in this process, as a resident worker runs it (``cluster/worker.py``: the
    stage, then a full collection), with nothing kept for a next ppo: which of the trainers'
    models and optimizers are still alive after it. ``freeze``: the stage's heap freeze as it is,
    else a no-op."""
    import gc
    import weakref

    from llamarl.stages import ppo_kept

    refs, hook, real = {}, ppo._test_hook, ppo.job.freeze_heap

    def hooked(point, trainers=None):
        if trainers and not refs:
            for name, t in trainers.items():
                refs[f"{name} model"], refs[f"{name} optimizer"] = weakref.ref(t.model), weakref.ref(t.opt)
        hook(point, trainers)

    ppo._test_hook = hooked
    if not freeze:
        ppo.job.freeze_heap = lambda: None
    try:
        ppo.run(PPOConfig(**cfg_json))
    finally:
        ppo._test_hook, ppo.job.freeze_heap = hook, real
        ppo_kept._kept = None  # let go, as a next ppo's take does when it cannot use them
    gc.collect()
    return sorted(name for name, r in refs.items() if r() is not None)


@pytest.mark.slow
def test_a_resident_worker_gets_back_what_ppo_built(pool1, iteration, tmp_path):
    # A resident worker runs many ppo stages in one process and frees what each built with a full
    # collection after it (cluster/worker.py, serve). ppo's heap freeze after its first step hides
    # every object alive then (models, optimizers, the data) from the collector for good: whatever
    # of it sits in a reference cycle would outlive the stage, its device memory with it.
    [no_freeze] = pool1.run(_ppo_leaves_behind, _cfg(iteration, tmp_path / "a").to_json(), False)
    assert no_freeze == [], no_freeze  # the check can see a leak only if the stage leaves none itself
    [frozen] = pool1.run(_ppo_leaves_behind, _cfg(iteration, tmp_path / "b").to_json(), True)
    assert frozen == [], f"alive after the stage and a full collection: {frozen}"


def test_ppo_refuses_a_reference_that_is_no_checkpoint_of_the_actors_model_in_one_line(iteration, tmp_path):
    import shutil

    shaped = tmp_path / "other-shape"
    shutil.copytree(iteration / "actor", shaped)
    manifest = json.loads((shaped / publish.MANIFEST).read_text())
    manifest["model_config"]["num_layers"] += 1
    (shaped / publish.MANIFEST).write_text(json.dumps(manifest))
    for reference, why in ((tmp_path / "nowhere", f"{tmp_path / 'nowhere'}"),
                           (shaped, f"{shaped}: the reference is not of the model of {iteration / 'actor'}")):
        out = tmp_path / "ppo"
        r = _stage("ppo", {"rollout": str(iteration / "rollout"), "scores": str(iteration / "scores"),
                           "actor": str(iteration / "actor"), "out": str(out), "reference": str(reference)})
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        assert why in r.stderr, r.stderr
        assert not out.exists()


# ---- retention.train_state_every: a state left in memory --------------------------------------------------


def _ppo_one_line(cfg: PPOConfig) -> str | None:
    """``ppo.run`` on this rank: its one-line error (None if it finished)."""
    from llamarl.lib.errors import UserError

    try:
        ppo.run(cfg)
    except UserError as e:
        return str(e)
    return None


def test_a_ppo_outside_a_resident_worker_writes_the_state_it_cannot_keep(pool1, iteration, reference_run, tmp_path):
    # A stage process's memory ends with it: write_train_state false writes the state all the same,
    # the bytes of a ppo told to write it.
    # A path as long as reference_run's, which .metadata records.
    out = reference_run.parent.parent / "w".ljust(len(reference_run.parent.name), "x") / reference_run.name
    pool1.run(ppo.run, _cfg(iteration, out, write_train_state=False))
    assert _output_bytes(out, reference_run) == _output_bytes(reference_run, reference_run)
    assert publish.require_published(str(out), "ppo")["summary"]["train_state"] == "written"
    # A state published as not written, that no process holds: the next ppo refuses it in one line.
    left = tmp_path / "left"
    shutil.copytree(out, left)
    for role in ("actor", "critic"):
        state = left / "train_state" / role
        manifest = publish.read_manifest(str(state))
        shutil.rmtree(state)
        state.mkdir()
        publish.publish_unwritten(str(state), manifest, "kept in memory")
    errors = pool1.run(_ppo_one_line, _cfg(iteration, tmp_path / "it2", actor=str(left / "actor"),
                                           critic=str(left / "critic"), reference=str(iteration / "actor"),
                                           ppo_epochs=1, off_policy=True))
    assert errors[0].startswith(f"{left}/train_state/actor was not written: its ppo left it in its run's resident "
                                "workers"), errors
    assert "\n" not in errors[0] and not (tmp_path / "it2" / "actor").exists()
