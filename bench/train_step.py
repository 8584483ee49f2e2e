"""Training step throughput: lib/ against HF transformers, same run, same shape and batch.

    python bench/train_step.py           # Llama-3.2-1B shape, bf16, 8 x 2048 tokens a step, fused AdamW
    python bench/train_step.py --small   # a CPU smoke run
    python bench/train_step.py --ablate --profile DIR --out FILE

A step = forward, cross-entropy (lib/: vocab-parallel, remove-padding path), backward, AdamW.
Reports tokens/s, MFU (of 989 TFLOP/s, the reference's convention) and peak memory for each
variant: ``llamarl`` (lib/ as it runs by default: fused regions and Triton vocabulary kernels on
CUDA), ``llamarl-eager`` (``--ablate``: the same with ``LLAMARL_FUSED=0``, the unfused reference
path), ``hf``. Step times are CUDA-event times per step, the median of ``--steps``.

``--profile DIR``: after timing, a ``torch.profiler`` trace of two steps of each variant, summed
per kernel category (matmul, attention forward / backward, elementwise, cross-entropy, optimizer,
embedding, memcpy, idle) into ``DIR/profile.md`` and ``DIR/profile.json``.
"""

from __future__ import annotations

import argparse
import bisect
import contextlib
import gzip
import json
import os
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import record_function

PEAK_TFLOPS = 989e12


def flops_per_step(n_params_no_embed: int, layers: int, hidden: int, seq: int, tokens: int) -> float:
    return 6 * n_params_no_embed * tokens + 12 * layers * hidden * seq * tokens / 2  # causal attention


def step_times(step, n, dev, warmup=3) -> list[float]:
    """Seconds per step: CUDA events around each step (host clock on CPU), after ``warmup`` steps
    (compilation, allocator growth); peak memory counts from the first timed step."""
    for _ in range(warmup):
        step()
    if dev != "cuda":
        out = []
        for _ in range(n):
            t = time.perf_counter()
            step()
            out.append(time.perf_counter() - t)
        return out
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(n + 1)]
    events[0].record()
    for i in range(n):
        step()
        events[i + 1].record()
    torch.cuda.synchronize()
    return [a.elapsed_time(b) / 1e3 for a, b in zip(events[:-1], events[1:])]


@contextlib.contextmanager
def fused_env(value: str | None):
    old = os.environ.get("LLAMARL_FUSED")
    if value is None:
        os.environ.pop("LLAMARL_FUSED", None)
    else:
        os.environ["LLAMARL_FUSED"] = value
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("LLAMARL_FUSED", None)
        else:
            os.environ["LLAMARL_FUSED"] = old


def build_lib(hf_cfg, ids, dtype, fused, dev):
    """lib/'s model, optimizer and step (cross-entropy through ``lib.vocab_parallel``)."""
    from llamarl.lib import vocab_parallel
    from llamarl.lib.config import LlamaConfig, ParallelLayout
    from llamarl.lib.model import ParallelLlamaForCausalLM

    with torch.device(dev):
        model = ParallelLlamaForCausalLM(LlamaConfig.from_hf(hf_cfg.to_dict()), ParallelLayout(), dtype=dtype)
    model.init_random(seed=0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **fused)
    batch = model.make_batch(ids)
    labels = batch.flat(torch.roll(ids, -1, 1))
    losses = []

    def step():
        with record_function("forward"):
            logits = model(batch)
        with record_function("loss"):
            loss = vocab_parallel.cross_entropy(logits, labels).mean()
        del logits
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    return model, step, losses


def build_hf(hf_cfg, ids, dtype, fused, dev):
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    with torch.device(dev):
        model = LlamaForCausalLM(hf_cfg).to(dtype)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **fused)
    losses = []

    def step():
        with record_function("forward"):
            loss = model(input_ids=ids, labels=ids).loss
        with record_function("backward"):
            loss.backward()
        with record_function("optimizer"):
            opt.step()
            opt.zero_grad(set_to_none=True)
        losses.append(loss.detach())

    return model, step, losses


def measure(name, build, args, dev, n, flops, tokens, profile_dir):
    """One variant, in its own scope: its model and optimizer are freed before the next."""
    env = {"llamarl": None, "llamarl-eager": "0", "hf": None}[name]
    with fused_env(env):
        model, step, losses = build(*args)
        t0 = time.perf_counter()
        times = step_times(step, n, dev)
        out = {"step_s_median": statistics.median(times), "step_s_min": min(times), "step_s_max": max(times),
               "first_losses": [round(float(x), 5) for x in losses[:3]],
               "warmup_and_timed_s": time.perf_counter() - t0}
        dt = out["step_s_median"]
        out.update(tok_s=tokens / dt, mfu=flops / dt / PEAK_TFLOPS,
                   peak_gb=torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda" else None)
        if profile_dir:
            out["profile"] = profile(step, name, profile_dir, dev)
    del model, step
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


# ---- profile ---------------------------------------------------------------------------------

CATEGORIES = ("matmul", "attention fwd", "attention bwd", "elementwise (norm, rotary, SwiGLU, residual, casts)",
              "cross-entropy", "optimizer", "embedding", "memcpy/memset", "idle")
_CE_OPS = ("_logprob", "_klogprob", "_entropy", "_kentropy", "_klogprobentropy", "nll_loss", "log_softmax",
           "cross_entropy", "stats_kernel", "grad_kernel")
_GEMM = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "wgmma", "splitk")


