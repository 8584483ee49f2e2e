"""Pipeline parallelism: run micro-batches through the stages with a 1F1B schedule.

Hidden states go point to point between neighbouring stages (``batch_isend_irecv``: a send and a
receive in opposite directions never deadlock). Every stage gets the same micro-batches, so a
receiver knows each activation's shape, ``[tokens on this rank, hidden]``, without a handshake.
1F1B: stage s runs ``pp - s - 1`` forwards (warm-up), then alternates one forward with one
backward, then drains the rest: at most ``pp - s`` micro-batches are alive on a stage at once.
"""

from __future__ import annotations

import functools
from collections import deque
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from llamarl.lib.model.batch import TokenBatch
from llamarl.lib.model.llama import ParallelLlama
from llamarl.lib.distributed.parallel import Topology

LossFn = Callable[[torch.Tensor, Any], torch.Tensor]


def _p2p(topo: Topology, send_next=None, send_prev=None, recv_prev=None, recv_next=None):
    """One batch of point-to-point ops with this rank's neighbouring stages; ``recv_*`` are
    (shape, dtype, device). Returns the received tensors (from the previous stage, from the next)."""
    got = [None if r is None else torch.empty(r[0], dtype=r[1], device=r[2]) for r in (recv_prev, recv_next)]
    ops = [dist.P2POp(op, t.contiguous(), peer) for op, t, peer in
           ((dist.isend, send_next, topo.next_stage_rank), (dist.isend, send_prev, topo.prev_stage_rank),
            (dist.irecv, got[0], topo.prev_stage_rank), (dist.irecv, got[1], topo.next_stage_rank)) if t is not None]
    if ops:
        for work in dist.batch_isend_irecv(ops):
            work.wait()
    return got[0], got[1]


def forward_backward(
    model: ParallelLlama,
    batches: Sequence[TokenBatch],
    loss_fn: LossFn | None = None,
    extras: Sequence[Any] | None = None,
    *,
    forward_only: bool = False,
) -> list[Any]:
    """Run ``batches`` (micro-batches) through this rank's stage.

    On the last stage ``loss_fn(output, extra)`` turns each micro-batch's head output into a
    scalar loss, which is back-propagated (scale it by 1 / len(batches) yourself for a mean).
    Returns, on the last stage, the losses (or, with ``forward_only``, the head outputs);
    elsewhere an empty list. Gradients accumulate in ``.grad`` as usual."""
    topo = model.topology
    p2p = functools.partial(_p2p, topo)
    first, last = topo.is_first_stage, topo.is_last_stage
    extras = list(extras) if extras is not None else [None] * len(batches)
    dev = next(model.parameters()).device
    sp = model.layout.tp if model.layout.sequence_parallel else 1  # the tokens' split between TP ranks
    results: list[Any] = []
    n = len(batches)

    def recv_spec(i):
        return (batches[i].num_tokens // sp, model.cfg.hidden_size), model.dtype, dev

    def run_forward(i, received):
        x = None
        if not first:
            x = received.requires_grad_(not forward_only)
        with torch.set_grad_enabled(not forward_only):
            out = model(batches[i], x)
        if last:
            if forward_only:
                results.append(out if loss_fn is None else loss_fn(out, extras[i]).detach())
                return x, None
            loss = loss_fn(out, extras[i])
            results.append(loss.detach())
            return x, loss
        return x, out

    def run_backward(x, out, grad_out):
        if last:
            out.backward()
        else:
            torch.autograd.backward(out, grad_out)
        return x.grad if x is not None else None

    if forward_only:
        for i in range(n):
            recv, _ = p2p(recv_prev=None if first else recv_spec(i))
            _, out = run_forward(i, recv)
            if not last:
                p2p(send_next=out)
        return results

    _one_f_one_b(topo, n, p2p, recv_spec, run_forward, run_backward)
    return results


def _one_f_one_b(topo: Topology, n: int, p2p, recv_spec, run_forward, run_backward) -> None:
    """The 1F1B order (module docstring) of ``n`` micro-batches on this rank's stage, run through
    ``forward_backward``'s ``recv_spec``, ``run_forward`` and ``run_backward``."""
    first, last = topo.is_first_stage, topo.is_last_stage
    warmup = min(topo.pp - topo.pp_rank - 1, n)
    alive: deque = deque()
    for i in range(warmup):
        recv, _ = p2p(recv_prev=None if first else recv_spec(i))
        x, out = run_forward(i, recv)
        p2p(send_next=None if last else out.detach())
        alive.append((x, out, i))

    recv = None
    if warmup < n and not first:
        recv, _ = p2p(recv_prev=recv_spec(warmup))
    for i in range(warmup, n):
        x, out = run_forward(i, recv)
        alive.append((x, out, i))
        # Send this forward's output and receive the gradient for the oldest alive micro-batch.
        _, grad_out = p2p(send_next=None if last else out.detach(),
                           recv_next=None if last else recv_spec(alive[0][2]))
        x0, out0, _ = alive.popleft()
        grad_in = run_backward(x0, out0, grad_out)
        more = i + 1 < n
        recv, _ = p2p(send_prev=None if first else grad_in,
                       recv_prev=recv_spec(i + 1) if (more and not first) else None)

    while alive:
        x0, out0, j = alive.popleft()
        _, grad_out = p2p(recv_next=None if last else recv_spec(j))
        grad_in = run_backward(x0, out0, grad_out)
        p2p(send_prev=None if first else grad_in)


def forward(model: ParallelLlama, batches: Sequence[TokenBatch]) -> list[torch.Tensor]:
    """Inference through all stages; the head outputs on the last stage, [] elsewhere."""
    with torch.no_grad():
        return forward_backward(model, batches, forward_only=True)
