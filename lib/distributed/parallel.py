"""Process groups, built from the torchrun environment: this module is their one owner (nothing
else in llamarl builds a group; how they reach a model: docs/lib.md, "Conventions"). NCCL on GPU,
gloo on CPU. The grid is megatron-core's order (tensor fastest, then data, then pipeline) and the
groups its ``parallel_state`` builds (tests/test_parallel.py checks them against it).
"""

from __future__ import annotations

import datetime
import os
import socket
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from llamarl.lib.distributed import liveness
from llamarl.lib.errors import UserError


@dataclass(frozen=True)
class Groups:
    """This rank's process groups (None: a group of one, nothing to communicate)."""

    tp: ProcessGroup | None = None
    dp: ProcessGroup | None = None
    pp: ProcessGroup | None = None
    model_parallel: ProcessGroup | None = None  # TP × PP: one copy of the model
    embedding: ProcessGroup | None = None  # first and last pipeline stage (PP > 1)


@dataclass(frozen=True)
class Topology:
    """This rank's place in the TP × PP × DP grid, and the groups it communicates over: what
    ``init`` returns, passed to whatever needs to know how the job is split."""

    tp: int
    pp: int
    dp: int
    tp_rank: int
    pp_rank: int
    dp_rank: int
    groups: Groups = field(default=Groups(), compare=False, repr=False)

    @property
    def is_first_stage(self) -> bool:
        return self.pp_rank == 0

    @property
    def is_last_stage(self) -> bool:
        return self.pp_rank == self.pp - 1

    def rank_of(self, tp_rank: int, dp_rank: int, pp_rank: int) -> int:
        return tp_rank + self.tp * (dp_rank + self.dp * pp_rank)

    @property
    def next_stage_rank(self) -> int:
        """Global rank of the next pipeline stage at this TP/DP position (after the last: the first)."""
        return self.rank_of(self.tp_rank, self.dp_rank, (self.pp_rank + 1) % self.pp)

    @property
    def prev_stage_rank(self) -> int:
        return self.rank_of(self.tp_rank, self.dp_rank, (self.pp_rank - 1) % self.pp)


_TOPOLOGY: Topology | None = None
joined_at: float | None = None  # when this process joined the job's process group (the start-up profile)


def device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _await_store(timeout_s: float) -> None:
    """Rank > 0: wait until rank 0's store (``MASTER_ADDR:MASTER_PORT``) accepts a connection,
    trying every 10 ms. torch's store client backs off between its own tries, so a rank that tries
    before rank 0 listens would join up to a second or more after it could (0.3-0.5 s of export's
    2.8 s with 4 processes on the H100). After ``timeout_s``, the rendezvous's error (``job`` names it)."""
    addr, port = os.environ.get("MASTER_ADDR"), os.environ.get("MASTER_PORT")
    if int(os.environ.get("RANK", 0)) == 0 or not addr or not port:
        return
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            socket.create_connection((addr, int(port)), timeout=1).close()
            return
        except socket.gaierror:
            time.sleep(0.5)  # a name not (yet) resolvable: the resolver is asked twice a second
        except OSError:
            time.sleep(0.01)
    raise dist.DistStoreError(f"rank 0's store at {addr}:{port} accepted no connection within {timeout_s} s")


def init(tp: int = 1, pp: int = 1, *, dp: int | None = None, backend: str | None = None, timeout_s: int = 600,
         stage: str | None = None) -> Topology:
    """Join the job's process group (from torchrun's environment) and build the TP/PP/DP groups.

    ``dp``, when given, is the data-parallel size the job was launched for: any other number of
    processes is a one-line ``UserError`` naming ``stage``, before the rendezvous. ``timeout_s``
    bounds every collective, over the job's process group and over each group built here.
    May be called again with another layout after ``destroy_model_parallel()``; the global
    process group is kept."""
    global _TOPOLOGY
    world = dist.get_world_size() if dist.is_initialized() else int(os.environ.get("WORLD_SIZE", 1))
    if dp is not None and world != tp * pp * dp:
        raise UserError(f"{stage or 'this job'} runs with tp*pp*dp = {tp}*{pp}*{dp} = {tp * pp * dp} processes, not "
                        f"{world}; launch it through `llamarl stage` or `llamarl run`, which start that many")
    if world % (tp * pp):
        raise ValueError(f"world size {world} is not a multiple of tp*pp = {tp}*{pp}; launch tp*pp*dp processes")
    timeout = datetime.timedelta(seconds=timeout_s)
    if not dist.is_initialized():
        if backend is None:
            backend = "nccl" if torch.cuda.is_available() else "gloo"
        if backend == "nccl":
            torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", 0)))
        if "RANK" in os.environ or "WORLD_SIZE" in os.environ:
            _await_store(timeout_s)
            dist.init_process_group(backend, timeout=timeout)
        else:  # started by hand, not by torchrun or an executor: a job of one process
            dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout)
        liveness.start()  # so that a rank whose collective fails can name the peer that was lost
        global joined_at
        joined_at = time.time()
    destroy_model_parallel()
    dp, rank = world // (tp * pp), dist.get_rank()
    grid = torch.arange(world).view(pp, dp, tp)  # grid[p, d, t] is rank t + tp * (d + dp * p)
    # Each kind of group as the grid with the axes it spans last: each row of it is one group.
    kinds = {"tp": grid, "dp": grid.movedim(1, -1), "pp": grid.movedim(0, -1),
             "model_parallel": grid.movedim(1, 0).flatten(1)}
    if pp > 1:  # the first and the last pipeline stage
        kinds["embedding"] = grid[[0, -1]].movedim(0, -1)
    mine = {}
    for kind, groups in kinds.items():
        for ranks in groups.reshape(-1, groups.shape[-1]).tolist():
            # Every rank creates every group, in the same order (new_group is collective). A
            # group does not take the job's timeout from the global group: it is given here.
            group = dist.new_group(ranks, timeout=timeout)
            if rank in ranks:
                mine[kind] = group
    _TOPOLOGY = Topology(tp, pp, dp, rank % tp, rank // (tp * dp), (rank // tp) % dp, Groups(**mine))
    return _TOPOLOGY


def destroy_model_parallel() -> None:
    """Drop the TP/PP/DP groups — every group but the world's, whoever made it — with their
    communicators and gloo threads, keeping the global process group."""
    global _TOPOLOGY
    if not dist.is_initialized():
        return
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


def tp_group() -> ProcessGroup | None:
    return topology().groups.tp


def group_size(group: ProcessGroup | None) -> int:
    return 1 if group is None else group.size()


def group_rank(group: ProcessGroup | None) -> int:
    """This rank's index in ``group``; for the TP group, the TP rank."""
    return 0 if group is None else group.rank()


def manual_seed(seed: int) -> torch.Generator:
    """Seed this rank: the default generator alike on every TP and PP rank, so replicated work
    agrees across the model-parallel group; the returned one offset by the TP rank, for work that
    must differ between TP shards (dropout on sharded activations)."""
    topo = topology()
    torch.manual_seed(seed)
    gen = torch.Generator(device=device())
    gen.manual_seed(seed + 2718 + topo.tp_rank)
    return gen
