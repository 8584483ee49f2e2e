"""The run spec: one YAML file describing a whole PPO run.

    name: demo
    storage: /shared/runs            # any fsspec URL; the run lives in STORAGE/NAME
    actor: /models/llama-1b          # HF checkpoint of the initial actor (and reference)
    reward_model: /models/rm         # HF LlamaForSequenceClassification, optional
    prompts: /data/prompts.jsonl
    iterations: 3
    layout: {shard: {tp: 2}, rollout: {tp: 2}, score: {tp: 2}, ppo: {tp: 2}, export: {procs: 2}}
    rollout: {...}                   # options of stages.rollout.RolloutConfig
    score: {...}                     # options of stages.score.ScoreConfig (rewards, …)
    ppo: {...}                       # options of stages.ppo.PPOConfig
    export: {dtype: bf16}
    executor: {kind: local}          # local | slurm | kubernetes, with their options

Stage options are those of each stage's config class (see ``llamarl stage NAME --help``);
inputs and outputs are filled in by the pipeline.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import fsspec
import yaml

from llamarl.lib.errors import UserError
from llamarl.lib.job import parse_config, require_positive


@dataclass(kw_only=True)
class Layout:
    tp: int = 1
    """Tensor-parallel size."""
    pp: int = 1
    """Pipeline-parallel size (score, ppo, shard)."""
    dp: int = 1
    """Data-parallel groups (rollout, score, ppo)."""
    procs: int = 1
    """Processes for export (parallel file writers)."""
    nodes: int = 1
    """Nodes of a cluster job (slurm, kubernetes); processes are spread evenly over them."""

    def __post_init__(self):
        require_positive(self, "tp", "pp", "dp", "procs", "nodes")

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


@dataclass(kw_only=True)
class Layouts:
    shard: Layout = field(default_factory=Layout)
    rollout: Layout = field(default_factory=Layout)
    score: Layout = field(default_factory=Layout)
    ppo: Layout = field(default_factory=Layout)
    export: Layout = field(default_factory=Layout)


@dataclass(kw_only=True)
class Executor:
    kind: str = "local"
    """local | slurm | kubernetes."""
    options: dict = field(default_factory=dict)
    """Executor options (slurm: partition, account, timeout_min, gpus_per_node, …; kubernetes: image,
    namespace, pvc, …), see docs/pipeline.md."""


@dataclass(kw_only=True)
class RunSpec:
    name: str
    """Run name: the run directory is STORAGE/NAME."""
    storage: str
    """Root of run directories (any fsspec URL shared by all nodes)."""
    actor: str
    """HF checkpoint of the initial actor; also the reference."""
    prompts: str
    """Prompts (Parquet or JSONL, file or folder)."""
    reward_model: str | None = None
    """HF reward model (LlamaForSequenceClassification, one label); needed by an 'rm' reward term."""
    iterations: int = 1
    """PPO iterations (rollout → score → ppo)."""
    layout: Layouts = field(default_factory=Layouts)
    rollout: dict = field(default_factory=dict)
    """Options of the rollout stage."""
    score: dict = field(default_factory=dict)
    """Options of the score stage."""
    ppo: dict = field(default_factory=dict)
    """Options of the ppo stage."""
    export: dict = field(default_factory=dict)
    """Options of the export stage."""
    executor: Executor = field(default_factory=Executor)

    @property
    def run_dir(self) -> str:
        return f"{self.storage.rstrip('/')}/{self.name}"


def load_spec(path: str) -> RunSpec:
    try:
        with fsspec.open(path, "r") as f:
            data = yaml.safe_load(f)
    except FileNotFoundError:
        raise UserError(f"{path}: no such run spec") from None
    except yaml.YAMLError as e:
        raise UserError(f"{path}: not valid YAML ({str(e).splitlines()[0]})") from None
    spec = parse_config(RunSpec, data or {}, path)
    if spec.iterations < 1:
        raise UserError(f"{path}: iterations={spec.iterations} must be at least 1")
    if spec.executor.kind not in ("local", "slurm", "kubernetes"):
        raise UserError(f"{path}: executor kind {spec.executor.kind!r}: use local, slurm or kubernetes")
    return spec
