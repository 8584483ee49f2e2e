"""Generation throughput: lib/'s engine against HF generate (static cache, compiled), same run.

    python bench/rollout.py            # Llama-3.2-1B shape, bf16, 64 prompts x 128 -> 256 new tokens
    python bench/rollout.py --small    # a CPU smoke run

Both sample (temperature 1, top_p 1) exactly ``new`` tokens per prompt from the same random
weights. Prints one JSON object with new tokens/s for each and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    args = ap.parse_args()
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29544")
    from llamarl.lib import parallel
    from llamarl.lib.config import LlamaConfig, ParallelLayout
    from llamarl.lib.generate import SamplingParams, generate
    from llamarl.lib.model import ParallelLlamaForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    if args.small:
        shape = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=1000)
        bs, plen, new = 8, 16, 16
    else:
        shape = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256)
        bs, plen, new = 64, 128, 256
    hf_cfg = HFConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=False, rope_theta=500000.0)
    hf_cfg._attn_implementation = "sdpa"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    res = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "torch": torch.__version__, "batch": bs, "prompt_len": plen, "new_tokens": new}
    torch.manual_seed(0)
    prompts = torch.randint(3, shape["vocab_size"], (bs, plen), device=dev)

    parallel.init(1, 1)
    with torch.device(dev):
        ours = ParallelLlamaForCausalLM(LlamaConfig.from_hf(hf_cfg.to_dict()), ParallelLayout(), dtype=dtype)
    ours.init_random(seed=0)
    params = SamplingParams(temperature=1.0, max_new_tokens=new, stop_token_ids=())
    gen = torch.Generator(device=dev).manual_seed(0)
    lists = prompts.tolist()
    generate(ours, lists, SamplingParams(temperature=1.0, max_new_tokens=4), gen)  # warm-up
    if dev == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    out = generate(ours, lists, params, gen, max_batch=bs)
    if dev == "cuda":
        torch.cuda.synchronize()
    res["llamarl_new_tok_s"] = sum(len(c.tokens) for c in out) / (time.perf_counter() - t)
    del ours
    if dev == "cuda":
        torch.cuda.empty_cache()

    with torch.device(dev):
        hf = LlamaForCausalLM(hf_cfg).to(dtype).eval()
    kw = dict(max_new_tokens=new, min_new_tokens=new, do_sample=True, top_p=1.0, pad_token_id=0)
    with torch.no_grad():
        impl = {"cache_implementation": "static"} if dev == "cuda" else {}
        hf.generate(prompts, **impl, **kw)  # compiles on the first call with a static cache
        hf.generate(prompts, **impl, **kw)
        if dev == "cuda":
            torch.cuda.synchronize()
        t = time.perf_counter()
        hf.generate(prompts, **impl, **kw)
        if dev == "cuda":
            torch.cuda.synchronize()
    res["hf_static_new_tok_s" if dev == "cuda" else "hf_new_tok_s"] = bs * new / (time.perf_counter() - t)
    res["ratio_llamarl_over_hf"] = res["llamarl_new_tok_s"] / res.get("hf_static_new_tok_s", res.get("hf_new_tok_s"))
    parallel.shutdown()
    print(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
