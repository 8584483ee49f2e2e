"""Stages shard and export: HF → sharded (any layout) → HF, bit for bit; loading; failures."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import pytest
import torch
from safetensors.torch import load_file

import tiny
from llamarl.lib.files import checkpoint, checksums, dcp_format, publish
from llamarl.lib.distributed import parallel
from llamarl.lib.model.config import LlamaConfig, ParallelLayout
from llamarl.lib.errors import UserError
from llamarl.lib.model.llama import ParallelLlamaForCausalLM, ParallelLlamaForScore
from llamarl.stages import export, shard
from llamarl.stages.config import ExportConfig, ShardConfig

HERE = os.path.dirname(__file__)


def _hf_dir(path, kind="lm", dtype=torch.float32, max_shard_size=None, **overrides):
    model = tiny.hf_model(kind, **overrides).to(dtype)
    kw = {"max_shard_size": max_shard_size} if max_shard_size else {}
    model.save_pretrained(path, **kw)
    return model


def _tensors(path) -> dict[str, torch.Tensor]:
    out = {}
    for f in sorted(os.listdir(path)):
        if f.endswith(".safetensors"):
            out.update(load_file(os.path.join(path, f)))
    return out


def _assert_identical(a_dir, b_dir):
    a, b = _tensors(a_dir), _tensors(b_dir)
    assert sorted(a) == sorted(b)
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


# ---- runs inside the 2-process pool ----------------------------------------------------------


def shard_then_export(src, mid, dst, tp, pp, dtype=None, max_shard_gb=2.0):
    shard.run(ShardConfig(src=src, dst=mid, tp=tp, pp=pp, dtype=dtype))
    export.run(ExportConfig(src=mid, dst=dst, max_shard_gb=max_shard_gb))


def load_and_compare(ckpt, src, tp, pp, kind):
    parallel.init(tp, pp)
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    manifest = publish.require_published(ckpt, "checkpoint")
    cfg = LlamaConfig.from_dict(manifest["model_config"])
    cls = ParallelLlamaForCausalLM if kind == "lm" else ParallelLlamaForScore
    model = cls(cfg, ParallelLayout(tp=tp, pp=pp))
    with torch.no_grad():
        for p in model.parameters():
            p.fill_(float("nan"))  # whatever the load leaves unwritten shows, vocabulary padding included
    checkpoint.load_model(model, f"{ckpt}/model")
    for name, p in model.named_parameters():
        assert torch.isfinite(p).all(), name
    hf = (AutoModelForCausalLM if kind == "lm" else AutoModelForSequenceClassification).from_pretrained(src).eval()
    ids, mask, pos = tiny.batch("left")
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits
    if pp > 1:
        from llamarl.lib.model import schedule

        batch = model.make_batch(ids, mask, pos)
        outs = schedule.forward(model, [batch])
        if not parallel.topology().is_last_stage:
            return None
        out = batch.to_padded(outs[0])
    else:
        with torch.no_grad():
            out = model.run(ids, mask, pos)
    if kind == "lm":
        out = tiny.gather_tp(out)[..., : cfg.vocab_size]
        return (out - ref)[mask.bool()].abs().max().item()
    return (out - ref[:, 0]).abs().max().item()


# ---- round trips ------------------------------------------------------------------------------


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied"])
@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)], ids=["tp2pp1", "tp1pp2"])
def test_roundtrip_bit_identical(pool2, tmp_path, tp, pp, tied):
    src = str(tmp_path / "hf")
    _hf_dir(src, tie_word_embeddings=tied)
    pool2.run(shard_then_export, src, str(tmp_path / "ckpt"), str(tmp_path / "out"), tp, pp)
    _assert_identical(src, tmp_path / "out")
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert model.config.tie_word_embeddings == tied


def test_checkpoint_written_at_tp2_loads_at_tp1pp2_and_tp2(pool2, tmp_path):
    src, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    _hf_dir(src)
    pool2.run(shard.run, ShardConfig(src=src, dst=ckpt, tp=2, pp=1))
    for tp, pp in ((1, 2), (2, 1)):
        errs = [e for e in pool2.run(load_and_compare, ckpt, src, tp, pp, "lm") if e is not None]
        assert errs and max(errs) < 1e-4, (tp, pp, errs)


def test_reward_model_roundtrip_and_scores(pool2, tmp_path):
    src = str(tmp_path / "rm")
    _hf_dir(src, kind="score")
    pool2.run(shard_then_export, src, str(tmp_path / "ckpt"), str(tmp_path / "out"), 2, 1)
    _assert_identical(src, tmp_path / "out")
    cfg = json.load(open(tmp_path / "out" / "config.json"))
    assert cfg["architectures"] == ["LlamaForSequenceClassification"] and cfg["num_labels"] == 1
    errs = pool2.run(load_and_compare, str(tmp_path / "ckpt"), src, 2, 1, "score")
    assert max(errs) < 1e-4, errs


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_sources_and_split_files(pool2, tmp_path, dtype):
    src = str(tmp_path / "hf")
    _hf_dir(src, dtype=dtype, max_shard_size="60KB")  # several source files with an index
    assert os.path.exists(os.path.join(src, "model.safetensors.index.json"))
    pool2.run(shard_then_export, src, str(tmp_path / "ckpt"), str(tmp_path / "out"), 1, 2, None, 0.0001)
    out = tmp_path / "out"
    assert os.path.exists(out / "model.safetensors.index.json") and len(list(out.glob("*.safetensors"))) > 2
    _assert_identical(src, out)
    index = json.load(open(out / "model.safetensors.index.json"))
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in _tensors(out).values())
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out).dtype == dtype


def test_export_dtype_conversion(pool2, tmp_path):
    src = str(tmp_path / "hf")
    ref = _hf_dir(src)
    pool2.run(shard.run, ShardConfig(src=src, dst=str(tmp_path / "ckpt"), tp=2, pp=1))
    pool2.run(export.run, ExportConfig(src=str(tmp_path / "ckpt"), dst=str(tmp_path / "out"), dtype="bf16"))
    out = _tensors(tmp_path / "out")
    for k, v in ref.state_dict().items():
        if k in out:
            assert out[k].dtype == torch.bfloat16 and torch.equal(out[k], v.to(torch.bfloat16)), k


def test_rerun_of_published_output_is_skipped(pool2, tmp_path):
    src, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    _hf_dir(src)
    pool2.run(shard.run, ShardConfig(src=src, dst=ckpt, tp=2, pp=1))
    before = {p: os.stat(p).st_mtime_ns for p in map(str, (tmp_path / "ckpt").rglob("*"))}
    pool2.run(shard.run, ShardConfig(src=src, dst=ckpt, tp=2, pp=1))
    assert {p: os.stat(p).st_mtime_ns for p in map(str, (tmp_path / "ckpt").rglob("*"))} == before
    # The source's entries are block-tree XXH3 (hashed by several threads); a checkpoint of an
    # older version — the streamed ones, and no request recorded — is still found current.
    import xxhash

    manifest = json.loads((tmp_path / "ckpt" / publish.MANIFEST).read_text())
    files = manifest["source"]["files"]
    assert all(set(e) == {"bytes", publish.TREE} for e in files.values()), files
    manifest["source"]["files"] = {n: {"bytes": e["bytes"], "xxh3_128": xxhash.xxh3_128(
        (tmp_path / "hf" / n).read_bytes()).hexdigest()} for n, e in files.items()}
    del manifest["request"]
    (tmp_path / "ckpt" / publish.MANIFEST).write_text(json.dumps(manifest))
    before = {p: os.stat(p).st_mtime_ns for p in map(str, (tmp_path / "ckpt").rglob("*"))}
    pool2.run(shard.run, ShardConfig(src=src, dst=ckpt, tp=2, pp=1))
    assert {p: os.stat(p).st_mtime_ns for p in map(str, (tmp_path / "ckpt").rglob("*"))} == before


# ---- failures: clear errors, nothing deleted ---------------------------------------------------


def _user_error(pool, fn, *args) -> str:
    with pytest.raises(RuntimeError) as e:
        pool.run(fn, *args)
    text = str(e.value)
    assert "UserError" in text or "Error: " in text, text
    return text.strip().splitlines()[-1]


def test_layout_the_model_cannot_take(pool2, tmp_path):
    src = str(tmp_path / "hf")
    _hf_dir(src, num_attention_heads=4, num_key_value_heads=2)
    with pytest.raises(UserError, match=r"^options: dtype='int4': Input should be 'bf16', 'fp16' or 'fp32'$"):
        ShardConfig.parse({"src": src, "dst": str(tmp_path / "c"), "dtype": "int4"}, "options")
    with pytest.raises(Exception, match="pp=5 is larger than num_hidden_layers=3"):
        shard.run(ShardConfig(src=src, dst=str(tmp_path / "c"), tp=1, pp=5))
    assert not (tmp_path / "c").exists()


def test_a_job_of_another_size_than_the_layout_is_refused(pool2, tmp_path):
    src = str(tmp_path / "hf")
    _hf_dir(src)
    msg = _user_error(pool2, shard.run, ShardConfig(src=src, dst=str(tmp_path / "c"), tp=1, pp=1))
    assert "shard runs with tp*pp*dp = 1*1*1 = 1 processes, not 2" in msg
    assert not (tmp_path / "c").exists()


def test_config_that_does_not_match_weights(tmp_path):
    src = tmp_path / "hf"
    _hf_dir(str(src))
    cfg = json.load(open(src / "config.json"))
    cfg["intermediate_size"] = 96
    json.dump(cfg, open(src / "config.json", "w"))
    with pytest.raises(UserError, match=r"mlp.*has shape \[128, 64\] but config.json implies \[96, 64\]"):
        shard.run(ShardConfig(src=str(src), dst=str(tmp_path / "c")))


@pytest.mark.parametrize("dtype,bad", [(None, float("nan")), (None, float("-inf")), ("fp16", 1e6)],
                         ids=["nan", "inf", "beyond-fp16"])
def test_weights_that_are_not_finite_are_refused_naming_the_file_and_the_tensor(tmp_path, dtype, bad):
    from safetensors.torch import save_file

    src = tmp_path / "hf"
    _hf_dir(str(src))
    (path,) = [f for f in os.listdir(src) if f.endswith(".safetensors")]
    state = load_file(str(src / path))
    state["model.layers.1.mlp.down_proj.weight"][3, 5] = bad
    save_file(state, str(src / path), metadata={"format": "pt"})
    as_ = "float16" if dtype else "float32"
    with pytest.raises(UserError, match=rf"^{src}/{path}: model.layers.1.mlp.down_proj.weight holds values that are "
                                        rf"not finite as {as_} \(NaN, ±inf, or beyond its range\); the checkpoint is "
                                        rf"damaged, or its training diverged: shard another one \(or another --dtype\)$"):
        shard.run(ShardConfig(src=str(src), dst=str(tmp_path / "c"), dtype=dtype))
    assert publish.read_manifest(str(tmp_path / "c")) is None


def test_tensors_the_config_does_not_imply_are_refused_not_dropped(tmp_path):
    src = tmp_path / "hf"
    _hf_dir(str(src))  # 3 layers
    cfg = json.load(open(src / "config.json"))
    cfg["num_hidden_layers"] = 2
    json.dump(cfg, open(src / "config.json", "w"))
    with pytest.raises(UserError, match=r"hf: 9 tensors that config.json does not imply would be dropped "
                                        r"\(model.layers.2.input_layernorm.weight, model.layers.2.mlp.down_proj.weight, "
                                        r"model.layers.2.mlp.gate_proj.weight, …\); fix config.json \(num_hidden_layers, "
                                        r"attention_bias, mlp_bias, tie_word_embeddings, architectures\) or remove them"):
        shard.run(ShardConfig(src=str(src), dst=str(tmp_path / "c")))
    assert not (tmp_path / "c").exists()


def test_what_real_checkpoints_carry_beside_their_parameters_is_not_extra(pool2, tmp_path):
    # Tied embeddings saved with the head's copy, and rotary frequencies older checkpoints kept:
    # made from the config, so sharding goes on; the export is the model as HF saves it.
    from safetensors.torch import save_file

    model = tiny.hf_model("lm", tie_word_embeddings=True)
    ref, src = str(tmp_path / "ref"), tmp_path / "hf"
    model.save_pretrained(ref)
    state = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    assert "lm_head.weight" in state
    state["model.rotary_emb.inv_freq"] = torch.rand(8)
    state["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.rand(8)
    model.config.save_pretrained(src)
    save_file(state, str(src / "model.safetensors"), metadata={"format": "pt"})
    pool2.run(shard_then_export, str(src), str(tmp_path / "ckpt"), str(tmp_path / "out"), 2, 1)
    _assert_identical(ref, tmp_path / "out")


def _names_match(cfg_kwargs: dict, head: str, tp: int, pp: int):
    from llamarl.lib.model import hf_mapping

    cfg = LlamaConfig(**cfg_kwargs)
    topo = parallel.init(tp, pp)
    cls = ParallelLlamaForCausalLM if head == "lm" else ParallelLlamaForScore
    model = cls(cfg, ParallelLayout(tp=tp, pp=pp), dtype=torch.float32)
    try:
        return sorted(n for n, _ in model.named_parameters()) == sorted(
            hf_mapping.stage_param_names(cfg, head, pp, topo.pp_rank))
    finally:
        parallel.destroy_model_parallel()


@pytest.mark.parametrize("tp,pp", [(2, 1), (1, 2)])
def test_shard_plans_the_model_s_parameter_names(pool2, tp, pp):
    base = dict(vocab_size=96, hidden_size=32, intermediate_size=64, num_layers=3, num_heads=4, num_kv_heads=2,
                head_dim=8)
    for extra, head in (({}, "lm"), ({"tie_word_embeddings": True}, "lm"), ({"attention_bias": True, "mlp_bias": True}, "lm"),
                        ({}, "score")):
        assert all(pool2.run(_names_match, {**base, **extra}, head, tp, pp)), (extra, head)


def test_destination_that_is_not_ours_is_never_touched(pool2, tmp_path):
    src = str(tmp_path / "hf")
    _hf_dir(src)
    precious = tmp_path / "precious"
    precious.mkdir()
    (precious / "notes.txt").write_text("keep me")
    msg = _user_error(pool2, shard.run, ShardConfig(src=src, dst=str(precious), tp=2, pp=1))
    assert "not a llamarl output; refusing to overwrite" in msg
    assert (precious / "notes.txt").read_text() == "keep me" and len(list(precious.iterdir())) == 1


def test_missing_or_corrupt_shard_file(pool2, tmp_path):
    src, ckpt = str(tmp_path / "hf"), tmp_path / "ckpt"
    _hf_dir(src)
    pool2.run(shard.run, ShardConfig(src=src, dst=str(ckpt), tp=2, pp=1))
    part = ckpt / "model" / "__1_0.distcp"
    data = bytearray(part.read_bytes())
    data[len(data) // 2] ^= 0xFF
    part.write_bytes(bytes(data))
    msg = _user_error(pool2, export.run, ExportConfig(src=str(ckpt), dst=str(tmp_path / "out")))
    assert "model/__1_0.distcp does not match its xxh3_128 checksum" in msg and "delete" in msg
    part.unlink()
    msg = _user_error(pool2, export.run, ExportConfig(src=str(ckpt), dst=str(tmp_path / "out")))
    assert "model/__1_0.distcp is missing" in msg
    assert not (tmp_path / "out").exists() and (ckpt / "model" / "__0_0.distcp").exists()


def test_manifest_checksums_are_those_of_the_files_and_old_sha256_checkpoints_export(pool2, tmp_path):
    import hashlib

    import xxhash

    src, ckpt, out = str(tmp_path / "hf"), tmp_path / "ckpt", tmp_path / "out"
    _hf_dir(src)
    pool2.run(shard_then_export, src, str(ckpt), str(out), 2, 1)
    for root in (ckpt, out):  # hashed while written, by the rank that wrote each file
        for name, entry in publish.read_manifest(str(root))["files"].items():
            data = (root / name).read_bytes()
            if root == out and name.endswith(".safetensors"):  # written by several threads: a block tree
                assert entry == {"bytes": len(data), publish.TREE: checksums._tree_checksum(str(root / name), 1)}, name
                continue
            assert entry == {"bytes": len(data), "xxh3_128": xxhash.xxh3_128(data).hexdigest()}, name
    # The same checkpoint as an older llamarl published it: sha256 entries. It still exports,
    # and a flipped byte is still caught.
    manifest = json.loads((ckpt / publish.MANIFEST).read_text())
    manifest["files"] = {n: {"bytes": e["bytes"], "sha256": hashlib.sha256((ckpt / n).read_bytes()).hexdigest()}
                         for n, e in manifest["files"].items()}
    (ckpt / publish.MANIFEST).write_text(json.dumps(manifest))
    pool2.run(export.run, ExportConfig(src=str(ckpt), dst=str(tmp_path / "out2")))
    _assert_identical(src, tmp_path / "out2")
    part = ckpt / "model" / "__0_0.distcp"
    data = bytearray(part.read_bytes())
    data[len(data) // 3] ^= 0x10
    part.write_bytes(bytes(data))
    msg = _user_error(pool2, export.run, ExportConfig(src=str(ckpt), dst=str(tmp_path / "out3")))
    assert "model/__0_0.distcp does not match its sha256 checksum" in msg
    assert not (tmp_path / "out3").exists()


@pytest.mark.parametrize("old_reader", [False, True], ids=["reader", "reader-without-record-size"])
@pytest.mark.parametrize("direct", [False, True], ids=["ranges", "direct"])
def test_reader_copies_views_of_the_stored_bytes(tmp_path, monkeypatch, direct, old_reader):
    # Small items read in coalesced ranges, each tensor copied from the read buffer (no
    # torch.load); large ones (direct: every item here) read straight into their target, in
    # blocks, where they map onto it 1:1, through the ranges otherwise. Row and column pieces
    # written, other pieces read, strided targets, another dtype, 0-d, bool, misaligned items
    # (DCP packs them back to back).
    from llamarl.lib.files.checkpoint import Chunks

    g = torch.Generator().manual_seed(0)
    full = {"a": torch.randn(128, 96, generator=g).to(torch.bfloat16), "b": torch.randn(33, 7, generator=g),
            "c": torch.arange(100), "d": torch.rand(9, generator=g) > 0.5, "e": torch.tensor(3.5),
            "f": torch.randn(16, 6, generator=g).to(torch.float16)}
    state = {"a": Chunks(full["a"].shape, {(0, 0): full["a"][:80], (80, 0): full["a"][80:]}),
             "b": Chunks(full["b"].shape, {(0, 0): full["b"][:, :3], (0, 3): full["b"][:, 3:]}),
             "c": full["c"], "d": full["d"], "e": full["e"], "f": full["f"].t().contiguous().t()}
    checkpoint.save(state, str(tmp_path / "m"), threads=2)
    a, b = torch.zeros(128, 96, dtype=torch.bfloat16), torch.zeros(7, 33).t()
    out = {"a": Chunks(a.shape, {(0, 0): a[:40], (40, 0): a[40:]}),
           "b": Chunks((33, 7), {(0, 0): b[:, :5], (0, 5): b[:, 5:]}),
           "c": torch.zeros(100, dtype=torch.int64), "d": torch.zeros(9, dtype=torch.bool), "e": torch.tensor(0.0),
           "f": torch.zeros(16, 6)}
    monkeypatch.setattr(torch, "load", lambda *a, **k: pytest.fail("an item went through torch.load"))
    if old_reader:  # torch < 2.12 (the GPU image's 2.11): its zip reader has no get_record_size
        real_reader = torch._C.PyTorchFileReader

        class Reader:
            def __init__(self, f):
                self._zf = real_reader(f)

            def __getattr__(self, name):
                if name == "get_record_size":
                    raise AttributeError(name)
                return getattr(self._zf, name)

        monkeypatch.setattr(torch._C, "PyTorchFileReader", Reader)
    monkeypatch.setattr(checkpoint, "BLOCK_BYTES", 4096)  # several ranges per file
    flat = []
    if direct:
        monkeypatch.setattr(checkpoint, "_DIRECT_BYTES", 1)
        monkeypatch.setattr(checkpoint, "_EDGE_BYTES", 4096)  # a's middle is not read for its header
        monkeypatch.setattr(checkpoint, "BLOCK_BYTES", 1000)  # a tensor's data in several blocks
        real = checkpoint._flat_span
        monkeypatch.setattr(checkpoint, "_flat_span", lambda r, st: flat.append(real(r, st)) or flat[-1])
    checkpoint.load(out, str(tmp_path / "m"))
    if direct:  # a: rows of chunks; c, d: whole; b (columns), e (0-d), f (strided, dtype) through ranges
        assert sum(f is not None for f in flat) == 5 and None in flat
    assert torch.equal(a, full["a"]) and torch.equal(b, full["b"]) and torch.equal(out["f"], full["f"].float())
    assert all(torch.equal(out[k], full[k]) for k in "cde")


def _full_tensors():
    g = torch.Generator().manual_seed(1)
    return {"w": torch.randn(12, 10, generator=g).to(torch.bfloat16), "kv": torch.randn(6, 4, generator=g),
            "n": torch.randn(10, generator=g)}


def save_with_replicas(url):
    # Rank r holds rows r*6:(r+1)*6 of w, the whole of kv (replicated, like kv heads over TP) and
    # columns of n: each chunk must be written once.
    rank = torch.distributed.get_rank()
    full = _full_tensors()
    state = {"w": checkpoint.Chunks((12, 10), {(6 * rank, 0): full["w"][6 * rank : 6 * rank + 6]}),
             "kv": checkpoint.Chunks((6, 4), {(0, 0): full["kv"].clone()}),
             "n": checkpoint.Chunks((10,), {(5 * rank,): full["n"][5 * rank : 5 * rank + 5]})}
    checkpoint.save(state, url, threads=2)


def test_files_are_dcp_s_format_both_ways(pool2, tmp_path):
    import pickle

    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.filesystem import CURRENT_DCP_VERSION
    from torch.distributed.checkpoint.metadata import Metadata

    full = _full_tensors()
    ours = str(tmp_path / "ours")
    pool2.run(save_with_replicas, ours)
    md = pickle.loads((tmp_path / "ours" / ".metadata").read_bytes())  # DCP's own classes
    assert isinstance(md, Metadata) and md.version == CURRENT_DCP_VERSION
    assert sorted(len(md.state_dict_metadata[k].chunks) for k in full) == [1, 2, 2]  # kv once
    assert len(md.storage_data) == 5
    # DCP reads ours...
    got = {k: torch.zeros_like(v) for k, v in full.items()}
    dcp.load(got, storage_reader=dcp.FileSystemReader(ours))
    assert all(torch.equal(got[k], full[k]) for k in full)
    # ...and we read DCP's, written by torch's own writer, into other pieces.
    theirs = str(tmp_path / "theirs")
    dcp.save(full, storage_writer=dcp.FileSystemWriter(theirs, thread_count=2))
    w, kv = torch.zeros(12, 10, dtype=torch.bfloat16), torch.zeros(6, 4)
    checkpoint.load({"w": checkpoint.Chunks((12, 10), {(0, 0): w[:, :3], (0, 3): w[:, 3:]}),
                     "kv": checkpoint.Chunks((6, 4), {(2, 0): kv[2:]})}, theirs)
    assert torch.equal(w, full["w"]) and torch.equal(kv[2:], full["kv"][2:]) and not kv[:2].any()
    md = dcp.FileSystemReader(theirs).read_metadata()
    assert tuple(md.state_dict_metadata["w"].size) == (12, 10)
    assert md.state_dict_metadata["w"].properties.dtype == torch.bfloat16
    # The same state saved by both writers: the same metadata, field for field (bar the save id).
    checkpoint.save(full, str(tmp_path / "ours1"), threads=2)
    a, b = (pickle.loads((tmp_path / d / ".metadata").read_bytes()) for d in ("ours1", "theirs"))
    assert (a.state_dict_metadata, a.planner_data, a.version) == (b.state_dict_metadata, b.planner_data, b.version)
    assert sorted((k.fqn, tuple(k.offset)) for k in a.storage_data) == sorted((k.fqn, tuple(k.offset)) for k in b.storage_data)


def test_chunks_held_by_several_ranks_are_written_once_by_the_lightest():
    plans = [[("a", (0,), (8,), 800), ("kv", (0,), (2,), 200)],
             [("b", (0,), (2,), 200), ("kv", (0,), (2,), 200)],
             [("kv", (0,), (2,), 200), ("c", (0,), (9,), 900)]]
    mine = dcp_format.assign(plans)
    assert mine == [{("a", (0,))}, {("b", (0,)), ("kv", (0,))}, {("c", (0,))}]


def test_loading_what_the_checkpoint_lacks_is_one_error(tmp_path):
    checkpoint.save({"t": torch.ones(4)}, str(tmp_path / "m"))
    with pytest.raises(RuntimeError, match="the checkpoint has no tensor u"):
        checkpoint.load({"u": torch.zeros(4)}, str(tmp_path / "m"))
    with pytest.raises(RuntimeError, match=r"t is stored with shape \[4\], asked for \[5\]"):
        checkpoint.load({"t": torch.zeros(5)}, str(tmp_path / "m"))
    with pytest.raises(RuntimeError, match="do not tile"):
        checkpoint.save({"t": checkpoint.Chunks((4,), {(0,): torch.ones(2)})}, str(tmp_path / "gap"))
    assert not (tmp_path / "gap" / ".metadata").exists()


def test_dtype_names_are_one_table(tmp_path):
    # A config's name, a manifest's and a safetensors header's all name the same torch dtype.
    from llamarl.lib import dtypes
    from llamarl.lib.files.safetensors_io import SafetensorsFile, write_file

    for short, dtype in (("bf16", torch.bfloat16), ("fp16", torch.float16), ("fp32", torch.float32)):
        assert dtypes.torch_dtype(short) == dtype and dtypes.torch_dtype(dtypes.name(dtype)) == dtype
    written = {str(d): torch.zeros(2, dtype=d) for d in (torch.bfloat16, torch.float16, torch.float32, torch.float64,
                                                          torch.int64, torch.int32, torch.int8, torch.uint8, torch.bool)}
    write_file(str(tmp_path / "t.safetensors"), written)
    assert {n: t.dtype for n, t in SafetensorsFile(str(tmp_path / "t.safetensors")).tensors.items()} == \
        {n: dtypes.name(t.dtype) for n, t in written.items()}


def test_safetensors_written_by_threads_at_offsets_is_the_same_file(tmp_path):
    # Local files: tensors fetched and written at their offsets by several threads, then hashed as
    # a block tree; a stream elsewhere (memory:// here), in order. The same bytes either way, and
    # what safetensors itself writes.
    import fsspec
    from safetensors.torch import save as st_save

    from llamarl.lib.files.safetensors_io import Deferred, write_file

    g = torch.Generator().manual_seed(0)
    tensors = {f"t{i}": torch.randn(17 + i, 9, generator=g) for i in range(7)}
    tensors["h"] = torch.randn(5, generator=g).to(torch.bfloat16)
    lazy = {n: Deferred(t.dtype, tuple(t.shape), lambda t=t: t) for n, t in tensors.items()}
    a = write_file(str(tmp_path / "a.safetensors"), lazy, threads=4)
    b = write_file(str(tmp_path / "b.safetensors"), tensors, threads=1)
    c = write_file("memory://llamarl-test/c.safetensors", lazy, threads=4)
    data = (tmp_path / "a.safetensors").read_bytes()
    assert data == (tmp_path / "b.safetensors").read_bytes() == fsspec.filesystem("memory").cat("/llamarl-test/c.safetensors")
    assert data == st_save(tensors)
    assert publish.TREE in a and "xxh3_128" in b and "xxh3_128" in c
    publish.verify(str(tmp_path), {"a.safetensors": a, "b.safetensors": b})
    # A tensor given as its rows in pieces (export's row chunks) writes the same bytes, both ways.
    rows = {**lazy, "t6": Deferred(torch.float32, (23, 9), lambda: [(0, tensors["t6"][:10]), (10, tensors["t6"][10:])])}
    assert write_file(str(tmp_path / "e.safetensors"), rows, threads=4)["bytes"] == len(data)
    assert (tmp_path / "e.safetensors").read_bytes() == data
    write_file("memory://llamarl-test/e.safetensors", rows, threads=1)
    assert fsspec.filesystem("memory").cat("/llamarl-test/e.safetensors") == data
    wrong = {**lazy, "t3": Deferred(torch.float32, (1, 1), lambda: tensors["t3"])}
    with pytest.raises(ValueError, match="t3 came as torch.float32"):
        write_file(str(tmp_path / "d.safetensors"), wrong, threads=4)
    gap = {**lazy, "t6": Deferred(torch.float32, (23, 9), lambda: [(0, tensors["t6"][:10]), (12, tensors["t6"][12:])])}
    with pytest.raises(ValueError, match="t6's rows from 12"):
        write_file(str(tmp_path / "d.safetensors"), gap, threads=4)
    short = {**lazy, "t6": Deferred(torch.float32, (23, 9), lambda: [(0, tensors["t6"][:10])])}
    with pytest.raises(ValueError, match="t6 came as 10 rows, planned as 23"):
        write_file(str(tmp_path / "d.safetensors"), short, threads=4)
    assert not (tmp_path / "d.safetensors").exists()


def test_slices_read_by_many_threads_at_once_are_each_their_own(tmp_path):
    # Shard's writer threads read slices of one source file at once; on memory:// every opener
    # of a file gets the same file object (one position), so a read is a range request.
    from concurrent.futures import ThreadPoolExecutor

    import fsspec
    from safetensors.torch import save

    from llamarl.lib.files.safetensors_io import SafetensorsFile

    w = torch.arange(512 * 64, dtype=torch.float32).reshape(512, 64)
    url = "memory://llamarl-threads/model.safetensors"
    fsspec.filesystem("memory").pipe_file(url, save({"w": w}))
    f = SafetensorsFile(url)
    spans = [(dim, a, a + 7) for dim, n in ((0, 512), (1, 64)) for a in range(0, n - 7, 3)] * 4
    with ThreadPoolExecutor(8) as pool:
        got = list(pool.map(lambda s: f.read("w", *s), spans))
    for (dim, a, b), t in zip(spans, got):
        assert torch.equal(t, w.narrow(dim, a, b - a)), (dim, a, b)


def _mapping_flags(address: int) -> str | None:
    """The ``VmFlags`` of this process's memory mapping that holds ``address`` (None: none does)."""
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and ":" not in head:
                lo, hi = (int(x, 16) for x in head.split("-"))
                inside = lo <= address < hi
            elif inside and head == "VmFlags:":
                return line.split(":", 1)[1]
    return None


