"""Stage ppo: one PPO iteration — update the actor and critic from a rollout and its scores.

Run with tp × pp × dp processes (``llamarl stage ppo …``); ``run`` is the recipe, one named step a
line. What it writes, in which order, and how a rerun resumes to the same bytes: docs/formats.md,
"What ppo writes, when"; the estimators and losses: docs/rl.md.
"""

from __future__ import annotations

import os
import signal
import time
from dataclasses import dataclass

import torch
import torch.distributed as dist

from llamarl.lib.files import checkpoint, dcp_format, outputs, publish
from llamarl.lib import dtypes
from llamarl.lib.runtime import job
from llamarl.lib.distributed import parallel
from llamarl.lib.model.config import LlamaConfig, ParallelLayout, compute_dtype
from llamarl.lib.errors import UserError
from llamarl.stages import contract, identity, ppo_kept, space
from llamarl.stages.config import PPOConfig
from llamarl.stages.ppo_checks import StepCheck, check_schedule
from llamarl.stages.ppo_data import advantages, check_groups, dynamic_sampling, load_samples, micro_batches, mini_batch
from llamarl.stages.ppo_metrics import finite_or_null, json_lines
from llamarl.stages.ppo_state import (clear_published, clear_state, metrics_on_rank0, optim_url, resume, save_state,
                                      save_train_state, save_unwritten_state, save_weights, verify_train_state)
from llamarl.stages.ppo_batches import StepBatches
from llamarl.stages.ppo_trainer import Trainer, frozen_logprobs, gather_dp, reference_source, token_outputs, train_step


@dataclass
class _Inputs:
    """What ppo learns of its inputs before any process group or weight: checked, one line each."""

    actor: dict  # the actor's checkpoint manifest
    critic: dict | None  # the critic's, when gae trains one from a checkpoint
    states: dict[str, tuple[str, dict] | None]  # each role's training state beside its checkpoint
    model_cfg: LlamaConfig
    layout: ParallelLayout
    samples: list
    sampling_stats: dict | None  # dynamic sampling's counts
    joined: dict  # the rollout's mean score and response length, over every sample
    start_step: int
    steps: int
    agg_norm: int | None
    request: dict
    ref_source: str  # where π_ref's log-probs come from (``ppo_trainer.reference_source``)


def run(cfg: PPOConfig) -> None:
    dcp_format.start_metadata_import()  # loading and saving read and write .metadata: DCP's import beside
    room = space.check(cfg, defer=True)  # a wait for the run's trash comes before the first write
    clock = _Clock()
    inputs = _read_inputs(cfg)
    topo = parallel.init(cfg.tp, cfg.pp, dp=cfg.dp, timeout_s=cfg.collective_timeout_s, stage="ppo")
    out = cfg.out.rstrip("/")
    if identity.skip_if_current(out, inputs.request, "this PPO iteration is already done"):
        return
    ppo_kept.reference_from = None  # no reference model read, unless ``frozen_logprobs`` reads one
    if dist.get_rank() == 0:
        clear_published(out)  # what an interrupted run published inside ``out``: written again, whole
    dtype = compute_dtype(cfg.dtype, parallel.device())
    where = ppo_kept.place(cfg, inputs.layout, inputs.model_cfg, dtype, topo, inputs.start_step)
    kept = ppo_kept.take(_wanted(cfg, inputs), where, topo)
    ppo_kept.refuse_unwritten([url for url, _ in filter(None, inputs.states.values())], kept)
    clock.lap("inputs")
    _verify_inputs(cfg, inputs, kept is not None)
    clock.lap("verify")
    if kept is not None:
        actor, critic = kept[contract.ACTOR].model, kept[contract.CRITIC].model if contract.CRITIC in kept else None
    else:
        actor, critic = _load_models(cfg, inputs, dtype)
    clock.lap("load")
    data, check = _batch_terms(cfg, inputs, actor, critic, dtype, topo)
    clock.lap("reference")
    trainers = _trainers(cfg, inputs, actor, critic, kept)
    metrics, update_tokens = _train(cfg, out, inputs, trainers, data, check, clock, topo, room)
    tis_mine = [data["tis_stats"]] if data and cfg.uses_tis() else None
    del data  # what no output needs, freed for a stage that may now share the device
    room.wait()
    keeps = ppo_kept.will_keep(trainers, dtypes.torch_dtype(inputs.actor["dtype"]))
    written = cfg.write_train_state or not keeps  # what no process keeps is written
    _publish_outputs(cfg, out, inputs, trainers, clock, write_state=written)
    lines = metrics_on_rank0(metrics, topo)
    tis = metrics_on_rank0(tis_mine, topo) if cfg.uses_tis() else None
    summary = {**_summary(cfg, inputs, dtype, update_tokens, clock, tis),
               "models_from": "memory" if kept is not None else "files", "reference_from": ppo_kept.reference_from,
               "train_state": "written" if written else "kept in memory"}
    if dist.get_rank() == 0:
        _publish_manifest(cfg, out, inputs, trainers, lines, summary)
    dist.barrier()
    final = ppo_kept.place(cfg, inputs.layout, inputs.model_cfg, dtype, topo, inputs.start_step + inputs.steps)
    if keeps:
        ppo_kept.keep(out, trainers, final)


