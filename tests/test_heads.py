"""Value and score heads: shapes, last-valid-token selection, parity with HF's
LlamaForSequenceClassification (one label)."""

from __future__ import annotations

import pytest
import torch

import tiny
from llamarl.lib.distributed import parallel
from llamarl.lib.model.config import ParallelLayout
from llamarl.lib.model.llama import ParallelLlamaForScore, ParallelLlamaForValue


def head_errors(tp, sp, rmpad, side):
    parallel.init(tp, 1)
    hf = tiny.hf_model("score")
    cfg = tiny.our_config(hf)
    layout = ParallelLayout(tp=tp, sequence_parallel=sp, remove_padding=rmpad)
    ids, mask, pos = tiny.batch(side)
    with torch.no_grad():
        hidden = hf.model(input_ids=ids, attention_mask=mask, position_ids=pos).last_hidden_state
        ref_values = hf.score(hidden)[..., 0]
        # HF pools at the last non-pad token, found from pad_token_id.
        ref_scores = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits[:, 0]

    value_model = ParallelLlamaForValue(cfg, layout)
    value_model.load_hf_state_dict(hf.state_dict())
    score_model = ParallelLlamaForScore(cfg, layout)
    score_model.load_hf_state_dict(hf.state_dict())
    with torch.no_grad():
        values = value_model.run(ids, mask, pos)
        scores = score_model.run(ids, mask, pos)
    real = mask.bool()
    # The score is the value at each row's last real token.
    last = torch.where(real, torch.arange(ids.shape[1]), -1).amax(1)
    return {
        "value_shape": tuple(values.shape),
        "score_shape": tuple(scores.shape),
        "dtype": str(scores.dtype),
        "values": (values - ref_values)[real].abs().max().item(),
        "scores": (scores - ref_scores).abs().max().item(),
        "score_is_last_value": (scores - values[torch.arange(len(last)), last]).abs().max().item(),
    }


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("tp,sp,rmpad", [(1, False, True), (1, False, False), (2, False, True), (2, True, False), (2, True, True)],
                         ids=lambda v: str(v))
def test_value_and_score_heads(pool2, tp, sp, rmpad, side):
    for r in pool2.run(head_errors, tp, sp, rmpad, side):
        assert r["value_shape"] == (3, 12) and r["score_shape"] == (3,) and r["dtype"] == "torch.float32"
        assert r["values"] < 1e-4 and r["scores"] < 1e-4 and r["score_is_last_value"] < 1e-6, r


def test_row_without_tokens_is_a_clear_error():
    from llamarl.lib.model.batch import TokenBatch

    ids = torch.ones(2, 4, dtype=torch.long)
    mask = torch.tensor([[1, 1, 0, 0], [0, 0, 0, 0]])
    with pytest.raises(ValueError, match="no real token"):
        TokenBatch.from_padded(ids, mask).last_token_index()
