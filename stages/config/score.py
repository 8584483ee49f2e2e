"""The score stage's config: its reward terms (the reward model, built-in rules bound against their
signatures, ``module:function`` rules) and how the reward model runs."""

from __future__ import annotations

import inspect
import math
import re
from typing import Any, Literal

from pydantic import ConfigDict, Field, TypeAdapter, ValidationError, ValidationInfo, field_validator, model_validator

from llamarl.lib.options import FieldsError, Strict
from llamarl.lib.rl.rewards import BUILTIN, check_args

from .base import OUTPUT, ComputeDtype, Count, StageConfig, Url, layout, path, placement


def _rule_inputs(fn) -> tuple[inspect.Signature, list[inspect.Parameter]]:
    """A rule's signature, and the parameters that ``args`` set (after the response and the row,
    which score passes)."""
    sig = inspect.signature(fn, eval_str=True)
    return sig, list(sig.parameters.values())[2:]


def describe_rules() -> list[str]:
    """One line per built-in rule of lib/rl/rewards.py: ``name(args): what it scores``."""
    lines = []
    for name, fn in BUILTIN.items():
        _, params = _rule_inputs(fn)
        doc = (inspect.getdoc(fn) or "").split("\n\n")[0].replace("\n", " ")
        lines.append(f"{name}({', '.join(map(str, params))}): {doc}")
    return lines


class RewardTerm(Strict):
    model_config = ConfigDict(validate_default=True)  # no args is checked too (regex needs some)

    name: str = Field(description=f"rm (the reward model), a built-in rule ({', '.join(BUILTIN)}) or "
                                  "module:function.")
    weight: float = Field(1.0, description="Weight of this term in the total score.")
    args: dict = Field(default_factory=dict, description="Options of the rule, e.g. {column: answer} or "
                                                         "{pattern: '^yes'}; a built-in rule's are checked against "
                                                         "its signature.")

    @field_validator("name")
    @classmethod
    def _known(cls, name: str) -> str:
        if name != "rm" and name not in BUILTIN and not re.fullmatch(r"[\w.]+:\w+", name):
            raise ValueError(f"use rm, one of {', '.join(BUILTIN)}, or module:function")
        return name

    @field_validator("args")
    @classmethod
    def _fit_the_rule(cls, args: dict, info: ValidationInfo) -> dict:
        # A module:function rule is imported only by the stage (it may need anything); a built-in
        # one is bound here, so a misspelt or missing argument fails before the rollout it scores.
        name = info.data.get("name")
        if name == "rm" and args:
            raise ValueError("the reward model takes no args; remove them")
        bad = _non_finite(args)
        if bad is not None:
            raise ValueError(f"{bad[0]}={bad[1]!r}: Input should be a finite number")
        if name not in BUILTIN:
            return args
        sig, params = _rule_inputs(BUILTIN[name])
        takes = f"{name} takes {', '.join(map(str, params))}"
        try:
            sig.bind("", {}, **args)
        except TypeError as e:
            raise ValueError(f"{e}; {takes}") from None
        for p in params:
            if p.name in args and p.annotation is not inspect.Parameter.empty:
                try:
                    TypeAdapter(p.annotation).validate_python(args[p.name], strict=True)
                except ValidationError as e:
                    raise ValueError(f"{p.name}={args[p.name]!r}: {e.errors()[0]['msg']}; {takes}") from None
        check_args(name, args)
        return args

    def columns(self) -> list[str]:
        """The row columns a built-in rule reads by name (its ``column`` argument, or its default);
        none for the reward model or a module:function rule, which nothing here can read."""
        if self.name not in BUILTIN:
            return []
        _, params = _rule_inputs(BUILTIN[self.name])
        return [self.args.get(p.name, p.default) for p in params if p.name == "column"]


def _non_finite(value: Any, at: str = "") -> tuple[str, float] | None:
    """The first float in ``value`` (through lists and mappings) that is inf or nan, with where it
    sits (``scale``, ``bounds.1``): the same rule as every typed option, for a rule's untyped args."""
    if isinstance(value, float) and not math.isfinite(value):
        return at, value
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, (list, tuple)) else ()
    for key, item in items:
        found = _non_finite(item, f"{at}.{key}" if at else str(key))
        if found is not None:
            return found
    return None


class ScoreConfig(StageConfig):
    rollout: Url = path("Published rollout folder.")
    out: Url = path("Output folder for the scores parts.", kind=OUTPUT)
    reward_model: Url | None = path("Published reward-model checkpoint (head 'score'); needed when a term is "
                                    "'rm'.", None)
    rewards: list[RewardTerm] = Field(default_factory=lambda: [RewardTerm(name="rm")], min_length=1,
                                      description="Terms of the total score.")
    references: Url | None = Field(None, description="Optional Parquet/JSONL with prompt_id and reference columns "
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

    @field_validator("rewards")
    @classmethod
    def _one_term_per_name(cls, rewards: list[RewardTerm]) -> list[RewardTerm]:
        # score keeps one column per term name and sums weight × that column: a second term of
        # the same name would silently take the first one's values.
        names = [t.name for t in rewards]
        twice = next((n for n in names if names.count(n) > 1), None)
        if twice:
            raise FieldsError(f"{twice!r} is given twice; each term names its own column in the scores, so give it "
                              "once (a module:function rule can wrap it with other args)")
        return rewards

    @model_validator(mode="after")
    def _terms_usable(self):
        if self.uses_rm() and not self.reward_model:
            raise FieldsError("{rewards} has an 'rm' term but no {reward_model} is given; set {reward_model} or drop "
                              "the 'rm' term")
        # Every score would be 0: no sample could be told from another, so nothing could be learnt.
        if all(t.weight == 0 for t in self.rewards):
            raise FieldsError("every term of {rewards} has weight 0, so every score would be 0 and no sample better "
                              "than another; give a term a non-zero weight")
        return self

    def uses_rm(self) -> bool:
        """Whether a term is the reward model's (else every term is a rule)."""
        return any(t.name == "rm" for t in self.rewards)

