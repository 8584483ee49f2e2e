"""The prompts dataset (stages/prompts.py): the selection of an iteration's rows, the row index and
its cache, reading rows, and the rules every row meets — then the rollout stage reading them."""

from __future__ import annotations

import json
import multiprocessing
import os
import subprocess
import sys
import time

import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.parquet as pq
import pytest

from llamarl.lib.files import publish
from llamarl.lib.errors import UserError
from llamarl.pipeline import toy
from llamarl.stages import prompts, shard
from llamarl.stages.config import PromptSelection, RolloutConfig, ShardConfig
from llamarl.stages.prompts import Columns

# ---- the selection -------------------------------------------------------------------------------------------


def _take(n, start, count, seed=0, shuffle=True) -> list[int]:
    return prompts.selected_rows(n, PromptSelection(seed=seed, shuffle=shuffle, start=start, count=count)).tolist()


def test_each_epoch_takes_every_row_once_in_an_order_of_its_own():
    epoch0 = [r for k in range(3) for r in _take(48, 16 * k, 16)]  # positions 0-47: three rollouts of 16
    epoch1 = [r for k in range(3, 6) for r in _take(48, 16 * k, 16)]  # 48-95
    assert sorted(epoch0) == sorted(epoch1) == list(range(48))
    assert epoch0 != epoch1 and epoch0 != list(range(48))
    assert epoch0 == prompts.epoch_order(48, 0, 0).tolist() and epoch1 == prompts.epoch_order(48, 0, 1).tolist()
    # Without shuffle: file order, epoch after epoch.
    assert _take(48, 40, 16, shuffle=False) == list(range(40, 48)) + list(range(8))


def test_an_epoch_boundary_takes_the_tail_and_the_head_each_row_once():
    n, start, count = 48, 40, 16
    tail, head = prompts.epoch_order(n, 5, 0)[40:].tolist(), prompts.epoch_order(n, 5, 1)[:8].tolist()
    rows = _take(n, start, count, seed=5)
    assert rows == tail + [r for r in head if r not in tail]
    repeats = len(set(tail) & set(head))
    select = PromptSelection(seed=5, start=start, count=count)
    record = prompts.selection_record(n, select, np.array(rows))
    assert record["epochs"] == [{"epoch": 0, "from": 40, "to": 48}, {"epoch": 1, "from": 0, "to": 8}]
    assert record["rows"] == count - repeats and record["dropped_repeats"] == repeats
    assert record["dataset_rows"] == n and (record["seed"], record["start"], record["count"]) == (5, 40, 16)
    # A seed whose boundary repeats rows (the dropping is exercised, not assumed).
    seed = next(s for s in range(100) if set(prompts.epoch_order(n, s, 0)[40:]) & set(prompts.epoch_order(n, s, 1)[:8]))
    rows = _take(n, start, count, seed=seed)
    assert len(rows) < count and len(set(rows)) == len(rows)


