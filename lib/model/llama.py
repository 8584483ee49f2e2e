"""The parallel Llama: one backbone, three heads (actor and reference, critic, reward model).

A model object is one pipeline stage: the first holds the embedding, the last the final norm
and head, each a contiguous range of decoder layers. ``forward(batch, hidden)`` runs the stage;
``lib.model.schedule`` chains stages. With PP = 1, ``model.run(input_ids, attention_mask)`` does it all.
"""

from __future__ import annotations

import dataclasses

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed import ProcessGroup

from llamarl.lib.model import hf_mapping, mappings
from llamarl.lib.distributed import parallel
from llamarl.lib.model.attention import AttentionMetadata, attention
from llamarl.lib.model.batch import TokenBatch
from llamarl.lib.model.config import LlamaConfig, ParallelLayout, pad_vocab, split_layers
from llamarl.lib.model.layers import (ColumnParallelLinear, RMSNorm, RowParallelLinear, VocabParallelEmbedding,
                                      column_input, compiled_region, fused_layers_on, fusions_on, linear,
                                      region_add_rms_norm, region_linear, region_rms_norm, region_swiglu, swiglu,
                                      wgrad_target)
from llamarl.lib.model.rotary import region_rotary_qk, rope_cos_sin, rope_inv_freq, rotary_qk
from llamarl.lib.distributed.parallel import Topology, group_rank, group_size


class ParallelAttention(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp_group: ProcessGroup | None, sp: bool, dtype: torch.dtype):
        super().__init__()
        tp = group_size(tp_group)
        self.tp_group, self.tp_group_size = tp_group, tp
        self.head_dim = cfg.head_dim
        self.heads = cfg.num_heads // tp
        self.kv_heads = max(cfg.num_kv_heads // tp, 1)
        # TP > kv heads: each kv head lives on tp / num_kv_heads ranks, which must sum its grads.
        self.kv_replicas = max(tp // cfg.num_kv_heads, 1)
        self.kv_head = group_rank(tp_group) // self.kv_replicas
        self.num_kv_heads = cfg.num_kv_heads
        self.q_rows, self.kv_rows = self.heads * cfg.head_dim, self.kv_heads * cfg.head_dim
        bias = cfg.attention_bias
        self.qkv_proj = ColumnParallelLinear(cfg.hidden_size, self.q_rows + 2 * self.kv_rows, bias=bias,
                                             tp_group=tp_group, sequence_parallel=sp, dtype=dtype)
        self.o_proj = RowParallelLinear(self.q_rows, cfg.hidden_size, bias=bias, tp_group=tp_group,
                                        sequence_parallel=sp, dtype=dtype)

    def forward(self, x, cos, sin, meta: AttentionMetadata, layer: int, fused: bool = False):
        w, b = self.qkv_proj.weight, self.qkv_proj.bias
        if self.kv_replicas > 1:
            w = mappings.SumReplicatedKV.apply(w, self.q_rows, self.kv_head, self.num_kv_heads, self.tp_group)
            if b is not None:
                b = mappings.SumReplicatedKV.apply(b, self.q_rows, self.kv_head, self.num_kv_heads, self.tp_group)
        qkv = linear(column_input(x, self.tp_group, self.qkv_proj.sequence_parallel), w, b)
        q, k, v = qkv.split([self.q_rows, self.kv_rows, self.kv_rows], dim=-1)
        q, k = rotary_qk(q.reshape(-1, self.heads, self.head_dim), k.reshape(-1, self.kv_heads, self.head_dim),
                         cos, sin, fused=fused)
        v = v.reshape(-1, self.kv_heads, self.head_dim)
        out = attention(q, k, v, meta, layer)
        return self.o_proj(out.reshape(-1, self.q_rows))


class ParallelMLP(nn.Module):
    def __init__(self, cfg: LlamaConfig, tp_group: ProcessGroup | None, sp: bool, dtype: torch.dtype):
        super().__init__()
        rows = cfg.intermediate_size // group_size(tp_group)
        self.gate_up_proj = ColumnParallelLinear(cfg.hidden_size, 2 * rows, bias=cfg.mlp_bias, tp_group=tp_group,
                                                 sequence_parallel=sp, dtype=dtype)
        self.down_proj = RowParallelLinear(rows, cfg.hidden_size, bias=cfg.mlp_bias, tp_group=tp_group,
                                           sequence_parallel=sp, dtype=dtype)

    def forward(self, x, fused: bool = False):
        return self.down_proj(swiglu(self.gate_up_proj(x), fused=fused))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, index: int, tp_group: ProcessGroup | None, sp: bool, dtype: torch.dtype):
        super().__init__()
        self.index = index  # global layer index: names this layer's KV cache
        norm = {"tp_group": tp_group, "sequence_parallel": sp, "dtype": dtype}
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm)
        self.self_attn = ParallelAttention(cfg, tp_group, sp, dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, **norm)
        self.mlp = ParallelMLP(cfg, tp_group, sp, dtype)

    def forward(self, x, cos, sin, meta: AttentionMetadata, fused: bool = False):
        """``fused``: norms, residual add, rotary and SwiGLU as compiled regions; at TP 1, where
        ``fused_layers_on``, two regions with the matmuls inside: before attention, and after it."""
        if fused and self.self_attn.tp_group_size == 1 and fused_layers_on():
            return self._two_regions(x, cos, sin, meta)
        attn = self.self_attn(self.input_layernorm(x, fused=fused), cos, sin, meta, self.index, fused)
        x, h = self.post_attention_layernorm(x, attn, fused=fused)
        return x + self.mlp(h, fused)

    def _two_regions(self, x, cos, sin, meta: AttentionMetadata):
        a, mlp = self.self_attn, self.mlp
        eps = self.input_layernorm.eps
        qkv, o, gate_up, down = a.qkv_proj, a.o_proj, mlp.gate_up_proj, mlp.down_proj
        # Each linear's fp32 main_grad goes in as an argument where its gradient is fused into it
        # (lib.model.layers.wgrad_fusion_on).
        q, k, v = compiled_region(_attention_in, 0, 5, 6)(
            x, self.input_layernorm.weight, qkv.weight, qkv.bias, wgrad_target(qkv.weight), cos, sin, eps,
            a.heads, a.kv_heads, a.head_dim)
        out = attention(q, k, v, meta, self.index).reshape(-1, a.q_rows)
        return compiled_region(_attention_out_and_mlp, 0, 1)(
            out, x, self.post_attention_layernorm.weight,
            *(t for lin in (o, gate_up, down) for t in (lin.weight, lin.bias, wgrad_target(lin.weight))), eps)


