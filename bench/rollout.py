"""Generation throughput: lib/'s engine against HF generate (static cache, compiled), same run.

    python bench/rollout.py --out bench/results/rollout-h100-DATE.json   # Llama-3.2-1B shape, bf16
    python bench/rollout.py --small                                       # a CPU smoke run

Workloads (random weights, random prompts of ``prompt_len`` tokens, temperature 1, top_p 1):

* ``fixed``: ``batch`` prompts → exactly ``new`` tokens each, ``max_batch = batch``, for each
  batch size; HF generate (static cache, compiled by HF) on the first batch size, in the same run.
  For each, the memory-bandwidth bound: every decode step reads the weights once (all but the
  embedding table, of which it reads ``batch`` rows) and each sequence's KV cache so far; the bound
  is those bytes over the device-to-device copy bandwidth measured in the same run.
* ``stops``: continuous batching, ``cb_slots`` slots for ``cb_prompts`` prompts, a stop set of
  ``stop_tokens`` token ids (random weights hit it with probability ≈ stop_tokens / vocab per step,
  so lengths are random, mean well below ``new``), against the same slots and prompts with no stops.

Each engine workload runs twice (the first run captures the CUDA graphs and compiles the sampler)
and the second is timed. Prints one JSON object (and writes it to ``--out``).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def sync(dev):
    if dev == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(dev) -> float | None:
    """Device-to-device copy, bytes read + written per second (the ceiling for decode)."""
    if dev != "cuda":
        return None
    a = torch.empty(1 << 30, dtype=torch.uint8, device=dev)
    b = torch.empty_like(a)
    for _ in range(3):
        b.copy_(a)
    sync(dev)
    t = time.perf_counter()
    for _ in range(20):
        b.copy_(a)
    sync(dev)
    return 2 * a.numel() * 20 / (time.perf_counter() - t)


def timed(fn, dev):
    fn()  # warm-up: graph capture, compilation
    sync(dev)
    t = time.perf_counter()
    out = fn()
    sync(dev)
    return out, time.perf_counter() - t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--batches", default="64,256,512")
    ap.add_argument("--skip-hf", action="store_true")
    ap.add_argument("--profile", action="store_true", help="kernel table of a few eager decode steps")
    ap.add_argument("--profile-host", action="store_true",
                    help="cProfile of the random-stops workload: where the host spends its time")
    ap.add_argument("--only-cb", action="store_true", help="the continuous-batching workloads only")
    ap.add_argument("--cb-prompts", type=int, help="prompts of the continuous-batching workloads (default 512)")
    ap.add_argument("--cb-every", default="1,2,4,16", help="check_every values to compare")
    ap.add_argument("--out")
    args = ap.parse_args()
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29544")
    from llamarl.lib import parallel
    from llamarl.lib.config import LlamaConfig, ParallelLayout
    from llamarl.lib.generate import Engine, SamplingParams
    from llamarl.lib.model import ParallelLlamaForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    batches = [int(b) for b in args.batches.split(",")]
    if args.small:
        shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=1000)
        batches, plen, new, cb_slots, cb_prompts, stop_tokens = [8, 16], 16, 16, 4, 16, 40
    else:
        shape = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256)
        plen, new, cb_slots, cb_prompts, stop_tokens = 128, 256, 64, 512, 1000
    cb_prompts = args.cb_prompts or cb_prompts
    hf_cfg = HFConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=False, rope_theta=500000.0)
    hf_cfg._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    res = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "torch": torch.__version__, "prompt_len": plen, "new_tokens": new, "sampling": "temperature 1, top_p 1",
           "copy_bandwidth_Bps": copy_bandwidth(dev)}
    torch.manual_seed(0)
    prompts = torch.randint(3, shape["vocab_size"], (max(batches + [cb_prompts]), plen), device=dev).tolist()

    parallel.init(1, 1)
    with torch.device(dev):
        ours = ParallelLlamaForCausalLM(LlamaConfig.from_hf(hf_cfg.to_dict()), ParallelLayout(), dtype=dtype)
    ours.init_random(seed=0)
    cfg = ours.cfg
    size = torch.finfo(dtype).bits // 8
    weight_bytes = sum(p.numel() for n, p in ours.named_parameters() if "embed_tokens" not in n) * size
    kv_token_bytes = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * size
    bw = res["copy_bandwidth_Bps"]
    res["weight_bytes_per_step"], res["kv_bytes_per_token"] = weight_bytes, kv_token_bytes

    try:  # the sampler's compiled pass against the eager one, before anything relies on it
        res["sampler_compiled"] = dev == "cuda" and _check_compiled_sampler(dev, res)
    except Exception as e:  # noqa: BLE001 - recorded, and the engine runs eager sampling instead
        res["sampler_compiled"], res["sampler_compile_error"] = False, repr(e)[:500]
    compiled = res["sampler_compiled"]

    fixed = {}
    for bs in [] if args.only_cb else batches:
        params = SamplingParams(temperature=1.0, max_new_tokens=new)
        engine = Engine(ours, params, max_batch=bs, compiled=compiled)
        out, secs = timed(lambda: engine.generate(prompts[:bs], seed=1), dev)
        made = sum(len(c.tokens) for c in out)
        # Decode step j (1 .. new-1) reads plen + j cached keys per sequence; the prefill reads
        # the weights once more.
        kv = bs * sum(plen + j for j in range(1, new)) * kv_token_bytes
        bound = (new * weight_bytes + kv) / bw if bw else None
        fixed[bs] = {"new_tok_s": made / secs, "seconds": secs, "tokens": made, "engine": engine.stats,
                     "graphs": len(engine._graphs), "bandwidth_bound_s": bound,
                     "fraction_of_bandwidth_bound": bound / secs if bound else None}
        print(json.dumps({"batch": bs, **fixed[bs]}), flush=True)
        res["fixed"] = fixed
        if args.profile and bs in (batches[0], batches[-1]):
            res.setdefault("profile", {})[bs] = prof = _profile(engine, bs, dev)
            print(json.dumps(prof, indent=1), flush=True)
        _save(res, args.out)

    # Continuous batching: random stop lengths against fixed lengths, same slots and prompts.
    cb = {"slots": cb_slots, "prompts": cb_prompts, "stop_tokens": stop_tokens}
    for every in [int(e) for e in args.cb_every.split(",")]:
        for name, stops in (("fixed_length", ()), ("random_stops", tuple(range(3, 3 + stop_tokens)))):
            params = SamplingParams(temperature=1.0, max_new_tokens=new, stop_token_ids=stops)
            engine = Engine(ours, params, max_batch=cb_slots, compiled=compiled, check_every=every)
            out, secs = timed(lambda: engine.generate(prompts[:cb_prompts], seed=2), dev)
            made = sum(len(c.tokens) for c in out)
            if args.profile_host and stops and every == 4:
                import cProfile
                import io
                import pstats

                prof = cProfile.Profile()
                prof.runcall(engine.generate, prompts[:cb_prompts], seed=2)
                text = io.StringIO()
                pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(25)
                print(text.getvalue(), flush=True)
            cb[f"{name}_every{every}"] = r = {
                "new_tok_s": made / secs, "seconds": secs, "tokens": made, "mean_len": made / len(out),
                "stopped": sum(c.finish_reason == "stop" for c in out), "engine": engine.stats,
                "slot_utilisation": (made - len(out)) / engine.stats["slot_steps"]}  # decode-made tokens per slot-step
            print(json.dumps({f"{name}_every{every}": r}), flush=True)
        cb[f"ratio_every{every}"] = cb[f"random_stops_every{every}"]["new_tok_s"] / cb[f"fixed_length_every{every}"]["new_tok_s"]
        res["continuous_batching"] = cb
        _save(res, args.out)
    engine = ours = None  # free the cache and weights before HF's model
    if dev == "cuda":
        torch.cuda.empty_cache()

    if not args.skip_hf:
        bs = batches[0]
        with torch.device(dev):
            hf = LlamaForCausalLM(hf_cfg).to(dtype).eval()
        ids = torch.tensor(prompts[:bs], device=dev)
        kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=True, top_p=1.0, pad_token_id=0)
        impl = {"cache_implementation": "static"} if dev == "cuda" else {}
        with torch.no_grad():
            hf.generate(ids, **impl, **kw)  # compiles on the first call with a static cache
            _, secs = timed(lambda: hf.generate(ids, **impl, **kw), dev)
        key = "hf_static_compiled" if dev == "cuda" else "hf_eager"
        res[key] = {"batch": bs, "new_tok_s": bs * new / secs, "seconds": secs}
        res["ratio_llamarl_over_hf"] = fixed[bs]["new_tok_s"] / res[key]["new_tok_s"]
    parallel.shutdown()
    print(json.dumps(res, indent=1))
    _save(res, args.out)


def _save(res: dict, path: str | None) -> None:
    """Written after every workload, so a failure later keeps what was measured."""
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(res, indent=1) + "\n")


def _check_compiled_sampler(dev, res) -> bool:
    """The compiled per-shard pass draws what the eager one draws (the same hash, the same
    Gumbel perturbation up to float rounding) on Llama-sized rows."""
    from llamarl.lib.sampling import SamplingParams, sample, sequence_keys

    g = torch.Generator(device=dev).manual_seed(0)
    logits = (torch.randn(64, 128256, device=dev, generator=g) * 2).bfloat16()
    keys, steps = sequence_keys(0, range(64), device=dev), torch.arange(64, device=dev)
    t0 = time.perf_counter()
    a = sample(logits, SamplingParams(), keys, steps, compiled=True)
    res["sampler_compile_s"] = time.perf_counter() - t0
    b = sample(logits, SamplingParams(), keys, steps, compiled=False)
    res["sampler_compiled_vs_eager"] = {"same_tokens": int((a[0] == b[0]).sum()), "rows": 64,
                                        "max_logp_diff": float((a[1] - b[1]).abs().max())}
    return bool((a[0] == b[0]).float().mean() >= 0.95)


@torch.no_grad()
def _profile(engine, bs, dev) -> dict:
    """The decode step at batch ``bs``: graph replay time, eager time, and the eager step's kernels."""
    from torch.profiler import ProfilerActivity, profile

    span = engine.max_len
    engine._step(bs, span)  # capture (if new)
    graph = engine._graphs.get((bs, span))
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(50):
        graph.replay()
    end.record()
    sync(dev)
    out = {"batch": bs, "span": span, "graph_step_ms": start.elapsed_time(end) / 50}
    start.record()
    for _ in range(10):
        engine._decode(bs, span)
    end.record()
    sync(dev)
    out["eager_step_ms"] = start.elapsed_time(end) / 10
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            engine._decode(bs, span)
        sync(dev)
    rows = []
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None) or getattr(e, "cuda_time_total", 0)
        if t:
            rows.append((t / 5 / 1000, e.count // 5, e.key[:90]))
    rows.sort(reverse=True)
    out["kernel_ms_per_step"] = sum(r[0] for r in rows)
    out["kernels_per_step"] = sum(r[1] for r in rows)
    out["top_kernels"] = [{"ms": round(ms, 4), "calls": c, "name": k} for ms, c, k in rows[:20]]
    return out


if __name__ == "__main__":
    main()
