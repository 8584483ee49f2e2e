"""The ppo stage's config: the advantage estimator, the policy and value losses, the optimizer
and its schedule, and how π_old and importance weights are taken."""

from __future__ import annotations

from typing import Annotated, ClassVar, Literal

from pydantic import Field, model_validator

from llamarl.lib.options import FieldsError

from .base import OUTPUT, Count, StageConfig, TrainDtype, Url, layout, marked, path, placement
from .rollout import _temperature


# Estimators whose baseline is a prompt's other samples: they need samples_per_prompt >= 2.
GROUP_ADVANTAGES = ("grpo", "rloo", "reinforce++-baseline")


class PPOConfig(StageConfig):
    prepares: ClassVar[bool] = True  # its training's compiled kernels (stages/ppo.py ``prepare``)

    rollout: Url = path("Published rollout folder.")
    scores: Url = path("Published scores folder of that rollout.")
    actor: Url = path("Actor checkpoint to update (from shard or the previous ppo).")
    out: Url = path("Output folder: actor/, critic/ (published checkpoints) and metrics.jsonl.", kind=OUTPUT)
    reference: Url | None = path("Frozen reference for the KL; default: the actor (right for the first "
                                 "iteration).", None)
    critic: Url | None = path("Critic checkpoint (head 'score'); default: the actor's backbone with a zero "
                              "value head.", None)
    tp: int = layout("Tensor-parallel size; processes = tp × pp × dp.")
    pp: int = layout("Pipeline-parallel size (1F1B schedule).")
    dp: int = layout("Data-parallel groups; the optimizer state is sharded over them (ZeRO-1).")
    # Not an option: what the stage publishes, not what it computes (so no part of its identity);
    # the pipeline sets it from the run spec's retention.train_state_every.
    write_train_state: bool = Field(True, description="Write the training state under OUT/train_state/; false: "
                                                      "where the next ppo can take it from this resident worker's "
                                                      "memory, publish it as not written, else write it all the "
                                                      "same (the pipeline sets it).", **marked(OUTPUT))
    sequence_parallel: bool = placement(False, "Split activations along tokens between TP ranks outside attention "
                                               "and MLP (needs tp > 1): less activation memory, the same update up to rounding.")
    advantage: Literal["gae", "grpo", "rloo", "reinforce++", "reinforce++-baseline"] = Field(
        "gae", description="gae | grpo | rloo | reinforce++ | reinforce++-baseline. gae: GAE with a critic (the only "
                           "one that trains a critic); grpo: score minus its prompt's mean, over the group's std; "
                           "rloo: score minus the mean of the prompt's other samples; reinforce++: returns of the "
                           "KL-penalised rewards, whitened over the batch; reinforce++-baseline: the same from scores "
                           "minus their prompt's mean. Formulas: docs/rl.md.")
    grpo_norm_by_std: bool = Field(True, description="grpo: divide by the group's score std; false for Dr. GRPO "
                                                     "(score minus the group mean only).")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ.")
    kl_coef: float = Field(0.05, ge=0, description="β of the KL penalty in the reward (or of the KL loss with "
                                                   "use_kl_loss); 0: no KL, no reference read, the kl metric null.")
    kl_estimator: Literal["kl", "abs", "mse", "low_var_kl"] = Field("kl", description="kl | abs | mse | low_var_kl.")
    use_kl_loss: bool = Field(False, description="KL as a loss term instead of a reward penalty.")
    whiten_advantages: bool = Field(True, description="Normalise gae, reinforce++ and reinforce++-baseline "
                                                      "advantages to mean 0, std 1 over the batch's response tokens.")
    clip_eps: float = Field(0.2, gt=0, lt=1, description="PPO ratio clip ε, below 1: the ratio is kept within "
                                                          "[1 − ε, 1 + ε] (the upper bound 1 + clip_eps_high when "
                                                          "that is set).")
    clip_eps_high: float | None = Field(None, gt=0, description="Upper ratio clip ε_high, for clip-higher (DAPO: "
                                                                "0.28 with clip_eps 0.2); null: clip_eps.")
    dual_clip: float | None = Field(3.0, gt=1, description="Dual-clip bound c (> 1) for negative advantages; null "
                                                           "to disable.")
    policy_loss: Literal["ppo", "gspo", "cispo", "sapo"] = Field(
        "ppo", description="The policy loss: ppo (the clipped ratio per token: clip_eps, clip_eps_high, dual_clip) | "
                           "gspo (the ratio and its clip per sequence, the geometric mean of the response's token "
                           "ratios: clip_eps, clip_eps_high; the paper's 3e-4 and 4e-4) | cispo (the log-prob's "
                           "gradient weighed by the ratio capped at cispo_cap, a constant: no token's gradient is "
                           "dropped) | sapo (a smooth gate of temperature sapo_tau_pos / sapo_tau_neg instead of the "
                           "clip). Formulas: docs/rl.md.")
    cispo_cap: float = Field(5.0, ge=1, allow_inf_nan=False,
                             description="cispo: the largest importance weight (1 + MiniMax-M1's ε_high; no lower "
                                         "bound); ≥ 1, so that an on-policy token weighs 1.")
    sapo_tau_pos: float = Field(1.0, gt=0, allow_inf_nan=False,
                                description="sapo: the gate's temperature τ for positive advantages (larger: "
                                            "the gradient fades faster as the ratio leaves 1).")
    sapo_tau_neg: float = Field(1.05, gt=0, allow_inf_nan=False,
                                description="sapo: τ for the other advantages (the paper: larger than sapo_tau_pos, "
                                            "so that negative updates fade faster).")
    value_clip: float | None = Field(0.2, gt=0, description="Clip of the value update around the old values; null "
                                                            "to disable.")
    entropy_coef: float = Field(0.0, description="Entropy bonus weight (entropy is reported every step either way).")
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = Field(
        "token-mean", description="How a mini-batch's token losses make its loss: token-mean (over its tokens) | "
                                  "seq-mean-token-mean (each sequence's mean, then their mean) | "
                                  "seq-mean-token-sum-norm (Dr. GRPO: the sum over tokens / (sequences × "
                                  "loss_agg_norm)).")
    loss_agg_norm: Count | None = Field(None, description="seq-mean-token-sum-norm's constant number of tokens per "
                                                          "sequence; null: the rollout's sampling.max_new_tokens.")
    ppo_epochs: Count = Field(1, description="Passes over the rollout.")
    mini_batch_size: Count = Field(8, description="Sequences per optimizer step (over all DP ranks).")
    micro_batch_tokens: Count = Field(4096, description="Token budget of one forward/backward (per rank): whole "
                                                        "sequences packed to it, longest first; a longer one alone. "
                                                        "The forwards without gradients (reference, old log-probs, "
                                                        "old values) take twice it.")
    # AdamW moves every weight by about lr a step, whatever the gradient's scale: at lr > 1 no model survives.
    actor_lr: float = Field(1e-6, ge=0, le=1, description="Actor learning rate (AdamW), at most 1.")
    critic_lr: float = Field(1e-5, ge=0, le=1, description="Critic learning rate (AdamW), at most 1.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay (actor and critic).")
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = Field(
        (0.9, 0.999), strict=False, description="AdamW betas.")  # a list (YAML, JSON) is a tuple; its items stay strict
    warmup_steps: int = Field(0, ge=0, description="Linear LR warm-up, in optimizer steps counted across iterations.")
    lr_decay: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="constant | linear | cosine (to 0 at total_steps, after the warm-up; needs "
                                "total_steps).")
    total_steps: Count | None = Field(None, description="The optimizer step (counted across iterations) at which "
                                                        "lr_decay reaches 0; larger than warmup_steps.")
    grad_clip: float | None = Field(1.0, gt=0, description="Clip the global gradient norm (the same at every "
                                                           "layout); null to disable.")
    temperature: Annotated[float, _temperature(greedy=False)] = Field(
        1.0, gt=0, description="Must equal the rollout's: log-probs are of softmax(logits / temperature).")
    off_policy: bool = Field(False, description="Allow a rollout sampled from another actor checkpoint than actor "
                                                "(its recorded log-probs are then another policy's); by default that "
                                                "is refused as a mix-up. The pipeline sets it with max_staleness > 0.")
    old_logp: Literal["auto", "rollout", "actor"] = Field(
        "auto", description="π_old, what the clipped ratio divides by: rollout (the log-probs the rollout recorded) | "
                            "actor (recomputed by the actor before the update, one more forward pass) | auto (actor "
                            "when off_policy, else rollout).")
    tis: Literal["auto", "on", "off"] = Field(
        "auto", description="Truncated importance sampling: weigh each token's policy loss by min(π_old / "
                            "π_rollout, tis_cap), correcting for samples drawn by another policy (an older actor, "
                            "or the rollout engine's numerics). auto: on when old_logp is the actor's. With old_logp "
                            "rollout every weight is 1.")
    tis_level: Literal["token", "sequence"] = Field(
        "token", description="What tis weighs: token (each token by its own ratio) | sequence (every token of a "
                             "response by the response's ratio, the product of its tokens', capped at tis_cap).")
    tis_cap: float = Field(2.0, ge=1, description="C of tis: the largest importance weight (≥ 1, so that equal "
                                                  "log-probs weigh exactly 1).")
    dynamic_sampling: bool = Field(False, description="DAPO dynamic sampling: drop the prompts whose samples' scores "
                                                      "are all equal (no signal against each other) before training; "
                                                      "the manifest counts groups dropped and kept.")
    train_groups: Count | None = Field(None, description="With dynamic_sampling: train on at most this many of the "
                                                         "kept prompts, drawn by seed (the fixed batch DAPO fills; "
                                                         "give the rollout more prompts than this to over-sample); "
                                                         "null: every kept prompt.")
    seed: int = Field(0, ge=0, lt=2**32, description="Seed of the mini-batch order (the same at every layout); "
                                                      "0 ≤ seed < 2³² (it seeds torch generators).")
    save_every: int = placement(0, "Save resumable training state every N optimizer steps (0: only at the end); "
                                   "a resumed run ends bit-identical, so this changes no result.", ge=0)
    dtype: TrainDtype = Field(
        "auto", description="Parameters and activations: auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32 (fp16 would "
                            "need loss scaling). Gradients are accumulated and reduced, and master weights and Adam "
                            "moments kept, in fp32 whatever this is; log-probs, KL, advantages and losses are fp32 "
                            "too. Checkpoints keep the actor's stored dtype.")

    @model_validator(mode="after")
    def _trains(self):
        if self.actor_lr > 0 or (self.advantage == "gae" and self.critic_lr > 0):
            return self
        if self.advantage != "gae":
            raise FieldsError(f"{{actor_lr}} is 0 and {{advantage}}={self.advantage!r} trains no critic: no weight "
                              "would change; raise {actor_lr}")
        raise FieldsError("{actor_lr} and {critic_lr} are both 0: neither the actor nor the critic would change; raise "
                          "one of them")

    @model_validator(mode="after")
    def _consistent(self):
        if self.loss_agg_norm is not None and self.loss_agg != "seq-mean-token-sum-norm":
            raise FieldsError(f"{{loss_agg_norm}} is read by {{loss_agg}}='seq-mean-token-sum-norm' only (it is "
                              f"{self.loss_agg!r}); remove {{loss_agg_norm}} or change {{loss_agg}}")
        if not self.grpo_norm_by_std and self.advantage != "grpo":
            raise FieldsError(f"{{grpo_norm_by_std}} applies to {{advantage}}='grpo' only (it is {self.advantage!r}); "
                              "remove {grpo_norm_by_std} or set {advantage} to 'grpo'")
        if self.train_groups is not None and not self.dynamic_sampling:
            raise FieldsError("{train_groups} is the batch of {dynamic_sampling}, which is off; set "
                              "{dynamic_sampling}: true or remove {train_groups}")
        for name, modes in {"clip_eps": ("ppo", "gspo"), "clip_eps_high": ("ppo", "gspo"), "dual_clip": ("ppo",),
                            "cispo_cap": ("cispo",), "sapo_tau_pos": ("sapo",), "sapo_tau_neg": ("sapo",)}.items():
            if self.policy_loss not in modes and getattr(self, name) != type(self).model_fields[name].default:
                raise FieldsError(f"{{{name}}} is read by {{policy_loss}} {' or '.join(map(repr, modes))} only (it is "
                                  f"{self.policy_loss!r}); remove {{{name}}} or change {{policy_loss}}")
        if self.tis_level != "token" and self.tis == "off":
            raise FieldsError("{tis_level} chooses what {tis} weighs, and {tis} is off; remove {tis_level} or set "
                              "{tis} to 'auto' or 'on'")
        if self.sequence_parallel and self.tp == 1:
            raise FieldsError("{sequence_parallel} needs {tp} > 1; raise {tp} or turn {sequence_parallel} off")
        if self.lr_decay != "constant" and self.total_steps is None:
            raise FieldsError(f"{{lr_decay}}={self.lr_decay!r} decays over {{total_steps}}, which is not set; set "
                              "{total_steps}, or set {lr_decay} to 'constant'")
        if self.total_steps is not None and self.total_steps <= self.warmup_steps:
            raise FieldsError(f"{{total_steps}}={self.total_steps} must be larger than {{warmup_steps}}="
                              f"{self.warmup_steps} (the decay follows the warm-up); raise {{total_steps}} or lower "
                              "{warmup_steps}")
        return self

    def old_logp_source(self) -> Literal["rollout", "actor"]:
        """Where π_old comes from, ``auto`` resolved."""
        return ("actor" if self.off_policy else "rollout") if self.old_logp == "auto" else self.old_logp

    def uses_tis(self) -> bool:
        """Whether the policy loss is weighed by truncated importance weights, ``auto`` resolved."""
        return self.tis == "on" or (self.tis == "auto" and self.old_logp_source() == "actor")

