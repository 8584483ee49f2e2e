"""The ppo stage's forward-only pass (``ppo_trainer.token_outputs``: the reference's or π_old's
log-probs) at the 1B shape over micro-batch budgets: 1024 samples of 128 prompt + 64–256 response
tokens (293 k tokens), random bf16 weights, one GPU. Prints one line a budget: micro-batches,
seconds, TFLOP/s (2 · 1.236 G matmul parameters a token), peak GPU memory (weights included).

    source bench/gpu_env.sh && python bench/frozen_pass.py
"""

import os
import random
import time

import torch
from transformers import LlamaConfig as HFConfig

os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29555")
from llamarl.lib.distributed import parallel  # noqa: E402
from llamarl.lib.model.config import LlamaConfig, ParallelLayout  # noqa: E402
from llamarl.lib.model.llama import ParallelLlamaForCausalLM  # noqa: E402
from llamarl.stages.ppo_data import Sample, micro_batches  # noqa: E402
from llamarl.stages.ppo_trainer import token_outputs  # noqa: E402

parallel.init(1, 1)
shape = dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
             num_key_value_heads=8, vocab_size=128256)
hf_cfg = HFConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=False, rope_theta=500000.0)
with torch.device("cuda"):
    model = ParallelLlamaForCausalLM(LlamaConfig.from_hf(hf_cfg.to_dict()), ParallelLayout(), dtype=torch.bfloat16)
model.init_random(seed=0)
rng = random.Random(0)
lens = [rng.randint(64, 256) for _ in range(1024)]
samples = [Sample(ids=[rng.randrange(3, 128000) for _ in range(128 + n)], prompt_len=128, rollout_logp=[0.0] * n,
                  score=0.0, group=str(i // 4)) for i, n in enumerate(lens)]
tokens = sum(len(s.ids) for s in samples)
for budget in (4096, 8192, 16384, 32768):
    groups = micro_batches(list(range(len(samples))), samples, budget)
    token_outputs(model, samples, groups[:3], 1.0)
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t = time.perf_counter()
    out = token_outputs(model, samples, groups, 1.0)
    torch.cuda.synchronize()
    dt = time.perf_counter() - t
    flops = 2 * 1.236e9 * tokens
    print({"budget": budget, "micro_batches": len(groups), "tokens": tokens, "s": round(dt, 3),
           "tflops": round(flops / dt / 1e12, 1), "peak_gb": round(torch.cuda.max_memory_allocated() / 1e9, 2)}, flush=True)
