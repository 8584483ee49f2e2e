"""The run spec: what one YAML file describing a whole PPO run may say (docs/pipeline.md, "A long
run", has one to copy; "Configs are validated whole" says what each part takes).
``pipeline/dag.py``'s ``load_spec`` checks a spec whole.
"""

from __future__ import annotations

import re
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, create_model, field_validator, model_validator

from llamarl.cluster.kinds import KINDS
from llamarl.lib.options import Source, Strict, validate
from llamarl.stages.config import (GROUP_ADVANTAGES, INPUT, LAYOUT, STAGES, Count, ExportConfig, PPOConfig,
                                   RewardTerm, RolloutConfig, Sampling, ScoreConfig, StageConfig, Url, kind_of,
                                   options_model, processes)

def _no_seed(data):
    if isinstance(data, dict) and "seed" in data:
        raise ValueError("seed: derived for each iteration from the run's seed (no two iterations share random "
                         "streams); remove it here and set seed at the top of the spec instead")
    return data


def _sampling_model(name: str, doc: str | None, optional: bool, **validators) -> type[BaseModel]:
    """``rollout.sampling``'s fields but the seed, which the run derives; ``optional``: each None
    by default (the run's)."""
    fields = {key: (f.annotation | None, Field(None, description=f.description)) if optional else (f.annotation, f)
              for key, f in Sampling.model_fields.items() if key != "seed"}
    return create_model(name, __config__=ConfigDict(extra="forbid", allow_inf_nan=False), __doc__=doc,
                        __validators__=validators, **fields)


RunSampling = _sampling_model("RunSampling", Sampling.__doc__, False, _no_seed=model_validator(mode="before")(_no_seed))
RolloutOptions = create_model("RolloutOptions", __base__=options_model(RolloutConfig),
                              sampling=(RunSampling, Field(default_factory=RunSampling,
                                                           description="How responses are drawn.")))
ScoreOptions = options_model(ScoreConfig)
PPOOptions = options_model(PPOConfig)
ExportOptions = options_model(ExportConfig)


# A typo must not start a billion processes (dp: 1e9), nor build a DAG that no memory holds
# (iterations: 1e12): every `llamarl run` and dry run builds and checks each stage of every
# iteration (about 1 ms a stage on one core).
MAX_PROCESSES = 2**16
MAX_ITERATIONS = 10_000


class StageLayout(Strict):
    """How many processes one stage runs on, on how many nodes, and how they split the work: one
    entry of the spec's ``layout:``. Each stage's own model (``layout_model``) has the counts it
    takes, then ``nodes``."""

    @model_validator(mode="after")
    def _spread_evenly(self):
        world = processes(self)
        if world > MAX_PROCESSES:
            counts = " × ".join(f"{name}={value}" for name, value in self if name != "nodes")
            raise ValueError(f"{counts} is {world} processes, more than any job runs (at most {MAX_PROCESSES}); "
                             "lower them")
        if world % self.nodes:
            counts = " × ".join(name for name in type(self).model_fields if name != "nodes")
            raise ValueError(f"{world} processes ({counts}) do not spread evenly over nodes={self.nodes}; use "
                             f"nodes that divide {world}")
        return self


def layout_model(cls: type[StageConfig]) -> type[StageLayout]:
    """The layout of the stage whose config is ``cls``: its layout counts (the same fields, so
    the two never disagree) and ``nodes``."""
    counts = {name: (f.annotation, f) for name, f in cls.model_fields.items() if kind_of(f) == LAYOUT}
    counts["nodes"] = (Count, Field(1, description="Nodes of a cluster job (slurm, kubernetes); the processes are "
                                                   "spread evenly over them, so nodes must divide their number."))
    return create_model(f"{cls.__name__.removesuffix('Config')}Layout", __base__=StageLayout,
                        __doc__=f"The layout of the {cls.__name__.removesuffix('Config').lower()} stage.", **counts)


Layouts = create_model("Layouts", __base__=Strict,
                       __doc__="The spec's ``layout:``, one entry per stage with only the counts its stage uses.",
                       **{stage: (layout, Field(default_factory=layout))
                          for stage, layout in zip(STAGES, map(layout_model, STAGES.values()))})


class ExecutorSpec(Strict):
    kind: Literal[KINDS] = Field("local", description="Where stages run.")
    options: dict = Field(default_factory=dict, description="Options of that executor (local: threads_per_process; "
                                                            "slurm: partition, account, timeout_min, gpus_per_node, …; "
                                                            "kubernetes: image, namespace, pvc, …), see "
                                                            "docs/pipeline.md; checked by parse_spec.")


SamplingOverrides = _sampling_model("SamplingOverrides", "How validation responses are drawn: each field overrides the "
                                    "run's rollout.sampling.", True)


