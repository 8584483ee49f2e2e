"""Shard and export run without torch: the pieces they stand on, checked against torch's own.

- dtype conversions on numpy storage equal torch's ``.to()``, bit for bit;
- an item written by lib/dcp_format.py is what ``torch.load`` reads, and it reads torch's items;
- a checkpoint's ``.metadata`` is the same bytes when the same checkpoint is written again;
- ``IOGroup``: the collectives, a lost peer named on every rank, strangers turned away;
- the parameter names shard plans from equal the model's, for every layout;
- the stage processes of shard and export never import torch (a poisoned ``torch`` on their path).
"""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import tiny
from llamarl.lib import dcp_format, dtypes, hf_mapping
from llamarl.lib.dtypes import HostTensor
from llamarl.lib.iogroup import IOGroup, PeerLost

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
FLOATS = ("bfloat16", "float16", "float32", "float64")


def _storage(t: torch.Tensor) -> np.ndarray:
    return HostTensor.of(t).data


@pytest.mark.parametrize("src", FLOATS)
def test_conversions_are_torch_s_bit_for_bit(src):
    g = torch.Generator().manual_seed(0)
    x = torch.cat([torch.randn(20000, generator=g) * 10 ** torch.randint(-8, 8, (20000,), generator=g).float(),
                   torch.tensor([0.0, -0.0, float("inf"), -float("inf"), 3.4e38, -3.4e38, 1e-40, -1e-45, 65504.0,
                                 65520.0, 1.0009765625, 1.00390625, 1.005859375])]).to(getattr(torch, src))
    for dst in FLOATS:
        ours = dtypes.convert(_storage(x), src, dst)
        theirs = _storage(x.to(getattr(torch, dst)))
        assert ours.dtype == theirs.dtype and np.array_equal(ours.view(np.uint8), theirs.view(np.uint8)), (src, dst)
    nan = torch.tensor([float("nan"), -float("nan")], dtype=getattr(torch, src))
    for dst in FLOATS:  # a NaN stays a NaN (its payload is not torch's to keep either)
        back = HostTensor(dst, dtypes.convert(_storage(nan), src, dst)).torch()
        assert back.isnan().all()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32, torch.int64, torch.bool, torch.int8])
@pytest.mark.parametrize("shape", [(5, 3), (), (0,), (2, 3, 4)])
def test_items_load_in_torch_and_torch_s_items_parse(dtype, shape):
    t = (torch.randn(shape) * 50).to(dtype)
    buf = io.BytesIO()
    dcp_format.write_item(buf, HostTensor.of(t))
    raw = buf.getvalue()
    back = torch.load(io.BytesIO(raw), weights_only=True)
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)
    stored = dcp_format.parse_item(memoryview(raw))
    assert stored.offset % 64 == 0  # aligned as torch aligns its records
    assert np.array_equal(dcp_format.item_array(memoryview(raw), stored), _storage(t))
    theirs = io.BytesIO()
    torch.save(t.t() if t.dim() == 2 else t, theirs)  # a transposed (strided) tensor too
    raw = theirs.getvalue()
    stored = dcp_format.parse_item(memoryview(raw))
    assert np.array_equal(dcp_format.item_array(memoryview(raw), stored), _storage(t.t() if t.dim() == 2 else t))


def test_zip64_items_load(monkeypatch):
    # Items over 4 GiB need zip64 fields; forced here at any size (a fp32 embedding of a 70B
    # model at TP 1 is 4.2 GB).
    monkeypatch.setattr(dcp_format, "ZIP64_LIMIT", 16)
    t = torch.randn(33, 17)
    buf = io.BytesIO()
    dcp_format.write_item(buf, HostTensor.of(t))
    raw = buf.getvalue()
    assert b"PK\x06\x06" in raw  # the zip64 end record
    assert torch.equal(torch.load(io.BytesIO(raw), weights_only=True), t)
    assert np.array_equal(dcp_format.item_array(memoryview(raw), dcp_format.parse_item(memoryview(raw))), t.numpy())


