"""Building blocks: tensor-parallel linears, vocab-parallel embedding, RMSNorm, SwiGLU (rotary: ``rotary.py``).

Activations are ``[tokens, features]``. Under sequence parallelism (SP) the tokens between blocks
are split over TP ranks; a column-parallel linear gathers them first, a row-parallel linear
scatters them after. megatron-core's layers hard-wire that communication on CUDA buffers; ours
hold the same shards and call ``mappings.py`` explicitly, one code path on gloo and NCCL
(docs/lib.md, "megatron-core"). The fused regions, the switches and what they save: docs/training.md.
"""

from __future__ import annotations

import functools
import os

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from llamarl.lib.model import mappings, swiglu_kernel
from llamarl.lib.distributed.parallel import group_rank, group_size


class _ParallelLinear(nn.Module):
    """This rank's ``[out, in]`` weight (and bias) of a TP linear; the subclass says how it splits."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, tp_group: ProcessGroup | None,
                 sequence_parallel: bool, dtype: torch.dtype | None = None):
        super().__init__()
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(out_features, in_features, dtype=dtype))
        self.bias = nn.Parameter(torch.empty(out_features, dtype=dtype)) if bias else None


class ColumnParallelLinear(_ParallelLinear):
    """``y = x Wᵀ`` with W split by output rows over TP (``out_features`` is this rank's); the
    output stays split (per-rank features).

    Input: replicated tokens (``copy_to_tp``: gradient summed over TP) or, under SP, this rank's
    slice of the tokens (gathered first)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(column_input(x, self.tp_group, self.sequence_parallel), self.weight, self.bias)


def column_input(x: torch.Tensor, tp_group: ProcessGroup | None, sequence_parallel: bool) -> torch.Tensor:
    """The input of column-parallel work: all tokens gathered under SP (gradient
    reduce-scattered), else the replicated tokens (gradient summed over TP)."""
    return mappings.gather_from_sp(x, tp_group) if sequence_parallel else mappings.copy_to_tp(x, tp_group)


class RowParallelLinear(_ParallelLinear):
    """``y = x Wᵀ`` with W split by input columns over TP (``in_features`` is this rank's); partial
    outputs are summed over TP (or, under SP, reduce-scattered to this rank's tokens). The bias,
    replicated, is added once after the sum."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = linear(x, self.weight)
        y = output_reduce(y, self.tp_group, self.sequence_parallel)
        if self.bias is not None:
            bias = mappings.copy_to_tp(self.bias, self.tp_group) if self.sequence_parallel else self.bias
            y = y + bias
        return y


def output_reduce(y: torch.Tensor, tp_group: ProcessGroup | None, sequence_parallel: bool) -> torch.Tensor:
    """Partial sums over TP made whole: reduce-scattered to this rank's tokens under SP, else
    all-reduced."""
    return mappings.reduce_scatter_to_sp(y, tp_group) if sequence_parallel else mappings.reduce_from_tp(y, tp_group)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear``; where ``wgrad_target`` names a ``main_grad``, the weight's gradient is added
    into it by the weight-gradient GEMM itself and ``.grad`` stays None."""
    if wgrad_target(weight) is not None:
        return _LinearGradIntoMain.apply(x, weight, bias)
    return F.linear(x, weight, bias)


def wgrad_target(weight: torch.Tensor) -> torch.Tensor | None:
    """The fp32 ``main_grad`` a linear's weight-gradient GEMM should add into (see ``linear`` and
    ``region_linear``), or None."""
    if (torch.is_grad_enabled() and weight.requires_grad and weight.dtype != torch.float32
            and getattr(weight, "main_grad", None) is not None and wgrad_fusion_on(weight.device)):
        return weight.main_grad
    return None


def region_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                  main_grad: torch.Tensor | None) -> torch.Tensor:
    """``linear`` inside a compiled region: with ``main_grad`` (``wgrad_target``'s, passed in as a
    region argument) its backward adds the weight gradient into it (``_RegionLinear``, below)."""
    y = F.linear(x, weight) if main_grad is None else _RegionLinear.apply(x, weight, main_grad)
    return y if bias is None else y + bias


