"""Vocab-parallel log-probs, entropy and cross-entropy against full-vocabulary references."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import tiny
from llamarl.lib.distributed import parallel
from llamarl.lib.model import vocab_parallel
from llamarl.lib.model.config import ParallelLayout, pad_vocab
from llamarl.lib.model.llama import ParallelLlamaForCausalLM

V = 251


def _reference(full, labels, w_lp, w_ent):
    full = full.detach().requires_grad_()
    lsm = torch.log_softmax(full, -1)
    lp = lsm.gather(-1, labels[:, None]).squeeze(-1)
    ent = -(lsm.exp() * lsm).sum(-1)
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    return lp.detach(), ent.detach(), full.grad


def vocab_ops_errors(tp):
    parallel.init(tp, 1)
    g = torch.Generator().manual_seed(0)
    n = 10
    full = torch.randn(n, V, generator=g, dtype=torch.float64).float() * 3
    labels = torch.randint(0, V, (n,), generator=g)
    w_lp, w_ent = torch.randn(n, generator=g), torch.randn(n, generator=g)
    ref_lp, ref_ent, ref_grad = _reference(full, labels, w_lp, w_ent)

    vp = pad_vocab(V, tp)
    padded = torch.cat([full, full.new_full((n, vp - V), torch.finfo(full.dtype).min)], dim=1)
    per = vp // tp
    r = parallel.topology().tp_rank
    local = padded[:, r * per : (r + 1) * per].clone().requires_grad_()
    # The group passed explicitly here, left to default (the current TP group) for the fused op.
    lp = vocab_parallel.log_probs(local, labels, parallel.tp_group())
    ent = vocab_parallel.entropy(local, parallel.tp_group())
    ((lp * w_lp).sum() + (ent * w_ent).sum()).backward()
    grad = tiny.gather_tp(local.grad)
    fused_in = local.detach().clone().requires_grad_()
    f_lp, f_ent = vocab_parallel.log_probs_and_entropy(fused_in, labels)
    ((f_lp * w_lp).sum() + (f_ent * w_ent).sum()).backward()
    fused_grad = tiny.gather_tp(fused_in.grad)

    ours_ce = vocab_parallel.cross_entropy(local.detach(), labels)
    # megatron-core's op as the reference, on its own groups (the same rank layout as ours).
    from megatron.core import parallel_state as ps
    from megatron.core.tensor_parallel import vocab_parallel_cross_entropy

    parallel.destroy_model_parallel()
    ps.initialize_model_parallel(tensor_model_parallel_size=tp)
    mc_ce = vocab_parallel_cross_entropy(local.detach().clone()[:, None, :], labels[:, None])[:, 0]
    ps.destroy_model_parallel()
    parallel.destroy_model_parallel()  # and their communicators
    return {
        "logprob": (lp - ref_lp).abs().max().item(),
        "entropy": (ent - ref_ent).abs().max().item(),
        "grad": (grad[:, :V] - ref_grad).abs().max().item(),
        "fused_logprob": (f_lp - ref_lp).abs().max().item(),
        "fused_entropy": (f_ent - ref_ent).abs().max().item(),
        "fused_grad": (fused_grad[:, :V] - ref_grad).abs().max().item(),
        "fused_grad_padding": fused_grad[:, V:].abs().max().item() if vp > V else 0.0,
        "grad_padding": grad[:, V:].abs().max().item() if vp > V else 0.0,
        "cross_entropy_vs_megatron": (ours_ce - mc_ce).abs().max().item(),
    }


@pytest.mark.parametrize("tp", [1, 2])
def test_vocab_parallel_ops_match_full_vocab(pool2, tp):
    for errs in pool2.run(vocab_ops_errors, tp):
        assert max(errs.values()) < 1e-5, errs


def test_vocab_parallel_ops_in_bf16_compute_in_fp32():
    # bf16 logits: the op upcasts, so it matches the fp32 reference on the same (rounded) values.
    # (No process group here: lib/ then runs as a single rank.)
    full = (torch.randn(6, V) * 3).bfloat16()
    labels = torch.randint(0, V, (6,))
    lp = vocab_parallel.log_probs(full, labels)
    assert lp.dtype == torch.float32
    ref = torch.log_softmax(full.float(), -1).gather(-1, labels[:, None]).squeeze(-1)
    assert (lp - ref).abs().max() < 1e-5


class _ShapeRecorder(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[str, tuple[int, ...]]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.shapes.append((str(func), tuple(t.shape)))
        return out


def full_vocab_allocations(sp):
    parallel.init(2, 1)
    hf = tiny.hf_model()
    model = ParallelLlamaForCausalLM(tiny.our_config(hf), ParallelLayout(tp=2, sequence_parallel=sp))
    model.load_hf_state_dict(hf.state_dict())
    ids, mask, pos = tiny.batch("left")
    batch = model.make_batch(ids, mask, pos)
    labels = batch.flat(torch.roll(ids, -1, 1))
    with _ShapeRecorder() as rec:
        logits = model(batch)
        loss = -vocab_parallel.log_probs(logits, labels).sum() - vocab_parallel.entropy(logits).sum()
        loss.backward()
    full = {V, pad_vocab(V, 2)}
    offending = [(f, s) for f, s in rec.shapes if full & set(s)]
    local_seen = any(pad_vocab(V, 2) // 2 in s for _, s in rec.shapes)
    return offending, local_seen, len(rec.shapes)


@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
def test_no_rank_allocates_full_vocab_tensor(pool2, sp):
    for offending, local_seen, n_ops in pool2.run(full_vocab_allocations, sp):
        assert n_ops > 100 and local_seen, "the recorder saw no vocab-sharded tensors: it is not recording"
        assert not offending, offending[:5]
