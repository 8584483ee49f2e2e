"""PPO's models at work: the frozen forward passes (reference log-probs, old values) and the update
step, one ``Trainer`` per role. Every pass runs the 1F1B schedule over micro-batches of packed
tokens; each micro-batch's loss is its share of the mini-batch's (``Aggregation``), so what is
accumulated over micro-batches and DP ranks sums to the mini-batch's mean.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llamarl.lib.files import checkpoint
from llamarl.lib.rl import core as rl, optim
from llamarl.lib.model import schedule, vocab_parallel
from llamarl.lib.distributed.parallel import Topology
from llamarl.stages import contract, ppo_kept
from llamarl.stages.config import PPOConfig
from llamarl.stages.ppo_checks import StepCheck
from llamarl.stages.ppo_batches import StepBatches, step_batches
from llamarl.stages.ppo_data import Sample, response_values, tis_reads


STATE_WRITERS = 8
"""Files (and threads) a rank writes its optimizer state into: six times the weights' bytes, on
the critical path of a run with ``max_staleness: 1`` (the next ppo reads it)."""


class Trainer:
    """One role's model with its fp32 gradient buffer and ZeRO-1 optimizer; the optimizer state
    comes from ``optim_url`` (moments, masters) or, for masters, from ``model_url`` at its stored
    precision."""

    def __init__(self, model, lr: float, cfg: PPOConfig, optim_url: str | None, model_url: str | None, step: int,
                 opt: optim.ShardedAdamW | None = None):
        """``opt``: the optimizer, with its state, the previous ppo left in this process
        (stages/ppo_kept.py), instead of one read from ``optim_url``."""
        self.model, self.lr, self.cfg = model, lr, cfg
        self.grads = optim.GradBuffer(model)
        if opt is None:
            opt = optim.ShardedAdamW(model, lr, cfg.betas, weight_decay=cfg.weight_decay)
            opt.load_state(optim_url, step, model_url)
        self.opt = opt

    def update(self, batches: list, loss_fn, extras: list, step: int) -> tuple[torch.Tensor, float]:
        """One optimizer step over the micro-``batches``: accumulate, reduce over DP, clip, step.
        Returns the gradient norm (on the device, unread) and the learning rate used."""
        cfg = self.cfg
        self.grads.zero()
        schedule.forward_backward(self.model, batches, loss_fn, extras)
        self.grads.reduce()
        grad_norm, clip = self.grads.clip_factor(cfg.grad_clip)
        self.opt.lr = optim.lr_at(step, self.lr, cfg.warmup_steps, cfg.total_steps, cfg.lr_decay)
        self.opt.step(clip)
        return grad_norm, self.opt.lr

    def save_weights(self, root: str, store_dtype: torch.dtype) -> None:
        """Collective: the weights (from the fp32 masters, as ``store_dtype``) under ``root/model``."""
        checkpoint.save(self.opt.model_state(store_dtype), f"{root}/{contract.MODEL}")

    def save_optimizer(self, root: str) -> None:
        """Collective: the optimizer state in fp32 (moments, and masters when they are copies) under
        ``root/optim``."""
        checkpoint.save(self.opt.state(), f"{root}/{contract.OPTIM}", threads=STATE_WRITERS)

    def free_gradients(self) -> None:
        """After the last step: drop the fp32 gradient buffer (4 bytes a parameter), which nothing
        saved reads, so the memory is free before the outputs are written. No step may follow."""
        for p in self.grads.params:
            p.grad = None
            del p.main_grad  # a view of the buffer; bf16 parameters' hooks would read it on a backward
        self.opt.inner.zero_grad(set_to_none=True)  # the masters' .grad: views of it too
        self.grads = None

    def restore(self, root: str, step: int) -> None:
        """Collective: what ``save_weights`` and ``save_optimizer`` wrote under ``root``, as of optimizer
        step ``step``."""
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
    batches, extras = step_batches(model, samples, groups, None, next(model.parameters()).device)

    def per_token(out, meta):
        batch, x = meta
        if model.hf_head == "lm":
            out = vocab_parallel.log_probs(_scaled(out, temperature), x["labels"], model.tp_group)
        return batch.to_padded(out)

    with torch.no_grad():
        outs = schedule.forward_backward(model, batches, per_token, list(zip(batches, extras)), forward_only=True)
    if not model.topology.is_last_stage:
        return None
    # One copy to the host a micro-batch, not one a sample.
    return [v for g, out in zip(groups, outs) for v in response_values([samples[i] for i in g], out.cpu())]


def reference_source(cfg: PPOConfig, reference_id: str, actor_id: str, sampled_by: str,
                     sampled_at: float | None) -> str:
    """Where π_ref's log-probs come from, so that no forward pass runs whose result is at hand:
    ``none``, ``actor``, ``rollout`` or ``forward``, when and why as docs/rl.md §2 tabulates. Ids
    are the published outputs' ids, which hash every file; ``sampled_by``, ``sampled_at``: the id of
    the actor the rollout sampled from and its temperature, from the rollout's manifest."""
    recompute = cfg.old_logp_source() == "actor"
    if cfg.kl_coef == 0:
        return "none"
    if recompute and reference_id == actor_id:
        return "actor"
    recorded_at = 1.0 if sampled_at == 0 else sampled_at  # a greedy rollout records log-probs at 1
    if not recompute and reference_id == sampled_by and recorded_at == cfg.temperature:
        return "rollout"
    return "forward"


