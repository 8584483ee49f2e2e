"""What ppo checks so that it never trains on, or publishes, anything non-finite (docs/rl.md, §6):
that some optimizer step has a learning rate above 0 (``check_schedule``, before any weight is
read), and the terms of ``TERMS`` before the first step and at every one (``StepCheck``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from llamarl.lib import dtypes
from llamarl.lib.rl import optim
from llamarl.lib.errors import UserError
from llamarl.stages.config import PPOConfig

# In the order a fault spreads — inputs, losses, gradients, weights — so that the first term
# flagged is the one nearest to its cause; each with the role whose numbers it is.
TERMS = {"log-probs": "actor", "advantages": "actor", "returns": "critic", "policy loss": "actor", "entropy": "actor",
         "KL loss": "actor", "value loss": "critic", "actor grad norm": "actor", "critic grad norm": "critic",
         "actor masters": "actor", "critic masters": "critic"}


class StepCheck:
    """Flags what must stay finite during one optimizer step (or before the first), on the device;
    ``verify`` agrees on them over every rank and raises the first one as a one-line ``UserError``."""

    def __init__(self, cfg: PPOConfig, scores: list[float], device, stored: torch.dtype | None = None):
        """``scores``: the batch's scores (their range is the likely cause of most faults);
        ``stored``: the dtype the checkpoints store, which the masters must fit in."""
        self.cfg, self.device, self.stored = cfg, device, stored
        self.scores = (min(scores), max(scores))
        self._bad: dict[str, torch.Tensor] = {}
        self._updates: dict[str, tuple[float, torch.dtype]] = {}  # role: its step's lr, the masters' narrowest dtype

    def watch(self, term: str, *tensors: torch.Tensor) -> None:
        """Flag ``term`` if any element of ``tensors`` is inf or nan."""
        for t in tensors:
            self._flag(term, ~torch.isfinite(t.detach()).all())

    def watch_update(self, role: str, opt: optim.ShardedAdamW) -> None:
        """Flag ``<role> masters`` if a master ``opt`` just updated is not finite or too large for the
        parameters' dtype or the stored one (a bf16 or fp16 copy of it would be inf)."""
        narrowest = min((opt.param_dtype, self.stored or torch.float32), key=lambda d: torch.finfo(d).max)
        self._flag(f"{role} masters", ~(opt.largest_master() <= torch.finfo(narrowest).max))
        self._updates[role] = (opt.lr, narrowest)

    def _flag(self, term: str, bad: torch.Tensor) -> None:
        if term not in TERMS:
            raise ValueError(f"{term!r} is not a term of the step check ({', '.join(TERMS)})")
        self._bad[term] = self._bad[term] | bad if term in self._bad else bad

    def verify(self, when: str) -> None:
        """Collective over every rank: a ``UserError`` (the same on every rank) if any rank flagged a
        term since the last call. One all-reduce of one small tensor, one read."""
        flags, updates = self.take()
        self.judge(when, flags.tolist(), updates)

    def take(self) -> tuple[torch.Tensor, dict]:
        """Collective: the flags raised since the last ``take``, agreed over every rank, on the device
        and unread (one per term of ``TERMS``), with what ``judge`` needs to name their cause; the
        check starts again. Read later, they let the host run ahead of the device."""
        no = torch.zeros((), dtype=torch.bool, device=self.device)
        flags = torch.stack([self._bad.get(t, no) for t in TERMS]).float()
        self._bad = {}
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        return flags, dict(self._updates)

    def judge(self, when: str, flags: list[float], updates: dict) -> None:
        """A ``UserError`` naming the first term ``take``'s ``flags`` (read) raised, if any."""
        failed = [t for t, bad in zip(TERMS, flags) if bad]
        if failed:
            also = f" (also: {', '.join(failed[1:])})" if len(failed) > 1 else ""
            raise UserError(f"ppo {when}: {failed[0]} not finite{self._range(failed[0], updates)}{also}; likely "
                            f"cause: {self._cause(failed[0], updates)}; nothing was published")

    def _range(self, term: str, updates: dict) -> str:
        role = TERMS[term]
        if term != f"{role} masters" or updates[role][1] == torch.float32:
            return ""
        return f" or beyond {dtypes.name(updates[role][1])}"

    def _cause(self, term: str, updates: dict) -> str:
        cfg, role = self.cfg, TERMS[term]
        kl = f", kl_coef={cfg.kl_coef:g}" if cfg.kl_coef and not cfg.use_kl_loss else ""
        rewards = f"the rewards' scale (scores from {self.scores[0]:g} to {self.scores[1]:g}{kl})"
        base_lr = cfg.actor_lr if role == "actor" else cfg.critic_lr
        used = updates.get(role, (base_lr,))[0]  # the schedule's, at this step
        lr = f"{role}_lr={base_lr:g}" + (f", now {used:g}" if used != base_lr else "")
        if term == "log-probs":
            return ("a log-prob of -inf or nan: the rollout's recorded response_logprobs, a response token the "
                    f"reference gives probability 0, logits / temperature overflowing (temperature={cfg.temperature:g}), "
                    "or weights of the actor or reference that are not finite")
        if term == f"{role} masters":
            return f"the learning rate ({lr}); lower it"
        if term in ("advantages", "returns"):
            return f"{rewards}; scale the scores down (a rule's weight) or lower kl_coef"
        return f"{rewards}, or a learning rate too high for the {role} ({lr}) in an earlier update"


def check_schedule(cfg: PPOConfig, start_step: int, steps: int) -> None:
    """Refuse an iteration in which every optimizer step of every role that trains has learning
    rate 0: its ``lr_decay`` reached 0 at ``total_steps`` before the iteration's first step."""
    lrs = [cfg.actor_lr] + ([cfg.critic_lr] if cfg.advantage == "gae" else [])
    if any(optim.lr_at(s, lr, cfg.warmup_steps, cfg.total_steps, cfg.lr_decay) > 0
           for lr in lrs for s in range(start_step, start_step + steps)):
        return
    raise UserError(f"{cfg.actor}: this iteration's optimizer steps {start_step + 1}..{start_step + steps} all come "
                    f"at or after total_steps={cfg.total_steps}, where lr_decay={cfg.lr_decay!r} has brought the "
                    "learning rate to 0, so no weight would change; raise total_steps, or set lr_decay to 'constant'")
