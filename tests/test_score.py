"""Stage score: RM parity with HF, re-tokenization, rules, errors, resumption."""

from __future__ import annotations

import json
import os

import pyarrow.parquet as pq
import pytest
import torch

import tiny
from llamarl.lib.distributed import parallel
from llamarl.lib.files import publish
from llamarl.lib.engine import tokenizer as toklib
from llamarl.lib.model.config import ParallelLayout
from llamarl.lib.errors import UserError
from llamarl.lib.rl import rewards
from llamarl.lib.model.llama import ParallelLlamaForScore
from llamarl.pipeline import toy
from llamarl.stages import rollout, score, shard
from llamarl.stages.config import RewardTerm, RolloutConfig, Sampling, ScoreConfig, ShardConfig

SEQS = [[5, 17, 33, 9, 40], [101, 7], [44, 45, 46, 47, 48, 49, 50, 51, 52], [200, 3, 9]]


def rm_scores_vs_hf(tp, pp, side):
    parallel.init(tp, pp)
    hf = tiny.hf_model("score")
    model = ParallelLlamaForScore(tiny.our_config(hf), ParallelLayout(tp=tp, pp=pp))
    model.load_hf_state_dict(hf.state_dict())
    ours = score.score_sequences(model, SEQS, micro_batch=3, padding_side=side)
    if ours is None:
        return None
    with torch.no_grad():
        ref = [hf(input_ids=torch.tensor([s])).logits[0, 0].item() for s in SEQS]
    return max(abs(a - b) for a, b in zip(ours, ref))


@pytest.mark.parametrize("side", ["left", "right"])
@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["tp1", "tp2", "pp2"])
def test_rm_scores_equal_hf_sequence_classification(pool2, tp, pp, side):
    errs = [e for e in pool2.run(rm_scores_vs_hf, tp, pp, side) if e is not None]
    assert errs and max(errs) < 1e-4, errs


# ---- re-tokenization ---------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tokenizers(tmp_path_factory):
    root = tmp_path_factory.mktemp("tok")
    actor = toy.make_tokenizer(str(root / "a"), toy.CORPUS_A)
    rm = toy.make_tokenizer(str(root / "b"), toy.CORPUS_B)
    return actor, rm


def _row(actor_tok, prompt, response_text):
    p_ids = toklib.encode_prompt(actor_tok, prompt)
    r_ids = actor_tok(response_text, add_special_tokens=False)["input_ids"] + [toy.EOS]
    return {"prompt": toklib.render_prompt(prompt), "prompt_token_ids": p_ids, "response_token_ids": r_ids}


def test_rm_sees_what_its_own_tokenizer_makes_of_the_decoded_text(tokenizers):
    actor_tok, rm_tok = tokenizers
    assert toklib.fingerprint(actor_tok) != toklib.fingerprint(rm_tok)
    rows = [_row(actor_tok, "what is two plus two?", "four, said the fox"),
            _row(actor_tok, [{"role": "user", "content": "lorem ipsum"}], "dolor sit amet")]
    seqs, truncated = score.rm_inputs(rows, actor_tok, rm_tok, max_length=512)
    assert truncated == 0
    for seq, (prompt, response) in zip(seqs, [("what is two plus two?", "four, said the fox"), ("lorem ipsum", "dolor sit amet")]):
        text = rm_tok.apply_chat_template([{"role": "user", "content": prompt}, {"role": "assistant", "content": response}],
                                          tokenize=False)
        assert seq == rm_tok(text, add_special_tokens=False)["input_ids"]
        assert rm_tok.decode(seq) == text


def test_same_tokenizer_reuses_token_ids_and_truncates_prompt_from_the_left(tokenizers):
    actor_tok, _ = tokenizers
    row = _row(actor_tok, "the quick brown fox jumps over the lazy dog", "yes")
    (seq,), truncated = score.rm_inputs([row], actor_tok, actor_tok, max_length=1000)
    assert seq == row["prompt_token_ids"] + row["response_token_ids"] and truncated == 0
    (short,), truncated = score.rm_inputs([row], actor_tok, actor_tok, max_length=10)
    assert truncated == 1 and len(short) == 10
    assert short == (row["prompt_token_ids"] + row["response_token_ids"])[-10:]


