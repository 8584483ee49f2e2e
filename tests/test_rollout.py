"""Stage rollout: Parquet parts with the documented schema, determinism, resumption, errors."""

from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from llamarl.lib.files import publish
from llamarl.lib.errors import UserError
from llamarl.pipeline import toy
from llamarl.stages import rollout, shard
from llamarl.stages.config import RolloutConfig, Sampling, ShardConfig

COLUMNS = ["prompt_id", "sample_index", "prompt", "prompt_token_ids", "response", "response_token_ids",
           "response_logprobs", "finish_reason"]


@pytest.fixture(scope="module")
def actor(tmp_path_factory, pool2):
    root = tmp_path_factory.mktemp("actor")
    toy.make_llama(str(root / "hf"))
    pool2.run(shard.run, ShardConfig(src=str(root / "hf"), dst=str(root / "ckpt"), tp=2))
    return str(root / "ckpt")


@pytest.fixture(scope="module")
def prompts(tmp_path_factory):
    return toy.make_prompts(str(tmp_path_factory.mktemp("prompts") / "prompts.jsonl"), n=10)


def _cfg(actor, prompts, out, **kw):
    sampling = Sampling(**{"samples_per_prompt": 2, "max_new_tokens": 8, "temperature": 1.0, "seed": 7,
                                   **kw.pop("sampling", {})})
    return RolloutConfig(actor=actor, prompts=prompts, out=str(out), sampling=sampling,
                         **{"id_column": "id", "keep_columns": ["answer"], "chunk_size": 4, "max_batch": 3, **kw})


def _rows(out) -> list[dict]:
    parts = sorted(p for p in os.listdir(os.path.join(out, "parts")) if p.endswith(".parquet"))
    return [r for p in parts for r in pq.read_table(os.path.join(out, "parts", p)).to_pylist()]


def test_rollout_writes_documented_parquet(pool2, actor, prompts, tmp_path):
    out = tmp_path / "r"
    pool2.run(rollout.run, _cfg(actor, prompts, out, tp=2))
    manifest = publish.require_published(str(out), "rollout")
    assert manifest["rows"] == 20 and len([f for f in manifest["files"] if f.startswith("parts/")]) == 3
    import datasets
    import pandas as pd

    df = pd.concat(pd.read_parquet(out / "parts" / p) for p in sorted(os.listdir(out / "parts")))
    assert list(df.columns) == COLUMNS + ["answer"] and len(df) == 20
    ds = datasets.load_dataset("parquet", data_files=str(out / "parts" / "*.parquet"), split="train")
    assert ds.column_names == COLUMNS + ["answer"] and ds.num_rows == 20
    table = pq.read_table(out / "parts" / "part-000000.parquet")
    meta = {k.decode(): v.decode() for k, v in table.schema.metadata.items() if not k.startswith(b"ARROW")}
    assert meta["actor_id"] == publish.output_id(actor) and json.loads(meta["sampling"])["seed"] == 7
    assert table.schema.field("response_logprobs").type.value_type == pa.float32()
    assert table.schema.field("response_token_ids").type.value_type == pa.int32()

    tok = __import__("llamarl.lib.engine.tokenizer", fromlist=["load"]).load(actor)
    keys = set()
    for r in _rows(out):
        keys.add((r["prompt_id"], r["sample_index"]))
        assert len(r["response_token_ids"]) == len(r["response_logprobs"]) <= 8
        assert all(lp <= 0 for lp in r["response_logprobs"])
        assert r["finish_reason"] == ("stop" if r["response_token_ids"][-1] == toy.EOS else "length")
        assert tok.decode(r["prompt_token_ids"]).startswith("<|user|>")  # chat template applied
        assert r["response"] == tok.decode(r["response_token_ids"], skip_special_tokens=True)
    assert keys == {(f"p{i:04d}", k) for i in range(10) for k in range(2)}


def _same_rows(a, b):
    """Equal rows; log-probs to float rounding (another batch size rounds the logits differently)."""
    assert len(a) == len(b)
    for ra, rb in zip(a, b):
        la, lb = ra.pop("response_logprobs"), rb.pop("response_logprobs")
        assert ra == rb
        assert max((abs(x - y) for x, y in zip(la, lb)), default=0) < 1e-5


