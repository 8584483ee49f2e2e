"""Generation throughput: lib/'s engine against HF generate (static cache, compiled), same run.

    python bench/rollout.py --out bench/results/rollout-h100-DATE.json   # Llama-3.2-1B shape, bf16
    python bench/rollout.py --small                                       # a CPU smoke run

Workloads (random weights, random prompts of ``prompt_len`` tokens, temperature 1, top_p 1):

* ``fixed``: ``batch`` prompts → exactly ``new`` tokens each, ``max_batch = batch``, for each
  batch size; HF generate (static cache, compiled by HF) on the first batch size, in the same run.
  For each, the memory-bandwidth bound: every decode step reads the weights once (all but the
  embedding table, of which it reads ``batch`` rows) and each sequence's KV cache so far; the bound
  is those bytes over the device-to-device copy bandwidth measured in the same run.
* ``drain`` (``--drain-slots``): the rollout stage's batch-invariant stream (chunks of 64, random
  stops, 8 × slots prompts) against the default engine, same prompts: tokens/s and the seconds
  from the window where nothing is left to admit to the end (``drain_s``), where the invariant
  engine keeps running every slot and the default one shrinks its step.
* ``stops``: continuous batching, ``cb_slots`` slots for ``cb_prompts`` prompts, a stop set of
  ``stop_tokens`` token ids (random weights hit it with probability ≈ stop_tokens / vocab per step,
  so lengths are random, mean well below ``new``), against the same slots and prompts with no stops.

Each engine workload runs twice (the first run captures the CUDA graphs and compiles the sampler)
and the second is timed. Prints one JSON object (and writes it to ``--out``).

Several GPUs (``--tp N`` / ``--dp N``, under torchrun, tp × dp processes)::

    torchrun --nproc-per-node 2 bench/rollout.py --dp 2 --out bench/results/rollout-dp2-h100x2-DATE.json
    torchrun --nproc-per-node 2 bench/rollout.py --tp 2
    torchrun --nproc-per-node 2 bench/rollout.py --dp 2 --small                # CPU smoke run, gloo

* ``parallel``: the rollout stage's engine (batch-invariant, one stream over chunks of ``--chunk``
  prompts, chunk c to DP group c mod dp) on ``cb_prompts`` prompts → ``new`` tokens each (no
  stops), ``cb_slots`` slots per engine: first on one GPU (rank 0 alone, TP1, the others wait),
  then at TP × DP on all of them, in the same run; tokens/s of both, the speed-up, and whether
  the layout drew the tokens one GPU drew (the same bits at DP, where the engine is batch-invariant).
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
    ap.add_argument("--drain-slots", default="64,256",
                    help="slot counts of the drain workload (batch-invariant stream against the default engine); '' skips it")
    ap.add_argument("--only-drain", action="store_true", help="the drain workload only")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (under torchrun)")
    ap.add_argument("--dp", type=int, default=None, help="data-parallel groups (under torchrun; default: the rest)")
    ap.add_argument("--chunk", type=int, default=64, help="prompts per chunk of the parallel workload")
    ap.add_argument("--out")
    args = ap.parse_args()
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 or args.tp > 1 or (args.dp or 1) > 1:
        return parallel_main(args, world)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29544")
    from llamarl.lib.distributed import parallel
    from llamarl.lib.model.config import LlamaConfig, ParallelLayout
    from llamarl.lib.engine.generate import Engine, SamplingParams
    from llamarl.lib.model.llama import ParallelLlamaForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    batches = [8, 16] if args.small else [int(b) for b in args.batches.split(",")]
    shape, w = _workload(args.small)
    plen, new, cb_slots, stop_tokens = w["plen"], w["new"], w["cb_slots"], w["stop_tokens"]
    cb_prompts = args.cb_prompts or w["cb_prompts"]
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
    weight_bytes, kv_token_bytes = step_bytes(ours)
    bw = res["copy_bandwidth_Bps"]
    res["weight_bytes_per_step"], res["kv_bytes_per_token"] = weight_bytes, kv_token_bytes

    try:  # the sampler's kernel against the eager torch code, before anything relies on it
        res["sampler_fused"] = dev == "cuda" and _check_fused_sampler(dev, res)
    except Exception as e:  # noqa: BLE001 - recorded, and the engine runs eager sampling instead
        res["sampler_fused"], res["sampler_fused_error"] = False, repr(e)[:500]
    fused = res["sampler_fused"]

    fixed = {}
    for bs in [] if args.only_cb or args.only_drain else batches:
        params = SamplingParams(temperature=1.0, max_new_tokens=new)
        engine = Engine(ours, params, max_batch=bs, fused=fused)
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
    for every in [] if args.only_drain else [int(e) for e in args.cb_every.split(",")]:
        for name, stops in (("fixed_length", ()), ("random_stops", tuple(range(3, 3 + stop_tokens)))):
            params = SamplingParams(temperature=1.0, max_new_tokens=new, stop_token_ids=stops)
            engine = Engine(ours, params, max_batch=cb_slots, fused=fused, check_every=every)
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
    drain_slots = [int(x) for x in args.drain_slots.split(",") if x] if not args.small else [cb_slots]
    if drain_slots:
        g = torch.Generator().manual_seed(3)
        count = 4 * cb_slots if args.small else 8 * max(drain_slots)
        drain_prompts = torch.randint(3, shape["vocab_size"], (count, plen), generator=g).tolist()
        res["drain"] = _drain(ours, drain_prompts, drain_slots, new, stop_tokens, fused, dev, args.small)
        _save(res, args.out)
    engine = ours = None  # free the cache and weights before HF's model
    if dev == "cuda":
        torch.cuda.empty_cache()

    if not args.skip_hf and not args.only_drain:
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


def _drain(model, prompts, slots_list, new, stop_tokens, fused, dev, small) -> dict:
    """What batch invariance costs at a stream's end: the rollout stage's stream (chunks of 64
    prompts, or 4 with --small; random stops, so responses end early and the slots empty unevenly)
    with ``batch_invariant`` (every step runs all slots to the end) against the default engine
    (live sequences compacted into the lowest slots, smaller buckets as the stream drains), the same
    prompts and draws. ``drain_*``: from the window where nothing was left to admit to the end."""
    from llamarl.lib.engine.generate import Batch, Engine, SamplingParams

    params = SamplingParams(temperature=1.0, max_new_tokens=new, stop_token_ids=tuple(range(3, 3 + stop_tokens)))
    chunk = 4 if small else 64
    out = {"stop_tokens": stop_tokens, "chunk": chunk, "new_tokens": new}
    for slots in slots_list:
        n = min(len(prompts), 8 * slots) if not small else len(prompts)
        batches = [Batch(prompts[i:i + chunk], list(range(i, min(i + chunk, n))), tag=i // chunk) for i in range(0, n, chunk)]
        row = {"slots": slots, "prompts": n}
        for name, invariant in (("batch_invariant", True), ("default", False)):
            engine = Engine(model, params, max_batch=slots, fused=fused, batch_invariant=invariant)
            comps, secs = timed(lambda: [c for _, cs in engine.stream(batches, seed=2) for c in cs], dev)
            made = sum(len(c.tokens) for c in comps)
            st = engine.stats
            row[name] = {"engine_slots": engine.slots, "new_tok_s": made / secs, "seconds": secs, "tokens": made, "mean_len": made / len(comps),
                         "steps": st["steps"], "slot_steps": st["slot_steps"], "drain_s": st["drain_s"],
                         "drain_steps": st["drain_steps"], "drain_slot_steps": st["drain_slot_steps"],
                         "drain_fraction_of_time": st["drain_s"] / secs if secs else None}
        inv, base = row["batch_invariant"], row["default"]
        row["invariant_over_default_tok_s"] = inv["new_tok_s"] / base["new_tok_s"]
        row["extra_s"] = inv["seconds"] - base["seconds"]
        row["extra_drain_s"] = inv["drain_s"] - base["drain_s"]
        print(json.dumps({"drain": row}), flush=True)
        out[str(slots)] = row
    return out


def step_bytes(model) -> tuple[int, int]:
    """What a decode step reads, in bytes: the weights (all but the embedding table, of which it
    reads a row a sequence), and one cached token's keys and values over all layers."""
    cfg, size = model.cfg, model.dtype.itemsize
    weights = sum(p.numel() for n, p in model.named_parameters() if "embed_tokens" not in n) * size
    return weights, 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * size


