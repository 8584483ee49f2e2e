"""Reading a torch.distributed.checkpoint (DCP) checkpoint's layout: ``.metadata`` as an index of
every tensor's chunks and their byte ranges (``read_index``, without importing DCP), and where an
item's tensor lies in its bytes (``parse_item``), so that readers can map or range-read them.
The files themselves: lib/files/dcp_format.py.
"""

from __future__ import annotations

import collections
import importlib
import io
import pickle
from typing import NamedTuple

import fsspec
import torch

from llamarl.lib.files.dcp_format import METADATA


class Chunk(NamedTuple):
    """A stored chunk of a tensor, and the byte range of its item."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]
    file: str  # relative to the checkpoint's folder
    begin: int
    end: int
    transforms: tuple  # DCP's stream extensions (compression…): llamarl reads plain items only


class Stored(NamedTuple):
    """A stored tensor: its whole size and dtype, and its chunks."""

    size: tuple[int, ...]
    dtype: torch.dtype
    chunks: tuple[Chunk, ...]


def read_index(url: str) -> dict[str, Stored]:
    """Every tensor of the checkpoint at ``url``, from its ``.metadata``, without importing DCP
    (half a second of DTensor and sympy, on the critical path of export and of every load):
    DCP's metadata classes are plain records of fields, so they are read as such (``_Records``).
    A ``.metadata`` holding anything else (another torch's classes) is read by DCP's own classes."""
    fs, path = fsspec.core.url_to_fs(url.rstrip("/"))
    data = fs.cat_file(f"{path}/{METADATA}")
    try:
        return _index(_Records(io.BytesIO(data)).load())
    except Exception:  # noqa: BLE001 — not the records read here: DCP says what it is, or what is wrong
        return _index(pickle.loads(data))


def _index(md) -> dict[str, Stored]:
    """``read_index``'s answer from DCP's ``Metadata`` or its records (the same field names).
    Entries without chunks (bytes) are not tensors and are left out."""
    # A bytes entry's key has no offset (a field left at its default is not pickled).
    where = {(k.fqn, tuple(getattr(k, "offset", None) or ())): v for k, v in md.storage_data.items()}
    out = {}
    for fqn, t in md.state_dict_metadata.items():
        if not hasattr(t, "chunks"):
            continue
        chunks = []
        for c in t.chunks:
            info = where[(fqn, tuple(c.offsets))]
            begin, transforms = int(info.offset), tuple(getattr(info, "transform_descriptors", None) or ())
            chunks.append(Chunk(tuple(map(int, c.offsets)), tuple(map(int, c.sizes)), str(info.relative_path),
                                begin, begin + int(info.length), transforms))
        if not isinstance(t.properties.dtype, torch.dtype):
            raise TypeError(f"{fqn}: dtype {t.properties.dtype!r}")
        out[fqn] = Stored(tuple(map(int, t.size)), t.properties.dtype, tuple(chunks))
    return out


class _Record:
    """An object of one of DCP's metadata classes, as the fields it was pickled with."""

    def __init__(self, *args):  # an enum member: pickled as a call with its value
        self.args = args

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 2:  # a class with __slots__: (dict, slots)
            state = {**(state[0] or {}), **(state[1] or {})}
        self.__dict__.update(state)


class _Properties(_Record):
    """``TensorProperties``, pickled as the tuple (dtype, layout, requires_grad, memory format,
    pin_memory)."""

    def __setstate__(self, state):
        self.dtype = state[0]


_DCP_RECORDS = {("torch.distributed.checkpoint.metadata", "TensorProperties"): _Properties,
                **{("torch.distributed.checkpoint.metadata", n): _Record
                   for n in ("Metadata", "TensorStorageMetadata", "ChunkStorageMetadata", "BytesStorageMetadata",
                             "MetadataIndex", "StorageMeta", "_MEM_FORMAT_ENCODING")},
                ("torch.distributed.checkpoint.filesystem", "_StorageInfo"): _Record}


class _Records(pickle.Unpickler):
    """``.metadata`` with DCP's classes as ``_Record``s; besides them only the plain values DCP
    pickles (torch's dtypes, sizes and layouts, paths); anything else is refused here and read by
    DCP's own unpickler. Not a sandbox: ``.metadata`` is trusted input (DCP itself unpickles it),
    as every file of a published checkpoint is."""

    def find_class(self, module, name):
        if (module, name) in _DCP_RECORDS:
            return _DCP_RECORDS[(module, name)]
        if module == "torch" and (name == "Size" or isinstance(getattr(torch, name, None), torch.dtype)):
            return getattr(torch, name)
        if (module, name) in {("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
                              ("pathlib", "PurePosixPath"), ("collections", "OrderedDict")}:
            return getattr(importlib.import_module(module), name)
        raise pickle.UnpicklingError(f"{module}.{name}")


class StoredTensor(NamedTuple):
    """Where an item's tensor lies in a buffer holding the item's bytes."""

    dtype: torch.dtype
    size: tuple[int, ...]
    stride: tuple[int, ...]
    begin: int  # byte offset of element 0 in the buffer


_STORAGES = {name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()}


class _Unpickler(pickle.Unpickler):
    """An item's ``data.pkl`` as (storage, offset, size, stride); only the names a saved tensor
    needs, anything else is not a plain one-tensor item."""

    def find_class(self, module, name):
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *_: (storage, offset, tuple(size), tuple(stride))
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "torch" and name in _STORAGES:
            return _STORAGES[name]
        raise pickle.UnpicklingError(f"{module}.{name}")

    def persistent_load(self, pid):
        kind, dtype, key, _location, numel = pid
        if kind != "storage" or not isinstance(dtype, torch.dtype):
            raise pickle.UnpicklingError(str(pid))
        return dtype, key, numel


def parse_item(item: io.RawIOBase, start: int = 0) -> StoredTensor | None:
    """Where the tensor of a ``torch.save`` archive lies, read by torch's own zip reader. ``item``:
    the item's bytes as a file (``MemoryFile``, ``Sparse``); ``start``: where the item begins in the
    buffer that ``begin`` counts from. None when the item is not the plain one-tensor archive DCP
    and ``torch.save`` write (its reader then goes through ``torch.load``), or is damaged."""
    try:
        zf = torch._C.PyTorchFileReader(item)
        if zf.has_record("byteorder") and bytes(zf.get_record("byteorder")) != b"little":
            return None
        (dtype, key, numel), offset, size, stride = _Unpickler(io.BytesIO(zf.get_record("data.pkl"))).load()
        if _record_size(zf, item, f"data/{key}") != numel * dtype.itemsize:
            return None
        return StoredTensor(dtype, size, stride, start + zf.get_record_offset(f"data/{key}") + offset * dtype.itemsize)
    except Exception:  # any other archive: torch.load reads it, or says what is wrong with it
        return None


def _record_size(zf, item: io.RawIOBase, name: str) -> int:
    """Bytes of record ``name`` of the archive ``item``. torch < 2.12's reader cannot say (it has
    no ``get_record_size``): then the zip's central directory, at the item's end, does, so that
    the item is still read in place rather than through ``torch.load``."""
    if hasattr(zf, "get_record_size"):
        return zf.get_record_size(name)
    import zipfile

    item.seek(0)
    with zipfile.ZipFile(item) as z:
        return next(i.file_size for i in z.infolist() if i.filename.split("/", 1)[-1] == name)
