"""Dtype names, in one table: what configs, manifests and safetensors headers call a dtype.

A config says ``bf16``; a manifest, Parquet metadata and an HF ``config.json`` say torch's own
name, ``bfloat16``; a safetensors header says ``BF16``. Names only, so importing this (and
lib/config.py, which does) costs no torch import; torch is imported when a dtype is asked for.
"""

from __future__ import annotations

# torch's name: (a config's name, the safetensors code). Configs choose among the dtypes with a
# config name; float64 is only ever a source checkpoint's own dtype (shard keeps it by default);
# the integer and bool codes are there to read any safetensors header.
TABLE: dict[str, tuple[str | None, str]] = {
    "bfloat16": ("bf16", "BF16"),
    "float16": ("fp16", "F16"),
    "float32": ("fp32", "F32"),
    "float64": (None, "F64"),
    "int64": (None, "I64"),
    "int32": (None, "I32"),
    "int16": (None, "I16"),
    "int8": (None, "I8"),
    "uint8": (None, "U8"),
    "bool": (None, "BOOL"),
}

CONFIG_NAMES: tuple[str, ...] = tuple(short for short, _ in TABLE.values() if short)
"""The dtypes a config may name (``bf16``, ``fp16``, ``fp32``): the choices of stages/config.py's dtype fields."""

# What ``torch_dtype`` reads: a config's name or a manifest's name of a floating dtype.
_FLOATS = {**{short: name for name, (short, _) in TABLE.items() if short},
           **{name: name for name in TABLE if name.startswith(("float", "bfloat"))}}

SAFETENSORS_CODES = {code: name for name, (_, code) in TABLE.items()}
"""A safetensors header's dtype code → torch's name."""


def torch_name(name: str) -> str:
    """torch's name (``bfloat16``) of a config's (``bf16``) or a manifest's name of a floating dtype."""
    return _FLOATS[name]


def torch_dtype(name: str):
    """A config's (``bf16``) or a manifest's (``bfloat16``) name of a floating dtype as a torch dtype."""
    import torch

    return getattr(torch, _FLOATS[name])


def name(dtype) -> str:
    """What manifests and Parquet metadata call a torch dtype: torch's own name (``bfloat16``)."""
    return str(dtype).removeprefix("torch.")


# ---- the same dtypes as numpy arrays, without torch --------------------------------------------
# Stages that only move bytes (shard, export) hold tensors as numpy arrays of the dtype's *storage*:
# numpy has no bfloat16, so a bf16 tensor is a uint16 array of its bit patterns, and the dtype's
# name travels beside it. Conversions between floating dtypes are torch's, bit for bit (tested).

_STORAGE = {"bfloat16": "<u2", "float16": "<f2", "float32": "<f4", "float64": "<f8", "int64": "<i8", "int32": "<i4",
            "int16": "<i2", "int8": "i1", "uint8": "u1", "bool": "?"}


def numpy_storage(name: str):
    """The numpy dtype whose arrays hold the bytes of torch dtype ``name`` (``bfloat16`` → ``uint16``)."""
    import numpy as np

    return np.dtype(_STORAGE[name])


def itemsize(name: str) -> int:
    return numpy_storage(name).itemsize


def convert(array, src: str, dst: str):
    """``array`` (storage of dtype ``src``) as dtype ``dst``: what torch's ``.to(dst)`` gives,
    bit for bit (round to nearest even, overflow to infinity), except that every NaN becomes the
    one quiet NaN (torch's own payloads differ between its code paths). The same array when
    ``src == dst``."""
    import numpy as np

    if src == dst:
        return array
    if src == "bfloat16":  # exact: bf16 is the top half of an fp32
        array = (array.astype(np.uint32) << 16).view(np.float32)
        src = "float32"
    with np.errstate(over="ignore"):  # overflow is infinity, as in torch
        if dst != "bfloat16":
            return array.astype(numpy_storage(dst))
        bits = np.ascontiguousarray(array, dtype=np.float32).view(np.uint32)
    rounded = ((bits + (0x7FFF + ((bits >> 16) & 1))) >> 16).astype(np.uint16)
    rounded[np.isnan(bits.view(np.float32))] = 0x7FC0
    return rounded


class HostTensor:
    """A tensor without torch: its dtype's name and a numpy array of its storage (``numpy_storage``)."""

    __slots__ = ("dtype", "data")

    def __init__(self, dtype: str, data):
        if data.dtype != numpy_storage(dtype):
            raise TypeError(f"a {dtype} tensor is stored as {numpy_storage(dtype)}, not {data.dtype}")
        self.dtype, self.data = dtype, data

    @property
    def shape(self) -> tuple[int, ...]:
        return self.data.shape

    @property
    def nbytes(self) -> int:
        return self.data.nbytes

    def to(self, dtype: str) -> HostTensor:
        return self if dtype == self.dtype else HostTensor(dtype, convert(self.data, self.dtype, dtype))

    @staticmethod
    def of(t) -> HostTensor:
        """A CPU torch tensor's bytes, shared (no copy when it is contiguous)."""
        t = t.detach().cpu().contiguous()
        name = str(t.dtype).removeprefix("torch.")
        return HostTensor(name, t.view(-1).view(__import__("torch").uint8).numpy().view(numpy_storage(name)).reshape(t.shape))

    def torch(self):
        """As a torch tensor, sharing the memory."""
        import torch

        return torch.from_numpy(self.data).view(getattr(torch, self.dtype))