# ---- the stage end to end ----------------------------------------------------------------------


@pytest.fixture(scope="module")
def pipeline_inputs(tmp_path_factory, pool2):
    root = tmp_path_factory.mktemp("score")
    toy.make_llama(str(root / "actor_hf"), tokenizer_corpus=toy.CORPUS_A)
    toy.make_llama(str(root / "rm_hf"), kind="score", seed=1, tokenizer_corpus=toy.CORPUS_B)
    pool2.run(shard.run, ShardConfig(src=str(root / "actor_hf"), dst=str(root / "actor"), tp=2))
    pool2.run(shard.run, ShardConfig(src=str(root / "rm_hf"), dst=str(root / "rm"), tp=2))
    prompts = toy.make_prompts(str(root / "prompts.jsonl"), n=6)
    cfg = RolloutConfig(actor=str(root / "actor"), prompts=prompts, out=str(root / "rollout"), id_column="id",
                                keep_columns=["answer"], chunk_size=2, tp=2,
                                sampling=Sampling(samples_per_prompt=2, max_new_tokens=6, seed=1))
    pool2.run(rollout.run, cfg)
    return root


def _scores(out) -> list[dict]:
    parts = sorted(p for p in os.listdir(os.path.join(out, "parts")) if p.endswith(".parquet"))
    return [r for p in parts for r in pq.read_table(os.path.join(out, "parts", p)).to_pylist()]


def _score_cfg(root, out, **kw):
    terms = kw.pop("rewards", [RewardTerm(name="rm", weight=0.5), RewardTerm(name="contains", weight=2.0)])
    return ScoreConfig(rollout=str(root / "rollout"), out=str(out), reward_model=str(root / "rm"), rewards=terms,
                             micro_batch=3, **kw)


def test_score_stage_combines_rm_and_rules(pool2, pipeline_inputs, tmp_path):
    root = pipeline_inputs
    pool2.run(score.run, _score_cfg(root, tmp_path / "s", tp=2))
    rows = _scores(tmp_path / "s")
    assert len(rows) == 12 and publish.require_published(str(tmp_path / "s"), "scores")["rows"] == 12
    assert set(rows[0]) == {"prompt_id", "sample_index", "score", "score_rm", "score_contains", "rm_id"}
    for r in rows:
        assert abs(r["score"] - (0.5 * r["score_rm"] + 2.0 * r["score_contains"])) < 1e-5
    # The RM column is what HF's classifier says of the RM-tokenized conversation.
    from transformers import AutoModelForSequenceClassification

    hf = AutoModelForSequenceClassification.from_pretrained(root / "rm_hf").eval()
    actor_tok, rm_tok = toklib.load(str(root / "actor")), toklib.load(str(root / "rm"))
    ro = [r for p in sorted(os.listdir(root / "rollout" / "parts")) for r in pq.read_table(root / "rollout" / "parts" / p).to_pylist()]
    seqs, _ = score.rm_inputs(ro, actor_tok, rm_tok, 512)
    with torch.no_grad():
        ref = [hf(input_ids=torch.tensor([s])).logits[0, 0].item() for s in seqs]
    assert max(abs(a["score_rm"] - b) for a, b in zip(rows, ref)) < 1e-4
    # Same result at another layout (PP=2 for the RM, the path users struggle with).
    pool2.run(score.run, _score_cfg(root, tmp_path / "s_pp2", pp=2))
    assert max(abs(a["score"] - b["score"]) for a, b in zip(rows, _scores(tmp_path / "s_pp2"))) < 1e-4