def reference_model(actor, reference: str):
    """The reference checkpoint ``reference`` built like the actor and read, for its forward pass."""
    with torch.device(next(actor.parameters()).device):
        ref = type(actor)(actor.cfg, actor.layout, dtype=actor.dtype)
    checkpoint.load_model(ref, f"{reference}/{contract.MODEL}")
    return ref.eval()


def frozen_logprobs(cfg: PPOConfig, source: str, samples: list[Sample], groups: list[list[int]], actor,
                    reference: str, where: tuple) -> tuple[dict[int, list[float]] | None, dict[int, list[float]] | None]:
    """Collective: π_ref's log-probs (from ``source``, ``reference_source``'s; None for ``none``) and,
    with ``old_logp`` actor, π_old's (the actor's before any update), per sample index over all DP
    ranks, on the last pipeline stage (None elsewhere); this rank runs ``groups``. A forward pass
    runs only for what nothing else gives: the reference checkpoint ``reference`` runs only for
    ``forward``, built like the actor (``where``: ``ppo_kept.model_place``'s) and read once a run
    in a resident worker (stages/ppo_kept.py), once a stage otherwise."""
    topo = actor.topology
    ref_logp = None
    if source == "forward":
        ref = ppo_kept.take_reference(reference, where, topo) or reference_model(actor, reference)
        ref_logp = gather_dp(groups, token_outputs(ref, samples, groups, cfg.temperature), topo)
        ppo_kept.keep_reference(reference, ref, where)
        del ref  # its GPU memory, free for the update (a resident worker parked it on the host)
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    actor_logp = None
    if cfg.old_logp_source() == "actor":
        actor_logp = gather_dp(groups, token_outputs(actor, samples, groups, cfg.temperature), topo)
    if source == "actor":
        ref_logp = actor_logp
    elif source == "rollout" and topo.is_last_stage:
        ref_logp = {i: s.rollout_logp for i, s in enumerate(samples)}
    return ref_logp, actor_logp


