"""DCP's files: the one writer (lib/files/dcp_format.py) and the one reader of their layout (lib/files/dcp_index.py), against torch's own.

- items are ``torch.save``'s archives, and the parser finds the tensor in any of them;
- a checkpoint written again from the same tensors is the same bytes, ``.metadata`` too;
- its items' CRC-32 is 0, on every writer thread;
- a failure on one rank raises on every rank as its kind (a user error, a full disk, a bug);
- a checkpoint written before the writer moved onto torch (tests/data/ckpt-db68fda) still loads
  and exports bit for bit;
- whole tensors (what export reads) come back from chunks of our writer and of DCP's;
- ``.metadata`` is read into the same index as DCP's own classes give, without importing DCP, and
  through DCP where it holds anything else.
"""

from __future__ import annotations

import errno
import fractions
import io
import os
import pickle
import shutil
import subprocess
import sys
import threading

import pytest
import torch
from safetensors.torch import load_file

from llamarl.lib.files import checkpoint, dcp_format, dcp_index, publish, ranges
from llamarl.lib.errors import UserError
from llamarl.stages import export
from llamarl.stages.config import ExportConfig


def dcp_metadata(url: str):
    """The checkpoint's ``.metadata`` as DCP's own reader gives it (DCP's classes)."""
    from torch.distributed.checkpoint import FileSystemReader

    return FileSystemReader(url).read_metadata()


OLD = os.path.join(os.path.dirname(__file__), "data", "ckpt-db68fda")


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool, torch.int8])
@pytest.mark.parametrize("shape", [(5, 3), (), (0,), (2, 3, 4)])
def test_the_parser_finds_the_tensor_of_any_torch_save_archive(dtype, shape):
    t = (torch.randn(shape) * 50).to(dtype)
    for saved in (t, t.t() if t.dim() == 2 else t):  # a transposed (strided) tensor too
        buf = io.BytesIO()
        torch.save(saved, buf)
        raw = buf.getvalue()
        stored = dcp_index.parse_item(ranges.MemoryFile(memoryview(raw)), start=0)
        assert stored is not None and stored.dtype == dtype and stored.size == tuple(saved.shape)
        assert stored.begin % 64 == 0  # torch aligns its records
        span = sum((n - 1) * s for n, s in zip(stored.size, stored.stride)) + 1 if saved.numel() else 0
        data = torch.frombuffer(bytearray(raw), dtype=torch.uint8)[stored.begin : stored.begin + span * dtype.itemsize]
        assert torch.equal(data.view(dtype).as_strided(stored.size, stored.stride), saved)
    assert dcp_index.parse_item(ranges.MemoryFile(memoryview(b"not a zip at all")), start=0) is None


def test_a_checkpoint_written_again_is_the_same_bytes(tmp_path):
    g = torch.Generator().manual_seed(0)
    big = torch.randn(64, 40, generator=g)
    state = {"w": torch.randn(40, 8, generator=g).to(torch.bfloat16), "b": torch.arange(7),
             "rows": checkpoint.Chunks((64, 40), {(0, 0): big[:30], (30, 0): big[30:]})}  # views of one storage
    checkpoint.save(state, str(tmp_path / "a"), threads=2)
    first = {f: (tmp_path / "a" / f).read_bytes() for f in os.listdir(tmp_path / "a")}
    shutil.rmtree(tmp_path / "a")
    checkpoint.save(state, str(tmp_path / "a"), threads=2)  # a rerun, after a kill that lost it all
    again = {f: (tmp_path / "a" / f).read_bytes() for f in os.listdir(tmp_path / "a")}
    assert ".metadata" in first and first == again  # .metadata too: its save id is the items' digest
    # An item holds its chunk alone, not the whole storage the chunk is a view of.
    assert sum(len(v) for k, v in first.items() if k != ".metadata") < 2 * (64 * 40 * 4 + 40 * 8 * 2 + 7 * 8)
    out = {"w": torch.zeros(40, 8, dtype=torch.bfloat16), "b": torch.zeros(7, dtype=torch.int64),
           "rows": torch.zeros(64, 40)}
    checkpoint.load(out, str(tmp_path / "a"))
    assert torch.equal(out["w"], state["w"]) and torch.equal(out["b"], state["b"]) and torch.equal(out["rows"], big)


