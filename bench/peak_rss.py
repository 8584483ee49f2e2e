"""Per-rank peak memory of shard and export on a big model: no rank may hold the whole model.

    python bench/peak_rss.py [--shape 8b] [--procs 2] [--workdir /tmp/llamarl-rss]

Writes an HF checkpoint of the shape (Llama-3.1-8B: 16 GB of bf16; the values are a fill, not a
model: only the bytes' count matters here), then runs ``llamarl stage shard --tp PROCS`` and
``llamarl stage export --procs PROCS`` through the command line. Shard's manifest records each
rank's owned bytes and peak RSS; for both commands, the largest peak RSS of any of their processes
(``RUSAGE_CHILDREN``). CPU only (both stages move bytes on the CPU, over gloo). Writes JSON to
bench/results/peak_rss-<shape>-cpu-<date>.json (``--out`` elsewhere).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import shutil
import subprocess
import sys
import time


HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = {
    "8b": dict(vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
               num_attention_heads=32, num_key_value_heads=8),
    "small": dict(vocab_size=16000, hidden_size=512, intermediate_size=2048, num_hidden_layers=8,
                  num_attention_heads=8, num_key_value_heads=4),
}


def write_hf(path: str, shape: dict, max_file_gb: float = 5.0) -> int:
    """An HF Llama directory of ``shape`` with bf16 tensors filled with one value; returns its bytes."""
    from llamarl.lib import hf_mapping
    from llamarl.lib.config import LlamaConfig
    import torch

    from llamarl.lib.safetensors_io import Deferred, write_file

    hf = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "torch_dtype": "bfloat16",
          "rms_norm_eps": 1e-5, "rope_theta": 500000.0, "max_position_embeddings": 8192, "tie_word_embeddings": False,
          "head_dim": shape["hidden_size"] // shape["num_attention_heads"], **shape}
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf, f)
    shapes = hf_mapping.hf_shapes(LlamaConfig.from_hf(hf), "lm")
    files, current, size = [], {}, 0
    for name, s in shapes.items():
        n = 2 * math.prod(s)
        if current and size + n > max_file_gb * 1e9:
            files.append(current)
            current, size = {}, 0
        current[name] = s
        size += n
    files.append(current)
    names = [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))]
    for fname, group in zip(names, files):
        write_file(os.path.join(path, fname), {n: Deferred(torch.bfloat16, s, lambda s=s: torch.full(
            s, 1 / 128, dtype=torch.bfloat16)) for n, s in group.items()}, threads=2)
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": {n: fname for fname, g in zip(names, files) for n in g}}, f)
    return sum(2 * math.prod(s) for s in shapes.values())


_MEASURED = ("import json, resource, subprocess, sys, time; t = time.perf_counter(); "
             "p = subprocess.run([sys.executable, '-m', 'llamarl.pipeline.cli', *sys.argv[1:]], capture_output=True, "
             "text=True); print(json.dumps([p.returncode, p.stdout + p.stderr, time.perf_counter() - t, "
             "resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024]))")


def cli(*args) -> tuple[float, int]:
    """A ``llamarl`` command's seconds and the largest peak RSS of its processes (the command's own
    and its ranks': every descendant waited for), in bytes."""
    proc = subprocess.run([sys.executable, "-c", _MEASURED, *args], capture_output=True, text=True)
    code, output, seconds, peak = json.loads(proc.stdout.strip().splitlines()[-1])
    if code:
        raise SystemExit(f"{args} failed:\n{output}")
    return seconds, peak


def baseline_rss() -> int:
    """Peak RSS of an interpreter that imported both stages, and nothing more, in bytes."""
    code = ("import resource, llamarl.stages.shard, llamarl.stages.export; "
            "print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024)")
    return int(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="8b")
    ap.add_argument("--procs", type=int, default=2)
    ap.add_argument("--workdir", default="/tmp/llamarl-rss")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    shutil.rmtree(args.workdir, ignore_errors=True)
    hf, ckpt, out, prof = (os.path.join(args.workdir, n) for n in ("hf", "ckpt", "out", "profile"))
    total = write_hf(hf, SHAPES[args.shape])
    res = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "shape": args.shape, "procs": args.procs,
           "model_GB": total / 1e9}
    res["shard_s"], shard_peak = cli("stage", "shard", hf, ckpt, "--tp", str(args.procs))
    res["shard_max_rss_GB"] = shard_peak / 1e9
    with open(os.path.join(ckpt, "llamarl.json")) as f:
        ranks = json.load(f)["ranks"]
    res["shard_ranks"] = [{"rank": r["rank"], "owned_GB": r["owned_bytes"] / 1e9,
                           "peak_rss_GB": r["peak_rss_bytes"] / 1e9,
                           "growth_GB": (r["peak_rss_bytes"] - r["rss_before_bytes"]) / 1e9} for r in ranks]
    res["export_s"], export_peak = cli("stage", "export", ckpt, out, "--procs", str(args.procs))
    res["export_max_rss_GB"] = export_peak / 1e9
    res["largest_tensor_GB"] = 2 * SHAPES[args.shape]["vocab_size"] * SHAPES[args.shape]["hidden_size"] / 1e9
    # Bounded: every process well under the model (its share, or a few tensors at once), beyond what
    # a stage process holds before its work (an interpreter with torch and the stages imported).
    res["baseline_rss_GB"] = baseline_rss() / 1e9
    res["bounded"] = max(res["shard_max_rss_GB"], res["export_max_rss_GB"]) < res["model_GB"] / 2 + res["baseline_rss_GB"]
    print(json.dumps(res, indent=1))
    path = args.out or os.path.join(HERE, "results", f"peak_rss-{args.shape}-cpu-{res['date']}.json")
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    shutil.rmtree(args.workdir, ignore_errors=True)


if __name__ == "__main__":
    main()
