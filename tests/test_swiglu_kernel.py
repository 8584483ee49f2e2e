"""lib.model.swiglu_kernel: SwiGLU's one-pass backward against autograd's, in Triton's
interpreter on CPU and on CUDA; where it runs. tests/test_fusions.py checks the compiled regions
that call it."""

import pytest
import torch
import torch.nn.functional as F

from distpool import interpreter_pool, triton_available
from llamarl.lib.model import swiglu_kernel


def autograd_grad(gate_up: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """The input gradient of ``silu(gate) * up`` by autograd, in fp64."""
    x = gate_up.double().requires_grad_()
    gate, up = x.chunk(2, dim=-1)
    (grad,) = torch.autograd.grad(F.silu(gate) * up, x, dy.double())
    return grad


def condition(gate_up: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """The sum of the magnitudes of the backward's terms: fp32 arithmetic errs by a few fp32
    roundings of it (``1 + gate (1 - s)`` cancels near gate = -1.28)."""
    gate, up = gate_up.double().chunk(2, dim=-1)
    s, d = torch.sigmoid(gate), dy.double().abs()
    return torch.cat([d * up.abs() * s * (1 + (gate * (1 - s)).abs()), d * (gate * s).abs()], dim=-1)


def kernel_against_autograd(device: str = "cpu") -> dict:
    """The op on shapes that leave a partial block and have a leading batch dimension, bf16 and fp32:
    its worst error against fp64 autograd, in units of the error the arithmetic allows (fp32 from
    the rounded inputs, rounded once to the dtype)."""
    g = torch.Generator().manual_seed(0)
    out = {"ran_kernel": swiglu_kernel._wanted(torch.device(device))}
    for dtype in (torch.bfloat16, torch.float32):
        for shape in ((3, 5, 2 * 2100), (7, 2 * 64), (0, 2 * 64)):
            gate_up = (3 * torch.randn(shape, generator=g)).to(device, dtype)
            dy = torch.randn(shape[:-1] + (shape[-1] // 2,), generator=g).to(device, dtype)
            got = torch.ops.llamarl.swiglu_backward(gate_up, dy)
            want = autograd_grad(gate_up, dy)
            allowed = (want.abs() * torch.finfo(dtype).eps + 8 * torch.finfo(torch.float32).eps
                       * condition(gate_up, dy)).clamp_min(1e-38)
            worst = float(((got.double() - want).abs() / allowed).max()) if want.numel() else 0.0
            out[f"{dtype}-{shape}"] = (tuple(got.shape) == shape and got.dtype == dtype, worst)
    return out


def _check(out: dict, kernel: bool) -> None:
    assert out.pop("ran_kernel") is kernel
    for case, (same_shape, worst) in out.items():
        assert same_shape and worst <= 1.0, (case, worst)


@pytest.mark.skipif(not triton_available(), reason="needs triton (a dev dependency) for its interpreter")
def test_the_kernel_is_autograds_backward(monkeypatch):
    monkeypatch.setenv(swiglu_kernel.ENV, "1")  # the pool's processes inherit it: the interpreter runs the kernel
    with interpreter_pool(1) as pool:
        (out,) = pool.run(kernel_against_autograd)
    _check(out, kernel=True)


def test_the_reference_formula_is_autograds_backward(monkeypatch):
    monkeypatch.setenv(swiglu_kernel.ENV, "0")
    _check(kernel_against_autograd(), kernel=False)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_kernel_is_autograds_backward_on_cuda(monkeypatch):
    monkeypatch.delenv(swiglu_kernel.ENV, raising=False)
    _check(kernel_against_autograd("cuda"), kernel=True)


def test_the_kernel_runs_on_cuda_by_default_and_in_the_interpreter_only_when_asked(monkeypatch):
    monkeypatch.setattr(swiglu_kernel, "_kernel", lambda: object())  # as if Triton imported
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    monkeypatch.delenv(swiglu_kernel.ENV, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert swiglu_kernel._wanted(cuda) and not swiglu_kernel._wanted(cpu)
    monkeypatch.setenv(swiglu_kernel.ENV, "1")
    assert swiglu_kernel._wanted(cpu)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert not swiglu_kernel._wanted(cpu)
    monkeypatch.setenv(swiglu_kernel.ENV, "0")
    assert not swiglu_kernel._wanted(cuda)
    monkeypatch.setattr(swiglu_kernel, "_kernel", lambda: None)  # no Triton: the formula
    monkeypatch.delenv(swiglu_kernel.ENV)
    assert not swiglu_kernel._wanted(cuda)
    monkeypatch.setenv(swiglu_kernel.ENV, "yes")
    with pytest.raises(ValueError, match="LLAMARL_FUSED_SWIGLU='yes': use auto, 0 or 1"):
        swiglu_kernel._wanted(cuda)
