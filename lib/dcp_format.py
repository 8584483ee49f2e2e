"""torch.distributed.checkpoint's (DCP) file format, written and read without torch.

A DCP checkpoint is a directory: ``__<rank>_<i>.distcp`` files, each a run of items — one
``torch.save`` archive per chunk of a tensor — and ``.metadata``, a pickle of DCP's dataclasses
saying which tensor each item holds, its offsets in the whole tensor and its byte range. Both are
simple enough to write byte-compatible from Python, and doing so is what lets the stages that only
move bytes (shard, export) start without importing torch (4.5 s on the GPU machines, before the
first byte), and every stage write without ``torch.save``'s per-item overhead. lib/checkpoint.py
builds on this module for GPU tensors and the collective save/load; tests check that torch's own
``torch.load`` and DCP's reader load what is written here, and that this module reads what they
write.

What this module writes:

* an item is a zip archive of stored (uncompressed) records: ``archive/data.pkl`` (the pickle
  ``torch._utils._rebuild_tensor_v2`` of one storage), ``.format_version``, ``.storage_alignment``,
  ``byteorder``, ``data/0`` (the tensor's bytes, 64-byte aligned as torch aligns them) and
  ``version``. Like ``torch.save`` with ``compute_crc32`` off (lib/checkpoint.py's setting before
  this module), the data record's CRC-32 is left 0: every file's checksum (XXH3) is in the
  manifest, verified before reading, and torch's reader does not check it;
* ``.metadata`` pickles records that stand in for DCP's classes (``_Record``), ``Size`` for
  ``torch.Size``, ``DType`` for a torch dtype; their class names in the pickle are rewritten to
  torch's, so DCP's reader gets its own classes back, and reading maps torch's names back to ours.
"""

from __future__ import annotations

import collections
import hashlib
import io
import math
import pickle
import pickletools
import struct
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable

from .dtypes import HostTensor, numpy_storage

METADATA = ".metadata"
DCP_VERSION = "1.0.0"  # torch.distributed.checkpoint.filesystem.CURRENT_DCP_VERSION (checked in tests)


# ---- the records of ``.metadata`` -----------------------------------------------------------------

_DCP_CLASSES = {"torch.distributed.checkpoint.metadata": (
    "Metadata", "TensorStorageMetadata", "BytesStorageMetadata", "ChunkStorageMetadata", "TensorProperties",
    "MetadataIndex", "StorageMeta"), "torch.distributed.checkpoint.filesystem": ("_StorageInfo",)}


class Size(tuple):
    """``torch.Size``: a tuple, pickled as torch's."""

    def __reduce__(self):
        return Size, (tuple(self),)


class DType(str):
    """A torch dtype by its name (``bfloat16``), pickled as the global ``torch.bfloat16``. One
    object per name (pickle writes a global by reference: it must be the module's own)."""

    _known: dict[str, DType] = {}

    def __new__(cls, name: str):
        name = str(name)
        if name not in cls._known:
            cls._known[name] = super().__new__(cls, name)
        return cls._known[name]

    def __reduce__(self):
        return f"_dtype_{self}"


def _get_layout(name: str) -> str:  # pickled as torch.serialization._get_layout
    return name


class _Layout(str):
    def __reduce__(self):
        return _get_layout, (str(self),)


class _MemFormat(int):  # DCP's _MEM_FORMAT_ENCODING enum, pickled as ENUM(value)
    def __reduce__(self):
        return _MemFormat, (int(self),)


class _Record:
    transform_descriptors = None  # _StorageInfo leaves it out when empty
    index = None

    def __init__(self, **fields):
        self.__dict__.update(fields)

    def __getstate__(self):
        if type(self).__name__ == "_dcp_TensorProperties":  # DCP's TensorProperties pickles a tuple
            return (self.dtype, _Layout("torch.strided"), False, _MemFormat(0), False)
        return self.__dict__

    def __setstate__(self, state):
        if isinstance(state, tuple) and len(state) == 5:  # TensorProperties' tuple
            self.dtype, self.layout, self.requires_grad, _fmt, self.pin_memory = state
        else:
            state, slots = state if isinstance(state, tuple) else (state, None)
            self.__dict__.update(state or {})
            self.__dict__.update(slots or {})


