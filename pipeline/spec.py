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
and layout, which the pipeline fills in. The whole spec — every stage of every iteration — is
validated when it is loaded, so a wrong value fails ``llamarl run`` (and ``--dry-run``) in one line
before any stage starts.
"""

from __future__ import annotations

import re
from typing import Literal

import fsspec
import yaml
from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, field_validator, model_validator

from llamarl.cluster.executor import validate_options
from llamarl.lib.errors import UserError
from llamarl.stages.config import (Count, ExportConfig, PPOConfig, RolloutConfig, ScoreConfig, options_model,
                                   validate)

RolloutOptions = options_model(RolloutConfig)
ScoreOptions = options_model(ScoreConfig)
PPOOptions = options_model(PPOConfig)
ExportOptions = options_model(ExportConfig)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class Placement(_Strict):
    """How many processes a stage runs on, and how they split the work (the spec's `layout:`)."""

    tp: Count = Field(1, description="Tensor-parallel size.")
    pp: Count = Field(1, description="Pipeline-parallel size (score, ppo, shard).")
    dp: Count = Field(1, description="Data-parallel groups (rollout, score, ppo).")
    procs: Count = Field(1, description="Processes for export (parallel file writers).")
    nodes: Count = Field(1, description="Nodes of a cluster job (slurm, kubernetes); processes are spread evenly "
                                        "over them.")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


class Placements(_Strict):
    """The spec's `layout:`, one entry per stage."""

    shard: Placement = Field(default_factory=Placement)
    rollout: Placement = Field(default_factory=Placement)
    score: Placement = Field(default_factory=Placement)
    ppo: Placement = Field(default_factory=Placement)
    export: Placement = Field(default_factory=Placement)


class ExecutorSpec(_Strict):
    kind: Literal["local", "slurm", "kubernetes"] = Field("local", description="Where stages run.")
    options: dict = Field(default_factory=dict, description="Options of that executor (local: threads_per_process; "
                                                            "slurm: partition, account, timeout_min, gpus_per_node, …; "
                                                            "kubernetes: image, namespace, pvc, …), see "
                                                            "docs/pipeline.md.")

    @model_validator(mode="after")
    def _options_of_the_kind(self):
        # Checked by the executor's own model now, not when the first stage is submitted.
        try:
            validate_options(self.kind, self.options, "options")
        except UserError as e:
            raise ValueError(str(e)) from None
        return self


class RunSpec(_Strict):
    name: str = Field(description="Run name: the run directory is STORAGE/NAME.")
    storage: str = Field(description="Root of run directories (any fsspec URL shared by all nodes).")
    actor: str = Field(description="HF checkpoint of the initial actor; also the reference.")
    prompts: str = Field(description="Prompts (Parquet or JSONL, file or folder).")
    reward_model: str | None = Field(None, description="HF reward model (LlamaForSequenceClassification, one label); "
                                                       "needed by an 'rm' reward term.")
    iterations: Count = Field(1, description="PPO iterations (rollout → score → ppo).")
    layout: Placements = Field(default_factory=Placements, description="Processes of each stage.")
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
        if any(t.name == "rm" for t in self.score.rewards) and not self.reward_model:
            raise ValueError("score.rewards has an 'rm' term but no reward_model is given; set reward_model or "
                             "give score.rewards without 'rm'")
        t_roll, t_ppo = self.rollout.sampling.temperature, self.ppo.temperature
        if t_roll > 0 and t_roll != t_ppo:
            raise ValueError(f"ppo.temperature={t_ppo} differs from rollout.sampling.temperature={t_roll}: the "
                             "log-probs ppo trains on are of the rollout's temperature; set them equal")
        if self.ppo.sequence_parallel and self.layout.ppo.tp == 1:
            raise ValueError("ppo.sequence_parallel needs layout.ppo.tp > 1")
        return self

    @property
    def run_dir(self) -> str:
        return f"{self.storage.rstrip('/')}/{self.name}"

    @property
    def source(self) -> str:
        """The spec file this came from, for error messages."""
        return self._source

    def stage_config(self, cls, options: BaseModel | dict, where: str, **wired):
        """A stage's config: the spec's options for it and what the pipeline wires in."""
        values = options.model_dump() if isinstance(options, BaseModel) else dict(options)
        return validate(cls, values | wired, f"{self._source}: {where}")

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.model_dump(mode="json"), sort_keys=False)


def parse_spec(data, source: str) -> RunSpec:
    spec = validate(RunSpec, data if data is not None else {}, source)
    spec._source = source
    return spec


def load_spec(path: str) -> RunSpec:
    try:
        with fsspec.open(path, "r") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise UserError(f"{path}: no such run spec") from None
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    return parse_spec(data, path)
