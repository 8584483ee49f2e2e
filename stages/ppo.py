"""Stage ppo: one PPO iteration — update the actor and critic from a rollout and its scores.

Run with tp × pp × dp processes (``llamarl stage ppo …``). The recipe:

1. join rollout and scores on (prompt_id, sample_index);
2. reference log-probs (frozen initial actor, freed once done) and old values (critic), the
   batch split over DP;
3. token rewards (score at the last token, minus β·KL unless KL is a loss term), GAE or GRPO
   advantages, whitening;
4. ``ppo_epochs`` passes over shuffled mini-batches; each mini-batch is one optimizer step of the
   actor (clipped/dual-clip policy loss, entropy bonus, optional KL loss) and of the critic (clipped
   value loss), micro-batched by a token budget with gradient accumulation, gradients reduced over
   DP from one buffer, clipped by the global norm, AdamW with ZeRO-1;
5. new actor and critic checkpoints (weights, optimizer moments, step) and metrics.jsonl.

Training state is saved every ``save_every`` steps under ``OUT/.state``; a rerun resumes from the
latest and ends with the same weights as an uninterrupted run (the data order depends only on
the seed). Mini-batches and micro-batches depend only on the data, never on the layout.
"""

from __future__ import annotations

import json
import time
from dataclasses import dataclass

import fsspec
import pyarrow.parquet as pq
import torch
import torch.distributed as dist

from llamarl.lib import checkpoint, job, optim, parallel, publish, rl, schedule, vocab_parallel
from llamarl.lib.config import LlamaConfig, ParallelLayout, compute_dtype
from llamarl.lib.errors import UserError
from llamarl.stages.config import PPOConfig


# ---- data ------------------------------------------------------------------------------------------


@dataclass
class Sample:
    ids: list[int]
    prompt_len: int
    old_logp: list[float]
    score: float
    group: str

    @property
    def response_len(self) -> int:
        return len(self.ids) - self.prompt_len


def _read_parts(root: str, manifest: dict) -> list[dict]:
    fs, path = fsspec.core.url_to_fs(root)
    rows = []
    for name in sorted(k for k in manifest["files"] if k.startswith("parts/")):
        with fs.open(f"{path}/{name}", "rb") as f:
            rows.extend(pq.read_table(f).to_pylist())
    return rows


def load_samples(rollout: str, scores: str) -> list[Sample]:
    """The rollout's responses with their scores, both verified against their manifests, and the
    scores checked to be of this very rollout."""
    rollout_m = publish.require_verified(rollout, "rollout", "parts/")
    scores_m = publish.require_verified(scores, "scores", "parts/")
    scored = scores_m.get("request", {}).get("rollout_id")
    if scored != publish.output_id(rollout):
        raise UserError(f"{scores} scores another rollout (id {scored}) than {rollout} (id {publish.output_id(rollout)}); "
                        "score this rollout first")
    by_key = {(r["prompt_id"], r["sample_index"]): r for r in _read_parts(scores, scores_m)}
    samples = []
    for r in _read_parts(rollout, rollout_m):
        key = (r["prompt_id"], r["sample_index"])
        if key not in by_key:
            raise UserError(f"{scores}: no score for {key}; score this rollout first")
        if not r["response_token_ids"]:
            continue
        samples.append(Sample(list(r["prompt_token_ids"]) + list(r["response_token_ids"]), len(r["prompt_token_ids"]),
                              list(r["response_logprobs"]), float(by_key.pop(key)["score"]), str(r["prompt_id"])))
    if by_key:
        raise UserError(f"{scores}: {len(by_key)} scores have no rollout row (first: {next(iter(by_key))}); "
                        "scores and rollout do not belong together")
    if not samples:
        raise UserError(f"{rollout}: no responses to train on")
    return samples


def micro_batches(indices: list[int], samples: list[Sample], budget: int) -> list[list[int]]:
    """Consecutive groups whose padded size (rows × longest) stays within the token budget."""
    groups, current, longest = [], [], 0
    for i in indices:
        n = len(samples[i].ids)
        if current and max(longest, n) * (len(current) + 1) > budget:
            groups.append(current)
            current, longest = [], 0
        current.append(i)
        longest = max(longest, n)
    if current:
        groups.append(current)
    return groups