# Our names → torch's, for the pickle's GLOBAL opcodes (and back, for reading).
_RECORDS: dict[tuple[str, str], type] = {}
_TORCH_NAMES: dict[str, str] = {}
for _module, _names in _DCP_CLASSES.items():
    for _name in _names:
        _cls = type(f"_dcp_{_name}", (_Record,), {"__module__": __name__})
        globals()[_cls.__name__] = _RECORDS[(_module, _name)] = _cls
        _TORCH_NAMES[f"{__name__} {_cls.__name__}"] = f"{_module}\n{_name}\n"
_TORCH_NAMES[f"{__name__} Size"] = "torch\nSize\n"
_TORCH_NAMES[f"{__name__} _get_layout"] = "torch.serialization\n_get_layout\n"
_TORCH_NAMES[f"{__name__} _MemFormat"] = "torch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n"
_DTYPES = ("bfloat16", "float16", "float32", "float64", "int64", "int32", "int16", "int8", "uint8", "bool")
for _name in _DTYPES:
    globals()[f"_dtype_{_name}"] = DType(_name)
    _TORCH_NAMES[f"{__name__} _dtype_{_name}"] = f"torch\n{_name}\n"
# torch's storage classes, by the dtype they hold (what an item's data.pkl names).
_STORAGES = {"bfloat16": "BFloat16Storage", "float16": "HalfStorage", "float32": "FloatStorage",
             "float64": "DoubleStorage", "int64": "LongStorage", "int32": "IntStorage", "int16": "ShortStorage",
             "int8": "CharStorage", "uint8": "ByteStorage", "bool": "BoolStorage"}
_STORAGE_DTYPES = {v: k for k, v in _STORAGES.items()}


def record(name: str, **fields) -> _Record:
    """A stand-in for DCP's class ``name`` (``TensorStorageMetadata``, ``_StorageInfo``, …)."""
    module = next(m for m, names in _DCP_CLASSES.items() if name in names)
    return _RECORDS[(module, name)](**fields)


def _torch_pickle(obj) -> bytes:
    """``pickle.dumps(obj)`` with our stand-ins' names replaced by torch's (protocol 2: a GLOBAL is
    its text, and no opcode refers to byte positions, so the rewrite is exact)."""
    raw = pickle.dumps(obj, protocol=2)
    out, last = [], 0
    for op, arg, pos in pickletools.genops(raw):
        if op.name == "GLOBAL" and arg in _TORCH_NAMES:
            end = raw.index(b"\n", raw.index(b"\n", pos) + 1) + 1
            out += [raw[last:pos], b"c", _TORCH_NAMES[arg].encode()]
            last = end
    return b"".join([*out, raw[last:]])


def dumps_metadata(md: _Record) -> bytes:
    return _torch_pickle(md)


class FormatError(ValueError):
    """Bytes that are not what this module reads (another DCP version, another kind of item)."""


class _Unpickler(pickle.Unpickler):
    """``.metadata`` (or an item's ``data.pkl``) into our stand-ins; any other global is refused."""

    def find_class(self, module, name):
        if (module, name) in _RECORDS:
            return _RECORDS[(module, name)]
        if (module, name) == ("torch.distributed.checkpoint.metadata", "_MEM_FORMAT_ENCODING"):
            return int
        if (module, name) == ("torch.serialization", "_get_layout"):
            return _get_layout
        if (module, name) == ("collections", "OrderedDict"):
            return collections.OrderedDict
        if module == "pathlib" and name in ("PosixPath", "PurePosixPath"):  # DCP's writer keeps its checkpoint_id so
            return lambda *parts: "/".join(parts).replace("//", "/")
        if module == "torch" and name == "Size":
            return Size
        if module == "torch" and name in _DTYPES:
            return DType(name)
        if module == "torch" and name in _STORAGE_DTYPES:
            return DType(_STORAGE_DTYPES[name])
        if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
            return lambda storage, offset, size, stride, *_: (storage, offset, tuple(size), tuple(stride))
        raise FormatError(f"{module}.{name}")

    def persistent_load(self, pid):
        kind, dtype, key, _location, numel = pid
        if kind != "storage" or not isinstance(dtype, DType):
            raise FormatError(str(pid))
        return dtype, key, numel


def loads_metadata(data: bytes) -> _Record:
    """``.metadata`` as records: ``state_dict_metadata`` (each tensor's ``size``,
    ``properties.dtype`` — a ``DType``, a str — and ``chunks``) and ``storage_data`` (where each
    chunk lies). ``FormatError`` for what this module does not know."""
    try:
        return _Unpickler(io.BytesIO(data)).load()
    except (pickle.UnpicklingError, AttributeError, TypeError, ValueError, EOFError) as e:
        raise FormatError(str(e)) from None


