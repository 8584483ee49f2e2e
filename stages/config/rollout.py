"""The rollout stage's config: how responses are sampled, which prompt rows a rollout takes, and
the columns it reads and keeps."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import AfterValidator, Field, field_validator, model_validator

from llamarl.lib.options import Strict

from .base import (INPUT, INT32_MAX, OUTPUT, Column, ComputeDtype, Count, StageConfig, Url, marked, layout, path,
                   placement)
from .score import ScoreConfig


MIN_TEMPERATURE = 1e-6
"""The smallest temperature but 0: logits are divided by it in float32, and below this a logit of
a few hundred already overflows to inf (then softmax is NaN); sampling there is greedy anyway."""


def _temperature(greedy: bool):
    """A check of a temperature that refuses what lies between 0 and ``MIN_TEMPERATURE`` (and says
    whether 0, greedy, is taken)."""

    def check(t: float) -> float:
        if 0 < t < MIN_TEMPERATURE:
            allowed = f"0 (greedy) or at least {MIN_TEMPERATURE}" if greedy else f"at least {MIN_TEMPERATURE}"
            raise ValueError(f"Input should be {allowed}: logits / temperature would overflow float32")
        return t

    return AfterValidator(check)


class Sampling(Strict):
    samples_per_prompt: Count = Field(1, le=INT32_MAX, description="Responses drawn for each prompt (GRPO-style groups "
                                                                   "need several).")
    temperature: Annotated[float, _temperature(greedy=True)] = Field(
        1.0, ge=0, description=f"Softmax temperature; 0 = greedy, else at least {MIN_TEMPERATURE}.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling: keep the smallest set of tokens whose "
                                                      "probability reaches top_p.")
    top_k: int = Field(0, ge=0, description="Keep the k most likely tokens; 0 = off.")
    max_new_tokens: Count = Field(256, description="Longest response.")
    # Token ids are int32 in the rollout's parts; the spec also holds them to the actor's vocabulary.
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] = Field(
        default_factory=list, description="Stop tokens besides the checkpoint's EOS.")
    seed: int = Field(0, description="Sampling seed. Sample k of prompt row r draws from its own random stream, keyed by "
                                     "(seed, r, k): responses depend on nothing else (not layout, batch or chunks).")


def beyond_vocab(token_ids, vocab: int) -> tuple[int, int] | None:
    """The first (position, id) of ``token_ids`` that is no token of a vocabulary of ``vocab`` ids:
    an actor cannot sample it, so as a stop token it would never stop a response."""
    return next(((i, t) for i, t in enumerate(token_ids or ()) if t >= vocab), None)


class PromptSelection(Strict):
    """Which rows of the prompts one rollout takes: positions [``start``, ``start + count``) of an
    endless stream of epochs, each a permutation of every row drawn from (``seed``, epoch);
    docs/generation.md, "Which prompts a rollout reads"."""

    seed: int = Field(0, description="Seed of every epoch's permutation.")
    shuffle: bool = Field(True, description="A new seeded permutation every epoch; false: the rows in file order.")
    start: int = Field(0, ge=0, description="First position in the stream of epochs (epoch = start // rows).")
    count: Count = Field(description="Positions taken (prompts in this rollout).")


class RolloutConfig(StageConfig):
    actor: Url = path("Published actor checkpoint (from shard or ppo).")
    prompts: Url = path("Parquet or JSONL prompts: a file or a folder of them, any fsspec URL.")
    out: Url = path("Output folder for the Parquet parts.", kind=OUTPUT)
    index_cache: Url | None = path("Folder where the prompts' row index, and the result of checking every row, are "
                                   "kept between rollouts (one of each per dataset version); default: each rollout "
                                   "builds the index (when it selects rows) and checks every row itself.", None,
                                   kind=OUTPUT)
    select: PromptSelection | None = Field(None, description="Take only these rows of the prompts (a run's "
                                                             "prompts_per_iteration); null: every row, in order.",
                                           **marked(INPUT))
    prompt_column: Column = Field("prompt", description="Column holding the prompt: text, or chat messages "
                                                     "[{role, content}, ...].")
    id_column: Column | None = Field(None, description="Column holding a prompt id; default: the row number.")
    keep_columns: list[Column] = Field(default_factory=list, description="Prompt columns copied into every output row "
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
    chunk_size: Count = Field(64, description="Prompts per part file (the unit of resumption). It decides the output's "
                                              "part files, though not the rows in them.")
    max_batch: Count = placement(64, "Sequences decoded together (engine slots): speed and memory only; the responses "
                                     "do not depend on it.")
    dtype: ComputeDtype = Field("auto", description="Compute dtype: auto (bf16 on GPU, fp32 on CPU) | bf16 | "
                                                    "fp16 (GPU only) | fp32.")
    # A second output, not an option: the rollout is the same with or without it (so it is no part
    # of the rollout's identity), and the scores are the score stage's (stages/scoring.py).
    scores: ScoreConfig | None = Field(None, description="The score stage's config of this rollout when every term "
                                                         "is a rule: the rollout then publishes those scores itself, "
                                                         "right after its own output (the pipeline sets it).",
                                       **marked(OUTPUT))

    @model_validator(mode="after")
    def _scores_of_this_rollout(self):
        s = self.scores
        if s is not None and s.rollout.rstrip("/") != self.out.rstrip("/"):
            raise ValueError(f"scores.rollout={s.rollout!r} is not this rollout's out={self.out!r}; score this rollout")
        if s is not None and s.uses_rm():
            raise ValueError("scores has an 'rm' term: the reward model runs in the score stage; score rules only here")
        if s is not None and s.out.rstrip("/") == self.out.rstrip("/"):
            raise ValueError("scores.out is the rollout's out; give the scores their own folder")
        return self

    @field_validator("keep_columns")
    @classmethod
    def _keep_fits_the_parts(cls, keep: list[str]) -> list[str]:
        # A kept column sits beside the rollout's own in every part: one of the same name would make
        # parts with a duplicate column, which no reader opens.
        from llamarl.stages.contract import ROLLOUT_COLUMNS

        clash = next((k for k in keep if k in ROLLOUT_COLUMNS), None)
        if clash:
            raise ValueError(f"{clash!r} is a column the rollout writes itself ({', '.join(ROLLOUT_COLUMNS)}); keep "
                             "no column of those names (rename it in the prompts)")
        twice = next((k for k in keep if keep.count(k) > 1), None)
        if twice:
            raise ValueError(f"{twice!r} is given twice; keep each column once")
        return keep