def _attention_in(x, norm_w, qkv_w, qkv_b, qkv_g, cos, sin, eps: float, heads: int, kv_heads: int, head_dim: int):
    """A decoder layer before attention, at TP 1: norm, the qkv projection, rotary. ``*_g``: the
    weight's fp32 main_grad (``region_linear``) or None."""
    qkv = region_linear(region_rms_norm(x, norm_w, eps), qkv_w, qkv_b, qkv_g)
    q, k, v = qkv.split([heads * head_dim, kv_heads * head_dim, kv_heads * head_dim], dim=-1)
    q, k = region_rotary_qk(q.reshape(-1, heads, head_dim), k.reshape(-1, kv_heads, head_dim), cos, sin)
    return q, k, v.reshape(-1, kv_heads, head_dim)


def _attention_out_and_mlp(attn, x, norm_w, o_w, o_b, o_g, gate_up_w, gate_up_b, gate_up_g, down_w, down_b, down_g,
                           eps: float):
    """A decoder layer after attention, at TP 1: the output projection, residual add + norm, the
    MLP and its residual add."""
    x, h = region_add_rms_norm(x, region_linear(attn, o_w, o_b, o_g), norm_w, eps)
    gate_up = region_linear(h, gate_up_w, gate_up_b, gate_up_g)
    return x + region_linear(region_swiglu(gate_up), down_w, down_b, down_g)


class ParallelLlamaModel(nn.Module):
    """The decoder stack of one pipeline stage: embedding on the first, final norm on the last."""

    def __init__(self, cfg: LlamaConfig, topo: Topology, tp_group: ProcessGroup | None, sp: bool,
                 dtype: torch.dtype, layer_split: list[int] | None, fused: bool | None = None):
        super().__init__()
        self.fused = fused
        self.layer_range = split_layers(cfg.num_layers, topo.pp, layer_split)[topo.pp_rank]
        self.embed_tokens = (
            VocabParallelEmbedding(pad_vocab(cfg.vocab_size, topo.tp), cfg.hidden_size, tp_group=tp_group,
                                   sequence_parallel=sp, dtype=dtype)
            if topo.is_first_stage else None
        )
        # Keyed by global layer index, so parameter names do not depend on the pipeline split.
        self.layers = nn.ModuleDict({str(i): DecoderLayer(cfg, i, tp_group, sp, dtype) for i in self.layer_range})
        self.norm = (RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, tp_group=tp_group, sequence_parallel=sp, dtype=dtype)
                     if topo.is_last_stage else None)
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, batch: TokenBatch, hidden: torch.Tensor | None) -> torch.Tensor:
        if self.embed_tokens is not None:
            hidden = self.embed_tokens(batch.input_ids)
        # Attention sees all N tokens (SP gathers them inside qkv_proj), so RoPE covers all N.
        cos, sin = rope_cos_sin(batch.positions, self.inv_freq, hidden.dtype)
        # ``fused`` (None: ``LLAMARL_FUSED``): the compiled regions, with or without gradients (a
        # training pass saves less for backward; every pass runs fewer kernels).
        fused = fusions_on(hidden.device) if self.fused is None else self.fused
        for layer in self.layers.values():
            hidden = layer(hidden, cos, sin, batch.meta, fused)
        return self.norm(hidden, fused=fused) if self.norm is not None else hidden


