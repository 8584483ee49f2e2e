"""Whether one of lib/'s hand-written Triton kernels runs, as its environment switch says, and
the kernels built where Triton imports.

Each kernel has a switch (``LLAMARL_FUSED_ADAMW``, ``LLAMARL_FUSED_SWIGLU``,
``LLAMARL_FUSED_DECODE``): unset (or ``auto`` where a switch takes it), the kernel on CUDA
wherever Triton imports; ``0``, the torch reference everywhere; ``1``, also in Triton's
interpreter on CPU (``TRITON_INTERPRET=1``), which the tests ask for by name, since other tests
that run kernels there compare against the reference. Each kernel is built on first use
(``triton_kernels``), so that importing lib/ never imports Triton.
"""

from __future__ import annotations

import functools
import os
from typing import Callable


def kernel_wanted(env: str, device, kernel: Callable[[], object | None], choices: tuple[str, ...]) -> bool:
    """Whether the kernel that ``kernel()`` compiles (None without Triton) runs on ``device``, as
    ``env`` (one of ``choices`` when set) says."""
    value = os.environ.get(env)
    if value is not None and value not in choices:
        raise ValueError(f"{env}={value!r}: use {', '.join(choices[:-1])} or {choices[-1]}")
    if value == "0":
        return False
    on_device = device.type == "cuda" or (value == "1" and os.environ.get("TRITON_INTERPRET") == "1")
    return on_device and kernel() is not None


def triton_kernels(build: Callable) -> Callable[[], object | None]:
    """``build(triton)``'s kernels, compiled on first call and kept; None without Triton (lib/ never
    imports it at import). The kernels' bodies name ``tl`` as a global of ``build``'s module, which
    Triton's JIT reads as it parses them: it is set there here."""

    @functools.cache
    @functools.wraps(build)
    def kernels():
        try:
            import triton
            import triton.language as tl
        except ImportError:
            return None
        build.__globals__["tl"] = tl
        return build(triton)

    return kernels
