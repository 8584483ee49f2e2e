"""Tiny random Llamas and batches shared by the tests, plus helpers that run inside pool workers."""

from __future__ import annotations

import torch
import torch.distributed as dist

from llamarl.lib.files import checkpoint
from llamarl.lib.model import hf_mapping
from llamarl.lib.distributed import parallel
from llamarl.lib.model.config import LlamaConfig

PAD_ID = 0


def hf_config(**overrides):
    from transformers import LlamaConfig as HFLlamaConfig

    kw = dict(
        vocab_size=251,  # no TP divides it: vocab padding is exercised
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,  # PP=2 splits it unevenly
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        max_position_embeddings=256,
        rms_norm_eps=1e-5,
        rope_theta=10000.0,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
        tie_word_embeddings=False,
        pad_token_id=PAD_ID,
    )
    kw.update(overrides)
    cfg = HFLlamaConfig(**kw)
    cfg._attn_implementation = "eager"
    return cfg


def hf_model(kind="lm", seed=0, **overrides):
    from llamarl.pipeline.toy import random_hf_model

    model = random_hf_model(hf_config(**overrides), kind, seed)
    # HF initialises norms to one; perturb them so a wrong norm weight cannot hide.
    with torch.no_grad():
        for n, p in model.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(torch.randn_like(p) * 0.1)
    return model.eval()


def our_config(hf) -> LlamaConfig:
    return LlamaConfig.from_hf(hf.config.to_dict())


def batch(side="right", seed=1, vocab=251, lengths=(7, 12, 3)):
    """Token ids [B, S] with unequal lengths padded on ``side``; no real token equals PAD_ID."""
    g = torch.Generator().manual_seed(seed)
    s = max(lengths)
    ids = torch.full((len(lengths), s), PAD_ID)
    mask = torch.zeros(len(lengths), s, dtype=torch.long)
    for i, n in enumerate(lengths):
        row = torch.randint(1, vocab, (n,), generator=g)
        sl = slice(s - n, s) if side == "left" else slice(0, n)
        ids[i, sl], mask[i, sl] = row, 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def gather_tp(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """Concatenate a TP-sharded tensor (test-only: gathers the full thing)."""
    topo = parallel.topology()
    if topo.tp == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(topo.tp)]
    dist.all_gather(parts, x.contiguous(), group=parallel.tp_group())
    return torch.cat(parts, dim=dim)


def gather_hf_grads(model) -> dict[str, torch.Tensor]:
    """This stage's parameter gradients as full HF tensors (gathered over TP)."""
    topo = parallel.topology()
    shapes = hf_mapping.hf_shapes(model.cfg, model.hf_head)
    out: dict[str, torch.Tensor] = {}
    for name, p in model.named_parameters():
        grads = [torch.empty_like(p) for _ in range(topo.tp)]
        if topo.tp > 1:
            dist.all_gather(grads, p.grad.contiguous(), group=parallel.tp_group())
        else:
            grads = [p.grad]
        for r, g in enumerate(grads):
            for hf_name, off, piece in checkpoint.chunks_of(model.cfg, topo.tp, r, name, g, model.hf_head, shapes):
                if hf_name not in out:
                    out[hf_name] = g.new_empty(shapes[hf_name])
                out[hf_name][tuple(slice(o, o + n) for o, n in zip(off, piece.shape))] = piece
    return out
