"""The parts every stage config is made of: the four kinds of field, the field helpers that mark
them, checked locations (``Url``) and ``StageConfig``, the base of each stage's config."""

from __future__ import annotations

import math
from typing import Annotated, Any, ClassVar, Literal, Self

from pydantic import AfterValidator, ConfigDict, Field

from llamarl.lib.dtypes import CONFIG_NAMES
from llamarl.lib.options import Strict, validate


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


def marked(kind: str) -> dict:
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
    return Field(default, description=doc, **marked(kind))


def layout(doc: str) -> Any:
    return Field(1, ge=1, description=doc, **marked(LAYOUT))


def placement(default: Any, doc: str, **constraints: Any) -> Any:
    return Field(default, description=doc, **constraints, **marked(PLACEMENT))


def kind_of(field) -> str:
    return (field.json_schema_extra or {}).get("kind", "option")


class StageConfig(Strict):
    model_config = ConfigDict(validate_default=True)

    prepares: ClassVar[bool] = False
    """Whether the stage's module has ``prepare(config)``: what a resident worker may do for it
    while other stages run (cluster/worker.py), such as ppo's compiling."""

    collective_timeout_s: int = placement(
        600, "Seconds a collective (all-reduce, barrier, ...) may wait for a peer before the stage fails with the "
             "lost rank named; bounds how long a job hangs after a host dies. Raise it for steps that are slow "
             "on one rank only (e.g. rank 0 writing a large file while the others wait).", ge=1, le=MAX_TIMEOUT_S)

    @classmethod
    def parse(cls, data: Any, source: str) -> Self:
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


def processes(counts: Strict) -> int:
    """The processes a stage runs on: the product of its layout counts (tp × pp × dp, export's
    ``procs``), read from its config or from its entry of a run spec's layout alike."""
    fields = type(counts).model_fields
    return math.prod(getattr(counts, name) for name, f in fields.items() if kind_of(f) == LAYOUT)