def categorize(kernel: str, cat: str, stack: list[str]) -> str:
    """A GPU activity's category from its name and the CPU ops (outermost first) that launched it."""
    k = kernel.lower()
    ops = " | ".join(stack).lower()
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "memcpy/memset"
    if any(w in k for w in ("flash", "fmha", "attention", "attn", "sdpa")):
        # Backward: the kernel says so, or autograd's engine launched it (the forward's own
        # wrapper op may be named "GeneratedBackwardFor_...": not a sign).
        bwd = "bwd" in k or "bprop" in k or "backward" in k or any("evaluate_function" in s for s in stack)
        return "attention bwd" if bwd else "attention fwd"
    if "optimizer" in ops or "adam" in k:
        return "optimizer"
    innermost = [s.lower() for s in stack[-3:]]
    if any(w in k for w in _CE_OPS) or any(w in s for s in innermost for w in _CE_OPS) or "loss" in stack:
        return "cross-entropy"
    if any(w in k for w in _GEMM):
        return "matmul"
    if "embedding" in ops:
        return "embedding"
    return CATEGORIES[3]


def summarize_trace(path: str, steps: int) -> dict:
    """Per-step milliseconds by category from a chrome trace of ``steps`` steps, and the top kernels."""
    with open(path) as f:
        events = [e for e in json.load(f)["traceEvents"] if e.get("ph") == "X"]
    launches, cpu = {}, defaultdict(list)
    gpu = []
    for e in events:
        c, args = e.get("cat", ""), e.get("args") or {}
        if c in ("cuda_runtime", "cuda_driver") and "correlation" in args:
            launches[args["correlation"]] = e
        elif c in ("cpu_op", "user_annotation", "python_function"):
            cpu[(e["pid"], e["tid"])].append(e)
        elif c in ("kernel", "gpu_memcpy", "gpu_memset"):
            gpu.append(e)
    # The CPU ops enclosing each launch, by a sweep over each thread's nested intervals.
    stacks: dict[int, list[str]] = {}
    by_thread = defaultdict(list)
    for corr, e in launches.items():
        by_thread[(e["pid"], e["tid"])].append((e["ts"], corr))
    for key, ls in by_thread.items():
        ops = sorted(cpu.get(key, []), key=lambda e: (e["ts"], -e.get("dur", 0)))
        starts = [e["ts"] for e in ops]
        ls.sort()
        stack, i = [], 0
        for ts, corr in ls:
            j = bisect.bisect_right(starts, ts)
            while i < j:
                e = ops[i]
                while stack and stack[-1][0] < e["ts"]:
                    stack.pop()
                stack.append((e["ts"] + e.get("dur", 0), e["name"]))
                i += 1
            while stack and stack[-1][0] < ts:
                stack.pop()
            stacks[corr] = [name for _, name in stack]
    busy = defaultdict(float)
    kernels = defaultdict(lambda: [0.0, 0, ""])
    first, last = float("inf"), 0.0
    for e in gpu:
        corr = (e.get("args") or {}).get("correlation")
        category = categorize(e["name"], e["cat"], stacks.get(corr, []))
        busy[category] += e["dur"]
        kk = kernels[e["name"][:90]]
        kk[0] += e["dur"]
        kk[1] += 1
        kk[2] = category
        first, last = min(first, e["ts"]), max(last, e["ts"] + e["dur"])
    span = (last - first) if gpu else 0.0
    busy["idle"] = max(span - sum(busy.values()), 0.0)
    ms = {c: busy.get(c, 0.0) / 1e3 / steps for c in CATEGORIES}
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:15]
    return {"step_ms": span / 1e3 / steps, "ms": ms, "unattributed_launches": sum(1 for e in gpu if (e.get("args") or {}).get("correlation") not in stacks),
            "top_kernels": [{"name": n, "ms": t / 1e3 / steps, "calls_per_step": c / steps, "category": cat}
                            for n, (t, c, cat) in top]}