def test_items_leave_their_crc_32_at_0_on_every_writer_thread(tmp_path):
    # torch 2.13 keeps set_crc32_options per thread: each writer thread turns it off for itself
    # (computing CRC-32 is the slowest part of a write), and the caller's is left as it was.
    import zipfile

    state = {f"t{i}": torch.randn(64, 32 + i) for i in range(6)}
    assert torch.serialization.get_crc32_options()
    checkpoint.save(state, str(tmp_path / "a"), threads=3)
    assert torch.serialization.get_crc32_options()
    md = dcp_metadata(str(tmp_path / "a"))
    assert len({info.relative_path for info in md.storage_data.values()}) == 3
    for info in md.storage_data.values():
        with open(tmp_path / "a" / info.relative_path, "rb") as f:
            f.seek(info.offset)
            item = f.read(info.length)
        with zipfile.ZipFile(io.BytesIO(item)) as z:
            records = z.infolist()
            assert records and all(r.CRC == 0 for r in records), [(r.filename, r.CRC) for r in records]
    out = {n: torch.zeros_like(t) for n, t in state.items()}
    checkpoint.load(out, str(tmp_path / "a"))
    assert all(torch.equal(out[n], state[n]) for n in state)


def item_crcs(url: str) -> dict[str, list[int]]:
    import zipfile

    md = dcp_metadata(url)
    out = {}
    for key, info in md.storage_data.items():
        with open(f"{url}/{info.relative_path}", "rb") as f:
            f.seek(info.offset)
            with zipfile.ZipFile(io.BytesIO(f.read(info.length))) as z:
                out[key.fqn] = [r.CRC for r in z.infolist()]
    return out


def test_crc_32_stays_off_until_the_last_writer_thread_ends_where_torch_keeps_it_per_process(tmp_path, monkeypatch):
    # torch 2.11 keeps set_crc32_options per process: a writer thread that ends must not turn it
    # back on while another still writes (that one's items would get a CRC: other bytes on a rerun).
    import time

    option = {"crc": True}
    monkeypatch.setattr(torch.serialization, "get_crc32_options", lambda: option["crc"])
    monkeypatch.setattr(torch.serialization, "set_crc32_options", lambda v: option.update(crc=v))
    big, small = torch.randn(64, 40), torch.randn(4, 4)

    small_started = threading.Event()

    def get_big():
        assert small_started.wait(10)
        return big

    def get_small():
        small_started.set()
        time.sleep(0.3)
        return small

    # File 0 (the big piece) ends once file 1's thread writes; file 1's piece comes after it ended.
    pieces = [dcp_format.Piece("big", (64, 40), (0, 0), (64, 40), torch.float32, get_big),
              dcp_format.Piece("small", (4, 4), (0, 0), (4, 4), torch.float32, get_small)]
    dcp_format.save(pieces, str(tmp_path / "a"), threads=2)
    assert option["crc"] is True  # as it was before
    crcs = item_crcs(str(tmp_path / "a"))
    assert set(crcs) == {"big", "small"} and all(c == 0 for cs in crcs.values() for c in cs), crcs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_a_state_saved_from_the_gpu_by_8_threads_is_the_same_bytes_again_with_crc_0(tmp_path):
    # With the machine's own torch (2.11 keeps the CRC option per process), through the writer's
    # pinned copies: the bytes of a training state do not depend on which writer thread ends first.
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {f"t{i}": torch.randn(1 << (14 + i % 5), device="cuda", generator=g) for i in range(24)}
    written = []
    for name in ("a", "b"):
        checkpoint.save(state, str(tmp_path / name), threads=8)
        written.append({f: (tmp_path / name / f).read_bytes() for f in os.listdir(tmp_path / name) if f != ".metadata"})
    assert written[0] == written[1]
    crcs = item_crcs(str(tmp_path / "a"))
    assert len(crcs) == len(state) and all(c == 0 for cs in crcs.values() for c in cs), crcs


def save_failing_on_rank_1(url: str, failure: str) -> str:
    rank = torch.distributed.get_rank()

    def get():
        if rank == 1 and failure == "user":
            raise UserError("src/model.safetensors: short read; the file changed while being read")
        if rank == 1 and failure == "disk":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), f"{url}/__1_0.distcp")
        if rank == 1:
            raise KeyError("a bug")
        return torch.ones(2)

    piece = dcp_format.Piece("t", (4,), (2 * rank,), (2,), torch.float32, get)
    try:
        dcp_format.save([piece], url)
    except Exception as e:  # noqa: BLE001 — what each rank raised, by kind
        return f"{type(e).__name__} {getattr(e, 'errno', None)} {e}"
    return "saved"


@pytest.mark.parametrize("failure", ["user", "disk", "bug"])
def test_a_failure_on_one_rank_raises_its_kind_on_every_rank(pool2, tmp_path, failure):
    url = str(tmp_path / f"m-{failure}")
    got = pool2.run(save_failing_on_rank_1, url, failure)
    assert got[0] == got[1], got  # the same on both ranks
    kind = {"user": "UserError None src/model.safetensors: short read",
            "disk": f"OSError {errno.ENOSPC} [Errno {errno.ENOSPC}] saving the checkpoint {url} failed: rank 1: "
                    "No space left on device",
            "bug": f"RuntimeError None saving the checkpoint {url} failed: rank 1: KeyError"}[failure]
    assert got[0].startswith(kind), got[0]
    assert not os.path.exists(f"{url}/.metadata")


