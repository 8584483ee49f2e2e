"""The decode-attention kernel alone against SDPA with the step's mask, at the rollout's shapes
(Llama-3.2-1B: 32 heads, 8 kv heads, head size 64, bf16), over its launch constants:

    python bench/decode_kernel.py --out bench/results/decode_kernel-h200-DATE.json

Each case: ``slots`` slots over a span of ``span`` positions, every slot ``length`` tokens long
(the last decode step of a 128 → 256 rollout: 383), 20 calls captured in one CUDA graph, the
median of 5 replays per call; the bytes of keys and values each reads over the time, against the
device-to-device copy bandwidth measured in the same run.
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import time

import torch
import torch.nn.functional as F

from llamarl.lib.model import decode_kernel


def graph_ms(fn, calls: int = 20) -> float:
    """Per call, ``calls`` calls of ``fn`` captured in one CUDA graph; median of 5 replays."""
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        fn()  # compiles outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def copy_bandwidth() -> float:
    a = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")
    b = torch.empty_like(a)
    ms = graph_ms(lambda: b.copy_(a), calls=5)
    return 2 * a.numel() / (ms / 1e3)


def case(slots: int, span: int, length: int, heads=32, kv=8, d=64) -> dict:
    g = torch.Generator(device="cuda").manual_seed(0)
    keys, values = (torch.randn(slots, kv, span, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    q = torch.randn(slots, heads, d, device="cuda", generator=g, dtype=torch.bfloat16)
    k, v = (torch.randn(slots, kv, d, device="cuda", generator=g, dtype=torch.bfloat16) for _ in range(2))
    lengths = torch.full((slots,), length, device="cuda")
    allowed = torch.arange(span, device="cuda")[None, :] <= lengths[:, None]
    bias = torch.zeros(allowed.shape, dtype=torch.bfloat16, device="cuda").masked_fill_(~allowed, float("-inf"))
    bias = bias[:, None, None, :]
    moved = 2 * slots * kv * (length + 1) * d * 2
    out = {"slots": slots, "span": span, "length": length, "bytes": moved}
    out["sdpa_ms"] = graph_ms(lambda: F.scaled_dot_product_attention(q.view(slots, kv, heads // kv, d), keys, values,
                                                                       attn_mask=bias))
    want = decode_kernel.decode_attention(q, k, v, keys, values, lengths)
    configs = {}
    for chunk, block, warps, stages in itertools.product((64, 128, 256, 512), (32, 64, 128), (2, 4, 8), (2, 3)):
        if block > chunk:
            continue
        decode_kernel.CHUNK, decode_kernel.BLOCK_N, decode_kernel.WARPS, decode_kernel.STAGES = chunk, block, warps, stages
        try:
            got = decode_kernel.decode_attention(q, k, v, keys, values, lengths)
            ok = (got.float() - want.float()).abs().max().item() < 0.05
            configs[f"{chunk}/{block}/{warps}/{stages}"] = graph_ms(
                lambda: decode_kernel.decode_attention(q, k, v, keys, values, lengths)) if ok else "wrong"
        except Exception as e:  # noqa: BLE001 - a launch the device refuses (shared memory) is recorded
            configs[f"{chunk}/{block}/{warps}/{stages}"] = repr(e)[:120]
    out["kernel_ms"] = configs
    timed = {c: t for c, t in configs.items() if isinstance(t, float)}
    best = min(timed, key=timed.get)
    out["best"], out["best_ms"] = best, timed[best]
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out")
    args = ap.parse_args()
    defaults = (decode_kernel.CHUNK, decode_kernel.BLOCK_N, decode_kernel.WARPS, decode_kernel.STAGES)
    res = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name(), "torch": torch.__version__,
           "default": "/".join(map(str, defaults)), "copy_bandwidth_Bps": copy_bandwidth(), "cases": []}
    for slots, length in ((8, 383), (64, 383), (256, 383), (256, 191)):
        r = case(slots, 384, length)
        r["default_ms"] = r["kernel_ms"][res["default"]]
        decode_kernel.CHUNK, decode_kernel.BLOCK_N, decode_kernel.WARPS, decode_kernel.STAGES = defaults
        res["cases"].append(r)
        print(json.dumps({k: v for k, v in r.items() if k != "kernel_ms"}), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
