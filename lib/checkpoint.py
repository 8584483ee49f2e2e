"""Sharded checkpoints on torch.distributed.checkpoint (DCP), at any fsspec URL.

What is stored is layout-free: the *HF-named, HF-shaped* tensors (``q_proj``, ``k_proj``, ...,
unpadded vocabulary), each rank writing the pieces it owns as chunks with their offsets
(``hf_mapping.param_slices`` says which). A job at any other TP×PP layout loads by asking for its
own pieces; DCP reads the overlapping chunks. No conversion step, and the fused QKV / gate_up and
vocabulary padding of a layout never reach the files.

DCP knows DTensor and ShardedTensor, neither of which can say "rows 128:192 of k_proj, also held
by another rank" (kv heads replicated over TP). ``Chunks`` states exactly that through DCP's
checkpointable-object hooks, and the two planners below resolve it — their documented extension
points (``lookup_object`` / ``lookup_tensor``).

The files are DCP's own (``FsspecWriter``'s layout, read by any DCP reader); only how they move
differs. Writing, each rank's writer threads hash every file as it goes out
(``publish.HashingWriter``), so the manifest's checksums cost no second read. Reading (``_Reader``),
a rank's items are read in large coalesced ranges by a pool of threads, and each tensor is copied
from that buffer into its target: a view of the stored bytes, no ``torch.load`` copy. For a CUDA
target the buffers are pinned and the copies non-blocking.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FileSystem, FsspecReader, FsspecWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import LoadItemType, TensorWriteData, WriteItem, WriteItemType
from torch.futures import Future

from . import hf_mapping, publish


class Chunks:
    """This rank's pieces of one global tensor: ``{offsets: local tensor}`` (views allowed: loading
    writes through them)."""

    def __init__(self, size: tuple[int, ...], pieces: dict[tuple[int, ...], torch.Tensor]):
        self._size = torch.Size(size)
        self.pieces = pieces

    def size(self) -> torch.Size:
        return self._size

    # DCP hooks (the protocol DTensor implements)
    def __create_write_items__(self, fqn: str, obj) -> list[WriteItem]:
        return [
            WriteItem(
                index=MetadataIndex(fqn, torch.Size(off)),
                type=WriteItemType.SHARD,
                tensor_data=TensorWriteData(
                    chunk=ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.shape),
                    properties=TensorProperties.create_from_tensor(t),
                    size=self._size,
                ),
            )
            for off, t in self.pieces.items()
        ]

    def __create_chunk_list__(self) -> list[ChunkStorageMetadata]:
        return [ChunkStorageMetadata(offsets=torch.Size(off), sizes=t.shape) for off, t in self.pieces.items()]

    def __get_tensor_shard__(self, index: MetadataIndex) -> torch.Tensor:
        return self.pieces[tuple(index.offset)]


def _lookup(state, index: MetadataIndex):
    obj = state[index.fqn]
    return obj.__get_tensor_shard__(index) if isinstance(obj, Chunks) else None


class _SavePlanner(DefaultSavePlanner):
    def lookup_object(self, index):
        found = _lookup(self.state_dict, index)
        return found.detach() if found is not None else super().lookup_object(index)


class _LoadPlanner(DefaultLoadPlanner):
    def __init__(self):
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=False)

    def set_up_planner(self, state_dict, metadata=None, is_coordinator=False):
        # The default set-up also materialises meta tensors by rebuilding the dict, and turns every
        # value type it does not know (ours) into None. Our state is flat and never on meta.
        self.original_state_dict = self.state_dict = state_dict
        self.metadata, self.is_coordinator = metadata, is_coordinator

    def lookup_tensor(self, index):
        found = _lookup(self.state_dict, index)
        return found if found is not None else super().lookup_tensor(index)


def chunks_of(cfg, tp: int, tp_rank: int, name: str, local: torch.Tensor, head: str) -> list[tuple[str, tuple, torch.Tensor]]:
    """The (hf_name, offsets, view) pieces of our parameter ``name`` held as ``local``; vocabulary
    padding is cut off (it is not part of the HF tensor)."""
    shapes = hf_mapping.hf_shapes(cfg, head)
    slices = hf_mapping.param_slices(cfg, tp, tp_rank, name)
    local = local.detach()  # views for I/O only: loading writes through them, outside autograd
    out = []
    for s, piece in zip(slices, local.split([s.stop - s.start for s in slices], dim=slices[0].dim)):
        full = shapes[s.hf_name]
        keep = min(s.stop, full[s.dim]) - s.start
        if keep <= 0:
            continue
        off = [0] * len(full)
        off[s.dim] = s.start
        out.append((s.hf_name, tuple(off), piece.narrow(s.dim, 0, keep)))
    return out


def model_state(model, tensors: dict[str, torch.Tensor] | None = None, suffix: str = "") -> dict[str, Chunks]:
    """The DCP state of ``model``'s parameters (or of per-parameter ``tensors`` such as optimizer
    moments, keyed like ``named_parameters``), under HF names plus ``suffix``; split as the model's
    topology splits it."""
    topo = model.topology
    shapes = hf_mapping.hf_shapes(model.cfg, model.hf_head)
    pieces: dict[str, dict] = defaultdict(dict)
    source = tensors if tensors is not None else dict(model.named_parameters())
    for name, local in source.items():
        for hf_name, off, view in chunks_of(model.cfg, topo.tp, topo.tp_rank, name, local, model.hf_head):
            pieces[hf_name + suffix][off] = view
    return {k: Chunks(shapes[k[: len(k) - len(suffix)] if suffix else k], v) for k, v in pieces.items()}


class _HashingFileSystem(FileSystem):
    """DCP's fsspec file system, with every file it writes hashed on the way (``publish.record``
    keeps the entry for the manifest)."""

    @contextmanager
    def create_stream(self, path, mode: str):
        if "w" not in mode:
            with super().create_stream(path, mode) as stream:
                yield stream
            return
        with super().create_stream(path, mode) as raw:
            writer = publish.HashingWriter(raw)
            yield writer
            writer.close()
        publish.record(self.fs, os.fspath(path), writer)

    def rename(self, path, new_path) -> None:
        super().rename(path, new_path)
        publish.moved(self.fs, os.fspath(path), os.fspath(new_path))


class _Writer(FsspecWriter):
    def __init__(self, url: str, threads: int):
        super().__init__(url, single_file_per_rank=True, sync_files=False, thread_count=threads)
        self.fs = _HashingFileSystem()
        self.path = self.fs.init_path(url)


def save(state: dict, url: str, threads: int = 4) -> None:
    """Collective: every rank of the default group calls it with its own state, written by
    ``threads`` writer threads into as many files (a training state is tens of GB per rank), each
    hashed as it is written (``publish.file_entry`` then costs no read)."""
    dcp.save(state, storage_writer=_Writer(url, threads), planner=_SavePlanner())


# ---- reading ------------------------------------------------------------------------------------

BLOCK_BYTES = 64 << 20  # a read covers neighbouring items up to this many bytes
READ_THREADS = 8
_GAP_BYTES = 1 << 20  # items this close are read in one range, the bytes between them included


class _Stored:
    """Where one DCP item's tensor lies in a buffer holding the item's bytes (a ``torch.save``
    zip): dtype, size, stride and the byte offset of element 0. None when the item is not the
    plain one-tensor archive DCP writes (read through ``torch.load`` instead)."""

    _STORAGES = {name: dtype for dtype, name in torch.storage._dtype_to_storage_type_map().items()}

    class _Unpickler(pickle.Unpickler):
        # Only the names a saved tensor needs; anything else means: not our fast path.
        def find_class(self, module, name):
            if (module, name) == ("torch._utils", "_rebuild_tensor_v2"):
                return lambda storage, offset, size, stride, *_: (storage, offset, tuple(size), tuple(stride))
            if (module, name) == ("collections", "OrderedDict"):
                return collections.OrderedDict
            if module == "torch" and name in _Stored._STORAGES:
                return _Stored._STORAGES[name]
            raise pickle.UnpicklingError(f"{module}.{name}")

        def persistent_load(self, pid):
            kind, dtype, key, _location, numel = pid
            if kind != "storage" or not isinstance(dtype, torch.dtype):
                raise pickle.UnpicklingError(str(pid))
            return dtype, key, numel

    @staticmethod
    def parse(view: memoryview, start: int):
        try:
            zf = torch._C.PyTorchFileReader(_MemoryFile(view))
            if zf.has_record("byteorder") and bytes(zf.get_record("byteorder")) != b"little":
                return None
            (dtype, key, numel), offset, size, stride = _Stored._Unpickler(io.BytesIO(zf.get_record("data.pkl"))).load()
            item = torch.empty((), dtype=dtype).element_size()
            if zf.get_record_size(f"data/{key}") != numel * item:
                return None
            return dtype, size, stride, start + zf.get_record_offset(f"data/{key}") + offset * item
        except Exception:  # any other archive: torch.load reads it
            return None


class _MemoryFile(io.RawIOBase):
    """A read-only, seekable file over a memoryview (no copy)."""

    def __init__(self, view: memoryview):
        self.view, self.pos = view, 0

    def readable(self):
        return True

    def seekable(self):
        return True

    def readinto(self, b):
        n = max(0, min(len(b), len(self.view) - self.pos))
        b[:n] = self.view[self.pos : self.pos + n]
        self.pos += n
        return n

    def seek(self, offset, whence=io.SEEK_SET):
        self.pos = offset + (0, self.pos, len(self.view))[whence]
        return self.pos

    def tell(self):
        return self.pos


def _copy_stored(target: torch.Tensor, buf: torch.Tensor, stored, offsets, lengths, non_blocking: bool) -> None:
    """Copy the region ``offsets``/``lengths`` of a stored tensor lying in the uint8 ``buf`` into
    ``target``: as bytes where both have unit last stride (any alignment, no temporary), otherwise
    through an aligned copy of the stored dtype."""
    dtype, _size, stride, begin = stored
    item = torch.empty((), dtype=dtype).element_size()
    lengths = list(lengths) or [1]
    stride = list(stride) or [1]
    begin += item * sum(o * st for o, st in zip(offsets, stride))
    tgt = target.reshape(1) if target.dim() == 0 else target
    if dtype == target.dtype and stride[-1] == 1 and tgt.stride(-1) == 1:
        src = buf.as_strided((*lengths[:-1], lengths[-1] * item), (*(st * item for st in stride[:-1]), 1), begin)
        tgt.view(torch.uint8).copy_(src, non_blocking=non_blocking)
        return
    # Uncommon (a stored or target tensor strided in its last dimension, or another dtype):
    # the bytes of the stored region gathered element by element into a tensor of its dtype.
    src = buf.as_strided((*lengths, item), (*(st * item for st in stride), 1), begin)
    tmp = torch.empty(lengths, dtype=dtype)
    tmp.view(torch.uint8).view(*lengths, item).copy_(src)
    tgt.copy_(tmp.view(tgt.shape))


class _Reader(FsspecReader):
    """DCP's fsspec reader, reading each rank's items in coalesced ranges of up to ``block_bytes``,
    ``threads`` ranges at a time, into pinned buffers when the targets live on a GPU."""

    def __init__(self, url: str, block_bytes: int | None = None, threads: int | None = None):
        super().__init__(url)
        self.block_bytes, self.threads = block_bytes or BLOCK_BYTES, threads or READ_THREADS

    def _ranges(self, plan):
        """[(file, begin, end, [(item, item_begin, item_end)])], items in file order."""
        per_file: dict[str, list] = defaultdict(list)
        for req in plan.items:
            info = self.storage_data[req.storage_index]
            if info.transform_descriptors:  # a stream extension (compression…): DCP's own path
                return None
            per_file[info.relative_path].append((req, info.offset, info.offset + info.length))
        out = []
        for name, items in per_file.items():
            items.sort(key=lambda x: x[1])
            run = [items[0]]
            for it in items[1:]:
                if it[1] - run[-1][2] <= _GAP_BYTES and it[2] - run[0][1] <= self.block_bytes:
                    run.append(it)
                else:
                    out.append((name, run[0][1], max(i[2] for i in run), run))
                    run = [it]
            out.append((name, run[0][1], max(i[2] for i in run), run))
        return out

    def _read_range(self, name: str, begin: int, end: int, pin: bool) -> torch.Tensor:
        buf = torch.empty(end - begin, dtype=torch.uint8, pin_memory=pin)
        view = memoryview(buf.numpy()).cast("B")
        fs = self.fs.fs
        path = os.fspath(self.fs.concat_path(self.path, name))
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
            data = fs.cat_file(path, begin, end)
            if len(data) != end - begin:
                raise OSError(f"{path}: short read at byte {begin}; the file changed while being read")
            view[:] = data
        return buf

    def read_data(self, plan, planner):
        ranges = self._ranges(plan) if plan.items else []
        if ranges is None:
            return super().read_data(plan, planner)
        targets = {}
        cuda = False
        for _, _, _, items in ranges:
            for req, _, _ in items:
                if req.type != LoadItemType.BYTE_IO:
                    targets[req] = t = planner.resolve_tensor(req).detach()
                    cuda |= t.is_cuda
        pin = cuda and torch.cuda.is_available()
        with ThreadPoolExecutor(max(1, min(self.threads, len(ranges)))) as pool:
            # At most `threads` ranges in memory ahead of the copies.
            pending = collections.deque()
            todo = iter(ranges)
            for r in todo:
                pending.append((r, pool.submit(self._read_range, r[0], r[1], r[2], pin)))
                if len(pending) >= self.threads:
                    break
            while pending:
                (_, begin, _, items), fut = pending.popleft()
                buf = fut.result()
                nxt = next(todo, None)
                if nxt is not None:
                    pending.append((nxt, pool.submit(self._read_range, nxt[0], nxt[1], nxt[2], pin)))
                view = memoryview(buf.numpy()).cast("B")
                for req, b, e in items:
                    piece = view[b - begin : e - begin]
                    if req.type == LoadItemType.BYTE_IO:
                        planner.load_bytes(req, io.BytesIO(bytes(piece)))
                        continue
                    target = targets[req]
                    stored = _Stored.parse(piece, b - begin)
                    if stored is None or tuple(req.lengths) != tuple(target.shape):
                        tensor = torch.load(io.BytesIO(bytes(piece)), map_location="cpu", weights_only=True)
                        tensor = tensor[tuple(slice(o, o + n) for o, n in zip(req.storage_offsets, req.lengths))]
                        if tensor.shape != target.shape:
                            raise AssertionError(f"req {req.storage_index} mismatch sizes {target.shape} vs {tensor.shape}")
                        target.copy_(tensor)
                    else:
                        _copy_stored(target, buf, stored, req.storage_offsets, req.lengths, non_blocking=pin and target.is_cuda)
                    planner.commit_tensor(req, target)
                # A pinned buffer dropped here is reused by torch's host allocator only after the
                # copies out of it have run (the copies record an event on it).
        if pin:
            torch.cuda.current_stream().synchronize()
        fut = Future()
        fut.set_result(None)
        return fut


def load(state: dict, url: str) -> None:
    """Collective. Fills the tensors/chunks of ``state`` in place from the checkpoint at ``url``."""
    dcp.load(state, storage_reader=_Reader(url), planner=_LoadPlanner())


def read_metadata(url: str):
    """DCP metadata: every stored tensor's global shape, dtype and chunks."""
    return FsspecReader(url).read_metadata()


def load_model(model, url: str) -> None:
    """Fill ``model``'s parameters (any layout) from a checkpoint's DCP directory."""
    with torch.no_grad():
        for p in model.parameters():
            p.zero_()  # vocabulary padding rows are not in the checkpoint: they must read as zeros
        load(model_state(model), url)
    if dist.is_initialized():
        dist.barrier()