def test_a_checkpoint_written_again_is_the_same_bytes(tmp_path):
    from llamarl.lib import checkpoint

    import shutil

    state = {"w": torch.randn(40, 8).to(torch.bfloat16), "b": torch.arange(7)}
    checkpoint.save(state, str(tmp_path / "a"), threads=2)
    first = {f: (tmp_path / "a" / f).read_bytes() for f in os.listdir(tmp_path / "a")}
    shutil.rmtree(tmp_path / "a")
    checkpoint.save(state, str(tmp_path / "a"), threads=2)  # a rerun, after a kill that lost it all
    again = {f: (tmp_path / "a" / f).read_bytes() for f in os.listdir(tmp_path / "a")}
    assert ".metadata" in first and first == again  # .metadata too: its save id is the items' digest
    whole = dcp_format.read_whole(str(tmp_path / "a"), dcp_format.read_metadata(str(tmp_path / "a")), "w")
    assert torch.equal(whole.torch(), state["w"])


# ---- IOGroup: processes of their own ---------------------------------------------------------------

_RANK = textwrap.dedent("""
    import os, sys, time
    sys.path.insert(0, {root!r})
    from llamarl.lib.iogroup import IOGroup, PeerLost
    rank = int(os.environ["RANK"])
    try:
        g = IOGroup.from_env(timeout_s=float(os.environ.get("T", "20")), token=os.environ.get("TOKEN", "job"))
        print("gather", g.all_gather({{"r": rank, "sq": rank * rank}}), flush=True)
        print("bcast", g.broadcast("hello" if rank == 0 else None), flush=True)
        if rank == int(os.environ.get("DIE", -1)):
            os._exit(9)
        time.sleep(float(os.environ.get("SLOW", 0)) if rank == 1 else 0)
        g.barrier()
        print("done", flush=True)
    except PeerLost as e:
        print("lost:", e, flush=True)
        sys.exit(3)
""")


def _ranks(world: int, port: int, only: list[int] | None = None, **env) -> list[subprocess.Popen]:
    code = _RANK.format(root=ROOT)
    return [subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                             env={**os.environ, "RANK": str(r), "WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                                  "MASTER_PORT": str(port), **{k: str(v) for k, v in env.items()}})
            for r in (range(world) if only is None else only)]


def _port() -> int:
    from llamarl.cluster.executor import free_port

    return free_port()


def test_iogroup_collectives_over_processes():
    procs = _ranks(3, _port())
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs), outs
    for out in outs:
        assert "gather [{'r': 0, 'sq': 0}, {'r': 1, 'sq': 1}, {'r': 2, 'sq': 4}]" in out and "bcast hello" in out
        assert "done" in out


def test_iogroup_names_a_lost_rank_on_every_rank_within_seconds():
    t0 = time.monotonic()
    procs = _ranks(3, _port(), DIE=2, T=60)
    outs = [p.communicate(timeout=60)[0] for p in procs]
    assert time.monotonic() - t0 < 20  # not the 60 s timeout: a dead process's socket closes at once
    assert procs[2].returncode == 9
    for p, out in zip(procs[:2], outs[:2]):
        assert p.returncode == 3 and "lost rank 2" in out, out


def test_iogroup_rendezvous_timeout_names_the_missing_rank_and_turns_strangers_away():
    port = _port()
    # A stranger (another job's token) knocks first; rank 1 never comes.
    rank0 = _ranks(2, port, only=[0], T=3)[0]
    stranger = _ranks(2, port, only=[1], TOKEN="other", T=5)[0]
    out = rank0.communicate(timeout=60)[0]
    stranger.communicate(timeout=60)
    assert rank0.returncode == 3 and "ranks [1] did not join the rendezvous" in out, out


def test_iogroup_of_one_needs_no_network():
    g = IOGroup(0, 1, "nowhere.invalid", 1, timeout_s=1)
    assert g.all_gather(5) == [5] and g.broadcast("x") == "x"
    g.barrier()


# ---- shard's plan and the stage processes --------------------------------------------------------------


