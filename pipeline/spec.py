"""The run spec: one YAML file describing a whole PPO run.

    name: demo
    storage: /shared/runs            # any fsspec URL; the run lives in STORAGE/NAME
    actor: /models/llama-1b          # HF checkpoint of the initial actor (and reference)
    reward_model: /models/rm         # HF LlamaForSequenceClassification, optional
    prompts: /data/prompts.jsonl
    iterations: 3
    layout: {shard: {tp: 2}, rollout: {tp: 2}, score: {tp: 2}, ppo: {tp: 2}, export: {procs: 2}}
    rollout: {...}                   # options of the rollout stage (``llamarl stage rollout --help``)
    score: {...}                     # options of the score stage (rewards, …)
    ppo: {...}                       # options of the ppo stage
    export: {dtype: bf16}
    executor: {kind: local}          # local | slurm | kubernetes, with their options

Stage options are those of each stage's config (``llamarl.stages.config``) except inputs, outputs
and layout, which the pipeline fills in. Each stage's ``layout`` takes only the counts that stage
uses (shard: tp, pp; rollout: tp, dp; score and ppo: tp, pp, dp; export: procs; all: nodes).
``parse_spec`` checks the whole spec — every stage of every iteration built whole, the executor's
options, and each stage's layout against the actor's and reward model's ``config.json`` where they
exist — so a wrong value fails ``llamarl run`` (and ``--dry-run``) in one line before any stage
starts, without importing torch.
"""

from __future__ import annotations

import math
import re
from typing import Literal

import fsspec
import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, create_model, field_validator, model_validator

from llamarl.cluster.executor import validate_options
from llamarl.lib.errors import UserError, unreadable
from llamarl.stages.config import (GROUP_ADVANTAGES, INPUT, LAYOUT, Count, ExportConfig, PPOConfig, RolloutConfig,
                                   ScoreConfig, ShardConfig, Source, StageConfig, kind_of, options_model, validate)

RolloutOptions = options_model(RolloutConfig)
ScoreOptions = options_model(ScoreConfig)
PPOOptions = options_model(PPOConfig)
ExportOptions = options_model(ExportConfig)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


def _nodes():
    return Field(1, description="Nodes of a cluster job (slurm, kubernetes); the processes are spread evenly over "
                                "them, so nodes must divide their number.")


class StageLayout(_Strict):
    """How many processes one stage runs on, on how many nodes, and how they split the work: one
    entry of the spec's ``layout:``. Each stage's own model (``layout_model``) has the counts it
    takes, then ``nodes``."""

    @property
    def world(self) -> int:
        """The stage's processes: the product of its counts."""
        return math.prod(value for name, value in self if name != "nodes")

    @model_validator(mode="after")
    def _spread_evenly(self):
        if self.world % self.nodes:
            counts = " × ".join(name for name in type(self).model_fields if name != "nodes")
            raise ValueError(f"{self.world} processes ({counts}) do not spread evenly over nodes={self.nodes}; use "
                             f"nodes that divide {self.world}")
        return self


def layout_model(cls: type[StageConfig]) -> type[StageLayout]:
    """The layout of the stage whose config is ``cls``: its layout counts (the same fields, so
    the two never disagree) and ``nodes``."""
    counts = {name: (f.annotation, f) for name, f in cls.model_fields.items() if kind_of(f) == LAYOUT}
    counts["nodes"] = (Count, _nodes())
    return create_model(f"{cls.__name__.removesuffix('Config')}Layout", __base__=StageLayout,
                        __doc__=f"The layout of the {cls.__name__.removesuffix('Config').lower()} stage.", **counts)


ShardLayout = layout_model(ShardConfig)
RolloutLayout = layout_model(RolloutConfig)
ScoreLayout = layout_model(ScoreConfig)
PPOLayout = layout_model(PPOConfig)


class ExportLayout(StageLayout):
    """The layout of the export stage: parallel file writers, no model parallelism."""

    procs: Count = Field(1, description="Processes writing files in parallel.")
    nodes: Count = _nodes()


class Layouts(_Strict):
    """The spec's ``layout:``, one entry per stage, each taking only the counts its stage uses."""

    shard: ShardLayout = Field(default_factory=ShardLayout)
    rollout: RolloutLayout = Field(default_factory=RolloutLayout)
    score: ScoreLayout = Field(default_factory=ScoreLayout)
    ppo: PPOLayout = Field(default_factory=PPOLayout)
    export: ExportLayout = Field(default_factory=ExportLayout)


