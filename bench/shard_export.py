"""Shard and export throughput against HF save_pretrained / from_pretrained, in the same run.

    python bench/shard_export.py [--procs 4] [--workdir /tmp/bench]

Llama-3.2-1B shape, bf16, random weights. Measures, on one machine:
  * HF ``save_pretrained`` (GPU model → safetensors) and ``from_pretrained`` (→ GPU model);
  * ``llamarl stage shard`` (HF dir → sharded checkpoint, --tp PROCS) and ``llamarl stage export``
    (→ HF dir, PROCS processes): whole-command wall time (process start and imports included) and
    the stage's own time;
  * loading the sharded checkpoint into lib/'s model on the GPU (``checkpoint.load_model``).
Each ``--repeat`` times, save_pretrained, shard and export interleaved (medians reported, every run
kept, and each command against the save_pretrained just before it; the first lib/ load pays CUDA's
and the reader's first-use costs), each after ``sync``: a command that starts while the one before
it still has GBs of dirty pages to write back is held to the disk's speed (the kernel's dirty limit). Checks the export is bit-identical to the HF source. Prints one JSON object and writes it to
bench/results/shard_export-<device>-<date>.json (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import subprocess
import sys
import time

import torch


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path) if f.endswith(".safetensors"))


def timed_cli(*args) -> tuple[float, float | None, str]:
    t = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", *args], capture_output=True, text=True)
    wall = time.perf_counter() - t
    if proc.returncode:
        raise SystemExit(f"{args} failed:\n{proc.stdout}\n{proc.stderr}")
    m = re.search(r"in ([\d.]+)s \(", proc.stdout)
    return wall, float(m.group(1)) if m else None, proc.stdout.strip()


def has_bytecode() -> bool:
    """Whether the installed packages have their bytecode (an ordinary pip install): without it
    every process compiles what it imports (the GPU machines before bench/gpu_env.sh compiles it)."""
    import importlib.util

    spec = importlib.util.find_spec("numpy")
    return bool(spec and spec.origin and os.path.exists(importlib.util.cache_from_source(spec.origin)))


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, default=4)
    ap.add_argument("--workdir", default="/tmp/llamarl-bench")
    ap.add_argument("--repeat", type=int, default=3, help="runs of each measurement; medians reported, all kept")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/shard_export-<device>-<date>.json)")
    args = ap.parse_args()
    from safetensors.torch import load_file
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    shutil.rmtree(args.workdir, ignore_errors=True)
    os.makedirs(args.workdir)
    hf_dir, ckpt, out = (os.path.join(args.workdir, n) for n in ("hf", "ckpt", "out"))
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    res = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "cpus": os.cpu_count(), "torch": torch.__version__, "procs": args.procs, "bytecode": has_bytecode()}
    import transformers

    res["transformers"] = transformers.__version__
    cfg = HFConfig(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=128256, max_position_embeddings=8192, tie_word_embeddings=False,
                   rope_theta=500000.0)
    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(cfg).to(torch.bfloat16)

    # Interleaved, each into a fresh directory (the first kept: the next command's input; a published
    # one would be skipped): a load that comes and goes on the machine meets all three alike.
    stages = (("shard", hf_dir, ckpt, "--tp"), ("export", ckpt, out, "--procs"))
    saves, runs = [], {stage: [] for stage, *_ in stages}
    for i in range(args.repeat):
        target = hf_dir if i == 0 else f"{hf_dir}{i}"
        if dev == "cuda":
            torch.cuda.synchronize()
        os.sync()  # each measurement starts with no dirty pages of the one before it to write back
        t = time.perf_counter()
        model.save_pretrained(target)
        saves.append(time.perf_counter() - t)
        if i:
            shutil.rmtree(target)
        for stage, src, dst, flag in stages:
            dst = dst if i == 0 else f"{dst}.{i}"
            os.sync()
            runs[stage].append(timed_cli("stage", stage, src, dst, flag, str(args.procs))[:2])
            if i:
                shutil.rmtree(dst)
    res["save_pretrained_runs_s"] = saves
    res["save_pretrained_s"] = statistics.median(saves)
    size = dir_bytes(hf_dir)
    res["GB"] = size / 1e9
    res["save_pretrained_GB_s"] = size / res["save_pretrained_s"] / 1e9
    for stage, stage_runs in runs.items():
        wall = statistics.median(w for w, _ in stage_runs)
        work = statistics.median(k for _, k in stage_runs) if all(k is not None for _, k in stage_runs) else None
        res.update({f"{stage}_runs_s": stage_runs, f"{stage}_wall_s": wall, f"{stage}_work_s": work,
                    f"{stage}_GB_s_wall": size / wall / 1e9, f"{stage}_GB_s_work": size / work / 1e9 if work else None,
                    # each run against the save_pretrained just before it
                    f"{stage}_vs_save_pretrained_paired": statistics.median(
                        sp / w for sp, (w, _) in zip(saves, stage_runs))})
    del model
    t = time.perf_counter()
    m2 = LlamaForCausalLM.from_pretrained(hf_dir, dtype=torch.bfloat16, **({"device_map": dev} if dev == "cuda" else {}))
    if dev == "cuda":
        torch.cuda.synchronize()
    res["from_pretrained_GB_s"] = size / (time.perf_counter() - t) / 1e9
    del m2

    # lib/ loading the sharded checkpoint onto the GPU (what rollout/score/ppo do), TP=1.
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")
    from llamarl.lib.files import checkpoint, publish
    from llamarl.lib.distributed import parallel
    from llamarl.lib.model.config import LlamaConfig, ParallelLayout
    from llamarl.lib.model.llama import ParallelLlamaForCausalLM

    parallel.init(1, 1)
    ours_cfg = LlamaConfig.from_dict(publish.require_published(ckpt)["model_config"])
    with torch.device(dev):
        ours = ParallelLlamaForCausalLM(ours_cfg, ParallelLayout(), dtype=torch.bfloat16)
    loads = []
    for _ in range(args.repeat):
        t = time.perf_counter()
        checkpoint.load_model(ours, f"{ckpt}/model")
        if dev == "cuda":
            torch.cuda.synchronize()
        loads.append(time.perf_counter() - t)
    res["lib_load_runs_s"] = loads
    res["lib_load_GB_s"] = size / statistics.median(loads) / 1e9
    parallel.shutdown()

    a = {}
    for f in os.listdir(hf_dir):
        if f.endswith(".safetensors"):
            a.update(load_file(os.path.join(hf_dir, f)))
    b = {}
    for f in os.listdir(out):
        if f.endswith(".safetensors"):
            b.update(load_file(os.path.join(out, f)))
    res["export_bit_identical"] = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
    res["shard_vs_save_pretrained"] = res["shard_GB_s_wall"] / res["save_pretrained_GB_s"]
    res["export_vs_save_pretrained"] = res["export_GB_s_wall"] / res["save_pretrained_GB_s"]
    res["lib_load_vs_from_pretrained"] = res["lib_load_GB_s"] / res["from_pretrained_GB_s"]
    print(json.dumps(res, indent=1))
    slug = re.sub(r"[^a-z0-9]+", "", res["device"].lower().replace("nvidia", "").split()[0]) if dev == "cuda" else "cpu"
    out_json = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                        f"shard_export-{slug}-{res['date']}.json")
    with open(out_json, "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