class ParallelLlama(nn.Module):
    """Base of the three models: backbone plus (on the last stage) a head (``fused``: ``ParallelLlamaModel.forward``)."""

    hf_head = "lm"  # which HF head the weights come from: lm (LlamaForCausalLM) | score

    def __init__(self, cfg: LlamaConfig, layout: ParallelLayout = ParallelLayout(), *,
                 dtype: torch.dtype = torch.float32, layer_split: list[int] | None = None,
                 fused: bool | None = None):
        super().__init__()
        topo = parallel.topology()
        if (topo.tp, topo.pp) != (layout.tp, layout.pp):
            raise ValueError(f"layout tp={layout.tp}, pp={layout.pp} does not match the initialised "
                             f"process groups tp={topo.tp}, pp={topo.pp}; call lib.distributed.parallel.init first")
        layout.check(cfg)
        self.cfg, self.layout, self.dtype = cfg, layout, dtype
        # The groups this model computes over, fixed now: every layer and collective uses these.
        self.topology, self.tp_group = topo, topo.groups.tp
        self.model = ParallelLlamaModel(cfg, topo, self.tp_group, layout.sequence_parallel, dtype, layer_split, fused)
        if topo.is_last_stage:
            self._build_head()

    # ---- running ---------------------------------------------------------------------------

    def make_batch(self, input_ids, attention_mask=None, position_ids=None) -> TokenBatch:
        return TokenBatch.from_padded(input_ids, attention_mask, position_ids,
                                      remove_padding=self.layout.remove_padding, pad_to_multiple=self._token_multiple)

    def make_batch_of_rows(self, rows) -> TokenBatch:
        """``make_batch`` of ``rows`` (int64 id arrays) right-padded, built from the rows themselves
        (``TokenBatch.from_rows``): for a remove-padding layout only."""
        if not self.layout.remove_padding:
            raise ValueError("make_batch_of_rows packs the rows: the layout keeps padding (remove_padding=False)")
        return TokenBatch.from_rows(rows, pad_to_multiple=self._token_multiple)

    @property
    def _token_multiple(self) -> int:
        """What a batch's token count is rounded up to: TP under sequence parallelism (each rank its share)."""
        return self.layout.tp if self.layout.sequence_parallel else 1

    def forward(self, batch: TokenBatch, hidden: torch.Tensor | None = None, rows: torch.Tensor | None = None) -> torch.Tensor:
        """Run this stage: hidden states out of an inner stage (this rank's tokens under SP), the
        head's per-token output out of the last. ``batch``: a ``TokenBatch``, or any object with
        ``input_ids``, ``positions`` and ``meta`` (generation steps). ``rows``: only these tokens
        go through the head (a prefill's last tokens); not with sequence parallelism."""
        hidden = self.model(batch, hidden)
        if not self.topology.is_last_stage:
            return hidden
        if rows is not None:
            if self.layout.sequence_parallel:
                raise ValueError("rows= selects tokens of the whole sequence; sequence parallelism splits it")
            hidden = hidden[rows]
        return self._head(hidden, batch)

    def run(self, input_ids, attention_mask=None, position_ids=None) -> torch.Tensor:
        """Whole-model forward for PP = 1 from padded inputs; outputs padded like the inputs."""
        if self.layout.pp > 1:
            raise RuntimeError("with pp > 1 run the stages through lib.model.schedule (forward / forward_backward)")
        batch = self.make_batch(input_ids, attention_mask, position_ids)
        return self.to_padded(self(batch), batch)

    def to_padded(self, out: torch.Tensor, batch: TokenBatch) -> torch.Tensor:
        return batch.to_padded(out)

    # ---- weights ---------------------------------------------------------------------------

    def load_hf(self, read: hf_mapping.SliceReader) -> None:
        """Fill every parameter of this rank from HF tensors (``read`` returns slices of them)."""
        topo = self.topology
        with torch.no_grad():
            for name, p in self.named_parameters():
                p.copy_(hf_mapping.build_local(self.cfg, topo.tp, topo.tp_rank, name, read, self.hf_head))

    def load_hf_state_dict(self, sd: dict[str, torch.Tensor]) -> None:
        self.load_hf(lambda name, dim, start, stop: sd[name].narrow(dim, start, stop - start))

    def init_random(self, seed: int = 0, std: float = 0.02) -> None:
        """Random weights that do not depend on the layout (see ``hf_mapping.random_reader``)."""
        self.load_hf(hf_mapping.random_reader(self.cfg, seed, std))

    def tied_head(self) -> bool:
        """Whether the head weight is the embedding's (tied embeddings); with PP > 1 the last stage
        then holds a copy whose gradient must be summed with the first stage's (``tied_copy``)."""
        return self.hf_head == "lm" and self.cfg.tie_word_embeddings

    def tied_copy(self) -> nn.Parameter | None:
        """With tied embeddings over PP > 1: this stage's copy of the shared weight (the embedding
        on the first stage, the head on the last), whose gradient is summed over the embedding
        group; None otherwise."""
        topo = self.topology
        if not self.tied_head() or topo.pp == 1:
            return None
        if topo.is_first_stage:
            return self.model.embed_tokens.weight
        return self.lm_head.weight if topo.is_last_stage else None


