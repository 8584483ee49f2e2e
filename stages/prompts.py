"""The prompts a rollout reads: the rows one rollout selects (``selected_rows``) and the rules every
row meets before anything is made from it (``check_rows``: each fault one line naming the file, the
line or row, and the fix). Torch-free: the pipeline checks a dataset (``check_dataset``) without
starting a stage. The selection and the index: docs/generation.md, "Which prompts a rollout reads";
the files and the rules: docs/formats.md, "Prompts".
"""

from __future__ import annotations

import base64
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from llamarl.lib.errors import UserError
from llamarl.stages import prompt_index
from llamarl.stages.prompt_files import ABSENT, Columns, Dataset, Row, iter_rows, open_dataset
from llamarl.stages.prompt_index import read_rows, row_index

# ---- the selection ----------------------------------------------------------------------------------


def epoch_order(n_rows: int, seed: int, epoch: int, shuffle: bool = True) -> np.ndarray:
    """The rows of epoch ``epoch`` in the order it takes them: file order without ``shuffle``,
    else the permutation NumPy's default generator (PCG64) draws seeded with ``[seed mod 2**64,
    epoch]``. A pure function of its arguments (tests/test_prompts.py pins its first values: a
    NumPy that drew other permutations would change which rows a run's iterations take)."""
    if not shuffle:
        return np.arange(n_rows, dtype=np.int64)
    return np.random.default_rng([seed % 2**64, epoch]).permutation(n_rows).astype(np.int64, copy=False)


