"""The stages' configs: one typed, validated model per stage (pydantic), importable without torch.

Every field is one of four kinds, marked once here and read everywhere else:

- an **input** or **output** path: the pipeline fills it in (a run spec may not set it);
- a **layout** count (tp, pp, dp): the pipeline fills it in from the spec's ``layout``;
- a **placement** option: how a stage runs, not what it computes (``score.offload``);
- an ordinary **option**: what the stage computes.

A stage's *identity* (what names its output: the pipeline's keys, the outputs' ``request``) is its
config with outputs, layout and placement blanked, so moving a stage to another layout or flipping
an offload never makes a finished output stale.

Values are checked when a config is built, each error one line naming the field and the fix; so
``llamarl run`` refuses a bad value in any iteration's stage before the first stage starts.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal, TypeVar

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model, field_validator, model_validator

from llamarl.lib.errors import UserError

ComputeDtype = Literal["auto", "bf16", "fp16", "fp32"]
"""What a stage computes in: auto is bf16 on a GPU and fp32 on CPU; fp16 runs on GPUs only."""
StoredDtype = Literal["bf16", "fp16", "fp32"]
"""What a checkpoint stores."""
Count = Annotated[int, Field(ge=1)]

INPUT, OUTPUT, LAYOUT, PLACEMENT = "input", "output", "layout", "placement"
WIRED = (INPUT, OUTPUT, LAYOUT)  # kinds the pipeline fills in
NOT_IDENTITY = (OUTPUT, LAYOUT, PLACEMENT)  # kinds that do not change what a stage computes


def _kind(kind: str) -> dict:
    return {"json_schema_extra": {"kind": kind}}


def path(doc: str, default: Any = ..., *, kind: str = INPUT) -> Any:
    """An input (or, with ``kind=OUTPUT``, output) location, any fsspec URL."""
    return Field(default, description=doc, **_kind(kind))


def layout(doc: str) -> Any:
    return Field(1, ge=1, description=doc, **_kind(LAYOUT))


def placement(default: Any, doc: str) -> Any:
    return Field(default, description=doc, **_kind(PLACEMENT))


def kind_of(field) -> str:
    return (field.json_schema_extra or {}).get("kind", "option")


C = TypeVar("C", bound="StageConfig")


class StageConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_default=True)

    collective_timeout_s: int = placement(
        600, "Seconds a collective (all-reduce, barrier, ...) may wait for a peer before the stage fails with the "
             "lost rank named; bounds how long a job hangs after a host dies. Raise it for steps that are slow "
             "on one rank only (e.g. rank 0 writing a large file while the others wait).")

    @classmethod
    def parse(cls: type[C], data: Any, source: str) -> C:
        """Build from a mapping (YAML / JSON), or raise a one-line ``UserError`` naming ``source``
        and the field."""
        return validate(cls, data, source)

    def identity(self) -> dict:
        """The config as it identifies the stage's output: outputs, layout and placement blanked."""
        values = self.model_dump(mode="json")
        return values | {k: None for k, f in type(self).model_fields.items() if kind_of(f) in NOT_IDENTITY}

    def to_json(self) -> dict:
        """What travels to the stage's processes (``--config-json``)."""
        return self.model_dump(mode="json")


def _where(loc: tuple) -> str:
    return ".".join(str(x) for x in loc if not str(x).startswith("function-"))


def one_line(error: ValidationError, source: str, model: type[BaseModel] | None = None) -> str:
    """A pydantic error as one line: ``SOURCE: FIELD: what is wrong`` (+ how many more)."""
    errors = error.errors(include_url=False)
    first = errors[0]
    where = _where(first["loc"])
    missing = [_where(e["loc"]) for e in errors if e["type"] == "missing"]
    if first["type"] == "missing":
        errors = [e for e in errors if e["type"] != "missing"] + [first]  # counted once below
        text = f"{', '.join(missing)}: required, not given"
    elif first["type"] == "extra_forbidden":
        parent = _model_at(model, first["loc"][:-1]) if model else None
        valid = f"; valid options: {', '.join(parent.model_fields)}" if parent else ""
        text = f"{where}: unknown option{valid}"
    else:
        msg = first["msg"].removeprefix("Value error, ")
        value = first.get("input")
        shown = f"={value!r}" if where and not isinstance(value, dict) else ""
        text = f"{where}{shown}: {msg}" if where else msg
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return f"{source}: {text}{more}"