def _padded(samples: list[Sample], device):
    """ids, attention mask, labels and the response mask, in label space (position t predicts
    token t+1), right-padded."""
    width = max(len(s.ids) for s in samples)
    ids = torch.zeros(len(samples), width, dtype=torch.long)
    mask = torch.zeros_like(ids)
    resp = torch.zeros(len(samples), width)
    for b, s in enumerate(samples):
        ids[b, : len(s.ids)] = torch.tensor(s.ids)
        mask[b, : len(s.ids)] = 1
        resp[b, s.prompt_len - 1 : len(s.ids) - 1] = 1
    labels = torch.roll(ids, -1, dims=1)
    return ids.to(device), mask.to(device), labels.to(device), resp.to(device)


def _label_space(samples: list[Sample], values: list[list[float]], width: int, device) -> torch.Tensor:
    """Per-response-token values placed at their label positions, [B, width]."""
    out = torch.zeros(len(samples), width)
    for b, (s, v) in enumerate(zip(samples, values)):
        out[b, s.prompt_len - 1 : s.prompt_len - 1 + len(v)] = torch.tensor(v, dtype=torch.float32)
    return out.to(device)


def _response_values(samples: list[Sample], padded_out: torch.Tensor) -> list[list[float]]:
    return [padded_out[b, s.prompt_len - 1 : len(s.ids) - 1].tolist() for b, s in enumerate(samples)]


# ---- models ---------------------------------------------------------------------------------------


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature == 1.0:
        return logits  # the vocab-parallel ops upcast to fp32 themselves
    # In fp32: dividing bf16 logits would round them again. Padded vocabulary sits at the dtype's
    # minimum; keep it finite after scaling.
    return (logits.float() / temperature).clamp(min=torch.finfo(torch.float32).min)


def _token_outputs(model, samples: list[Sample], groups: list[list[int]], temperature: float) -> list[list[float]] | None:
    """Per-response-token log-probs (CausalLM) or values (Value) for ``groups`` of samples; None
    off the last pipeline stage. Each micro-batch's head output is reduced as soon as it exists:
    a whole batch of ``[tokens, vocab]`` logits never lives at once."""
    dev = next(model.parameters()).device
    batches, metas = [], []
    for g in groups:
        ss = [samples[i] for i in g]
        ids, mask, labels, _ = _padded(ss, dev)
        batch = model.make_batch(ids, mask)
        batches.append(batch)
        metas.append((batch, labels))

    def per_token(out, meta):
        batch, labels = meta
        if model.hf_head == "lm":
            out = vocab_parallel.log_probs(_scaled(out, temperature), batch.flat(labels))
        return batch.to_padded(out)

    with torch.no_grad():
        outs = schedule.forward_backward(model, batches, per_token, metas, forward_only=True)
    if not parallel.topology().is_last_stage:
        return None
    return [v for g, out in zip(groups, outs) for v in _response_values([samples[i] for i in g], out)]


def _gather_dp(mine: dict[int, list[float]] | None) -> dict[int, list[float]] | None:
    if mine is None:
        return None
    topo = parallel.topology()
    if topo.dp == 1:
        return mine
    parts: list = [None] * topo.dp
    dist.all_gather_object(parts, mine, group=parallel.dp_group())
    return {k: v for p in parts for k, v in p.items()}


# ---- the stage -------------------------------------------------------------------------------------


