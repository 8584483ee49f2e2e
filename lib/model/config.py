"""Model configuration: what lib/ needs to know about a Llama, read from an HF ``config.json``.

Anything lib/ cannot reproduce exactly is rejected here with a one-line ``ConfigError`` naming
the field and the fix, so no stage ever runs a model that silently differs from the checkpoint.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any, Mapping

from llamarl.lib.dtypes import torch_dtype
from llamarl.lib.errors import UserError


class ConfigError(UserError, ValueError):
    """A model config or parallel layout that lib/ cannot run; the message says what to change."""


_SUPPORTED_ROPE = ("default", "linear", "llama3")
# Our field names that HF spells otherwise; every other field is HF's own name.
_HF_NAMES = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads", "num_kv_heads": "num_key_value_heads"}


def compute_dtype(name: str, device):
    """The torch dtype a stage computes in, from its (validated: stages/config.py) ``dtype``
    option; refused up front, in one line, when the device cannot run it (before any weights are read).

    ``auto`` is bf16 on CUDA and fp32 on CPU. fp32 runs on CUDA too (attention then takes the SDPA
    path: the varlen kernels are fp16/bf16 only). fp16 on CPU is refused: CPU kernels for half
    precision are partial and slow, and bf16 does the same job there."""
    import torch

    cuda = torch.device(device).type == "cuda"
    if name == "auto":
        return torch.bfloat16 if cuda else torch.float32
    if name == "fp16" and not cuda:
        raise UserError("dtype=fp16 does not run on CPU; use bf16 or fp32 (or auto: fp32 on CPU, bf16 on GPU)")
    return torch_dtype(name)


@dataclass(frozen=True, kw_only=True)
class LlamaConfig:
    """Shape and numerics of a Llama decoder (HF ``LlamaConfig`` fields, our names)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    # None, or {"rope_type": "linear"|"llama3", "factor": ..., and llama3's low/high_freq_factor,
    # original_max_position_embeddings}.
    rope_scaling: dict | None = None
    max_position_embeddings: int = 2048
    tie_word_embeddings: bool = False
    attention_bias: bool = False
    mlp_bias: bool = False
    # Carried through to exported configs; lib/ itself does not use token ids.
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    # ---- HF interop -------------------------------------------------------------------------

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any] | Any, source: str = "config.json") -> LlamaConfig:
        """Read an HF Llama config (a ``config.json`` dict or a ``PretrainedConfig``)."""
        d = dict(hf) if isinstance(hf, Mapping) else hf.to_dict()

        def fail(msg: str) -> ConfigError:
            return ConfigError(f"{source}: {msg}")

        model_type = d.get("model_type")
        archs = d.get("architectures") or []
        if model_type != "llama" and not any(a.startswith("Llama") for a in archs):
            raise fail(f"model_type={model_type!r} is not a Llama; llamarl runs Llama models only "
                       "(model_type 'llama', e.g. LlamaForCausalLM)")
        act = d.get("hidden_act", "silu")
        if act != "silu":
            raise fail(f"hidden_act={act!r} is not supported; Llama uses 'silu'")
        for key in ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size"):
            if not isinstance(d.get(key), int) or d[key] <= 0:
                raise fail(f"{key}={d.get(key)!r} must be a positive integer")

        heads = d["num_attention_heads"]
        kv_heads = d.get("num_key_value_heads") or heads
        if heads % kv_heads:
            raise fail(f"num_key_value_heads={kv_heads} must divide num_attention_heads={heads}")
        head_dim = d.get("head_dim") or d["hidden_size"] // heads

        rope_theta, rope_scaling = _read_rope(d, fail)
        if d.get("pretraining_tp", 1) not in (1, None):
            raise fail(f"pretraining_tp={d['pretraining_tp']} is not supported; set it to 1 (it only "
                       "changes how HF splits matmuls, not the weights)")

        return cls(vocab_size=d["vocab_size"], hidden_size=d["hidden_size"], intermediate_size=d["intermediate_size"],
                   num_layers=d["num_hidden_layers"], num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim,
                   rms_norm_eps=float(d.get("rms_norm_eps", 1e-6)), rope_theta=rope_theta, rope_scaling=rope_scaling,
                   max_position_embeddings=int(d.get("max_position_embeddings", 2048)),
                   tie_word_embeddings=bool(d.get("tie_word_embeddings", False)),
                   attention_bias=bool(d.get("attention_bias", False)), mlp_bias=bool(d.get("mlp_bias", False)),
                   bos_token_id=d.get("bos_token_id"), eos_token_id=d.get("eos_token_id"),
                   pad_token_id=d.get("pad_token_id"))

    @classmethod
    def from_json(cls, path: str) -> LlamaConfig:
        import fsspec

        with fsspec.open(path, "r") as f:
            try:
                d = json.load(f)
            except json.JSONDecodeError as e:
                raise ConfigError(f"{path}: not valid JSON ({e}); re-copy the checkpoint's config.json") from None
        return cls.from_hf(d, source=path)

    def to_hf(self, architecture: str = "LlamaForCausalLM") -> dict:
        """An HF ``config.json`` dict that ``transformers`` loads back into the same model: every
        field under its HF name (``_HF_NAMES``), so a field added here reaches exported configs."""
        return {"architectures": [architecture], "model_type": "llama", "hidden_act": "silu",
                **{_HF_NAMES.get(name, name): value for name, value in self.to_dict().items()}}

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> LlamaConfig:
        return cls(**d)