def test_same_seed_same_samples_any_dp_and_max_batch(pool1, pool2, actor, prompts, tmp_path):
    # DP2 with 4 slots per engine (refilled as sequences finish) against DP1 with 64 slots: other
    # chunk order, other batch neighbours, the same responses.
    pool2.run(rollout.run, _cfg(actor, prompts, tmp_path / "dp2", tp=1, dp=2, max_batch=4))
    pool1.run(rollout.run, _cfg(actor, prompts, tmp_path / "dp1", tp=1, dp=1, max_batch=64))
    a, b = _rows(tmp_path / "dp2"), _rows(tmp_path / "dp1")
    assert len({tuple(r["response_token_ids"]) for r in a}) > 10  # sampled, not all alike
    _same_rows(a, b)
    pool2.run(rollout.run, _cfg(actor, prompts, tmp_path / "seed8", tp=1, dp=2, sampling={"seed": 8}))
    assert [r["response_token_ids"] for r in _rows(tmp_path / "seed8")] != [r["response_token_ids"] for r in _rows(tmp_path / "dp1")]


def _parts(out) -> dict[str, bytes]:
    return {p: (out / "parts" / p).read_bytes() for p in sorted(os.listdir(out / "parts"))}


def test_overlap_and_chunk_size_change_no_byte_of_the_rows(pool1, actor, prompts, tmp_path):
    # Overlapped (tokenizing ahead, one engine stream across chunks with 3 slots, so sequences of
    # the next chunk run beside the last ones of this one, parts written behind) against chunk
    # after chunk, each drained: the same part files, byte for byte, and the same manifest entries.
    stops = {"stop_token_ids": list(range(40, 70))}  # random response lengths
    pool1.run(rollout.run, _cfg(actor, prompts, tmp_path / "overlap", tp=1, sampling=stops))
    pool1.run(functools.partial(rollout.run, overlap=False), _cfg(actor, prompts, tmp_path / "serial", tp=1, sampling=stops))
    a, b = _parts(tmp_path / "overlap"), _parts(tmp_path / "serial")
    assert list(a) == [f"part-{i:06d}.parquet" for i in range(3)] and a == b
    ma, mb = (publish.require_published(str(tmp_path / d), "rollout") for d in ("overlap", "serial"))
    assert ma["files"] == mb["files"] and ma["rows"] == mb["rows"] == 20
    assert {k: v for k, v in ma["stats"].items() if k != "engine_s"} == {k: v for k, v in mb["stats"].items() if k != "engine_s"}
    # Another chunk size makes other part files (the contract: chunk_size decides the files, not
    # the rows), with the same rows in the same order (log-probs to float rounding: prompts are
    # prefilled in other groups) and the same metadata.
    pool1.run(rollout.run, _cfg(actor, prompts, tmp_path / "chunk3", tp=1, chunk_size=3, sampling=stops))
    assert len(_parts(tmp_path / "chunk3")) == 4
    _same_rows(_rows(tmp_path / "chunk3"), _rows(tmp_path / "overlap"))
    schema = [pq.read_schema(tmp_path / d / "parts" / "part-000000.parquet") for d in ("chunk3", "overlap")]
    assert schema[0] == schema[1] and schema[0].metadata == schema[1].metadata