def profile(step, name, out_dir, dev, steps=2) -> dict:
    from torch.profiler import ProfilerActivity, profile as torch_profile

    os.makedirs(out_dir, exist_ok=True)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if dev == "cuda" else [])
    with torch_profile(activities=activities) as prof:
        for _ in range(steps):
            step()
        if dev == "cuda":
            torch.cuda.synchronize()
    path = f"/tmp/train_step-{name}.trace.json"
    prof.export_chrome_trace(path)
    summary = summarize_trace(path, steps)
    if name == "llamarl":  # the trace itself, when small enough to bring back
        with open(path, "rb") as f, gzip.open(os.path.join(out_dir, f"trace-{name}.json.gz"), "wb", compresslevel=6) as g:
            g.write(f.read())
        if os.path.getsize(os.path.join(out_dir, f"trace-{name}.json.gz")) > 15e6:
            os.remove(os.path.join(out_dir, f"trace-{name}.json.gz"))
    os.remove(path)
    return summary


def profile_table(res: dict) -> str:
    names = [n for n in ("llamarl", "llamarl-eager", "hf") if "profile" in res.get(n, {})]
    lines = ["| category | " + " | ".join(f"{n} ms/step | %" for n in names) + " |",
             "|---|" + "---|---|" * len(names)]
    for c in CATEGORIES:
        row = [c]
        for n in names:
            p = res[n]["profile"]
            row += [f"{p['ms'][c]:.1f}", f"{p['ms'][c] / p['step_ms']:.1%}" if p["step_ms"] else "–"]
        lines.append("| " + " | ".join(row) + " |")
    lines.append("| **step (GPU span)** | " + " | ".join(f"**{res[n]['profile']['step_ms']:.1f}** | " for n in names) + "|")
    for n in names:
        lines += ["", f"Top kernels, {n}:", "", "| kernel | category | ms/step | calls/step |", "|---|---|---|---|"]
        for k in res[n]["profile"]["top_kernels"]:
            lines.append(f"| `{k['name']}` | {k['category']} | {k['ms']:.2f} | {k['calls_per_step']:.0f} |")
    return "\n".join(lines) + "\n"


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--ablate", action="store_true", help="also lib/ with LLAMARL_FUSED=0 (the unfused path)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 20; --small 2)")
    ap.add_argument("--profile", metavar="DIR", help="write a per-category kernel profile of each variant here")
    ap.add_argument("--out", metavar="FILE", help="write the JSON here too")
    args = ap.parse_args()
    from transformers import LlamaConfig as HFConfig

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29545")
    from llamarl.lib import parallel

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.small:
        shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=1000)
        batch, seq, n = 2, 64, 2
    else:
        shape = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256)
        batch, seq, n = 8, 2048, 20
    n = args.steps or n
    hf_cfg = HFConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=False, rope_theta=500000.0)
    hf_cfg._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    fused = {"fused": True} if dev == "cuda" else {}
    tokens = batch * seq
    res = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "torch": torch.__version__, "tokens_per_step": tokens, "dtype": str(dtype), "shape": shape,
           "batch": batch, "seq": seq, "steps": n}
    try:
        import transformers
        res["transformers"] = transformers.__version__
    except ImportError:
        pass
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), device=dev)
    h, f, v, L = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    no_embed = L * (h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h) + h + v * h
    flops = flops_per_step(no_embed, L, h, seq, tokens)
    res["flops_per_step"] = flops

    parallel.init(1, 1)
    variants = ["llamarl"] + (["llamarl-eager"] if args.ablate else []) + ["hf"]
    for name in variants:
        build = build_hf if name == "hf" else build_lib
        res[name] = measure(name, build, (hf_cfg, ids, dtype, fused, dev), dev, n, flops, tokens, args.profile)
        print(name, json.dumps({k: v for k, v in res[name].items() if k != "profile"}), flush=True)
    # The flat keys bench/report.py and earlier result files use.
    for name, key in (("llamarl", "llamarl"), ("hf", "hf")):
        res.update({f"{key}_tok_s": res[name]["tok_s"], f"{key}_mfu": res[name]["mfu"], f"{key}_peak_gb": res[name]["peak_gb"]})
    res["ratio_llamarl_over_hf"] = res["llamarl_tok_s"] / res["hf_tok_s"]
    if res["llamarl_peak_gb"] and res["hf_peak_gb"]:
        res["peak_memory_llamarl_over_hf"] = res["llamarl_peak_gb"] / res["hf_peak_gb"]
    parallel.shutdown()
    text = json.dumps(res, indent=1)
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    if args.profile:
        table = profile_table(res)
        with open(os.path.join(args.profile, "profile.md"), "w") as fh:
            fh.write(table)
        with open(os.path.join(args.profile, "profile.json"), "w") as fh:
            json.dump({n: res[n].get("profile") for n in variants}, fh, indent=1)
        print(table)
    print(json.dumps({k: v for k, v in res.items() if not isinstance(v, dict)}, indent=1))


if __name__ == "__main__":
    main()