class _RegionLinear(torch.autograd.Function):
    """``x Wᵀ`` for ``region_linear``, traced into the compiled region: the forward is the plain
    matmul, the backward the ``llamarl::linear_grad_into_main_backward`` op."""

    @staticmethod
    def forward(ctx, x, weight, main_grad):
        ctx.save_for_backward(x, weight, main_grad)
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, dy):
        x, weight, main_grad = ctx.saved_tensors
        return torch.ops.llamarl.linear_grad_into_main_backward(dy, x, weight, main_grad), None, None


# The region linear's backward op writes into main_grad through an alias with its own version
# counter and declares no mutation: a declared one would fail autograd's check of the saved
# main_grad wherever another micro-batch's backward ran in between (1F1B). Its output is dx, so
# it is never dead code. A plain torch.library kernel, not a custom_op, for its host time
# (docs/training.md, "The ppo stage's update").
_OPS = torch.library.Library("llamarl", "FRAGMENT")
_OPS.define("linear_grad_into_main_backward(Tensor dy, Tensor x, Tensor weight, Tensor main_grad) -> Tensor")


def _linear_backward_op(dy, x, weight, main_grad):
    dy2 = dy.reshape(-1, dy.shape[-1])
    accumulate_wgrad(own_version(main_grad), dy2, x.reshape(-1, x.shape[-1]))
    return (dy2 @ weight).view(x.shape)


for _key in ("CPU", "CUDA"):
    _OPS.impl("linear_grad_into_main_backward", _linear_backward_op, _key)


@torch.library.register_fake("llamarl::linear_grad_into_main_backward")
def _(dy, x, weight, main_grad):
    return x.new_empty(x.shape)


def own_version(t: torch.Tensor) -> torch.Tensor:
    """A tensor over ``t``'s memory (same offset, shape, strides) with its own version counter:
    in-place writes through it are not seen by autograd's checks of ``t``."""
    return torch.empty(0, dtype=t.dtype, device=t.device).set_(t.untyped_storage(), t.storage_offset(), t.shape,
                                                               t.stride())