def _wanted(cfg: PPOConfig, inputs: _Inputs) -> dict[str, tuple[str, str | None]]:
    """Each role this ppo trains from a checkpoint: its weights' URL and its training state's."""
    roles = {contract.ACTOR: cfg.actor}
    if inputs.critic is not None:
        roles[contract.CRITIC] = cfg.critic
    elif cfg.advantage == "gae":
        roles[contract.CRITIC] = None  # a fresh critic: nothing kept can be it
    return {name: (url or "", (inputs.states.get(name) or (None,))[0]) for name, url in roles.items()}


def prepare(cfg: PPOConfig) -> None:
    """Get a resident worker ready for this ppo while other stages run (cluster/worker.py
    ``prepare``): the kernels its training compiles, compiled now. Reads only the actor's manifest,
    when it is published; writes nothing, joins no process group."""
    from llamarl.lib.model.llama import warm_regions

    manifest = publish.read_manifest(cfg.actor)
    if manifest is None or "model_config" not in manifest:
        return
    device = parallel.device()
    warm_regions(LlamaConfig.from_dict(manifest["model_config"]), _layout(cfg), compute_dtype(cfg.dtype, device),
                 device, backward=True)


def _layout(cfg: PPOConfig) -> ParallelLayout:
    return ParallelLayout(tp=cfg.tp, pp=cfg.pp, sequence_parallel=cfg.sequence_parallel, remove_padding=True)