def selected_rows(n_rows: int, select) -> np.ndarray:
    """The rows a rollout with ``select`` (a ``PromptSelection``) takes, in order: positions
    [start, start + count) of the stream of epochs, each row once (at an epoch boundary a row the
    tail of one epoch already took is not taken again from the head of the next)."""
    if select.count > n_rows:
        raise UserError(f"select.count={select.count} is more than the {n_rows} rows of the prompts; take at most "
                        f"{n_rows} prompts a rollout (a run's prompts_per_iteration), or give more prompts")
    begin, end = select.start, select.start + select.count
    taken = np.concatenate([epoch_order(n_rows, select.seed, e, select.shuffle)[max(begin - e * n_rows, 0):
                                                                                 min(end - e * n_rows, n_rows)]
                            for e in range(begin // n_rows, (end - 1) // n_rows + 1)])
    _, first = np.unique(taken, return_index=True)
    return taken[np.sort(first)]


def selection_record(n_rows: int, select, rows: np.ndarray) -> dict:
    """What a rollout's manifest says it took: the selection, the dataset's rows, each epoch it
    took from with its range of positions in that epoch, the rows taken and the repeats dropped."""
    begin, end = select.start, select.start + select.count
    epochs = [{"epoch": e, "from": max(begin - e * n_rows, 0), "to": min(end - e * n_rows, n_rows)}
              for e in range(begin // n_rows, (end - 1) // n_rows + 1)]
    return {**select.model_dump(), "dataset_rows": n_rows, "epochs": epochs, "rows": len(rows),
            "dropped_repeats": select.count - len(rows)}


# ---- the rules ------------------------------------------------------------------------------------------

PROMPT_FIX = "give every row a prompt: text, or chat messages [{role, content}, ...]"


def _text_fault(text: str) -> str | None:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as e:
        return f"is not valid Unicode (character {e.start}: a lone surrogate such as \\ud800); fix the text"
    return None


def _kind(value) -> str:
    return {bool: "a boolean", int: "a number", float: "a number", dict: "an object", bytes: "binary (bytes)",
            str: "text", list: "a list", type(None): "null"}.get(type(value), type(value).__name__)


def _prompt_fault(name: str, value) -> str | None:
    """What is wrong with a prompt ``value`` of column ``name``, with the fix; None when nothing."""
    if value is ABSENT:
        return f"has no {name!r}; {PROMPT_FIX}"
    if value is None:
        return f"{name!r} is null; {PROMPT_FIX}"
    if isinstance(value, str):
        if not value.strip():
            return f"{name!r} is empty; remove the row or give it a prompt (an empty one would be generated from " \
                   "an empty turn)"
        fault = _text_fault(value)
        return f"{name!r} {fault}" if fault else None
    if not isinstance(value, list):
        shown = f" ({value!r})" if isinstance(value, (bool, int, float)) else ""
        return f"{name!r} is {_kind(value)}{shown}, not text or chat messages; {PROMPT_FIX}"
    if not value:
        return f"{name!r} has no messages; {PROMPT_FIX}"
    for i, m in enumerate(value):
        fault = _message_fault(m)
        if fault:
            return f"{name!r} message {i} {fault}"
    if not any(m["content"].strip() for m in value):
        return f"{name!r}: every message is empty; remove the row or give it a prompt"
    try:
        json.dumps(value, ensure_ascii=False, allow_nan=False).encode("utf-8")  # as the rollout stores it
    except (TypeError, ValueError) as e:
        return f"{name!r} cannot be stored as JSON ({e}); give its messages text fields only"
    return None


def _message_fault(message) -> str | None:
    if not isinstance(message, dict):
        return f"is {_kind(message)}, not a message {{role, content}}; {PROMPT_FIX}"
    for key in ("role", "content"):
        value = message.get(key)
        if value is None:
            return f"has no {key}; give every message a role (user, system, assistant) and its text as content"
        if not isinstance(value, str):
            return f"has {_kind(value)} as its {key} ({value!r}), not text; give every message a role name and " \
                   "its text as content"
        fault = _text_fault(value)
        if fault:
            return f"{key} {fault}"
    if not message["role"].strip():
        return "has an empty role; give it a role name such as user"
    return None


def _id_fault(name: str, value) -> str | None:
    if value is ABSENT or value is None:
        return f"{'has no' if value is ABSENT else 'has a null'} {name!r}; give every row an id, or set no id_column " \
               "to use row numbers"
    if isinstance(value, bool) or not isinstance(value, (str, int)):
        return f"{name!r} is {_kind(value)} ({value!r}); ids are text or integers"
    if isinstance(value, str):
        if not value.strip():
            return f"{name!r} is empty; give every row an id, or set no id_column to use row numbers"
        fault = _text_fault(value)
        return f"{name!r} {fault}" if fault else None
    return None


@dataclass(frozen=True)
class Checked:
    """What checking rows found: how many there were and the type each kept column is written as
    (the one type all its values have; pa.null() when every value is null)."""

    rows: int
    kept: pa.Schema

    def to_json(self) -> dict:
        return {"rows": self.rows, "kept": base64.b64encode(self.kept.serialize().to_pybytes()).decode()}

    @classmethod
    def from_json(cls, data: dict) -> Checked:
        kept = pa.ipc.read_schema(pa.py_buffer(base64.b64decode(data["kept"])))
        return cls(int(data["rows"]), kept)


def check_rows(ds: Dataset, rows: Iterable[Row], columns: Columns, batch: int = 4096) -> Checked:
    """Every row of ``rows`` (of ``ds``) well-formed, or a ``UserError`` naming the first fault's
    file and line or row: its prompt, its id (and ids unique among ``rows``), its kept values (each
    column one type Parquet can store). A function of ``rows`` alone (it reads a file only to
    number a faulty row's line)."""
    kept = _KeptTypes(ds, columns.keep)
    ids = _Ids(ds, columns.id)
    count, width = 0, len(columns.names)
    pending: list[Row] = []
    for row in rows:
        number, place, values = row
        fault = _fault(columns, values) if len(values) < width or not _plain(values, columns) else None
        if fault:
            raise UserError(f"{ds.where(number, place)}: {fault}")
        pending.append(row)
        count += 1
        if len(pending) == batch:
            kept.add(pending)
            ids.add(pending)
            pending = []
    kept.add(pending)
    ids.add(pending)
    ids.check_unique()
    return Checked(count, kept.schema())


def _plain(values: dict, columns: Columns) -> bool:
    """The common row, told apart fast: a prompt of non-blank valid text, an id of the same or an
    integer. The others go through ``_fault``."""
    prompt = values[columns.prompt]
    if type(prompt) is not str or not prompt or prompt.isspace():
        return False
    if not prompt.isascii() and _text_fault(prompt):
        return False
    if columns.id is None:
        return True
    id_ = values[columns.id]
    return type(id_) is int or (type(id_) is str and id_ != "" and not id_.isspace() and id_.isascii())


def _fault(columns: Columns, values: dict) -> str | None:
    """What is wrong with a row's values, with the fix; None when nothing."""
    fault = _prompt_fault(columns.prompt, values.get(columns.prompt, ABSENT))
    if not fault and columns.id:
        fault = _id_fault(columns.id, values.get(columns.id, ABSENT))
    if not fault:
        fault = next((f"has no {k!r} (a kept column); give it in every row (null where there is none), or do "
                      "not keep it" for k in columns.keep if k not in values), None)
    return fault


class _KeptTypes:
    """The one type of each kept column over the rows seen: Arrow's type of each batch of values,
    unified as pa.array unifies values (an integer column with a float in it is float64)."""

    def __init__(self, ds: Dataset, keep: tuple[str, ...]):
        self.ds, self.keep = ds, keep
        self.types = {k: pa.null() for k in keep}

    def add(self, rows: list[Row]) -> None:
        for k in self.keep:
            try:
                self.types[k] = self._unify(self.types[k], pa.array([v.get(k) for _, _, v in rows]).type)
            except (pa.ArrowException, OverflowError, TypeError, ValueError):
                for row in rows:  # the first row that does not fit, to name it
                    self._add_one(k, row)

    def _unify(self, a, b):
        both = [pa.schema([("c", a)]), pa.schema([("c", b)])]
        return pa.unify_schemas(both, promote_options="permissive").field("c").type

    def _add_one(self, key: str, row: Row) -> None:
        number, place, values = row
        value = values.get(key)
        try:
            mine = pa.array([value]).type
        except (pa.ArrowException, OverflowError, TypeError, ValueError) as e:
            raise UserError(f"{self.ds.where(number, place)}: kept column {key!r} cannot be written to Parquet "
                            f"({str(e).splitlines()[0]}); fix the value or do not keep the column") from None
        try:
            self.types[key] = self._unify(self.types[key], mine)
        except pa.ArrowException:
            raise UserError(f"{self.ds.where(number, place)}: kept column {key!r} is {mine} here and "
                            f"{self.types[key]} in the rows before; give the column one type in every row") from None

    def schema(self) -> pa.Schema:
        return pa.schema([(k, t) for k, t in self.types.items()])


class _Ids:
    """The rows' prompt ids as the rollout writes them (text), held as Arrow strings to find
    repeats among millions without a Python object each; beside them each row's number and place
    (file, position), to name a repeat's rows."""

    def __init__(self, ds: Dataset, column: str | None):
        self.ds, self.column = ds, column
        self.chunks, self.rows = [], []

    def add(self, rows: list[Row]) -> None:
        if self.column and rows:
            self.chunks.append(pa.array([str(v[self.column]) for _, _, v in rows], pa.string()))
            self.rows.append(np.fromiter((x for n, (f, at), _ in rows for x in (n, f, at)), np.int64, 3 * len(rows)))

    def check_unique(self) -> None:
        if not self.chunks:
            return
        ids = pa.chunked_array(self.chunks)
        if len(pc.unique(ids)) == len(ids):
            return
        counts = pc.value_counts(ids)
        twice = counts.filter(pc.greater(counts.field("counts"), 1))[0]["values"].as_py()
        at = np.flatnonzero(pc.equal(ids, twice).to_numpy(zero_copy_only=False))[:2]
        rows = np.concatenate(self.rows).reshape(-1, 3)
        (first, f1, at1), (again, f2, at2) = (rows[i].tolist() for i in at)
        raise UserError(f"{self.ds.where(again, (f2, at2))}: {self.column!r} {twice!r} is also the id of row {first} "
                        f"({self.ds.where(first, (f1, at1))}); prompt ids must be unique: change or remove one")


# ---- a whole dataset ---------------------------------------------------------------------------------------


def check_dataset(url: str | Dataset, columns: Columns = Columns(), index_cache: str | None = None) -> Checked:
    """Every row of the prompts at ``url`` checked (``check_rows``), or one ``UserError``; ids
    unique over the whole dataset. With ``index_cache`` the result is kept there for this dataset
    version and these columns, so a dataset is read whole once, not by every rollout."""
    ds = url if isinstance(url, Dataset) else open_dataset(url)
    key = {"columns": [columns.prompt, columns.id, list(columns.keep)]}
    if index_cache:
        found = prompt_index.load_note(ds, index_cache, "checked", key)
        if found is not None:
            try:
                return Checked.from_json(found)
            except (KeyError, TypeError, ValueError, OSError):
                pass  # damaged: checked again
    checked = check_rows(ds, iter_rows(ds, columns), columns)
    if checked.rows == 0:
        raise UserError(f"{ds.url}: no prompts (0 rows); point at a file with at least one")
    if index_cache:
        prompt_index.store_note(ds, index_cache, "checked", key, checked.to_json())
    return checked


# ---- what one rollout reads -----------------------------------------------------------------------------------


@dataclass(frozen=True)
class RolloutRows:
    """The rows one rollout reads, every one checked: the selected rows, read (``rows``), or, with
    no selection, every row in order, streamed when iterated. ``checked``: the whole dataset's
    check; ``selection``: what the manifest records of the selection (None without one)."""

    ds: Dataset
    columns: Columns
    checked: Checked
    rows: list[Row] | None
    selection: dict | None

    @property
    def count(self) -> int:
        return len(self.rows) if self.rows is not None else self.checked.rows

    def __iter__(self) -> Iterator[Row]:
        return iter(self.rows) if self.rows is not None else iter_rows(self.ds, self.columns)


def for_rollout(url: str, columns: Columns, select=None, index_cache: str | None = None) -> RolloutRows:
    """What a rollout with these columns and ``select`` (a ``PromptSelection``, or None for every
    row) reads, checked before it generates anything: the whole dataset (once per version with
    ``index_cache``), then the selected rows as they are read."""
    ds = open_dataset(url)
    if select is None:
        return RolloutRows(ds, columns, check_dataset(ds, columns, index_cache), None, None)
    index = row_index(ds, index_cache)
    checked = check_dataset(ds, columns, index_cache)
    if checked.rows != index.n_rows:
        raise UserError(f"{url} changed while it was read ({index.n_rows} rows indexed, {checked.rows} checked); "
                        "run again")
    numbers = selected_rows(index.n_rows, select)
    rows = read_rows(ds, index, numbers, columns)
    check_rows(ds, rows, columns)  # as read now: a file changed in place under an unchanged stamp is caught here
    record = {**selection_record(index.n_rows, select, numbers), "index": "built" if index.built else "cached"}
    return RolloutRows(ds, columns, checked, rows, record)
