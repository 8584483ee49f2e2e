"""Stage ppo: the layout does not change the math; interrupted and resumed equals uninterrupted."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest
import torch

from llamarl.lib import checkpoint, hf_layout, publish
from llamarl.lib.config import LlamaConfig
from llamarl.pipeline import toy
from llamarl.stages import ppo, rollout, score, shard


@pytest.fixture(scope="module")
def iteration(tmp_path_factory, pool2):
    """An actor, a rollout of it and rule-based scores: the inputs of one PPO iteration."""
    root = tmp_path_factory.mktemp("ppo")
    toy.make_llama(str(root / "actor_hf"), num_layers=3)
    pool2.run(shard.run, shard.ShardConfig(src=str(root / "actor_hf"), dst=str(root / "actor"), tp=2))
    prompts = toy.make_prompts(str(root / "prompts.jsonl"), n=6)
    pool2.run(rollout.run, rollout.RolloutConfig(
        actor=str(root / "actor"), prompts=prompts, out=str(root / "rollout"), id_column="id", chunk_size=3, tp=2,
        sampling=rollout.Sampling(samples_per_prompt=2, max_new_tokens=8, seed=5)))
    pool2.run(score.run, score.ScoreConfig(rollout=str(root / "rollout"), out=str(root / "scores"), tp=2,
                                           rewards=[score.RewardTerm(name="rules_for_tests:response_length", weight=0.1)]))
    return root


def _cfg(root, out, **kw):
    base = dict(rollout=str(root / "rollout"), scores=str(root / "scores"), actor=str(root / "actor"), out=str(out),
                mini_batch_size=4, micro_batch_tokens=40, ppo_epochs=2, actor_lr=1e-3, critic_lr=1e-3, kl_coef=0.1,
                entropy_coef=0.01, seed=1)
    base.update(kw)
    return ppo.PPOConfig(**base)


def _weights(ckpt: str) -> dict[str, torch.Tensor]:
    manifest = publish.require_published(ckpt, "checkpoint")
    cfg = LlamaConfig.from_dict(manifest["model_config"])
    state = {n: torch.empty(s) for n, s in hf_layout.hf_shapes(cfg, manifest["head"]).items()}
    checkpoint.load(state, f"{ckpt}/model")
    return state


def _rel_diff(a: dict, b: dict) -> float:
    return max(((a[k] - b[k]).norm() / b[k].norm().clamp(min=1e-12)).item() for k in b)


@pytest.fixture(scope="module")
def reference_run(iteration, pool1, tmp_path_factory):
    out = tmp_path_factory.mktemp("ref") / "tp1"
    pool1.run(ppo.run, _cfg(iteration, out))
    return out


@pytest.mark.parametrize("layout", [dict(tp=2), dict(pp=2), dict(dp=2), dict(tp=2, sequence_parallel=True)],
                         ids=["tp2", "pp2", "dp2", "tp2-sp"])
def test_layout_does_not_change_the_update(pool2, iteration, reference_run, tmp_path, layout):
    pool2.run(ppo.run, _cfg(iteration, tmp_path / "run", **layout))
    before = _weights(str(iteration / "actor"))
    ref_actor, actor = _weights(str(reference_run / "actor")), _weights(str(tmp_path / "run" / "actor"))
    moved = max(((ref_actor[k] - before[k]).norm() / before[k].norm()).item() for k in before)
    assert moved > 1e-3  # the update did something
    assert _rel_diff(actor, ref_actor) < 1e-5
    assert _rel_diff(_weights(str(tmp_path / "run" / "critic")), _weights(str(reference_run / "critic"))) < 1e-5


def test_outputs_metrics_and_checkpoint_format(reference_run, iteration):
    lines = [json.loads(x) for x in open(reference_run / "metrics.jsonl")]
    assert len(lines) == 6  # 12 samples / 4 per mini-batch × 2 epochs
    for key in ("policy_loss", "value_loss", "entropy", "approx_kl", "clip_fraction", "actor_grad_norm", "actor_lr",
                "mean_score", "mean_response_length", "kl", "seconds"):
        assert key in lines[0], key
    assert lines[0]["entropy"] > 0 and lines[0]["actor_lr"] == 1e-3
    m = publish.require_published(str(reference_run / "actor"), "checkpoint")
    assert m["train_state"]["step"] == 6 and any(k.startswith("optim/") for k in m["files"])
    assert any(k.startswith("hf/tokenizer") for k in m["files"])  # rollout of the next iteration needs it
    assert publish.require_published(str(reference_run / "critic"), "checkpoint")["head"] == "score"
    assert publish.require_published(str(reference_run), "ppo")["final_step"] == 6


def test_next_iteration_continues_optimizer_state(pool1, iteration, reference_run, tmp_path):
    # The updated actor is a valid input: a second iteration loads its moments and step count.
    pool1.run(ppo.run, _cfg(iteration, tmp_path / "it2", actor=str(reference_run / "actor"),
                            critic=str(reference_run / "critic"), reference=str(iteration / "actor"), ppo_epochs=1))
    lines = [json.loads(x) for x in open(tmp_path / "it2" / "metrics.jsonl")]
    assert lines[0]["step"] == 7
    assert publish.require_published(str(tmp_path / "it2" / "actor"))["train_state"]["step"] == 9


def test_grpo_and_kl_loss_variants_run(pool2, iteration, tmp_path):
    pool2.run(ppo.run, _cfg(iteration, tmp_path / "grpo", tp=2, advantage="grpo", use_kl_loss=True,
                            kl_estimator="low_var_kl", loss_agg="seq-mean-token-mean"))
    lines = [json.loads(x) for x in open(tmp_path / "grpo" / "metrics.jsonl")]
    assert all(torch.isfinite(torch.tensor(x["policy_loss"])) for x in lines)


@pytest.mark.slow
def test_interrupted_between_steps_then_resumed_equals_uninterrupted(iteration, reference_run, tmp_path):
    opts = tmp_path / "opts.yaml"
    opts.write_text("mini_batch_size: 4\nmicro_batch_tokens: 40\nppo_epochs: 2\nactor_lr: 0.001\ncritic_lr: 0.001\n"
                    "kl_coef: 0.1\nentropy_coef: 0.01\nseed: 1\nsave_every: 1\n")
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
    assert _rel_diff(_weights(str(out / "actor")), _weights(str(reference_run / "actor"))) < 1e-6
    assert _rel_diff(_weights(str(out / "critic")), _weights(str(reference_run / "critic"))) < 1e-6
