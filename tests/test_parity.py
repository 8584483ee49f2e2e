"""lib/ against transformers.LlamaForCausalLM with the same random weights (fp32, gloo).

Every layout: TP ∈ {1, 2}, PP ∈ {1, 2}, sequence parallel on/off, remove-padding on/off, left and
right padding; GQA, Llama-3 rope scaling and a vocabulary no TP divides are in every case.
"""

from __future__ import annotations

import pytest
import torch

import tiny
from llamarl.lib.rl import optim
from llamarl.lib.distributed import parallel
from llamarl.lib.model import schedule, vocab_parallel
from llamarl.lib.model.config import ParallelLayout
from llamarl.lib.model.llama import ParallelLlamaForCausalLM


def _build(tp, pp, sp, rmpad, **hf_overrides):
    parallel.init(tp, pp)
    hf = tiny.hf_model(**hf_overrides)
    layout = ParallelLayout(tp=tp, pp=pp, sequence_parallel=sp, remove_padding=rmpad)
    model = ParallelLlamaForCausalLM(tiny.our_config(hf), layout)
    model.load_hf_state_dict(hf.state_dict())
    return hf, model


def _micro_batches(model, ids, mask, pos):
    # Two micro-batches of unequal size, so the pipeline schedule has work in flight.
    rows = [slice(0, 2), slice(2, ids.shape[0])]
    return [model.make_batch(ids[r], mask[r], pos[r]) for r in rows]


def logits_error(tp, pp, sp, rmpad, side, tied):
    hf, model = _build(tp, pp, sp, rmpad, tie_word_embeddings=tied)
    ids, mask, pos = tiny.batch(side)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    if pp == 1:
        with torch.no_grad():
            logits = model.run(ids, mask, pos)
    else:
        batches = _micro_batches(model, ids, mask, pos)
        outs = schedule.forward(model, batches)
        if not parallel.topology().is_last_stage:
            return None
        logits = torch.cat([b.to_padded(o) for b, o in zip(batches, outs)])
    full = tiny.gather_tp(logits)
    assert full.shape[-1] >= ref.shape[-1]
    # Padded vocabulary entries must be unreachable: at the dtype's minimum.
    real = mask.bool()
    assert (full[real][:, ref.shape[-1]:] == torch.finfo(full.dtype).min).all()
    return (full[..., : ref.shape[-1]] - ref)[real].abs().max().item()


LAYOUTS_2 = [(1, 1, False), (2, 1, False), (2, 1, True), (1, 2, False)]


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("rmpad", [True, False], ids=["rmpad", "padded"])
@pytest.mark.parametrize("tp,pp,sp", LAYOUTS_2, ids=lambda v: str(v))
def test_logits_match_hf(pool2, tp, pp, sp, rmpad, side):
    errs = [e for e in pool2.run(logits_error, tp, pp, sp, rmpad, side, False) if e is not None]
    assert errs and max(errs) < 1e-4, errs


@pytest.mark.parametrize("tp,pp,sp", [(2, 1, True), (1, 2, False)], ids=lambda v: str(v))
def test_logits_match_hf_tied_embeddings(pool2, tp, pp, sp):
    errs = [e for e in pool2.run(logits_error, tp, pp, sp, True, "left", True) if e is not None]
    assert errs and max(errs) < 1e-4, errs


@pytest.mark.slow
@pytest.mark.parametrize("sp", [False, True], ids=["nosp", "sp"])
@pytest.mark.parametrize("rmpad", [True, False], ids=["rmpad", "padded"])
def test_logits_match_hf_tp2_pp2(pool4, sp, rmpad):
    errs = [e for e in pool4.run(logits_error, 2, 2, sp, rmpad, "left", False) if e is not None]
    assert len(errs) == 2 and max(errs) < 1e-4, errs


# ---- gradients -----------------------------------------------------------------------------


def _shifted_labels(ids, mask):
    labels = torch.roll(ids, -1, dims=1)
    label_mask = mask.bool() & torch.roll(mask.bool(), -1, dims=1)
    label_mask[:, -1] = False
    return labels, label_mask


def grad_errors(tp, pp, sp, rmpad, kv_heads, tied):
    hf, model = _build(tp, pp, sp, rmpad, num_key_value_heads=kv_heads, tie_word_embeddings=tied)
    ids, mask, pos = tiny.batch("right")
    labels, label_mask = _shifted_labels(ids, mask)
    scale = 1.0 / label_mask.sum()

    logits = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    ref_lp = torch.log_softmax(logits.float(), -1).gather(-1, labels[..., None]).squeeze(-1)
    (-(ref_lp * label_mask).sum() * scale).backward()
    ref = {n: p.grad for n, p in hf.named_parameters()}

    def loss_fn(out, extra):
        lab, lmask = extra
        return -(vocab_parallel.log_probs(out, lab) * lmask).sum() * scale

    batches = _micro_batches(model, ids, mask, pos) if pp > 1 else [model.make_batch(ids, mask, pos)]
    rows = [slice(0, 2), slice(2, 3)] if pp > 1 else [slice(0, 3)]
    extras = [(b.flat(labels[r]), b.flat(label_mask[r].float())) for b, r in zip(batches, rows)]
    buffer = optim.GradBuffer(model)  # fp32 parameters: .grad is the buffer's view
    schedule.forward_backward(model, batches, loss_fn, extras)
    buffer.reduce()
    grads = tiny.gather_hf_grads(model)
    assert grads, "this stage has no parameters"
    return {n: ((g - ref[n]).abs().max() / ref[n].abs().max()).item() for n, g in grads.items()}


@pytest.mark.parametrize(
    "tp,pp,sp,rmpad,kv_heads,tied",
    [
        (2, 1, False, True, 2, False),
        (2, 1, True, True, 2, False),
        (2, 1, True, False, 1, False),  # kv heads replicated over TP
        (2, 1, False, True, 2, True),
        (1, 2, False, True, 2, False),
        (1, 2, False, False, 2, True),  # tied embeddings across pipeline stages
    ],
    ids=lambda v: str(v),
)
def test_gradients_match_hf(pool2, tp, pp, sp, rmpad, kv_heads, tied):
    per_rank = pool2.run(grad_errors, tp, pp, sp, rmpad, kv_heads, tied)
    errors = {n: e for r in per_rank for n, e in r.items()}
    # Every HF parameter must have been compared on some rank.
    hf_names = {n for n, _ in tiny.hf_model(num_key_value_heads=kv_heads, tie_word_embeddings=tied).named_parameters()}
    assert set(errors) == hf_names
    worst = max(errors, key=errors.get)
    assert errors[worst] < 1e-4, (worst, errors[worst])
