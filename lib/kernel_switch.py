"""Whether one of lib/'s hand-written Triton kernels runs, as its environment switch says.

Each kernel has a switch (``LLAMARL_FUSED_ADAMW``, ``LLAMARL_FUSED_SWIGLU``,
``LLAMARL_FUSED_DECODE``): unset (or ``auto`` where a switch takes it), the kernel on CUDA
wherever Triton imports; ``0``, the torch reference everywhere; ``1``, also in Triton's
interpreter on CPU (``TRITON_INTERPRET=1``), which the tests ask for by name, since other tests
that run kernels there compare against the reference.
"""

from __future__ import annotations

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
