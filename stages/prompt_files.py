"""The files of a prompts dataset (docs/formats.md, "Prompts"): which they are, their version, where
a row is (for messages), and every row read in order as a stream; torch-free. A JSON line is parsed
alone, by Python's json, so a value is what its line says whatever the lines around it say
(pyarrow's reader types a column by a block of lines, and cannot pass a line longer than a block).
"""

from __future__ import annotations

import functools
import hashlib
import json
from collections.abc import Iterator
from dataclasses import dataclass

import fsspec
import pyarrow as pa
import pyarrow.parquet as pq
from fsspec.implementations.local import LocalFileSystem

from llamarl.lib.errors import UserError

JSONL, PARQUET = "jsonl", "parquet"
VERSION_FORMAT = 1  # of a dataset's version digest: a new one makes every index and note of the old obsolete
BLOCK = 16 << 20  # bytes read at a time when a JSON lines file is scanned
_BOM = b"\xef\xbb\xbf"
ABSENT = object()  # a JSON line without the column (a Parquet row always has every column of its file)

Row = tuple  # (row number, place, {column: value}); place: (file index, byte offset | row in the file)


@dataclass(frozen=True)
class Columns:
    """The columns a rollout reads: the prompt, the id (None: the row number) and those it keeps."""

    prompt: str = "prompt"
    id: str | None = None
    keep: tuple[str, ...] = ()

    @classmethod
    def of(cls, cfg) -> Columns:
        """A rollout config's (anything with prompt_column, id_column and keep_columns)."""
        return cls(cfg.prompt_column, cfg.id_column, tuple(cfg.keep_columns))

    @property
    def names(self) -> list[str]:
        return list(dict.fromkeys([self.prompt] + ([self.id] if self.id else []) + list(self.keep)))


@dataclass(frozen=True)
class Dataset:
    """A prompts dataset's files, in the order their rows are numbered."""

    url: str
    fs: object
    files: tuple[str, ...]
    sizes: tuple[int, ...]
    stamps: tuple[str, ...]  # each file's modification stamp (mtime, or what the storage offers)
    kind: str  # JSONL | PARQUET

    @functools.cached_property
    def key(self) -> list:
        return [self.kind, [list(e) for e in zip(self.files, self.sizes, self.stamps)]]

    @functools.cached_property
    def version(self) -> str:
        """A digest of every file's path, size and modification stamp."""
        return hashlib.sha256(json.dumps([VERSION_FORMAT, self.key]).encode()).hexdigest()[:32]

    def name(self, f: int) -> str:
        path = self.files[f]
        return path if isinstance(self.fs, LocalFileSystem) else self.fs.unstrip_protocol(path)

    def where(self, number: int, place: tuple[int, int]) -> str:
        """Row ``number`` at ``place`` as a user finds it: ``FILE: line L (row N)`` (JSON lines) or
        ``FILE: row R`` (Parquet: R in the file; the dataset's row number too when it differs)."""
        f, pos = place
        of = " of the prompts" if len(self.files) > 1 else ""
        if self.kind == JSONL:
            return f"{self.name(f)}: line {self._line(f, pos)} (row {number}{of})"
        return f"{self.name(f)}: row {pos}" + (f" (row {number}{of})" if pos != number else "")

    def _line(self, f: int, offset: int) -> int:
        count = 0
        with self.fs.open(self.files[f], "rb") as fh:
            while offset > 0 and (block := fh.read(min(BLOCK, offset))):
                count += block.count(b"\n")
                offset -= len(block)
        return count + 1


def _stamp(info: dict) -> str:
    keys = ("mtime", "LastModified", "last_modified", "updated", "created", "ETag", "etag")
    return next((str(info[key]) for key in keys if info.get(key) is not None), "")


def open_dataset(url: str) -> Dataset:
    """The dataset at ``url`` (a file or a folder), or a one-line ``UserError``."""
    fs, path = fsspec.core.url_to_fs(url)
    if not fs.exists(path):
        raise UserError(f"{url}: no such file or folder; check the prompts path")
    found = {path: fs.info(path)} if fs.isfile(path) else fs.find(path, detail=True)
    paths = sorted(p for p, i in found.items() if i.get("type", "file") == "file")
    parquet = [p for p in paths if p.endswith(".parquet")]
    jsonl = [p for p in paths if p.endswith((".jsonl", ".json"))]
    if parquet and jsonl:
        raise UserError(f"{url}: mixes Parquet and JSONL files; keep one format per dataset")
    if not parquet and not jsonl:
        raise UserError(f"{url}: no .parquet, .jsonl or .json files; give prompts as Parquet or JSON lines")
    chosen = parquet or jsonl
    return Dataset(url, fs, tuple(chosen), tuple(int(found[p]["size"]) for p in chosen),
                   tuple(_stamp(found[p]) for p in chosen), PARQUET if parquet else JSONL)


# ---- JSON lines and Parquet, file by file ------------------------------------------------------------------


def line_text(line: bytes, offset: int) -> bytes | None:
    """A line's JSON text, or None for a blank line (not a row)."""
    if offset == 0 and line.startswith(_BOM):
        line = line[len(_BOM):]
    return line if line.strip() else None


def jsonl_lines(ds: Dataset, f: int) -> Iterator[tuple[int, bytes]]:
    """(byte offset, text) of each row of JSON lines file ``f``: its non-blank lines, of any length."""
    offset = 0
    with ds.fs.open(ds.files[f], "rb") as fh:
        for line in fh:
            text = line_text(line, offset)
            if text is not None:
                yield offset, text
            offset += len(line)