def run(cfg: PPOConfig) -> None:
    dtype = compute_dtype(cfg.dtype, parallel.device())
    actor_m = publish.require_published(cfg.actor, "checkpoint")
    if actor_m["head"] != "lm":
        raise UserError(f"{cfg.actor} is a {actor_m['head']} model; the actor must be a causal LM")
    model_cfg = LlamaConfig.from_dict(actor_m["model_config"])
    layout = ParallelLayout(tp=cfg.tp, pp=cfg.pp, sequence_parallel=cfg.sequence_parallel, remove_padding=True)
    layout.check(model_cfg)
    samples = load_samples(cfg.rollout, cfg.scores)
    sampled_from = publish.read_manifest(cfg.rollout)["request"]["actor_id"]
    if not cfg.off_policy and sampled_from != publish.output_id(cfg.actor):
        raise UserError(f"{cfg.rollout} was sampled from another actor (id {sampled_from}) than {cfg.actor} "
                        f"(id {publish.output_id(cfg.actor)}); point at the actor it was sampled from, or set "
                        "off_policy: true")
    reference = cfg.reference or cfg.actor
    use_critic = cfg.advantage == "gae"
    critic_m = None
    if cfg.critic and use_critic:
        critic_m = publish.require_published(cfg.critic, "checkpoint")
        if critic_m["head"] != "score":
            raise UserError(f"{cfg.critic} has head {critic_m['head']!r}; a critic has a value (score) head")

    topo = parallel.init(cfg.tp, cfg.pp)
    if topo.dp != cfg.dp:
        raise UserError(f"ppo runs with tp*pp*dp = {cfg.tp * cfg.pp * cfg.dp} processes, not {dist.get_world_size()}")
    rank = dist.get_rank()
    out = cfg.out.rstrip("/")
    request = {"kind": "ppo", "actor_id": publish.output_id(cfg.actor), "rollout_id": publish.output_id(cfg.rollout),
               "scores_id": publish.output_id(cfg.scores), "reference_id": publish.output_id(reference),
               "critic_id": publish.output_id(cfg.critic) if critic_m else None,
               "config": cfg.identity()}
    if job.prepare_output(out, lambda m: m.get("request") == request, request) == "skip":
        if rank == 0:
            print(f"{out}: this PPO iteration is already done, nothing to do", flush=True)
        return
    for root in dict.fromkeys(filter(None, (cfg.actor, reference, cfg.critic if critic_m else None))):
        job.verify_input(root, publish.require_published(root, "checkpoint"), "")  # weights and training state

    from llamarl.lib.model import ParallelLlamaForCausalLM, ParallelLlamaForValue

    clock = _Clock()
    dev = parallel.device()
    store_dtype = getattr(torch, actor_m["dtype"])  # checkpoints keep the actor's stored dtype
    with torch.device(dev):
        actor = ParallelLlamaForCausalLM(model_cfg, layout, dtype=dtype)
    checkpoint.load_model(actor, f"{cfg.actor}/model")
    critic = None
    if use_critic:
        with torch.device(dev):
            critic = ParallelLlamaForValue(model_cfg, layout, dtype=dtype)
        _load_critic(critic, cfg, model_cfg)
    start_step = actor_m.get("train_state", {}).get("step", 0)
    clock.lap("load")

    # 2. reference log-probs and old values, the samples split over DP
    mine = [i for i in range(len(samples)) if i % topo.dp == topo.dp_rank]
    groups = micro_batches(mine, samples, cfg.micro_batch_tokens)
    with torch.device(dev):
        ref = ParallelLlamaForCausalLM(model_cfg, layout, dtype=dtype)
    checkpoint.load_model(ref, f"{reference}/model")
    ref.eval()
    ref_logp = _token_outputs(ref, samples, groups, cfg.temperature)
    del ref  # used once per iteration: free its memory for training rather than park it on the host
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    old_values = _token_outputs(critic, samples, groups, 1.0) if use_critic else None
    order = [i for g in groups for i in g]
    ref_logp = _gather_dp(dict(zip(order, ref_logp)) if ref_logp is not None else None)
    old_values = _gather_dp(dict(zip(order, old_values)) if old_values is not None else None)

    # 3. rewards and advantages (on the last stage, where losses are computed)
    data = None
    if topo.is_last_stage:
        data = _advantages(cfg, samples, ref_logp, old_values, dev)
    clock.lap("reference")

    # 4. the epochs: one trainer per model (the critic only for GAE)
    trainers = {"actor": _Trainer(actor, cfg.actor_lr, cfg, f"{cfg.actor}/optim" if _has_optim(actor_m) else None,
                                  f"{cfg.actor}/model", start_step)}
    if critic is not None:
        trainers["critic"] = _Trainer(critic, cfg.critic_lr, cfg,
                                      f"{cfg.critic}/optim" if critic_m and _has_optim(critic_m) else None,
                                      f"{cfg.critic}/model" if critic_m else None, start_step)

    steps_per_epoch = -(-len(samples) // cfg.mini_batch_size)
    total = cfg.ppo_epochs * steps_per_epoch
    done, metrics_lines = _resume(out, trainers, start_step)
    clock.lap("load")
    update_tokens = 0
    for k in range(done, total):
        epoch, j = divmod(k, steps_per_epoch)
        gen = torch.Generator().manual_seed(cfg.seed * 1_000_003 + epoch)
        perm = torch.randperm(len(samples), generator=gen).tolist()
        batch_idx = perm[j * cfg.mini_batch_size : (j + 1) * cfg.mini_batch_size]
        step = start_step + k
        t0 = time.perf_counter()
        m = _train_step(cfg, trainers, samples, data, batch_idx, step, dev)
        m.update(step=step + 1, epoch=epoch, seconds=time.perf_counter() - t0)
        update_tokens += m["tokens"]
        metrics_lines.append(m)
        if cfg.save_every and (k + 1) % cfg.save_every == 0 and k + 1 < total:
            clock.lap("update")
            _save_state(out, k + 1, trainers, start_step, store_dtype, _metrics_on_rank0(metrics_lines))
            clock.lap("save")
    clock.lap("update")

    # 5. outputs
    final = start_step + total
    for name, trainer in trainers.items():
        _save_checkpoint(f"{out}/{name}", trainer, cfg.actor, actor_m, final, store_dtype)
    clock.lap("save")
    lines = _metrics_on_rank0(metrics_lines)
    if rank == 0:
        publish.write_bytes(f"{out}/metrics.jsonl", "".join(json.dumps(x) + "\n" for x in lines).encode())
        files = {"metrics.jsonl": publish.file_entry(f"{out}/metrics.jsonl")}
        summary = {"steps": total, "seconds": clock.laps, "dtype": str(dtype).removeprefix("torch."),
                   # Tokens through the actor's forward and backward, over all DP ranks.
                   "update_tokens": update_tokens,
                   "update_tokens_per_s": update_tokens / max(clock.laps["update"], 1e-9),
                   "mean_score": sum(s.score for s in samples) / len(samples),
                   "mean_response_length": sum(s.response_len for s in samples) / len(samples)}
        publish.publish(out, {"kind": "ppo", "timing": job.timing(), "request": request, "files": files,
                              "summary": summary, "actor": "actor", "critic": "critic" if critic is not None else None,
                              "final_step": final})
        fs, path = fsspec.core.url_to_fs(out)
        if fs.exists(f"{path}/.state"):
            fs.rm(f"{path}/.state", recursive=True)
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


def _has_optim(manifest: dict) -> bool:
    return any(k.startswith("optim/") for k in manifest["files"])


class _Trainer:
    """A model with its fp32 gradient buffer and ZeRO-1 optimizer, state loaded from ``optim_url``
    (moments, masters) or, for masters, from ``model_url`` at its stored precision."""

    def __init__(self, model, lr: float, cfg: PPOConfig, optim_url: str | None, model_url: str | None, step: int):
        self.model, self.lr = model, lr
        self.grads = optim.GradBuffer(model)
        self.opt = optim.ShardedAdamW(model, lr, cfg.betas, weight_decay=cfg.weight_decay)
        self.opt.load_state(optim_url, step, model_url)


def _load_critic(critic, cfg: PPOConfig, model_cfg) -> None:
    if cfg.critic:
        checkpoint.load_model(critic, f"{cfg.critic}/model")
        return
    # A fresh critic: the actor's backbone and a zero value head.
    with torch.no_grad():
        for p in critic.parameters():
            p.zero_()
    state = {k: v for k, v in checkpoint.model_state(critic).items() if k != "score.weight"}
    checkpoint.load(state, f"{cfg.actor}/model")


def _advantages(cfg: PPOConfig, samples, ref_logp, old_values, dev) -> dict:
    n = len(samples)
    width = max(len(s.ids) for s in samples)
    old = _label_space(samples, [s.old_logp for s in samples], width, dev)
    ref = _label_space(samples, [ref_logp[i] for i in range(n)], width, dev)
    resp = torch.zeros(n, width, device=dev)
    for b, s in enumerate(samples):
        resp[b, s.prompt_len - 1 : len(s.ids) - 1] = 1
    scores = torch.tensor([s.score for s in samples], device=dev)
    kl = rl.kl_estimate(old, ref, cfg.kl_estimator) * resp
    if cfg.advantage == "grpo":
        adv = rl.grpo_advantages(scores, [s.group for s in samples], resp)
        values = returns = torch.zeros_like(adv)
    else:
        values = _label_space(samples, [old_values[i] for i in range(n)], width, dev)
        rewards = rl.token_rewards(scores, kl, resp, 0.0 if cfg.use_kl_loss else cfg.kl_coef)
        adv, returns = rl.gae(rewards, values, resp, cfg.gamma, cfg.lam)
        if cfg.whiten_advantages:
            adv = rl.whiten(adv, resp)
    return {"old_logp": old, "ref_logp": ref, "adv": adv, "values": values, "returns": returns, "resp": resp,
            "kl": rl.masked_mean(kl, resp).item()}


def _train_step(cfg, trainers: dict[str, _Trainer], samples, data, batch_idx, step, dev):
    topo = parallel.topology()
    actor = trainers["actor"].model
    mine = batch_idx[topo.dp_rank :: topo.dp]
    groups = micro_batches(mine, samples, cfg.micro_batch_tokens)
    tokens = sum(samples[i].response_len for i in batch_idx)
    denom = float(tokens if cfg.loss_agg == "token-mean" else len(batch_idx))
    # Metric sums stay on the device (a host read per micro-batch would stall the GPU); read once a step.
    sums = {k: torch.zeros((), dtype=torch.float64, device=dev)
            for k in ("policy_loss", "entropy", "approx_kl", "clip_fraction", "value_loss")}

    batches, extras = [], []
    for g in groups:
        ss = [samples[i] for i in g]
        ids, mask, labels, resp = _padded(ss, dev)
        batch = actor.make_batch(ids, mask)
        batches.append(batch)
        if data is None:
            extras.append(None)
            continue
        width = ids.shape[1]
        rows = torch.tensor(g, device=dev)

        def take(name):
            return batch.flat(data[name][rows, :width])

        extras.append({"labels": batch.flat(labels), "resp": batch.flat(resp), "old_logp": take("old_logp"),
                       "ref_logp": take("ref_logp"), "adv": take("adv"), "values": take("values"),
                       "returns": take("returns"), "per_seq": batch.flat(_seq_index(resp))})

    def actor_loss(out, x):
        logp, entropy = vocab_parallel.log_probs_and_entropy(_scaled(out, cfg.temperature), x["labels"])
        pg, clipped, approx_kl = rl.policy_loss(logp, x["old_logp"], x["adv"], cfg.clip_eps, cfg.dual_clip)
        loss = _agg(pg, x, cfg.loss_agg, denom)
        sums["policy_loss"] += loss.detach()
        sums["clip_fraction"] += (clipped * x["resp"]).sum().detach() / tokens
        sums["approx_kl"] += (approx_kl * x["resp"]).sum().detach() / tokens
        # Entropy is a reported metric every step, and a bonus when entropy_coef > 0.
        ent_term = _agg(entropy, x, cfg.loss_agg, denom)
        sums["entropy"] += ent_term.detach()
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * ent_term
        if cfg.use_kl_loss:
            loss = loss + cfg.kl_coef * _agg(rl.kl_estimate(logp, x["ref_logp"], cfg.kl_estimator), x, cfg.loss_agg, denom)
        return loss

    def critic_loss(out, x):
        loss = _agg(rl.value_loss(out, x["values"], x["returns"], cfg.value_clip), x, cfg.loss_agg, denom)
        sums["value_loss"] += loss.detach()
        return loss

    metrics = {}
    for name, t in trainers.items():
        t.grads.zero()
        schedule.forward_backward(t.model, batches, actor_loss if name == "actor" else critic_loss, extras)
        t.grads.reduce()
        metrics[f"{name}_grad_norm"] = optim.clip_grad_norm(t.model, cfg.grad_clip)
        t.opt.lr = optim.lr_at(step, t.lr, cfg.warmup_steps, cfg.total_steps, cfg.lr_decay)
        metrics[f"{name}_lr"] = t.opt.lr
        t.opt.step()

    metrics["tokens"] = sum(len(samples[i].ids) for i in batch_idx)
    if topo.is_last_stage:
        reduced = torch.stack(list(sums.values()))
        if topo.dp > 1:
            dist.all_reduce(reduced, group=parallel.dp_group())
        metrics.update(dict(zip(sums, reduced.tolist())))
        metrics["mean_score"] = sum(samples[i].score for i in batch_idx) / len(batch_idx)
        metrics["mean_response_length"] = tokens / len(batch_idx)
        metrics["kl"] = data["kl"]
    return metrics


def _seq_index(resp: torch.Tensor) -> torch.Tensor:
    """Row index of every position (to aggregate per sequence on flat tokens), -1 off responses."""
    rows = torch.arange(resp.shape[0], device=resp.device)[:, None].expand_as(resp)
    return torch.where(resp.bool(), rows, torch.full_like(rows, -1))


def _agg(loss: torch.Tensor, x: dict, mode: str, denom: float) -> torch.Tensor:
    if mode == "token-mean":
        return (loss * x["resp"]).sum() / denom
    seq = x["per_seq"]
    valid = seq >= 0
    n = int(seq.max()) + 1 if valid.any() else 0
    sums = torch.zeros(n, dtype=loss.dtype, device=loss.device).index_add(0, seq[valid], loss[valid])
    counts = torch.zeros(n, dtype=loss.dtype, device=loss.device).index_add(0, seq[valid], torch.ones_like(loss[valid]))
    return (sums / counts.clamp(min=1)).sum() / denom


# ---- checkpoints -----------------------------------------------------------------------------------


def _save_checkpoint(root: str, trainer: _Trainer, source: str, source_manifest: dict, step: int,
                     store_dtype: torch.dtype) -> None:
    """A published checkpoint (same format as shard's): the weights from the fp32 masters stored as
    ``store_dtype``, the optimizer state in fp32, and the step; tokenizer and config files come from
    ``source``. ``root`` lies inside our own unpublished output, so whatever an interrupted run left
    there is ours to replace."""
    rank = dist.get_rank()
    if rank == 0:
        fs, path = fsspec.core.url_to_fs(root)
        if fs.exists(path):
            fs.rm(path, recursive=True)
        publish.prepare(root, lambda m: False)
        _copy_side_files(source, root)
    dist.barrier()
    checkpoint.save(trainer.opt.model_state(store_dtype), f"{root}/model")
    checkpoint.save(trainer.opt.state(), f"{root}/optim")
    dist.barrier()
    fs, path = fsspec.core.url_to_fs(root)
    names = sorted(f"{sub}/{p.rsplit('/', 1)[-1]}" for sub in ("model", "optim", "hf") for p in fs.ls(f"{path}/{sub}", detail=False))
    files = job.file_entries(root, names)
    if rank == 0:
        from llamarl.lib import hf_mapping

        model = trainer.model
        publish.publish(root, {
            "kind": "checkpoint", "head": model.hf_head, "dtype": str(store_dtype).removeprefix("torch."),
            "model_config": model.cfg.to_dict(), "hf_config": source_manifest.get("hf_config", {}),
            "written_layout": {"tp": parallel.topology().tp, "pp": parallel.topology().pp},
            "tensors": {n: list(s) for n, s in hf_mapping.hf_shapes(model.cfg, model.hf_head).items()},
            "source": {"url": source_manifest.get("source", {}).get("url"), "files": {}},
            "train_state": {"step": step}, "files": files,
        })
    dist.barrier()


def _copy_side_files(src_ckpt: str, dst: str) -> None:
    fs, path = fsspec.core.url_to_fs(src_ckpt)
    for p in fs.ls(f"{path}/hf", detail=False) if fs.exists(f"{path}/hf") else []:
        publish.write_bytes(f"{dst}/hf/{p.rsplit('/', 1)[-1]}", fs.cat_file(p))


def _metrics_on_rank0(lines: list[dict]) -> list[dict] | None:
    """Collective: the step metrics (kept on the last stage's first TP/DP rank), on rank 0."""
    topo = parallel.topology()
    gathered: list = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, lines if (topo.is_last_stage and topo.tp_rank == 0 and topo.dp_rank == 0) else None)
    return next(g for g in gathered if g is not None) if dist.get_rank() == 0 else None


