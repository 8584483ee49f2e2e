"""Stage ppo: one PPO iteration — update the actor and critic from a rollout and its scores.

Run with tp × pp × dp processes (``llamarl stage ppo …``). The recipe:

1. join rollout and scores on (prompt_id, sample_index); with dynamic sampling, drop the prompts
   whose scores are all equal;
2. reference log-probs (a forward of the frozen initial actor, freed once done, only where the
   rollout's or the actor's own give none: ``ppo_trainer.reference_source``), old values (critic)
   and, when π_old is the actor's (``old_logp``), the actor's own log-probs before any update, the
   batch split over DP;
3. token rewards (score at the last token, minus β·KL unless KL is a loss term), the advantages
   (GAE, GRPO, RLOO, REINFORCE++), whitening, truncated importance weights;
4. ``ppo_epochs`` passes over shuffled mini-batches; each mini-batch is one optimizer step of the
   actor (clipped/dual-clip policy loss, entropy bonus, optional KL loss) and of the critic (clipped
   value loss), micro-batched by a token budget with gradient accumulation, gradients reduced over
   DP from one buffer, clipped by the global norm, AdamW with ZeRO-1;
5. the outputs, weights first: each role's checkpoint ``OUT/<role>`` (published as soon as the last
   step is done: the next rollout and export read nothing else), the gradient memory freed, then
   each role's training state ``OUT/train_state/<role>`` (fp32 moments and masters, 6× the bf16
   weights, read only by the next ppo), metrics.jsonl, and the stage's manifest last.

Training state is saved every ``save_every`` steps under ``OUT/.state``; a rerun resumes from the
latest and ends with the same weights as an uninterrupted run (the data order depends only on
the seed); what the interrupted run had published inside ``OUT`` (weights, training state) is
written again, whole. Mini-batches and micro-batches depend only on the data, never on the layout.

This module is the recipe; the work is in ``ppo_data`` (1, 3 and the batches), ``ppo_trainer``
(2 and 4: the models, one ``Trainer`` per role) and ``ppo_state`` (5 and the saved state).
"""

from __future__ import annotations

import os
import signal
import time

import torch
import torch.distributed as dist

from llamarl.lib.files import checkpoint, outputs, publish
from llamarl.lib import dtypes
from llamarl.lib.runtime import job
from llamarl.lib.distributed import parallel
from llamarl.lib.model.config import LlamaConfig, ParallelLayout, compute_dtype
from llamarl.lib.errors import UserError
from llamarl.stages import contract, space
from llamarl.stages.config import PPOConfig
from llamarl.stages.ppo_checks import StepCheck, check_schedule
from llamarl.stages.ppo_data import (
    advantages,
    check_groups,
    dynamic_sampling,
    load_samples,
    micro_batches,
    mini_batch,
)
from llamarl.stages.ppo_metrics import finite_or_null, json_lines
from llamarl.stages.ppo_state import (
    clear_published,
    clear_state,
    metrics_on_rank0,
    optim_url,
    resume,
    save_state,
    save_train_state,
    save_weights,
    verify_train_state,
)
from llamarl.stages.ppo_trainer import (Trainer, frozen_logprobs, gather_dp, reference_source, token_outputs,
                                        train_step)