class ExecutorSpec(_Strict):
    kind: Literal["local", "slurm", "kubernetes"] = Field("local", description="Where stages run.")
    options: dict = Field(default_factory=dict, description="Options of that executor (local: threads_per_process; "
                                                            "slurm: partition, account, timeout_min, gpus_per_node, …; "
                                                            "kubernetes: image, namespace, pvc, …), see "
                                                            "docs/pipeline.md; checked by parse_spec.")


class RunSpec(_Strict):
    name: str = Field(description="Run name: the run directory is STORAGE/NAME.")
    storage: str = Field(description="Root of run directories (any fsspec URL shared by all nodes).")
    actor: str = Field(description="HF checkpoint of the initial actor; also the reference.")
    prompts: str = Field(description="Prompts (Parquet or JSONL, file or folder).")
    reward_model: str | None = Field(None, description="HF reward model (LlamaForSequenceClassification, one label); "
                                                       "needed by an 'rm' reward term.")
    iterations: Count = Field(1, description="PPO iterations (rollout → score → ppo).")
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


def parse_spec(data, source: str) -> RunSpec:
    """The spec in ``data`` (read from ``source``), checked whole: its fields, the executor's
    options, every stage's config of every iteration, and the layouts against the models."""
    spec = validate(RunSpec, data if data is not None else {}, source)
    spec._source = source
    validate_options(spec.executor.kind, spec.executor.options, Source(source, at="executor.options"))
    from .run import check_spec  # run.py builds the stages from a spec: one wiring, used here to check it

    check_spec(spec)
    check_models(spec)
    return spec


def check_models(spec: RunSpec) -> None:
    """Each stage's tp and pp against the model it runs — heads, kv heads, MLP width, layers —
    read from the ``config.json`` of the spec's actor and reward model where they exist (plain HF
    checkpoint folders): the very check (lib/config.py, torch-free) a stage makes when it starts,
    hours later. Also the rollout's ``max_new_tokens`` against the actor's context."""
    L = spec.layout
    uses_rm = any(t.name == "rm" for t in spec.score.rewards)
    models = {"actor": (spec.actor, [("shard", L.shard.tp, L.shard.pp, False), ("rollout", L.rollout.tp, 1, False),
                                     ("ppo", L.ppo.tp, L.ppo.pp, spec.ppo.sequence_parallel)]),
              "reward_model": (spec.reward_model, [("shard", L.shard.tp, L.shard.pp, False)]
                               + ([("score", L.score.tp, L.score.pp, False)] if uses_rm else []))}
    for key, (url, stages) in models.items():
        if not url:
            continue
        config_url = f"{url.rstrip('/')}/config.json"
        fs, path = fsspec.core.url_to_fs(config_url)
        if not fs.exists(path):
            continue  # not there yet (or not an HF folder): shard checks it when it starts
        from llamarl.lib.config import ConfigError, LlamaConfig, ParallelLayout

        try:
            model = LlamaConfig.from_json(config_url)
        except ConfigError as e:
            raise UserError(f"{spec.source}: {key}: {e}") from None
        for stage, tp, pp, sp in stages:
            try:
                ParallelLayout(tp=tp, pp=pp, sequence_parallel=sp).check(model)
            except ConfigError as e:
                raise UserError(f"{spec.source}: layout.{stage}: {e} (the {key.replace('_', ' ')}: {config_url})") from None
        if key == "actor":
            new = spec.rollout.sampling.max_new_tokens
            if new >= model.max_position_embeddings:
                raise UserError(f"{spec.source}: rollout.sampling.max_new_tokens={new} leaves no room for a prompt "
                                f"within the actor's max_position_embeddings={model.max_position_embeddings} "
                                f"({config_url}); lower max_new_tokens")


def yaml_problem(e: yaml.YAMLError) -> str:
    """A YAML syntax error in a few words, with its line and column where yaml knows them."""
    if isinstance(e, yaml.MarkedYAMLError) and e.problem_mark is not None:  # nearly every syntax error
        mark = e.problem_mark
        return f"line {mark.line + 1}, column {mark.column + 1}: {e.problem or e.context}"
    return str(e).splitlines()[0]


def load_spec(path: str) -> RunSpec:
    try:
        with fsspec.open(path, "r") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise UserError(f"{path}: no such run spec") from None
    except (OSError, UnicodeDecodeError) as e:  # a folder, no permission, not text
        raise UserError(f"{path}: cannot be read as a run spec ({unreadable(e)}); give the spec's YAML file") from None
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML ({yaml_problem(e)})") from None
    return parse_spec(data, path)
