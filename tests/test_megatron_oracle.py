"""megatron-core as the oracle of the parallel layers: our ColumnParallelLinear, RowParallelLinear
and VocabParallelEmbedding against megatron-core's own, at TP 2 on gloo, with the same weights
and inputs — outputs, input gradients and weight gradients (docs/lib.md: what llamarl takes from
megatron-core and why it does not import it at run time)."""

from __future__ import annotations

import pytest
import torch

from llamarl.lib.distributed import parallel
from llamarl.lib.model import layers


def _megatron_config(tp: int):
    from megatron.core.model_parallel_config import ModelParallelConfig

    return ModelParallelConfig(tensor_model_parallel_size=tp, use_cpu_initialization=True, params_dtype=torch.float32)


def _pair_errors(make_ours, make_theirs, x_full, split_input: bool) -> dict[str, float]:
    """Max differences of one layer pair on this rank: forward output, input grad, weight grad."""
    from megatron.core import parallel_state as ps

    tp, rank = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    theirs = make_theirs()
    ours = make_ours()
    with torch.no_grad():
        ours.weight.copy_(theirs.weight)
        if getattr(ours, "bias", None) is not None:
            ours.bias.copy_(theirs.bias)
    x = x_full.chunk(tp, dim=-1)[rank] if split_input else x_full
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    out_theirs = theirs(xa)
    out_theirs = out_theirs[0] if isinstance(out_theirs, tuple) else out_theirs
    out_ours = ours(xb)
    g = torch.Generator().manual_seed(7)
    w = torch.randn(out_ours.shape, generator=g)
    (out_theirs * w).sum().backward()
    (out_ours * w).sum().backward()
    return {"out": (out_ours - out_theirs).abs().max().item(), "dx": (xb.grad - xa.grad).abs().max().item(),
            "dw": (ours.weight.grad - theirs.weight.grad).abs().max().item()}


def layer_errors(tp: int) -> dict[str, dict[str, float]]:
    from megatron.core import parallel_state as ps
    from megatron.core import tensor_parallel as mtp

    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    parallel.init(tp, 1)
    group, cfg = parallel.tp_group(), _megatron_config(tp)
    init = torch.nn.init.normal_
    torch.manual_seed(0)  # megatron draws the full weight on every rank and keeps its slice
    hidden, ffn, vocab, tokens = 16, 24, 32, 5
    g = torch.Generator().manual_seed(1)
    found = {
        "column": _pair_errors(
            lambda: layers.ColumnParallelLinear(hidden, ffn // tp, bias=True, tp_group=group, sequence_parallel=False),
            lambda: mtp.ColumnParallelLinear(hidden, ffn, config=cfg, init_method=init, bias=True, gather_output=False),
            torch.randn(tokens, hidden, generator=g), split_input=False),
        "row": _pair_errors(
            lambda: layers.RowParallelLinear(ffn // tp, hidden, bias=True, tp_group=group, sequence_parallel=False),
            lambda: mtp.RowParallelLinear(ffn, hidden, config=cfg, init_method=init, bias=True, input_is_parallel=True,
                                          skip_bias_add=False),
            torch.randn(tokens, ffn, generator=g), split_input=True),
    }
    ids = torch.randint(0, vocab, (tokens,), generator=g)
    theirs = mtp.VocabParallelEmbedding(vocab, hidden, init_method=init, config=cfg)
    ours = layers.VocabParallelEmbedding(vocab, hidden, tp_group=group, sequence_parallel=False)
    with torch.no_grad():
        ours.weight.copy_(theirs.weight)
    w = torch.randn(tokens, hidden, generator=g)
    (theirs(ids) * w).sum().backward()
    (ours(ids) * w).sum().backward()
    found["embedding"] = {"out": (ours(ids) - theirs(ids)).abs().max().item(),
                          "dw": (ours.weight.grad - theirs.weight.grad).abs().max().item()}
    ps.destroy_model_parallel()
    parallel.destroy_model_parallel()
    return found


@pytest.mark.parametrize("tp", [2])
def test_parallel_layers_are_megatron_cores(pool2, tp):
    for found in pool2.run(layer_errors, tp):
        for layer, errors in found.items():
            for what, err in errors.items():
                assert err <= 1e-6, (layer, what, err)