def run(cfg: PPOConfig) -> None:
    space.check(cfg)
    # 0. inputs checked before any process group or weights
    dtype = compute_dtype(cfg.dtype, parallel.device())
    actor_m = contract.require_checkpoint(cfg.actor, "lm", "the actor")
    model_cfg = LlamaConfig.from_dict(actor_m["model_config"])
    layout = ParallelLayout(tp=cfg.tp, pp=cfg.pp, sequence_parallel=cfg.sequence_parallel, remove_padding=True)
    layout.check(model_cfg)
    start_step = actor_m.get("train_state", {}).get("step", 0)
    samples = load_samples(cfg.rollout, cfg.scores)
    rollout_request = publish.read_manifest(cfg.rollout)["request"]
    sampled_from = rollout_request["actor_id"]
    if not cfg.off_policy and sampled_from != publish.output_id(cfg.actor):
        raise UserError(f"{cfg.rollout} was sampled from another actor (id {sampled_from}) than {cfg.actor} "
                        f"(id {publish.output_id(cfg.actor)}); point at the actor it was sampled from, or set "
                        "off_policy: true")
    joined_score = sum(s.score for s in samples) / len(samples)  # the rollout's, whatever is trained on
    joined_length = sum(s.response_len for s in samples) / len(samples)
    samples, sampling_stats = dynamic_sampling(cfg, samples, start_step)
    check_groups(cfg, samples)
    total = cfg.ppo_epochs * -(-len(samples) // cfg.mini_batch_size)
    check_schedule(cfg, start_step, total)
    agg_norm = _agg_norm(cfg, rollout_request)
    reference = cfg.reference or cfg.actor
    ref_source = reference_source(cfg, publish.output_id(reference), publish.output_id(cfg.actor), rollout_request)
    use_critic = cfg.advantage == "gae"
    critic_m = contract.require_checkpoint(cfg.critic, "score", "a critic") if cfg.critic and use_critic else None
    # Each role's training state, when it lies beside its checkpoint (not inside, not none).
    states = {role: contract.require_train_state(url, m) for role, url, m in
              ((contract.ACTOR, cfg.actor, actor_m), (contract.CRITIC, cfg.critic, critic_m)) if m is not None}

    topo = parallel.init(cfg.tp, cfg.pp, dp=cfg.dp, timeout_s=cfg.collective_timeout_s, stage="ppo")
    rank = dist.get_rank()
    out = cfg.out.rstrip("/")
    request = {"kind": contract.PPO, "actor_id": publish.output_id(cfg.actor), "rollout_id": publish.output_id(cfg.rollout),
               "scores_id": publish.output_id(cfg.scores), "reference_id": publish.output_id(reference),
               "critic_id": publish.output_id(cfg.critic) if critic_m else None,
               "config": cfg.identity()}
    if contract.skip_if_current(out, {"request": request}, "this PPO iteration is already done", request):
        return
    if rank == 0:
        clear_published(out)  # a resumed run writes its outputs again, whole
    read = (cfg.actor, reference if ref_source == "forward" else None, cfg.critic if critic_m else None)
    for root in dict.fromkeys(filter(None, (cfg.actor, reference, cfg.critic if critic_m else None))):
        manifest = publish.require_published(root, contract.CHECKPOINT)
        if root in read:  # weights (and old optim/)
            outputs.verify_input(root, manifest, "")
    for role, found in states.items():
        if found is not None:
            verify_train_state(*found, cfg.actor if role == contract.ACTOR else cfg.critic)

    # 1. the models
    from llamarl.lib.model.llama import ParallelLlamaForCausalLM, ParallelLlamaForValue

    clock = _Clock()
    dev = parallel.device()
    store_dtype = dtypes.torch_dtype(actor_m["dtype"])  # checkpoints keep the actor's stored dtype
    with torch.device(dev):
        actor = ParallelLlamaForCausalLM(model_cfg, layout, dtype=dtype)
    checkpoint.load_model(actor, f"{cfg.actor}/{contract.MODEL}")
    critic = None
    if use_critic:
        with torch.device(dev):
            critic = ParallelLlamaForValue(model_cfg, layout, dtype=dtype)
        _load_critic(critic, cfg)
    clock.lap("load")

    # 2. reference log-probs and old values, the samples split over DP
    mine = [i for i in range(len(samples)) if i % topo.dp == topo.dp_rank]
    groups = micro_batches(mine, samples, cfg.micro_batch_tokens)
    # π_old recomputed before any update (a resumed run recomputes it from the same input actor).
    ref_logp, actor_logp = frozen_logprobs(cfg, ref_source, samples, groups, actor, reference)
    old_values = token_outputs(critic, samples, groups, 1.0) if use_critic else None
    old_values = gather_dp(dict(zip([i for g in groups for i in g], old_values)) if old_values is not None else None,
                           topo)

    # 3. rewards and advantages (on the last stage, where losses are computed), checked on every rank
    data = advantages(cfg, samples, ref_logp, old_values, dev, actor_logp) if topo.is_last_stage else None
    check = StepCheck(cfg, [s.score for s in samples], dev, store_dtype)
    if data is not None:
        check.watch("log-probs", data["old_logp"], *(data[k] for k in ("ref_logp", "tis") if k in data))
        check.watch("advantages", data["adv"])
        check.watch("returns", data["returns"], data["values"])
    check.verify("before the first optimizer step")
    clock.lap("reference")

    # 4. the epochs: one trainer per role (the critic only for GAE)
    actor_optim = optim_url(cfg.actor, actor_m, states.get(contract.ACTOR))
    trainers = {contract.ACTOR: Trainer(actor, cfg.actor_lr, cfg, actor_optim, f"{cfg.actor}/{contract.MODEL}", start_step)}
    if critic is not None:
        critic_optim = optim_url(cfg.critic, critic_m, states.get(contract.CRITIC))
        trainers[contract.CRITIC] = Trainer(critic, cfg.critic_lr, cfg, critic_optim,
                                            f"{cfg.critic}/{contract.MODEL}" if critic_m else None, start_step)
    done, metrics_lines = resume(out, trainers, start_step)
    clock.lap("load")
    update_tokens = 0
    for k in range(done, total):
        epoch, batch_idx = mini_batch(cfg, len(samples), k)
        step = start_step + k
        _test_hook(f"step {step + 1}", trainers)
        t0 = time.perf_counter()
        m = train_step(cfg, trainers, samples, data, batch_idx, step, dev, agg_norm, check)
        m.update(step=step + 1, epoch=epoch, seconds=time.perf_counter() - t0)
        update_tokens += m["tokens"]
        metrics_lines.append(m)
        if cfg.save_every and (k + 1) % cfg.save_every == 0 and k + 1 < total:
            clock.lap("update")
            save_state(out, k + 1, trainers, store_dtype, metrics_on_rank0(metrics_lines, topo))
            clock.lap("save")
    clock.lap("update")

    # 5. outputs, weights first: the next rollout and export can start from them while the
    # training state (6x their bytes) is written.
    final = start_step + total
    for name, trainer in trainers.items():
        save_weights(f"{out}/{name}", name, trainer, cfg.actor, actor_m, final, store_dtype)
        _test_hook(f"published {name}")
    clock.lap("weights")
    # Free what no output needs (gradients, the batch's tensors) for a stage that may now share
    # the device: a rollout from these weights.
    tis_mine = [data["tis_stats"]] if data and cfg.uses_tis() else None
    data = None
    for trainer in trainers.values():
        trainer.free_gradients()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    for name, trainer in trainers.items():
        save_train_state(out, name, trainer, final)
        _test_hook(f"published {contract.TRAIN_STATE}/{name}")
    clock.lap(contract.TRAIN_STATE)
    lines = metrics_on_rank0(metrics_lines, topo)
    tis = metrics_on_rank0(tis_mine, topo) if cfg.uses_tis() else None
    if rank == 0:
        publish.write_bytes(f"{out}/{contract.METRICS}", json_lines(lines))
        files = {contract.METRICS: publish.file_entry(f"{out}/{contract.METRICS}")}
        _test_hook("wrote metrics")
        summary = {"steps": total, "seconds": clock.laps, "dtype": dtypes.name(dtype),
                   # Tokens through the actor's forward and backward, over all DP ranks.
                   "update_tokens": update_tokens,
                   "update_tokens_per_s": update_tokens / max(clock.laps["update"], 1e-9),
                   # The rollout's, over every sample (dynamic sampling may train on fewer).
                   "mean_score": joined_score, "mean_response_length": joined_length,
                   "trained_samples": len(samples), "old_logp": cfg.old_logp_source(), "ref_logp": ref_source,
                   "tis": tis[0] if tis else None, "dynamic_sampling": sampling_stats}
        # The id of each sub-output: the stage's own id changes with any of them.
        parts = [*trainers, *(f"{contract.TRAIN_STATE}/{name}" for name in trainers)]
        publish.publish(out, {"kind": contract.PPO, "timing": outputs.timing(), "request": request, "files": files,
                              "summary": finite_or_null(summary), "actor": contract.ACTOR,
                              "critic": contract.CRITIC if critic is not None else None,
                              "train_state": {name: f"{contract.TRAIN_STATE}/{name}" for name in trainers},
                              "outputs": {p: publish.output_id(f"{out}/{p}") for p in parts},
                              "final_step": final})
        clear_state(out)
        if sampling_stats:
            print(f"{out}: dynamic sampling kept {sampling_stats['kept']} of {sampling_stats['groups']} prompts "
                  f"(scores all equal in {sampling_stats['dropped']}), trains on {sampling_stats['trained']}"
                  + (f", {sampling_stats['short']} short of train_groups" if sampling_stats["short"] else ""), flush=True)
        print(f"{out}: {total} PPO steps, mean score {summary['mean_score']:.4f}, update "
              f"{summary['update_tokens_per_s']:.0f} tokens/s ({', '.join(f'{k} {v:.1f}s' for k, v in clock.laps.items())})",
              flush=True)
    dist.barrier()


class _Clock:
    """Wall time per phase (summed when a phase recurs), for the summary."""

    def __init__(self):
        self.laps: dict[str, float] = {}
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.laps[phase] = self.laps.get(phase, 0.0) + now - self._t
        self._t = now


def _agg_norm(cfg: PPOConfig, rollout_request: dict) -> int | None:
    """seq-mean-token-sum-norm's constant: ``loss_agg_norm``, or the rollout's max_new_tokens."""
    if cfg.loss_agg != "seq-mean-token-sum-norm":
        return None
    if cfg.loss_agg_norm is not None:
        return cfg.loss_agg_norm
    norm = rollout_request.get("config", {}).get("sampling", {}).get("max_new_tokens")
    if norm is None:
        raise UserError(f"{cfg.rollout}: its manifest does not say the rollout's max_new_tokens, the default of "
                        "loss_agg_norm; set loss_agg_norm")
    return norm


def _test_hook(point: str, trainers: dict | None = None) -> None:
    """Tests stop a run at a point of its publication: ``LLAMARL_TEST_PPO_AT="<point>:kill"`` kills
    every process there (as a preemption would), ``"<point>:sleep=S"`` holds it S seconds (a slow
    write). Points: "published actor", "published critic", "published train_state/actor", …,
    "wrote metrics" (rank 0, before the manifest); and "step N" (before optimizer step N, every
    rank), where ``"step N:lr=X"`` sets every role's learning rate to X (inf included), which no
    config can: the step check's test."""
    spec = os.environ.get("LLAMARL_TEST_PPO_AT", "")
    where, _, action = spec.rpartition(":")
    if where != point:
        return
    if action == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    if action.startswith("lr="):
        for trainer in trainers.values():
            trainer.lr = float(action.removeprefix("lr="))
        return
    time.sleep(float(action.removeprefix("sleep=")))


def _load_critic(critic, cfg: PPOConfig) -> None:
    if cfg.critic:
        checkpoint.load_model(critic, f"{cfg.critic}/{contract.MODEL}")
        return
    # A fresh critic: the actor's backbone and a zero value head.
    with torch.no_grad():
        for p in critic.parameters():
            p.zero_()
    state = {k: v for k, v in checkpoint.model_state(critic).items() if k != "score.weight"}
    checkpoint.load(state, f"{cfg.actor}/{contract.MODEL}")


if __name__ == "__main__":
    job.main(PPOConfig, run)
