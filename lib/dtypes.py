"""Dtype names, in one table: what configs, manifests and safetensors headers call a dtype.

A config says ``bf16``; a manifest, Parquet metadata and an HF ``config.json`` say torch's own
name, ``bfloat16``; a safetensors header says ``BF16``. Names only, so importing this (and
lib/model/config.py, which does) costs no torch import; torch is imported when a dtype is asked for.
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
"""The dtypes a config may name (``bf16``, ``fp16``, ``fp32``): the choices of stages/config's dtype fields."""

# What ``torch_name`` reads: a config's name or a manifest's name of a floating dtype.
_FLOATS = {**{short: name for name, (short, _) in TABLE.items() if short},
           **{name: name for name in TABLE if name.startswith(("float", "bfloat"))}}

# What ``torch_dtype`` reads: torch's name of any dtype of the table, or a config's name.
_ANY = {**{name: name for name in TABLE}, **_FLOATS}

SAFETENSORS_CODES = {code: name for name, (_, code) in TABLE.items()}
"""A safetensors header's dtype code → torch's name."""


def torch_name(name: str) -> str:
    """torch's name (``bfloat16``) of a config's (``bf16``) or a manifest's name of a floating dtype."""
    return _FLOATS[name]


def torch_dtype(name: str):
    """A config's name (``bf16``) or torch's (``bfloat16``, ``int64``: any of ``TABLE``) as a torch dtype."""
    import torch

    return getattr(torch, _ANY[name])


def itemsize(name: str) -> int:
    """Bytes an element of the dtype ``name`` takes."""
    return torch_dtype(name).itemsize


def name(dtype) -> str:
    """What manifests and Parquet metadata call a torch dtype: torch's own name (``bfloat16``)."""
    return str(dtype).removeprefix("torch.")