def test_a_checkpoint_written_before_the_one_runtime_loads_and_exports(pool2, tmp_path):
    # Written at db68fda (TP 2, bf16, one kv head replicated over TP) by the torch-free writer,
    # whose .metadata pickled stand-ins under DCP's class names. Its source is beside it.
    ckpt = str(tmp_path / "ckpt")
    shutil.copytree(os.path.join(OLD, "checkpoint"), ckpt)
    source = load_file(os.path.join(OLD, "hf-source", "model.safetensors"))
    index = checkpoint.read_index(f"{ckpt}/model")
    whole = {n: torch.zeros(index[n].size, dtype=torch.bfloat16) for n in source}
    checkpoint.load(whole, f"{ckpt}/model")
    assert all(torch.equal(whole[n], source[n]) for n in source)
    pool2.run(export.run, ExportConfig(src=ckpt, dst=str(tmp_path / "out")))
    out = load_file(str(tmp_path / "out" / "model.safetensors"))
    assert out.keys() == source.keys() and all(torch.equal(out[n], source[n]) for n in source)
    assert publish.read_manifest(str(tmp_path / "out"))["kind"] == "hf_export"


def _whole(got) -> torch.Tensor:
    """``export._tensor``'s answer as one tensor: it may be the tensor's rows in pieces."""
    return torch.cat([t for _, t in got]) if isinstance(got, list) else got


@pytest.mark.parametrize("direct", [False, True], ids=["ranges", "rows-read-in-place"])
def test_whole_tensors_read_from_chunks_of_either_writer(tmp_path, monkeypatch, direct):
    # What export reads: whole tensors from chunks split by rows (their items mapped and written
    # as they are: export's pieces) or by columns (copied), written by lib/ or by DCP's own writer
    # (strided items included); and, read into one tensor, rows read straight into place when
    # their items are large (every item here, with direct).
    import torch.distributed.checkpoint as dcp

    flat, mapped = [], []
    real_mapped = checkpoint.mapped

    def spy(url, index, name):
        t = real_mapped(url, index, name)
        if t is not None:
            mapped.append((os.path.basename(url), name))
        return t

    monkeypatch.setattr(checkpoint, "mapped", spy)
    if direct:
        monkeypatch.setattr(checkpoint, "_DIRECT_BYTES", 1)
        monkeypatch.setattr(checkpoint, "_EDGE_BYTES", 4096)  # torch's zip reader looks for the end in 4 KiB
        real = checkpoint._flat_span
        monkeypatch.setattr(checkpoint, "_flat_span", lambda r, st: flat.append(real(r, st)) or flat[-1])
    g = torch.Generator().manual_seed(3)
    full = {"rows": torch.randn(96, 40, generator=g).to(torch.bfloat16), "cols": torch.randn(24, 50, generator=g),
            "vec": torch.randn(3000, generator=g).to(torch.float16)}
    ours = str(tmp_path / "ours")
    checkpoint.save({"rows": checkpoint.Chunks((96, 40), {(0, 0): full["rows"][:32], (32, 0): full["rows"][32:]}),
                     "cols": checkpoint.Chunks((24, 50), {(0, 0): full["cols"][:, :20], (0, 20): full["cols"][:, 20:]}),
                     "vec": full["vec"]}, ours, threads=2)
    theirs = str(tmp_path / "theirs")
    dcp.save({"rows": full["rows"], "cols": full["cols"].t().contiguous().t(), "vec": full["vec"]},
             storage_writer=dcp.FileSystemWriter(theirs, thread_count=2))
    pieces = []
    for url in (ours, theirs):
        index = checkpoint.read_index(url)
        for name, t in full.items():
            got = export._tensor(url, index, name, t.dtype)
            if isinstance(got, list):
                pieces.append((os.path.basename(url), name, [first for first, _ in got]))
            assert _whole(got).dtype == t.dtype and torch.equal(_whole(got), t), (url, name)
        assert torch.equal(_whole(export._tensor(url, index, "rows", torch.float32)), full["rows"].float())
    # A tensor stored whole in one plain item is its file's pages, mapped: vec (of both), rows
    # (DCP's one chunk); not DCP's strided item of cols. Our rows' two chunks are mapped as its
    # rows (converted to another dtype, they are read); the columns of ours are read.
    assert sorted(set(mapped)) == [("ours", "vec"), ("theirs", "rows"), ("theirs", "vec")], mapped
    assert pieces == [("ours", "rows", [0, 32])], pieces
    rows = torch.empty(96, 40, dtype=torch.bfloat16)
    flat.clear()
    checkpoint.read({"rows": rows}, ours)
    assert torch.equal(rows, full["rows"]) and len([f for f in flat if f is not None]) == (2 if direct else 0)