def _save_state(out, k, trainers: dict[str, _Trainer], start_step, store_dtype, metrics: list[dict] | None) -> None:
    """The training state after ``k`` steps, and (so that a resumed run reports every step) the
    metrics of those steps, in the marker written last."""
    root = f"{out}/.state/step-{k:06d}"
    for name, t in trainers.items():
        checkpoint.save(t.opt.model_state(store_dtype), f"{root}/{name}/model")
        checkpoint.save(t.opt.state(), f"{root}/{name}/optim")
    dist.barrier()
    fs, path = fsspec.core.url_to_fs(root)
    files = job.file_entries(root, sorted(p[len(path) + 1 :] for p in fs.find(path)))
    if dist.get_rank() == 0:
        marker = {"step": k, "metrics": metrics, "files": files}
        publish.write_bytes(f"{root}/done.json", json.dumps(marker).encode())  # written last
    dist.barrier()


def _resume(out, trainers: dict[str, _Trainer], start_step) -> tuple[int, list[dict]]:
    """The number of optimizer steps already done by an interrupted run (0 if none), with their
    metrics (on the rank that keeps them)."""
    fs, path = fsspec.core.url_to_fs(out)
    steps = []
    if fs.exists(f"{path}/.state"):
        for p in fs.ls(f"{path}/.state", detail=False):
            if fs.exists(f"{p}/done.json"):
                steps.append(int(p.rstrip("/").rsplit("-", 1)[-1]))
    found = [max(steps) if steps else 0, None]
    error = None
    if found[0] and dist.get_rank() == 0:
        done = f"{out}/.state/step-{found[0]:06d}"
        try:
            found[1] = json.loads(fs.cat_file(f"{path}/.state/step-{found[0]:06d}/done.json"))
        except json.JSONDecodeError:
            error = (f"{done}/done.json is not valid JSON: the saved training state is damaged; delete {done} to resume "
                     "from an earlier step (or the whole output to start over)")
    job.check(error)
    dist.broadcast_object_list(found, src=0)
    k, marker = found
    metrics = (marker or {}).get("metrics")
    if k:
        root = f"{out}/.state/step-{k:06d}"
        try:
            job.verify_input(root, {"files": marker.get("files", {})})  # states saved before checksums: none
        except UserError as e:
            raise UserError(f"{e.args[0].split('; ')[0]}: the saved training state is damaged; delete {root} to resume "
                            "from an earlier step (or the whole output to start over)") from None
        for name, t in trainers.items():
            checkpoint.load_model(t.model, f"{root}/{name}/model")
            t.opt.load_state(f"{root}/{name}/optim", start_step + k, f"{root}/{name}/model")
        if dist.get_rank() == 0:
            print(f"{out}: resuming after optimizer step {k}", flush=True)
    return k, list(metrics or [])


if __name__ == "__main__":
    job.main(PPOConfig, run)