def _read_rope(d: dict, fail) -> tuple[float, dict | None]:
    """(rope_theta, rope_scaling) from either the old (``rope_scaling``) or the transformers-5
    (``rope_parameters``) spelling."""
    params = d.get("rope_parameters") or {}
    theta = d.get("rope_theta", params.get("rope_theta", 10000.0))
    scaling = d.get("rope_scaling") or {k: v for k, v in params.items() if k != "rope_theta"} or None
    if scaling is not None:
        scaling = dict(scaling)
        rope_type = scaling.get("rope_type", scaling.get("type", "default"))
        if rope_type not in _SUPPORTED_ROPE:
            raise fail(f"rope_scaling type {rope_type!r} is not supported; use one of {', '.join(_SUPPORTED_ROPE)}")
        if rope_type == "default":
            return float(theta), None
        scaling["rope_type"] = rope_type
        scaling.pop("type", None)
        if "factor" not in scaling:
            raise fail(f"rope_scaling of type {rope_type!r} needs a 'factor'")
        if rope_type == "llama3":
            for k in ("low_freq_factor", "high_freq_factor", "original_max_position_embeddings"):
                if k not in scaling:
                    raise fail(f"rope_scaling of type 'llama3' needs {k!r}")
    return float(theta), scaling


@dataclass(frozen=True, kw_only=True)
class ParallelLayout:
    """How one model is split: tensor (tp) and pipeline (pp) parallel sizes, and the switches."""

    tp: int = 1
    pp: int = 1
    # Split activations along tokens between the TP ranks outside attention/MLP (Megatron SP).
    sequence_parallel: bool = False
    # Pack the valid tokens of a batch into one sequence (varlen attention) instead of padding.
    remove_padding: bool = True

    def check(self, cfg: LlamaConfig) -> None:
        """Raise a one-line ConfigError when ``cfg`` cannot run on this layout."""
        tp, pp = self.tp, self.pp
        if tp < 1 or pp < 1:
            raise ConfigError(f"tp={tp}, pp={pp}: both must be at least 1")
        if cfg.num_heads % tp:
            raise ConfigError(f"tp={tp} does not divide num_attention_heads={cfg.num_heads}; "
                              f"use a tp in {valid_tps(cfg)}")
        if cfg.num_kv_heads % tp and tp % cfg.num_kv_heads:
            raise ConfigError(f"tp={tp} and num_key_value_heads={cfg.num_kv_heads}: one must divide the other "
                              f"(kv heads are split over TP or replicated); use a tp in {valid_tps(cfg)}")
        if cfg.intermediate_size % tp:
            raise ConfigError(f"tp={tp} does not divide intermediate_size={cfg.intermediate_size}; "
                              f"use a tp in {valid_tps(cfg)}")
        if pp > cfg.num_layers:
            raise ConfigError(f"pp={pp} is larger than num_hidden_layers={cfg.num_layers}; use pp <= {cfg.num_layers}")
        if self.sequence_parallel and tp == 1:
            raise ConfigError("sequence_parallel=True needs tp > 1; turn it off or raise tp")


def valid_tps(cfg: LlamaConfig) -> list[int]:
    """Every tensor-parallel size ``cfg`` runs at: it divides the heads and the MLP width, and
    divides or is a multiple of the kv heads."""
    return [t for t in range(1, cfg.num_heads + 1)
            if cfg.num_heads % t == 0 and cfg.intermediate_size % t == 0
            and (cfg.num_kv_heads % t == 0 or t % cfg.num_kv_heads == 0)]


def pad_vocab(vocab_size: int, tp: int) -> int:
    """The vocabulary size rounded up so each of ``tp`` ranks holds an equal slice. The padded rows
    are never sampled, scored or given probability."""
    return -(-vocab_size // tp) * tp


def split_layers(num_layers: int, pp: int, sizes: list[int] | None = None) -> list[range]:
    """Layer ranges per pipeline stage: as even as possible (earlier stages take the remainder),
    or exactly ``sizes`` when given (uneven splits, e.g. to make room for embedding or head)."""
    if sizes is None:
        base, rem = divmod(num_layers, pp)
        sizes = [base + (i < rem) for i in range(pp)]
    if len(sizes) != pp or sum(sizes) != num_layers or min(sizes) < 1:
        raise ConfigError(f"pipeline layer split {sizes} must be {pp} positive numbers adding up to {num_layers}")
    starts = [sum(sizes[:i]) for i in range(pp)]
    return [range(s, s + n) for s, n in zip(starts, sizes)]
