"""The stages' configs: one typed, validated model per stage (pydantic), importable without torch.

Every field is one of four kinds, marked once here and read everywhere else:

- an **input** or **output** path: the pipeline fills it in (a run spec may not set it);
- a **layout** count (tp, pp, dp): the pipeline fills it in from the spec's ``layout``;
- a **placement** option: how a stage runs, not what it computes (``score.offload``,
  ``ppo.save_every``, ``ppo.sequence_parallel``);
- an ordinary **option**: what the stage computes.

A stage's *identity* (what names its output: the pipeline's keys, the outputs' ``request``) is its
config without outputs, layout and placement, so moving a stage to another layout or flipping an
offload never makes a finished output stale, and adding a placement option changes no key.

Values are checked when a config is built, each error one line naming the field and the fix; so
``llamarl run`` refuses a bad value in any iteration's stage before the first stage starts. A check
across fields lives once, in the stage's model (a ``FieldsError`` naming its fields as ``{field}``),
and reads in the caller's words: ``layout.ppo.tp`` in a run spec, ``--tp`` on a stage's command line.
"""

from __future__ import annotations

import inspect
import math
import re
import reprlib
from typing import Annotated, Any, Literal, Mapping, TypeVar

from pydantic import (AfterValidator, BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, ValidationInfo,
                      create_model, field_validator, model_validator)

from llamarl.lib.dtypes import CONFIG_NAMES
from llamarl.lib.errors import UserError
from llamarl.lib.rl.rewards import BUILTIN, check_args

StoredDtype = Literal[CONFIG_NAMES]
"""What a checkpoint stores (lib/dtypes.py's config names)."""
ComputeDtype = Literal[("auto", *CONFIG_NAMES)]
"""What a stage computes in: auto is bf16 on a GPU and fp32 on CPU; fp16 runs on GPUs only."""
TrainDtype = Literal[tuple(d for d in ("auto", *CONFIG_NAMES) if d != "fp16")]
"""What ppo trains in: no fp16, which would need loss scaling."""
Count = Annotated[int, Field(ge=1)]
Column = Annotated[str, Field(min_length=1)]
"""A column of the prompts (Parquet and JSON name columns by text; an empty name is none)."""
INT32_MAX = 2**31 - 1  # rollout parts store sample indices (and token ids) as int32
MAX_TIMEOUT_S = 10**9  # ~31 years: "never"; far larger overflows the timedelta that torch's process groups take

INPUT, OUTPUT, LAYOUT, PLACEMENT = "input", "output", "layout", "placement"
WIRED = (INPUT, OUTPUT, LAYOUT)  # kinds the pipeline fills in
NOT_IDENTITY = (OUTPUT, LAYOUT, PLACEMENT)  # kinds that do not change what a stage computes


def _kind(kind: str) -> dict:
    return {"json_schema_extra": {"kind": kind}}


def _usable(url: str) -> str:
    """``url`` if the stages can open it: not empty, no NUL (no file system's path holds one), and
    every protocol in it one that fsspec knows, with its package installed (``s3://`` needs
    s3fs) — checked before anything runs, not when the first stage opens it."""
    if not url:
        raise ValueError("is empty; give a path or a URL")
    if "\x00" in url:
        raise ValueError("holds a NUL character, which no path can hold; remove it")
    import fsspec

    for part in url.split("::"):  # fsspec's chained URLs: simplecache::s3://…
        protocol = fsspec.core.split_protocol(part)[0] or "file"
        try:
            fsspec.get_filesystem_class(protocol)
        except ValueError:
            raise ValueError(f"{protocol}:// is no storage fsspec knows; give a path, or a URL of a known protocol "
                             f"(file, memory, s3, gs, …)") from None
        except ImportError as e:
            raise ValueError(f"{protocol}:// needs a package that is not installed ({e}); install it") from None
    return url


Url = Annotated[str, AfterValidator(_usable)]
"""A location any stage may read or write: a path or an fsspec URL, checked usable (``_usable``)."""


def path(doc: str, default: Any = ..., *, kind: str = INPUT) -> Any:
    """An input (or, with ``kind=OUTPUT``, output) location, any fsspec URL."""
    return Field(default, description=doc, **_kind(kind))


def layout(doc: str) -> Any:
    return Field(1, ge=1, description=doc, **_kind(LAYOUT))


def placement(default: Any, doc: str, **constraints: Any) -> Any:
    return Field(default, description=doc, **constraints, **_kind(PLACEMENT))


def kind_of(field) -> str:
    return (field.json_schema_extra or {}).get("kind", "option")


C = TypeVar("C", bound="StageConfig")