def _read_inputs(cfg: PPOConfig) -> _Inputs:
    """The rollout and its scores joined on (prompt_id, sample_index) and checked against the
    rollout's manifest (its actor, its temperature), dynamic sampling's prompts dropped; the
    checkpoints' manifests and training states; the schedule checked."""
    actor = contract.require_checkpoint(cfg.actor, "lm", "the actor")
    if cfg.reference:  # read token by token beside the actor: the same model
        contract.require_checkpoint(cfg.reference, "lm", "the reference", like=(cfg.actor, actor))
    model_cfg = LlamaConfig.from_dict(actor["model_config"])
    layout = _layout(cfg)
    layout.check(model_cfg)
    start_step = actor.get("train_state", {}).get("step", 0)
    samples = load_samples(cfg.rollout, cfg.scores)
    facts = contract.RolloutFacts.read(cfg.rollout, publish.read_manifest(cfg.rollout))
    facts.check_temperature(cfg.temperature, cfg.out)
    if not cfg.off_policy and facts.actor_id != publish.output_id(cfg.actor):
        raise UserError(f"{cfg.rollout} was sampled from another actor (id {facts.actor_id}) than {cfg.actor} "
                        f"(id {publish.output_id(cfg.actor)}); point at the actor it was sampled from, or set "
                        "off_policy: true")
    joined = {"mean_score": sum(s.score for s in samples) / len(samples),
              "mean_response_length": sum(s.response_len for s in samples) / len(samples)}
    samples, sampling_stats = dynamic_sampling(cfg, samples, start_step)
    check_groups(cfg, samples)
    steps = cfg.ppo_epochs * -(-len(samples) // cfg.mini_batch_size)
    check_schedule(cfg, start_step, steps)
    critic = contract.require_checkpoint(cfg.critic, "score", "a critic") if cfg.critic and cfg.advantage == "gae" else None
    states = {role: contract.require_train_state(url, m, unwritten_ok=True) for role, url, m in
              ((contract.ACTOR, cfg.actor, actor), (contract.CRITIC, cfg.critic, critic)) if m is not None}
    reference_id = publish.output_id(cfg.reference or cfg.actor)
    ref_source = reference_source(cfg, reference_id, publish.output_id(cfg.actor), facts.actor_id, facts.temperature)
    return _Inputs(actor, critic, states, model_cfg, layout, samples, sampling_stats, joined, start_step, steps,
                   _agg_norm(cfg, facts), identity.declare(cfg).request(), ref_source)


def _verify_inputs(cfg: PPOConfig, inputs: _Inputs, kept: bool) -> None:
    """Collective: every checkpoint this ppo reads verified, with the training states beside them;
    the actor's and critic's are not read when the previous ppo's state is ``kept``."""
    critic = cfg.critic if inputs.critic else None
    reference = cfg.reference or cfg.actor
    read = {reference} if inputs.ref_source == "forward" else set()
    if not kept:
        read |= {cfg.actor, critic}
    for root in dict.fromkeys(filter(None, (cfg.actor, reference, critic))):
        manifest = publish.require_published(root, contract.CHECKPOINT)
        if root in read:  # weights (and old optim/)
            outputs.verify_input(root, manifest, "")
    for role, found in inputs.states.items():
        if found is not None and not kept:
            verify_train_state(*found, cfg.actor if role == contract.ACTOR else cfg.critic)


def _load_models(cfg: PPOConfig, inputs: _Inputs, dtype):
    """The actor, and the critic when gae trains one, on this rank's device."""
    from llamarl.lib.model.llama import ParallelLlamaForCausalLM, ParallelLlamaForValue

    with torch.device(parallel.device()):
        actor = ParallelLlamaForCausalLM(inputs.model_cfg, inputs.layout, dtype=dtype)
    checkpoint.load_model(actor, f"{cfg.actor}/{contract.MODEL}")
    if cfg.advantage != "gae":
        return actor, None
    with torch.device(parallel.device()):
        critic = ParallelLlamaForValue(inputs.model_cfg, inputs.layout, dtype=dtype)
    if cfg.critic:
        checkpoint.load_model(critic, f"{cfg.critic}/{contract.MODEL}")
        return actor, critic
    # A fresh critic: the actor's backbone and a zero value head.
    with torch.no_grad():
        for p in critic.parameters():
            p.zero_()
    state = {k: v for k, v in checkpoint.model_state(critic).items() if k != "score.weight"}
    checkpoint.load(state, f"{cfg.actor}/{contract.MODEL}")
    return actor, critic


# The passes without autograd (π_ref, π_old, the critic's old values) keep nothing for backward:
# their micro-batches take twice the training budget and still peak below a training micro-batch,
# which keeps every layer's activations; each micro-batch costs the host its launches. 1B, H200,
# 293 k tokens: 2.68 s at 4096 tokens a micro-batch, 1.72 s at 8192 (peak 4.1 → 5.2 GB, weights
# included), 1.68 s at 16384 (bench/results/frozen_pass-h200-2026-12-03.txt).
FROZEN_BUDGET = 2


def _batch_terms(cfg: PPOConfig, inputs: _Inputs, actor, critic, dtype, topo):
    """Collective: the reference's log-probs, the critic's old values and (``old_logp: actor``)
    the actor's own log-probs before any update, the samples split over DP; then the rewards and
    advantages on the last pipeline stage (None elsewhere), and the step check watching them."""
    samples, dev = inputs.samples, parallel.device()
    groups = micro_batches([i for i in range(len(samples)) if i % topo.dp == topo.dp_rank], samples,
                           FROZEN_BUDGET * cfg.micro_batch_tokens)
    # π_old recomputed before any update (a resumed run recomputes it from the same input actor).
    ref_logp, actor_logp = frozen_logprobs(cfg, inputs.ref_source, samples, groups, actor, cfg.reference or cfg.actor,
                                           ppo_kept.model_place(inputs.layout, inputs.model_cfg, dtype, topo))
    old_values = gather_dp(groups, token_outputs(critic, samples, groups, 1.0), topo) if critic is not None else None
    data = advantages(cfg, samples, ref_logp, old_values, dev, actor_logp) if topo.is_last_stage else None
    check = StepCheck(cfg, [s.score for s in samples], dev, dtypes.torch_dtype(inputs.actor["dtype"]))
    if data is not None:
        check.watch("log-probs", data["old_logp"], *(data[k] for k in ("ref_logp", "tis") if k in data))
        check.watch("advantages", data["adv"])
        check.watch("returns", data["returns"], data["values"])
    check.verify("before the first optimizer step")
    return data, check


def _trainers(cfg: PPOConfig, inputs: _Inputs, actor, critic, kept: dict | None) -> dict[str, Trainer]:
    """One trainer per role, each with its optimizer state where its checkpoint has one (``kept``:
    the optimizers the previous ppo left in this process, stages/ppo_kept.py)."""
    actor_optim = optim_url(cfg.actor, inputs.actor, inputs.states.get(contract.ACTOR))
    trainers = {contract.ACTOR: Trainer(actor, cfg.actor_lr, cfg, actor_optim, f"{cfg.actor}/{contract.MODEL}",
                                        inputs.start_step, kept[contract.ACTOR].opt if kept else None)}
    if critic is not None:
        critic_optim = optim_url(cfg.critic, inputs.critic, inputs.states.get(contract.CRITIC))
        trainers[contract.CRITIC] = Trainer(critic, cfg.critic_lr, cfg, critic_optim,
                                            f"{cfg.critic}/{contract.MODEL}" if inputs.critic else None,
                                            inputs.start_step, kept[contract.CRITIC].opt if kept else None)
    return trainers


def _train(cfg: PPOConfig, out: str, inputs: _Inputs, trainers: dict[str, Trainer], data, check, clock: _Clock,
           topo, room: space.Room) -> tuple[list[dict], int]:
    """Collective: the epochs' optimizer steps, resumed after the latest saved state, saving one
    every ``save_every`` steps (once there is ``room``); the steps' metrics and the tokens through
    the actor's update."""
    done, metrics = resume(out, trainers, inputs.start_step)
    clock.lap("load")
    store_dtype = dtypes.torch_dtype(inputs.actor["dtype"])
    dev, update_tokens = parallel.device(), 0
    batches = StepBatches(cfg, trainers[contract.ACTOR].model, inputs.samples, data, dev)
    launched: list = []  # steps whose reads are still on their way: the last one at most
    t0 = time.perf_counter()

    def read_launched():
        nonlocal t0
        for m in launched:
            metrics.append(m.result())
            clock.steps.append(time.perf_counter() - t0)  # from the step before's read to this one's
            t0 = time.perf_counter()
        launched.clear()

    for k in range(done, inputs.steps):
        epoch, batch_idx = mini_batch(cfg, len(inputs.samples), k)
        next_idx = mini_batch(cfg, len(inputs.samples), k + 1)[1] if k + 1 < inputs.steps else None
        step = inputs.start_step + k
        _test_hook(f"step {step + 1}", trainers)
        reads = train_step(cfg, trainers, inputs.samples, data, batch_idx, step, dev, inputs.agg_norm, check, batches,
                           next_idx)
        reads.known.update(step=step + 1, epoch=epoch)
        update_tokens += reads.known["tokens"]
        # The step before is read once this one is launched: the device has it done by now, and
        # goes on with this one while the host reads it.
        read_launched()
        launched.append(reads)
        if k == done:
            read_launched()
            job.freeze_heap()  # the first step compiled the update's graphs
        if cfg.save_every and (k + 1) % cfg.save_every == 0 and k + 1 < inputs.steps:
            read_launched()  # a state is saved only after its steps are checked
            clock.lap("update")
            room.wait()
            save_state(out, k + 1, trainers, store_dtype, metrics_on_rank0(metrics, topo))
            clock.lap("save")
            t0 = time.perf_counter()
    read_launched()
    clock.lap("update")
    return metrics, update_tokens


def _publish_outputs(cfg: PPOConfig, out: str, inputs: _Inputs, trainers: dict[str, Trainer], clock: _Clock,
                     write_state: bool) -> None:
    """Collective: each role's weights first — the next rollout and export can start from them
    while the training state (6x their bytes) is written — then, with the gradients freed, each
    role's training state; or, without ``write_state`` (the next ppo takes it from memory),
    each one published as not written."""
    final = inputs.start_step + inputs.steps
    store_dtype = dtypes.torch_dtype(inputs.actor["dtype"])  # checkpoints keep the actor's stored dtype
    for name, trainer in trainers.items():
        save_weights(f"{out}/{name}", name, trainer, cfg.actor, inputs.actor, final, store_dtype)
        _test_hook(f"published {name}")
    clock.lap("weights")
    for trainer in trainers.values():
        trainer.free_gradients()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    for name, trainer in trainers.items():
        if write_state:
            save_train_state(out, name, trainer, final)
        else:
            save_unwritten_state(out, name, final)
        _test_hook(f"published {contract.TRAIN_STATE}/{name}")
    clock.lap(contract.TRAIN_STATE)


def _summary(cfg: PPOConfig, inputs: _Inputs, dtype, update_tokens: int, clock: _Clock, tis: list | None) -> dict:
    return {"steps": inputs.steps, "seconds": clock.laps, "step_seconds": clock.steps, "dtype": dtypes.name(dtype),
            # Tokens through the actor's forward and backward, over all DP ranks.
            "update_tokens": update_tokens, "update_tokens_per_s": update_tokens / max(clock.laps["update"], 1e-9),
            # The rollout's, over every sample (dynamic sampling may train on fewer).
            **inputs.joined, "trained_samples": len(inputs.samples), "old_logp": cfg.old_logp_source(),
            "ref_logp": inputs.ref_source, "tis": tis[0] if tis else None, "dynamic_sampling": inputs.sampling_stats}


def _publish_manifest(cfg: PPOConfig, out: str, inputs: _Inputs, trainers: dict[str, Trainer], lines: list[dict],
                      summary: dict) -> None:
    """Rank 0: the step metrics, then the stage's manifest, with the id of each sub-output (the
    stage's own id changes with any of them); the saved states go."""
    files = {contract.METRICS: publish.write_bytes(f"{out}/{contract.METRICS}", json_lines(lines))}
    _test_hook("wrote metrics")
    parts = [*trainers, *(f"{contract.TRAIN_STATE}/{name}" for name in trainers)]
    publish.publish(out, {"kind": contract.PPO, "timing": outputs.timing(), "request": inputs.request, "files": files,
                          "summary": finite_or_null(summary), "actor": contract.ACTOR,
                          "critic": contract.CRITIC if contract.CRITIC in trainers else None,
                          "train_state": {name: f"{contract.TRAIN_STATE}/{name}" for name in trainers},
                          "outputs": {p: publish.output_id(f"{out}/{p}") for p in parts},
                          "final_step": inputs.start_step + inputs.steps})
    clear_state(out)
    stats = inputs.sampling_stats
    if stats:
        print(f"{out}: dynamic sampling kept {stats['kept']} of {stats['groups']} prompts (scores all equal in "
              f"{stats['dropped']}), trains on {stats['trained']}"
              + (f", {stats['short']} short of train_groups" if stats["short"] else ""), flush=True)
    kept = ", training state kept in memory (not written)" if summary["train_state"] != "written" else ""
    print(f"{out}: {inputs.steps} PPO steps from the models in {summary['models_from']}{kept}, mean score "
          f"{summary['mean_score']:.4f}, update "
          f"{summary['update_tokens_per_s']:.0f} tokens/s ({', '.join(f'{k} {v:.1f}s' for k, v in summary['seconds'].items())})",
          flush=True)


class _Clock:
    """Wall time per phase (summed when a phase recurs) and of each optimizer step this process
    ran, for the summary: measured, so not in ``metrics.jsonl``, whose bytes a rerun makes again."""

    def __init__(self):
        self.laps: dict[str, float] = {}
        self.steps: list[float] = []
        self._t = time.perf_counter()

    def lap(self, phase: str) -> None:
        if torch.cuda.is_available():
            torch.cuda.synchronize()
        now = time.perf_counter()
        self.laps[phase] = self.laps.get(phase, 0.0) + now - self._t
        self._t = now


def _agg_norm(cfg: PPOConfig, facts: contract.RolloutFacts) -> int | None:
    """seq-mean-token-sum-norm's constant: ``loss_agg_norm``, or the rollout's max_new_tokens."""
    if cfg.loss_agg != "seq-mean-token-sum-norm":
        return None
    if cfg.loss_agg_norm is not None:
        return cfg.loss_agg_norm
    norm = facts.max_new_tokens
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


if __name__ == "__main__":
    job.main(PPOConfig, run)