def _model_at(model, loc) -> type[BaseModel] | None:
    """The model class that holds the field at ``loc`` (for listing its valid options)."""
    for part in loc:
        if isinstance(part, int):
            continue
        field = model.model_fields.get(part) if model else None
        if field is None:
            return None
        ann = field.annotation
        args = getattr(ann, "__args__", ()) or ()
        model = next((a for a in (ann, *args) if isinstance(a, type) and issubclass(a, BaseModel)), None)
    return model


def validate(cls: type[C], data: Any, source: str) -> C:
    if not isinstance(data, dict):
        raise UserError(f"{source}: expected a mapping of options, got {type(data).__name__}")
    try:
        return cls.model_validate(data)
    except ValidationError as e:
        raise UserError(one_line(e, source, cls)) from None


# ---- shard / export ----------------------------------------------------------------------------------


class ShardConfig(StageConfig):
    src: str = path("HF checkpoint directory (any fsspec URL): config.json, *.safetensors, tokenizer files.")
    dst: str = path("Output directory (any fsspec URL); created, or resumed if an earlier run was interrupted.",
                    kind=OUTPUT)
    tp: int = layout("Tensor-parallel size of the job (the checkpoint itself loads at any layout).")
    pp: int = layout("Pipeline-parallel size of the job.")
    dtype: StoredDtype | None = Field(None, description="Stored dtype: bf16 | fp16 | fp32; default: the source's.")


class ExportConfig(StageConfig):
    src: str = path("A published llamarl checkpoint directory (any fsspec URL).")
    dst: str = path("Output HF directory (any fsspec URL).", kind=OUTPUT)
    dtype: StoredDtype | None = Field(None, description="Output dtype: bf16 | fp16 | fp32; default: the checkpoint's.")
    max_shard_gb: float = Field(2.0, gt=0, description="Largest safetensors file, in GB; bigger models are split "
                                                       "with an index, as HF does.")
    verify: bool = placement(True, "Check the checkpoint's files against their checksums before reading.")


# ---- rollout --------------------------------------------------------------------------------------------


class Sampling(BaseModel):
    model_config = ConfigDict(extra="forbid")

    samples_per_prompt: Count = Field(1, description="Responses drawn for each prompt (GRPO-style groups need several).")
    temperature: float = Field(1.0, ge=0, description="Softmax temperature; 0 = greedy.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: keep the smallest set of tokens whose "
                                                      "probability reaches top_p.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 = off.")
    max_new_tokens: Count = Field(256, description="Longest response.")
    stop_token_ids: list[Annotated[int, Field(ge=0)]] = Field(default_factory=list,
                                                              description="Stop tokens besides the checkpoint's EOS.")
    seed: int = Field(0, description="Sampling seed (mixed with each chunk's index).")


class RolloutConfig(StageConfig):
    actor: str = path("Published actor checkpoint (from shard or ppo).")
    prompts: str = path("Parquet or JSONL prompts: a file or a folder of them, any fsspec URL.")
    out: str = path("Output folder for the Parquet parts.", kind=OUTPUT)
    prompt_column: str = Field("prompt", description="Column holding the prompt: text, or chat messages "
                                                     "[{role, content}, ...].")
    id_column: str | None = Field(None, description="Column holding a prompt id; default: the row number.")
    keep_columns: list[str] = Field(default_factory=list, description="Prompt columns copied into every output row "
                                                                      "(e.g. a reference answer for rewards).")
    chat_template: Literal["auto", "never", "always"] = Field(
        "auto", description="auto: apply the tokenizer's chat template if it has one; never; always.")
    max_prompt_tokens: Count | None = Field(
        None, description="Longer prompts keep their last tokens (counted as truncated in the manifest). Prompts are "
                          "also held to the actor's max_position_embeddings − max_new_tokens, as overlong_prompts says.")
    overlong_prompts: Literal["truncate", "error"] = Field(
        "truncate", description="A prompt that leaves no room for max_new_tokens within the actor's "
                                "max_position_embeddings: truncate (keep its last tokens, counted in the manifest) | "
                                "error (stop, naming the row).")
    sampling: Sampling = Field(default_factory=Sampling, description="How responses are drawn.")
    tp: int = layout("Tensor-parallel size; processes = tp × dp.")
    dp: int = layout("Data-parallel groups, each taking every dp-th chunk.")
    chunk_size: Count = Field(64, description="Prompts per part file (the unit of resumption).")
    max_batch: Count = Field(64, description="Sequences decoded together.")
    dtype: ComputeDtype = Field("auto", description="Compute dtype: auto (bf16 on GPU, fp32 on CPU) | bf16 | "
                                                    "fp16 (GPU only) | fp32.")


# ---- score ------------------------------------------------------------------------------------------------