class Strict(BaseModel):
    """The base of every options model — each stage's config and its parts, the options a run spec
    sets (``options_model``), the executors' options: an unknown option is refused, and so is a
    float that is not finite. YAML's ``.inf`` / ``.nan`` and JSON's ``Infinity`` / ``NaN`` parse as
    floats, and no option means them: an infinite learning rate or KL coefficient would train every
    weight to inf and publish it. Values are taken as the types they are written as (pydantic's
    strict mode): ``keep_last: true`` or ``weight: false`` is no number and ``tp: "2"`` no count, where
    the lax mode would read them as 1, 0 and 2; an integer is still a float."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


class StageConfig(Strict):
    model_config = ConfigDict(validate_default=True)

    collective_timeout_s: int = placement(
        600, "Seconds a collective (all-reduce, barrier, ...) may wait for a peer before the stage fails with the "
             "lost rank named; bounds how long a job hangs after a host dies. Raise it for steps that are slow "
             "on one rank only (e.g. rank 0 writing a large file while the others wait).", ge=1, le=MAX_TIMEOUT_S)

    @classmethod
    def parse(cls: type[C], data: Any, source: str) -> C:
        """Build from a mapping (YAML / JSON), or raise a one-line ``UserError`` naming ``source``
        and the field."""
        return validate(cls, data, source)

    def identity(self) -> dict:
        """The config as it identifies the stage's output: its inputs and options. Outputs, layout
        and placement are left out, not blanked, so adding a placement option changes no key."""
        fields = type(self).model_fields
        return {k: v for k, v in self.model_dump(mode="json").items() if kind_of(fields[k]) not in NOT_IDENTITY}

    def to_json(self) -> dict:
        """What travels to the stage's processes (``--config-json``)."""
        return self.model_dump(mode="json")


class Source(str):
    """Where validated values come from, for error messages: the file (the string itself, may be
    empty), the field path of the values inside it (``at``, e.g. ``executor.options``), and how
    the user spells some fields elsewhere (``names``: ``tp`` → ``layout.ppo.tp`` in a run spec,
    ``--tp`` on a stage's command line)."""

    at: str
    names: dict[str, str]

    def __new__(cls, file: str, at: str = "", names: Mapping[str, str] | None = None) -> Source:
        self = super().__new__(cls, file)
        self.at, self.names = at, dict(names or {})
        return self

    @classmethod
    def of(cls, source: str) -> Source:
        return source if isinstance(source, Source) else cls(source)

    def name(self, loc: tuple) -> str:
        """A field's name as the user writes it."""
        parts = [str(x) for x in loc if not str(x).startswith("function-")]
        if not parts:
            return self.at
        head = self.names.get(parts[0]) or ".".join(p for p in (self.at, parts[0]) if p)
        return ".".join([head, *parts[1:]])

    def line(self, text: str) -> str:
        return f"{self}: {text}" if self else text


class FieldsError(ValueError):
    """A check across fields: its message names each field as ``{field}``, rendered the way the
    caller's user sets it (``Source.name``)."""

    def render(self, source: Source) -> str:
        return re.sub(r"\{(\w+)\}", lambda m: source.name((m.group(1),)), str(self))


def one_line(error: ValidationError, source: str, model: type[BaseModel] | None = None) -> str:
    """A pydantic error as one line: ``SOURCE: FIELD: what is wrong`` (+ how many more)."""
    source = Source.of(source)
    # An unknown option first: a misspelt one is also a missing one, and the unknown one lists the valid.
    errors = sorted(error.errors(include_url=False), key=lambda e: e["type"] != "extra_forbidden")
    first = errors[0]
    where = source.name(first["loc"])
    missing = [source.name(e["loc"]) for e in errors if e["type"] == "missing"]
    cause = (first.get("ctx") or {}).get("error")
    if first["type"] == "missing":
        errors = [e for e in errors if e["type"] != "missing"] + [first]  # counted once below
        text = f"{', '.join(missing)}: required, not given"
    elif first["type"] == "extra_forbidden":
        parent = _model_at(model, first["loc"][:-1]) if model else None
        valid = f"; valid options: {', '.join(parent.model_fields)}" if parent else ""
        text = f"{where}: unknown option{valid}"
    elif first["type"] == "model_type":  # pydantic's message names our classes
        parent = _model_at(model, first["loc"]) if model else None
        valid = f" ({', '.join(parent.model_fields)})" if parent else ""
        text = f"{where}={_VALUE.repr(first.get('input'))}: expected a mapping of options{valid}"
    elif isinstance(cause, FieldsError):
        text = cause.render(source)
        if first["loc"]:  # a nested model's check: say which one
            text = f"{where}: {text}"
    else:
        msg = first["msg"].removeprefix("Value error, ")
        value = first.get("input")
        shown = f"={_VALUE.repr(value)}" if first["loc"] and not isinstance(value, dict) else ""
        text = f"{where}{shown}: {msg}" if where else msg
    more = f" (and {len(errors) - 1} more)" if len(errors) > 1 else ""
    return source.line(f"{text}{more}")