# ---- items: one torch.save archive per chunk -----------------------------------------------------

_ALIGN = 64  # torch aligns each record's data to this many bytes (".storage_alignment")
ZIP64_LIMIT = 0xFFFFFFFF  # sizes and offsets from here on need zip64 fields (a test lowers it)
_LOCAL, _CENTRAL, _END = 0x04034B50, 0x02014B50, 0x06054B50
_END64, _LOCATOR64 = 0x06064B50, 0x07064B50


def _data_pkl(dtype: str, shape: tuple[int, ...]) -> bytes:
    """The pickle ``torch.save`` writes for a contiguous tensor that is its whole storage."""
    numel = 1
    stride = []
    for n in reversed(shape):
        stride.insert(0, numel)
        numel *= n
    out = io.BytesIO()
    out.write(b"\x80\x02ctorch._utils\n_rebuild_tensor_v2\n(")
    # (('storage', <Storage class>, '0', 'cpu', numel), 0, size, stride, False, OrderedDict())
    out.write(b"(" + _pickled_str("storage") + f"ctorch\n{_STORAGES[dtype]}\n".encode() + _pickled_str("0")
              + _pickled_str("cpu") + _pickled_int(numel) + b"tQ")
    out.write(_pickled_int(0) + _pickled_tuple(shape) + _pickled_tuple(tuple(stride)))
    out.write(b"\x89ccollections\nOrderedDict\n)Rt" + b"R.")
    return out.getvalue()


def _pickled_str(s: str) -> bytes:
    b = s.encode()
    return b"X" + struct.pack("<I", len(b)) + b


