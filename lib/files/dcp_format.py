"""torch.distributed.checkpoint's (DCP) files and ``.metadata``: the one writer. The format, and
why its items and ``.metadata`` are written as they are: docs/formats.md "Sharded checkpoint";
where their tensors lie: lib/files/dcp_index.py.

Ours rather than ``torch.distributed.checkpoint.save`` for what DCP does not do: a chunk held by
several ranks (no DTensor says "rows 128:192 of k_proj, also on rank 3") is written once
(``assign``); every file is hashed as written (``publish.open_write``); a chunk's bytes are fetched
when it is written (``Piece.get``, on a writer thread: shard never holds its whole share); the save
id is the items' digest, so a rerun writes the same bytes. Items' CRC-32 is left 0
(``_Crc32Off``): computing it is the slowest part of a write, and the files are hashed anyway.
"""

from __future__ import annotations

import collections
import functools
import hashlib
import importlib
import math
import pickle
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import fsspec
import torch
from llamarl.lib.distributed import collectives
from llamarl.lib.files import publish

METADATA = ".metadata"


# ---- writing: every rank its chunks, rank 0 the metadata -----------------------------------------


@dataclass
class Piece:
    """A chunk of a tensor that this rank holds: where it sits, and how to get it (called when the
    chunk is written, on a writer thread)."""

    fqn: str
    size: tuple[int, ...]  # the whole tensor's
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: torch.dtype
    get: Callable[[], torch.Tensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * self.dtype.itemsize


def assign(plans: list[list[tuple]]) -> list[set]:
    """Which rank writes each chunk ``(fqn, offsets, shape, nbytes)`` of ``plans`` (one list per
    rank): its only holder, or of several holders (replicated kv heads, DP copies) the one with the
    fewest bytes so far. The same answer on every rank."""
    holders: dict[tuple, list[int]] = collections.defaultdict(list)
    size: dict[tuple, int] = {}
    for r, plan in enumerate(plans):
        for fqn, off, _shape, nbytes in plan:
            holders[(fqn, tuple(off))].append(r)
            size[(fqn, tuple(off))] = nbytes
    load = [0] * len(plans)
    mine: list[set] = [set() for _ in plans]
    for key, rs in holders.items():
        if len(rs) == 1:
            mine[rs[0]].add(key)
            load[rs[0]] += size[key]
    for key in sorted((k for k, rs in holders.items() if len(rs) > 1), key=lambda k: (-size[k], k)):
        r = min(holders[key], key=lambda r: (load[r], r))
        mine[r].add(key)
        load[r] += size[key]
    return mine


class _Sink:
    """The stream ``torch.save`` writes an item to. torch's archive writer turns an error of
    ``write`` into a RuntimeError of its own ("unexpected pos …"), losing the errno: a full disk
    would read as a bug. The first ``OSError`` is kept, to be raised instead."""

    def __init__(self, f):
        self.f, self.error = f, None

    def write(self, data) -> int:
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = self.error or e
            raise

    def flush(self) -> None:
        self.f.flush()


def _write_item(f, t: torch.Tensor) -> None:
    """``t`` as the archive ``torch.save`` writes, its storage exactly its elements (``torch.save``
    writes a view's whole storage)."""
    t = t.detach()
    if t.device.type != "cpu":  # copied out through pinned memory, on this writer thread
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=torch.cuda.is_available())
        host.copy_(t, non_blocking=True)
        torch.cuda.current_stream(t.device).synchronize()
        t = host
    if not t.is_contiguous() or t.storage_offset() or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        t = t.clone(memory_format=torch.contiguous_format)
    sink = _Sink(f)
    try:
        torch.save(t, sink)
    except RuntimeError:
        if sink.error is not None:
            raise sink.error from None
        raise


