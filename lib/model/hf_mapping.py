"""The one mapping between HF Llama tensors and llamarl's sharded parameters.

Each local parameter of a TP rank is a concatenation of slices of HF tensors (``Slice``), e.g. a
fused QKV shard is ``[q rows of this rank's heads; k rows; v rows]``. Load, shard and export all
use ``param_slices``, so they can never disagree. Slices may run past the end of an HF tensor:
those rows are vocabulary padding and read as zeros.

Our names are HF's but for two fusions, ``self_attn.qkv_proj`` and ``mlp.gate_up_proj``; the
heads are ``lm_head`` (tied: ``model.embed_tokens``) and ``score`` (Value and Score models, HF's
``LlamaForSequenceClassification`` with one label).
"""

from __future__ import annotations

import re
import zlib
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable

from llamarl.lib.model.config import LlamaConfig, pad_vocab, split_layers

if TYPE_CHECKING:
    import torch
# torch is imported by the functions that build tensors: the mapping itself (names, shapes,
# slices) serves stages that never import it (shard, export).


@dataclass(frozen=True)
class Slice:
    hf_name: str
    dim: int  # the HF tensor's dim that is sliced; slices of one parameter concatenate along it
    start: int
    stop: int


_LAYER = re.compile(r"model\.layers\.(\d+)\.(.+)")


