"""Process groups: set up from the torchrun environment, owned by megatron-core's ``parallel_state``.

Everything in llamarl asks this module for ranks and groups; nothing else builds groups.
NCCL on GPU, gloo on CPU — the same collectives are used on both.
"""

from __future__ import annotations

import datetime
import os
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class Topology:
    """This rank's place in the TP × PP × DP grid."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1


_TOPOLOGY: Topology | None = None


def _ps():
    # Imported lazily: `import megatron.core` costs seconds, and CLI start-up must not pay it.
    # Its import warns that Transformer Engine / Apex are missing; lib/ uses neither.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*Transformer Engine and Apex.*")
        from megatron.core import parallel_state

    return parallel_state


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def init(tp: int = 1, pp: int = 1, *, backend: str | None = None, timeout_s: int = 600) -> Topology:
    """Join the job's process group (from torchrun's environment) and build the TP/PP/DP groups.

    May be called again with another layout after ``destroy_model_parallel()``; the global
    process group is kept."""
    global _TOPOLOGY
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
    world = dist.get_world_size()
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not a multiple of tp*pp = {tp}*{pp}; launch tp*pp*dp processes")
    ps = _ps()
    destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    _TOPOLOGY = Topology(
        tp=tp,
        pp=pp,
        dp=world // (tp * pp),
        tp_rank=ps.get_tensor_model_parallel_rank(),
        pp_rank=ps.get_pipeline_model_parallel_rank(),
        dp_rank=ps.get_data_parallel_rank(),
    )
    return _TOPOLOGY


def destroy_model_parallel() -> None:
    """Drop the TP/PP/DP groups, keeping the global process group.

    megatron-core's ``destroy_model_parallel`` only forgets its groups; the communicators (and
    gloo's threads) would live on, one set per ``init``. So every group but the world's is
    destroyed here too."""
    global _TOPOLOGY
    if _TOPOLOGY is None:
        return
    _ps().destroy_model_parallel()
    from torch.distributed import distributed_c10d as c10d

    for group in list(c10d._world.pg_map):
        if group is not c10d.GroupMember.WORLD:
            dist.destroy_process_group(group)
    _TOPOLOGY = None


def shutdown() -> None:
    """Tear down the groups and the process group (end of a stage)."""
    destroy_model_parallel()
    if dist.is_initialized():
        dist.destroy_process_group()


def topology() -> Topology:
    """The current layout; a single-process layout when ``init`` was never called."""
    return _TOPOLOGY or Topology(1, 1, 1, 0, 0, 0)


def tp_group():
    return _ps().get_tensor_model_parallel_group() if _TOPOLOGY else None


def dp_group():
    return _ps().get_data_parallel_group() if _TOPOLOGY else None


def pp_group():
    return _ps().get_pipeline_model_parallel_group() if _TOPOLOGY else None


def embedding_group():
    """First and last pipeline stage of this TP/DP position: they share tied embeddings."""
    return _ps().get_embedding_group() if _TOPOLOGY else None


def model_parallel_group():
    """TP × PP ranks holding one copy of the model (the group for gradient-norm reductions)."""
    return _ps().get_model_parallel_group() if _TOPOLOGY else None


def pp_next_rank() -> int:
    return _ps().get_pipeline_model_parallel_next_rank()


def pp_prev_rank() -> int:
    return _ps().get_pipeline_model_parallel_prev_rank()


def manual_seed(seed: int) -> torch.Generator:
    """Seed this rank.

    The default generator gets the same seed on every TP and PP rank, so replicated work (sampling
    a token, initialising a replicated weight) agrees across the model-parallel group. The returned
    generator is offset by the TP rank, for work that must differ between TP shards (dropout on
    sharded activations)."""
    topo = topology()
    torch.manual_seed(seed)
    gen = torch.Generator(device=device())
    gen.manual_seed(seed + 2718 + topo.tp_rank)
    return gen
