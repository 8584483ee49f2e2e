"""The per-iteration weight hand-off: ppo publishes the actor's bf16 weights, rollout has them on
the device. Seconds and GB/s, one process (TP 1).

    python bench/handoff.py [--shape 1b|8b|small] [--small] [--repeat 3] [--cold] [--workdir DIR]

What each side does is what the stages do, through the same lib/ calls:

  save     ppo: the fp32 masters converted to bf16 (``ShardedAdamW.model_state``) and written
           (``checkpoint.save``: 4 writer threads, hashed while written), every file's manifest
           entry (``outputs.file_entries``), the manifest published last;
  verify   rollout: every file of ``model/`` checked against its checksum (``outputs.verify_input``);
  build    rollout: its model allocated on the device;
  load     rollout: ``checkpoint.load_model`` (coalesced range reads, pinned buffers and
           non-blocking copies on a GPU), synchronized.

``handoff_s`` is their sum. The load follows the save, so the files are in the page cache, as on
one host; ``--cold`` drops them from it first (fsync, then POSIX_FADV_DONTNEED), as when rollout
runs on another host. Checks the loaded weights are the saved ones, bit for bit. Also measures the checksums: GB/s
of xxh3_128, sha256, blake2b on one core, and a file's manifest entry hashed while writing
against a second pass (``--checksum-mb``). Writes JSON to
bench/results/handoff-<device>-<date>.json (``--out`` elsewhere). Shapes: Llama-3.2-1B (hidden 2048,
16 layers, 32/8 heads, ffn 8192, vocab 128256, untied: 3.0 GB of bf16 weights), Llama-3.1-8B
(16 GB), and a small one for CPU tests.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import statistics
import sys
import tempfile
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256, rope_theta=500000.0),
    "small": dict(hidden_size=256, intermediate_size=512, num_hidden_layers=4, num_attention_heads=8,
                  num_key_value_heads=4, vocab_size=4000, rope_theta=10000.0),
}


def hf_config(shape: str) -> dict:
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "max_position_embeddings": 8192,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": False, "torch_dtype": "bfloat16", **SHAPES[shape]}


def device_name(dev: torch.device) -> str:
    if dev.type != "cuda":
        return "cpu"
    name = torch.cuda.get_device_name(dev).lower()
    m = re.search(r"\b([a-z]\d{2,4}[a-z]?)\b", name)
    return m.group(1) if m else re.sub(r"[^a-z0-9]+", "-", name).strip("-")


def sync(dev: torch.device) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def drop_from_page_cache(root: str) -> None:
    for folder, _, names in os.walk(root):
        for n in names:
            fd = os.open(os.path.join(folder, n), os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def checksum_throughput(nbytes: int, folder: str) -> dict:
    """GB/s of each checksum on one core, and what a manifest entry of a written file costs: hashed
    while writing (``publish.open_write``) against writing then reading it again to hash it (what
    every writer did before), xxh3 and sha256."""
    import hashlib

    import xxhash

    from llamarl.lib.files import publish

    data = memoryview(os.urandom(nbytes))
    out = {"MB": nbytes / 1e6}
    for name, new in (("xxh3_128", xxhash.xxh3_128), ("sha256", hashlib.sha256), ("blake2b", hashlib.blake2b)):
        h, t = new(), time.perf_counter()
        for k in range(0, nbytes, 16 << 20):
            h.update(data[k : k + (16 << 20)])
        out[f"{name}_GB_s"] = nbytes / (time.perf_counter() - t) / 1e9
    path = os.path.join(folder, "checksum.bin")

    def fresh(write) -> float:  # the best of two, each into a new file (page cache allocation alike)
        best = None
        for _ in range(2):
            if os.path.exists(path):
                os.remove(path)
            t = time.perf_counter()
            write()
            best = min(best or 1e9, time.perf_counter() - t)
        return best

    def plain():
        with open(path, "wb") as f:
            f.write(data)

    def hashing():
        with publish.open_write(path) as f:
            f.write(data)

    out["write_s"] = fresh(plain)
    for algo in ("xxh3_128", "sha256"):
        t = time.perf_counter()
        publish.checksum(path, algo)
        out[f"second_pass_{algo}_s"] = time.perf_counter() - t  # from the page cache: a lower bound
    out["write_hashing_xxh3_128_s"] = fresh(hashing)
    os.remove(path)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--shape", choices=sorted(SHAPES), default="1b")
    ap.add_argument("--small", action="store_true", help="the small shape (CPU tests); same as --shape small")
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--cold", action="store_true", help="drop the written files from the page cache before loading")
    ap.add_argument("--device", default=None, help="cpu or cuda (default: cuda when there is one)")
    ap.add_argument("--workdir", default=None)
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/handoff-<device>-<date>.json)")
    ap.add_argument("--checksum-mb", type=int, default=None, help="size of the checksum measurement (default: 1024, "
                                                                       "--small: 64; 0: none)")
    args = ap.parse_args()
    shape = "small" if args.small else args.shape

    from llamarl.lib.files import checkpoint, outputs, publish
    from llamarl.lib.model import hf_mapping
    from llamarl.lib.distributed import parallel
    from llamarl.lib.model.config import LlamaConfig, ParallelLayout
    from llamarl.lib.model.llama import ParallelLlamaForCausalLM
    from llamarl.stages import contract

    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if dev.type == "cuda":
        torch.cuda.set_device(dev.index or 0)
    topo = parallel.init(1, 1, backend="gloo")
    cfg = LlamaConfig.from_hf(hf_config(shape))
    layout = ParallelLayout()

    # ppo's actor: fp32 masters on the device (random, the same whatever the layout).
    torch.manual_seed(0)
    with torch.device(dev):
        actor = ParallelLlamaForCausalLM(cfg, layout, dtype=torch.float32)
    read = hf_mapping.random_reader(cfg, seed=0)
    with torch.no_grad():
        for name, p in actor.named_parameters():
            p.copy_(hf_mapping.build_local(cfg, topo.tp, topo.tp_rank, name, read))
    del read
    masters = {n: p.detach() for n, p in actor.named_parameters()}

    work = args.workdir or tempfile.mkdtemp(prefix="llamarl-handoff-")
    res = {"date": time.strftime("%Y-%m-%d"), "device": device_name(dev), "device_full": str(dev) if dev.type == "cpu"
           else torch.cuda.get_device_name(dev), "cpus": os.cpu_count(), "torch": torch.__version__, "shape": shape,
           "hf_config": hf_config(shape), "cold": args.cold, "write_threads": 4,
           "read_block_bytes": checkpoint.BLOCK_BYTES, "read_threads": checkpoint.READ_THREADS, "runs": []}
    try:
        mb = args.checksum_mb if args.checksum_mb is not None else (64 if shape == "small" else 1024)
        if mb:
            res["checksums"] = checksum_throughput(mb << 20, work)
            print(json.dumps({k: round(v, 3) for k, v in res["checksums"].items()}), flush=True)
        for i in range(args.repeat):
            root = os.path.join(work, f"actor-{i}")
            shutil.rmtree(root, ignore_errors=True)
            sync(dev)
            t0 = time.perf_counter()
            # ---- ppo: publish the weights
            publish.prepare(root, lambda m: False)
            state = checkpoint.model_state(actor, tensors={n: m.to(torch.bfloat16) for n, m in masters.items()})
            checkpoint.save(state, f"{root}/{contract.MODEL}")
            del state
            names = sorted(f"{contract.MODEL}/{n}" for n in os.listdir(os.path.join(root, contract.MODEL)))
            files = outputs.file_entries(root, names)
            publish.publish(root, contract.checkpoint_manifest(cfg, "lm", torch.bfloat16, hf_config(shape), {}, files,
                                                               topo, train_state={"step": i}))
            t_save = time.perf_counter()
            if args.cold:
                drop_from_page_cache(root)
            t1 = time.perf_counter()
            # ---- rollout: verify, build, load
            manifest = publish.require_published(root, contract.CHECKPOINT)
            outputs.verify_input(root, manifest, f"{contract.MODEL}/")
            t_verify = time.perf_counter()
            with torch.device(dev):
                model = ParallelLlamaForCausalLM(LlamaConfig.from_dict(manifest["model_config"]), layout, dtype=torch.bfloat16)
            sync(dev)
            t_build = time.perf_counter()
            checkpoint.load_model(model, f"{root}/{contract.MODEL}")
            sync(dev)
            t_load = time.perf_counter()
            nbytes = sum(e["bytes"] for e in files.values())
            same = all(torch.equal(p, masters[n].to(torch.bfloat16)) for n, p in model.named_parameters())
            run = {"GB": nbytes / 1e9, "save_s": t_save - t0, "verify_s": t_verify - t1, "build_s": t_build - t_verify,
                   "load_s": t_load - t_build}
            run["handoff_s"] = run["save_s"] + run["verify_s"] + run["build_s"] + run["load_s"]
            run.update(save_GB_s=run["GB"] / run["save_s"], verify_GB_s=run["GB"] / run["verify_s"],
                       load_GB_s=run["GB"] / run["load_s"], handoff_s_per_GB=run["handoff_s"] / run["GB"],
                       bit_identical=same)
            res["runs"].append(run)
            print(json.dumps({k: round(v, 3) if isinstance(v, float) else v for k, v in run.items()}), flush=True)
            del model
            shutil.rmtree(root, ignore_errors=True)
    finally:
        if not args.workdir:
            shutil.rmtree(work, ignore_errors=True)
        parallel.shutdown()
    keys = [k for k, v in res["runs"][0].items() if isinstance(v, float)]
    res["median"] = {k: statistics.median(r[k] for r in res["runs"]) for k in keys}
    res["bit_identical"] = all(r["bit_identical"] for r in res["runs"])
    m = res["median"]
    print(f"{shape} on {res['device']}: {m['GB']:.2f} GB; save {m['save_s']:.2f} s ({m['save_GB_s']:.2f} GB/s), "
          f"verify {m['verify_s']:.2f} s, build {m['build_s']:.2f} s, load {m['load_s']:.2f} s ({m['load_GB_s']:.2f} GB/s); "
          f"hand-off {m['handoff_s']:.2f} s ({m['handoff_s_per_GB']:.2f} s/GB); bit-identical: {res['bit_identical']}")
    out = args.out or os.path.join(HERE, "results", f"handoff-{res['device']}-{res['date']}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(out)
    sys.stdout.flush()


if __name__ == "__main__":
    main()