def _names_match(cfg_kwargs: dict, head: str, tp: int, pp: int):
    from llamarl.lib import parallel
    from llamarl.lib.config import LlamaConfig, ParallelLayout
    from llamarl.lib.model import ParallelLlamaForCausalLM, ParallelLlamaForScore

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


def test_shard_and_export_processes_never_import_torch(tmp_path):
    # A torch that cannot be imported, first on the stage processes' path: shard at tp 2 and
    # export over 2 processes still run, through the CLI, and the export loads in transformers.
    poison = tmp_path / "poison" / "torch"
    poison.mkdir(parents=True)
    (poison / "__init__.py").write_text("raise ImportError('torch imported by a stage that must not need it')\n")
    src, ckpt, out = str(tmp_path / "hf"), str(tmp_path / "ckpt"), str(tmp_path / "out")
    tiny.hf_model("lm").to(torch.bfloat16).save_pretrained(src)
    env = {**os.environ, "PYTHONPATH": f"{poison.parent}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    for args in (["shard", src, ckpt, "--tp", "2"], ["export", ckpt, out, "--procs", "2"]):
        proc = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "stage", *args], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stdout + proc.stderr
    from transformers import LlamaForCausalLM

    ours = LlamaForCausalLM.from_pretrained(out).state_dict()
    ref = LlamaForCausalLM.from_pretrained(src).state_dict()
    assert ours.keys() == ref.keys() and all(torch.equal(ours[k], ref[k]) for k in ref)


@pytest.mark.slow
def test_shard_under_torchrun(tmp_path):
    # torchrun's agent holds MASTER_PORT (its store) for its workers: the IOGroup takes the next port.
    from llamarl.cluster.executor import free_port
    from llamarl.lib import publish
    from llamarl.stages.config import ShardConfig

    src, ckpt = str(tmp_path / "hf"), str(tmp_path / "ckpt")
    tiny.hf_model("lm").save_pretrained(src)
    cfg = ShardConfig(src=src, dst=ckpt, tp=2).model_dump_json()
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                           f"--master_port={free_port()}", "-m", "llamarl.stages.shard", "--config-json", cfg],
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert publish.read_manifest(ckpt)["written_layout"] == {"tp": 2, "pp": 1}


@pytest.mark.parametrize("edge", [1024, 64 << 10], ids=["rows-read-in-place", "items-read-whole"])
def test_whole_tensors_read_from_chunks_of_either_writer(tmp_path, monkeypatch, edge):
    # What export reads: whole tensors from chunks split by rows (read straight into place when
    # their items are large: every item here, with a small edge) or by columns (copied), written
    # by lib/ or by DCP's own writer (whose items torch.save writes, strided ones included).
    import torch.distributed.checkpoint as dcp

    from llamarl.lib import checkpoint
    from llamarl.lib.checkpoint import Chunks

    monkeypatch.setattr(dcp_format, "_EDGE_BYTES", edge)
    in_place = []
    real = dcp_format._parse_edges
    monkeypatch.setattr(dcp_format, "_parse_edges", lambda *a: in_place.append(real(*a)) or in_place[-1])
    g = torch.Generator().manual_seed(3)
    full = {"rows": torch.randn(96, 40, generator=g).to(torch.bfloat16), "cols": torch.randn(24, 50, generator=g),
            "vec": torch.randn(3000, generator=g).to(torch.float16)}
    ours = str(tmp_path / "ours")
    checkpoint.save({"rows": Chunks((96, 40), {(0, 0): full["rows"][:32], (32, 0): full["rows"][32:]}),
                     "cols": Chunks((24, 50), {(0, 0): full["cols"][:, :20], (0, 20): full["cols"][:, 20:]}),
                     "vec": full["vec"]}, ours, threads=2)
    theirs = str(tmp_path / "theirs")
    dcp.save({"rows": full["rows"], "cols": full["cols"].t().contiguous().t(), "vec": full["vec"]},
             storage_writer=dcp.FileSystemWriter(theirs, thread_count=2))
    for url in (ours, theirs):
        md = dcp_format.read_metadata(url)
        for name, t in full.items():
            got = dcp_format.read_whole(url, md, name)
            assert got.dtype == str(t.dtype).removeprefix("torch.") and torch.equal(got.torch(), t), (url, name)
    # Parsed from their edges: rows (2 chunks of ours, 1 of DCP's), vec (1 each) and DCP's cols (one
    # chunk, the whole tensor: but stored strided, so read whole after all); our cols chunks are not rows.
    assert len([p for p in in_place if p is not None]) == (6 if edge == 1024 else 0)


