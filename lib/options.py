"""Options models, checked up front: the strict base every options model derives from, and
validation whose every error is one line naming the file, the field as its user spells it, and the
fix (``validate``). Stage configs (stages/config), a run spec (pipeline/spec.py) and the executors'
options (cluster/) are all checked through here.
"""

from __future__ import annotations

import re
import reprlib
from typing import Any, Mapping, TypeVar

from pydantic import BaseModel, ConfigDict, ValidationError

from llamarl.lib.errors import UserError

M = TypeVar("M", bound=BaseModel)


class Strict(BaseModel):
    """The base of every options model: an unknown option is refused, and so is a float that is not
    finite (YAML's ``.inf`` parses as one; an infinite learning rate would train every weight to
    inf and publish it). Values are taken as the types they are written as (pydantic's strict
    mode): ``keep_last: true`` is no number and ``tp: "2"`` no count; an integer is still a float."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False, strict=True)


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


def validate(cls: type[M], data: Any, source: str) -> M:
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