BUILTIN_RULES = ("exact_match", "contains", "regex", "length")  # lib/rewards.py's


class RewardTerm(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(description="rm (the reward model), a built-in rule (exact_match, contains, regex, length) "
                                  "or module:function.")
    weight: float = Field(1.0, description="Weight of this term in the total score.")
    args: dict = Field(default_factory=dict, description="Options of the rule, e.g. {column: answer} or "
                                                         "{pattern: '^yes'}.")

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        if name != "rm" and name not in BUILTIN_RULES and not re.fullmatch(r"[\w.]+:\w+", name):
            raise ValueError(f"use rm, one of {', '.join(BUILTIN_RULES)}, or module:function")
        return name


class ScoreConfig(StageConfig):
    rollout: str = path("Published rollout folder.")
    out: str = path("Output folder for the scores parts.", kind=OUTPUT)
    reward_model: str | None = path("Published reward-model checkpoint (head 'score'); needed when a term is "
                                    "'rm'.", None)
    rewards: list[RewardTerm] = Field(default_factory=lambda: [RewardTerm(name="rm")], min_length=1,
                                      description="Terms of the total score.")
    references: str | None = Field(None, description="Optional Parquet/JSONL with prompt_id and reference columns "
                                                     "for rules, joined on prompt_id.")
    tp: int = layout("Tensor-parallel size; processes = tp × pp × dp.")
    pp: int = layout("Pipeline-parallel size.")
    dp: int = layout("Data-parallel groups, each taking every dp-th part.")
    micro_batch: Count = Field(16, description="Sequences per RM forward.")
    max_length: Count | None = Field(None, description="Longest RM input; default: the RM's "
                                                        "max_position_embeddings.")
    chat_template: Literal["auto", "never"] = Field(
        "auto", description="auto: use the RM tokenizer's chat template when re-tokenizing, if it has one; never.")
    offload: bool = placement(True, "Keep the RM's parameters in host memory between parts.")
    dtype: ComputeDtype = Field("auto", description="Compute dtype: auto (bf16 on GPU, fp32 on CPU) | bf16 | "
                                                    "fp16 (GPU only) | fp32.")

    @model_validator(mode="after")
    def _rm_given(self):
        if any(t.name == "rm" for t in self.rewards) and not self.reward_model:
            raise ValueError("a reward term is 'rm' but no reward_model is given; give one or drop the term")
        return self


# ---- ppo ---------------------------------------------------------------------------------------------------


class PPOConfig(StageConfig):
    rollout: str = path("Published rollout folder.")
    scores: str = path("Published scores folder of that rollout.")
    actor: str = path("Actor checkpoint to update (from shard or the previous ppo).")
    out: str = path("Output folder: actor/, critic/ (published checkpoints) and metrics.jsonl.", kind=OUTPUT)
    reference: str | None = path("Frozen reference for the KL; default: the actor (right for the first "
                                 "iteration).", None)
    critic: str | None = path("Critic checkpoint (head 'score'); default: the actor's backbone with a zero "
                              "value head.", None)
    tp: int = layout("Tensor-parallel size; processes = tp × pp × dp.")
    pp: int = layout("Pipeline-parallel size (1F1B schedule).")
    dp: int = layout("Data-parallel groups; the optimizer state is sharded over them (ZeRO-1).")
    sequence_parallel: bool = Field(False, description="Split activations along tokens between TP ranks outside "
                                                       "attention and MLP (needs tp > 1).")
    advantage: Literal["gae", "grpo"] = Field("gae", description="gae | grpo (group-normalised scores; no critic).")
    gamma: float = Field(1.0, ge=0, le=1, description="GAE discount.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE λ.")
    kl_coef: float = Field(0.05, ge=0, description="β of the KL penalty in the reward (or of the KL loss with "
                                                   "use_kl_loss).")
    kl_estimator: Literal["kl", "abs", "mse", "low_var_kl"] = Field("kl", description="kl | abs | mse | low_var_kl.")
    use_kl_loss: bool = Field(False, description="KL as a loss term instead of a reward penalty.")
    whiten_advantages: bool = Field(True, description="Normalise GAE advantages to mean 0, std 1 over the batch's "
                                                      "response tokens.")
    clip_eps: float = Field(0.2, gt=0, description="PPO ratio clip ε.")
    dual_clip: float | None = Field(3.0, gt=1, description="Dual-clip bound c (> 1) for negative advantages; null "
                                                           "to disable.")
    value_clip: float | None = Field(0.2, gt=0, description="Clip of the value update around the old values; null "
                                                            "to disable.")
    entropy_coef: float = Field(0.0, description="Entropy bonus weight (entropy is reported every step either way).")
    loss_agg: Literal["token-mean", "seq-mean-token-mean"] = Field(
        "token-mean", description="token-mean | seq-mean-token-mean.")
    ppo_epochs: Count = Field(1, description="Passes over the rollout.")
    mini_batch_size: Count = Field(8, description="Sequences per optimizer step (over all DP ranks).")
    micro_batch_tokens: Count = Field(4096, description="Token budget of one forward/backward (per rank).")
    actor_lr: float = Field(1e-6, ge=0, description="Actor learning rate (AdamW).")
    critic_lr: float = Field(1e-5, ge=0, description="Critic learning rate (AdamW).")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay (actor and critic).")
    betas: tuple[Annotated[float, Field(ge=0, lt=1)], Annotated[float, Field(ge=0, lt=1)]] = Field(
        (0.9, 0.999), description="AdamW betas.")
    warmup_steps: int = Field(0, ge=0, description="Linear LR warm-up, in optimizer steps counted across iterations.")
    lr_decay: Literal["constant", "linear", "cosine"] = Field(
        "constant", description="constant | linear | cosine, over total_steps (counted across iterations).")
    total_steps: Count | None = Field(None, description="Steps over which lr_decay decays (null: no decay).")
    grad_clip: float | None = Field(1.0, gt=0, description="Clip the global gradient norm (the same at every "
                                                           "layout); null to disable.")
    temperature: float = Field(1.0, gt=0, description="Must equal the rollout's: log-probs are of "
                                                      "softmax(logits / temperature).")
    off_policy: bool = Field(False, description="Allow a rollout sampled from another actor checkpoint than actor "
                                                "(its recorded log-probs are then another policy's); by default that "
                                                "is refused as a mix-up.")
    seed: int = Field(0, description="Seed of the mini-batch order (the same at every layout).")
    save_every: int = Field(0, ge=0, description="Save resumable training state every N optimizer steps (0: only "
                                                 "at the end).")
    dtype: Literal["auto", "bf16", "fp32"] = Field(
        "auto", description="Parameters and activations: auto (bf16 on GPU, fp32 on CPU) | bf16 | fp32 (fp16 would "
                            "need loss scaling). Gradients are accumulated and reduced, and master weights and Adam "
                            "moments kept, in fp32 whatever this is; log-probs, KL, advantages and losses are fp32 "
                            "too. Checkpoints keep the actor's stored dtype.")

    @model_validator(mode="after")
    def _consistent(self):
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence_parallel needs tp > 1; set tp or drop sequence_parallel")
        return self


STAGES: dict[str, type[StageConfig]] = {"shard": ShardConfig, "rollout": RolloutConfig, "score": ScoreConfig,
                                         "ppo": PPOConfig, "export": ExportConfig}


def options_model(cls: type[StageConfig]) -> type[BaseModel]:
    """The part of a stage's config a run spec sets: everything but inputs, outputs and layout
    (the pipeline fills those in)."""
    fields = {name: (f.annotation, f) for name, f in cls.model_fields.items() if kind_of(f) not in WIRED}
    wired = [name for name, f in cls.model_fields.items() if kind_of(f) in WIRED]

    def not_wired(data: Any) -> Any:
        given = [k for k in wired if isinstance(data, dict) and k in data]
        if given:
            raise ValueError(f"{given[0]} is filled in by the pipeline (from the spec's inputs and layout); "
                             "remove it here")
        return data

    return create_model(f"{cls.__name__.removesuffix('Config')}Options", __config__=ConfigDict(extra="forbid"),
                        __doc__=f"Options of the {cls.__name__} a run spec sets.",
                        __validators__={"_not_wired": model_validator(mode="before")(not_wired)}, **fields)


def _shown(value: Any) -> str:
    if isinstance(value, list) and value and isinstance(value[0], BaseModel):
        return repr([v.model_dump(exclude_defaults=True) for v in value])
    return repr(value)


def describe(cls: type[BaseModel], skip: tuple[str, ...] = (), prefix: str = "") -> list[str]:
    """One line per option: ``name = default: doc``; nested models as ``outer.inner``."""
    lines = []
    for name, f in cls.model_fields.items():
        if name in skip:
            continue
        nested = f.annotation if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel) else None
        if nested is not None:
            lines += describe(nested, prefix=f"{prefix}{name}.")
            continue
        default = "(required)" if f.is_required() else _shown(f.get_default(call_default_factory=True))
        lines.append(f"{prefix}{name} = {default}" + (f": {f.description}" if f.description else ""))
    return lines
