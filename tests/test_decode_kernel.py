"""lib.model.decode_kernel: split-KV decode attention against SDPA in fp64, in Triton's interpreter
on CPU and on CUDA; a slot's bits independent of the span and of the slots beside it; the engine
with the kernel draws what it draws with SDPA; where the kernel runs."""

import os

import pytest
import torch
import torch.nn.functional as F

import tiny
from distpool import interpreter_pool, triton_available
from llamarl.lib.distributed import parallel
from llamarl.lib.engine.generate import Engine, SamplingParams
from llamarl.lib.model import decode_kernel
from llamarl.lib.model.config import ParallelLayout
from llamarl.lib.model.llama import ParallelLlamaForCausalLM

needs_triton = pytest.mark.skipif(not triton_available(), reason="needs triton (a dev dependency) for its interpreter")
C = decode_kernel.CHUNK


def reference(q, keys, values, lengths) -> torch.Tensor:
    """SDPA in fp64 over each slot's positions ``0 .. lengths[i]``."""
    b, heads, d = q.shape
    kv, span = keys.shape[1], keys.shape[2]
    allowed = torch.arange(span, device=q.device)[None, :] <= lengths[:, None]
    bias = torch.zeros(allowed.shape, dtype=torch.float64, device=q.device).masked_fill_(~allowed, float("-inf"))
    out = F.scaled_dot_product_attention(q.double().view(b, kv, heads // kv, d), keys.double(), values.double(),
                                         attn_mask=bias[:, None, None, :])
    return out.reshape(b, heads, d)


def _case(g, b, heads, kv, d, span, lengths, room, dtype, device):
    """A cache ``room`` positions longer than ``span`` (the kernel reads a strided view), NaN from
    each slot's length on (where its new key and value go, and past it), and the new keys and values."""
    cache = torch.randn(2, b, kv, span + room, d, generator=g).to(device, dtype)
    for i, n in enumerate(lengths):
        cache[:, i, :, n:] = float("nan")
    q, k, v = (torch.randn(b, h, d, generator=g).to(device, dtype) for h in (heads, kv, kv))
    return q, k, v, cache[0, :, :, :span], cache[1, :, :, :span], torch.tensor(lengths, device=device)


# (slots, heads, kv heads, head size, span, lengths, positions past the span). GQA groups 4, 3, 8
# (padded to 16 rows) and 1; lengths on chunk edges; a span that is no multiple of the chunk, over
# a cache that ends there; a free slot's length past the span (it attends over the span).
CASES = ((4, 8, 2, 16, 3 * C, [0, C - 1, C, 3 * C - 1], 64),
         (3, 9, 3, 64, C, [5, C - 1, 1], 64),
         (3, 8, 1, 128, C + 64, [C + 63, 3 * C, C], 0),
         (2, 4, 4, 32, 64, [63, 17], 0))


def kernel_against_reference(device: str = "cpu") -> dict:
    """Worst errors against fp64 SDPA, whether the new keys and values were stored, and whether a
    slot's output changed bits with the span or with the slots beside it."""
    g = torch.Generator().manual_seed(0)
    out = {"ran_kernel": None, "errors": {}, "stored": True, "invariant": True}
    for dtype in (torch.bfloat16, torch.float32) if device == "cpu" else (torch.bfloat16, torch.float16):
        for b, heads, kv, d, span, lengths, room in CASES:
            q, k, v, keys, values, lengths_t = _case(g, b, heads, kv, d, span, lengths, room, dtype, device)
            out["ran_kernel"] = decode_kernel.wanted(keys)
            got = decode_kernel.decode_attention(q, k, v, keys, values, lengths_t)
            live = lengths_t < span
            slots = torch.arange(b, device=device)[live]
            out["stored"] &= (torch.equal(keys[slots, :, lengths_t[live]], k[live])
                              and torch.equal(values[slots, :, lengths_t[live]], v[live]))
            keys0, values0 = keys.nan_to_num(), values.nan_to_num()
            want = reference(q, keys0, values0, lengths_t)
            # A rounding of the output, and on a GPU of each probability before the value product;
            # fp32's sums over hundreds of positions err by a few roundings more.
            allowed = (16 if dtype == torch.float32 else 1) * torch.finfo(dtype).eps * (
                want.abs() + reference(q, keys0, values0.abs(), lengths_t))
            out["errors"][f"{dtype}-{heads}/{kv}x{d}-span{span}"] = float(((got.double() - want).abs() / allowed).max())
            if room:  # the same slots over a longer span
                longer = decode_kernel.decode_attention(q, k, v, *_wider(keys, values, C), lengths_t)
                out["invariant"] &= torch.equal(got, longer)
            alone = decode_kernel.decode_attention(q[1:2], k[1:2], v[1:2], keys[1:2], values[1:2], lengths_t[1:2])
            out["invariant"] &= torch.equal(got[1:2], alone)
    return out


def _wider(keys, values, extra):
    """The same slots over a span ``extra`` positions longer (NaN there, as past any length)."""
    pad = torch.full(keys.shape[:2] + (extra,) + keys.shape[3:], float("nan"), dtype=keys.dtype, device=keys.device)
    return torch.cat([keys, pad], dim=2), torch.cat([values, pad], dim=2)


def _check(out: dict, kernel: bool) -> None:
    assert out["ran_kernel"] is kernel
    assert out["stored"], "the new keys and values are not where the next step reads them"
    assert out["invariant"], "a slot's output depends on the span or on the other slots"
    for case, worst in out["errors"].items():
        assert worst <= 1.0, (case, worst)


@needs_triton
def test_the_kernel_is_sdpa_over_each_slots_own_length(monkeypatch):
    monkeypatch.setenv(decode_kernel.ENV, "1")  # the pool's processes inherit it: the interpreter runs the kernel
    with interpreter_pool(1) as pool:
        (out,) = pool.run(kernel_against_reference)
    _check(out, kernel=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_the_kernel_is_sdpa_over_each_slots_own_length_on_cuda(monkeypatch):
    monkeypatch.delenv(decode_kernel.ENV, raising=False)
    _check(kernel_against_reference("cuda"), kernel=True)


def engine_responses(kernel: bool) -> list:
    """Sampled responses of a tiny model (fp32), random stops, slots refilled and compacted."""
    os.environ[decode_kernel.ENV] = "1" if kernel else "0"
    parallel.init(1, 1)
    hf = tiny.hf_model()
    model = ParallelLlamaForCausalLM(tiny.our_config(hf), ParallelLayout(tp=1))
    model.load_hf_state_dict(hf.state_dict())
    calls, run = [], decode_kernel.decode_attention
    decode_kernel.decode_attention = lambda *a: calls.append(1) or run(*a)
    prompts = [[5, 17, 33, 9], [101, 7], [44, 45, 46, 47, 48, 49, 50, 51, 52]]
    params = SamplingParams(temperature=1.0, max_new_tokens=6, stop_token_ids=tuple(range(40, 70)))
    out = Engine(model, params, max_batch=4).generate(prompts, seed=3, samples_per_prompt=2)
    return len(calls), [(c.tokens, c.logprobs) for c in out]


@needs_triton
def test_the_engine_draws_with_the_kernel_what_it_draws_with_sdpa():
    with interpreter_pool(1) as pool:
        ((calls, kernel),), ((no_calls, sdpa),) = pool.run(engine_responses, True), pool.run(engine_responses, False)
    assert calls and not no_calls
    assert [t for t, _ in kernel] == [t for t, _ in sdpa]
    worst = max(abs(x - y) for (_, a), (_, b) in zip(kernel, sdpa) for x, y in zip(a, b))
    assert worst < 1e-5, worst


def test_the_kernel_runs_on_cuda_for_half_caches_and_in_the_interpreter_only_when_asked(monkeypatch):
    monkeypatch.setattr(decode_kernel, "_kernels", lambda: object())  # as if Triton imported
    meta = {"device": "meta"}

    def cache(dtype=torch.bfloat16, d=64, device="cuda"):
        t = torch.empty(2, 8, 128, d, dtype=dtype, **meta)
        return type("Cache", (), {"shape": t.shape, "dtype": dtype, "device": torch.device(device),
                                  "stride": t.stride})()

    monkeypatch.delenv(decode_kernel.ENV, raising=False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert decode_kernel.wanted(cache()) and decode_kernel.wanted(cache(torch.float16))
    assert not decode_kernel.wanted(cache(torch.float32))  # tl.dot would round fp32 to tf32
    assert not decode_kernel.wanted(cache(d=48))  # tl.arange takes powers of two
    assert not decode_kernel.wanted(cache(device="cpu"))
    monkeypatch.setenv(decode_kernel.ENV, "1")
    assert decode_kernel.wanted(cache(torch.float32, device="cpu"))
    monkeypatch.setenv(decode_kernel.ENV, "0")
    assert not decode_kernel.wanted(cache())
    monkeypatch.setattr(decode_kernel, "_kernels", lambda: None)  # no Triton: SDPA
    monkeypatch.delenv(decode_kernel.ENV)
    assert not decode_kernel.wanted(cache())
    monkeypatch.setenv(decode_kernel.ENV, "yes")
    with pytest.raises(ValueError, match="LLAMARL_FUSED_DECODE='yes': use auto, 0 or 1"):
        decode_kernel.wanted(cache())
