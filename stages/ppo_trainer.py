"""PPO's models at work: the frozen forward passes (reference log-probs, old values) and the update
step, one ``Trainer`` per role (actor, critic).

Every pass goes through the 1F1B schedule over micro-batches of packed tokens; losses are
computed on the last pipeline stage, per micro-batch, as its share of the mini-batch mean
(``rl.aggregate``), so gradient accumulation over micro-batches and DP ranks sums to the mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llamarl.lib.files import checkpoint
from llamarl.lib.rl import core as rl, optim
from llamarl.lib.model import schedule, vocab_parallel
from llamarl.lib.model.batch import TokenBatch
from llamarl.lib.distributed.parallel import Topology
from llamarl.stages import contract
from llamarl.stages.config import PPOConfig
from llamarl.stages.ppo_checks import StepCheck
from llamarl.stages.ppo_data import Sample, micro_batches, padded, response_values, tis_stats


class Trainer:
    """One role's model with its fp32 gradient buffer and ZeRO-1 optimizer; the optimizer state
    comes from ``optim_url`` (moments, masters) or, for masters, from ``model_url`` at its stored
    precision."""

    def __init__(self, model, lr: float, cfg: PPOConfig, optim_url: str | None, model_url: str | None, step: int):
        self.model, self.lr, self.cfg = model, lr, cfg
        self.grads = optim.GradBuffer(model)
        self.opt = optim.ShardedAdamW(model, lr, cfg.betas, weight_decay=cfg.weight_decay)
        self.opt.load_state(optim_url, step, model_url)

    def update(self, batches: list, loss_fn, extras: list, step: int) -> tuple[torch.Tensor, float]:
        """One optimizer step over the micro-``batches``: accumulate, reduce over DP, clip, step.
        Returns the gradient norm (on the device, unread) and the learning rate used."""
        cfg = self.cfg
        self.grads.zero()
        schedule.forward_backward(self.model, batches, loss_fn, extras)
        self.grads.reduce()
        grad_norm = self.grads.clip(cfg.grad_clip)
        self.opt.lr = optim.lr_at(step, self.lr, cfg.warmup_steps, cfg.total_steps, cfg.lr_decay)
        self.opt.step()
        return grad_norm, self.opt.lr

    def save_weights(self, root: str, store_dtype: torch.dtype) -> None:
        """Collective: the weights (from the fp32 masters, as ``store_dtype``) under ``root/model``."""
        checkpoint.save(self.opt.model_state(store_dtype), f"{root}/{contract.MODEL}")

    def save_optimizer(self, root: str) -> None:
        """Collective: the optimizer state in fp32 (moments, and masters when they are copies) under
        ``root/optim``."""
        checkpoint.save(self.opt.state(), f"{root}/{contract.OPTIM}")

    def save(self, root: str, store_dtype: torch.dtype) -> None:
        """Collective: both, under one ``root`` (a resumable state of the run)."""
        self.save_weights(root, store_dtype)
        self.save_optimizer(root)

    def free_gradients(self) -> None:
        """After the last step: drop the fp32 gradient buffer (4 bytes a parameter), which nothing
        saved reads, so the memory is free before the outputs are written. No step may follow."""
        for p in self.grads.params:
            p.grad = None
            del p.main_grad  # a view of the buffer; bf16 parameters' hooks would read it on a backward
        self.opt.inner.zero_grad(set_to_none=True)  # the masters' .grad: views of it too
        self.grads = None

    def restore(self, root: str, step: int) -> None:
        """Collective: what ``save`` wrote, as of optimizer step ``step``."""
        checkpoint.load_model(self.model, f"{root}/{contract.MODEL}")
        self.opt.load_state(f"{root}/{contract.OPTIM}", step, f"{root}/{contract.MODEL}")


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    if temperature == 1.0:
        return logits  # the vocab-parallel ops upcast to fp32 themselves
    # In fp32: dividing bf16 logits would round them again. Padded vocabulary sits at the dtype's
    # minimum; keep it finite after scaling.
    return (logits.float() / temperature).clamp(min=torch.finfo(torch.float32).min)


def token_outputs(model, samples: list[Sample], groups: list[list[int]], temperature: float) -> list[list[float]] | None:
    """Per-response-token log-probs (CausalLM) or values (Value) for ``groups`` of samples; None
    off the last pipeline stage. Each micro-batch's head output is reduced as soon as it exists:
    a whole batch of ``[tokens, vocab]`` logits never lives at once."""
    dev = next(model.parameters()).device
    batches, metas = [], []
    for g in groups:
        ids, mask, labels, _ = padded([samples[i] for i in g], dev)
        batch = model.make_batch(ids, mask)
        batches.append(batch)
        metas.append((batch, labels))

    def per_token(out, meta):
        batch, labels = meta
        if model.hf_head == "lm":
            out = vocab_parallel.log_probs(_scaled(out, temperature), batch.flat(labels), model.tp_group)
        return batch.to_padded(out)

    with torch.no_grad():
        outs = schedule.forward_backward(model, batches, per_token, metas, forward_only=True)
    if not model.topology.is_last_stage:
        return None
    return [v for g, out in zip(groups, outs) for v in response_values([samples[i] for i in g], out)]


def gather_dp(mine: dict[int, list[float]] | None, topo: Topology) -> dict[int, list[float]] | None:
    """Collective over DP: every rank's ``{sample index: values}`` merged (None stays None: off the
    last stage)."""
    if mine is None:
        return None
    if topo.dp == 1:
        return mine
    parts: list = [None] * topo.dp
    dist.all_gather_object(parts, mine, group=topo.groups.dp)
    return {k: v for p in parts for k, v in p.items()}


class Aggregation:
    """A mini-batch's loss from the per-token losses of its micro-batches (``loss_agg``): each
    micro-batch's share (``rl.aggregate``), so the shares summed over micro-batches and DP ranks
    are the mini-batch's mean."""

    def __init__(self, mode: str, response_lens: list[int], norm: int | None = None):
        """``norm``: seq-mean-token-sum-norm's constant number of tokens per sequence."""
        self.mode = mode
        self.tokens = sum(response_lens)
        if mode == "seq-mean-token-sum-norm":
            if norm is None:
                raise ValueError("seq-mean-token-sum-norm needs its constant number of tokens per sequence")
            self.denominator = float(len(response_lens) * norm)
        else:
            self.denominator = float(self.tokens if mode == "token-mean" else len(response_lens))

    @staticmethod
    def packed(batch: TokenBatch, resp: torch.Tensor) -> dict:
        """What a micro-batch's share reads, in ``batch``'s token order: the response mask ``resp``,
        each token's sequence, and the number of sequences (the rows, known here on the host)."""
        return {"resp": batch.flat(resp), "seq": batch.flat(rl.sequence_index(resp)), "sequences": resp.shape[0]}

    def __call__(self, loss: torch.Tensor, x: dict) -> torch.Tensor:
        return rl.aggregate(loss, x["resp"], self.mode, self.denominator, seq=x["seq"], sequences=x["sequences"])


