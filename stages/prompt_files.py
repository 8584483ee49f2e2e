"""The files of a prompts dataset: which they are and their version, the row index and its cache,
and reading rows — all of them as a stream, or a chosen few through the index. Torch-free.

The index says where each row lies: for JSON lines the byte offset of each row's line (a scan
for newlines, in NumPy, over the file's bytes), for Parquet the row count of each row group (from
the footers: no data read). It is built once per dataset version — every file's path, size and
modification stamp — and kept in an index cache folder, one file per version, written under a
temporary name and renamed (ranks and stages may race: each writes a whole file). A cache file is
trusted only when its header names this version and its arrays match their checksum; anything
else (damaged, truncated, another dataset's) is built again and replaced.
"""

from __future__ import annotations

import functools
import hashlib
import json
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass

import fsspec
import numpy as np
import xxhash

from llamarl.lib.errors import UserError

JSONL, PARQUET = "jsonl", "parquet"
INDEX_FORMAT = 1  # of the cache files: a new one builds every index again
_BLOCK = 16 << 20  # bytes scanned at a time when indexing a JSON lines file
_SPACE = np.array([ord(c) for c in " \t\r\x0b\x0c"], np.uint8)  # what bytes.strip() removes, but the newline
_BOM = b"\xef\xbb\xbf"
ABSENT = object()  # a JSON line without the column (a Parquet row always has every column of its file)

Row = tuple  # (row number, place, {column: value}); place: (file index, byte offset | row in the file)


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
        return hashlib.sha256(json.dumps([INDEX_FORMAT, self.key]).encode()).hexdigest()[:32]

    def name(self, f: int) -> str:
        path = self.files[f]
        return path if _is_local(self.fs) else self.fs.unstrip_protocol(path)

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
            while offset > 0 and (block := fh.read(min(_BLOCK, offset))):
                count += block.count(b"\n")
                offset -= len(block)
        return count + 1

    def locate(self, number: int) -> tuple[int, int]:
        """The place of row ``number`` (for messages: reads the files up to it)."""
        if self.kind == PARQUET:
            starts = np.cumsum([0] + [sum(_parquet_groups(self, f)) for f in range(len(self.files))])
            f = int(np.searchsorted(starts, number, side="right") - 1)
            return f, number - int(starts[f])
        seen = 0
        for f in range(len(self.files)):
            for offset, _ in _jsonl_lines(self, f):
                if seen == number:
                    return f, offset
                seen += 1
        raise IndexError(number)


def _is_local(fs) -> bool:
    from fsspec.implementations.local import LocalFileSystem

    return isinstance(fs, LocalFileSystem)


def _stamp(info: dict) -> str:
    for key in ("mtime", "LastModified", "last_modified", "updated", "created", "ETag", "etag"):
        if info.get(key) is not None:
            return str(info[key])
    return ""


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


def _content(line: bytes, offset: int) -> bytes | None:
    """A line's JSON text, or None for a blank line (not a row)."""
    if offset == 0 and line.startswith(_BOM):
        line = line[len(_BOM):]
    return line if line.strip() else None


def _jsonl_lines(ds: Dataset, f: int) -> Iterator[tuple[int, bytes]]:
    """(byte offset, text) of each row of JSON lines file ``f``: its non-blank lines, of any length."""
    offset = 0
    with ds.fs.open(ds.files[f], "rb") as fh:
        for line in fh:
            text = _content(line, offset)
            if text is not None:
                yield offset, text
            offset += len(line)


def _decode(text: bytes, names: list[str]) -> dict:
    """The values of ``names`` in a JSON line (absent ones left out), or a ``ValueError`` saying
    what is wrong and the fix."""
    try:
        s = text.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"not UTF-8 (byte {e.start} of the line); save the file as UTF-8") from None
    try:
        obj = json.loads(s)
    except json.JSONDecodeError as e:
        raise ValueError(f"not valid JSON ({e.msg} at column {e.colno}); fix the line or remove it") from None
    except RecursionError:
        raise ValueError("JSON nested too deeply to read; flatten the line") from None
    if not isinstance(obj, dict):
        raise ValueError(f"a JSON {type(obj).__name__}, not an object; give each row as one object "
                         '{"prompt": ...} on its own line') from None
    return {n: obj[n] for n in names if n in obj}


def _open_parquet(ds: Dataset, f: int, fh):
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(fh)
    except (pa.ArrowException, OSError) as e:
        raise UserError(f"{ds.name(f)}: cannot be read as Parquet ({str(e).splitlines()[0]}); replace the "
                        "file") from None