def test_a_tensor_of_no_elements_reads_as_one(tmp_path):
    url = str(tmp_path / "c")
    checkpoint.save({"empty": torch.zeros(0, 4), "w": torch.ones(2, 4)}, url, threads=1)
    index = checkpoint.read_index(url)
    assert checkpoint.mapped(url, index, "empty") is None  # nothing to map: read
    assert _whole(export._tensor(url, index, "empty", torch.float32)).shape == (0, 4)
    assert torch.equal(_whole(export._tensor(url, index, "w", torch.float32)), torch.ones(2, 4))


def test_weights_read_into_targets_of_another_dtype_are_converted_exactly(tmp_path):
    # fp32 masters from bf16 weights: rows of bytes into the stored dtype, then converted; a
    # region of columns and a stored item strided in its last dimension (DCP's writer) too.
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(5)
    w, cols = torch.randn(64, 48, generator=g).to(torch.bfloat16), torch.randn(20, 30, generator=g).to(torch.bfloat16)
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    checkpoint.save({"w": checkpoint.Chunks((64, 48), {(0, 0): w[:40], (40, 0): w[40:]}), "cols": cols}, ours, threads=2)
    dcp.save({"w": w, "cols": cols.t().contiguous().t()}, storage_writer=dcp.FileSystemWriter(theirs, thread_count=2))
    for url in (ours, theirs):
        got = {"w": torch.zeros(64, 48), "cols": checkpoint.Chunks((20, 30), {(0, 10): torch.zeros(20, 15)})}
        checkpoint.load(got, url)
        assert torch.equal(got["w"], w.float()), url
        assert torch.equal(got["cols"].pieces[(0, 10)], cols[:, 10:25].float()), url


def _three_writers(tmp_path) -> list[str]:
    """Checkpoints of our writer (chunks split by rows), DCP's own (a non-tensor entry too) and the
    torch-free writer's (tests/data/ckpt-db68fda)."""
    import torch.distributed.checkpoint as dcp

    w = torch.randn(12, 10).to(torch.bfloat16)
    ours, theirs = str(tmp_path / "ours"), str(tmp_path / "theirs")
    checkpoint.save({"w": checkpoint.Chunks((12, 10), {(0, 0): w[:4], (4, 0): w[4:]}), "v": torch.ones(3)}, ours,
                    threads=2)
    dcp.save({"w": w, "v": torch.ones(3, dtype=torch.int64), "step": 7},
             storage_writer=dcp.FileSystemWriter(theirs, thread_count=2))
    return [ours, theirs, os.path.join(OLD, "checkpoint", "model")]


def test_the_index_reads_metadata_as_dcp_does_without_importing_it(tmp_path):
    urls = _three_writers(tmp_path)
    for url in urls:
        index = dcp_index.read_index(url)
        assert index == dcp_index._index(dcp_metadata(url)), url
        assert index and all(isinstance(s.dtype, torch.dtype) and s.chunks for s in index.values())
    assert [len(c.chunks) for c in (dcp_index.read_index(urls[0])["w"], dcp_index.read_index(urls[1])["w"])] == [2, 1]
    assert "step" not in dcp_index.read_index(urls[1])  # not a tensor
    # DCP's import costs half a second of a stage's start-up: reading the index does not pay it.
    code = ("import sys; from llamarl.lib.files import dcp_index; "
            f"[dcp_index.read_index(u) for u in {urls!r}]; print(sorted(m for m in sys.modules "
            "if m.startswith('torch.distributed.checkpoint') or m.startswith('torch.distributed.tensor')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "[]", out


def test_a_metadata_holding_other_classes_is_read_through_dcp(tmp_path):
    # Another torch's .metadata may pickle classes the records do not know: DCP's own unpickler
    # reads it (here: a Fraction in the planner's data), and the index is the same.
    url = _three_writers(tmp_path)[0]
    md = dcp_metadata(url)
    md.planner_data = {"extra": fractions.Fraction(1, 3)}
    (tmp_path / "ours" / ".metadata").write_bytes(pickle.dumps(md))
    with pytest.raises(pickle.UnpicklingError, match="fractions.Fraction"):
        dcp_index._Records(io.BytesIO(pickle.dumps(md))).load()
    assert dcp_index.read_index(url) == dcp_index._index(md)
