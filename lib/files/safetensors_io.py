"""Sliced reads of safetensors files at any fsspec URL, and a checked writer.

``safetensors.safe_open`` needs a local path (it mmaps). A rank that owns a slice of a tensor on
S3 or NFS should fetch only those bytes: the format is an 8-byte header length, a JSON header
with each tensor's dtype, shape and byte range, then raw little-endian data — so a row range of a
tensor is one range read, and a column range is read in bounded row blocks.

Reads go straight into the memory of the torch tensor they return, writes straight out of it.
"""

from __future__ import annotations

import json
import math
import os
import struct
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

import fsspec
import torch

from llamarl.lib import dtypes
from llamarl.lib.files import publish
from llamarl.lib.files.checksums import is_local
from llamarl.lib.files.ranges import ShortRead, empty, mapped, read_into
from llamarl.lib.dtypes import SAFETENSORS_CODES as CODES  # a header's "BF16" → torch's "bfloat16"
from llamarl.lib.errors import UserError

# Column slices are read this many source bytes at a time, bounding the extra memory per rank.
_BLOCK_BYTES = 16 << 20


class SafetensorsError(UserError, ValueError):
    """A safetensors file that cannot be read as expected; the message names the file."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: str  # torch's name: "bfloat16"
    shape: tuple[int, ...]
    begin: int  # absolute byte offset in the file
    end: int


class SafetensorsFile:
    """One safetensors file; reads the header once, then any slice with range reads."""

    def __init__(self, url: str):
        self.url = url
        self.fs, self.path = fsspec.core.url_to_fs(url)
        try:
            head = self.fs.cat_file(self.path, 0, 8)
        except FileNotFoundError:
            raise SafetensorsError(f"{url}: file not found; check the checkpoint directory") from None
        if len(head) < 8:
            raise SafetensorsError(f"{url}: truncated (no header); re-copy the file")
        (n,) = struct.unpack("<Q", head)
        try:
            header = json.loads(self.fs.cat_file(self.path, 8, 8 + n))
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise SafetensorsError(f"{url}: header is not valid safetensors JSON; re-copy the file") from None
        self.metadata = header.pop("__metadata__", None) or {}
        size = self.fs.size(self.path)
        self.tensors: dict[str, TensorInfo] = {}
        for name, info in header.items():
            if info["dtype"] not in CODES:
                raise SafetensorsError(f"{url}: tensor {name} has unsupported dtype {info['dtype']}")
            begin, end = (8 + n + o for o in info["data_offsets"])
            if end > size:
                raise SafetensorsError(f"{url}: truncated ({size} bytes, tensor {name} ends at {end}); re-copy the file")
            self.tensors[name] = TensorInfo(CODES[info["dtype"]], tuple(info["shape"]), begin, end)

    def _read(self, begin: int, end: int, dtype: torch.dtype, shape) -> torch.Tensor:
        """Bytes ``begin:end`` as a tensor: a local file's page cache mapped (``mapped``), else read
        straight into its memory by a range read, which several threads may do at once (an fsspec
        file object is one position, and memory:// hands every opener the same one)."""
        try:
            if (view := mapped(self.fs, self.path, begin, end, dtype)) is not None:
                return view.view(shape)
            out = empty(shape, dtype)
            if end > begin:
                read_into(self.fs, self.path, begin, memoryview(out.view(-1).view(torch.uint8).numpy()))
        except ShortRead:
            raise SafetensorsError(f"{self.url}: short read; the file changed while being read") from None
        return out

    def read(self, name: str, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) ``start:stop`` of tensor ``name``."""
        info = self.tensors[name]
        shape = info.shape
        stop = shape[dim] if stop is None else stop
        dtype = dtypes.torch_dtype(info.dtype)
        if dim == 0:
            row = dtype.itemsize * math.prod(shape[1:])
            return self._read(info.begin + start * row, info.begin + stop * row, dtype, (stop - start, *shape[1:]))
        if dim != 1 or len(shape) != 2:
            raise ValueError(f"only row or column slices of 2-D tensors are supported ({name}, dim {dim})")
        rows, cols = shape
        row_bytes = cols * dtype.itemsize
        step = max(1, _BLOCK_BYTES // row_bytes)
        out = empty((rows, stop - start), dtype)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            block = self._read(info.begin + r0 * row_bytes, info.begin + r1 * row_bytes, dtype, (r1 - r0, cols))
            out[r0:r1] = block[:, start:stop]
        return out


class SafetensorsCheckpoint:
    """An HF checkpoint directory's weights: one ``model.safetensors`` or an index of shards."""

    def __init__(self, root: str):
        self.root = root.rstrip("/")
        fs, path = fsspec.core.url_to_fs(self.root)
        index = f"{path}/model.safetensors.index.json"
        if fs.exists(index):
            with fs.open(index, "r") as f:
                weight_map = json.load(f)["weight_map"]
            files = sorted(set(weight_map.values()))
        elif fs.exists(f"{path}/model.safetensors"):
            files, weight_map = ["model.safetensors"], None
        else:
            raise SafetensorsError(
                f"{root}: no model.safetensors or model.safetensors.index.json; "
                "point at an HF checkpoint directory saved with safetensors"
            )
        self.files = {name: SafetensorsFile(f"{self.root}/{name}") for name in files}
        self.where = {t: fname for fname, f in self.files.items() for t in f.tensors}
        if weight_map is not None:
            missing = sorted(t for t, fname in weight_map.items() if self.where.get(t) != fname)
            if missing:
                raise SafetensorsError(f"{root}: index lists {len(missing)} tensors not found in their files "
                                       f"(first: {missing[0]}); the checkpoint is incomplete")

    def info(self, name: str) -> TensorInfo:
        return self.files[self.where[name]].tensors[name]

    def read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return self.files[self.where[name]].read(name, dim, start, stop)


@dataclass(frozen=True)
class Deferred:
    """A tensor to write whose bytes are fetched when its turn comes (``get()``): a file's
    header needs only dtypes and shapes, so a writer need not hold the whole file in memory.
    ``get`` returns the tensor, or its rows in pieces that tile it in order: ``[(first row,
    tensor of those rows), …]`` (chunks of a checkpoint, written as they are stored)."""

    dtype: torch.dtype
    shape: tuple[int, ...]
    get: Callable[[], torch.Tensor | list[tuple[int, torch.Tensor]]]


def write_file(url: str, tensors: dict, metadata: dict[str, str] | None = None, threads: int = 1) -> dict:
    """Write a safetensors file at any fsspec URL; returns its manifest entry (``bytes`` and
    checksum). ``tensors``: CPU tensors, or ``Deferred``s (fetched when their turn comes, up to
    ``threads`` at once).

    On a local filesystem with ``threads`` > 1, ``threads`` threads each fetch a tensor and write
    it at its offset (the header fixes every offset up front), and the file is then hashed as a
    block tree (``publish.TREE``, several threads): one stream to a file writes at ~1.5 GB/s. Elsewhere
    (object stores write streams only) the tensors go out in order, hashed on the way.

    The layout is the safetensors library's: header JSON padded with spaces to 8 bytes, tensors
    ordered by element size (largest first, so each starts aligned), then name, with no gaps."""
    specs = {n: (t.dtype, tuple(t.shape), math.prod(t.shape) * t.dtype.itemsize) for n, t in tensors.items()}
    order = sorted(tensors, key=lambda n: (-specs[n][0].itemsize, n))
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset, offsets = 0, {}
    for name in order:
        dtype, shape, nbytes = specs[name]
        code = dtypes.TABLE[dtypes.name(dtype)][1]
        header[name] = {"dtype": code, "shape": list(shape), "data_offsets": [offset, offset + nbytes]}
        offsets[name] = offset
        offset += nbytes
    head = json.dumps(header, separators=(",", ":")).encode()
    head = struct.pack("<Q", len(head) + (-len(head) % 8)) + head + b" " * (-len(head) % 8)

    def fetch(name: str) -> list[tuple[int, memoryview]]:
        """The tensor's bytes as (offset in them, bytes) pieces, in order."""
        t = tensors[name].get() if isinstance(tensors[name], Deferred) else tensors[name]
        return [(at, memoryview(p.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy()))
                for at, p in _pieces(url, name, t, *specs[name])]

    fs, path = fsspec.core.url_to_fs(url)
    if threads > 1 and is_local(fs):
        return _write_local_parallel(fs, path, head, order, offsets, len(head) + offset, fetch, threads)
    with publish.open_write(url) as f, ThreadPoolExecutor(max(1, threads)) as pool:
        f.write(head)
        ahead: dict = {}
        for i, name in enumerate(order):
            for later in order[i : i + max(1, threads)]:  # fetched ahead of the one written
                if later not in ahead:
                    ahead[later] = pool.submit(fetch, later)
            for _, data in ahead.pop(name).result():
                if len(data):
                    f.write(data)
            data = None  # its memory goes before the next tensor's is fetched
    return f.entry()


def _pieces(url: str, name: str, t, dtype: torch.dtype, shape: tuple, nbytes: int) -> list[tuple[int, torch.Tensor]]:
    """``t`` (a tensor, or its rows in pieces) as (byte offset, tensor) pieces, checked against
    the planned dtype and shape: the pieces' rows follow each other and make up the whole."""
    if not isinstance(t, list):
        if (t.dtype, tuple(t.shape)) != (dtype, shape):
            raise ValueError(f"{url}: {name} came as {t.dtype} {list(t.shape)}, planned as {dtype} {list(shape)}")
        return [(0, t)]
    row_bytes, rows = (nbytes // shape[0] if shape and shape[0] else 0), 0
    for first, p in t:
        if p.dtype != dtype or not shape or tuple(p.shape[1:]) != shape[1:] or first != rows:
            raise ValueError(f"{url}: {name}'s rows from {first} came as {p.dtype} {list(p.shape)}, planned "
                             f"as rows from {rows} of {dtype} {list(shape)}")
        rows += p.shape[0]
    if rows != shape[0]:
        raise ValueError(f"{url}: {name} came as {rows} rows, planned as {shape[0]}")
    return [(first * row_bytes, p) for first, p in t]


def _write_local_parallel(fs, path: str, head: bytes, order: list[str], offsets: dict, size: int, fetch,
                          threads: int) -> dict:
    fs.makedirs(path.rsplit("/", 1)[0], exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    try:
        os.ftruncate(fd, size)
        publish.first_write_time = publish.first_write_time or time.time()
        _pwrite(fd, memoryview(head), 0)

        def put(name: str) -> None:
            for at, data in fetch(name):
                _pwrite(fd, data, len(head) + offsets[name] + at)

        with ThreadPoolExecutor(threads) as pool:
            for done in [pool.submit(put, n) for n in order]:
                done.result()
    except BaseException:
        os.close(fd)
        os.unlink(path)
        raise
    os.close(fd)
    return publish.file_entry(fs.unstrip_protocol(path), publish.TREE)


def _pwrite(fd: int, data: memoryview, at: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:], at + done)