def _parquet_groups(ds: Dataset, f: int) -> list[int]:
    with ds.fs.open(ds.files[f], "rb") as fh:
        meta = _open_parquet(ds, f, fh).metadata
    return [meta.row_group(g).num_rows for g in range(meta.num_row_groups)]


def _pylist(ds: Dataset, f: int, first: int, table, first_number: int) -> list[dict]:
    """A Parquet batch's rows as dicts; a value Python cannot decode (text that is not UTF-8)
    named by its row."""
    try:
        return table.to_pylist()
    except UnicodeDecodeError:
        for i in range(table.num_rows):
            for name in table.column_names:
                try:
                    table.slice(i, 1).column(name).to_pylist()
                except UnicodeDecodeError:
                    raise UserError(f"{ds.where(first_number + i, (f, first + i))}: {name!r} is not valid "
                                    "UTF-8 text; write the file's text as UTF-8") from None
        raise


def _parquet_rows(ds: Dataset, f: int, names: list[str], first_number: int) -> Iterator[tuple[int, dict]]:
    """(row in the file, values) of every row of Parquet file ``f``, a batch at a time."""
    import pyarrow as pa

    at = 0
    with ds.fs.open(ds.files[f], "rb") as fh:
        batches = _open_parquet(ds, f, fh).iter_batches(batch_size=4096, columns=names)
        while True:
            try:
                batch = next(batches, None)
            except (pa.ArrowException, OSError) as e:
                raise UserError(f"{ds.name(f)}: cannot be read as Parquet after row {at} ({str(e).splitlines()[0]}); "
                                "replace the file") from None
            if batch is None:
                return
            for row in _pylist(ds, f, at, batch, first_number + at):
                yield at, row
                at += 1


def require_columns(ds: Dataset, names: list[str]) -> None:
    """Every column of ``names`` in every Parquet file's schema, or in the first JSON line (a
    later line without one is refused by its row's check)."""
    for f in range(len(ds.files)):
        if ds.kind == PARQUET:
            with ds.fs.open(ds.files[f], "rb") as fh:
                has = _open_parquet(ds, f, fh).schema_arrow.names
        else:
            first = next(_jsonl_lines(ds, f), None)
            if first is None:
                continue
            try:
                has = list(json.loads(first[1]))
            except (ValueError, TypeError):
                return  # the row's check names the fault
        missing = [n for n in names if n not in has]
        if missing:
            where = ds.url if len(ds.files) == 1 else ds.name(f)
            raise UserError(f"{where}: no column(s) {', '.join(missing)}; it has {', '.join(map(str, has))}")
        if ds.kind == JSONL:
            return


def iter_rows(ds: Dataset, names: list[str]) -> Iterator[Row]:
    """Every row of ``ds`` in order, with bounded memory: ``(number, place, {name: value})``."""
    require_columns(ds, names)
    number = 0
    for f in range(len(ds.files)):
        if ds.kind == PARQUET:
            for at, values in _parquet_rows(ds, f, names, number):
                yield number, (f, at), values
                number += 1
            continue
        for offset, text in _jsonl_lines(ds, f):
            yield number, (f, offset), _values(ds, number, (f, offset), text, names)
            number += 1


def _values(ds: Dataset, number: int, place: tuple[int, int], text: bytes, names: list[str]) -> dict:
    try:
        return _decode(text, names)
    except ValueError as e:
        raise UserError(f"{ds.where(number, place)}: {e}") from None


