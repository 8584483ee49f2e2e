"""Training step throughput: lib/ against HF transformers, same run, same shape and batch.

    python bench/train_step.py           # Llama-3.2-1B shape, bf16, 8 x 2048 tokens a step, fused AdamW
    python bench/train_step.py --small   # a CPU smoke run
    python bench/train_step.py --ablate --profile DIR --out FILE
    python bench/train_step.py --ppo --out FILE    # and the ppo stage's update on the same tokens

A step = forward, cross-entropy (lib/: vocab-parallel, remove-padding path), backward, AdamW.
Reports tokens/s, MFU (of 989 TFLOP/s, the reference's convention) and peak memory for each
variant: ``llamarl`` (lib/ as it runs by default: fused regions and Triton vocabulary kernels on
CUDA), ``llamarl-eager`` (``--ablate``: the same with ``LLAMARL_FUSED=0``, the unfused reference
path), ``hf``. Step times are CUDA-event times per step, the median of ``--steps``.

``--ppo``: the ppo stage's update on the same model shape, one optimizer step each, through the
stage's own code: the actor built as ``stages/ppo.py`` builds it (its compute dtype, TP 1, remove
padding), a ``stages.ppo_trainer.Trainer`` (``GradBuffer``: fp32 ``main_grad``; ``ShardedAdamW``:
fp32 masters and moments), samples (``stages.ppo_data.Sample``: 128-token prompts, random ids,
rollout and reference log-probs, scores in groups of 4) turned into the loss inputs by
``ppo_data.advantages`` (grpo with a KL loss, β 0.05, as bench/e2e.py's grpo workload), and each
step is ``ppo_trainer.train_step`` on ``ppo_data.mini_batch``'s order: padding and micro-batches
by ``micro_batch_tokens``, log-prob + entropy through ``lib.vocab_parallel``, the policy and KL
losses through ``lib.rl``, fp32 gradient accumulation, the global-norm clip, the AdamW step on the
masters and their copy into the bf16 weights, the step's metrics read back. Cases (``--ppo-cases``):
``ppo`` (8 × 2048, the stage's default ``micro_batch_tokens`` 4096: 4 micro-batches), ``ppo-mb8k``
(the same in 2 micro-batches of 8192), ``ppo-1mb`` (in one micro-batch of 16384) and ``ppo-ragged``
(16 sequences of 512–1536 tokens, 16384 in all, micro-batches of 4096). Tokens/s counts every token through forward and backward (the
stage's ``update_tokens``); ``ratio_<case>_over_llamarl`` is the issue-16 goal (≥ 0.8).

``--env-variant NAME:VAR=VAL[,VAR=VAL][@VARIANT+VARIANT]`` (repeatable): lib/'s variants again
(``llamarl`` and the ppo cases, or those named after ``@``) with these environment variables set,
as ``NAME/llamarl``, ``NAME/ppo``, … — ablations of the fusion switches (``LLAMARL_FUSED_WGRAD``,
``LLAMARL_FUSED_LAYERS``) in the same run; ``ratio_NAME/CASE_over_NAME/llamarl`` divides by the raw
step of the same environment, ``ratio_NAME/CASE_over_llamarl`` (where that did not run) by the
default one. The JSON is rewritten after every variant.

Several GPUs (the 8B goals), under torchrun, one process per GPU, ``tp × pp`` processes::

    torchrun --nproc-per-node 2 bench/train_step.py --shape 8b --tp 2 [--sp] --out FILE
    torchrun --nproc-per-node 2 bench/train_step.py --shape 8b --pp 2 [--micro-batches 8] --out FILE
    torchrun --nproc-per-node 2 bench/train_step.py --small --pp 2      # CPU smoke run, gloo

``--shape 8b`` is Llama-3.1-8B (hidden 4096, 32 layers, 32 / 8 heads, ffn 14336, vocab 128256). The
step is lib/'s (``llamarl`` only: HF has no TP/PP step to compare): the 8 × 2048 tokens in
``--micro-batches`` micro-batches (default: one sequence each at PP > 1 or at 8B, else one) through
``lib.schedule.forward_backward`` (1F1B over the stages), vocab-parallel cross-entropy, torch's
AdamW on each rank's shards. Reported: tokens/s, MFU per GPU (the step's FLOPs over ``tp × pp``
GPUs), each rank's peak memory, and with PP the bubble — its 1F1B share ``(pp − 1) / (m + pp − 1)``
and, on CUDA, measured from a trace of two steps on every rank: the share of the step during which
the rank runs no compute kernel (NCCL kernels, which spin while a peer is not ready, and idle
gaps count; host gaps too).

``--host-profile``: a cProfile of two steps of each lib/ variant (top functions by own and
cumulative time). Every variant records torch._dynamo's counters over its build and steps
(compiles, recompiles, graph breaks). ``--skip-hf`` leaves HF out (profiling runs).

``--profile DIR``: after timing, a ``torch.profiler`` trace of two steps of each variant, summed
per kernel category (matmul, attention forward / backward, elementwise, cross-entropy, optimizer,
embedding, memcpy, idle) into ``DIR/profile.md`` and ``DIR/profile.json``. The ppo cases add
their own categories, from ``record_function`` scopes put around the trainer's pieces for the
profiled steps only (the timed steps run unwrapped): gradient accumulation into the fp32 buffer
(autograd's AccumulateGrad), gradient zero / norm / clip, the masters' copy into the bf16 weights,
the RL loss arithmetic (forward), and the batches' building and host → device copies.
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


def flops_of(n_params_no_embed: int, layers: int, hidden: int, lengths: list[int]) -> float:
    """``flops_per_step`` for sequences of any ``lengths`` (attention grows with each one's square)."""
    return 6 * n_params_no_embed * sum(lengths) + 12 * layers * hidden * sum(n * n for n in lengths) / 2


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


_READERS: dict = {}


def random_weights(cfg):
    """``init_random(seed=0)``'s weights, drawn once per process and kept (on the host) for every
    variant after the first: drawing 1.5 B numbers costs seconds a variant."""
    from llamarl.lib.model import hf_mapping

    key = repr(cfg)
    if key not in _READERS:
        _READERS[key] = hf_mapping.random_reader(cfg, 0)
    return _READERS[key]


def build_lib(hf_cfg, ids, dtype, fused, dev):
    """lib/'s model, optimizer and step (cross-entropy through ``lib.vocab_parallel``)."""
    from llamarl.lib.model import vocab_parallel
    from llamarl.lib.model.config import LlamaConfig, ParallelLayout
    from llamarl.lib.model.llama import ParallelLlamaForCausalLM

    with torch.device(dev):
        model = ParallelLlamaForCausalLM(LlamaConfig.from_hf(hf_cfg.to_dict()), ParallelLayout(), dtype=dtype)
    model.load_hf(random_weights(model.cfg))
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


# ---- the ppo stage's update -------------------------------------------------------------------

PPO_CASES = ("ppo", "ppo-mb8k", "ppo-1mb", "ppo-ragged")


def ppo_lengths(case: str, batch: int, seq: int) -> list[int]:
    """Sequence lengths of a case: ``batch`` × ``seq``, or twice as many ragged ones from seq/4 to
    3·seq/4 (evenly spread, shuffled: the same number of tokens)."""
    if case != "ppo-ragged":
        return [seq] * batch
    n = 2 * batch
    lengths = [seq // 4 + round((seq // 2) * i / (n - 1)) for i in range(n)]
    order = torch.randperm(n, generator=torch.Generator().manual_seed(0)).tolist()
    return [lengths[i] for i in order]


def build_ppo(hf_cfg, case, lengths, micro_batch_tokens, dev):
    """The ppo stage's actor and trainer, samples of ``lengths`` and their loss inputs; the step is
    one ``ppo_trainer.train_step`` (one optimizer step on the whole mini-batch)."""
    from llamarl.lib.distributed import parallel
    from llamarl.lib.model.config import LlamaConfig, ParallelLayout, compute_dtype
    from llamarl.lib.model.llama import ParallelLlamaForCausalLM
    from llamarl.lib.runtime import job
    from llamarl.stages import contract
    from llamarl.stages.config import PPOConfig
    from llamarl.stages.ppo_data import Sample, advantages, check_groups, mini_batch
    from llamarl.stages.ppo_batches import StepBatches
    from llamarl.stages.ppo_trainer import Trainer, train_step

    n = len(lengths)
    cfg = PPOConfig(rollout="memory://bench/rollout", scores="memory://bench/scores", actor="memory://bench/actor",
                    out="memory://bench/out",
                    advantage="grpo", use_kl_loss=True, kl_coef=0.05, mini_batch_size=n,
                    micro_batch_tokens=micro_batch_tokens, seed=0)
    # As stages/ppo.py builds it.
    dtype = compute_dtype(cfg.dtype, parallel.device())
    model_cfg = LlamaConfig.from_hf(hf_cfg.to_dict())
    layout = ParallelLayout(tp=cfg.tp, pp=cfg.pp, sequence_parallel=cfg.sequence_parallel, remove_padding=True)
    layout.check(model_cfg)
    with torch.device(dev):
        actor = ParallelLlamaForCausalLM(model_cfg, layout, dtype=dtype)
    actor.load_hf(random_weights(model_cfg))
    trainers = {contract.ACTOR: Trainer(actor, cfg.actor_lr, cfg, None, None, 0)}

    g = torch.Generator().manual_seed(1)
    prompt_len = min(128, min(lengths) // 4)
    per_group = 4 if n >= 8 else 2
    samples = []
    for i, length in enumerate(lengths):
        ids = torch.randint(3, model_cfg.vocab_size, (length,), generator=g).tolist()
        logp = (-3 * torch.rand(length - prompt_len, generator=g)).tolist()
        samples.append(Sample(ids, prompt_len, logp, float(torch.rand((), generator=g)), str(i // per_group)))
    check_groups(cfg, samples)
    ref_logp = {i: [x - 0.01 for x in s.rollout_logp] for i, s in enumerate(samples)}
    data = advantages(cfg, samples, ref_logp, None, dev)
    counter, metrics, losses = [0], [], []
    batches = StepBatches(cfg, actor, samples, data, dev)

    launched = []
    read_now = os.environ.get("BENCH_PPO_READ") == "now"  # each step read before the next is launched

    def read():
        for r in launched:
            metrics.append(r.result())
            losses.append(torch.tensor(metrics[-1]["policy_loss"]))
        launched.clear()

    def step():  # as stages/ppo.py's loop: a step is read once the next is launched
        k = counter[0]
        _, batch_idx = mini_batch(cfg, len(samples), k)
        r = train_step(cfg, trainers, samples, data, batch_idx, k, dev, batches=batches,
                       next_idx=mini_batch(cfg, len(samples), k + 1)[1])
        read()
        launched.append(r)
        if counter[0] == 0 or read_now:
            read()
        if counter[0] == 0:
            job.freeze_heap()  # as stages/ppo.py after its first step
        counter[0] += 1

    step.read = read
    step.ppo = {"trainer": trainers[contract.ACTOR], "actor": actor, "metrics": metrics,
                "config": {"advantage": cfg.advantage, "use_kl_loss": cfg.use_kl_loss, "loss_agg": cfg.loss_agg,
                           "micro_batch_tokens": cfg.micro_batch_tokens, "grad_clip": cfg.grad_clip,
                           "dtype": str(dtype), "prompt_len": prompt_len, "sequences": n,
                           "lengths": lengths}}
    return actor, step, losses


@contextlib.contextmanager
def ppo_scopes(step):
    """``record_function`` scopes around the ppo trainer's pieces, for a profile: instance and module
    attributes swapped for wrappers of the same callables, put back after."""
    from llamarl.lib.rl import core as rl
    import llamarl.stages.ppo_batches as pb

    info = getattr(step, "ppo", None)
    if info is None:
        yield
        return

    def scoped(name, fn):
        def inner(*a, **kw):
            with record_function(name):
                return fn(*a, **kw)
        return inner

    t = info["trainer"]
    swaps = [(t.grads, "zero", "ppo.grads"), (t.grads, "clip_factor", "ppo.grads"), (t.grads, "reduce", "ppo.grads"),
             (t.opt, "step", "ppo.opt_step"), (pb, "step_batches", "ppo.batches"),
             (rl, "policy_loss", "ppo.rl_loss"), (rl, "kl_estimate", "ppo.rl_loss"), (rl, "aggregate", "ppo.rl_loss")]
    saved = []
    for obj, attr, name in swaps:
        saved.append((obj, attr, obj.__dict__.get(attr, _MISSING)))  # an instance's own, or a module's
        setattr(obj, attr, scoped(name, getattr(obj, attr)))
    try:
        yield
    finally:
        for obj, attr, old in reversed(saved):
            if old is _MISSING:
                delattr(obj, attr)  # back to the class's method
            else:
                setattr(obj, attr, old)


_MISSING = object()


def _dynamo_counters() -> dict:
    try:
        from torch._dynamo.utils import counters
    except ImportError:
        return {}
    return {k: dict(v) for k, v in counters.items()}


def _counters_delta(before: dict, after: dict) -> dict:
    out = {}
    for k, v in after.items():
        d = {kk: vv - before.get(k, {}).get(kk, 0) for kk, vv in v.items() if isinstance(vv, (int, float))}
        d = {kk: vv for kk, vv in d.items() if vv}
        if d:
            out[k] = d
    return out


def host_profile(step, dev, steps=2, top=25) -> dict:
    """cProfile of ``steps`` steps (synchronized at the end): where the host's time goes."""
    import cProfile
    import io
    import pstats

    prof = cProfile.Profile()
    t = time.perf_counter()
    prof.enable()
    for _ in range(steps):
        step()
    if dev == "cuda":
        torch.cuda.synchronize()
    prof.disable()
    wall = time.perf_counter() - t
    out = {"steps": steps, "wall_s_per_step": wall / steps}
    for key in ("tottime", "cumulative"):
        text = io.StringIO()
        pstats.Stats(prof, stream=text).sort_stats(key).print_stats(top)
        out[key] = [line for line in text.getvalue().splitlines() if line.strip()][-top - 1:]
    return out


def measure(name, build, args, dev, n, flops, tokens, profile_dir, host=False, traces=False, label=None):
    """One variant, in its own scope: its model and optimizer are freed before the next. ``label``:
    its name in the profile's files (default ``name``)."""
    label = (label or name).replace("/", "-")
    # llamarl-eager: LLAMARL_FUSED=0; the others run in the environment as it is (--env-variant's).
    with fused_env("0") if name == "llamarl-eager" else contextlib.nullcontext():
        dyn0 = _dynamo_counters()
        model, step, losses = build(*args)
        t0 = time.perf_counter()
        times = step_times(step, n, dev)
        getattr(step, "read", lambda: None)()  # a ppo case's last step, launched but not yet read
        out = {"step_s_median": statistics.median(times), "step_s_min": min(times), "step_s_max": max(times),
               "first_losses": [round(float(x), 5) for x in losses[:3]],
               "warmup_and_timed_s": time.perf_counter() - t0}
        dt = out["step_s_median"]
        out.update(tok_s=tokens / dt, mfu=flops / dt / PEAK_TFLOPS,
                   peak_gb=torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda" else None)
        if getattr(step, "ppo", None):
            out["ppo"] = dict(step.ppo["config"])
            last = step.ppo["metrics"][-1]
            out["ppo"].update(**_packing(step), tokens_per_step=last["tokens"],
                              last_metrics={k: v for k, v in last.items() if isinstance(v, (int, float))})
        out["dynamo_counters"] = _counters_delta(dyn0, _dynamo_counters())  # compiles, recompiles, graph breaks
        if profile_dir:
            with ppo_scopes(step):
                out["profile"] = profile(step, label, profile_dir, dev, keep_trace=traces or label == "llamarl")
        if host:
            out["host_profile"] = host_profile(step, dev)
            print(f"{name}: host profile, {out['host_profile']['wall_s_per_step'] * 1e3:.1f} ms a step under cProfile\n"
                  + "\n".join(out["host_profile"]["tottime"]) + "\n" + "\n".join(out["host_profile"]["cumulative"]),
                  flush=True)
    del model, step
    if dev == "cuda":
        torch.cuda.empty_cache()
    return out


def _packing(step) -> dict:
    """The stage's micro-batches of the case: how many, the share of their budget left empty, the
    share of their rows × longest that is padding (``ppo_data.packing_stats``)."""
    from llamarl.stages.ppo_data import micro_batches, packing_stats

    cfg = step.ppo["config"]
    samples, budget = _Lens(cfg["lengths"]), cfg["micro_batch_tokens"]
    stats = packing_stats(micro_batches(list(range(cfg["sequences"])), samples, budget), samples, budget)
    return {"micro_batches": stats["micro_batches"], "budget_unused": stats["budget_unused"], "padding": stats["padding"]}


class _Lens(list):
    """Stand-ins with ``ids`` of the right lengths, for ``micro_batches``."""

    def __init__(self, lengths):
        super().__init__(type("S", (), {"ids": range(n)})() for n in lengths)


# ---- profile ---------------------------------------------------------------------------------

CATEGORIES = ("matmul", "attention fwd", "attention bwd", "elementwise (norm, rotary, SwiGLU, residual, casts)",
              "cross-entropy", "optimizer", "embedding", "memcpy/memset", "idle",
              # the ppo cases' own (zero elsewhere)
              "grad accumulate into fp32", "grad zero, norm, clip", "masters -> bf16 weights",
              "rl loss (fwd)", "batches (padding, to device)",
              # several GPUs
              "nccl collectives (tp/sp)", "nccl send/recv (pp, incl. waiting)")
_CE_OPS = ("_logprob", "_klogprob", "_entropy", "_kentropy", "_klogprobentropy", "nll_loss", "log_softmax",
           "cross_entropy", "stats_kernel", "grad_kernel")
_GEMM = ("gemm", "nvjet", "xmma", "cutlass", "cublas", "wgmma", "splitk")


def categorize(kernel: str, cat: str, stack: list[str]) -> str:
    """A GPU activity's category from its name and the CPU ops (outermost first) that launched it."""
    k = kernel.lower()
    ops = " | ".join(stack).lower()
    if "ppo.batches" in ops:
        return "batches (padding, to device)"
    if "accumulategrad" in ops:
        return "grad accumulate into fp32"
    if "ppo.grads" in ops or ("ppo.opt_step" in ops and "multiplies" in k):  # the clip's factor: in the step
        return "grad zero, norm, clip"
    if "ppo.opt_step" in ops and "optimizer.step" not in ops and "adam" not in k:  # adam: the one-pass step
        return "masters -> bf16 weights"
    if "ppo.rl_loss" in ops:
        return "rl loss (fwd)"
    if cat in ("gpu_memcpy", "gpu_memset"):
        return "memcpy/memset"
    if "nccl" in k:
        return "nccl send/recv (pp, incl. waiting)" if ("sendrecv" in k or "send" in k or "recv" in k) \
            else "nccl collectives (tp/sp)"
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
    # The time some compute kernel runs (the union over streams; no NCCL, copies or memsets).
    compute, end = 0.0, float("-inf")
    for ts, te in sorted((e["ts"], e["ts"] + e["dur"]) for e in gpu
                         if e["cat"] == "kernel" and "nccl" not in e["name"].lower()):
        if te > end:
            compute += te - max(ts, end)
            end = te
    ms = {c: busy.get(c, 0.0) / 1e3 / steps for c in CATEGORIES}
    top = sorted(kernels.items(), key=lambda kv: -kv[1][0])[:15]
    return {"step_ms": span / 1e3 / steps, "ms": ms, "compute_ms": compute / 1e3 / steps, "unattributed_launches": sum(1 for e in gpu if (e.get("args") or {}).get("correlation") not in stacks),
            "top_kernels": [{"name": n, "ms": t / 1e3 / steps, "calls_per_step": c / steps, "category": cat}
                            for n, (t, c, cat) in top]}


def profile(step, name, out_dir, dev, steps=2, keep_trace=False) -> dict:
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
    if keep_trace:  # the trace itself, when small enough to bring back
        with open(path, "rb") as f, gzip.open(os.path.join(out_dir, f"trace-{name}.json.gz"), "wb", compresslevel=6) as g:
            g.write(f.read())
        if os.path.getsize(os.path.join(out_dir, f"trace-{name}.json.gz")) > 15e6:
            os.remove(os.path.join(out_dir, f"trace-{name}.json.gz"))
    os.remove(path)
    return summary


def profile_table(res: dict) -> str:
    names = [n for n in res.get("variants", ("llamarl", "llamarl-eager", "hf")) if (res.get(n) or {}).get("profile")]
    lines = ["| category | " + " | ".join(f"{n} ms/step | %" for n in names) + " |",
             "|---|" + "---|---|" * len(names)]
    for c in CATEGORIES:
        if not any(res[n]["profile"]["ms"].get(c) for n in names) and c != "idle":
            continue
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


def _run_variant(name, label, args, hf_cfg, ids, dtype, fused, dev, n, batch, seq, tokens, flops, no_embed, L, h):
    """One variant ``name`` (llamarl, llamarl-eager, a ppo case, hf), reported as ``label``."""
    if name in PPO_CASES:
        lengths = ppo_lengths(name, batch, seq)
        budget = {"ppo-1mb": tokens, "ppo-mb8k": tokens // 2}.get(name, 4096 if not args.small else seq)
        build, bargs = build_ppo, (hf_cfg, name, lengths, budget, dev)
        vflops, vtokens = flops_of(no_embed, L, h, lengths), sum(lengths)
    else:
        build, bargs = (build_hf if name == "hf" else build_lib), (hf_cfg, ids, dtype, fused, dev)
        vflops, vtokens = flops, tokens
    out = measure(name, build, bargs, dev, n, vflops, vtokens, args.profile,
                  host=args.host_profile and name != "hf", traces=args.traces, label=label)
    print(label, json.dumps({k: v for k, v in out.items() if k not in ("profile", "ppo", "host_profile")}), flush=True)
    if "ppo" in out:
        print(label, json.dumps({k: v for k, v in out["ppo"].items() if k != "lengths"}), flush=True)
    return out


SHAPES = {
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, vocab_size=128256),
    "small": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, vocab_size=1000),
}


def params_no_embed(shape: dict) -> int:
    """Parameters that do matmul work per token: the layers and the head (not the embedding)."""
    h, f, v, L = shape["hidden_size"], shape["intermediate_size"], shape["vocab_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    return L * (h * (h + 2 * kv) + h * h + 3 * h * f + 2 * h) + h + v * h


def _env_variants(specs: list[str]) -> dict[str, tuple[dict[str, str], list[str] | None]]:
    """``NAME:VAR=VAL[,VAR=VAL][@VARIANT+VARIANT]`` → {NAME: (environment, variants or None: all)}."""
    out = {}
    for spec in specs:
        name, _, rest = spec.partition(":")
        assigns, _, only = rest.partition("@")
        pairs = [a.split("=", 1) for a in assigns.split(",") if a]
        if not name or not pairs or any(len(p) != 2 for p in pairs):
            raise SystemExit(f"--env-variant {spec!r}: NAME:VAR=VAL[,VAR=VAL][@VARIANT+VARIANT]")
        out[name] = (dict(pairs), only.split("+") if only else None)
    return out


@contextlib.contextmanager
def env_set(values: dict[str, str]):
    old = {k: os.environ.get(k) for k in values}
    os.environ.update(values)
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def build_parallel(model_cfg, layout, ids, micro_batches, dtype, dev):
    """lib/'s model on this rank's TP/PP shard, the step over ``micro_batches`` through
    ``lib.schedule.forward_backward`` (1F1B), torch's AdamW on the rank's own parameters."""
    from llamarl.lib.model import schedule, vocab_parallel
    from llamarl.lib.model.llama import ParallelLlamaForCausalLM

    with torch.device(dev):
        model = ParallelLlamaForCausalLM(model_cfg, layout, dtype=dtype)
    with torch.no_grad():  # random weights drawn on the device (random_reader's full tensors: slow at 8B)
        g = torch.Generator(device=dev).manual_seed(1 + model.topology.pp_rank * 1000 + model.topology.tp_rank)
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.fill_(1.0)
            else:
                p.normal_(0, 0.02, generator=g)
    fused = {"fused": True} if dev == "cuda" else {}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, **fused)
    chunks = ids.chunk(micro_batches)
    batches = [model.make_batch(c) for c in chunks]
    labels = [b.flat(torch.roll(c, -1, 1)) for b, c in zip(batches, chunks)]
    losses = []

    def loss_fn(logits, labels_mb):
        return vocab_parallel.cross_entropy(logits, labels_mb, model.tp_group).mean() / len(batches)

    def step():
        out = schedule.forward_backward(model, batches, loss_fn, labels)
        opt.step()
        opt.zero_grad(set_to_none=True)
        if out:
            losses.append(torch.stack(out).sum())

    return model, step, losses


def parallel_main(args, world, shape, batch, seq, n):
    """The step at TP × PP, one process per GPU (torchrun): rank 0 writes the results."""
    import torch.distributed as dist
    from transformers import LlamaConfig as HFConfig

    from llamarl.lib.distributed import parallel
    from llamarl.lib.model.config import LlamaConfig, ParallelLayout

    tp, pp = args.tp, args.pp
    if world != tp * pp:
        raise SystemExit(f"--tp {tp} --pp {pp} needs tp*pp = {tp * pp} processes (torchrun --nproc-per-node "
                         f"{tp * pp}), not {world}")
    if args.ppo or args.ablate or args.env_variant:
        raise SystemExit("--ppo, --ablate and --env-variant are single-process options")
    # One sequence a micro-batch at PP > 1 (the 1F1B schedule needs several) and at 8B (16384 tokens of
    # 8B activations at once would not fit an 80 GB GPU at TP 2 without recompute).
    m = args.micro_batches or (batch if pp > 1 or args.shape == "8b" else 1)
    if batch % m:
        raise SystemExit(f"--micro-batches {m} does not divide the batch of {batch} sequences")
    topo = parallel.init(tp, pp)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.bfloat16 if dev == "cuda" else torch.float32
    hf_cfg = HFConfig(**shape, max_position_embeddings=8192, tie_word_embeddings=False, rope_theta=500000.0)
    model_cfg = LlamaConfig.from_hf(hf_cfg.to_dict())
    layout = ParallelLayout(tp=tp, pp=pp, sequence_parallel=args.sp, remove_padding=True)
    layout.check(model_cfg)
    g = torch.Generator().manual_seed(0)  # the same tokens on every rank
    ids = torch.randint(0, shape["vocab_size"], (batch, seq), generator=g).to(dev)
    tokens = batch * seq
    flops = flops_per_step(params_no_embed(shape), shape["num_hidden_layers"], shape["hidden_size"], seq, tokens)
    rank = dist.get_rank()
    label = f"llamarl-rank{rank}"
    dyn0 = _dynamo_counters()
    model, step, losses = build_parallel(model_cfg, layout, ids, m, dtype, dev)
    t0 = time.perf_counter()
    times = step_times(step, n, dev)
    mine = {"rank": rank, "tp_rank": topo.tp_rank, "pp_rank": topo.pp_rank,
            "step_s_median": statistics.median(times), "step_s_min": min(times), "step_s_max": max(times),
            "warmup_and_timed_s": time.perf_counter() - t0,
            "peak_gb": torch.cuda.max_memory_allocated() / 1e9 if dev == "cuda" else None,
            "params": sum(p.numel() for p in model.parameters()),
            "first_losses": [round(float(x), 5) for x in losses[:3]]}
    if dev == "cuda":  # the bubble, measured: a trace of two steps on every rank
        prof = profile(step, label, args.profile or "/tmp/train_step-profile", dev)
        mine["profile"] = prof
        mine["no_compute_fraction"] = 1 - prof["compute_ms"] / prof["step_ms"] if prof["step_ms"] else None
    mine["dynamo_counters"] = _counters_delta(dyn0, _dynamo_counters())
    ranks: list = [None] * world
    dist.all_gather_object(ranks, mine)
    if rank == 0:
        dt = max(r["step_s_median"] for r in ranks)  # the step ends when the slowest rank's does
        res = {"date": time.strftime("%Y-%m-%d"), "device": torch.cuda.get_device_name() if dev == "cuda" else "cpu",
               "gpus": world, "torch": torch.__version__, "shape": shape,
               "shape_name": "small" if args.small else args.shape,
               "batch": batch, "seq": seq, "tokens_per_step": tokens, "dtype": str(dtype), "steps": n,
               "layout": {"tp": tp, "pp": pp, "sequence_parallel": args.sp, "micro_batches": m},
               "flops_per_step": flops, "variants": ["llamarl"]}
        res["llamarl"] = {
            "tok_s": tokens / dt, "tok_s_per_gpu": tokens / dt / world, "step_s_median": dt,
            "mfu": flops / dt / world / PEAK_TFLOPS,
            "peak_gb": max((r["peak_gb"] or 0) for r in ranks) if dev == "cuda" else None,
            "peak_gb_per_rank": [r["peak_gb"] for r in ranks],
            "ranks": ranks,
        }
        if pp > 1:
            res["llamarl"]["pp_bubble_1f1b"] = (pp - 1) / (m + pp - 1)
            fractions = [r.get("no_compute_fraction") for r in ranks]
            res["llamarl"]["pp_bubble_measured_per_rank"] = fractions if dev == "cuda" else None
        res.update(llamarl_tok_s=res["llamarl"]["tok_s"], llamarl_mfu=res["llamarl"]["mfu"],
                   llamarl_peak_gb=res["llamarl"]["peak_gb"])
        if args.out:
            _write(args.out, res)
        print(json.dumps({k: v for k, v in res["llamarl"].items() if k != "ranks"}, indent=1))
    parallel.shutdown()


def _write(path: str, res: dict) -> None:
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path + ".tmp", "w") as fh:
        fh.write(json.dumps(res, indent=1) + "\n")
    os.replace(path + ".tmp", path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--small", action="store_true", help="a tiny shape (CPU smoke runs)")
    ap.add_argument("--shape", choices=("1b", "8b"), default="1b", help="Llama-3.2-1B or Llama-3.1-8B")
    ap.add_argument("--tp", type=int, default=1, help="tensor-parallel size (under torchrun)")
    ap.add_argument("--pp", type=int, default=1, help="pipeline-parallel size (under torchrun)")
    ap.add_argument("--sp", action="store_true", help="with --tp: sequence parallelism")
    ap.add_argument("--micro-batches", type=int, help="under torchrun: micro-batches a step (default: one "
                                                      "sequence each at PP > 1 or at 8B, else 1)")
    ap.add_argument("--env-variant", action="append", default=[], metavar="NAME:VAR=VAL[,VAR=VAL]",
                    help="lib/'s variants again with these environment variables (repeatable; "
                         "@VARIANT+VARIANT: only those)")
    ap.add_argument("--ablate", action="store_true", help="also lib/ with LLAMARL_FUSED=0 (the unfused path)")
    ap.add_argument("--steps", type=int, default=None, help="timed steps per variant (default 20; --small 2)")
    ap.add_argument("--ppo", action="store_true", help="also the ppo stage's update (one optimizer step) on the same tokens")
    ap.add_argument("--ppo-cases", default=",".join(PPO_CASES), help=f"with --ppo: of {', '.join(PPO_CASES)}")
    ap.add_argument("--skip-hf", action="store_true", help="no HF variant (a profiling run)")
    ap.add_argument("--host-profile", action="store_true", help="also a cProfile of two steps of each lib/ variant")
    ap.add_argument("--traces", action="store_true", help="with --profile: keep every variant's trace (gzip), not "
                                                          "only llamarl's")
    ap.add_argument("--profile", metavar="DIR", help="write a per-category kernel profile of each variant here")
    ap.add_argument("--out", metavar="FILE", help="write the JSON here too")
    args = ap.parse_args()
    from transformers import LlamaConfig as HFConfig

    shape = SHAPES["small" if args.small else args.shape]
    batch, seq, n = (2, 64, 2) if args.small else (8, 2048, 20)
    n = args.steps or n
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world > 1 or args.tp > 1 or args.pp > 1:
        return parallel_main(args, world, shape, batch, seq, n)
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29545")
    from llamarl.lib.distributed import parallel

    dev = "cuda" if torch.cuda.is_available() else "cpu"
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
    h, L = shape["hidden_size"], shape["num_hidden_layers"]
    no_embed = params_no_embed(shape)
    flops = flops_per_step(no_embed, L, h, seq, tokens)
    res["flops_per_step"] = flops

    parallel.init(1, 1)
    cases = [c for c in args.ppo_cases.split(",") if c] if args.ppo else []
    if any(c not in PPO_CASES for c in cases):
        raise SystemExit(f"--ppo-cases {args.ppo_cases!r}: of {', '.join(PPO_CASES)}")
    envs = _env_variants(args.env_variant)
    lib_variants = ["llamarl"] + (["llamarl-eager"] if args.ablate else []) + cases
    variants = lib_variants + ([] if args.skip_hf else ["hf"]) + [
        f"{e}/{v}" for e, (_, only) in envs.items() for v in lib_variants
        if v != "llamarl-eager" and (only is None or v in only)]
    res["variants"] = variants
    if envs:
        res["env_variants"] = {e: env for e, (env, _) in envs.items()}
    for full_name in variants:
        env_name, _, name = full_name.rpartition("/")
        with env_set(envs[env_name][0] if env_name else {}):
            try:
                res[full_name] = _run_variant(name, full_name, args, hf_cfg, ids, dtype, fused, dev, n, batch, seq,
                                              tokens, flops, no_embed, L, h)
            except Exception as e:  # noqa: BLE001 - recorded; the other variants still run
                import traceback

                res[full_name] = {"error": repr(e)[:2000], "traceback": traceback.format_exc()[-4000:]}
                print(full_name, "FAILED", res[full_name]["traceback"], flush=True)
                if dev == "cuda":
                    torch.cuda.empty_cache()
        if args.out:  # what is measured so far, in case the run is cut short
            _write(args.out, res)
    # The flat keys bench/report.py and earlier result files use.
    for name, key in (("llamarl", "llamarl"), ("hf", "hf")):
        if "tok_s" in res.get(name, {}):
            res.update({f"{key}_tok_s": res[name]["tok_s"], f"{key}_mfu": res[name]["mfu"],
                        f"{key}_peak_gb": res[name]["peak_gb"]})
    if "hf_tok_s" in res and "llamarl_tok_s" in res:
        res["ratio_llamarl_over_hf"] = res["llamarl_tok_s"] / res["hf_tok_s"]
    if res.get("llamarl_peak_gb") and res.get("hf_peak_gb"):
        res["peak_memory_llamarl_over_hf"] = res["llamarl_peak_gb"] / res["hf_peak_gb"]
    def ratio(a, b):
        if "tok_s" in res.get(a, {}) and "tok_s" in res.get(b, {}):
            res[f"ratio_{a}_over_{b}"] = res[a]["tok_s"] / res[b]["tok_s"]

    for c in cases:  # issue 16: the ppo update at >= 0.8x the raw step's tokens/s
        ratio(c, "llamarl")
        for e in envs:  # each against the raw step of the same environment (or the default's)
            ratio(f"{e}/{c}", f"{e}/llamarl" if f"{e}/llamarl" in res else "llamarl")
    parallel.shutdown()
    if args.out:
        _write(args.out, res)
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
