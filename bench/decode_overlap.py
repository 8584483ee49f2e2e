"""Would the decode step be faster with its slots in two halves, one per CUDA stream? A probe of a
design (docs/generation.md, "What is left at 256 slots"): each half's memory-bound attention could
run beside the other half's compute-bound matmuls.

    python bench/decode_overlap.py --out bench/results/decode_overlap-h200-DATE.json   # 1B shape, bf16
    python bench/decode_overlap.py --small                                               # a CPU smoke run

The engine (lib/engine) generates once for ``--slots`` prompts (128 → 256 tokens, as
bench/rollout.py's fixed workload) to fill its cache with real keys and values; then every slot is
set to ``--lengths`` cached tokens in turn and three forms of one decode step (the model's forward
and the sampler's draw, not the engine's bookkeeping) are timed as CUDA graphs, 50 replays each:

* ``whole``: all slots in one forward, as the engine runs them;
* ``halves_one_stream``: the two halves one after the other (what splitting alone costs);
* ``halves_two_streams``: the second half on its own stream, forked and joined inside the graph.

Each form's draws are compared with ``whole``'s: the same tokens, and the largest log-prob
difference (a half's matmuls have other row counts, so their bits may differ: the engine's batch
invariance, docs/generation.md, would need the halves fixed). With each length, the bandwidth
bound of that step (weights once, every slot's keys and values) over the copy bandwidth measured
in the same run. On CPU (``--small``) the forms run eagerly, one stream.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/rollout.py, even under PYTHONSAFEPATH
from rollout import _workload, copy_bandwidth, step_bytes, sync  # noqa: E402


def draw(engine, lo: int, hi: int, span: int, out_tok: torch.Tensor, out_logp: torch.Tensor) -> None:
    """Slots ``lo:hi``'s forward and draw over ``span`` positions, into ``out_*[lo:hi]``."""
    from llamarl.lib.engine.slots import _Step
    from llamarl.lib.model.attention import Decode, KVCache

    cache = KVCache({i: t[lo:hi] for i, t in engine.cache.k.items()}, {i: t[lo:hi] for i, t in engine.cache.v.items()})
    lengths = engine.lengths[lo:hi]
    logits = engine.model(_Step(engine.tokens[lo:hi], lengths, Decode(cache, lengths, span)))
    tok, logp = engine._sample(logits, engine.keys[lo:hi], engine.made[lo:hi])
    out_tok[lo:hi].copy_(tok)
    out_logp[lo:hi].copy_(logp)


def forms(engine, slots: int, span: int, out_tok, out_logp) -> dict:
    half = slots // 2
    side = torch.cuda.Stream() if engine.device.type == "cuda" else None

    def whole():
        draw(engine, 0, slots, span, out_tok, out_logp)

    def halves_one_stream():
        draw(engine, 0, half, span, out_tok, out_logp)
        draw(engine, half, slots, span, out_tok, out_logp)

    def halves_two_streams():
        if side is None:
            return halves_one_stream()
        side.wait_stream(torch.cuda.current_stream())
        draw(engine, 0, half, span, out_tok, out_logp)
        with torch.cuda.stream(side):
            draw(engine, half, slots, span, out_tok, out_logp)
        torch.cuda.current_stream().wait_stream(side)

    return {"whole": whole, "halves_one_stream": halves_one_stream, "halves_two_streams": halves_two_streams}


def timed_ms(fn, dev: str, replays: int = 50) -> float:
    """ms per call: a CUDA graph's replays on CUDA (captured after an eager warm-up), the host clock on CPU."""
    fn()
    sync(dev)
    if dev != "cuda":
        t = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - t) / 3 * 1e3
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, capture_error_mode="thread_local"):
        fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    sync(dev)
    return start.elapsed_time(end) / replays


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true")
    ap.add_argument("--slots", type=int, default=256)
    ap.add_argument("--lengths", default="256,383", help="cached tokens of every slot, one measurement each")
    ap.add_argument("--out")
    args = ap.parse_args()
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29545")
    from transformers import LlamaConfig as HFConfig

    from llamarl.lib.distributed import parallel
    from llamarl.lib.engine.generate import Engine, SamplingParams
    from llamarl.lib.model.config import LlamaConfig, ParallelLayout
    from llamarl.lib.model.llama import ParallelLlamaForCausalLM

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    shape, w = _workload(args.small)
    slots = 8 if args.small else args.slots
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    hf_cfg = HFConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=False, rope_theta=500000.0)
    parallel.init(1, 1)
    with torch.device(dev):
        model = ParallelLlamaForCausalLM(LlamaConfig.from_hf(hf_cfg.to_dict()), ParallelLayout(), dtype=dtype)
    model.init_random(seed=0)
    torch.manual_seed(0)
    prompts = torch.randint(3, shape["vocab_size"], (slots, w["plen"]), device=dev).tolist()
    engine = Engine(model, SamplingParams(temperature=1.0, max_new_tokens=w["new"]), max_batch=slots)
    engine.generate(prompts, seed=1)  # the cache filled, the regions and the sampler compiled
    span = engine.max_len
    weight_bytes, kv_token_bytes = step_bytes(model)
    bw = copy_bandwidth(dev)
    res = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
           "torch": torch.__version__, "slots": slots, "span": span, "copy_bandwidth_Bps": bw, "lengths": {}}
    out_tok = torch.zeros(slots, dtype=torch.long, device=dev)
    out_logp = torch.zeros(slots, dtype=torch.float32, device=dev)
    with torch.no_grad():
        for length in [min(int(x), span - 1) for x in args.lengths.split(",")] if not args.small else [w["plen"]]:
            engine.lengths.fill_(length)
            engine.made.fill_(length - w["plen"])
            row = {"bandwidth_bound_ms": (weight_bytes + slots * (length + 1) * kv_token_bytes) / bw * 1e3 if bw else None}
            ref = None
            for name, fn in forms(engine, slots, span, out_tok, out_logp).items():
                ms = timed_ms(fn, dev)
                got = (out_tok.clone(), out_logp.clone())
                if ref is None:  # ``whole``, the first form
                    ref = got
                row[name] = {"step_ms": ms, "same_tokens": bool(torch.equal(got[0], ref[0])),
                             "max_logp_diff": float((got[1] - ref[1]).abs().max())}
                if bw:
                    row[name]["fraction_of_bound"] = row["bandwidth_bound_ms"] / ms
            res["lengths"][length] = row
            print(length, json.dumps(row), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