# ---- the index ---------------------------------------------------------------------------------------------


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
    first with its byte-order mark — are read and tested as ``_jsonl_lines`` tests them)."""
    starts, firsts, carry, base = [], [], True, 0
    with ds.fs.open(ds.files[f], "rb") as fh:
        while block := fh.read(_BLOCK):
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
        keep[i] = _content(line, int(starts[i])) is not None
    return starts[keep]


def _build(ds: Dataset) -> Index:
    if ds.kind == JSONL:
        offsets = [_jsonl_offsets(ds, f) for f in range(len(ds.files))]
        return Index(np.array([len(o) for o in offsets], np.int64), np.concatenate(offsets).astype(np.int64),
                     np.zeros(0, np.int64), np.zeros(0, np.int64), built=True)
    groups = [_parquet_groups(ds, f) for f in range(len(ds.files))]
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
                  "arrays": {a: len(getattr(index, a)) for a in Index.ARRAYS}, "xxh3_128": xxhash.xxh3_128_hexdigest(payload)}
        _write(index_cache, f"{ds.version}.index", json.dumps(header).encode() + b"\n" + payload)
    return index


def _load_index(ds: Dataset, index_cache: str) -> Index | None:
    data = _read(index_cache, f"{ds.version}.index")
    try:
        head, payload = data.split(b"\n", 1)
        header = json.loads(head)
        if (header["format"], header["version"], header["dataset"]) != ("llamarl-prompt-index", INDEX_FORMAT, ds.key):
            return None
        if xxhash.xxh3_128_hexdigest(payload) != header["xxh3_128"]:
            return None
        lengths = [int(header["arrays"][a]) for a in Index.ARRAYS]
        if sum(lengths) * 8 != len(payload):
            return None
        flat = np.frombuffer(payload, "<i8").astype(np.int64)
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
    """``data`` as ``folder/name``, whole or not at all: written under a name of its own, then
    renamed. The cache only saves work: a folder that cannot hold it is said once, not fatal."""
    fs, root = fsspec.core.url_to_fs(folder)
    root = root.rstrip("/")
    tmp = f"{root}/.{name}.{uuid.uuid4().hex}.tmp"
    try:
        fs.makedirs(root, exist_ok=True)
        fs.pipe_file(tmp, data)
        fs.mv(tmp, f"{root}/{name}")
    except OSError as e:
        print(f"warning: {folder}: cannot keep the prompts' index there ({e}); it is built again each time",
              file=sys.stderr, flush=True)


# ---- a few rows, through the index -------------------------------------------------------------------------


def read_rows(ds: Dataset, index: Index, rows: np.ndarray, names: list[str]) -> list[Row]:
    """Rows ``rows`` (numbers) of ``ds``, in that order, reading only them: JSON lines by their
    byte ranges, Parquet by the row groups holding them (only ``names``' columns)."""
    require_columns(ds, names)
    rows = np.asarray(rows, np.int64)
    starts = index.file_starts
    file_of = np.searchsorted(starts, rows, side="right") - 1
    out: list = [None] * len(rows)
    for f in np.unique(file_of):
        at = np.flatnonzero(file_of == f)
        read = _jsonl_read if ds.kind == JSONL else _parquet_read
        for i, row in zip(at, read(ds, index, int(f), rows[at], rows[at] - starts[f], names)):
            out[i] = row
    return out


def _jsonl_read(ds: Dataset, index: Index, f: int, numbers: np.ndarray, local: np.ndarray, names) -> list[Row]:
    begin = index.offsets[numbers]
    last = numbers + 1 >= index.file_starts[f + 1]  # a file's last row runs to its end
    end = np.where(last, ds.sizes[f], index.offsets[np.minimum(numbers + 1, index.n_rows - 1)])
    blobs = ds.fs.cat_ranges([ds.files[f]] * len(numbers), begin.tolist(), end.tolist())
    rows = []
    for n, b, blob in zip(numbers.tolist(), begin.tolist(), blobs):
        text = _content(blob, b)
        if text is None:  # the file changed since its index was made (a stamp that did not)
            raise UserError(f"{ds.name(f)} changed while it was read; run again")
        rows.append((n, (f, b), _values(ds, n, (f, b), text, names)))
    return rows


def _parquet_read(ds: Dataset, index: Index, f: int, numbers: np.ndarray, local: np.ndarray, names) -> list[Row]:
    import pyarrow as pa

    first_group = int(index.file_groups[:f].sum())
    group_starts = np.concatenate(([0], np.cumsum(index.group_rows[first_group:first_group + index.file_groups[f]])))
    group_of = np.searchsorted(group_starts, local, side="right") - 1
    rows: list = [None] * len(numbers)
    with ds.fs.open(ds.files[f], "rb") as fh:
        pf = _open_parquet(ds, f, fh)
        for g in np.unique(group_of):
            at = np.flatnonzero(group_of == g)
            try:
                table = pf.read_row_group(int(g), columns=names).take(pa.array(local[at] - group_starts[g]))
            except (pa.ArrowException, OSError) as e:
                raise UserError(f"{ds.name(f)}: row group {g} cannot be read ({str(e).splitlines()[0]}); replace "
                                "the file") from None
            try:
                values = table.to_pylist()
            except UnicodeDecodeError:
                values = [_pylist(ds, f, int(local[i]), table.slice(j, 1), int(numbers[i]))[0] for j, i in enumerate(at)]
            for i, v in zip(at, values):
                rows[i] = (int(numbers[i]), (f, int(local[i])), v)
    return rows