def _workload(small: bool):
    """The model shape, prompt and response lengths, and the continuous-batching workload."""
    if small:
        shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=1000)
        return shape, dict(plen=16, new=16, cb_slots=4, cb_prompts=16, stop_tokens=40)
    shape = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                 num_key_value_heads=8, vocab_size=128256)
    return shape, dict(plen=128, new=256, cb_slots=64, cb_prompts=512, stop_tokens=1000)


def parallel_main(args, world: int) -> None:
    """``--tp`` / ``--dp``: one GPU (rank 0 alone) against TP × DP, the same prompts, one run."""
    import torch.distributed as dist
    from transformers import LlamaConfig as HFConfig

    from llamarl.lib.distributed import parallel
    from llamarl.lib.model.config import LlamaConfig, ParallelLayout
    from llamarl.lib.engine.generate import Batch, Engine, SamplingParams
    from llamarl.lib.model.llama import ParallelLlamaForCausalLM

    tp = args.tp
    dp = args.dp or world // tp
    if tp * dp != world:
        raise SystemExit(f"--tp {tp} --dp {dp} needs {tp * dp} processes, not {world}: "
                         f"torchrun --nproc-per-node {tp * dp} bench/rollout.py ...")
    shape, w = _workload(args.small)
    chunk = min(args.chunk, w["cb_prompts"]) if not args.small else 4
    prompts_n = args.cb_prompts or (w["cb_prompts"] * 2 if args.small else w["cb_prompts"])
    slots, plen, new = w["cb_slots"], w["plen"], w["new"]
    cfg = LlamaConfig.from_hf(HFConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=False,
                                       rope_theta=500000.0).to_dict())
    topo = parallel.init(1, 1)  # every rank its own TP1 group, for the one-GPU run
    rank, dev = dist.get_rank(), parallel.device()
    cuda = dev.type == "cuda"
    dtype = torch.bfloat16 if cuda else torch.float32
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, shape["vocab_size"], (prompts_n, plen), generator=g).tolist()
    chunks = [Batch(prompts[i:i + chunk], list(range(i, min(i + chunk, prompts_n))), tag=c)
              for c, i in enumerate(range(0, prompts_n, chunk))]
    params = SamplingParams(temperature=1.0, max_new_tokens=new)
    res = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if cuda else "cpu",
           "gpus": world if cuda else 0, "torch": torch.__version__, "backend": dist.get_backend(),
           "prompt_len": plen, "new_tokens": new, "sampling": "temperature 1, top_p 1",
           "parallel": {"tp": tp, "dp": dp, "prompts": prompts_n, "chunk": chunk, "max_batch": slots,
                        "engine": "batch_invariant, one stream over the chunks (as the rollout stage)"}}

    def build(layout_tp: int):
        with torch.device(dev):
            model = ParallelLlamaForCausalLM(cfg, ParallelLayout(tp=layout_tp), dtype=dtype)
        model.init_random(seed=0)
        return model.eval()

    def timed_stream(model, mine: list, active: bool) -> tuple[dict, float, dict]:
        """This rank's chunks through one engine stream, twice (the first captures graphs and
        compiles); the second timed between barriers of all ranks, so the wall is the slowest's."""
        engine = Engine(model, params, max_batch=slots, batch_invariant=True)
        out = {}
        for attempt in range(2):
            dist.barrier()
            t0 = time.perf_counter()
            if active:
                out = {b.tag: [c.tokens for c in comps] for b, comps in engine.stream(mine, seed=1)}
            sync("cuda" if cuda else "cpu")
            dist.barrier()
            wall = time.perf_counter() - t0
        stats = {**engine.stats, "slots": engine.slots} if active else {}
        return out, wall, stats

    def tokens(out: dict) -> int:
        return sum(len(t) for comps in out.values() for t in comps)

    # One GPU: rank 0 runs every chunk, the others wait.
    model = build(1)
    one, wall1, stats1 = timed_stream(model, chunks, rank == 0)
    model = None
    made1 = tokens(one)
    res["one_gpu"] = {"new_tok_s": made1 / wall1, "seconds": wall1, "tokens": made1, "engine": stats1}
    if rank == 0:
        print(json.dumps({"one_gpu": res["one_gpu"]}), flush=True)

    # TP x DP: every rank, chunk c on DP group c mod dp; each TP group's rank 0 counts its tokens.
    topo = parallel.init(tp, 1)
    model = build(tp)
    mine = [b for b in chunks if b.tag % dp == topo.dp_rank]
    out, wall, stats = timed_stream(model, mine, True)
    counted = {k: v for k, v in out.items()} if topo.tp_rank == 0 else {}
    gathered: list = [None] * world
    dist.all_gather_object(gathered, counted)
    if rank == 0:
        merged = {k: v for part in gathered for k, v in part.items()}
        made = tokens(merged)
        seqs = [(a, b) for tag in one for a, b in zip(one[tag], merged.get(tag, []))]
        key = f"tp{tp}_dp{dp}"
        res[key] = {"new_tok_s": made / wall, "seconds": wall, "tokens": made, "engine_rank0": stats,
                    "speedup_over_one_gpu": (made / wall) / (made1 / wall1),
                    "efficiency": (made / wall) / (made1 / wall1) / world,
                    "same_tokens_as_one_gpu": sum(a == b for a, b in seqs) / max(len(seqs), 1)}
        if tp == 1:
            res["dp_speedup"] = res[key]["speedup_over_one_gpu"]
        print(json.dumps(res, indent=1), flush=True)
        _save(res, args.out)
    dist.barrier()
    parallel.shutdown()