def test_a_rollout_of_every_row_writes_the_parts_the_pyarrow_reader_made(pool1, actor, tmp_path):
    # Golden: the parts, byte for byte, that the previous reader (pyarrow's dataset, columns typed
    # per part) and writer made from the same responses: the prompt ids, prompts and kept values
    # from its rows, the rest as sampled. Kept columns of every JSON type, blank lines between rows.
    import io

    import pyarrow.dataset as pads

    from llamarl.lib.engine import tokenizer as toklib
    from llamarl.stages import contract

    url = tmp_path / "p.jsonl"
    with open(url, "w") as f:
        for i, row in enumerate(json.loads(line) for line in open(toy.make_prompts(str(tmp_path / "t.jsonl"), n=10))):
            f.write(json.dumps({**row, "n": i, "x": i / 3, "tags": ["t"] * (i % 3), "meta": {"k": i}}) + "\n" * (1 + i % 2))
    keep = ["answer", "n", "x", "tags", "meta"]
    pool1.run(rollout.run, _cfg(actor, str(url), tmp_path / "out", tp=1, keep_columns=keep))
    old = pads.dataset([str(url)], format="json").to_table(columns=["prompt", "id", *keep]).to_pylist()
    parts = _parts(tmp_path / "out")
    assert len(parts) == 3
    for c, (name, data) in enumerate(parts.items()):
        table = pq.read_table(io.BytesIO(data))
        rows = [old[4 * c + i // 2] for i in range(table.num_rows)]  # 2 samples a prompt
        cols = {k: table.column(k).to_pylist() for k in contract.ROLLOUT_COLUMNS}
        cols |= {contract.PROMPT_ID: [r["id"] for r in rows], contract.PROMPT: [toklib.render_prompt(r["prompt"]) for r in rows]}
        meta = {k.decode(): v.decode() for k, v in table.schema.metadata.items() if not k.startswith(b"ARROW")}
        buf = io.BytesIO()
        pq.write_table(contract.rollout_table(cols, {k: [r[k] for r in rows] for k in keep}, meta), buf)
        assert buf.getvalue() == data, name


def rollout_with_failing_writer(cfg, fail_on: int) -> list[str]:
    """The stage, with the fail_on-th part write failing half-way (a full disk); the names of the
    parts written, in order, up to the failure."""
    from llamarl.stages import contract

    write, calls = contract.write_part, []

    def failing(root, name, table):
        calls.append(name)
        if len(calls) == fail_on:
            os.makedirs(f"{root}/parts", exist_ok=True)
            with open(f"{root}/parts/.{name}.tmp", "wb") as f:
                f.write(b"PAR1")
            raise OSError(28, "No space left on device")
        write(root, name, table)

    contract.write_part = failing
    try:
        rollout.run(cfg)
    except OSError as e:
        return calls + [f"raised: {e}"]
    finally:
        contract.write_part = write
    return calls


@pytest.mark.parametrize("fail_on", [1, 3], ids=["first-part", "last-part"])
def test_a_failed_part_write_fails_the_stage_and_a_rerun_finishes_it(pool1, actor, prompts, tmp_path, fail_on):
    out = tmp_path / "r"
    cfg = _cfg(actor, prompts, out, tp=1)
    calls, = pool1.run(rollout_with_failing_writer, cfg, fail_on)
    # raised in the stage (not a hang), after the failed part: no part written after it
    assert calls[-1] == "raised: [Errno 28] No space left on device" and len(calls) == fail_on + 1
    published = sorted(p for p in os.listdir(out / "parts") if p.endswith(".parquet"))
    assert published == sorted(calls[: fail_on - 1])  # those before the failure, whole; not the half one
    assert publish.read_manifest(str(out)) is None
    pool1.run(rollout.run, cfg)
    manifest = publish.require_published(str(out), "rollout")
    assert manifest["stats"]["skipped_chunks"] == fail_on - 1 and manifest["rows"] == 20
    pool1.run(rollout.run, _cfg(actor, prompts, tmp_path / "whole", tp=1))
    assert _parts(out) == _parts(tmp_path / "whole")
    assert not [p for p in os.listdir(out / "parts") if not p.endswith(".parquet")]


def test_greedy_rollout_is_layout_independent(pool2, actor, prompts, tmp_path):
    greedy = {"temperature": 0.0}
    pool2.run(rollout.run, _cfg(actor, prompts, tmp_path / "tp2", tp=2, sampling=greedy))
    pool2.run(rollout.run, _cfg(actor, prompts, tmp_path / "tp1", tp=1, dp=2, sampling=greedy))
    a, b = _rows(tmp_path / "tp2"), _rows(tmp_path / "tp1")
    assert [r["response_token_ids"] for r in a] == [r["response_token_ids"] for r in b]


def test_bad_inputs_are_clear_errors(actor, prompts, tmp_path):
    with pytest.raises(UserError, match=r"no column\(s\) question; it has id, prompt, answer"):
        rollout.run(_cfg(actor, prompts, tmp_path / "x", prompt_column="question"))
    with pytest.raises(UserError, match="no such file"):
        rollout.run(_cfg(actor, str(tmp_path / "nope.jsonl"), tmp_path / "x"))
    (tmp_path / "bad.csv").write_text("a,b\n")
    with pytest.raises(UserError, match="no .parquet, .jsonl or .json files"):
        rollout.run(_cfg(actor, str(tmp_path / "bad.csv"), tmp_path / "x"))
    vocab = publish.read_manifest(actor)["model_config"]["vocab_size"]
    with pytest.raises(UserError, match=rf"^sampling.stop_token_ids.1={vocab} is no token of {actor}, whose vocabulary "
                                        rf"has {vocab}; give ids below {vocab}$"):
        rollout.run(_cfg(actor, prompts, tmp_path / "x", sampling={"stop_token_ids": [2, vocab]}))
    # A bad value is refused when the config is built, before the stage runs.
    with pytest.raises(UserError, match=r"^opts.yaml: sampling.top_p=1.5: Input should be less than or equal to 1$"):
        RolloutConfig.parse({"actor": actor, "prompts": prompts, "out": str(tmp_path / "x"), "sampling": {"top_p": 1.5}},
                            "opts.yaml")
    assert not (tmp_path / "x").exists()


@pytest.mark.slow
def test_killed_mid_run_then_rerun_gives_same_rows_none_twice(actor, tmp_path):
    prompts = toy.make_prompts(str(tmp_path / "p.jsonl"), n=24)
    opts = tmp_path / "opts.yaml"
    opts.write_text("id_column: id\nchunk_size: 2\nmax_batch: 4\nsampling: {samples_per_prompt: 2, max_new_tokens: 24, seed: 3}\n")

    def cli(out, **popen):
        return subprocess.Popen([sys.executable, "-m", "llamarl.pipeline.cli", "stage", "rollout", actor, prompts, str(out),
                                 "--tp", "2", "--config", str(opts)], **popen)

    assert cli(tmp_path / "whole", stdout=subprocess.DEVNULL).wait(timeout=300) == 0
    out = tmp_path / "killed"
    proc = cli(out, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 240
    while time.monotonic() < deadline:  # kill once a few parts are published, mid-chunk
        parts = os.listdir(out / "parts") if (out / "parts").exists() else []
        if len([p for p in parts if p.endswith(".parquet")]) >= 3:
            break
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert publish.read_manifest(str(out)) is None  # never looks finished
    published_before = {p: os.stat(out / "parts" / p).st_mtime_ns for p in os.listdir(out / "parts") if p.endswith(".parquet")}
    assert 3 <= len(published_before) < 12
    assert cli(out, stdout=subprocess.DEVNULL).wait(timeout=300) == 0
    # the parts published before the kill were kept, not redone
    assert all(os.stat(out / "parts" / p).st_mtime_ns == t for p, t in published_before.items())
    a, b = _rows(tmp_path / "whole"), _rows(out)
    assert a == b and len({(r["prompt_id"], r["sample_index"]) for r in b}) == len(b) == 48
    assert not [p for p in os.listdir(out / "parts") if not p.endswith(".parquet")]


def test_prompts_are_held_to_the_actors_positions(pool1, actor, tmp_path):
    # The toy actor has max_position_embeddings 512: a 700-word prompt + 8 new tokens does not fit.
    long = tmp_path / "long.jsonl"
    long.write_text(json.dumps({"id": "long", "prompt": " ".join(["hello world"] * 350)}) + "\n"
                    + json.dumps({"id": "short", "prompt": "the cat"}) + "\n")
    pool1.run(rollout.run, RolloutConfig(actor=actor, prompts=str(long), out=str(tmp_path / "out"), id_column="id",
                                                 sampling=Sampling(samples_per_prompt=1, max_new_tokens=8)))
    rows = {r["prompt_id"]: r for r in _rows(tmp_path / "out")}
    assert len(rows["long"]["prompt_token_ids"]) == 512 - 8
    manifest = publish.require_published(str(tmp_path / "out"), "rollout")
    assert manifest["stats"]["truncated_prompts"] == 1
    # The engine's own time, within the stage's work time (what bench/e2e.py compares the wall with).
    timing = manifest["timing"]
    assert 0 < manifest["stats"]["engine_s"] < timing["work_end"] - timing["work_start"]
    cfg = {"actor": actor, "prompts": str(long), "out": str(tmp_path / "refused"), "id_column": "id",
           "overlong_prompts": "error", "sampling": {"max_new_tokens": 8}}
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "29531"}
    r = subprocess.run([sys.executable, "-m", "llamarl.stages.rollout", "--config-json", json.dumps(cfg)],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 2 and f"{long}: line 1 (row 0): " in r.stderr and "overlong_prompts: truncate" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    with pytest.raises(RuntimeError, match="UserError: sampling.max_new_tokens=600 leaves no room"):
        pool1.run(rollout.run, RolloutConfig(actor=actor, prompts=str(long), out=str(tmp_path / "x"),
                                                     sampling=Sampling(max_new_tokens=600)))


def test_a_prompts_file_without_rows_is_refused_before_any_output(pool1, actor, tmp_path):
    empty = tmp_path / "empty.parquet"
    pq.write_table(pa.table({"prompt": pa.array([], pa.string())}), empty)
    with pytest.raises(RuntimeError, match=rf"UserError: {empty}: no prompts \(0 rows\)"):
        pool1.run(rollout.run, RolloutConfig(actor=actor, prompts=str(empty), out=str(tmp_path / "out")))
    assert not (tmp_path / "out").exists()


@pytest.mark.slow
@pytest.mark.parametrize("layout", [["--dp", "2"], ["--tp", "2"]], ids=["dp2", "tp2"])
def test_the_multi_gpu_rollout_bench_runs_small_on_cpu(tmp_path, layout):
    # bench/rollout.py --tp/--dp under torchrun, over gloo: one GPU (rank 0 alone), then the layout.
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = tmp_path / "r.json"
    r = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                        os.path.join(root, "bench", "rollout.py"), *layout, "--small", "--out", str(out)],
                       capture_output=True, text=True, timeout=300, cwd=root)
    assert r.returncode == 0, r.stderr[-3000:]
    res = json.loads(out.read_text())
    key = "tp1_dp2" if layout[0] == "--dp" else "tp2_dp1"
    assert res["one_gpu"]["tokens"] == res[key]["tokens"] == 32 * 16 and res[key]["speedup_over_one_gpu"] > 0
    # the same tokens as one GPU: at DP to the bit (batch-invariant engines); at TP the same draws
    assert res[key]["same_tokens_as_one_gpu"] == 1.0
    assert ("dp_speedup" in res) == (layout[0] == "--dp")
    # bench/tables.py (docs/benchmarks.md) renders the layout's row next to one GPU's
    sys.path.insert(0, os.path.join(root, "bench"))
    import tables

    text = "\n".join(tables.rollout(str(out)))
    name = "TP1 × DP2" if layout[0] == "--dp" else "TP2 × DP1"
    row = next(line for line in text.splitlines() if line.startswith(f"| {name} |"))
    assert f"**{res[key]['speedup_over_one_gpu']:.2f}×**" in row and row.endswith("| 1.00 |")
    assert "| one device (TP1) |" in text


def test_the_tokenizer_process_gives_the_ids_and_texts_of_the_tokenizer_here(tmp_path):
    # A stage process tokenizes in a child process (lib/engine/tokenizer_process.py): the same ids and
    # texts as in-process, errors as one-line UserErrors, a dead child named.
    from llamarl.lib.engine import tokenizer as T
    from llamarl.lib.engine import tokenizer_process

    assert tokenizer_process.config_json_value(["--config-json", '{"actor": "s3://b/a/"}'], "actor") == "s3://b/a"
    for argv in (["--config", "x.yaml"], ["--config-json", "{not json"], ["--config-json", "[1]"], ["--config-json"]):
        assert tokenizer_process.config_json_value(argv, "actor") is None  # then it loads when asked
    toy.make_tokenizer(str(tmp_path / "chat" / "hf"))
    toy.make_tokenizer(str(tmp_path / "plain" / "hf"), chat_template=None)
    prompts = ["the cat sat", [{"role": "user", "content": "hello there"}], "ünïcode  and   spaces"]
    local = T.Local(T.load(str(tmp_path / "chat")))
    proc = tokenizer_process.TokenizerProcess().load(str(tmp_path / "chat"))
    plain = tokenizer_process.TokenizerProcess().load(str(tmp_path / "plain"))
    try:
        assert proc.eos_token_id == local.eos_token_id is not None
        for mode in ("auto", "never"):
            assert proc.encode_prompts(prompts, mode) == local.encode_prompts(prompts, mode)
        ids = local.encode_prompts(prompts) + [[5, 6, 7, local.eos_token_id]]
        assert proc.decode(ids) == local.decode(ids)
        with pytest.raises(UserError, match="no chat template"):
            plain.encode_prompts([[{"role": "user", "content": "hi"}]])
        assert plain.encode_prompts(["the cat"]) == T.Local(T.load(str(tmp_path / "plain"))).encode_prompts(["the cat"])
        (tmp_path / "empty" / "hf").mkdir(parents=True)
        with pytest.raises(UserError, match="has no tokenizer files"):
            tokenizer_process.TokenizerProcess().load(str(tmp_path / "empty"))
        # Told the checkpoint at its start (as a stage process does), it loads before the request;
        # an error then waits for the request.
        early = tokenizer_process.TokenizerProcess(tokenizer_process.spawn(str(tmp_path / "chat")))
        time.sleep(4)  # its imports and load take ~1.5 s here
        asked = time.time()
        assert early.load(str(tmp_path / "chat")).encode_prompts(prompts) == local.encode_prompts(prompts)
        assert early.times["loaded"] < asked
        early.close()
        with pytest.raises(UserError, match="has no tokenizer files"):
            tokenizer_process.TokenizerProcess(tokenizer_process.spawn(str(tmp_path / "empty"))).load(str(tmp_path / "empty"))
        plain.proc.kill()
        plain.proc.wait()
        with pytest.raises(RuntimeError, match="tokenizer process .* exited"):
            plain.decode([[5]])
    finally:
        proc.close()
        plain.close()


def test_tokenizer_loads_as_autotokenizer_would_without_its_imports(tmp_path):
    # A generic fast tokenizer (Llama 3's class, and what save_pretrained of one writes) is loaded
    # as that class: the same tokenizer AutoTokenizer gives, without importing every model's config.
    toy.make_tokenizer(str(tmp_path / "hf"))
    code = ("import json, sys; from llamarl.lib.engine import tokenizer as T; tok = T.load(sys.argv[1]); "
            "print(json.dumps([type(tok).__name__, T.fingerprint(tok), T.encode_prompt(tok, 'the cat sat'), "
            "'transformers.models.auto.tokenization_auto' in sys.modules]))")
    out = subprocess.run([sys.executable, "-c", code, str(tmp_path)], capture_output=True, text=True, check=True)
    name, fingerprint, ids, auto = json.loads(out.stdout.strip().splitlines()[-1])
    from transformers import AutoTokenizer

    from llamarl.lib.engine import tokenizer as toklib

    ref = AutoTokenizer.from_pretrained(str(tmp_path / "hf"))
    assert (name, fingerprint, ids) == (type(ref).__name__, toklib.fingerprint(ref), toklib.encode_prompt(ref, "the cat sat"))
    assert not auto


def test_a_tokenizer_process_whose_stage_left_before_its_reply_exits_without_a_word():
    # A rollout that refuses a damaged actor ends while its tokenizer process still answers: the
    # stage's one-line error must stay the only line (no BrokenPipeError traceback after it).
    import pickle

    proc = subprocess.Popen([sys.executable, "-m", "llamarl.lib.engine.tokenizer_process"], stdin=subprocess.PIPE,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    proc.stdout.close()  # the stage is gone before the reply
    pickle.dump(("decode", [[5]]), proc.stdin)
    proc.stdin.close()
    assert proc.wait(timeout=120) == 0
    assert proc.stderr.read().decode() == ""