@pytest.mark.skipif(not os.path.exists("/proc/self/smaps"), reason="reads Linux's /proc/self/smaps")
def test_large_read_buffers_are_huge_page_mappings_freed_with_their_tensor():
    # A buffer torch's allocator would map afresh (and the kernel fault in 4 KiB at a time) is a
    # mapping of its own, advised for transparent huge pages; a view keeps it, the last one frees it.
    import gc

    from llamarl.lib.files import ranges

    t = ranges.empty((1024, 1024), torch.float32)
    assert t.shape == (1024, 1024) and t.dtype == torch.float32 and t.is_contiguous()
    address = t.data_ptr()
    assert " hg" in _mapping_flags(address)
    view = t[3:5]
    del t
    gc.collect()
    view.fill_(2.0)
    assert view.sum().item() == 2.0 * 2 * 1024
    del view
    gc.collect()
    assert " hg" not in (_mapping_flags(address) or "")
    small = ranges.empty((4, 3), torch.bfloat16)  # below a huge page: torch's own allocation
    assert small.shape == (4, 3) and small.dtype == torch.bfloat16


def test_large_row_and_column_slices_of_a_local_file_read_exactly_and_never_write_it(tmp_path):
    from safetensors.torch import save_file

    from llamarl.lib.files.safetensors_io import SafetensorsError, SafetensorsFile

    w = torch.randn(1024, 1536, generator=torch.Generator().manual_seed(0)).to(torch.bfloat16)  # 3 MiB
    path = tmp_path / "model.safetensors"
    save_file({"w": w, "b": torch.arange(5)}, str(path))
    before = path.read_bytes()
    f = SafetensorsFile(str(path))
    for dim, a, b in ((0, 0, 1024), (0, 100, 1000), (1, 0, 1536), (1, 10, 1100)):
        got = f.read("w", dim, a, b)
        assert torch.equal(got, w.narrow(dim, a, b - a)), (dim, a, b)
        got.zero_()  # rows are the file's pages mapped copy-on-write: the file keeps its bytes
    assert torch.equal(f.read("b"), torch.arange(5)) and path.read_bytes() == before
    # A file cut short after its header was read is a one-line error, not a crash.
    with open(path, "r+b") as out:
        out.truncate(len(before) - 1000)
    with pytest.raises(SafetensorsError, match="short read"):
        f.read("w", 0, 1000, 1024)  # the file's last rows


