"""Sharded checkpoints in torch.distributed.checkpoint's (DCP) format, at any fsspec URL: the
HF-named, HF-shaped tensors, each rank writing the chunks it owns (``hf_mapping.param_slices``), so
that a job at any TP×PP layout loads its own pieces (docs/formats.md "Sharded checkpoint").

The files are written by lib/files/dcp_format.py. Reading is this module's own (``_read`` says how):
straight into the targets, without ``torch.load``'s copy.
"""

from __future__ import annotations

import io
import math
import threading
from collections import defaultdict
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import NamedTuple

import fsspec
import torch
from llamarl.lib.distributed import collectives
from llamarl.lib.files import dcp_format, dcp_index, ranges
from llamarl.lib.files.checksums import is_local
from llamarl.lib.files.dcp_format import METADATA  # noqa: F401 — part of this module's interface
from llamarl.lib.files.dcp_index import read_index  # noqa: F401 — part of this module's interface
from llamarl.lib.model import hf_mapping


class Chunks(NamedTuple):
    """This rank's pieces of one global tensor of ``size``: ``{offsets: local tensor}`` (views
    allowed: loading writes through them)."""

    size: tuple[int, ...]
    pieces: dict[tuple[int, ...], torch.Tensor]


def _pieces(state: dict) -> dict[str, tuple[torch.Size, dict[tuple[int, ...], torch.Tensor]]]:
    out = {}
    for fqn, obj in state.items():
        if isinstance(obj, Chunks):
            out[fqn] = (torch.Size(obj.size), {tuple(o): t for o, t in obj.pieces.items()})
        elif isinstance(obj, torch.Tensor):
            out[fqn] = (obj.shape, {(0,) * obj.dim(): obj})
        else:
            raise TypeError(f"checkpoint state {fqn!r}: {type(obj).__name__}; only tensors and Chunks are stored")
    return out


def chunks_of(cfg, tp: int, tp_rank: int, name: str, local: torch.Tensor, head: str,
              shapes: dict[str, tuple[int, ...]] | None = None) -> list[tuple[str, tuple, torch.Tensor]]:
    """The (hf_name, offsets, view) pieces of our parameter ``name`` held as ``local``; vocabulary
    padding is cut off (it is not part of the HF tensor). ``shapes``: ``hf_shapes`` of the model,
    when the caller has it (a model's every parameter: computed once)."""
    shapes = shapes or hf_mapping.hf_shapes(cfg, head)
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
    shapes = hf_mapping.hf_shapes(model.cfg, model.hf_head)
    pieces: dict[str, dict] = defaultdict(dict)
    for chunks in _param_chunks(model, tensors, shapes).values():
        for hf_name, off, view in chunks:
            pieces[hf_name][off] = view
    return {k + suffix: Chunks(shapes[k], v) for k, v in pieces.items()}


def _param_chunks(model, tensors: dict[str, torch.Tensor] | None, shapes) -> dict[str, list[tuple]]:
    """``chunks_of`` each of ``tensors`` (None: the parameters), by name."""
    topo = model.topology
    source = tensors if tensors is not None else dict(model.named_parameters())
    return {name: chunks_of(model.cfg, topo.tp, topo.tp_rank, name, local, model.hf_head, shapes)
            for name, local in source.items()}


# ---- writing ------------------------------------------------------------------------------------


def save(state: dict, url: str, threads: int = 4) -> None:
    """Collective: every rank of the stage calls it with its own state (tensors or ``Chunks``); a
    chunk held by several ranks is written once (``dcp_format.save``: files hashed as written,
    ``.metadata`` last, a failure on any rank raised on every rank)."""
    pieces = [dcp_format.Piece(fqn, tuple(size), tuple(off), tuple(t.shape), t.dtype, lambda t=t: t)
              for fqn, (size, ps) in _pieces(state).items() for off, t in ps.items()]
    dcp_format.save(pieces, url, threads)


# ---- reading ------------------------------------------------------------------------------------

BLOCK_BYTES = 64 << 20  # a read covers neighbouring items up to this many bytes
READ_THREADS = 8
_GAP_BYTES = 1 << 20  # items this close are read in one range, the bytes between them included


@dataclass
class _Read:
    """One piece to read: the stored item (file, byte range), the region of its tensor, the target."""

    file: str
    begin: int
    end: int
    offsets: tuple
    lengths: tuple
    target: torch.Tensor