class ParallelLlamaForCausalLM(ParallelLlama):
    """Output: vocab-parallel logits ``[N, padded_vocab / tp]``; padded vocab entries are -inf-like
    (the dtype's minimum), so they never get probability mass."""

    def _build_head(self):
        topo = self.topology
        padded = pad_vocab(self.cfg.vocab_size, topo.tp)
        self.vocab_start = topo.tp_rank * (padded // topo.tp)
        self.lm_head = None
        if not (self.tied_head() and topo.pp == 1):
            self.lm_head = ColumnParallelLinear(self.cfg.hidden_size, padded // topo.tp, bias=False, tp_group=self.tp_group,
                                                sequence_parallel=self.layout.sequence_parallel, dtype=self.dtype)

    def _head(self, hidden, batch):
        weight = self.lm_head.weight if self.lm_head is not None else self.model.embed_tokens.weight
        logits = linear(column_input(hidden, self.tp_group, self.layout.sequence_parallel), weight)
        valid = self.cfg.vocab_size - self.vocab_start
        if valid < logits.shape[-1]:
            cols = torch.arange(logits.shape[-1], device=logits.device)
            logits = logits.masked_fill(cols >= valid, torch.finfo(logits.dtype).min)
        return logits


def warm_regions(cfg: LlamaConfig, layout: ParallelLayout, dtype: torch.dtype, device, *, backward: bool) -> bool:
    """Compile, in this process, the regions a model of ``cfg`` at ``layout`` runs, with a forward
    without gradients (generation, ppo's frozen passes) and, with ``backward``, a forward and
    backward (training) of a one-layer model of its shapes: every layer shares the regions and
    their token dimension is symbolic, so the model compiles nothing more. False where there is
    nothing to do (fusions off) or the layout splits layers over TP."""
    device = torch.device(device)
    if layout.tp != 1 or not fusions_on(device) or parallel.topology().tp != 1:
        return False
    with torch.device(device):
        model = ParallelLlamaForCausalLM(dataclasses.replace(cfg, num_layers=1), dataclasses.replace(layout, pp=1),
                                         dtype=dtype)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(std=0.02)
    lengths = torch.tensor([5, 11], device=device)  # more than one token each: the kernels of any batch
    mask = torch.arange(11, device=device) < lengths[:, None]
    batch = model.make_batch(torch.zeros_like(mask, dtype=torch.long), mask)
    with torch.no_grad():
        model(batch)
    if backward:
        model(batch).float().sum().backward()
    return True


class ParallelLlamaForValue(ParallelLlama):
    """Output: one fp32 value per token ``[N]`` (the critic)."""

    hf_head = "score"

    def _build_head(self):
        self.score = nn.Linear(self.cfg.hidden_size, 1, bias=False, dtype=self.dtype)

    def _head(self, hidden, batch):
        sp = self.layout.sequence_parallel
        weight = mappings.copy_to_tp(self.score.weight, self.tp_group) if sp else self.score.weight
        values = F.linear(hidden, weight).squeeze(-1)
        # Under SP each rank scored its own tokens; every rank then uses all of them identically.
        return (mappings.gather_from_sp(values, self.tp_group, grad_is_partial=False) if sp else values).float()


class ParallelLlamaForScore(ParallelLlamaForValue):
    """Output: one fp32 score per sequence ``[B]``, the head at its last real token (left or right
    padding alike) — HF's ``LlamaForSequenceClassification`` with one label."""

    def _head(self, hidden, batch):
        return super()._head(hidden, batch)[batch.last_token_index()]

    def to_padded(self, out, batch):
        return out