# A value shown in an error as Python writes it, but of a readable length: a list of a thousand
# items or a page of text is cut (`[1, 2, 3, ...]`, `'abc...'`).
_VALUE = reprlib.Repr()  # (its keyword arguments are Python 3.12's)
_VALUE.maxlevel, _VALUE.maxstring, _VALUE.maxlong, _VALUE.maxother = 3, 160, 80, 160
_VALUE.maxdict = _VALUE.maxlist = _VALUE.maxtuple = _VALUE.maxset = 8


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
    """``data`` as a ``cls``, or a one-line ``UserError`` naming ``source`` (a file, or a ``Source``
    that also says where in it the data sits and how its user names fields) and the field."""
    source = Source.of(source)
    if not isinstance(data, dict):
        where = f"{source.at}: " if source.at else ""
        raise UserError(source.line(f"{where}expected a mapping of options, got {type(data).__name__}"))
    try:
        return cls.model_validate(data, context={"names": source.names})
    except ValidationError as e:
        raise UserError(one_line(e, source, cls)) from None


# ---- shard / export ----------------------------------------------------------------------------------


class ShardConfig(StageConfig):
    src: Url = path("HF checkpoint directory (any fsspec URL): config.json, *.safetensors, tokenizer files.")
    dst: Url = path("Output directory (any fsspec URL); created, or resumed if an earlier run was interrupted.",
                    kind=OUTPUT)
    tp: int = layout("Tensor-parallel size of the job (the checkpoint itself loads at any layout).")
    pp: int = layout("Pipeline-parallel size of the job.")
    dtype: StoredDtype | None = Field(None, description="Stored dtype: bf16 | fp16 | fp32; default: the source's.")


class ExportConfig(StageConfig):
    src: Url = path("A published llamarl checkpoint directory (any fsspec URL).")
    dst: Url = path("Output HF directory (any fsspec URL).", kind=OUTPUT)
    dtype: StoredDtype | None = Field(None, description="Output dtype: bf16 | fp16 | fp32; default: the checkpoint's.")
    max_shard_gb: float = Field(1.0, gt=0, description="Largest safetensors file, in GB; bigger models are split "
                                                       "with an index, as HF does. A file is what one process "
                                                       "writes (and a loader reads) at once: more files, more "
                                                       "of them in parallel.")
    verify: bool = placement(True, "Check the checkpoint's files against their checksums before reading.")


# ---- rollout --------------------------------------------------------------------------------------------


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


class PromptSelection(Strict):
    """Which rows of the prompts one rollout takes, as a pure function of these four numbers.

    The rows form an endless stream of epochs: epoch e is a permutation of every row, drawn from
    (``seed``, e) (the rows in file order without ``shuffle``). A rollout takes the positions
    [``start``, ``start + count``) of that stream, so an epoch boundary inside it takes the tail of
    one epoch and the head of the next. A row keeps its row number in the dataset as its key (its
    prompt id without ``id_column``, and what its random streams are keyed by)."""

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
                                           **_kind(INPUT))
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


# ---- score ------------------------------------------------------------------------------------------------

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
    def _rm_given(self):
        if any(t.name == "rm" for t in self.rewards) and not self.reward_model:
            raise FieldsError("{rewards} has an 'rm' term but no {reward_model} is given; set {reward_model} or drop "
                              "the 'rm' term")
        return self

    @model_validator(mode="after")
    def _some_weight(self):
        # Every score would be 0: no sample could be told from another, so nothing could be learnt.
        if all(t.weight == 0 for t in self.rewards):
            raise FieldsError("every term of {rewards} has weight 0, so every score would be 0 and no sample better "
                              "than another; give a term a non-zero weight")
        return self


# ---- ppo ---------------------------------------------------------------------------------------------------


# Estimators whose baseline is a prompt's other samples: they need samples_per_prompt >= 2.
GROUP_ADVANTAGES = ("grpo", "rloo", "reinforce++-baseline")


class PPOConfig(StageConfig):
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
                                                        "sequences packed to it, longest first; a longer one alone.")
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
        if self.old_logp == "auto":
            return "actor" if self.off_policy else "rollout"
        return self.old_logp

    def uses_tis(self) -> bool:
        """Whether the policy loss is weighed by truncated importance weights, ``auto`` resolved."""
        return self.tis == "on" or (self.tis == "auto" and self.old_logp_source() == "actor")


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