class _LinearGradIntoMain(torch.autograd.Function):
    """``y = x Wᵀ + b``. Backward: ``dx = dy W`` and ``db = Σ dy`` as F.linear's; ``dW = dyᵀ x`` is
    accumulated into ``W.main_grad`` (fp32) by ``accumulate_wgrad``, and returned as None."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, dy):
        x, weight = ctx.saved_tensors
        dy2 = dy.reshape(-1, dy.shape[-1])
        dx = (dy2 @ weight).view(*dy.shape[:-1], weight.shape[1]) if ctx.needs_input_grad[0] else None
        accumulate_wgrad(weight.main_grad, dy2, x.reshape(-1, x.shape[-1]))
        db = dy2.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return dx, None, db


def accumulate_wgrad(main_grad: torch.Tensor, dy: torch.Tensor, x: torch.Tensor) -> None:
    """``main_grad += dyᵀ x`` (``dy [N, out]``, ``x [N, in]``, ``main_grad [out, in]`` fp32): on CUDA one
    cuBLAS GEMM with fp32 output and accumulation; elsewhere the operands upcast to fp32 (CPU has
    no mixed-dtype addmm; the reference for tests)."""
    if main_grad.is_cuda:
        torch.addmm(main_grad, dy.t(), x, out_dtype=torch.float32, out=main_grad)
    else:
        main_grad.addmm_(dy.t().float(), x.float())


WGRAD_ENV = "LLAMARL_FUSED_WGRAD"


def wgrad_fusion_on(device: torch.device) -> bool:
    """Whether a linear accumulates its weight gradient into ``main_grad`` in its GEMM, as
    ``LLAMARL_FUSED_WGRAD`` says (docs/training.md): ``auto``, on CUDA where ``fusions_on`` and
    torch's mixed-dtype ``addmm`` works; ``1``, everywhere (on CPU by upcasting, for tests); ``0``,
    never."""
    mode = _switch(WGRAD_ENV, "auto", ("auto", "0", "1"))
    if mode != "auto":
        return mode == "1"
    return device.type == "cuda" and fusions_on(device) and _fp32_addmm_works(device.index)


@functools.cache
def _fp32_addmm_works(index: int | None) -> bool:
    """torch's ``addmm(..., out_dtype=float32)`` on bf16 operands into an fp32 ``out`` (torch ≥ 2.8 on
    CUDA), checked once per device against the fp32 product."""
    dev = torch.device("cuda", index) if index is not None else torch.device("cuda")
    g = torch.Generator(device=dev).manual_seed(0)
    a = torch.randn(64, 32, device=dev, generator=g).bfloat16()
    b = torch.randn(64, 48, device=dev, generator=g).bfloat16()
    acc = torch.ones(32, 48, device=dev)
    try:
        torch.addmm(acc, a.t(), b, out_dtype=torch.float32, out=acc)
    except (RuntimeError, TypeError, NotImplementedError):
        return False
    ref = 1 + a.float().t() @ b.float()
    return bool(((acc - ref).abs().max() <= 1e-3 * ref.abs().max()).item())


class VocabParallelEmbedding(nn.Module):
    """Embedding with the (padded) vocabulary split into equal contiguous slices over TP."""

    def __init__(self, padded_vocab: int, hidden: int, *, tp_group: ProcessGroup | None, sequence_parallel: bool,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.per_rank = padded_vocab // group_size(tp_group)
        self.start = group_rank(tp_group) * self.per_rank
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = nn.Parameter(torch.empty(self.per_rank, hidden, dtype=dtype))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        local = ids - self.start
        outside = (local < 0) | (local >= self.per_rank)
        local = local.masked_fill(outside, 0)
        embed = _EmbeddingGradIntoMain.apply if wgrad_target(self.weight) is not None else F.embedding
        out = embed(local, self.weight)
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return output_reduce(out, self.tp_group, self.sequence_parallel)


class _EmbeddingGradIntoMain(torch.autograd.Function):
    """``weight[ids]``; backward adds each token's gradient into its row of ``weight.main_grad``
    (fp32, sorted and summed by ``index_put_``: deterministic) and returns None. The plain
    backward writes a dense bf16 gradient of the whole vocabulary, which the hook then adds into
    ``main_grad``: 3 GB of memory traffic a micro-batch at Llama 3's vocabulary, for the few
    thousand rows the micro-batch's tokens touch."""

    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, dy):
        (ids,) = ctx.saved_tensors
        main_grad = ctx.weight.main_grad
        main_grad.index_put_((ids.reshape(-1),), dy.reshape(-1, dy.shape[-1]).float(), accumulate=True)
        return None, None


class RMSNorm(nn.Module):
    """RMSNorm computed in fp32, as HF Llama does. Under SP each TP rank sees a slice of the
    tokens, so the weight's gradient is summed over TP."""

    def __init__(self, hidden: int, eps: float, *, tp_group: ProcessGroup | None, sequence_parallel: bool,
                 dtype: torch.dtype | None = None):
        super().__init__()
        self.eps = eps
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        self.weight = nn.Parameter(torch.ones(hidden, dtype=dtype))

    def forward(self, x: torch.Tensor, residual: torch.Tensor | None = None, *, fused: bool = False):
        """``norm(x)``; with ``residual``: ``(x + residual, norm(x + residual))``, the sum being the
        next residual stream. ``fused``: one compiled kernel (see the module's docstring)."""
        weight = mappings.copy_to_tp(self.weight, self.tp_group) if self.sequence_parallel else self.weight
        if residual is None:
            if fused:
                return compiled_region(region_rms_norm, 0)(x, weight, self.eps)
            return weight * rms_normalize(x, self.eps)
        if fused:
            return compiled_region(region_add_rms_norm, 0, 1)(x, residual, weight, self.eps)
        x = x + residual
        return x, weight * rms_normalize(x, self.eps)