def _pickled_int(n: int) -> bytes:
    if 0 <= n < 256:
        return b"K" + bytes([n])
    if 0 <= n < 65536:
        return b"M" + struct.pack("<H", n)
    if -(2**31) <= n < 2**31:
        return b"J" + struct.pack("<i", n)
    b = n.to_bytes((n.bit_length() + 8) // 8, "little", signed=True)
    return b"\x8a" + bytes([len(b)]) + b  # LONG1


def _pickled_tuple(t: tuple[int, ...]) -> bytes:
    return b"(" + b"".join(_pickled_int(n) for n in t) + b"t"


class _ZipWriter:
    """A zip of stored records, written in order to a sequential stream (``write`` only): each
    record's data 64-byte aligned from the archive's start (a padding extra field, as torch's
    writer does), zip64 fields where sizes or offsets need them."""

    def __init__(self, f):
        self.f, self.pos, self.central = f, 0, []

    def _write(self, b) -> None:
        self.f.write(b)
        self.pos += len(b)

    def add(self, name: str, data, crc: int | None = None) -> None:
        import zlib

        data = memoryview(data).cast("B")
        size, offset = len(data), self.pos
        crc = zlib.crc32(data) if crc is None else crc
        key = f"archive/{name}".encode()
        big = size >= ZIP64_LIMIT
        zip64 = struct.pack("<HHQQ", 1, 16, size, size) if big else b""
        fixed = 30 + len(key) + len(zip64) + 4
        pad = -(offset + fixed) % _ALIGN
        extra = zip64 + b"FB" + struct.pack("<H", pad) + b"Z" * pad
        n32 = 0xFFFFFFFF if big else size
        self._write(struct.pack("<IHHHHHIIIHH", _LOCAL, 45 if big else 20, 0x800, 0, 0, 0x21, crc, n32, n32,
                                len(key), len(extra)) + key + extra)
        self._write(data)
        self.central.append((key, crc, size, offset))

    def close(self) -> None:
        start = self.pos
        for key, crc, size, offset in self.central:
            fields = ([size, size] if size >= ZIP64_LIMIT else []) + ([offset] if offset >= ZIP64_LIMIT else [])
            extra = struct.pack(f"<HH{len(fields)}Q", 1, 8 * len(fields), *fields) if fields else b""
            self._write(struct.pack("<IHHHHHHIIIHHHHHII", _CENTRAL, 45 if extra else 20, 45 if extra else 20, 0x800,
                                    0, 0, 0x21, crc, min(size, 0xFFFFFFFF), min(size, 0xFFFFFFFF), len(key),
                                    len(extra), 0, 0, 0, 0, min(offset, 0xFFFFFFFF)) + key + extra)
        n, length = len(self.central), self.pos - start
        if start >= ZIP64_LIMIT or length >= ZIP64_LIMIT:
            end64 = self.pos
            self._write(struct.pack("<IQHHIIQQQQ", _END64, 44, 45, 45, 0, 0, n, n, length, start))
            self._write(struct.pack("<IIQI", _LOCATOR64, 0, end64, 1))
        self._write(struct.pack("<IHHHHIIH", _END, 0, 0, n, n, min(length, 0xFFFFFFFF), min(start, 0xFFFFFFFF), 0))


def write_item(f, t: HostTensor) -> None:
    """``t`` as the archive ``torch.save(tensor)`` writes (the tensor contiguous and its whole
    storage), to the sequential stream ``f``."""
    z = _ZipWriter(f)
    z.add("data.pkl", _data_pkl(t.dtype, tuple(t.shape)))
    z.add(".format_version", b"1")
    z.add(".storage_alignment", str(_ALIGN).encode())
    z.add("byteorder", b"little")
    data = t.data if t.data.flags.c_contiguous else t.data.copy()
    z.add("data/0", data.reshape(-1).view("u1"), crc=0)
    z.add("version", b"3\n")
    z.close()


@dataclass(frozen=True)
class StoredTensor:
    """Where an item's tensor lies in the item's bytes."""

    dtype: DType
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # of element 0, in bytes from the item's start


def _records(item: memoryview) -> dict[str, tuple[int, int]]:
    """An archive's records: short name (``data.pkl``, ``data/0``) → (data offset, size), from its
    central directory (torch writes sizes there and after each record, not in the local headers)."""
    end = bytes(item[-22:])
    sig, _, _, n, _, length, start, _ = struct.unpack("<IHHHHIIH", end)
    if sig != _END:
        raise FormatError("no zip end record (a comment, or not a zip)")
    if start == 0xFFFFFFFF or n == 0xFFFF or length == 0xFFFFFFFF:
        at = len(item) - 22 - 20
        sig, _, end64, _ = struct.unpack("<IIQI", bytes(item[at : at + 20]))
        if sig != _LOCATOR64:
            raise FormatError("no zip64 locator")
        sig, *_, n, _, length, start = struct.unpack("<IQHHIIQQQQ", bytes(item[end64 : end64 + 56]))
        if sig != _END64:
            raise FormatError("no zip64 end record")
    out, pos = {}, start
    for _ in range(n):
        f = struct.unpack("<IHHHHHHIIIHHHHHII", bytes(item[pos : pos + 46]))
        if f[0] != _CENTRAL or f[4] != 0:
            raise FormatError("not a stored zip record")
        size, nl, el, cl, offset = f[9], f[10], f[11], f[12], f[16]
        name = bytes(item[pos + 46 : pos + 46 + nl]).decode()
        extra = bytes(item[pos + 46 + nl : pos + 46 + nl + el])
        if size == 0xFFFFFFFF or offset == 0xFFFFFFFF:
            values = iter(_zip64_values(extra))
            size = next(values) if size == 0xFFFFFFFF else size
            if f[8] == 0xFFFFFFFF:
                next(values)  # the compressed size, equal for stored records
            offset = next(values) if offset == 0xFFFFFFFF else offset
        local_nl, local_el = struct.unpack("<HH", bytes(item[offset + 26 : offset + 30]))
        out[name.split("/", 1)[-1]] = (offset + 30 + local_nl + local_el, size)
        pos += 46 + nl + el + cl
    return out


def _zip64_values(extra: bytes) -> list[int]:
    pos = 0
    while pos + 4 <= len(extra):
        tag, n = struct.unpack_from("<HH", extra, pos)
        if tag == 1:
            return list(struct.unpack_from(f"<{n // 8}Q", extra, pos + 4))
        pos += 4 + n
    raise FormatError("zip64 sizes missing")


def parse_item(item: memoryview) -> StoredTensor:
    """Where the one tensor of an item (a ``torch.save`` archive, written here or by torch) lies;
    ``FormatError`` for any other archive, or damaged bytes."""
    try:
        return _parse_item(item)
    except (struct.error, KeyError, UnicodeDecodeError, pickle.UnpicklingError, EOFError, TypeError, ValueError) as e:
        if isinstance(e, FormatError):
            raise
        raise FormatError(f"not a tensor item ({type(e).__name__}: {e})") from None


def _parse_item(item: memoryview) -> StoredTensor:
    records = _records(item)
    if "byteorder" in records:
        at, n = records["byteorder"]
        if bytes(item[at : at + n]) != b"little":
            raise FormatError("big-endian item")
    at, n = records["data.pkl"]
    (dtype, key, numel), offset, shape, stride = _Unpickler(io.BytesIO(bytes(item[at : at + n]))).load()
    at, n = records[f"data/{key}"]
    size = numpy_storage(dtype).itemsize
    if n != numel * size:
        raise FormatError(f"data/{key} holds {n} bytes, its storage {numel * size}")
    return StoredTensor(dtype, shape, stride, at + offset * size)


def item_array(item: memoryview, stored: StoredTensor):
    """The tensor of an item as a numpy array of its storage, a view into ``item`` (no copy)."""
    import numpy as np

    dtype = numpy_storage(stored.dtype)
    numel = 1
    for n in stored.shape:
        numel *= n
    span = (sum((n - 1) * s for n, s in zip(stored.shape, stored.stride)) + 1) if numel else 0
    flat = np.frombuffer(item, dtype=np.uint8, count=span * dtype.itemsize, offset=stored.offset).view(dtype)
    return np.lib.stride_tricks.as_strided(flat, stored.shape, [s * dtype.itemsize for s in stored.stride],
                                           writeable=False)


# ---- writing a checkpoint: every rank its chunks, the lowest rank the metadata --------------------


@dataclass
class Piece:
    """A chunk of a tensor that this rank holds: where it sits, and how to get its bytes (called
    when the chunk is written, on a writer thread: a GPU tensor is copied out then)."""

    fqn: str
    size: tuple[int, ...]  # the whole tensor's
    offsets: tuple[int, ...]
    shape: tuple[int, ...]
    dtype: str
    get: Callable[[], HostTensor]

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * numpy_storage(self.dtype).itemsize


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


def _write_file(url: str, pieces: list[Piece]) -> list[tuple]:
    """One ``.distcp`` file: each piece an item, back to back, hashed as written. Returns
    ``(fqn, offsets, shape, file, begin, length)`` per piece."""
    from . import publish

    name = url.rsplit("/", 1)[1]
    out = []
    with publish.open_write(url) as f:
        for p in pieces:
            begin = f.tell()
            t = p.get()
            if tuple(t.shape) != tuple(p.shape) or t.dtype != p.dtype:
                raise ValueError(f"{p.fqn} at {list(p.offsets)}: got {t.dtype} {list(t.shape)}, planned "
                                 f"{p.dtype} {list(p.shape)}")
            write_item(f, t)
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


def _write_metadata(url: str, tensors: dict[str, tuple], written: list[tuple]) -> None:
    """The ``.metadata`` pickle DCP writes (its classes, its fields), to a temporary name, then
    moved. Its save id is the written items' digest, not a random one: a rerun writes the same bytes."""
    import fsspec

    from . import publish

    chunks: dict[str, list] = collections.defaultdict(list)
    for fqn, off, shape, *_ in written:
        chunks[fqn].append((tuple(off), tuple(shape)))
    _check_tiling(url, tensors, chunks)
    state_md, storage, index = {}, {}, {}
    for fqn in sorted(tensors):
        size, dtype = tensors[fqn]
        cs = sorted(chunks[fqn])
        index.update({(fqn, off): i for i, (off, _) in enumerate(cs)})
        state_md[fqn] = record("TensorStorageMetadata", properties=record("TensorProperties", dtype=DType(dtype)),
                               size=Size(size), chunks=[record("ChunkStorageMetadata", offsets=Size(o), sizes=Size(sz))
                                                        for o, sz in cs])
    for fqn, off, _shape, name, begin, length in sorted(written):
        key = record("MetadataIndex", fqn=fqn, offset=Size(off), index=index[(fqn, tuple(off))])
        storage[key] = record("_StorageInfo", relative_path=name, offset=begin, length=length)
    save_id = hashlib.sha256(repr(sorted(written)).encode()).hexdigest()[:32]
    md = record("Metadata", state_dict_metadata=state_md, planner_data={fqn: (fqn,) for fqn in state_md},
                storage_data=storage, storage_meta=record("StorageMeta", checkpoint_id=url, save_id=save_id,
                                                          load_id=None, modules=[]), version=DCP_VERSION)
    fs, path = fsspec.core.url_to_fs(url)
    tmp = f"{path}/{METADATA}.tmp"
    with publish.open_write(fs.unstrip_protocol(tmp)) as f:
        f.write(dumps_metadata(md))
    fs.mv(tmp, f"{path}/{METADATA}")
    publish.moved(fs, tmp, f"{path}/{METADATA}")


def save(pieces: list[Piece], url: str, threads: int = 4) -> None:
    """Collective over the stage's processes (``job``'s: torch.distributed or an ``IOGroup``):
    every rank passes the pieces it holds; a piece held by several ranks is written once. Each
    rank writes its pieces into up to ``threads`` files at once, each hashed as it is written
    (``publish.file_entry`` then costs no read); the lowest rank writes ``.metadata`` last. A
    failure on any rank raises on every rank, and leaves no ``.metadata``."""
    import fsspec

    from . import job

    url = url.rstrip("/")
    rank, _world = job.rank_world()
    plan = [(p.fqn, p.offsets, p.shape, p.nbytes) for p in pieces]
    tensors = {p.fqn: (tuple(p.size), p.dtype) for p in pieces}
    plans = job.all_gather_object((plan, tensors))
    mine = assign([p for p, _ in plans])[rank]
    todo = sorted((p for p in pieces if (p.fqn, tuple(p.offsets)) in mine), key=lambda p: -p.nbytes)
    buckets: list[list[Piece]] = [[] for _ in range(max(1, threads))]
    sizes = [0] * len(buckets)
    for p in todo:  # largest first, each to the lightest file (DCP's split)
        i = sizes.index(min(sizes))
        buckets[i].append(p)
        sizes[i] += p.nbytes
    buckets = [b for b in buckets if b]
    error, cause, written = None, None, []
    try:
        fs, path = fsspec.core.url_to_fs(url)
        fs.makedirs(path, exist_ok=True)
        with ThreadPoolExecutor(max(1, len(buckets))) as pool:
            for part in pool.map(_write_file, [f"{url}/__{rank}_{i}.distcp" for i in range(len(buckets))], buckets):
                written += part
    except Exception as e:  # reported on every rank below
        error, cause = f"rank {rank}: {type(e).__name__}: {e}", e
    results = job.all_gather_object((error, written))
    error = next((e for e, _ in results if e), None)
    if rank == 0 and error is None:
        all_tensors: dict = {}
        for _, t in plans:
            for fqn, v in t.items():
                if all_tensors.setdefault(fqn, v) != v:
                    error = f"{fqn} is {v} on one rank and {all_tensors[fqn]} on another"
        try:
            if error is None:
                _write_metadata(url, all_tensors, [w for _, ws in results for w in ws])
        except Exception as e:
            error, cause = f"rank 0: {type(e).__name__}: {e}", e
    error = job.agree(error)
    if error is not None:
        raise RuntimeError(f"saving the checkpoint {url} failed: {error}") from cause


# ---- reading whole tensors, without torch (export) ------------------------------------------------


def read_metadata(url: str) -> _Record:
    """The ``.metadata`` of the checkpoint at ``url`` (``FormatError``: not one this module reads)."""
    import fsspec

    fs, path = fsspec.core.url_to_fs(url.rstrip("/"))
    return loads_metadata(fs.cat_file(f"{path}/{METADATA}"))


_EDGE_BYTES = 64 << 10  # of a large item, what is read to find its tensor: its first and last bytes


def read_whole(url: str, md: _Record, fqn: str) -> HostTensor:
    """Tensor ``fqn`` of the checkpoint at ``url``, assembled from its chunks: a chunk of whole
    rows (split along dim 0, or the whole tensor) is read straight into its place once its item's
    first and last bytes have said where its data lies; any other is read whole and copied."""
    import fsspec
    import numpy as np

    fs, path = fsspec.core.url_to_fs(url.rstrip("/"))
    stored = md.state_dict_metadata[fqn]
    dtype = str(stored.properties.dtype)
    size = tuple(stored.size)
    out = np.empty(size, dtype=numpy_storage(dtype))
    flat = out.reshape(-1).view(np.uint8)
    row_bytes = math.prod(size[1:]) * out.itemsize if size else out.itemsize
    storage = {(k.fqn, tuple(k.offset)): v for k, v in md.storage_data.items() if k.fqn == fqn}
    covered = 0
    for chunk in stored.chunks:
        info = storage[(fqn, tuple(chunk.offsets))]
        if info.transform_descriptors:
            raise FormatError(f"{fqn} was written with DCP stream extensions {info.transform_descriptors}")
        file = f"{path}/{info.relative_path}"
        region = tuple(slice(o, o + n) for o, n in zip(chunk.offsets, chunk.sizes))
        rows = size and all(o == 0 for o in chunk.offsets[1:]) and tuple(chunk.sizes[1:]) == size[1:]
        piece = None
        if rows and info.length > 2 * _EDGE_BYTES:
            piece = _parse_edges(fs, file, info.offset, info.length)
            if piece is not None and _dense(piece) and str(piece.dtype) == dtype and tuple(piece.shape) == tuple(chunk.sizes):
                start = chunk.offsets[0] * row_bytes if size else 0
                read_into(fs, file, info.offset + piece.offset, memoryview(flat[start : start + piece_bytes(piece)]))
                covered += math.prod(chunk.sizes)
                continue
        item = memoryview(np.empty(info.length, dtype=np.uint8))  # not zeroed: every byte is read
        read_into(fs, file, info.offset, item)
        piece = parse_item(item)
        if str(piece.dtype) != dtype or tuple(piece.shape) != tuple(chunk.sizes):
            raise FormatError(f"{fqn} at {list(chunk.offsets)}: the item holds {piece.dtype} {list(piece.shape)}, "
                              f"the metadata says {dtype} {list(chunk.sizes)}")
        out[region] = item_array(item, piece)
        covered += math.prod(chunk.sizes)
    if covered != out.size:
        raise FormatError(f"the stored chunks of {fqn} cover {covered} of its {out.size} elements")
    return HostTensor(dtype, out)


def piece_bytes(piece: StoredTensor) -> int:
    return math.prod(piece.shape) * numpy_storage(piece.dtype).itemsize


def _dense(piece: StoredTensor) -> bool:
    """Whether the item's tensor is contiguous (its bytes one run, in row-major order)."""
    expect = 1
    for n, st in zip(reversed(piece.shape), reversed(piece.stride)):
        if n != 1 and st != expect:
            return False
        expect *= n
    return True


def _parse_edges(fs, file: str, begin: int, length: int) -> StoredTensor | None:
    """``parse_item`` of a large item from its first and last ``_EDGE_BYTES`` (None when those do
    not hold its directory and pickle: an unusual archive, read whole instead)."""
    import numpy as np

    head = np.empty(_EDGE_BYTES, dtype=np.uint8)
    tail = np.empty(_EDGE_BYTES, dtype=np.uint8)
    read_into(fs, file, begin, memoryview(head))
    read_into(fs, file, begin + length - _EDGE_BYTES, memoryview(tail))
    try:
        return parse_item(_Sparse(memoryview(head), memoryview(tail), length))
    except (FormatError, IndexError, struct.error, KeyError, pickle.UnpicklingError, ValueError):
        return None


class _Sparse:
    """The bytes of an item of which only its ``head`` and ``tail`` were read; slicing into the
    hole between them raises IndexError."""

    def __init__(self, head: memoryview, tail: memoryview, length: int):
        self.head, self.tail, self.length = head, tail, length

    def __len__(self) -> int:
        return self.length

    def __getitem__(self, key: slice):
        start, stop, _ = key.indices(self.length)
        if stop <= len(self.head):
            return self.head[start:stop]
        tail_start = self.length - len(self.tail)
        if start >= tail_start:
            return self.tail[start - tail_start : stop - tail_start]
        raise IndexError("outside the bytes read")


def read_into(fs, path: str, begin: int, view: memoryview) -> None:
    """Bytes ``begin:begin+len(view)`` of a file into ``view`` (local files: ``preadv``, no
    intermediate copy; others: one range request)."""
    import os

    if getattr(fs, "local_file", False):
        fd = os.open(fs._strip_protocol(path), os.O_RDONLY)
        try:
            done = 0
            while done < len(view):
                n = os.preadv(fd, [view[done:]], begin + done)
                if n <= 0:
                    raise OSError(f"{path}: short read at byte {begin + done}; the file changed while being read")
                done += n
        finally:
            os.close(fd)
    else:
        data = fs.cat_file(path, begin, begin + len(view))
        if len(data) != len(view):
            raise OSError(f"{path}: short read at byte {begin}; the file changed while being read")
        view[:] = data
