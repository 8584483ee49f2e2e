"""The stages' configs: one typed, validated model per stage (pydantic), importable without torch;
here, what reads all of them. The kinds of field, and why a stage's identity leaves some out:
docs/pipeline.md, "Configs are validated whole, before anything runs". A check across fields
lives once, in the stage's model (a ``FieldsError`` naming its fields as ``{field}``), so that it
reads in the caller's words: ``layout.ppo.tp`` in a run spec, ``--tp`` on a command line.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ValidationInfo, create_model, model_validator

from llamarl.lib.options import Strict

# What callers import from here, beside this module's own.
from .base import INPUT, LAYOUT, WIRED, Count, StageConfig, Url, kind_of, processes
from .checkpoint import ExportConfig, ShardConfig
from .ppo import GROUP_ADVANTAGES, PPOConfig
from .rollout import PromptSelection, RolloutConfig, Sampling, beyond_vocab
from .score import RewardTerm, ScoreConfig, describe_rules

STAGES: dict[str, type[StageConfig]] = {"shard": ShardConfig, "rollout": RolloutConfig, "score": ScoreConfig,
                                         "ppo": PPOConfig, "export": ExportConfig}


def options_model(cls: type[StageConfig]) -> type[BaseModel]:
    """The part of a stage's config a run spec (or a stage command's ``--config``) sets: everything
    but inputs, outputs and layout, which the pipeline (or the command's arguments) fill in.

    It checks each value; the checks across fields stay in ``cls`` alone, since they may involve
    the wired fields: a spec is checked by building every stage's whole config when it is loaded."""
    stage = next(name for name, c in STAGES.items() if c is cls)
    fields = {name: (f.annotation, f) for name, f in cls.model_fields.items() if kind_of(f) not in WIRED}
    wired = [name for name, f in cls.model_fields.items() if kind_of(f) in WIRED]

    def not_wired(data: Any, info: ValidationInfo) -> Any:
        given = [k for k in wired if isinstance(data, dict) and k in data]
        if not given:
            return data
        key = given[0]
        flag = ((info.context or {}).get("names") or {}).get(key)
        if flag:
            raise ValueError(f"{key} is given by {flag} on the command line; remove it from this file")
        if kind_of(cls.model_fields[key]) == LAYOUT:
            raise ValueError(f"{key} is set in layout.{stage}.{key}, not here; move it there")
        raise ValueError(f"{key} is filled in by the pipeline (from the spec's actor, prompts, reward_model and the "
                         "stages before); remove it here")

    return create_model(f"{cls.__name__.removesuffix('Config')}Options", __base__=Strict,
                        __doc__=f"Options of the {stage} stage that a run spec sets.",
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