def test_unpublished_checkpoint_is_refused(tmp_path):
    (tmp_path / "half").mkdir()
    (tmp_path / "half" / publish.INCOMPLETE).write_text("")
    with pytest.raises(UserError, match="unfinished output"):
        export.run(ExportConfig(src=str(tmp_path / "half"), dst=str(tmp_path / "out")))


# ---- processes: the CLI, memory, kills ---------------------------------------------------------


def _cli(*args, **popen):
    return subprocess.Popen([sys.executable, "-m", "llamarl.pipeline.cli", *args], **popen)


def test_cli_prints_one_line_error_and_status_2(tmp_path):
    src = str(tmp_path / "hf")
    _hf_dir(src)
    proc = _cli("stage", "shard", src, str(tmp_path / "c"), "--tp", "3", stderr=subprocess.PIPE, text=True)
    _, err = proc.communicate(timeout=120)
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 2, err
    assert lines == ["error: tp=3 does not divide num_attention_heads=4; use a tp in [1, 2, 4]"], err


@pytest.mark.slow
def test_peak_memory_per_rank_stays_near_its_share(tmp_path):
    # ~190 MB of fp32 weights split over 4 ranks (TP2 x PP2): each rank owns about a quarter.
    src = str(tmp_path / "hf")
    _hf_dir(src, vocab_size=16000, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
            num_attention_heads=8, num_key_value_heads=4, head_dim=64)
    total = sum(os.path.getsize(os.path.join(src, f)) for f in os.listdir(src) if f.endswith(".safetensors"))
    proc = _cli("stage", "shard", src, str(tmp_path / "c"), "--tp", "2", "--pp", "2")
    assert proc.wait(timeout=300) == 0
    ranks = publish.read_manifest(str(tmp_path / "c"))["ranks"]
    margin = 48 << 20  # one source tensor in flight plus the writer's buffers
    for r in ranks:
        growth = r["peak_rss_bytes"] - r["rss_before_bytes"]
        assert r["owned_bytes"] < total / 2.5  # a real share, not the whole model
        assert growth < r["owned_bytes"] + margin, (r, total)