def param_slices(cfg: LlamaConfig, tp: int, tp_rank: int, name: str) -> list[Slice]:
    """The HF slices whose concatenation is TP rank ``tp_rank``'s parameter ``name``."""
    vocab_rows = pad_vocab(cfg.vocab_size, tp) // tp
    if name in ("model.embed_tokens.weight", "lm_head.weight"):
        src = "model.embed_tokens.weight" if cfg.tie_word_embeddings else name
        return [Slice(src, 0, tp_rank * vocab_rows, (tp_rank + 1) * vocab_rows)]
    if name in ("model.norm.weight", "score.weight"):
        return [_whole(cfg, name)]
    m = _LAYER.fullmatch(name)
    if not m:
        raise KeyError(f"no HF mapping for parameter {name!r}")
    prefix, rest = f"model.layers.{m.group(1)}.", m.group(2)
    hd = cfg.head_dim
    if rest.startswith("self_attn.qkv_proj."):
        kind = rest.rsplit(".", 1)[1]  # weight | bias
        q_heads = cfg.num_heads // tp
        kv_heads = max(cfg.num_kv_heads // tp, 1)
        kv_index = tp_rank * kv_heads if cfg.num_kv_heads >= tp else tp_rank // (tp // cfg.num_kv_heads)
        q0, k0 = tp_rank * q_heads * hd, kv_index * hd
        return [
            Slice(f"{prefix}self_attn.q_proj.{kind}", 0, q0, q0 + q_heads * hd),
            Slice(f"{prefix}self_attn.k_proj.{kind}", 0, k0, k0 + kv_heads * hd),
            Slice(f"{prefix}self_attn.v_proj.{kind}", 0, k0, k0 + kv_heads * hd),
        ]
    if rest.startswith("mlp.gate_up_proj."):
        kind = rest.rsplit(".", 1)[1]
        rows = cfg.intermediate_size // tp
        r0 = tp_rank * rows
        return [Slice(f"{prefix}mlp.gate_proj.{kind}", 0, r0, r0 + rows), Slice(f"{prefix}mlp.up_proj.{kind}", 0, r0, r0 + rows)]
    if rest in ("self_attn.o_proj.weight", "mlp.down_proj.weight"):  # row-parallel: split by input columns
        cols = (cfg.q_size if rest.startswith("self_attn") else cfg.intermediate_size) // tp
        return [Slice(name, 1, tp_rank * cols, (tp_rank + 1) * cols)]
    if rest in ("input_layernorm.weight", "post_attention_layernorm.weight", "self_attn.o_proj.bias", "mlp.down_proj.bias"):
        return [_whole(cfg, name)]
    raise KeyError(f"no HF mapping for parameter {name!r}")


def hf_shapes(cfg: LlamaConfig, head: str = "lm") -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint for ``cfg`` and its shape. ``head`` is ``lm`` for
    ``LlamaForCausalLM``, ``score`` for ``LlamaForSequenceClassification`` (one label)."""
    h, i = cfg.hidden_size, cfg.intermediate_size
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (cfg.vocab_size, h), "model.norm.weight": (h,)}
    for n in range(cfg.num_layers):
        p = f"model.layers.{n}."
        shapes |= {
            p + "self_attn.q_proj.weight": (cfg.q_size, h),
            p + "self_attn.k_proj.weight": (cfg.kv_size, h),
            p + "self_attn.v_proj.weight": (cfg.kv_size, h),
            p + "self_attn.o_proj.weight": (h, cfg.q_size),
            p + "mlp.gate_proj.weight": (i, h),
            p + "mlp.up_proj.weight": (i, h),
            p + "mlp.down_proj.weight": (h, i),
            p + "input_layernorm.weight": (h,),
            p + "post_attention_layernorm.weight": (h,),
        }
        if cfg.attention_bias:
            shapes |= {p + "self_attn.q_proj.bias": (cfg.q_size,), p + "self_attn.k_proj.bias": (cfg.kv_size,),
                       p + "self_attn.v_proj.bias": (cfg.kv_size,), p + "self_attn.o_proj.bias": (h,)}
        if cfg.mlp_bias:
            shapes |= {p + "mlp.gate_proj.bias": (i,), p + "mlp.up_proj.bias": (i,), p + "mlp.down_proj.bias": (h,)}
    if head == "lm":
        if not cfg.tie_word_embeddings:
            shapes["lm_head.weight"] = (cfg.vocab_size, h)
    elif head == "score":
        shapes["score.weight"] = (1, h)
    else:
        raise ValueError(f"head={head!r}: use 'lm' or 'score'")
    return shapes


def stage_param_names(cfg: LlamaConfig, head: str, pp: int, pp_rank: int) -> list[str]:
    """Our parameter names on pipeline stage ``pp_rank`` of ``pp`` (any TP rank: TP splits
    parameters, never names them), as lib/model/llama.py's models name them: the embedding on the first
    stage, the layers of ``split_layers``, the final norm and the head on the last. With tied
    embeddings the head is the embedding (pp 1) or the last stage's copy of it."""
    names = ["model.embed_tokens.weight"] if pp_rank == 0 else []
    for n in split_layers(cfg.num_layers, pp)[pp_rank]:
        for part, bias in (("input_layernorm", False), ("self_attn.qkv_proj", cfg.attention_bias),
                           ("self_attn.o_proj", cfg.attention_bias), ("post_attention_layernorm", False),
                           ("mlp.gate_up_proj", cfg.mlp_bias), ("mlp.down_proj", cfg.mlp_bias)):
            names += [f"model.layers.{n}.{part}.{kind}" for kind in ("weight", "bias")[: 1 + bias]]
    if pp_rank == pp - 1:
        names.append("model.norm.weight")
        if head == "score":
            names.append("score.weight")
        elif not (cfg.tie_word_embeddings and pp == 1):
            names.append("lm_head.weight")
    return names


def _whole(cfg: LlamaConfig, name: str) -> Slice:
    shape = hf_shapes(cfg, "score" if name == "score.weight" else "lm").get(name)
    if shape is None:
        raise KeyError(f"no HF tensor {name!r} for this config")
    return Slice(name, 0, 0, shape[0])


# ---- reading and writing shards ----------------------------------------------------------------

# (hf_name, dim, start, stop) -> the rows/cols that exist in the HF tensor, as a tensor.
SliceReader = Callable[[str, int, int, int], "torch.Tensor"]


def build_local(cfg: LlamaConfig, tp: int, tp_rank: int, name: str, read: SliceReader,
                head: str = "lm") -> torch.Tensor:
    """TP rank ``tp_rank``'s parameter ``name``, its HF slices read through ``read``; rows past an
    HF tensor's end (vocabulary padding) are zeros."""
    import torch

    shapes, parts = hf_shapes(cfg, head), []
    slices = param_slices(cfg, tp, tp_rank, name)
    for s in slices:
        stop = min(s.stop, shapes[s.hf_name][s.dim])
        if stop <= s.start:
            raise ValueError(f"slice {s} lies entirely in padding")
        parts.append(read(s.hf_name, s.dim, s.start, stop))
        if stop < s.stop:
            pad = list(parts[-1].shape)
            pad[s.dim] = s.stop - stop
            parts.append(parts[-1].new_zeros(pad))
    return torch.cat(parts, dim=slices[0].dim)


def random_reader(cfg: LlamaConfig, seed: int, std: float = 0.02) -> SliceReader:
    """A reader over a random HF checkpoint: each tensor drawn from its own generator (seeded by
    ``seed`` and the tensor's name), norms at one. The same weights whatever the layout that
    reads them, which is what makes TP/PP runs comparable without a checkpoint."""
    import torch

    cache: dict[str, torch.Tensor] = {}
    shapes = hf_shapes(cfg, "lm") | hf_shapes(cfg, "score")

    def full(name: str) -> torch.Tensor:
        if name not in cache:
            if name.endswith("norm.weight"):
                cache[name] = torch.ones(shapes[name])
            else:
                gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
                cache[name] = torch.randn(shapes[name], generator=gen) * std
        return cache[name]

    return lambda name, dim, start, stop: full(name).narrow(dim, start, stop - start)