def rms_normalize(x: torch.Tensor, eps: float) -> torch.Tensor:
    """``x / rms(x)`` in fp32, cast back to x's dtype. On GPU torch's fused kernel does it in one
    pass; on CPU the eager formula. Both compute in fp32 and round once, so they agree."""
    xf = x.float()
    if x.is_cuda:
        y = F.rms_norm(xf, (x.shape[-1],), eps=eps)
    else:
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return y.to(x.dtype)


def swiglu(gate_up: torch.Tensor, *, fused: bool = False) -> torch.Tensor:
    """``silu(gate) * up`` of the gate_up projection ``[tokens, 2 * ffn]``; ``fused``: one compiled
    kernel, keeping only ``gate_up`` for backward (SiLU recomputed there: ``region_swiglu``)."""
    if fused:
        return compiled_region(region_swiglu, 0)(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


# ---- fused elementwise regions ---------------------------------------------------------------

FUSED_ENV = "LLAMARL_FUSED"


def fusions_on(device: torch.device) -> bool:
    """Whether fused kernels (these compiled regions, the Triton vocabulary kernels) run on
    ``device``: ``LLAMARL_FUSED`` = ``auto`` (on CUDA), ``1`` or ``0`` (docs/training.md)."""
    mode = _switch(FUSED_ENV, "auto", ("auto", "0", "1"))
    return mode == "1" or (mode == "auto" and device.type == "cuda")


FUSED_LAYERS_ENV = "LLAMARL_FUSED_LAYERS"


def fused_layers_on() -> bool:
    """``LLAMARL_FUSED_LAYERS`` = ``1`` (the default): where the regions run at TP 1, a decoder
    layer is two compiled regions with its matmuls inside; ``0``: the four small regions, as at
    TP > 1 (docs/training.md)."""
    return _switch(FUSED_LAYERS_ENV, "1", ("0", "1")) == "1"


def _switch(env: str, default: str, choices: tuple[str, ...]) -> str:
    """The value of the switch ``env`` (``default`` when unset), one of ``choices``."""
    mode = os.environ.get(env, default)
    if mode not in choices:
        raise ValueError(f"{env}={mode!r}: use {', '.join(choices[:-1])} or {choices[-1]}")
    return mode


def region_rms_norm(x, weight, eps: float):
    xf = x.float()
    return weight * (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)).to(x.dtype)


def region_add_rms_norm(x, residual, weight, eps: float):
    s = x + residual
    return s, region_rms_norm(s, weight, eps)


def region_swiglu(gate_up):
    """Inductor fuses the forward; the backward is one pass of its own (lib.model.swiglu_kernel)."""
    return swiglu_kernel.SwiGLU.apply(gate_up)


@functools.cache
def compiled_region(fn, *token_args: int):
    """``fn`` compiled once per process and shape family: the token dimension (dim 0 of the
    arguments ``token_args``) is symbolic from the first call, so micro-batches of any length
    reuse one kernel; every layer shares it (weights are arguments, not guarded by identity)."""
    # The layer regions trace _RegionLinear, an autograd.Function, which AOTAutograd's cache
    # refuses by default: every process would trace the regions' joint graphs again (+2-3 s a
    # process on the 2-core dev CPU, warm cache). Safe for it: its backward is one registered op,
    # called by name, and the graph it traces is the cache key.
    import torch._functorch.config as aot_config

    aot_config.autograd_cache_allow_custom_autograd_functions = True
    compiled = torch.compile(fn, fullgraph=True)

    def call(*args):
        for i in token_args:
            torch._dynamo.maybe_mark_dynamic(args[i], 0)
        return compiled(*args)

    return call
