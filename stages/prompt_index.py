"""The row index of a prompts dataset, so that a rollout reads only the rows it takes: built once per
dataset version and kept in an index cache folder; beside it, small *notes* keep what was found
about that version (prompts.py: a whole dataset's check). Torch-free. The file and why it is so:
docs/generation.md, "Which prompts a rollout reads".
"""

from __future__ import annotations

import hashlib
import json
import sys
from dataclasses import dataclass

import fsspec
import numpy as np
import pyarrow as pa
import xxhash

from llamarl.lib.errors import UserError
from llamarl.lib.files import publish
from llamarl.stages.prompt_files import (BLOCK, JSONL, Columns, Dataset, Row, line_text, open_parquet, parquet_groups,
                                         parquet_pylist, require_columns, row_values)

INDEX_FORMAT = 1  # of the cache files: a new one builds every index again
_SPACE = np.array([ord(c) for c in " \t\r\x0b\x0c"], np.uint8)  # what bytes.strip() removes, but the newline


@dataclass(frozen=True)
class Index:
    """Where each row of a dataset lies. ``file_rows``: rows in each file. JSON lines: ``offsets``,
    each row's byte offset in its file. Parquet: ``group_rows``, the rows of each row group, file
    after file, ``file_groups`` of them in each file. ``built``: made by this call, not read from
    the cache."""

    file_rows: np.ndarray
    offsets: np.ndarray
    group_rows: np.ndarray
    file_groups: np.ndarray
    built: bool = False

    ARRAYS = ("file_rows", "offsets", "group_rows", "file_groups")

    @property
    def n_rows(self) -> int:
        return int(self.file_rows.sum())

    @property
    def file_starts(self) -> np.ndarray:
        return np.concatenate(([0], np.cumsum(self.file_rows)))


def _jsonl_offsets(ds: Dataset, f: int) -> np.ndarray:
    """The byte offset of every row of JSON lines file ``f``: each line start, from a NumPy scan for
    newlines, less blank lines (those that could be blank — empty, or starting with a space, or the
    first, for its byte-order mark — are read and tested as ``jsonl_lines`` tests them)."""
    starts, firsts, carry, base = [], [], True, 0
    with ds.fs.open(ds.files[f], "rb") as fh:
        while block := fh.read(BLOCK):
            data = np.frombuffer(block, np.uint8)
            s = np.flatnonzero(data == 10) + 1
            ends_line = len(s) > 0 and s[-1] == len(data)
            s = np.concatenate(([0] if carry else [], s[:-1] if ends_line else s)).astype(np.int64)
            starts.append(s + base)
            firsts.append(data[s])
            carry, base = ends_line, base + len(data)
    if not starts:
        return np.zeros(0, np.int64)
    starts, firsts = np.concatenate(starts), np.concatenate(firsts)
    length = np.append(starts[1:] - 1, base - (1 if carry else 0)) - starts
    maybe = (length > 0) & np.isin(firsts, _SPACE)
    maybe[:1] |= starts[:1] == 0
    keep = length > 0
    for i in np.flatnonzero(maybe):
        line = ds.fs.cat_file(ds.files[f], int(starts[i]), int(starts[i] + length[i]))
        keep[i] = line_text(line, int(starts[i])) is not None
    return starts[keep]


def _build(ds: Dataset) -> Index:
    if ds.kind == JSONL:
        offsets = [_jsonl_offsets(ds, f) for f in range(len(ds.files))]
        return Index(np.array([len(o) for o in offsets], np.int64), np.concatenate(offsets).astype(np.int64),
                     np.zeros(0, np.int64), np.zeros(0, np.int64), built=True)
    groups = [parquet_groups(ds, f) for f in range(len(ds.files))]
    return Index(np.array([sum(g) for g in groups], np.int64), np.zeros(0, np.int64),
                 np.array([n for g in groups for n in g], np.int64), np.array([len(g) for g in groups], np.int64),
                 built=True)


def row_index(ds: Dataset, index_cache: str | None = None) -> Index:
    """The index of ``ds``: read from ``index_cache`` when it holds a sound one of this version,
    else built (and kept there when given)."""
    if index_cache:
        found = _load_index(ds, index_cache)
        if found is not None:
            return found
    index = _build(ds)
    if index_cache:
        payload = b"".join(getattr(index, a).astype("<i8").tobytes() for a in Index.ARRAYS)
        header = {"format": "llamarl-prompt-index", "version": INDEX_FORMAT, "dataset": ds.key,
                  "arrays": {a: len(getattr(index, a)) for a in Index.ARRAYS},
                  "xxh3_128": xxhash.xxh3_128_hexdigest(payload)}
        _write(index_cache, f"{ds.version}.index", json.dumps(header).encode() + b"\n" + payload)
    return index


def _load_index(ds: Dataset, index_cache: str) -> Index | None:
    data = _read(index_cache, f"{ds.version}.index")
    try:
        cut = data.index(b"\n")
        header, payload = json.loads(data[:cut]), memoryview(data)[cut + 1:]  # the arrays not copied
        if (header["format"], header["version"], header["dataset"]) != ("llamarl-prompt-index", INDEX_FORMAT, ds.key):
            return None
        if xxhash.xxh3_128_hexdigest(payload) != header["xxh3_128"]:
            return None
        lengths = [int(header["arrays"][a]) for a in Index.ARRAYS]
        if sum(lengths) * 8 != len(payload):
            return None
        flat = np.frombuffer(payload, "<i8").astype(np.int64, copy=False)
        arrays = np.split(flat, np.cumsum(lengths)[:-1])
        index = Index(*arrays)
        expected = len(ds.files), index.n_rows if ds.kind == JSONL else 0, int(index.file_groups.sum())
        if (len(index.file_rows), len(index.offsets), len(index.group_rows)) != expected:
            return None
        return index
    except (AttributeError, KeyError, TypeError, ValueError):
        return None  # None read, or not one of ours whole: built again