class _Crc32Off:
    """``torch.save``'s CRC-32 off while any writer thread writes. Some torch releases keep
    ``set_crc32_options`` per thread (2.13), others per process (2.11): each writer thread turns it
    off, and the value found before the first one is put back when the last one ends, never while
    another still writes (its items would get a CRC, and a rerun other bytes)."""

    _lock = threading.Lock()
    _writers = 0
    _before = True

    def __enter__(self) -> None:
        with _Crc32Off._lock:
            if _Crc32Off._writers == 0:
                _Crc32Off._before = torch.serialization.get_crc32_options()
            torch.serialization.set_crc32_options(False)  # where torch keeps it per thread: this one's
            _Crc32Off._writers += 1  # counted once it is off: a failed call above leaves nothing to undo

    def __exit__(self, *exc) -> None:
        with _Crc32Off._lock:
            _Crc32Off._writers -= 1
            if _Crc32Off._writers == 0:
                torch.serialization.set_crc32_options(_Crc32Off._before)


def _write_file(url: str, pieces: list[Piece]) -> list[tuple]:
    """One ``.distcp`` file: each piece an item, back to back, hashed as written. Returns
    ``(fqn, offsets, shape, file, begin, length)`` per piece."""
    name = url.rsplit("/", 1)[1]
    out = []
    with _Crc32Off(), publish.open_write(url) as f:
        for p in pieces:
            begin = f.tell()
            t = p.get()
            if tuple(t.shape) != tuple(p.shape) or t.dtype != p.dtype:
                raise ValueError(f"{p.fqn} at {list(p.offsets)}: got {t.dtype} {list(t.shape)}, planned "
                                 f"{p.dtype} {list(p.shape)}")
            _write_item(f, t)
            out.append((p.fqn, p.offsets, p.shape, name, begin, f.tell() - begin))
    return out


def _check_tiling(url: str, tensors: dict[str, tuple], chunks: dict[str, list]) -> None:
    """Each tensor's chunks cover it exactly once (what DCP's global plan validation checks)."""
    for fqn, (size, _dtype) in tensors.items():
        cs = chunks[fqn]
        vol = sum(math.prod(sz) for _, sz in cs)
        overlap = any(all(a0 < b0 + bs and b0 < a0 + as_ for a0, as_, b0, bs in zip(ao, asz, bo, bsz))
                      for i, (ao, asz) in enumerate(cs) for bo, bsz in cs[i + 1 :])
        if vol != math.prod(size) or overlap:
            raise ValueError(f"{url}: the chunks of {fqn} do not tile its {list(size)} exactly "
                             f"({len(cs)} chunks, {vol} elements{', overlapping' if overlap else ''})")


def _metadata(url: str, tensors: dict[str, tuple], written: list[tuple]) -> bytes:
    """``.metadata``: DCP's ``Metadata`` of the written items, pickled as DCP pickles it. Its save
    id is the items' digest (DCP draws a random one): a rerun writes the same bytes."""
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION, _StorageInfo
    from torch.distributed.checkpoint.metadata import (ChunkStorageMetadata, Metadata, MetadataIndex, StorageMeta,
                                                       TensorProperties, TensorStorageMetadata)

    chunks: dict[str, list] = collections.defaultdict(list)
    for fqn, off, shape, *_ in written:
        chunks[fqn].append((tuple(off), tuple(shape)))
    _check_tiling(url, tensors, chunks)
    state_md, storage, index = {}, {}, {}
    for fqn in sorted(tensors):
        size, dtype = tensors[fqn]
        cs = sorted(chunks[fqn])
        index.update({(fqn, off): i for i, (off, _) in enumerate(cs)})
        state_md[fqn] = TensorStorageMetadata(TensorProperties(dtype=dtype), torch.Size(size),
                                              [ChunkStorageMetadata(torch.Size(o), torch.Size(sz)) for o, sz in cs])
    for fqn, off, _shape, name, begin, length in sorted(written):
        key = MetadataIndex(fqn, torch.Size(off), index[(fqn, tuple(off))])
        storage[key] = _StorageInfo(relative_path=name, offset=begin, length=length)
    save_id = hashlib.sha256(repr(sorted(written)).encode()).hexdigest()[:32]
    md = Metadata(state_md, planner_data={fqn: (fqn,) for fqn in state_md}, storage_data=storage,
                  storage_meta=StorageMeta(checkpoint_id=url, save_id=save_id), version=CURRENT_DCP_VERSION)
    return pickle.dumps(md)