def _plan(state: dict, index: dict[str, dcp_index.Stored], url: str) -> list[_Read]:
    reads = []
    for fqn, (size, pieces) in _pieces(state).items():
        stored = index.get(fqn)
        if stored is None:
            raise KeyError(f"{url}: the checkpoint has no tensor {fqn}")
        if tuple(stored.size) != tuple(size):
            raise ValueError(f"{url}: {fqn} is stored with shape {list(stored.size)}, asked for {list(size)}")
        for off, target in pieces.items():
            covered = 0
            for chunk in stored.chunks:
                lo = [max(a, b) for a, b in zip(off, chunk.offsets)]
                hi = [min(a + n, b + m) for a, n, b, m in zip(off, target.shape, chunk.offsets, chunk.sizes)]
                if any(h <= low for low, h in zip(lo, hi)):
                    continue
                if chunk.transforms:
                    raise ValueError(f"{url}: {fqn} was written with DCP stream extensions "
                                     f"{chunk.transforms}; llamarl reads plain DCP checkpoints")
                lengths = tuple(h - low for low, h in zip(lo, hi))
                view = target
                for d, (low, n) in enumerate(zip(lo, lengths)):
                    view = view.narrow(d, low - off[d], n)
                reads.append(_Read(chunk.file, chunk.begin, chunk.end,
                                   tuple(low - c for low, c in zip(lo, chunk.offsets)), lengths, view))
                covered += int(torch.Size(lengths).numel())
            if covered != target.numel():
                raise ValueError(f"{url}: the stored chunks of {fqn} cover {covered} of the {target.numel()} "
                                 f"elements asked for at {list(off)}; the checkpoint is damaged")
    return reads


def _copy_stored(target: torch.Tensor, buf: torch.Tensor, stored: dcp_index.StoredTensor, offsets, lengths,
                 non_blocking: bool) -> None:
    """Copy the region ``offsets``/``lengths`` of a stored tensor lying in the uint8 ``buf`` into
    ``target``: as bytes where both have unit last stride (any alignment, no temporary), otherwise
    through an aligned copy of the stored dtype."""
    dtype, _size, stride, begin = stored
    item = dtype.itemsize
    lengths = list(lengths) or [1]
    stride = list(stride) or [1]
    begin += item * sum(o * st for o, st in zip(offsets, stride))
    tgt = target.reshape(1) if target.dim() == 0 else target
    if stride[-1] == 1:  # rows of bytes
        src = buf.as_strided((*lengths[:-1], lengths[-1] * item), (*(st * item for st in stride[:-1]), 1), begin)
        if dtype == target.dtype and tgt.stride(-1) == 1:
            tgt.view(torch.uint8).copy_(src, non_blocking=non_blocking)
            return
        # Another dtype (fp32 masters from bf16 weights): the rows into a tensor of the stored
        # dtype on the target's device, converted there (a conversion on the host, or a copy
        # across devices that converts, takes seconds at 1 B parameters).
        tmp = torch.empty(lengths, dtype=dtype, device=tgt.device)
        tmp.view(torch.uint8).copy_(src, non_blocking=non_blocking)
    else:  # a stored tensor strided in its last dimension: its bytes gathered element by element
        src = buf.as_strided((*lengths, item), (*(st * item for st in stride), 1), begin)
        tmp = torch.empty(lengths, dtype=dtype)
        tmp.view(torch.uint8).view(*lengths, item).copy_(src)
    tgt.copy_(tmp.view(tgt.shape))


def _ranges(reads: list[_Read], block_bytes: int) -> list[tuple[str, int, int, list[_Read]]]:
    """Reads grouped into coalesced byte ranges of one file: [(file, begin, end, reads)]."""
    per_file: dict[str, list[_Read]] = defaultdict(list)
    for r in reads:
        per_file[r.file].append(r)
    out = []
    for name, rs in per_file.items():
        rs.sort(key=lambda r: r.begin)
        run = [rs[0]]
        for r in rs[1:]:
            end = max(x.end for x in run)
            if r.begin - end <= _GAP_BYTES and max(end, r.end) - run[0].begin <= block_bytes:
                run.append(r)
            else:
                out.append((name, run[0].begin, end, run))
                run = [r]
        out.append((name, run[0].begin, max(x.end for x in run), run))
    return out


