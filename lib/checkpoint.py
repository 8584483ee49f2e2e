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
"""

from __future__ import annotations

from collections import defaultdict

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint._fsspec_filesystem import FsspecReader, FsspecWriter
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner, DefaultSavePlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    MetadataIndex,
    TensorProperties,
)
from torch.distributed.checkpoint.planner import TensorWriteData, WriteItem, WriteItemType

from . import hf_mapping


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


def save(state: dict, url: str, threads: int = 4) -> None:
    """Collective: every rank of the default group calls it with its own state, written by
    ``threads`` writer threads into as many files (a training state is tens of GB per rank)."""
    writer = FsspecWriter(url, single_file_per_rank=True, sync_files=False, thread_count=threads)
    dcp.save(state, storage_writer=writer, planner=_SavePlanner())


def load(state: dict, url: str) -> None:
    """Collective. Fills the tensors/chunks of ``state`` in place from the checkpoint at ``url``."""
    dcp.load(state, storage_reader=FsspecReader(url), planner=_LoadPlanner())


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
