"""One pass over memory for ``ShardedAdamW``'s step on CUDA: a Triton kernel that reads each
parameter's fp32 master, gradient and moments once and writes, in the same pass, the master and
moments, the gradient-norm clip applied (a factor on the device, never read by the host), the
master rounded into the model's bf16 parameter, and the largest magnitude among the masters (for
the step check). torch's fused AdamW takes three more passes for the same step: the clip's
multiply before it, the copy into the parameters and the check's norm after it.

The arithmetic is torch's AdamW (decoupled weight decay, bias corrections, ``eps`` outside the
square root) in fp32; ``tests/test_optim.py`` compares it with ``torch.optim.AdamW`` in Triton's
interpreter on CPU, and ``pytest -m gpu`` on CUDA. It is the default on CUDA (docs/training.md:
0.92× the raw step against torch's 0.85× on an H200); ``LLAMARL_FUSED_ADAMW=0`` turns it off.
"""

from __future__ import annotations

import math

import torch

from llamarl.lib.kernel_switch import kernel_wanted, triton_kernels

ENV = "LLAMARL_FUSED_ADAMW"
BLOCK = 2048


def wanted(device: torch.device) -> bool:
    """Whether the kernel runs, as ``LLAMARL_FUSED_ADAMW`` says (lib/kernel_switch.py); else
    torch's fused AdamW."""
    return kernel_wanted(ENV, device, _kernel, ("0", "1"))


@triton_kernels
def _kernel(triton):
    """The update kernel."""

    @triton.jit
    def adamw_kernel(master_ptr, grad_ptr, avg_ptr, sq_ptr, param_ptr, scale_ptr, largest_ptr, n,
                     lr, beta2, rest1, rest2, eps, decay, step_size, bc2_sqrt,
                     WRITE_PARAM: tl.constexpr, BLOCK: tl.constexpr):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n
        g = tl.load(grad_ptr + offs, mask=mask, other=0.0) * tl.load(scale_ptr)
        avg = tl.load(avg_ptr + offs, mask=mask, other=0.0)
        sq = tl.load(sq_ptr + offs, mask=mask, other=0.0)
        p = tl.load(master_ptr + offs, mask=mask, other=0.0)
        p = p * decay
        avg = avg + rest1 * (g - avg)  # torch's lerp; rest = 1 - beta, taken in double as torch takes it
        sq = sq * beta2 + rest2 * g * g
        p = p - step_size * avg / (tl.sqrt(sq) / bc2_sqrt + eps)
        tl.store(master_ptr + offs, p, mask=mask)
        tl.store(avg_ptr + offs, avg, mask=mask)
        tl.store(sq_ptr + offs, sq, mask=mask)
        if WRITE_PARAM:  # bf16, rounded to nearest even by hand: as torch's copy_, on a GPU and in the interpreter
            bits = p.to(tl.uint32, bitcast=True)
            bits = (bits + (((bits >> 16) & 1) + 0x7FFF)) >> 16
            bits = tl.where(p == p, bits, 0x7FC0)  # NaN stays NaN
            tl.store(param_ptr + offs, bits.to(tl.uint16).to(tl.bfloat16, bitcast=True), mask=mask)
        # NaN counts as infinitely large: the check flags a master that is not finite or too large.
        size = tl.where(p == p, tl.abs(p), float("inf"))
        tl.atomic_max(largest_ptr, tl.max(tl.where(mask, size, 0.0), 0))

    return adamw_kernel


def step(masters: list[torch.Tensor], grads: list[torch.Tensor], avgs: list[torch.Tensor], sqs: list[torch.Tensor],
         params: list[torch.Tensor | None], scale: torch.Tensor | None, largest: torch.Tensor, t: int, lr: float,
         betas: tuple[float, float], eps: float, weight_decay: float) -> None:
    """AdamW step ``t`` (1-based) of every master in place, its moments with it, each gradient times
    ``scale`` first (a 0-d fp32 device tensor; None: 1), each parameter (None: the master is the
    parameter) written from its new master; ``largest`` (a 0-d fp32 tensor, zeroed here) receives
    the largest magnitude among the new masters, inf where one is NaN. Parameters are bf16."""
    kernel = _kernel()
    beta1, beta2 = betas
    if scale is None:
        scale = torch.ones((), dtype=torch.float32, device=largest.device)
    largest.zero_()
    step_size, bc2_sqrt = lr / (1 - beta1 ** t), math.sqrt(1 - beta2 ** t)
    for master, grad, avg, sq, param in zip(masters, grads, avgs, sqs, params):
        if not all(x.is_contiguous() for x in (master, grad, avg, sq, master if param is None else param)):
            raise ValueError("the fused AdamW step needs contiguous masters, gradients, moments and parameters")
        n = master.numel()
        kernel[(-(-n // BLOCK),)](master, grad, avg, sq, master if param is None else param, scale, largest, n, lr,
                                   beta2, 1 - beta1, 1 - beta2, eps, 1 - lr * weight_decay, step_size, bc2_sqrt,
                                   WRITE_PARAM=param is not None, BLOCK=BLOCK)