def _save(res: dict, path: str | None) -> None:
    """Written after every workload, so a failure later keeps what was measured."""
    if path:
        with open(path, "w") as f:
            f.write(json.dumps(res, indent=1) + "\n")


def _check_fused_sampler(dev, res) -> bool:
    """The sampler's Triton kernel draws what the eager torch code draws (the same hash, the same
    Gumbel perturbation up to float rounding) on Llama-sized rows; its compile (or cache load)
    seconds and each pass's time at 64 and 512 rows."""
    from llamarl.lib.engine.sampling import SamplingParams, sample, sequence_keys

    g = torch.Generator(device=dev).manual_seed(0)
    logits = (torch.randn(512, 128256, device=dev, generator=g) * 2).bfloat16()
    keys, steps = sequence_keys(0, range(512), device=dev), torch.arange(512, device=dev)
    t0 = time.perf_counter()
    a = sample(logits[:64], SamplingParams(), keys[:64], steps[:64], fused=True)
    torch.cuda.synchronize()
    res["sampler_compile_s"] = time.perf_counter() - t0
    b = sample(logits[:64], SamplingParams(), keys[:64], steps[:64], fused=False)
    res["sampler_fused_vs_eager"] = {"same_tokens": int((a[0] == b[0]).sum()), "rows": 64,
                                     "max_logp_diff": float((a[1] - b[1]).abs().max())}
    for rows in (64, 512):
        for fused in (True, False):
            args = (logits[:rows], SamplingParams(), keys[:rows], steps[:rows])
            _, secs = timed(lambda: [sample(*args, fused=fused) for _ in range(20)], dev)
            res[f"sampler_ms_{'fused' if fused else 'eager'}_{rows}_rows"] = secs / 20 * 1e3
    return bool((a[0] == b[0]).float().mean() >= 0.95)