_DIRECT_BYTES = 1 << 20  # items this large are read straight into their target where they can be
_EDGE_BYTES = 64 << 10  # of such an item, what is read first: its zip directory, pickle, data offset


def _header(fs, path: str, begin: int, end: int) -> dcp_index.StoredTensor | None:
    """Where the tensor of a large item (bytes ``begin:end``) lies, from its first and last bytes only."""
    n = end - begin
    head, tail = bytearray(min(n, _EDGE_BYTES)), bytearray(min(n, _EDGE_BYTES))
    ranges.read_into(fs, path, begin, memoryview(head))
    ranges.read_into(fs, path, end - len(tail), memoryview(tail))
    return dcp_index.parse_item(ranges.Sparse(bytes(head), bytes(tail), n))


def _flat_span(r: _Read, stored: dcp_index.StoredTensor | None) -> tuple[int, int] | None:
    """(file offset, bytes) of what ``r`` reads when it is one run of bytes that maps 1:1 onto a
    contiguous target of the same dtype (whole chunks, or rows of them: a layout read as written,
    or split along dim 0); None otherwise."""
    if stored is None:
        return None
    dtype, size, stride, begin = stored
    t = r.target
    if dtype != t.dtype or not t.is_contiguous() or not size:
        return None
    contiguous = torch.empty(size, device="meta").stride()  # torch's strides, as torch.save writes them
    if tuple(stride) != contiguous or any(r.offsets[1:]) or tuple(r.lengths[1:]) != tuple(size[1:]):
        return None
    row = t.element_size() * contiguous[0]
    return r.begin + begin + r.offsets[0] * row, r.lengths[0] * row


def _copy_range(buf: torch.Tensor, begin: int, rs: list[_Read], pin: bool) -> None:
    """Copy each of ``rs`` out of ``buf``, the bytes of its file from ``begin`` on."""
    view = memoryview(buf.numpy()).cast("B")
    for r in rs:
        stored = dcp_index.parse_item(ranges.MemoryFile(view[r.begin - begin : r.end - begin]), r.begin - begin)
        if stored is not None:
            _copy_stored(r.target, buf, stored, r.offsets, r.lengths, non_blocking=pin and r.target.is_cuda)
            continue
        tensor = torch.load(io.BytesIO(bytes(view[r.begin - begin : r.end - begin])), map_location="cpu",
                            weights_only=True)
        r.target.copy_(tensor[tuple(slice(o, o + n) for o, n in zip(r.offsets, r.lengths))])


STAGING_BYTES = 16 << 20  # the size of each pinned buffer that blocks bound for a GPU pass through


def _read(url: str, reads: list[_Read], block_bytes: int, threads: int) -> None:
    """Read ``reads`` with ``threads`` threads, at most that many blocks in flight.

    Small items are read in coalesced ranges and copied out of them. A large item that maps 1:1
    onto its target (``_flat_span``) has its first and last bytes read, then its data in blocks:
    straight into a CPU target; for a GPU target, through ``threads + 2`` pinned buffers pinned
    once per load, and non-blocking copies (``ranges.read_staged``)."""
    fs, root = fsspec.core.url_to_fs(url)
    gpu = any(r.target.is_cuda for r in reads) and torch.cuda.is_available()
    if gpu:
        block_bytes = min(block_bytes, STAGING_BYTES)
    small = [r for r in reads if r.end - r.begin < _DIRECT_BYTES]
    large = [r for r in reads if r.end - r.begin >= _DIRECT_BYTES]
    # (path, begin, bytes, into: the CPU tensor to read into, or None for a buffer, then: what
    # to do with the bytes read, or None)
    jobs: list[tuple] = []
    with ThreadPoolExecutor(max(1, threads)) as pool:
        for r, stored in zip(large, pool.map(lambda r: _header(fs, f"{root}/{r.file}", r.begin, r.end), large)):
            span = _flat_span(r, stored)
            if span is None:
                small.append(r)
                continue
            begin, nbytes = span
            target = r.target.detach().view(-1).view(torch.uint8)
            path = f"{root}/{r.file}"
            for k in range(0, nbytes, block_bytes):
                n = min(block_bytes, nbytes - k)
                if target.is_cuda:
                    jobs.append((path, begin + k, n, None,
                                 lambda buf, dst=target[k : k + n]: dst.copy_(buf, non_blocking=True)))
                else:
                    jobs.append((path, begin + k, n, target[k : k + n], None))
        for name, begin, end, rs in _ranges(small, block_bytes) if small else []:
            jobs.append((f"{root}/{name}", begin, end - begin, None,
                         lambda buf, begin=begin, rs=rs: _copy_range(buf, begin, rs, gpu)))
        if gpu:
            ranges.read_staged(fs, pool, jobs, threads)
        else:
            mine = threading.local()  # each thread's buffer, grown as needed and reused

            def run(path, begin, n, into, then):
                buf = into
                if buf is None:
                    if getattr(mine, "buf", None) is None or mine.buf.numel() < n:
                        mine.buf = torch.empty(n, dtype=torch.uint8)
                    buf = mine.buf[:n]
                ranges.read_into(fs, path, begin, memoryview(buf.numpy()))
                if then is not None:
                    then(buf)

            for fut in [pool.submit(run, *job) for job in jobs]:
                fut.result()
    if gpu:
        torch.cuda.current_stream().synchronize()


