"""Move a model's parameters to host memory (pinned where CUDA is) between uses, and back. Only
``.data`` moves, so optimizers and hooks keep their references to the parameter objects.
"""

from __future__ import annotations

import torch
from torch import nn


class ParamOffload:
    def __init__(self, model: nn.Module, device: torch.device | str):
        device = torch.device(device)
        if device.type == "cuda" and device.index is None:  # "cuda" means the current device
            device = torch.device("cuda", torch.cuda.current_device())
        self.model, self.device = model, device
        self.on_device = next(model.parameters()).device == device

    def to_host(self) -> None:
        if not self.on_device:
            return
        pin = torch.cuda.is_available()
        for p in self.model.parameters():
            host = torch.empty(p.shape, dtype=p.dtype, device="cpu", pin_memory=pin)
            host.copy_(p.data)
            p.data = host
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # give the memory back, not just to the caching allocator
        self.on_device = False

    def to_device(self) -> None:
        if self.on_device:
            return
        for p in self.model.parameters():
            p.data = p.data.to(self.device, non_blocking=True)
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self.on_device = True
