"""Sliced reads of safetensors files at any fsspec URL, and a checked writer.

``safetensors.safe_open`` needs a local path (it mmaps). A rank that owns a slice of a tensor on
S3 or NFS should fetch only those bytes: the format is an 8-byte header length, a JSON header
with each tensor's dtype, shape and byte range, then raw little-endian data — so a row range of a
tensor is one range read, and a column range is read in bounded row blocks.
"""

from __future__ import annotations

import json
import struct
from dataclasses import dataclass

import fsspec
import torch

from . import publish
from .dtypes import SAFETENSORS_CODES
from .errors import UserError

# A header's dtype code ("BF16") → torch dtype, from lib/dtypes.py's table.
CODES = {code: getattr(torch, name) for code, name in SAFETENSORS_CODES.items()}

# Column slices are read this many source bytes at a time, bounding the extra memory per rank.
_BLOCK_BYTES = 16 << 20


class SafetensorsError(UserError, ValueError):
    """A safetensors file that cannot be read as expected; the message names the file."""


@dataclass(frozen=True)
class TensorInfo:
    dtype: torch.dtype
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
        out = torch.empty(shape, dtype=dtype)
        if end > begin:
            # Straight into the tensor's memory: no intermediate bytes object.
            buf = memoryview(out.view(-1).view(torch.uint8).numpy()).cast("B")
            with self.fs.open(self.path, "rb") as f:
                f.seek(begin)
                if f.readinto(buf) != end - begin:
                    raise SafetensorsError(f"{self.url}: short read; the file changed while being read")
        return out

    def read(self, name: str, dim: int = 0, start: int = 0, stop: int | None = None) -> torch.Tensor:
        """Rows (dim 0) or columns (dim 1) ``start:stop`` of tensor ``name``."""
        info = self.tensors[name]
        shape = info.shape
        stop = shape[dim] if stop is None else stop
        itemsize = torch.empty((), dtype=info.dtype).element_size()
        if dim == 0:
            row = itemsize * (int(torch.tensor(shape[1:]).prod()) if len(shape) > 1 else 1)
            return self._read(info.begin + start * row, info.begin + stop * row, info.dtype, (stop - start, *shape[1:]))
        if dim != 1 or len(shape) != 2:
            raise ValueError(f"only row or column slices of 2-D tensors are supported ({name}, dim {dim})")
        rows, cols = shape
        row_bytes = cols * itemsize
        step = max(1, _BLOCK_BYTES // row_bytes)
        out = torch.empty((rows, stop - start), dtype=info.dtype)
        for r0 in range(0, rows, step):
            r1 = min(rows, r0 + step)
            block = self._read(info.begin + r0 * row_bytes, info.begin + r1 * row_bytes, info.dtype, (r1 - r0, cols))
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
        self.where: dict[str, str] = {}
        for fname, f in self.files.items():
            for t in f.tensors:
                self.where[t] = fname
        if weight_map is not None:
            missing = sorted(t for t, fname in weight_map.items() if self.where.get(t) != fname)
            if missing:
                raise SafetensorsError(f"{root}: index lists {len(missing)} tensors not found in their files "
                                       f"(first: {missing[0]}); the checkpoint is incomplete")

    def info(self, name: str) -> TensorInfo:
        return self.files[self.where[name]].tensors[name]

    def read(self, name: str, dim: int, start: int, stop: int) -> torch.Tensor:
        return self.files[self.where[name]].read(name, dim, start, stop)


# torch dtype → a header's dtype code, from the same table.
_CODE_OF = {dtype: code for code, dtype in CODES.items()}


def write_file(url: str, tensors: dict[str, torch.Tensor], metadata: dict[str, str] | None = None) -> dict:
    """Write a safetensors file at any fsspec URL, streamed from the tensors' memory (no copy of the
    whole file) and hashed on the way; returns its manifest entry (``bytes`` and checksum).

    The layout is the safetensors library's: header JSON padded with spaces to 8 bytes, tensors
    ordered by element size (largest first, so each starts aligned), then name, with no gaps."""
    order = sorted(tensors, key=lambda n: (-tensors[n].element_size(), n))
    header: dict = {"__metadata__": metadata} if metadata else {}
    offset = 0
    for name in order:
        t = tensors[name]
        n = t.numel() * t.element_size()
        header[name] = {"dtype": _CODE_OF[t.dtype], "shape": list(t.shape), "data_offsets": [offset, offset + n]}
        offset += n
    head = json.dumps(header, separators=(",", ":")).encode()
    head += b" " * (-len(head) % 8)
    with publish.open_write(url) as f:
        f.write(struct.pack("<Q", len(head)) + head)
        for name in order:
            t = tensors[name].detach().cpu().contiguous()
            if t.numel():
                f.write(memoryview(t.view(-1).view(torch.uint8).numpy()))
    return f.entry()
