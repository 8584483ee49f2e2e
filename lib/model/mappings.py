"""Tensor- and sequence-parallel communication as autograd functions, on plain torch.distributed.

Each function names what its forward does; its backward is the dual. Activations are 2-D
``[tokens, features]``, so sequence parallelism splits dim 0. Every function takes the TP group it
communicates over (a model's ``tp_group``); with a group of one rank, or None, it is the identity.
megatron-core's mappings, on gloo and NCCL alike (docs/lib.md, "megatron-core").
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed import ProcessGroup

from llamarl.lib.distributed.parallel import group_rank, group_size

# torch 2.13 renamed these two (the old names warn); torch 2.11 on the GPU image has only the old.
_all_gather_single = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)
_reduce_scatter_single = getattr(dist, "reduce_scatter_single", dist.reduce_scatter_tensor)


def all_reduce(x: torch.Tensor, group: ProcessGroup | None, op=dist.ReduceOp.SUM) -> torch.Tensor:
    """``x`` (contiguous) reduced over ``group`` in place and returned (no autograd); a group of
    one, or None, runs no collective."""
    if group_size(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def all_gather(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    """``x`` of every rank of ``group``, concatenated along dim 0 (no autograd)."""
    x = x.contiguous()
    out = x.new_empty((x.shape[0] * group_size(group), *x.shape[1:]))
    _all_gather_single(out, x, group=group)
    return out


def _reduce_scatter(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((x.shape[0] // group_size(group), *x.shape[1:]))
    _reduce_scatter_single(out, x, group=group)
    return out


def _split(x: torch.Tensor, group: ProcessGroup) -> torch.Tensor:
    n = x.shape[0] // group_size(group)
    r = group_rank(group)
    return x[r * n : (r + 1) * n].contiguous()


class _CopyToTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _GatherFromSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, grad_is_partial):
        ctx.group, ctx.grad_is_partial = group, grad_is_partial
        return all_gather(x, group)

    @staticmethod
    def backward(ctx, g):
        return (_reduce_scatter(g, ctx.group) if ctx.grad_is_partial else _split(g, ctx.group)), None, None


class _ReduceScatterToSP(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, g):
        return all_gather(g, ctx.group), None


def copy_to_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Identity; the gradient is summed over TP. Used where a replicated tensor feeds TP-sharded
    work (the input of a column-parallel linear), and on a replicated *weight* whose every TP
    rank sees only part of the tokens (norms under sequence parallelism)."""
    return _CopyToTP.apply(x, group) if group_size(group) > 1 else x


def reduce_from_tp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum over TP (the output of a row-parallel linear); the gradient passes unchanged."""
    return _ReduceFromTP.apply(x, group) if group_size(group) > 1 else x


def gather_from_sp(x: torch.Tensor, group: ProcessGroup | None, grad_is_partial: bool = True) -> torch.Tensor:
    """All-gather the tokens. The gradient is reduce-scattered when each rank's gradient of the
    full tensor is partial (it feeds TP-sharded work), or simply split when it is replicated."""
    return _GatherFromSP.apply(x, group, grad_is_partial) if group_size(group) > 1 else x


def reduce_scatter_to_sp(x: torch.Tensor, group: ProcessGroup | None) -> torch.Tensor:
    """Sum over TP and keep this rank's slice of the tokens (row-parallel output under SP)."""
    return _ReduceScatterToSP.apply(x, group) if group_size(group) > 1 else x


class SumReplicatedKV(torch.autograd.Function):
    """Identity on a fused QKV weight whose k/v rows are replicated on several TP ranks (TP > kv
    heads). Backward sums the k/v gradient over the ranks that hold the same kv head, so the
    replicas stay equal, with one all-reduce over TP into a buffer with a slot per kv head: no
    replica process groups, which would have to be created collectively at start-up."""

    @staticmethod
    def forward(ctx, w, q_rows, kv_head, num_kv_heads, group):
        ctx.args = (q_rows, kv_head, num_kv_heads, group)
        return w

    @staticmethod
    def backward(ctx, g):
        q_rows, kv_head, num_kv_heads, group = ctx.args
        kv = g[q_rows:]
        buf = kv.new_zeros((num_kv_heads, *kv.shape))
        buf[kv_head] = kv
        dist.all_reduce(buf, group=group)
        return torch.cat([g[:q_rows], buf[kv_head]]), None, None, None, None