@pytest.mark.slow
def test_killed_at_random_points_then_rerun_gives_identical_result(tmp_path):
    src = str(tmp_path / "hf")
    _hf_dir(src, vocab_size=4000, hidden_size=256, intermediate_size=1024, num_hidden_layers=4)
    ckpt, out = str(tmp_path / "ckpt"), str(tmp_path / "out")
    rng = random.Random(0)
    for delay in sorted(rng.uniform(0.5, 6.0) for _ in range(3)):
        proc = _cli("stage", "shard", src, ckpt, "--tp", "2", start_new_session=True,
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(delay)
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        manifest = publish.read_manifest(ckpt)
        # Either it finished before the kill, or it never looks finished.
        assert manifest is None or manifest["kind"] == "checkpoint"
    assert _cli("stage", "shard", src, ckpt, "--tp", "2").wait(timeout=300) == 0
    assert _cli("stage", "export", ckpt, out).wait(timeout=300) == 0
    _assert_identical(src, out)


@pytest.mark.slow
def test_shard_under_torchrun(tmp_path):
    # torchrun's agent holds MASTER_PORT (its store) for its workers; the stage joins through it.
    from llamarl.cluster.executor import free_port

    src, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    _hf_dir(src)
    cfg = ShardConfig(src=src, dst=ckpt, tp=2).model_dump_json()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={free_port()}", "-m", "llamarl.stages.shard", "--config-json", cfg],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert publish.read_manifest(ckpt)["written_layout"] == {"tp": 2, "pp": 1}


def _file_size_limit(max_bytes: int):
    """For a child process: writes past ``max_bytes`` fail with EFBIG (its SIGXFSZ ignored), as a
    full disk fails them with ENOSPC. Run it with PYTHONDONTWRITEBYTECODE: the bytecode it would
    cache would be cut short too, and break every later import of those modules."""
    def limit():
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (max_bytes, max_bytes))
    return limit


