"""Training step throughput: lib/ against HF transformers, same run, same shape and batch.

    python bench/train_step.py           # Llama-3.2-1B shape, bf16, 8 x 2048 tokens a step, fused AdamW
    python bench/train_step.py --small   # a CPU smoke run

A step = forward, cross-entropy (lib/: vocab-parallel, remove-padding path), backward, AdamW.
Reports tokens/s, MFU (of 989 TFLOP/s, the reference's convention) and peak memory for each.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def flops_per_step(n_params_no_embed: int, layers: int, hidden: int, seq: int, tokens: int) -> float:
    return 6 * n_params_no_embed * tokens + 12 * layers * hidden * seq * tokens / 2  # causal attention


def timed(step, n, dev) -> float:
    for _ in range(2):
        step()
    if dev == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    for _ in range(n):
        step()
    if dev == "cuda":
        torch.cuda.synchronize()
    return (time.perf_counter() - t) / n


def _measure_lib(hf_cfg, shape, ids, dtype, fused, dev, seq, tokens, n):
    """lib/'s step, in its own scope so its model and optimizer are freed before HF's."""
    from llamarl.lib import vocab_parallel
    from llamarl.lib.config import LlamaConfig, ParallelLayout
    from llamarl.lib.model import ParallelLlamaForCausalLM

    with torch.device(dev):
        ours = ParallelLlamaForCausalLM(LlamaConfig.from_hf(hf_cfg.to_dict()), ParallelLayout(), dtype=dtype)
    ours.init_random(seed=0)
    opt = torch.optim.AdamW(ours.parameters(), lr=1e-5, **fused)
    batch = ours.make_batch(ids)
    labels = batch.flat(torch.roll(ids, -1, 1))

    def step():
        vocab_parallel.cross_entropy(ours(batch), labels).mean().backward()
        opt.step()
        opt.zero_grad(set_to_none=True)

    no_embed = sum(p.numel() for p in ours.parameters()) - shape["vocab_size"] * shape["hidden_size"]
    flops = flops_per_step(no_embed, shape["num_hidden_layers"], shape["hidden_size"], seq, tokens)
    dt = timed(step, n, dev)
    return flops, {"llamarl_tok_s": tokens / dt, "llamarl_mfu": flops / dt / 989e12,
                   "llamarl_peak_gb": torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda" else None}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

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
        batch, seq, n = 8, 2048, 10
    hf_cfg = HFConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=False, rope_theta=500000.0)
    hf_cfg._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    fused = {"fused": True} if dev == "cuda" else {}
    tokens = batch * seq
    res = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "torch": torch.__version__, "tokens_per_step": tokens, "dtype": str(dtype)}
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), device=dev)

    parallel.init(1, 1)
    flops, lib = _measure_lib(hf_cfg, shape, ids, dtype, fused, dev, seq, tokens, n)
    res.update(lib)
    if dev == "cuda":
        torch.cuda.empty_cache()

    torch.manual_seed(0)
    with torch.device(dev):
        hf = LlamaForCausalLM(hf_cfg).to(dtype)
    hopt = torch.optim.AdamW(hf.parameters(), lr=1e-5, **fused)

    def hf_step():
        hf(input_ids=ids, labels=ids).loss.backward()
        hopt.step()
        hopt.zero_grad(set_to_none=True)

    dt = timed(hf_step, n, dev)
    res.update(hf_tok_s=tokens / dt, hf_mfu=flops / dt / 989e12,
               hf_peak_gb=torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda" else None)
    res["ratio_llamarl_over_hf"] = res["llamarl_tok_s"] / res["hf_tok_s"]
    parallel.shutdown()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