# ---- notes beside the index: what was found about a dataset version (a check's result) -----------------------


def _note_name(ds: Dataset, kind: str, key: dict) -> str:
    return f"{ds.version}.{kind}-{hashlib.sha256(json.dumps(key).encode()).hexdigest()[:16]}.json"


def load_note(ds: Dataset, index_cache: str, kind: str, key: dict) -> dict | None:
    """The value noted for this dataset version, ``kind`` and ``key``; None when there is no sound one."""
    try:
        note = json.loads(_read(index_cache, _note_name(ds, kind, key)) or b"null")
        if note and (note.get("format"), note.get("dataset"), note.get("key")) == ("llamarl-prompt-note", ds.key, key):
            return note["value"]
    except (AttributeError, KeyError, TypeError, ValueError):
        pass
    return None


def store_note(ds: Dataset, index_cache: str, kind: str, key: dict, value: dict) -> None:
    note = {"format": "llamarl-prompt-note", "dataset": ds.key, "key": key, "value": value}
    _write(index_cache, _note_name(ds, kind, key), json.dumps(note).encode())


def _read(folder: str, name: str) -> bytes | None:
    fs, root = fsspec.core.url_to_fs(folder)
    try:
        return fs.cat_file(f"{root.rstrip('/')}/{name}")
    except (FileNotFoundError, IsADirectoryError):
        return None


def _write(folder: str, name: str, data: bytes) -> None:
    """``data`` as ``folder/name``, whole or not at all. The cache only saves work: a folder that
    cannot hold it is said once, not fatal."""
    try:
        publish.replace(f"{folder.rstrip('/')}/{name}", data)
    except OSError as e:
        print(f"warning: {folder}: cannot keep the prompts' index there ({e}); each rollout makes it again",
              file=sys.stderr, flush=True)


# ---- a few rows, through the index -------------------------------------------------------------------------


def read_rows(ds: Dataset, index: Index, rows: np.ndarray, columns: Columns) -> list[Row]:
    """Rows ``rows`` (numbers) of ``ds``, in that order, reading only them: JSON lines by their
    byte ranges, Parquet by the row groups holding them (only the ``columns``)."""
    names = columns.names
    require_columns(ds, names)
    rows = np.asarray(rows, np.int64)
    starts = index.file_starts
    file_of = np.searchsorted(starts, rows, side="right") - 1
    read = _jsonl_read if ds.kind == JSONL else _parquet_read
    out: list = [None] * len(rows)
    for f in np.unique(file_of):
        at = np.flatnonzero(file_of == f)
        for i, row in zip(at, read(ds, index, int(f), rows[at], names)):
            out[i] = row
    return out


def _jsonl_read(ds: Dataset, index: Index, f: int, numbers: np.ndarray, names) -> list[Row]:
    """Rows ``numbers`` (in file ``f``) of a JSON lines dataset: each from its offset to
    the next row's (or the file's end), read together (``cat_ranges``: concurrent on object stores)."""
    begin = index.offsets[numbers]
    last = numbers + 1 >= index.file_starts[f + 1]  # a file's last row runs to its end
    end = np.where(last, ds.sizes[f], index.offsets[np.minimum(numbers + 1, index.n_rows - 1)])
    blobs = ds.fs.cat_ranges([ds.files[f]] * len(numbers), begin.tolist(), end.tolist())
    rows = []
    for n, b, blob in zip(numbers.tolist(), begin.tolist(), blobs):
        text = line_text(blob.partition(b"\n")[0], b)  # its line alone, not the blank lines after it
        if text is None:  # the file changed since its index was made (a stamp that did not)
            raise UserError(f"{ds.name(f)} changed while it was read; run again")
        rows.append((n, (f, b), row_values(ds, n, (f, b), text, names)))
    return rows


def _parquet_read(ds: Dataset, index: Index, f: int, numbers: np.ndarray, names) -> list[Row]:
    """Rows ``numbers`` (in file ``f``) of a Parquet dataset: each row group holding some read once,
    its ``names`` columns only."""
    file_start = int(index.file_starts[f])
    local = numbers - file_start
    first_group = int(index.file_groups[:f].sum())
    group_starts = np.concatenate(([0], np.cumsum(index.group_rows[first_group:first_group + index.file_groups[f]])))
    group_of = np.searchsorted(group_starts, local, side="right") - 1
    rows: list = [None] * len(numbers)
    with ds.fs.open(ds.files[f], "rb") as fh:
        pf = open_parquet(ds, f, fh)
        for g in np.unique(group_of):
            at = np.flatnonzero(group_of == g)
            try:
                table = pf.read_row_group(int(g), columns=names).take(pa.array(local[at] - group_starts[g]))
            except (pa.ArrowException, OSError) as e:
                raise UserError(f"{ds.name(f)}: row group {g} cannot be read ({str(e).splitlines()[0]}); replace "
                                "the file") from None
            for i, v in zip(at, parquet_pylist(ds, f, table, local[at], file_start)):
                rows[i] = (int(numbers[i]), (f, int(local[i])), v)
    return rows