@pytest.mark.parametrize("stage", ["shard", "export"])
def test_a_write_that_fails_is_never_blamed_on_the_input(tmp_path, stage):
    src, ckpt, out = str(tmp_path / "hf"), str(tmp_path / "ckpt"), str(tmp_path / "out")
    _hf_dir(src)
    shard.run(ShardConfig(src=src, dst=ckpt)) if stage == "export" else None
    cfg = {"src": src, "dst": ckpt} if stage == "shard" else {"src": ckpt, "dst": out}
    before = {p: p.read_bytes() for p in (tmp_path / ("hf" if stage == "shard" else "ckpt")).rglob("*") if p.is_file()}
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE")} | {"PYTHONDONTWRITEBYTECODE": "1"}
    proc = subprocess.run([sys.executable, "-m", f"llamarl.stages.{stage}", "--config-json", json.dumps(cfg)],
                          env=env, capture_output=True, text=True, timeout=300, preexec_fn=_file_size_limit(16 << 10))
    assert proc.returncode != 0, proc.stderr
    assert "File too large" in proc.stderr, proc.stderr
    assert "damaged" not in proc.stderr and "reshard" not in proc.stderr, proc.stderr
    assert publish.read_manifest(cfg["dst"]) is None
    assert {p: p.read_bytes() for p in before} == before  # the input as it was


def test_memory_filesystem_roundtrip(tmp_path):
    # fsspec's memory:// lives inside one process: the round trip runs in one process (world 1).
    script = os.path.join(HERE, "memfs_roundtrip.py")
    proc = subprocess.run([sys.executable, script, str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "IDENTICAL" in proc.stdout, proc.stdout + proc.stderr