def _write_metadata(url: str, data: bytes) -> None:
    """``.metadata`` to a temporary name, then moved: a checkpoint has one only once it is whole."""
    fs, path = fsspec.core.url_to_fs(url)
    tmp = f"{path}/{METADATA}.tmp"
    with publish.open_write(fs.unstrip_protocol(tmp)) as f:
        f.write(data)
    fs.mv(tmp, f"{path}/{METADATA}")
    publish.moved(fs, tmp, f"{path}/{METADATA}")


def _buckets(pieces: list[Piece], n: int) -> list[list[Piece]]:
    """Largest first, each to the lightest of ``n`` files (DCP's split)."""
    buckets: list[list[Piece]] = [[] for _ in range(max(1, n))]
    sizes = [0] * len(buckets)
    for p in sorted(pieces, key=lambda p: -p.nbytes):
        i = sizes.index(min(sizes))
        buckets[i].append(p)
        sizes[i] += p.nbytes
    return [b for b in buckets if b]


@functools.cache  # once a process
def start_metadata_import() -> None:
    """Import DCP's classes for ``.metadata`` on a thread. The import takes about half a second
    (DTensor, sympy): a stage that writes ``.metadata`` (its rank 0) or reads it starts it as early
    as it can, so that it runs beside the stage's start-up, waits and writes rather than before
    ``.metadata``."""
    threading.Thread(target=importlib.import_module, args=("torch.distributed.checkpoint.filesystem",),
                     name="llamarl-dcp-import", daemon=True).start()  # what ``_metadata`` imports


def save(pieces: list[Piece], url: str, threads: int = 4) -> None:
    """Collective over the stage's processes: every rank passes the pieces it holds; a piece held by
    several ranks is written once. Each rank writes its pieces into up to ``threads`` files at once;
    rank 0 writes ``.metadata`` last. A failure on any rank raises on every rank (``raise_first``)
    and leaves no ``.metadata``."""
    url = url.rstrip("/")
    rank, _world = collectives.rank_world()
    if rank == 0:
        start_metadata_import()
    plan = [(p.fqn, p.offsets, p.shape, p.nbytes) for p in pieces]
    tensors = {p.fqn: (tuple(p.size), p.dtype) for p in pieces}
    plans = collectives.all_gather_object((plan, tensors))
    mine = assign([p for p, _ in plans])[rank]
    buckets = _buckets([p for p in pieces if (p.fqn, tuple(p.offsets)) in mine], threads)
    failure, written = None, []
    try:
        fs, path = fsspec.core.url_to_fs(url)
        fs.makedirs(path, exist_ok=True)
        with ThreadPoolExecutor(max(1, len(buckets))) as pool:
            for part in pool.map(_write_file, [f"{url}/__{rank}_{i}.distcp" for i in range(len(buckets))], buckets):
                written += part
    except Exception as e:  # raised on every rank below
        failure = e
    results = collectives.all_gather_object((collectives.describe(failure, rank), written))
    first = next((f for f, _ in results if f is not None), None)
    if rank == 0 and first is None:
        try:
            _write_metadata(url, _metadata(url, _all_tensors(plans), [w for _, ws in results for w in ws]))
        except Exception as e:
            first = collectives.describe(e, 0)
    collectives.raise_first(f"saving the checkpoint {url}", [collectives.broadcast_object(first)])


def _all_tensors(plans: list[tuple]) -> dict[str, tuple]:
    """Every tensor's size and dtype, from every rank's plan; ranks that disagree are a bug."""
    out: dict = {}
    for _, tensors in plans:
        for fqn, v in tensors.items():
            if out.setdefault(fqn, v) != v:
                raise ValueError(f"{fqn} is {v} on one rank and {out[fqn]} on another")
    return out