def test_rerun_after_interruption_gives_identical_output(pool2, pipeline_inputs, tmp_path):
    root = pipeline_inputs
    pool2.run(score.run, _score_cfg(root, tmp_path / "a", tp=2))
    # Simulate a run killed after its first part: unpublish, drop the later parts, restore the marker.
    out = tmp_path / "b"
    pool2.run(score.run, _score_cfg(root, out, tp=2))
    marker = json.dumps(publish.read_manifest(str(out))["request"], sort_keys=True)
    (out / publish.MANIFEST).unlink()
    (out / publish.INCOMPLETE).write_text(marker)
    for p in sorted(os.listdir(out / "parts"))[1:]:
        (out / "parts" / p).unlink()
    kept = os.stat(out / "parts" / "part-000000.parquet").st_mtime_ns
    pool2.run(score.run, _score_cfg(root, out, tp=2))
    assert os.stat(out / "parts" / "part-000000.parquet").st_mtime_ns == kept
    assert _scores(tmp_path / "a") == _scores(out)


def test_nan_score_is_an_error_and_nothing_is_written(pool2, pipeline_inputs, tmp_path):
    cfg = _score_cfg(pipeline_inputs, tmp_path / "n", dp=2, rewards=[RewardTerm(name="rules_for_tests:nan_rule")])
    with pytest.raises(RuntimeError, match=r"rule 'rules_for_tests:nan_rule' scored \('p0000', 0\) nan: a score must "
                                           r"be a finite number"):
        pool2.run(score.run, cfg)
    assert publish.read_manifest(str(tmp_path / "n")) is None
    assert not (tmp_path / "n" / "parts").exists()


def test_unmatched_reference_keys_and_missing_columns_are_errors(pipeline_inputs, tmp_path):
    refs = tmp_path / "refs.jsonl"
    refs.write_text("".join(json.dumps({"prompt_id": f"p{i:04d}", "answer": "x"}) + "\n" for i in range(5)))  # p0005 missing
    cfg = _score_cfg(pipeline_inputs, tmp_path / "u", references=str(refs),
                     rewards=[RewardTerm(name="exact_match")])
    with pytest.raises(UserError, match="no row for prompt_id 'p0005'"):
        score.run(cfg)
    # a rollout whose parts lack a required column
    bad = tmp_path / "bad_rollout"
    (bad / "parts").mkdir(parents=True)
    table = pq.read_table(pipeline_inputs / "rollout" / "parts" / "part-000000.parquet").drop_columns(["prompt_token_ids"])
    pq.write_table(table, bad / "parts" / "part-000000.parquet")
    publish.publish(str(bad), {"kind": "rollout", "rows": len(table), "request": {},
                               "files": {"parts/part-000000.parquet": publish.file_entry(str(bad / "parts" / "part-000000.parquet"))}})
    with pytest.raises(UserError, match="missing column.*prompt_token_ids"):
        score.run(ScoreConfig(rollout=str(bad), out=str(tmp_path / "u2"), rewards=[RewardTerm(name="contains")]))
    assert not (tmp_path / "u").exists() and not (tmp_path / "u2").exists()


def test_reward_term_errors():
    with pytest.raises(UserError, match="unknown reward rule 'bogus'"):
        rewards.resolve("bogus")
    with pytest.raises(UserError, match="cannot be imported"):
        rewards.resolve("no_such_module:f")


def test_offload_moves_parameters_and_back():
    from llamarl.lib.model.offload import ParamOffload

    model = torch.nn.Linear(4, 4)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    ptrs = [p.data_ptr() for p in model.parameters()]
    off = ParamOffload(model, torch.device("cpu"))
    off.to_host()
    assert not off.on_device and [p.data_ptr() for p in model.parameters()] != ptrs
    off.to_device()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_offload_releases_device_memory():
    from llamarl.lib.model.offload import ParamOffload

    model = torch.nn.Linear(4096, 4096, device="cuda")
    used = torch.cuda.memory_allocated()
    off = ParamOffload(model, torch.device("cuda"))
    off.to_host()
    assert torch.cuda.memory_allocated() <= used - 4096 * 4096 * 4
    assert next(model.parameters()).is_pinned()
    off.to_device()
    assert torch.cuda.memory_allocated() >= used