def policy_terms(cfg: PPOConfig, logp: torch.Tensor, x: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The per-token policy loss of ``cfg.policy_loss`` over a micro-batch's packed tokens ``x``
    (``train_step``'s extras), where its clip acted (or its weight was capped), and the approximate
    KL. GSPO's sequence ratio reads each token's sequence (``x["seq"]``): a micro-batch holds whole
    sequences, and every TP rank every token's log-prob, so it is the same at any layout."""
    old, adv = x["old_logp"], x["adv"]
    if cfg.policy_loss == "gspo":
        return rl.gspo_loss(logp, old, adv, x["resp"], cfg.clip_eps, cfg.clip_eps_high, x["seq"], x["sequences"])
    if cfg.policy_loss == "cispo":
        return rl.cispo_loss(logp, old, adv, cfg.cispo_cap)
    if cfg.policy_loss == "sapo":
        return rl.sapo_loss(logp, old, adv, cfg.sapo_tau_pos, cfg.sapo_tau_neg)
    return rl.policy_loss(logp, old, adv, cfg.clip_eps, cfg.dual_clip, cfg.clip_eps_high)


def train_step(cfg: PPOConfig, trainers: dict[str, Trainer], samples: list[Sample], data: dict | None,
               batch_idx: list[int], step: int, dev, agg_norm: int | None = None, check: StepCheck | None = None) -> dict:
    """One optimizer step of every role on the mini-batch ``batch_idx``; its metrics (the losses on
    the last pipeline stage only, where ``data`` — ``ppo_data.advantages`` — lives). ``agg_norm``:
    the constant of ``loss_agg`` seq-mean-token-sum-norm. Collective: the step's losses, gradient
    norms and masters are checked (``check``, by default one that knows no stored dtype) and a
    non-finite one stops every rank with a ``UserError``."""
    check = check if check is not None else StepCheck(cfg, [s.score for s in samples], dev)
    actor = trainers[contract.ACTOR].model
    topo = actor.topology
    mine = batch_idx[topo.dp_rank :: topo.dp]
    groups = micro_batches(mine, samples, cfg.micro_batch_tokens)
    agg = Aggregation(cfg.loss_agg, [samples[i].response_len for i in batch_idx], agg_norm)
    weighed = cfg.uses_tis()
    tokens = agg.tokens
    # Metric sums stay on the device (a host read per micro-batch would stall the GPU); read once a step.
    sums = {k: torch.zeros((), dtype=torch.float64, device=dev)
            for k in ("policy_loss", "entropy", "approx_kl", "clip_fraction", "value_loss")}

    batches, extras = [], []
    for g in groups:
        ids, mask, labels, resp = padded([samples[i] for i in g], dev)
        batch = actor.make_batch(ids, mask)
        batches.append(batch)
        if data is None:
            extras.append(None)
            continue
        rows, width = torch.tensor(g, device=dev), ids.shape[1]
        keys = ("old_logp", "ref_logp", "adv", "values", "returns") + (("tis",) if weighed else ())
        mine_of = {k: batch.flat(data[k][rows, :width]) for k in keys}
        extras.append({"labels": batch.flat(labels), **agg.packed(batch, resp), **mine_of})

    def actor_loss(out, x):
        logp, entropy = vocab_parallel.log_probs_and_entropy(_scaled(out, cfg.temperature), x["labels"],
                                                             actor.tp_group)
        pg, clipped, approx_kl = policy_terms(cfg, logp, x)
        if weighed:  # truncated importance weights: constants, π_old over the sampling policy
            pg = pg * x["tis"]
        loss = agg(pg, x)
        sums["policy_loss"] += loss.detach()
        sums["clip_fraction"] += (clipped * x["resp"]).sum().detach() / tokens
        sums["approx_kl"] += (approx_kl * x["resp"]).sum().detach() / tokens
        # Entropy is a reported metric every step, and a bonus when entropy_coef > 0.
        ent_term = agg(entropy, x)
        sums["entropy"] += ent_term.detach()
        if cfg.entropy_coef:
            loss = loss - cfg.entropy_coef * ent_term
        if cfg.use_kl_loss:
            kl_loss = cfg.kl_coef * agg(rl.kl_estimate(logp, x["ref_logp"], cfg.kl_estimator), x)
            check.watch("KL loss", kl_loss)
            loss = loss + kl_loss
        return loss

    def critic_loss(out, x):
        loss = agg(rl.value_loss(out, x["values"], x["returns"], cfg.value_clip), x)
        sums["value_loss"] += loss.detach()
        return loss

    metrics, norms = {}, {}
    for name, t in trainers.items():
        norms[name], metrics[f"{name}_lr"] = t.update(
            batches, actor_loss if name == contract.ACTOR else critic_loss, extras, step)
        check.watch(f"{name} grad norm", norms[name])
        check.watch_update(name, t.opt)
    check.watch("policy loss", sums["policy_loss"])
    check.watch("entropy", sums["entropy"])
    if contract.CRITIC in trainers:
        check.watch("value loss", sums["value_loss"])
    check.verify(f"optimizer step {step + 1}")
    metrics.update({f"{name}_grad_norm": float(norm) for name, norm in norms.items()})  # read: the check synced

    metrics["tokens"] = sum(len(samples[i].ids) for i in batch_idx)
    if topo.is_last_stage:
        reduced = torch.stack(list(sums.values()))
        if topo.dp > 1:
            dist.all_reduce(reduced, group=topo.groups.dp)
        metrics.update(dict(zip(sums, reduced.tolist())))
        if contract.CRITIC not in trainers:
            metrics["value_loss"] = None  # no critic, no value loss: undefined, not 0
        metrics["mean_score"] = sum(samples[i].score for i in batch_idx) / len(batch_idx)
        metrics["mean_response_length"] = tokens / len(batch_idx)
        metrics["kl"] = data["kl"]
        if weighed:
            metrics.update(tis_stats(data, batch_idx))
    return metrics