class ValidationSpec(Strict):
    """A held-out prompt set rolled out with the then-current actor and scored, every ``every``
    iterations and after the last; its mean score (``val_score``), per-term means, best@n and
    pass@k land in that iteration's row of metrics.jsonl. Nothing waits for it."""

    prompts: Url = Field(description="Validation prompts (Parquet or JSONL, file or folder), the columns of the run's "
                                     "prompts (rollout.prompt_column, id_column, keep_columns).")
    every: Count = Field(10, description="Validate after every N-th iteration, and after the last.")
    sampling: SamplingOverrides = Field(default_factory=SamplingOverrides,
                                        description="Overrides of rollout.sampling for validation, e.g. {temperature: "
                                                    "0} for greedy; its seed is derived from the run's seed, the same "
                                                    "at every validation.")
    rewards: list[RewardTerm] | None = Field(None, min_length=1, description="Reward terms of the validation score; "
                                                                             "default: the run's score.rewards.")
    references: Url | None = Field(None, description="References for rules, joined on prompt_id (as score.references); "
                                                     "default: none.")
    pass_threshold: float = Field(1.0, description="A sample passes when its total score is at least this (1.0: a "
                                                   "built-in rule's score for a right answer); pass@k counts passes.")


class RetentionSpec(Strict):
    """What stays on disk as the run goes on. A deleted output stays done in the records (a rerun
    does not redo it); what a rerun, a running stage, a validation or the export still needs is
    never deleted. The default keeps everything."""

    keep_last: Count | None = Field(None, description="Keep the ppo outputs of the last N iterations whole; of older "
                                                      "ones delete the training state, and the actor (and critic) "
                                                      "unless keep_every keeps it. null: keep every ppo output.")
    keep_every: int = Field(0, ge=0, description="Also keep the actor weights of every iteration that is a multiple "
                                                 "of this (0: none beyond keep_last).")
    keep_samples: bool = Field(True, description="Keep every rollout and its scores; false: delete them once the ppo "
                                                 "that trains on them has published (validation samples once their "
                                                 "metrics are recorded).")
    train_state_every: Count = Field(1, description="Write the training state (Adam's moments and fp32 masters: 12 "
                                                    "bytes a parameter) of every N-th iteration's ppo and of the "
                                                    "last; between, the next ppo takes it from the resident workers' "
                                                    "memory. A ppo that cannot keep it there writes it anyway; a "
                                                    "rerun after a crash makes again the iterations since the newest "
                                                    "one written. Needs resident workers (the local executor's "
                                                    "default).")


class WandbSpec(Strict):
    project: str = Field(description="W&B project.")
    entity: str | None = Field(None, description="W&B entity (user or team); default: W&B's own.")
    name: str | None = Field(None, description="Display name of the W&B run; default: the run's name.")
    mode: Literal["online", "offline"] | None = Field(None, description="W&B mode; default: W&B's own (WANDB_MODE).")
    tags: list[str] = Field(default_factory=list, description="W&B tags.")


class MetricsSpec(Strict):
    """Where the per-iteration metrics go besides RUN/metrics.jsonl and metrics.png: the same rows,
    written by the driver."""

    tensorboard: Url | None = Field(None, description="Folder of TensorBoard event files (`tensorboard --logdir` it).")
    wandb: WandbSpec | None = Field(None, description="Log to Weights & Biases (needs the wandb package).")