@torch.no_grad()
def _profile(engine, bs, dev) -> dict:
    """The decode step at batch ``bs``: graph replay time, eager time, and the eager step's kernels."""
    from torch.profiler import ProfilerActivity, profile

    from llamarl.lib.model import decode_kernel, layers

    span = engine.max_len
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    out = {"batch": bs, "span": span}
    # The step's graph with decode attention in SDPA (the kernel switched off), with the layers'
    # elementwise work eager (no compiled regions), in the four small regions a layer, then as the
    # engine runs it.
    backbone = engine.model.model
    defaults = {decode_kernel.ENV: os.environ.get(decode_kernel.ENV), layers.FUSED_LAYERS_ENV: os.environ.get(layers.FUSED_LAYERS_ENV)}
    variants = (("graph_step_ms_sdpa", {decode_kernel.ENV: "0"}, None), ("graph_step_ms_eager_layers", {}, False),
                ("graph_step_ms_small_regions", {layers.FUSED_LAYERS_ENV: "0"}, None), ("graph_step_ms", {}, None))
    for key, switches, fused in variants:
        for env, default in defaults.items():
            value = switches.get(env, default)
            if value is None:
                os.environ.pop(env, None)
            else:
                os.environ[env] = value
        backbone.fused = fused
        engine._graphs.pop((bs, span), None)
        engine.step(bs, span)  # capture
        start.record()
        for _ in range(50):
            engine._graphs[(bs, span)].replay()
        end.record()
        sync(dev)
        out[key] = start.elapsed_time(end) / 50
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