def test_the_selection_is_a_pure_function_of_seed_epoch_and_position():
    for n in (1, 7, 48):
        for start in range(0, 3 * n, max(n // 3, 1)):
            for count in {1, max(n // 2, 1), n}:
                rows = _take(n, start, count, seed=3)
                assert rows == _take(n, start, count, seed=3)  # deterministic
                assert len(set(rows)) == len(rows) and all(0 <= r < n for r in rows)  # no duplicates
                assert len(rows) == count or start % n + count > n  # only a boundary drops rows
    assert _take(48, 0, 16, seed=1) != _take(48, 0, 16, seed=2)
    assert prompts.epoch_order(10**6, 1, 2).tolist() == prompts.epoch_order(10**6, 1, 2).tolist()
    assert _take(48, 0, 48, seed=-1) == prompts.epoch_order(48, 2**64 - 1, 0).tolist()  # a negative seed, mod 2**64
    # Pinned: NumPy drawing other permutations would change which rows a run's iterations take.
    assert prompts.epoch_order(48, 0, 0)[:8].tolist() == PINNED_EPOCH_0


PINNED_EPOCH_0 = [4, 18, 2, 43, 21, 34, 20, 11]


def test_more_rows_than_the_dataset_has_are_refused_in_one_line():
    with pytest.raises(UserError, match=r"^select.count=49 is more than the 48 rows of the prompts; take at most 48 "):
        _take(48, 0, 49)


# ---- datasets, the index and its cache -------------------------------------------------------------------------


def _jsonl(path, lines: list) -> str:
    """A JSON lines file of ``lines`` (dicts, or raw bytes written as they are)."""
    with open(path, "wb") as f:
        for line in lines:
            f.write(line if isinstance(line, bytes) else json.dumps(line).encode() + b"\n")
    return str(path)


def _awkward_jsonl(path) -> str:
    """Blank lines (empty, spaces, CRLF, form feeds), a byte-order mark, an indented line, a line of
    3 MiB (over pyarrow's 1 MiB block), and no newline after the last."""
    big = "word " * (3 << 18)
    return _jsonl(path, [b"\xef\xbb\xbf" + json.dumps({"prompt": "first", "n": 0}).encode() + b"\r\n", b"\n", b"   \n",
                         b"\r\n", {"prompt": "second", "n": 1}, b"  " + json.dumps({"prompt": big, "n": 2}).encode() + b"\n",
                         b"\x0c\x0b \n", b"\t\n", {"prompt": "2020-01-01", "n": 3}, json.dumps({"prompt": "last", "n": 4}).encode()])


def _datasets(tmp_path) -> dict[str, str]:
    (tmp_path / "folder").mkdir()
    for i in range(3):
        _jsonl(tmp_path / "folder" / f"part{i}.jsonl", [{"prompt": f"p{i}-{j}", "n": 10 * i + j} for j in range(4 + i)])
    table = pa.table({"prompt": [f"q{i}" for i in range(50)], "n": list(range(50))})
    pq.write_table(table, tmp_path / "p.parquet", row_group_size=7)
    (tmp_path / "pfolder").mkdir()
    pq.write_table(table.slice(0, 20), tmp_path / "pfolder" / "a.parquet", row_group_size=6)
    pq.write_table(table.slice(20), tmp_path / "pfolder" / "b.parquet", row_group_size=9)
    return {"awkward": _awkward_jsonl(tmp_path / "awkward.jsonl"), "folder": str(tmp_path / "folder"),
            "parquet": str(tmp_path / "p.parquet"), "pfolder": str(tmp_path / "pfolder")}


@pytest.mark.parametrize("name", ["awkward", "folder", "parquet", "pfolder"])
def test_the_index_reads_the_rows_the_stream_reads(tmp_path, name):
    url = _datasets(tmp_path)[name]
    cols = Columns("prompt", None, ("n",))
    ds = prompts.open_dataset(url)
    every = list(prompts.iter_rows(ds, cols))
    index = prompts.row_index(ds)
    assert index.n_rows == len(every) == prompts.row_index(prompts.open_dataset(url)).n_rows
    for seed in range(3):
        rows = prompts.selected_rows(index.n_rows, PromptSelection(seed=seed, start=2, count=index.n_rows - 1))
        assert prompts.read_rows(ds, index, rows, cols) == [every[r] for r in rows]
    if name == "awkward":  # values as written: a date stays text; the long line whole
        assert [v["n"] for _, _, v in every] == [0, 1, 2, 3, 4] and every[3][2]["prompt"] == "2020-01-01"
        assert len(every[2][2]["prompt"]) == 5 * (3 << 18)
        assert [ds.where(n, place) for n, place, _ in every] == [f"{url}: line {line} (row {n})"
                                                                  for n, line in enumerate([1, 5, 6, 9, 10])]
    if name == "folder":
        assert ds.where(*every[5][:2]) == f"{url}/part1.jsonl: line 2 (row 5 of the prompts)"
    if name == "pfolder":
        assert ds.where(*every[23][:2]) == f"{url}/b.parquet: row 3 (row 23 of the prompts)"


def test_well_formed_prompts_read_as_the_pyarrow_reader_read_them(tmp_path):
    # The rollout's rows are these values (and their row numbers): for prompts pyarrow typed right,
    # its previous reader, they are the same, so a full-dataset rollout writes the same parts.
    toy.make_prompts(str(tmp_path / "text.jsonl"), n=10)
    toy.make_prompts(str(tmp_path / "chat.jsonl"), n=9, chat=True)
    _jsonl(tmp_path / "typed.jsonl", [{"prompt": f"p{i}", "n": i, "x": i / 3, "tags": ["a"] * (i % 3), "meta": {"k": i}}
                                      for i in range(12)])
    data = _datasets(tmp_path)
    for url, cols in [(str(tmp_path / "text.jsonl"), ["prompt", "id", "answer"]), (str(tmp_path / "chat.jsonl"), ["prompt", "id"]),
                      (str(tmp_path / "typed.jsonl"), ["prompt", "n", "x", "tags", "meta"]), (data["folder"], ["prompt", "n"]),
                      (data["parquet"], ["prompt", "n"]), (data["pfolder"], ["prompt", "n"])]:
        ds = prompts.open_dataset(url)
        old = pads.dataset(list(ds.files), format="json" if ds.kind == "jsonl" else "parquet")
        assert [v for _, _, v in prompts.iter_rows(ds, Columns(cols[0], None, tuple(cols[1:])))] == \
            old.to_table(columns=cols).to_pylist(), url


def _cache_files(cache) -> list[str]:
    return sorted(p for p in os.listdir(cache) if not p.startswith("."))


def test_the_index_is_cached_per_dataset_version_and_rebuilt_when_it_is_not_sound(tmp_path):
    url, cache = _datasets(tmp_path)["awkward"], str(tmp_path / "cache")
    ds = prompts.open_dataset(url)
    first = prompts.row_index(ds, cache)
    assert first.built and _cache_files(cache) == [f"{ds.version}.index"]
    path = os.path.join(cache, f"{ds.version}.index")
    again = prompts.row_index(prompts.open_dataset(url), cache)
    assert not again.built and np.array_equal(again.offsets, first.offsets)
    # A file changed (its size, or its modification time alone): another version, indexed anew.
    with open(url, "ab") as f:
        f.write(b'\n{"prompt": "one more", "n": 5}\n')
    changed = prompts.open_dataset(url)
    assert changed.version != ds.version
    grown = prompts.row_index(changed, cache)
    assert grown.built and grown.n_rows == 6 and len(_cache_files(cache)) == 2
    os.utime(url, ns=(os.stat(url).st_atime_ns, os.stat(url).st_mtime_ns + 10**9))
    assert prompts.row_index(prompts.open_dataset(url), cache).built
    # Damaged (bytes flipped, truncated, garbage) or another dataset's: built again, then trusted again.
    ds = prompts.open_dataset(url)
    path = os.path.join(cache, f"{ds.version}.index")
    good = open(path, "rb").read()
    (tmp_path / "o").mkdir()
    other = prompts.open_dataset(_datasets(tmp_path / "o")["folder"])
    prompts.row_index(other, cache)
    foreign = open(os.path.join(cache, f"{other.version}.index"), "rb").read()
    flipped = good[:-4] + bytes(b ^ 0xFF for b in good[-4:])
    for bad in (flipped, good[: len(good) // 2], b"", b"\x00garbage\n", foreign, good.replace(b'"version": 1', b'"version": 9')):
        with open(path, "wb") as f:
            f.write(bad)
        rebuilt = prompts.row_index(ds, cache)
        assert rebuilt.built and rebuilt.n_rows == 6
        assert open(path, "rb").read() == good
        assert not prompts.row_index(ds, cache).built


def _build_index(url: str, cache: str) -> int:
    return prompts.row_index(prompts.open_dataset(url), cache).n_rows


def test_ranks_racing_to_build_the_index_leave_one_whole_file(tmp_path):
    url = _jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}"} for i in range(20000)])
    cache = str(tmp_path / "cache")
    with multiprocessing.get_context("spawn").Pool(4) as pool:
        assert pool.starmap(_build_index, [(url, cache)] * 8) == [20000] * 8
    assert _cache_files(cache) == [f"{prompts.open_dataset(url).version}.index"]
    assert not [p for p in os.listdir(cache) if p.endswith(".tmp")]
    assert not prompts.row_index(prompts.open_dataset(url), cache).built


def test_a_whole_dataset_is_checked_once_per_version_with_a_cache(tmp_path):
    url, cache = _jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}", "id": i} for i in range(30)]), str(tmp_path / "cache")
    cols = Columns("prompt", "id", ())
    assert prompts.check_dataset(url, cols, cache).rows == 30
    note, = [p for p in _cache_files(cache) if ".checked-" in p]
    calls = []
    real = prompts.check_rows
    prompts.check_rows = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        assert prompts.check_dataset(url, cols, cache).rows == 30 and not calls  # the note, not the rows
        assert prompts.check_dataset(url, Columns("prompt", None, ()), cache).rows == 30 and calls  # other columns
        for bad in (b"{", b'{"format": "llamarl-prompt-note"}', b"[]"):
            (tmp_path / "cache" / note).write_bytes(bad)
            calls.clear()
            assert prompts.check_dataset(url, cols, cache).rows == 30 and calls  # damaged: checked again
    finally:
        prompts.check_rows = real


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["jsonl", "parquet"])
def test_an_iteration_of_512_rows_out_of_a_million_reads_in_well_under_a_second(tmp_path, kind):
    n = 1_000_000
    ids = [f"q{i:07d}" for i in range(n)]
    text = [f"question {i}: what is {i % 977} plus {i % 13}?" for i in range(n)]
    if kind == "jsonl":
        url = str(tmp_path / "p.jsonl")
        with open(url, "w") as f:
            f.writelines(json.dumps({"id": a, "prompt": b, "answer": a[::-1]}) + "\n" for a, b in zip(ids, text))
    else:
        url = str(tmp_path / "p.parquet")
        pq.write_table(pa.table({"id": ids, "prompt": text, "answer": [a[::-1] for a in ids]}), url, row_group_size=64 * 1024)
    cache, cols = str(tmp_path / "cache"), Columns("prompt", "id", ("answer",))
    t0 = time.perf_counter()
    assert prompts.row_index(prompts.open_dataset(url), cache).n_rows == n
    t1 = time.perf_counter()
    prompts.check_dataset(url, cols, cache)
    t2 = time.perf_counter()
    seconds = []
    for k in range(1, 6):
        t = time.perf_counter()
        reading = prompts.for_rollout(url, cols, PromptSelection(seed=1, start=(k - 1) * 512, count=512), cache)
        seconds.append(time.perf_counter() - t)
        assert reading.count == 512 and reading.selection["index"] == "cached"
        numbers = [r for r, _, _ in reading.rows]
        assert [v["id"] for _, _, v in reading.rows] == [ids[r] for r in numbers] and len(set(numbers)) == 512
    print(f"\n{kind}: index {t1 - t0:.2f} s, whole check {t2 - t1:.2f} s, an iteration {min(seconds):.3f}-{max(seconds):.3f} s")
    # JSON lines reads its 512 lines alone; Parquet decodes the row groups they lie in (here all 16).
    assert sorted(seconds)[2] < {"jsonl": 0.25, "parquet": 1.0}[kind]


# ---- the rules: one row per fault ------------------------------------------------------------------------------

GOOD = {"prompt": "the cat", "id": "a", "answer": "x"}
COLS = Columns("prompt", "id", ("answer",))


def _row(**values) -> dict:
    return {k: v for k, v in {**GOOD, "id": "b", **values}.items() if v is not _DROP}


_DROP = object()

BAD_JSONL = [  # (name, the second line of the file, what the one line says after "FILE: line 2 (row 1): ")
    ("null-prompt", _row(prompt=None), "'prompt' is null; give every row a prompt"),
    ("no-prompt", _row(prompt=_DROP), "has no 'prompt'; give every row a prompt"),
    ("empty-prompt", _row(prompt=""), "'prompt' is empty; remove the row or give it a prompt"),
    ("blank-prompt", _row(prompt=" \n\t"), "'prompt' is empty"),
    ("number-prompt", _row(prompt=5), "'prompt' is a number (5), not text or chat messages"),
    ("bool-prompt", _row(prompt=True), "'prompt' is a boolean (True), not text or chat messages"),
    ("object-prompt", _row(prompt={"role": "user", "content": "hi"}), "'prompt' is an object, not text or chat messages"),
    ("no-messages", _row(prompt=[]), "'prompt' has no messages"),
    ("no-content", _row(prompt=[{"role": "user"}]), "'prompt' message 0 has no content; give every message a role"),
    ("null-content", _row(prompt=[{"role": "system", "content": "s"}, {"role": "user", "content": None}]),
     "'prompt' message 1 has no content"),
    ("list-content", _row(prompt=[{"role": "user", "content": [{"type": "text", "text": "hi"}]}]),
     "'prompt' message 0 has a list as its content ([{'type': 'text', 'text': 'hi'}]), not text"),
    ("no-role", _row(prompt=[{"content": "hi"}]), "'prompt' message 0 has no role"),
    ("number-role", _row(prompt=[{"role": 1, "content": "hi"}]), "'prompt' message 0 has a number as its role (1), not text"),
    ("empty-role", _row(prompt=[{"role": " ", "content": "hi"}]), "'prompt' message 0 has an empty role"),
    ("text-messages", _row(prompt=["hi", "there"]), "'prompt' message 0 is text, not a message {role, content}"),
    ("empty-messages", _row(prompt=[{"role": "user", "content": " "}]), "'prompt': every message is empty"),
    ("surrogate", b'{"prompt": "bad \\ud800 text", "id": "b", "answer": "x"}\n', "'prompt' is not valid Unicode"),
    ("null-id", _row(id=None), "has a null 'id'; give every row an id, or set no id_column"),
    ("no-id", _row(id=_DROP), "has no 'id'; give every row an id"),
    ("empty-id", _row(id=""), "'id' is empty"),
    ("float-id", _row(id=1.5), "'id' is a number (1.5); ids are text or integers"),
    ("bool-id", _row(id=False), "'id' is a boolean (False); ids are text or integers"),
    ("list-id", _row(id=[1]), "'id' is a list ([1]); ids are text or integers"),
    ("duplicate-id", _row(id="a"), "'id' 'a' is also the id of row 0 ("),
    ("no-kept", _row(answer=_DROP), "has no 'answer' (a kept column); give it in every row (null where there is none)"),
    ("kept-types", _row(answer=7), "kept column 'answer' is int64 here and string in the rows before; give the column one type"),
    ("kept-too-big", _row(answer=2**70), "kept column 'answer' cannot be written to Parquet"),
    ("not-json", b'{"prompt": "a", "id": "b",}\n', "not valid JSON (Expecting property name enclosed in double quotes at "
                                                  "column 27); fix the line or remove it"),
    ("not-utf8", b'{"prompt": "caf\xe9", "id": "b", "answer": "x"}\n', "not UTF-8 (byte 15 of the line); save the file as UTF-8"),
    ("array-line", b'["the cat", "b"]\n', "a JSON list, not an object; give each row as one object"),
    ("string-line", b'"the cat"\n', "a JSON str, not an object"),
    # found by tests/test_fuzz.py: a key given twice (json kept the last, silently), a null message
    ("key-twice", b'{"prompt": "the cat", "id": "b", "answer": "x", "id": "c"}\n',
     "gives 'id' twice in one object, and which value is meant is not said; keep one"),
    ("message-key-twice", b'{"prompt": [{"role": "user", "content": "a", "content": "b"}], "id": "b", "answer": "x"}\n',
     "gives 'content' twice in one object"),
    ("null-message", _row(prompt=[None]), "'prompt' message 0 is null, not a message {role, content}"),
    # an integer longer than Python's int() takes: json's ValueError, not a JSONDecodeError
    ("huge-integer", b'{"prompt": "a", "id": 1' + b"0" * 5000 + b', "answer": "x"}\n',
     "Exceeds the limit (4300 digits) for integer string conversion"),
]


@pytest.mark.parametrize("name,line,says", BAD_JSONL, ids=[c[0] for c in BAD_JSONL])
def test_a_bad_jsonl_row_is_refused_in_one_line_naming_its_line(tmp_path, name, line, says):
    url = _jsonl(tmp_path / "p.jsonl", [GOOD, line, {**GOOD, "id": "c"}])
    with pytest.raises(UserError) as e:
        prompts.check_dataset(url, COLS)
    assert str(e.value).startswith(f"{url}: line 2 (row 1): {says}") and "\n" not in str(e.value), str(e.value)


def test_ids_that_read_the_same_as_text_are_duplicates_and_int_ids_are_ids(tmp_path):
    url = _jsonl(tmp_path / "p.jsonl", [{"prompt": "a", "id": 1}, {"prompt": "b", "id": 2}, b"\n", {"prompt": "c", "id": "1"}])
    with pytest.raises(UserError, match=rf"^{url}: line 4 \(row 2\): 'id' '1' is also the id of row 0 \({url}: line 1 "
                                        r"\(row 0\)\); prompt ids must be unique"):
        prompts.check_dataset(url, Columns("prompt", "id", ()))
    assert prompts.check_dataset(url, Columns("prompt", None, ())).rows == 3  # without id_column: row numbers


def test_kept_columns_have_one_type_over_the_dataset(tmp_path):
    # Integers then a float: float64 everywhere (as one part would have it), so every part agrees;
    # a column null in a whole chunk keeps the type the others give it.
    url = _jsonl(tmp_path / "p.jsonl", [{"prompt": f"p{i}", "score": i if i < 5000 else 0.5, "maybe": None if i < 5000 else "x",
                                         "nested": {"a": i} if i % 2 else {"b": "y"}} for i in range(6000)])
    kept = prompts.check_dataset(url, Columns("prompt", None, ("score", "maybe", "nested"))).kept
    assert kept == pa.schema([("score", pa.float64()), ("maybe", pa.string()),
                              ("nested", pa.struct([("b", pa.string()), ("a", pa.int64())]))])


def _parquet(path, **columns) -> str:
    pq.write_table(pa.table({"prompt": ["the cat", "a dog"], "id": ["a", "b"], "answer": ["x", "y"]} | columns), path)
    return str(path)


MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
BAD_PARQUET = [  # (name, columns of a two-row file, the row refused, what the line says after "FILE: row R: ")
    ("binary-prompt", {"prompt": pa.array([b"the cat", b"a dog"], pa.binary())}, 0, "'prompt' is binary (bytes), not text"),
    ("list-of-text", {"prompt": pa.array([["a"], ["b"]], pa.list_(pa.string()))}, 0,
     "'prompt' message 0 is text, not a message"),
    ("null-content", {"prompt": pa.array([[{"role": "user", "content": "hi"}], [{"role": "user", "content": None}]], MESSAGES)},
     1, "'prompt' message 0 has no content"),
    ("float-id", {"id": pa.array([1.0, 1.5])}, 0, "'id' is a number (1.0); ids are text or integers"),
    ("not-json-message", {"prompt": pa.array([[{"role": "user", "content": "hi", "at": None}],
                                              [{"role": "user", "content": "hi", "at": 5}]],
                                             pa.list_(pa.struct([("role", pa.string()), ("content", pa.string()),
                                                                 ("at", pa.timestamp("s"))])))},
     1, "'prompt' cannot be stored as JSON (Object of type datetime is not JSON serializable)"),
    ("not-utf8", {"prompt": pa.Array.from_buffers(pa.string(), 2, pa.array([b"the cat", b"caf\xe9"], pa.binary()).buffers())},
     1, "'prompt' is not valid UTF-8 text"),
]


@pytest.mark.parametrize("name,columns,row,says", BAD_PARQUET, ids=[c[0] for c in BAD_PARQUET])
def test_a_bad_parquet_row_is_refused_in_one_line_naming_its_row(tmp_path, name, columns, row, says):
    url = _parquet(tmp_path / "p.parquet", **columns)
    with pytest.raises(UserError) as e:
        prompts.check_dataset(url, COLS)
    assert str(e.value).startswith(f"{url}: row {row}: {says}") and "\n" not in str(e.value), str(e.value)


def test_chat_messages_as_parquet_structs_are_prompts(tmp_path):
    messages = pa.array([[{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]] * 2, MESSAGES)
    url = _parquet(tmp_path / "p.parquet", prompt=messages)
    assert prompts.check_dataset(url, COLS).rows == 2
    rows = list(prompts.iter_rows(prompts.open_dataset(url), COLS))
    assert rows[1][2]["prompt"] == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]


def test_what_is_no_dataset_is_refused_in_one_line(tmp_path):
    (tmp_path / "bad.parquet").write_bytes(b"not parquet at all")
    cases = [(str(tmp_path / "bad.parquet"), "cannot be read as Parquet"),
             (_parquet(tmp_path / "p.parquet"), "no column(s) question; it has prompt, id, answer"),
             (_jsonl(tmp_path / "p.jsonl", [GOOD]), "no column(s) question; it has prompt, id, answer"),
             (_jsonl(tmp_path / "e.jsonl", [b"\n", b"  \n"]), "no prompts (0 rows)"),
             # found by tests/test_fuzz.py: the column check read the first line alone, a RecursionError
             (_jsonl(tmp_path / "deep.jsonl", [b'{"prompt": ' + b"[" * 100_000 + b"]" * 100_000 + b"}\n"]),
              "line 1 (row 0): JSON nested too deeply to read"),
             (_jsonl(tmp_path / "keyless.jsonl", [{}]), "no column(s) question; it has none")]
    for url, says in cases:
        with pytest.raises(UserError) as e:
            prompts.check_dataset(url, Columns("question" if "column" in says else "prompt"))
        assert str(e.value).startswith(f"{url}: {says}") and "\n" not in str(e.value), str(e.value)


def test_validation_imports_neither_torch_nor_transformers(tmp_path):
    url = _jsonl(tmp_path / "p.jsonl", [GOOD])
    code = ("import sys; from llamarl.stages import prompts; prompts.check_dataset(sys.argv[1], prompts.Columns('prompt', "
            "'id', ('answer',))); print(prompts.row_index(prompts.open_dataset(sys.argv[1])).n_rows, 'torch' in sys.modules, 'transformers' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code, url], capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["1", "False", "False"]


# ---- the rollout stage reading them ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def actor(tmp_path_factory, pool1):
    root = tmp_path_factory.mktemp("actor")
    toy.make_llama(str(root / "hf"))
    pool1.run(shard.run, ShardConfig(src=str(root / "hf"), dst=str(root / "ckpt")))
    return str(root / "ckpt")


def _stage(cfg: dict) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")}  # one process, started by hand
    return subprocess.run([sys.executable, "-m", "llamarl.stages.rollout", "--config-json", json.dumps(cfg)],
                          capture_output=True, text=True, timeout=300, env=env)


def _rows(out) -> list[dict]:
    return [r for p in sorted(os.listdir(out / "parts")) if p.endswith(".parquet")
            for r in pq.read_table(out / "parts" / p).to_pylist()]


@pytest.mark.slow
def test_a_rollout_with_a_selection_publishes_exactly_the_selected_rows(actor, tmp_path):
    n = 30
    url = _jsonl(tmp_path / "p.jsonl", [{"prompt": f"say {i}", "answer": i if i % 7 else None} for i in range(n)])
    cache = str(tmp_path / "cache")
    base = {"actor": actor, "prompts": url, "index_cache": cache, "keep_columns": ["answer"], "chunk_size": 4,
            "sampling": {"samples_per_prompt": 2, "max_new_tokens": 4, "seed": 3}}
    for k, start in enumerate([0, 24]):  # the second crosses into epoch 1
        select = {"seed": 11, "start": start, "count": 12}
        out = tmp_path / f"iter{k}"
        r = _stage(base | {"out": str(out), "select": select})
        assert r.returncode == 0, r.stderr[-3000:]
        chosen = prompts.selected_rows(n, PromptSelection(**select)).tolist()
        rows = _rows(out)
        assert [(row["prompt_id"], row["sample_index"]) for row in rows] == [(str(c), s) for c in chosen for s in (0, 1)]
        assert [row["prompt"] for row in rows[::2]] == [f"say {c}" for c in chosen]
        assert [row["answer"] for row in rows[::2]] == [c if c % 7 else None for c in chosen]
        schemas = {pq.read_schema(out / "parts" / p).field("answer").type for p in os.listdir(out / "parts")}
        assert schemas == {pa.int64()}  # one type in every part, also one whose answers are all null
        manifest = publish.require_published(str(out), "rollout")
        record = manifest["selection"]
        assert (record["seed"], record["start"], record["count"], record["dataset_rows"]) == (11, start, 12, n)
        assert record["rows"] == len(chosen) and record["dropped_repeats"] == 12 - len(chosen)
        assert record["index"] == ("built" if k == 0 else "cached") and manifest["request"]["config"]["select"] == select | {"shuffle": True}
        assert manifest["rows"] == 2 * len(chosen) and json.loads(pq.read_schema(out / "parts" / "part-000000.parquet")
                                                                  .metadata[b"sampling"])["seed"] == 3
    assert record["epochs"] == [{"epoch": 0, "from": 24, "to": 30}, {"epoch": 1, "from": 0, "to": 6}]
    # A row's responses are keyed by its row number: the same in a full rollout.
    full = tmp_path / "full"
    assert _stage({k: v for k, v in base.items() if k != "index_cache"} | {"out": str(full)}).returncode == 0
    by_id = {(row["prompt_id"], row["sample_index"]): row["response_token_ids"] for row in _rows(full)}
    assert all(by_id[(row["prompt_id"], row["sample_index"])] == row["response_token_ids"] for row in _rows(out))


@pytest.mark.slow
def test_a_bad_row_fails_the_rollout_in_one_line_before_anything_is_written(actor, tmp_path):
    lines = [{"prompt": f"say {i}", "id": f"p{i}"} for i in range(9)] + [{"prompt": None, "id": "p9"}]
    url = _jsonl(tmp_path / "p.jsonl", lines)
    cases = {"row": ({"prompts": url, "id_column": "id"}, f"error: {url}: line 10 (row 9): 'prompt' is null"),
             "shadow": ({"prompts": url, "keep_columns": ["response"]}, "keep_columns=['response']: 'response' is a column "
                                                                         "the rollout writes itself"),
             # Rows 4 and 6 taken: the bad row 9 is found by the whole dataset's check, at the first iteration.
             "selected": ({"prompts": url, "id_column": "id", "select": {"start": 0, "count": 2}, "index_cache": str(tmp_path / "c")},
                          f"error: {url}: line 10 (row 9): 'prompt' is null")}
    assert prompts.selected_rows(10, PromptSelection(start=0, count=2)).tolist() == [4, 6]
    for name, (cfg, says) in cases.items():
        out = tmp_path / name
        r = _stage({"actor": actor, "out": str(out), "chunk_size": 2, "sampling": {"max_new_tokens": 4}} | cfg)
        lines_out = r.stderr.strip().splitlines()
        assert r.returncode == 2 and len(lines_out) == 1 and says in lines_out[0], f"{name}: {r.stderr[-3000:]}"
        assert not list(out.glob("parts/*.parquet")) and publish.read_manifest(str(out)) is None


@pytest.mark.slow
def test_a_prompt_the_chat_template_refuses_is_one_line_naming_its_row(tmp_path, pool1):
    strict = ("{% for m in messages %}{% if m['role'] not in ['user', 'system', 'assistant'] %}"
              "{{ raise_exception('unknown role ' + m['role']) }}{% endif %}<|{{ m['role'] }}|>{{ m['content'] }}\n"
              "{% endfor %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
    toy.make_llama(str(tmp_path / "hf"))
    toy.make_tokenizer(str(tmp_path / "hf"), chat_template=strict)
    pool1.run(shard.run, ShardConfig(src=str(tmp_path / "hf"), dst=str(tmp_path / "ckpt")))
    url = _jsonl(tmp_path / "p.jsonl", [{"prompt": [{"role": "user", "content": "hi"}]},
                                        {"prompt": [{"role": "usr", "content": "hi"}]}])
    r = _stage({"actor": str(tmp_path / "ckpt"), "prompts": url, "out": str(tmp_path / "out"), "sampling": {"max_new_tokens": 4}})
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        f"error: {url}: line 2 (row 1): the tokenizer's chat template refuses these messages (unknown role usr); give "
        "it messages it takes (their roles, their order)"], r.stderr[-3000:]
    assert publish.read_manifest(str(tmp_path / "out")) is None


def test_a_rollout_config_refuses_kept_columns_that_shadow_its_own(tmp_path):
    base = {"actor": "a", "prompts": "p", "out": "o"}
    for keep, says in ((["response"], "'response' is a column the rollout writes itself"),
                       (["prompt_id", "x"], "'prompt_id' is a column the rollout writes itself"),
                       (["x", "x"], "'x' is given twice; keep each column once")):
        with pytest.raises(UserError, match=rf"^opts.yaml: keep_columns={keep!r}: {says}".replace("[", r"\[")):
            RolloutConfig.parse(base | {"keep_columns": keep}, "opts.yaml")
    from llamarl.pipeline.dag import parse_spec

    spec = {"name": "t", "storage": str(tmp_path), "actor": str(tmp_path / "a"), "prompts": str(tmp_path / "p.jsonl"),
            "rollout": {"keep_columns": ["response"]}, "score": {"rewards": [{"name": "length"}]}}
    with pytest.raises(UserError, match=r"^spec.yaml: rollout.keep_columns=\['response'\]: 'response' is a column"):
        parse_spec(spec, "spec.yaml")