class RunSpec(Strict):
    name: str = Field(description="Run name: the run directory is STORAGE/NAME.")
    storage: Url = Field(description="Root of run directories (any fsspec URL shared by all nodes).")
    actor: Url = Field(description="HF checkpoint of the initial actor; also the reference.")
    prompts: Url = Field(description="Prompts (Parquet or JSONL, file or folder).")
    prompts_per_iteration: Count | None = Field(None, description="Prompts each iteration's rollout takes, the next "
                                                                  "ones of the dataset's epochs (see shuffle); null: "
                                                                  "every prompt, every iteration.")
    shuffle: bool | None = Field(None, description="With prompts_per_iteration: a new seeded permutation of the "
                                                   "prompts every epoch (null: true); false: the file's order every "
                                                   "epoch.")
    seed: int = Field(0, description="Run seed: the prompts' order and every iteration's sampling seed derive from it "
                                     "(no two iterations share random streams).")
    reward_model: Url | None = Field(None, description="HF reward model (LlamaForSequenceClassification, one label); "
                                                       "needed by an 'rm' reward term.")
    iterations: Count = Field(1, le=MAX_ITERATIONS, description=f"PPO iterations (rollout → score → ppo), at most "
                                                                f"{MAX_ITERATIONS}.")
    validation: ValidationSpec | None = Field(None, description="A held-out prompt set scored as the run goes.")
    retention: RetentionSpec = Field(default_factory=RetentionSpec, description="What is deleted as the run goes on.")
    metrics: MetricsSpec = Field(default_factory=MetricsSpec, description="TensorBoard and W&B.")
    max_staleness: int = Field(0, ge=0, description="How many ppo updates the actor a rollout samples from may lag "
                                                    "behind the one ppo trains: 0 = on-policy, every rollout waits "
                                                    "for the previous ppo; 1 = rollout k+1 samples from the actor "
                                                    "of ppo k-1 and runs while ppo k trains (ppo then takes its "
                                                    "samples off-policy). See docs/pipeline.md, Overlapped "
                                                    "iterations.")
    layout: Layouts = Field(default_factory=Layouts, description="Processes of each stage.")
    rollout: RolloutOptions = Field(default_factory=RolloutOptions, description="Options of the rollout stage.")
    score: ScoreOptions = Field(default_factory=ScoreOptions, description="Options of the score stage.")
    ppo: PPOOptions = Field(default_factory=PPOOptions, description="Options of the ppo stage.")
    export: ExportOptions = Field(default_factory=ExportOptions, description="Options of the export stage.")
    executor: ExecutorSpec = Field(default_factory=ExecutorSpec, description="Where stages run.")
    _source: str = PrivateAttr("spec")

    @property
    def pass_threshold(self) -> float | None:
        """The validation's ``pass_threshold`` (None without a validation)."""
        return self.validation.pass_threshold if self.validation is not None else None

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise ValueError("use letters, digits, '.', '_' and '-' (it names the run directory)")
        return name

    @model_validator(mode="after")
    def _consistent(self):
        # Only checks between stages (or between a stage and the executor) live here; a stage's
        # own checks run when parse_spec builds its config.
        t_roll, t_ppo = self.rollout.sampling.temperature, self.ppo.temperature
        if t_roll > 0 and t_roll != t_ppo:
            raise ValueError(f"ppo.temperature={t_ppo} differs from rollout.sampling.temperature={t_roll}: the "
                             "log-probs ppo trains on are of the rollout's temperature; set them equal")
        n = self.rollout.sampling.samples_per_prompt
        grouped = [f"ppo.advantage={self.ppo.advantage!r}"] if self.ppo.advantage in GROUP_ADVANTAGES else []
        grouped += ["ppo.dynamic_sampling"] if self.ppo.dynamic_sampling else []
        if grouped and n < 2:
            raise ValueError(f"{' and '.join(grouped)} needs rollout.sampling.samples_per_prompt >= 2 (it is {n}): "
                             "each prompt's samples are compared with each other; draw more, or use advantage 'gae' "
                             "without dynamic sampling")
        if self.shuffle is not None and self.prompts_per_iteration is None:
            raise ValueError("shuffle orders the prompts that prompts_per_iteration takes, which is not set (every "
                             "iteration takes every prompt); set prompts_per_iteration or remove shuffle")
        if self.retention.keep_every and self.retention.keep_last is None:
            raise ValueError("retention.keep_every keeps actors that retention.keep_last would delete, but keep_last is "
                             "not set (everything is kept); set retention.keep_last or remove keep_every")
        resident = self.executor.kind == "local" and self.executor.options.get("resident", True) is not False
        if self.retention.train_state_every > 1 and not resident:
            raise ValueError(f"retention.train_state_every={self.retention.train_state_every} leaves training states "
                             "in the resident workers' memory, and this executor runs each stage as processes of its "
                             "own, whose memory ends with them; remove it, or use the local executor's resident "
                             "workers")
        sampling = self.rollout.sampling
        greedy = ("rollout.sampling.temperature=0" if sampling.temperature == 0 else
                  "rollout.sampling.top_k=1" if sampling.top_k == 1 else None)
        if grouped and greedy:
            lost = [what for what, on in (("every advantage would be 0", self.ppo.advantage in GROUP_ADVANTAGES),
                                          ("dynamic sampling would drop every prompt", self.ppo.dynamic_sampling)) if on]
            raise ValueError(f"{' and '.join(grouped)} compares each prompt's samples with each other, but {greedy} "
                             f"draws them greedily: every sample of a prompt is the same, so {' and '.join(lost)}; "
                             "sample (temperature > 0, top_k 0 or > 1), or use advantage 'gae' without dynamic "
                             "sampling")
        spread = next(((name, lay.nodes) for name, lay in self.layout if lay.nodes > 1), None)
        if spread and self.executor.kind == "local":
            raise ValueError(f"layout.{spread[0]}.nodes={spread[1]} needs a cluster executor: the local executor runs "
                             "on this machine only; set executor.kind to slurm or kubernetes, or nodes to 1")
        return self

    @property
    def run_dir(self) -> str:
        return f"{self.storage.rstrip('/')}/{self.name}"

    @property
    def source(self) -> str:
        """The spec file this came from, for error messages."""
        return self._source

    def stage_config(self, cls, options: BaseModel | dict, where: str, **wired):
        """A stage's config: the spec's options for it and what the pipeline wires in. An error
        names fields as the spec does: ``ppo.sequence_parallel``, ``layout.ppo.tp``, ``reward_model``."""
        values = options.model_dump() if isinstance(options, BaseModel) else dict(options)
        names = {name: f"layout.{where}.{name}" for name, f in cls.model_fields.items() if kind_of(f) == LAYOUT}
        names |= {name: name for name, f in cls.model_fields.items()
                  if kind_of(f) == INPUT and name in RunSpec.model_fields}
        return validate(cls, values | wired, Source(self._source, at=where, names=names))

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)

