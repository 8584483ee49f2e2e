"""Training pieces: fp32 gradient buffers and global-norm clipping (``GradBuffer``), ZeRO-1 AdamW
on fp32 master weights (``ShardedAdamW``), the LR schedule (``lr_at``). Mixed precision as
Megatron does it: parameters may be bf16, every number that accumulates is fp32 (gradients,
masters, moments).

``ShardedAdamW`` rather than torch's ``ZeroRedundancyOptimizer``: its moments are saved as chunks
of the same HF-named tensors as the weights, so optimizer state, too, loads into any other layout.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist

from llamarl.lib.files import checkpoint
from llamarl.lib.model import hf_mapping
from llamarl.lib.distributed import parallel
from llamarl.lib.model.layers import own_version
from llamarl.lib.rl import adamw_kernel

MOMENTS = ("exp_avg", "exp_avg_sq")


def _accumulate(p: torch.nn.Parameter) -> None:
    if p.grad is not None:  # None: the linear added it into main_grad itself (lib.layers.linear)
        p.main_grad.add_(p.grad)
        p.grad = None


class GradBuffer:
    """fp32 gradients of ``model``'s parameters in one flat buffer; ``p.main_grad`` is each one's view.
    fp32 parameters get ``.grad`` = that view; lower-precision ones a hook that adds each backward's
    ``.grad`` into it and frees it (or their GEMM adds into it: ``lib.model.layers.linear``)."""

    def __init__(self, model):
        self.model = model
        self.topo = model.topology
        groups = self.topo.groups
        self.dp_group = groups.dp if self.topo.dp > 1 else None
        self.model_parallel_group = groups.model_parallel if self.topo.tp * self.topo.pp > 1 else None
        self.embedding_group = groups.embedding if model.tied_copy() is not None else None
        self._shares = None  # per parameter, for the norm: depends only on the model and layout
        self.params = [p for p in model.parameters() if p.requires_grad]
        dev = self.params[0].device
        self.buffer = torch.zeros(sum(p.numel() for p in self.params), dtype=torch.float32, device=dev)
        offset = 0
        for p in self.params:
            # Each its own version counter (not a view's, shared with the buffer): autograd may
            # save one for backward (the fused linears of lib.layers.region_linear), and writes
            # into the others between that forward and backward must not fail its check.
            p.main_grad = own_version(self.buffer[offset : offset + p.numel()].view_as(p))
            offset += p.numel()
            if p.dtype == torch.float32:
                p.grad = p.main_grad
            elif not getattr(p, "accumulates", False):  # once: a model kept for the next ppo gets a new buffer
                p.register_post_accumulate_grad_hook(_accumulate)
                p.accumulates = True

    def zero(self) -> None:
        self.buffer.zero_()

    def reduce(self) -> None:
        """Sum the gradients over data-parallel replicas (each rank's loss is its share of the mean),
        and the tied embedding's two copies over the first and last pipeline stage."""
        if self.dp_group is not None:
            dist.all_reduce(self.buffer, group=self.dp_group)
        tied = self.model.tied_copy()
        if tied is not None:
            dist.all_reduce(tied.main_grad, group=self.embedding_group)

    def clip_factor(self, max_norm: float | None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the gradients' global L2 norm, the factor that brings it to at most ``max_norm``; None
        without ``max_norm``), both on the device, unread: the norm a 0-d fp64 tensor the caller
        reads with the step's other checks (a non-finite norm leaves the gradients non-finite), the
        factor a 0-d fp32 one that ``ShardedAdamW.step`` applies. Each piece's square is weighted
        by its share: a piece several ranks hold (a replicated norm, a kv head replicated over TP,
        the tied embedding's two copies) counts once, so it is the whole model's norm at any layout."""
        if self._shares is None:
            self._shares = _share_weights(self.model, self.topo)
            # Made once: a tensor from a host list is a copy that waits for the whole backward.
            share = [w for _, _, weights in self._shares.values() for w in weights]
            self._share = torch.tensor(share, dtype=torch.float64).to(self.buffer.device)
        pieces = []
        for name, p in self.model.named_parameters():
            dim, sizes, _ = self._shares[name]
            pieces += list(p.main_grad.split(sizes, dim)) if len(sizes) > 1 else [p.main_grad]
        total = (torch.stack(torch._foreach_norm(pieces)).double().square() * self._share).sum()
        if self.model_parallel_group is not None:
            dist.all_reduce(total, group=self.model_parallel_group)
        norm = total.sqrt()
        # As clip_grad_norm_: a factor clamped to 1 (multiplying by exactly 1 changes nothing), so
        # that no host branch has to read the norm.
        return norm, None if max_norm is None else (max_norm / (norm + 1e-6)).clamp(max=1.0).float()

    def clip(self, max_norm: float | None) -> torch.Tensor:
        """The gradients scaled in place by ``clip_factor``; the norm before."""
        norm, factor = self.clip_factor(max_norm)
        if factor is not None:
            torch._foreach_mul_([p.main_grad for p in self.model.parameters()], factor)
        return norm


def _share_weights(model, topo: parallel.Topology) -> dict[str, tuple[int, list[int], list[float]]]:
    """For each parameter: the dim and sizes of its HF slices, and for each slice 1 / (number of
    ranks in its TP group holding the same slice). Per slice, not per parameter: at tp > kv heads a
    fused qkv weight holds its own query rows but key/value rows that other ranks hold too."""

    def key(s):
        return s.hf_name, s.start, s.stop

    weights = {}
    for name, _ in model.named_parameters():
        mine = hf_mapping.param_slices(model.cfg, topo.tp, topo.tp_rank, name)
        held = [{key(s) for s in hf_mapping.param_slices(model.cfg, topo.tp, r, name)} for r in range(topo.tp)]
        tied = 0.5 if topo.pp > 1 and model.tied_head() and name in ("model.embed_tokens.weight", "lm_head.weight") else 1.0
        # (with PP > 1 and tied embeddings the same tensor lives on the first and the last stage)
        weights[name] = (mine[0].dim, [s.stop - s.start for s in mine],
                         [tied / sum(key(s) in h for h in held) for s in mine])
    return weights


class ShardedAdamW:
    """AdamW with fp32 master weights and moments sharded over DP (ZeRO-1).

    Each DP rank owns whole parameters. It steps their fp32 masters from the fp32 ``main_grad``
    (``GradBuffer``), copies the result into the model's parameters (rounding to their dtype) and
    broadcasts them to the other DP ranks. An fp32 parameter is its own master."""

    def __init__(self, model, lr: float, betas=(0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0):
        topo = self.topo = model.topology
        self.dp_group = topo.groups.dp if topo.dp > 1 else None
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
        # One dtype for all parameters: every rank (owning parameters or not) agrees on this.
        self.separate_masters = named[0][1].dtype != torch.float32
        self.master = {n: p.detach().float() if self.separate_masters else p
                       for n, p in named if self.owner[n] == topo.dp_rank}
        masters = list(self.master.values()) or [torch.zeros(1, requires_grad=True)]
        self.device = named[0][1].device
        # The fused kernel on CUDA (one launch for all tensors); the per-tensor loop on CPU, where
        # the tests compare layouts at 1e-5 and need the reference arithmetic. ``one_pass``: the
        # whole step in one pass over memory (lib/rl/adamw_kernel.py); ``inner`` then only holds
        # the moments, and ``steps`` counts the steps its bias corrections are of.
        self.fused = self.device.type == "cuda"
        self.one_pass = adamw_kernel.wanted(self.device) and {p.dtype for _, p in named} <= {torch.bfloat16, torch.float32}
        kernel = {"fused": True} if self.fused else {"foreach": False}
        self.inner = torch.optim.AdamW(masters, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay, **kernel)
        self.names = {m: n for n, m in self.master.items()}
        self.steps = 0
        self._largest: torch.Tensor | None = None  # of the masters, as the last one-pass step found it

    @property
    def lr(self) -> float:
        return self.inner.param_groups[0]["lr"]

    @lr.setter
    def lr(self, value: float) -> None:
        for g in self.inner.param_groups:
            g["lr"] = value

    @property
    def param_dtype(self) -> torch.dtype:
        """The dtype of the model's parameters, which the masters are copied into after each step."""
        return next(iter(self.params.values())).dtype

    def largest_master(self) -> torch.Tensor:
        """The largest magnitude among this rank's fp32 masters: a 0-d tensor on the device, NaN
        when one is NaN (one fused pass, ``torch._foreach_norm`` of order inf; no host sync)."""
        masters = list(self.master.values())
        if not masters:
            return torch.zeros((), device=self.device)
        if self._largest is not None:
            return self._largest  # inf, not NaN, where one is NaN: as large as can be
        with torch.no_grad():  # fp32 parameters are their own masters: no graph to record
            return torch.stack(torch._foreach_norm(masters, ord=math.inf)).max()

    def step(self, factor: torch.Tensor | None = None) -> None:
        """One AdamW step of this rank's masters from their ``main_grad``, times ``factor`` (the
        clip, ``GradBuffer.clip_factor``) first; the parameters from the masters, on every DP rank."""
        grads = {n: self.params[n].main_grad for n in self.master}
        self.steps += 1
        if self.one_pass and self.master:
            self._one_pass(grads, factor)
        else:
            if factor is not None:
                torch._foreach_mul_(list(grads.values()), factor)
            for n, m in self.master.items():
                m.grad = grads[n]
            self.inner.step()
            self._write_back()
        if self.dp_group is not None:
            ranks = dist.get_process_group_ranks(self.dp_group)
            for n, p in self.params.items():
                dist.broadcast(p.data, src=ranks[self.owner[n]], group=self.dp_group)

    def _one_pass(self, grads: dict[str, torch.Tensor], factor: torch.Tensor | None) -> None:
        group = self.inner.param_groups[0]
        states = [self.inner.state[m] for m in self.master.values()]
        for st, m in zip(states, self.master.values()):
            if not st:  # fresh moments, as torch's step makes them
                st.update(step=torch.zeros((), device=self.device), exp_avg=torch.zeros_like(m),
                          exp_avg_sq=torch.zeros_like(m))
        if self._largest is None:
            self._largest = torch.zeros((), device=self.device)
        adamw_kernel.step(list(self.master.values()), list(grads.values()), [st["exp_avg"] for st in states],
                          [st["exp_avg_sq"] for st in states],
                          [self.params[n] if self.separate_masters else None for n in self.master], factor,
                          self._largest, self.steps, group["lr"], group["betas"], group["eps"], group["weight_decay"])

    def _write_back(self) -> None:
        """The masters into the model's parameters (rounded to their dtype)."""
        with torch.no_grad():
            for n, m in self.master.items():
                if m is not self.params[n]:
                    self.params[n].copy_(m)

    # ---- checkpoint ------------------------------------------------------------------------

    def _state_of(self, tensors: dict[str, dict]) -> dict:
        """DCP chunks of per-parameter ``{kind: {name: tensor}}`` under ``<hf name>.<kind>``."""
        out = {}
        for k, ts in tensors.items():
            out.update(checkpoint.model_state(self.model, tensors=ts, suffix=f".{k}"))
        return out

    def model_state(self, dtype: torch.dtype) -> dict:
        """The model's DCP state from the masters at full precision, stored as ``dtype``: each DP
        rank writes the parameters it owns."""
        return checkpoint.model_state(self.model, tensors={n: m.detach().to(dtype) for n, m in self.master.items()})

    def state(self) -> dict:
        """This rank's moments (and masters, when they are copies) as DCP chunks under
        ``<hf name>.exp_avg`` / ``.exp_avg_sq`` / ``.master``."""
        tensors = {k: {self.names[m]: st[k] for m, st in self.inner.state.items() if m in self.names} for k in MOMENTS}
        if self.separate_masters:
            tensors["master"] = self.master
        return self._state_of(tensors)

    def load_state(self, url: str | None, step: int, model_url: str | None = None) -> None:
        """Collective. Fill this rank's optimizer state, for any layout: moments from the
        checkpoint's ``optim`` DCP folder ``url`` (None: fresh moments); masters from ``url`` when it
        has them, else from the model checkpoint ``model_url`` at its stored precision, else from
        the parameters."""
        stored = checkpoint.read_index(url) if url else {}
        wanted = list(MOMENTS) if url else []
        if self.separate_masters:
            if any(k.endswith(".master") for k in stored):
                wanted.append("master")
            elif model_url:
                checkpoint.load(checkpoint.model_state(self.model, tensors=self.master), model_url)
            else:
                with torch.no_grad():
                    for n, m in self.master.items():
                        m.copy_(self.params[n])
        targets = {k: self.master if k == "master" else {n: torch.zeros_like(m) for n, m in self.master.items()}
                   for k in wanted}
        self.steps, self._largest = (step if url else 0), None  # fresh moments: bias corrections from step 1
        if url:
            checkpoint.load(self._state_of(targets), url)
            for n, m in self.master.items():
                count = torch.tensor(float(step), device=self.device if self.fused else "cpu")
                self.inner.state[m] = {"step": count, "exp_avg": targets["exp_avg"][n], "exp_avg_sq": targets["exp_avg_sq"][n]}
        self._write_back()


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