def _unique_keys(pairs: list[tuple[str, object]]) -> dict:
    """An object's keys, each once: Python's json keeps the last of a repeated key, silently, and
    which value the line means is not said."""
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        twice = next(k for k, _ in pairs if k in seen or seen.add(k))
        raise ValueError(f"gives {twice!r} twice in one object, and which value is meant is not said; keep one")
    return obj


_JSON = json.JSONDecoder(object_pairs_hook=_unique_keys)  # built once: json.loads(s, hook) builds one per call


def row_values(ds: Dataset, number: int, place: tuple[int, int], text: bytes, names: list[str]) -> dict:
    """The values of ``names`` in the JSON line ``text`` of row ``number`` at ``place`` (absent ones
    left out), or a one-line ``UserError`` naming the row, what is wrong and the fix."""
    try:
        obj = _JSON.decode(text.decode("utf-8"))
    except UnicodeDecodeError as e:
        why = f"not UTF-8 (byte {e.start} of the line); save the file as UTF-8"
    except json.JSONDecodeError as e:
        why = f"not valid JSON ({e.msg} at column {e.colno}); fix the line or remove it"
    except RecursionError:
        why = "JSON nested too deeply to read; flatten the line"
    except ValueError as e:  # a repeated key (_unique_keys), an integer of more digits than int() takes
        why = str(e)
    else:
        if isinstance(obj, dict):
            return {n: obj[n] for n in names if n in obj}
        why = (f"a JSON {type(obj).__name__}, not an object; give each row as one object "
               '{"prompt": ...} on its own line')
    raise UserError(f"{ds.where(number, place)}: {why}")


def open_parquet(ds: Dataset, f: int, fh) -> pq.ParquetFile:
    try:
        return pq.ParquetFile(fh)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{ds.name(f)}: cannot be read as Parquet ({str(e).splitlines()[0]}); replace the "
                        "file") from None


def parquet_groups(ds: Dataset, f: int) -> list[int]:
    with ds.fs.open(ds.files[f], "rb") as fh:
        meta = open_parquet(ds, f, fh).metadata
    return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]


def parquet_pylist(ds: Dataset, f: int, table, places, file_start: int) -> list[dict]:
    """A table of Parquet file ``f``'s rows as dicts (row i: row ``places[i]`` of the file, row
    ``file_start + places[i]`` of the dataset); a value Python cannot decode (text that is not
    UTF-8) named by its row."""
    try:
        return table.to_pylist()
    except UnicodeDecodeError:
        for i, at in enumerate(map(int, places)):
            for name in table.column_names:
                try:
                    table.slice(i, 1).column(name).to_pylist()
                except UnicodeDecodeError:
                    raise UserError(f"{ds.where(file_start + at, (f, at))}: {name!r} is not valid "
                                    "UTF-8 text; write the file's text as UTF-8") from None
        raise


def _parquet_rows(ds: Dataset, f: int, names: list[str], first_number: int) -> Iterator[tuple[int, dict]]:
    """(row in the file, values) of every row of Parquet file ``f``, a batch at a time."""
    at = 0
    with ds.fs.open(ds.files[f], "rb") as fh:
        batches = open_parquet(ds, f, fh).iter_batches(batch_size=4096, columns=names)
        while True:
            try:
                batch = next(batches, None)
            except (pa.ArrowException, OSError) as e:
                raise UserError(f"{ds.name(f)}: cannot be read as Parquet after row {at} ({str(e).splitlines()[0]}); "
                                "replace the file") from None
            if batch is None:
                return
            for row in parquet_pylist(ds, f, batch, range(at, at + batch.num_rows), first_number):
                yield at, row
                at += 1


def require_columns(ds: Dataset, names: list[str]) -> None:
    """Every column of ``names`` in every Parquet file's schema, or in the first JSON line (a
    later line without one is refused by its row's check)."""
    for f in range(len(ds.files)):
        if ds.kind == PARQUET:
            with ds.fs.open(ds.files[f], "rb") as fh:
                has = open_parquet(ds, f, fh).schema_arrow.names
        else:
            first = next(jsonl_lines(ds, f), None)
            if first is None:
                continue
            try:
                obj = json.loads(first[1])
            except (ValueError, RecursionError):
                return  # no JSON object: the row's check names the fault
            if not isinstance(obj, dict):
                return
            has = list(obj)
        missing = [n for n in names if n not in has]
        if missing:
            where = ds.url if len(ds.files) == 1 else ds.name(f)
            raise UserError(f"{where}: no column(s) {', '.join(missing)}; it has {', '.join(map(str, has)) or 'none'}")
        if ds.kind == JSONL:
            return


def iter_rows(ds: Dataset, columns: Columns) -> Iterator[Row]:
    """Every row of ``ds`` in order, streamed, with bounded memory: ``(number, place, {column: value})``."""
    names = columns.names
    require_columns(ds, names)
    number = 0
    for f in range(len(ds.files)):
        if ds.kind == PARQUET:
            for at, values in _parquet_rows(ds, f, names, number):
                yield number, (f, at), values
                number += 1
            continue
        for offset, text in jsonl_lines(ds, f):
            yield number, (f, offset), row_values(ds, number, (f, offset), text, names)
            number += 1
