"""Training pieces: contiguous gradient buffers, global-norm clipping, ZeRO-1 AdamW, LR schedule.

* ``GradBuffer``: every parameter's ``.grad`` is a view into one flat buffer per dtype, so the
  data-parallel reduction is one all-reduce per dtype, not one per tensor.
* ``clip_grad_norm``: the norm of the *whole* model's gradient, whatever the layout: each TP/PP
  rank adds its shards, and pieces held by several ranks (replicated norms, kv heads replicated
  over TP, tied embeddings on two pipeline stages) are counted once.
* ``ShardedAdamW``: ZeRO-1 — each DP rank keeps AdamW moments for its share of the parameters,
  updates those, and broadcasts them. Written here rather than taken from torch's
  ``ZeroRedundancyOptimizer`` because checkpoints need to know who owns which moments: they are
  saved as chunks of the same HF-named tensors as the weights, so optimizer state, too, loads
  into any other layout.
"""

from __future__ import annotations

import math
from collections import defaultdict

import torch
import torch.distributed as dist

from . import checkpoint, hf_layout, parallel


class GradBuffer:
    def __init__(self, params: list[torch.nn.Parameter]):
        self.params = [p for p in params if p.requires_grad]
        by_dtype: dict[torch.dtype, list] = defaultdict(list)
        for p in self.params:
            by_dtype[p.dtype].append(p)
        self.buffers = {}
        for dtype, ps in by_dtype.items():
            buf = torch.zeros(sum(p.numel() for p in ps), dtype=dtype, device=ps[0].device)
            offset = 0
            for p in ps:
                p.grad = buf[offset : offset + p.numel()].view_as(p)
                offset += p.numel()
            self.buffers[dtype] = buf

    def zero(self) -> None:
        for buf in self.buffers.values():
            buf.zero_()

    def all_reduce_dp(self) -> None:
        """Sum the gradients over data-parallel replicas (each rank's loss is its share of the mean)."""
        if parallel.topology().dp > 1:
            for buf in self.buffers.values():
                dist.all_reduce(buf, group=parallel.dp_group())


def _share_weights(model) -> dict[str, float]:
    """For each parameter, 1 / (number of ranks in its TP group holding the same values)."""
    topo = parallel.topology()
    weights = {}
    for name, _ in model.named_parameters():
        mine = [(s.hf_name, s.start) for s in hf_layout.param_slices(model.cfg, topo.tp, topo.tp_rank, name)]
        copies = sum(1 for r in range(topo.tp)
                     if [(s.hf_name, s.start) for s in hf_layout.param_slices(model.cfg, topo.tp, r, name)] == mine)
        weights[name] = 1.0 / copies
    if topo.pp > 1 and model.tied_head():
        for name in ("model.embed_tokens.weight", "lm_head.weight"):
            if name in weights:
                weights[name] *= 0.5  # the same tensor lives on the first and the last stage
    return weights


def clip_grad_norm(model, max_norm: float | None) -> float:
    """Scale gradients so their global L2 norm is at most ``max_norm``; returns the norm before."""
    weights = getattr(model, "_grad_norm_weights", None)
    if weights is None:  # depends only on the model and layout: computed once, not every step
        weights = model._grad_norm_weights = _share_weights(model)
    dev = next(model.parameters()).device
    total = torch.zeros((), dtype=torch.float64, device=dev)
    for name, p in model.named_parameters():
        if p.grad is not None:
            total += weights[name] * p.grad.double().square().sum()
    if parallel.topology().tp * parallel.topology().pp > 1:
        dist.all_reduce(total, group=parallel.model_parallel_group())
    norm = float(total.sqrt())
    if max_norm is not None and norm > max_norm:
        for p in model.parameters():
            if p.grad is not None:
                p.grad.mul_(max_norm / (norm + 1e-6))
    return norm


class ShardedAdamW:
    """AdamW with its moments sharded over DP (ZeRO-1)."""

    def __init__(self, model, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        topo = parallel.topology()
        self.model = model
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        # Largest first onto the least loaded rank: balanced, and the same on every DP rank.
        load = [0] * topo.dp
        self.owner: dict[str, int] = {}
        for n, p in sorted(named, key=lambda x: (-x[1].numel(), x[0])):
            r = min(range(topo.dp), key=lambda i: (load[i], i))
            self.owner[n] = r
            load[r] += p.numel()
        self.params = dict(named)
        mine = [p for n, p in named if self.owner[n] == topo.dp_rank]
        self.inner = torch.optim.AdamW(mine or [torch.zeros(1, requires_grad=True)], lr=lr, betas=betas, eps=eps,
                                       weight_decay=weight_decay, foreach=False)
        self.names = {p: n for n, p in named}

    @property
    def lr(self) -> float:
        return self.inner.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        for g in self.inner.param_groups:
            g["lr"] = value

    def step(self) -> None:
        self.inner.step()
        topo = parallel.topology()
        if topo.dp > 1:
            group = parallel.dp_group()
            ranks = dist.get_process_group_ranks(group)
            for n, p in self.params.items():
                dist.broadcast(p.data, src=ranks[self.owner[n]], group=group)

    # ---- checkpoint ------------------------------------------------------------------------

    def state(self, step: int) -> dict:
        """This rank's moments as DCP chunks under ``<hf name>.exp_avg`` / ``.exp_avg_sq``."""
        moments: dict[str, dict] = {"exp_avg": {}, "exp_avg_sq": {}}
        for p, st in self.inner.state.items():
            name = self.names.get(p)
            if name is None:
                continue
            for k in moments:
                moments[k][name] = st[k]
        out = {}
        for k, tensors in moments.items():
            out.update(checkpoint.model_state(self.model, tensors=tensors, suffix=f".{k}"))
        return out

    def load_state(self, url: str, step: int) -> None:
        """Fill this rank's moments from a checkpoint's ``optim`` DCP folder, for any layout."""
        topo = parallel.topology()
        moments = {k: {n: torch.zeros_like(p) for n, p in self.params.items() if self.owner[n] == topo.dp_rank}
                   for k in ("exp_avg", "exp_avg_sq")}
        state = {}
        for k, tensors in moments.items():
            state.update(checkpoint.model_state(self.model, tensors=tensors, suffix=f".{k}"))
        checkpoint.load(state, url)
        for n, p in self.params.items():
            if self.owner[n] == topo.dp_rank:
                self.inner.state[p] = {"step": torch.tensor(float(step)), "exp_avg": moments["exp_avg"][n],
                                       "exp_avg_sq": moments["exp_avg_sq"][n]}


def lr_at(step: int, base: float, warmup: int, total: int | None, decay: str = "constant", min_ratio: float = 0.0) -> float:
    """Learning rate at optimizer step ``step`` (0-based): linear warm-up over ``warmup`` steps,
    then ``constant``, ``linear`` or ``cosine`` decay to ``min_ratio·base`` at ``total`` steps."""
    if warmup and step < warmup:
        return base * (step + 1) / warmup
    if decay == "constant" or not total:
        return base
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    if decay == "linear":
        factor = 1 - progress
    elif decay == "cosine":
        factor = 0.5 * (1 + math.cos(math.pi * progress))
    else:
        raise ValueError(f"lr decay {decay!r}: use constant, linear or cosine")
    return base * (min_ratio + (1 - min_ratio) * factor)