def gather_dp(groups: list[list[int]], values: list[list[float]] | None,
              topo: Topology) -> dict[int, list[float]] | None:
    """Collective over DP: ``token_outputs``' ``values`` of this rank's ``groups`` and every other
    rank's, by sample index (None stays None: off the last stage)."""
    if values is None:
        return None
    mine = dict(zip([i for g in groups for i in g], values))
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
               batch_idx: list[int], step: int, dev, agg_norm: int | None = None, check: StepCheck | None = None,
               batches: StepBatches | None = None, next_idx: list[int] | None = None) -> StepReads:
    """One optimizer step of every role on the mini-batch ``batch_idx``, launched; its metrics come
    from the ``StepReads`` returned (the losses on the last pipeline stage only, where ``data`` —
    ``ppo_data.advantages`` — lives). ``agg_norm``: the constant of ``loss_agg``
    seq-mean-token-sum-norm. Collective: the step's losses, gradient norms and masters are checked
    (``check``, by default one that knows no stored dtype), and reading a non-finite one stops every
    rank with a ``UserError``. The host waits for nothing here, per micro-batch or per step.
    ``batches``: the run's ``StepBatches``, which build the next step's (``next_idx``) while the
    device works on this one."""
    check = check if check is not None else StepCheck(cfg, [s.score for s in samples], dev)
    actor = trainers[contract.ACTOR].model
    topo = actor.topology
    batches = batches if batches is not None else StepBatches(cfg, actor, samples, data, dev)
    groups, micro, extras = batches.get(batch_idx)
    agg = Aggregation(cfg.loss_agg, [samples[i].response_len for i in batch_idx], agg_norm)
    weighed = cfg.uses_tis()
    tokens = agg.tokens
    # Metric sums stay on the device (a host read per micro-batch would stall the GPU); read once a step.
    sums = {k: torch.zeros((), dtype=torch.float64, device=dev)
            for k in ("policy_loss", "entropy", "approx_kl", "clip_fraction", "value_loss")}

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
        if cfg.use_kl_loss and "ref_logp" in x:  # none without a reference: kl_coef 0
            kl_loss = cfg.kl_coef * agg(rl.kl_estimate(logp, x["ref_logp"], cfg.kl_estimator), x)
            check.watch("KL loss", kl_loss)
            loss = loss + kl_loss
        return loss

    def critic_loss(out, x):
        loss = agg(rl.value_loss(out, x["values"], x["returns"], cfg.value_clip), x)
        sums["value_loss"] += loss.detach()
        return loss

    metrics, reads = {}, {}
    for name, t in trainers.items():
        norm, metrics[f"{name}_lr"] = t.update(micro, actor_loss if name == contract.ACTOR else critic_loss,
                                               extras, step)
        reads[f"{name}_grad_norm"] = norm
        check.watch(f"{name} grad norm", norm)
        check.watch_update(name, t.opt)
    check.watch("policy loss", sums["policy_loss"])
    check.watch("entropy", sums["entropy"])
    if contract.CRITIC in trainers:
        check.watch("value loss", sums["value_loss"])
    if topo.is_last_stage:
        reduced = torch.stack(list(sums.values()))
        if topo.dp > 1:
            dist.all_reduce(reduced, group=topo.groups.dp)
        reads.update(zip(sums, reduced))
        if weighed:
            reads.update(tis_reads(data, batch_idx))
    if next_idx is not None:
        batches.ahead(next_idx)
    known = {"tokens": sum(len(samples[i].ids) for i in batch_idx)}
    if topo.is_last_stage:
        if contract.CRITIC not in trainers:
            known["value_loss"] = None  # no critic, no value loss: undefined, not 0
        known["mean_score"] = sum(samples[i].score for i in batch_idx) / len(batch_idx)
        known["mean_response_length"] = tokens / len(batch_idx)
        known["kl"] = data["kl"]
    return StepReads(check, f"optimizer step {step + 1}", metrics, reads, known)


class StepReads:
    """An optimizer step's metrics and step check, launched: what the device holds of them is copied
    to the host behind the step's work, in one copy. ``result`` waits for that step alone, so the
    host launches the next step before it reads this one, and the device does not wait for the host
    between steps; a step that is not finite still stops the stage before anything after it is
    saved or published (stages/ppo.py reads every step before it does either)."""

    def __init__(self, check: StepCheck, when: str, first: dict, reads: dict[str, torch.Tensor], known: dict):
        """``first``, ``reads`` (on the device) and ``known`` (the host's, which a caller may add to)
        make the metrics, in that order."""
        flags, self._updates = check.take()
        values = torch.cat([flags.double(), torch.stack([x.double() for x in reads.values()])])
        self._check, self._when, self._first, self._names, self.known = check, when, first, list(reads), known
        self._flags = len(flags)
        self._done = None
        if values.is_cuda:
            self._host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
            self._host.copy_(values, non_blocking=True)
            self._done = torch.cuda.Event()
            self._done.record()
        else:
            self._host = values

    def result(self) -> dict:
        """The step's metrics, once the device has done the step; a ``UserError`` (the same on every
        rank) if its check flagged a term."""
        if self._done is not None:
            self._done.synchronize()
        values = self._host.tolist()
        self._check.judge(self._when, values[: self._flags], self._updates)
        return self._first | dict(zip(self._names, values[self._flags :])) | self.known