def mapped(url: str, index: dict[str, dcp_index.Stored], fqn: str) -> torch.Tensor | None:
    """Tensor ``fqn`` of a checkpoint on a local file system, whole, as a view of its file's page
    cache (``ranges.mapped``: no copy), where it is stored as one plain contiguous chunk; None
    otherwise (``read`` it). ``index``: the checkpoint's ``read_index``."""
    stored = index.get(fqn)
    if stored is None or len(stored.chunks) != 1:
        return None
    return mapped_chunk(url, stored.chunks[0], stored.dtype)


def mapped_chunk(url: str, chunk: dcp_index.Chunk, dtype: torch.dtype) -> torch.Tensor | None:
    """One stored chunk (of ``chunk.sizes``) of a checkpoint on a local file system, as a view of
    its file's pages, where its item is a plain contiguous tensor of ``dtype``; None otherwise."""
    fs, root = fsspec.core.url_to_fs(url.rstrip("/"))
    if not is_local(fs) or chunk.transforms:
        return None
    path = f"{root}/{chunk.file}"
    item = _header(fs, path, chunk.begin, chunk.end)
    size, numel = chunk.sizes, math.prod(chunk.sizes)
    if (item is None or item.dtype != dtype or item.size != size or not size
            or item.stride != torch.empty(size, device="meta").stride() or not numel):
        return None
    begin = chunk.begin + item.begin
    return ranges.mapped(fs, path, begin, begin + numel * item.dtype.itemsize, item.dtype).view(size)


def read(state: dict, url: str, index: dict[str, dcp_index.Stored] | None = None) -> None:
    """Fill the tensors/chunks of ``state`` in place from the checkpoint at ``url`` (written at any
    layout: each piece is read from the chunks it overlaps), on this rank alone. ``index``: the
    checkpoint's ``read_index``, when the caller has it. A missing tensor or a shape that
    differs is a ``KeyError`` / ``ValueError``; a damaged item fails in its reader."""
    url = url.rstrip("/")
    with torch.no_grad():
        _read(url, _plan(state, index if index is not None else read_index(url), url), BLOCK_BYTES, READ_THREADS)


def load(state: dict, url: str) -> None:
    """Collective ``read``: a failure on any rank raises on every rank."""
    url = url.rstrip("/")
    error, cause = None, None
    try:
        read(state, url)
    except Exception as e:  # reported on every rank below
        error, cause = f"rank {collectives.rank_world()[0]}: {type(e).__name__}: {e}", e
    error = collectives.agree(error)
    if error is not None:
        raise RuntimeError(f"loading the checkpoint {url} failed: {error}") from cause


def load_model(model, url: str) -> None:
    """Fill ``model``'s parameters (any layout) from a checkpoint's DCP directory."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for name, chunks in _param_chunks(model, params, hf_mapping.hf_shapes(model.cfg, model.hf_head)).items():
            if sum(view.numel() for _, _, view in chunks) < params[name].numel():
                params[name].zero_()  # vocabulary padding rows are not in the checkpoint: they must read as zeros
        load(model_state(model, params), url)
    collectives.barrier()