def test_safetensors_written_by_threads_at_offsets_is_the_same_file(tmp_path):
    # Local files: tensors fetched and written at their offsets by several threads, then hashed as
    # a block tree; a stream elsewhere (memory:// here), in order. The same bytes either way, and
    # what safetensors itself writes.
    import fsspec
    from safetensors.numpy import save as st_save

    from llamarl.lib import publish
    from llamarl.lib.safetensors_io import Deferred, write_file

    g = np.random.default_rng(0)
    arrays = {f"t{i}": g.standard_normal((17 + i, 9)).astype(np.float32) for i in range(7)}
    host = {n: HostTensor("float32", a) for n, a in arrays.items()}
    lazy = {n: Deferred("float32", a.shape, lambda n=n: host[n]) for n, a in arrays.items()}
    a = write_file(str(tmp_path / "a.safetensors"), lazy, threads=4)
    b = write_file(str(tmp_path / "b.safetensors"), host, threads=1)
    c = write_file("memory://llamarl-test/c.safetensors", lazy, threads=4)
    data = (tmp_path / "a.safetensors").read_bytes()
    assert data == (tmp_path / "b.safetensors").read_bytes() == fsspec.filesystem("memory").cat("/llamarl-test/c.safetensors")
    assert data == st_save(arrays)
    assert publish.TREE in a and "xxh3_128" in b and "xxh3_128" in c
    publish.verify(str(tmp_path), {"a.safetensors": a, "b.safetensors": b})
    wrong = {**lazy, "t3": Deferred("float32", (1, 1), lambda: host["t3"])}
    with pytest.raises(ValueError, match="t3 came as float32"):
        write_file(str(tmp_path / "d.safetensors"), wrong, threads=4)
    assert not (tmp_path / "d.safetensors").exists()


def test_forked_and_started_processes_shard_alike(tmp_path):
    # `llamarl stage` forks the processes of shard and export (their imports done); started as
    # new interpreters instead, the same bytes come out, and a user error is one line, status 2.
    from llamarl.cluster.local import LocalExecutor, LocalOptions
    from llamarl.stages.config import ShardConfig

    src = str(tmp_path / "hf")
    tiny.hf_model("lm").save_pretrained(src)
    code = ("import sys, json; from llamarl.cluster.local import LocalExecutor, LocalOptions; "
            "from llamarl.stages.config import ShardConfig; "
            "r = LocalExecutor(LocalOptions(fork=sys.argv[1] == '1')).run('shard', ShardConfig(src=sys.argv[2], "
            "dst=sys.argv[3], tp=int(sys.argv[4])), int(sys.argv[4])); print(json.dumps([r.code, r.error]))")
    out = {}
    for fork in ("1", "0"):
        dst = str(tmp_path / f"ckpt{fork}")
        proc = subprocess.run([sys.executable, "-c", code, fork, src, dst, "2"], capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0 and proc.stdout.strip().endswith("[0, null]"), proc.stdout + proc.stderr
        out[fork] = {f: (tmp_path / f"ckpt{fork}" / "model" / f).read_bytes()
                     for f in os.listdir(tmp_path / f"ckpt{fork}" / "model")}
    assert out["1"].keys() == out["0"].keys() and all(out["1"][f] == out["0"][f] for f in out["1"] if f != ".metadata")
    proc = subprocess.run([sys.executable, "-c", code, "1", str(tmp_path / "nowhere"), str(tmp_path / "x"), "2"],
                          capture_output=True, text=True, timeout=300)
    code_, error = json.loads(proc.stdout.strip().splitlines()[-1])
    assert code_ == 2 and "config.json not found" in error, proc.stdout + proc.stderr
