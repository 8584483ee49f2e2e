"""One whole PPO iteration through `llamarl run`, measured stage by stage, beside TRL in the same run;
or several iterations, overlapped (``max_staleness``) and sequential, in the same invocation.

    source bench/gpu_env.sh && python bench/e2e.py                  # 1 GPU: TRL, llamarl grpo, then ppo
    python bench/e2e.py --gpus 2 --layouts tp2,dp2 --skip-trl       # 2 GPUs
    python bench/e2e.py --workloads grpo --budget-s 300
    python bench/e2e.py --tiny                                     # CPU smoke run (gloo), a few minutes

    # issue 18, overlapped iterations on 2 GPUs: one GPU rolls out while the other trains
    source bench/gpu_env.sh && python bench/e2e.py --gpus 2 --workloads grpo --skip-trl \
        --iterations 4 --max-staleness 0,1 --layouts split,dp2 --budget-s 2400
    python bench/e2e.py --tiny --iterations 2 --max-staleness 0,1 --skip-trl   # its CPU smoke run

Inputs, made once in WORK/inputs (default /tmp/e2e): a Llama-3.2-1B-shaped actor (random bf16
weights, vocab 128256, llama3 rope scaling) with a tokenizer made here (pipeline/toy.py, 301 tokens:
the model's vocabulary is larger, which is fine), a small reward model with a *different* tokenizer
and 256 prompts. Workloads, each a fresh 1-iteration run (shard → rollout → score → ppo → export):

* ``grpo``: 256 prompts × 4 samples × 256 new tokens, the rule reward ``length`` (lib/rl/rewards.py),
  ``advantage: grpo`` with a KL loss (β 0.05), 16 optimizer steps of 64; and TRL's GRPOTrainer (run first) on
  the same model, prompts and reward function (HF generate, no vLLM, bf16), same batch shape.
* ``ppo``: the same sampling, scored by the reward model (re-tokenized), ``advantage: gae`` with a critic.

Per stage: wall time (from `llamarl run`'s own stage lines), and from the stage manifest's
``timing`` (when the stage writes one) process start → first work and work time; generated,
scored and trained tokens per second. Per iteration (rollout + score + ppo): generated and trained
tokens/s/GPU and the ratio to TRL's generated tokens/s/GPU. A rollout stage also has its engine's own
time (``engine_s``), ``wall_over_engine`` (issue 15: ≤ 1.15), ``not_engine_s`` and rank 0's steps
from its manifest (``spans_s``: imports, …, tokenizer_wait, compile_wait, first_tokens, engine;
``background_s``). Per run, its disk (``disk``, ``DiskActivity``): GB written and discarded on
the device holding the run, and the page cache's dirty bytes, sampled every second. ``--compile-cache fresh`` (default) gives each run an empty
TORCHINDUCTOR_CACHE_DIR and TRITON_CACHE_DIR, so with ``--iterations 2`` iteration 1's rollout
compiles cold and iteration 2's finds the cache. Results: bench/results/e2e-<gpu>-<date>.json
(appended to, one entry per invocation, rewritten after every workload); --tiny writes to WORK.
Everything ends within --budget-s: a stage still running at its deadline is killed and recorded.

Several iterations (``--iterations N``, default 1) and ``--max-staleness 0,1`` (each value a fresh
run of the same workload and layout, so the sequential baseline, 0, is measured in the same
invocation). The layout ``split`` is a placement: every stage at tp1 on one GPU, the local executor
sharing out 2 GPUs between 2 stages at once (``gpus: 2``, ``max_concurrent_stages: 2``), so with
staleness 1 rollout k+1 runs on one GPU while ppo k trains on the other; at staleness 0 the same
placement runs the stages in turn (a rollout may start once the ppo before it has published its
actor, while that ppo still writes its training state). The layout ``shared`` is the same on one
GPU: every stage at tp1, two at once on that GPU (a rollout beside the training-state write of the
ppo before it; both fit in its memory at the 1B shape). With ``--tiny`` on CPU it means 2 stages
at once of one process each (2 cores, ``threads_per_process: 1``). Per run, under ``iterations``:
the wall of all iterations (from the first rollout's start to the end of the last iteration
stage: rollout, score and ppo with the pipeline's bookkeeping, stages side by side counted once),
generated and trained tokens/s in total and per GPU (the run's GPUs: 2 for ``split``, the
layout's processes otherwise), the seconds two stages ran at once, each iteration's stages and mean
score; and for every run with staleness > 0, ``vs_sequential``: its tokens/s over those of the
staleness-0 run of the same layout and of the workload's best staleness-0 run (issue 18's goal:
≥ 1.3× on 2 GPUs). Stage walls of a run whose stages overlap end when ``llamarl run`` records the
stage done (its ``pipeline/<node>.json``), not at the next stage's start.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import uuid

HERE = os.path.dirname(os.path.abspath(__file__))
SPLIT = "split"  # the --layouts name of the placement: every stage tp1 on one of 2 GPUs, 2 stages at once
SHARED = "shared"  # every stage tp1 on the one GPU, 2 stages at once on it (a rollout beside a ppo's state write)


def iteration_nodes(k: int) -> tuple[str, str, str]:
    """The stages of iteration ``k`` (1-based), as `llamarl run` names them."""
    return f"iter-{k:03d}/rollout", f"iter-{k:03d}/scores", f"iter-{k:03d}/ppo"


def run_nodes(iterations: int, workload: str) -> list[str]:
    """Every stage of a run, in DAG order (shard/rm only for the workload scored by the reward model)."""
    shards = ["shard/actor"] + (["shard/rm"] if workload == "ppo" else [])
    return shards + [n for k in range(1, iterations + 1) for n in iteration_nodes(k)] + ["export"]


ACTOR_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192})
# The SmolLM2-135M shape: many thin layers, tied embeddings; per-iteration work is a few seconds, so
# the fixed costs of an iteration (process starts, loads, state writes) decide its speed.
ACTOR_135M = dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                  num_attention_heads=9, num_key_value_heads=3, head_dim=64, max_position_embeddings=8192,
                  rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True)
RM_SMALL = dict(hidden_size=512, intermediate_size=1408, num_hidden_layers=4, num_attention_heads=8,
                num_key_value_heads=4, head_dim=64, max_position_embeddings=4096, rms_norm_eps=1e-5,
                rope_theta=500000.0, tie_word_embeddings=False)
ACTOR_TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=16, max_position_embeddings=512, rms_norm_eps=1e-5,
                  rope_theta=500000.0, tie_word_embeddings=False,
                  rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                "original_max_position_embeddings": 64})
RM_TINY = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
               num_key_value_heads=2, head_dim=8, max_position_embeddings=512, rms_norm_eps=1e-5,
               tie_word_embeddings=False)


def actor_shape(shape: str) -> dict:
    return {"tiny": ACTOR_TINY, "1b": ACTOR_1B, "135m": ACTOR_135M}[shape]


def workload_params(shape: str, prompts: int | None, micro_batch_tokens: int | None = None) -> dict:
    """The shape of one iteration; TRL gets the same. ``shape``: tiny (CPU), 1b or 135m."""
    p = {"tiny": dict(prompts=16, samples=4, max_new_tokens=16, mini_batch=16, chunk_size=8, max_batch=32,
                      micro_batch_tokens=4096, trl_micro_batch=4),
         # 4096: ppo's default, ≈ TRL's 16 sequences
         "1b": dict(prompts=256, samples=4, max_new_tokens=256, mini_batch=64, chunk_size=64, max_batch=256,
                    micro_batch_tokens=4096, trl_micro_batch=16),
         # 4 optimizer steps of 256 an iteration
         "135m": dict(prompts=128, samples=8, max_new_tokens=48, mini_batch=256, chunk_size=128, max_batch=256,
                      micro_batch_tokens=8192, trl_micro_batch=64)}[shape]
    if prompts:
        p["prompts"] = prompts
    if micro_batch_tokens:
        p["micro_batch_tokens"] = micro_batch_tokens
    p["completions"] = p["prompts"] * p["samples"]
    if p["completions"] % p["mini_batch"]:
        raise SystemExit(f"--prompts {p['prompts']}: prompts × {p['samples']} must divide by {p['mini_batch']}")
    p["optimizer_steps"] = p["completions"] // p["mini_batch"]
    # The rule reward, the same for llamarl and TRL: -|response tokens - target| / scale.
    p["reward"] = {"name": "length", "args": {"target": p["max_new_tokens"] // 2, "scale": p["max_new_tokens"] / 4,
                                              "unit": "tokens"}}
    return p


# ---- inputs ------------------------------------------------------------------------------------------


def make_inputs(work: str, shape: str, prompts: int, deadline: float) -> dict:
    """Actor, reward model and prompts under WORK/inputs, built once (a child process does the
    building, so this process never holds a CUDA context)."""
    inputs = os.path.join(work, "inputs")
    tiny = shape == "tiny"
    stamp = {"tiny": tiny, "prompts": prompts, "actor": actor_shape(shape), "rm": RM_TINY if tiny else RM_SMALL}
    stamp_path = os.path.join(inputs, "inputs.json")
    if os.path.exists(stamp_path):
        with open(stamp_path) as f:
            if json.load(f).get("stamp") == stamp:
                return {"reused": True, "seconds": 0.0, **_input_paths(inputs)}
    shutil.rmtree(inputs, ignore_errors=True)
    t = time.time()
    subprocess.run([sys.executable, os.path.abspath(__file__), "--make-inputs", json.dumps({"dir": inputs, **stamp})],
                   check=True, cwd=work, timeout=max(deadline - time.time(), 1))
    seconds = time.time() - t
    with open(stamp_path, "w") as f:
        json.dump({"stamp": stamp, "seconds": seconds}, f)
    return {"reused": False, "seconds": seconds, **_input_paths(inputs)}


def _input_paths(inputs: str) -> dict:
    return {"actor": f"{inputs}/actor", "rm": f"{inputs}/rm", "prompts": f"{inputs}/prompts.jsonl"}


def _build_inputs(job: dict) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification
    from transformers.utils import logging as hf_logging

    from llamarl.pipeline import toy

    hf_logging.disable_progress_bar()
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if job["tiny"] else torch.bfloat16
    paths = _input_paths(job["dir"])
    ids = dict(pad_token_id=toy.PAD, bos_token_id=toy.BOS, eos_token_id=toy.EOS)
    torch.manual_seed(0)
    with torch.device(dev):
        actor = LlamaForCausalLM._from_config(LlamaConfig(**job["actor"], **ids), dtype=dtype)
    actor.save_pretrained(paths["actor"])
    del actor
    toy.make_tokenizer(paths["actor"], toy.CORPUS_A)
    rm_tok = toy.make_tokenizer(paths["rm"], toy.CORPUS_B)
    with torch.device(dev):
        rm = LlamaForSequenceClassification._from_config(
            LlamaConfig(**job["rm"], vocab_size=len(rm_tok), num_labels=1, **ids), dtype=dtype)
    rm.save_pretrained(paths["rm"])
    toy.make_prompts(paths["prompts"], n=job["prompts"])


# ---- one llamarl run ---------------------------------------------------------------------------------


def parse_layout(name: str) -> dict:
    if name in (SPLIT, SHARED):  # a placement: each stage on one device, two stages at once
        return {"tp": 1, "dp": 1}
    m = re.fullmatch(r"(?:tp(\d+))?(?:dp(\d+))?", name)
    if not name or not m:
        raise SystemExit(f"--layouts: {name!r} is not a layout; use e.g. tp1, tp2, dp2, tp2dp2, {SPLIT}")
    return {"tp": int(m.group(1) or 1), "dp": int(m.group(2) or 1)}


def run_devices(layout_name: str) -> int:
    """The devices a run holds: 2 for the split placement (one per concurrent stage), else every
    stage's processes."""
    lay = parse_layout(layout_name)
    return 2 if layout_name == SPLIT else 1 if layout_name == SHARED else lay["tp"] * lay["dp"]


def run_name(workload: str, layout_name: str, staleness: int | None, resident: bool = False) -> str:
    """``grpo-tp1`` as before; ``grpo-split-s1`` when the invocation compares staleness values or
    runs several iterations (``staleness`` not None); ``-resident`` with resident workers."""
    return (f"{workload}-{layout_name}" + ("" if staleness is None else f"-s{staleness}")
            + ("-resident" if resident else ""))


def executor_spec(layout_name: str, gpus: int, resident: bool = False) -> dict:
    """The local executor; for the split placement with two stages at once, each on its own GPU
    (``gpus``: 0 on CPU, where each stage's one process takes one core). ``resident``: one worker
    process per rank for the whole run (cluster/resident.py)."""
    options = {"resident": resident}
    if layout_name == SHARED:  # gpus unset: every stage sees the one GPU
        return {"kind": "local", "options": {"max_concurrent_stages": 2} | options}
    if layout_name != SPLIT:
        return {"kind": "local", "options": options}
    return {"kind": "local", "options": {"max_concurrent_stages": 2} | ({"gpus": gpus} if gpus else {}) | options}


def write_spec(work: str, paths: dict, workload: str, layout_name: str, p: dict, export_procs: int, *,
               iterations: int = 1, staleness: int | None = None, gpus: int = 0,
               resident: bool = False, train_state_every: int = 1) -> tuple[str, str]:
    """The run spec of one run; ``staleness`` None is today's single sequential run (no
    ``max_staleness`` in the spec); ``gpus``: what the split placement shares out."""
    lay = parse_layout(layout_name)
    stage = {"tp": lay["tp"], "dp": lay["dp"]}
    spec = {
        "name": run_name(workload, layout_name, staleness, resident),
        "storage": f"{work}/runs",
        "actor": paths["actor"],
        "prompts": paths["prompts"],
        "iterations": iterations,
        "seed": 0,
        # A 1B ppo output is ~20 GB (weights + training state): the GPU machine's 64 GB disk holds the
        # last one whole and the actors of the others.
        "retention": {"keep_last": 1, **({"train_state_every": train_state_every} if train_state_every > 1 else {})},
        **({} if staleness is None else {"max_staleness": staleness}),
        "layout": {"shard": {"tp": lay["tp"]}, "rollout": stage, "score": stage, "ppo": stage,
                   # split: each stage's processes get GPUs of their own, export's too (2 at most)
                   "export": {"procs": min(export_procs, 2) if layout_name == SPLIT else export_procs}},
        "rollout": {"id_column": "id", "chunk_size": p["chunk_size"], "max_batch": p["max_batch"],
                    "sampling": {"samples_per_prompt": p["samples"], "max_new_tokens": p["max_new_tokens"],
                                 "temperature": 1.0}},
        "ppo": {"mini_batch_size": p["mini_batch"], "ppo_epochs": 1, "kl_coef": 0.05,
                "micro_batch_tokens": p["micro_batch_tokens"], "seed": 0},
        "export": {},
        "executor": executor_spec(layout_name, gpus, resident),
    }
    if workload == "grpo":
        spec["score"] = {"rewards": [{"name": p["reward"]["name"], "weight": 1.0, "args": p["reward"]["args"]}]}
        spec["ppo"].update(advantage="grpo", use_kl_loss=True)
    else:
        spec["reward_model"] = paths["rm"]
        spec["score"] = {"rewards": [{"name": "rm", "weight": 1.0}]}
        spec["ppo"].update(advantage="gae")
    import yaml

    path = f"{work}/specs/{spec['name']}.yaml"
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        yaml.safe_dump(spec, f, sort_keys=False)
    return path, f"{spec['storage']}/{spec['name']}"


class GpuMemory:
    """Samples every GPU's used memory (nvidia-smi, 4 times a second) to report each stage's peak."""

    def __init__(self):
        self.samples: list[tuple[float, int, float]] = []
        self.proc = None
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=index,memory.used", "--format=csv,noheader,nounits",
                                          "-lms", "250"], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True)
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for line in self.proc.stdout:
            try:
                idx, mib = (x.strip() for x in line.split(","))
                self.samples.append((time.time(), int(idx), float(mib)))
            except ValueError:
                pass

    def peak_gb(self, t0: float, t1: float) -> float | None:
        vals = [mib for t, _, mib in self.samples if t0 <= t <= t1]
        return round(max(vals) * 1.048576e-3, 2) if vals else None

    def close(self):
        if self.proc and self.proc.poll() is None:
            self.proc.kill()


def _mount_options(folder: str) -> str | None:
    """The options ``folder``'s file system is mounted with (/proc/mounts; ``discard`` among them
    makes each delete's TRIMs stall the disk's writes), None off Linux."""
    try:
        mounts = [line.split() for line in open("/proc/mounts")]
    except OSError:
        return None
    folder = os.path.realpath(folder)
    inside = [m for m in mounts if folder == m[1] or folder.startswith(m[1].rstrip("/") + "/")]
    return max(inside, key=lambda m: len(m[1]))[3] if inside else None


class DiskActivity:
    """What a run asks of its disk, sampled every second while it runs: the page cache's dirty and
    writeback bytes (/proc/meminfo), the kernel's dirty limits now (/proc/vmstat: a writer is
    throttled to the disk's rate above the limit; writeback starts above the background one, both
    a share of the memory not pinned or in use) and what the block device holding the run wrote
    and discarded since the run began (/proc/diskstats, 512-byte sectors; other writers to that
    disk count too). An iteration bound by its disk shows as GB written at the disk's own rate,
    with the dirty bytes at their limit."""

    def __init__(self, folder: str, period_s: float = 1.0):
        while not os.path.isdir(folder):  # the run's folder, or the nearest that exists
            folder = os.path.dirname(folder)
        dev = os.stat(folder).st_dev
        self.device = f"{os.major(dev)}:{os.minor(dev)}"
        self.mount_options = _mount_options(folder)
        self.samples: list[list[float]] = []
        self.t0, self.period_s, self.stopped = time.time(), period_s, threading.Event()
        self.start = self._read()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _read(self) -> list[float] | None:
        """[seconds since start, dirty GB, writeback GB, written GB, discarded GB, dirty limit GB,
        background limit GB] (None: not Linux)."""
        try:
            meminfo = {line.split(":")[0]: int(line.split()[1]) for line in open("/proc/meminfo")}
            vmstat = {k: int(v) * os.sysconf("SC_PAGE_SIZE") / 1e9 for k, v in map(str.split, open("/proc/vmstat"))}
            sectors = next(([int(f[9]), int(f[16]) if len(f) > 16 else 0] for f in map(str.split, open("/proc/diskstats"))
                            if f"{f[0]}:{f[1]}" == self.device), [0, 0])
        except (OSError, ValueError, IndexError, KeyError):
            return None
        return [round(time.time() - self.t0, 2), meminfo["Dirty"] / 1e6, meminfo["Writeback"] / 1e6,
                sectors[0] * 512 / 1e9, sectors[1] * 512 / 1e9, vmstat["nr_dirty_threshold"],
                vmstat["nr_dirty_background_threshold"]]

    def _run(self) -> None:
        while not self.stopped.wait(self.period_s):
            if (sample := self._read()) is not None:
                self.samples.append(sample)

    def result(self) -> dict | None:
        self.stopped.set()
        self.thread.join()
        if self.start is None or not self.samples:
            return None
        last, wall = self.samples[-1], self.samples[-1][0] - self.start[0]
        dirty = [x[1] for x in self.samples]
        return {"device": self.device, "mount_options": self.mount_options, "written_gb": round(last[3] - self.start[3], 2),
                "discarded_gb": round(last[4] - self.start[4], 2),
                "written_gb_per_s": round((last[3] - self.start[3]) / wall, 3) if wall > 0 else None,
                "dirty_gb_max": round(max(dirty), 2), "dirty_gb_mean": round(sum(dirty) / len(dirty), 2),
                "dirty_limit_gb_min": round(min(x[5] for x in self.samples), 2),
                "samples": [[round(t, 2), round(d, 3), round(w, 3), round(gb - self.start[3], 3), round(dis - self.start[4], 3),
                             round(lim, 2), round(bg, 2)] for t, d, w, gb, dis, lim, bg in self.samples],
                "columns": ["s", "dirty_gb", "writeback_gb", "written_gb since the start", "discarded_gb since the start",
                            "dirty_limit_gb", "background_limit_gb"]}


def run_pipeline(spec: str, run_dir: str, deadline: float, stage_timeout: float | None, log_path: str, echo,
                 compile_cache: str | None = None) -> dict:
    """`llamarl run SPEC` in its own process group; the start time of every stage (from its
    "[node] running" line), how it ended, and the error line of a failure. ``compile_cache``: an
    empty folder made for this run, its stages' ``TORCHINDUCTOR_CACHE_DIR`` (None: torch's default)."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: every stage is measured
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "250"}
    if compile_cache:
        shutil.rmtree(compile_cache, ignore_errors=True)
        os.makedirs(compile_cache)
        env["TORCHINDUCTOR_CACHE_DIR"] = compile_cache
        env["TRITON_CACHE_DIR"] = os.path.join(compile_cache, "triton")  # the sampler's kernel: cold too
    cmd = [sys.executable, "-m", "llamarl.pipeline.cli", "run", spec]
    disk = DiskActivity(run_dir)
    t0 = time.time()
    # cwd: not the repo root, whose llamarl/ folder would hide an installed (non-editable) llamarl.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            cwd=os.path.dirname(spec), env=env, start_new_session=True)
    starts: dict[str, float] = {}
    order: list[str] = []
    errors: list[str] = []
    last_exception = [None]
    overlapped = [False]  # a stage started beside another
    elsewhere: set[str] = set()  # nodes recorded done without a process of their own

    def read():
        with open(log_path, "w") as log:
            for line in proc.stdout:
                now = time.time()
                log.write(f"{now - t0:9.2f} {line}")
                log.flush()
                # "done: scored in the rollout": a node the driver recorded done without a process
                # (its work is in the stage that made its output), a stage of no time of its own.
                m = re.match(r"^\[([^\]]+)\] (running |done: )", line)
                if m:
                    starts[m.group(1)] = now
                    if m.group(2) == "done: ":
                        elsewhere.add(m.group(1))
                    order.append(m.group(1))
                    overlapped[0] = overlapped[0] or "(beside" in line
                    echo(f"  {now - t0:7.1f}s {line.rstrip()}")
                elif line.startswith("error:"):
                    errors.append(line.strip())
                    echo(f"  {now - t0:7.1f}s {line.rstrip()}")
                elif re.match(r"^[A-Za-z_.]*(Error|Exception)\b.*:", line):
                    last_exception[0] = line.strip()

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    killed = None
    while proc.poll() is None:
        now = time.time()
        current = order[-1] if order else None
        if now > deadline:
            killed = f"budget: killed at its deadline while {current or 'starting'} ran"
        elif stage_timeout and current and now - starts[current] > stage_timeout:
            killed = f"stage timeout: {current} ran longer than {stage_timeout:.0f} s"
        if killed:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            break
        time.sleep(0.2)
    t_end = time.time()
    reader.join(timeout=10)
    return {"rc": proc.returncode, "t0": t0, "t_end": t_end, "disk": disk.result(), "starts": starts, "order": order, "killed": killed,
            "error": errors[-1] if errors else None, "exception": last_exception[0], "overlapped": overlapped[0],
            "elsewhere": elsewhere}


# ---- measurements ------------------------------------------------------------------------------------


def _manifest(path: str) -> dict | None:
    try:
        with open(f"{path}/llamarl.json") as f:
            return json.load(f)
    except (OSError, json.JSONDecodeError):
        return None


def _parquet_lengths(folder: str) -> tuple[int, int, int]:
    """(rows, response tokens, prompt + response tokens of rows with a response) of a rollout."""
    import pyarrow.compute as pc
    import pyarrow.parquet as pq

    rows = resp = trained = 0
    parts = sorted(os.listdir(f"{folder}/parts")) if os.path.isdir(f"{folder}/parts") else []
    for name in parts:
        if not name.endswith(".parquet"):
            continue
        t = pq.read_table(f"{folder}/parts/{name}", columns=["prompt_token_ids", "response_token_ids"])
        r = pc.list_value_length(t["response_token_ids"]).fill_null(0)
        q = pc.list_value_length(t["prompt_token_ids"]).fill_null(0)
        has = pc.greater(r, 0)
        rows += t.num_rows
        resp += pc.sum(r).as_py() or 0
        trained += pc.sum(pc.if_else(has, pc.add(r, q), 0)).as_py() or 0
    return rows, resp, trained


def _rate(n, seconds):
    return round(n / seconds, 2) if n is not None and seconds else None


def _record(run_dir: str, node: str) -> tuple[dict, float | None]:
    """The pipeline's record of a stage and when it was last written ({} and None if there is none)."""
    path = f"{run_dir}/pipeline/{node.replace('/', '.')}.json"
    try:
        with open(path) as f:
            return json.load(f), os.path.getmtime(path)
    except (OSError, json.JSONDecodeError):
        return {}, None


def _recorded_end(run_dir: str, node: str) -> float | None:
    """When `llamarl run` recorded the stage done or failed."""
    record, written = _record(run_dir, node)
    return written if record.get("status") in ("done", "failed") else None


def stage_spans(run_dir: str, res: dict) -> dict[str, tuple[float, float]]:
    """(start, stop) of every stage that started. One stage at a time (no ``beside``): a stage
    stops where the next starts (its publishing and the pipeline's bookkeeping included), as
    always; when stages overlapped, where `llamarl run` recorded it done."""
    order, starts = res["order"], res["starts"]
    spans = {}
    for i, node in enumerate(order):
        if res["overlapped"]:
            stop = _recorded_end(run_dir, node) or res["t_end"]
        else:
            stop = starts[order[i + 1]] if i + 1 < len(order) else res["t_end"]
        spans[node] = (starts[node], stop)
    return spans


def measure_run(run_dir: str, res: dict, world: int, gpus: GpuMemory, workload: str, iterations: int = 1) -> dict:
    """Per-stage numbers of a finished (or cut off) `llamarl run`; ``world``: each stage's processes."""
    stages = {}
    spans = stage_spans(run_dir, res)
    for node in run_nodes(iterations, workload):
        out = f"{run_dir}/{node}"
        st = {"status": "not run"}
        if node in spans:
            t_start, t_stop = spans[node]
            m = _manifest(out)
            # The stage that was running when the run failed or was cut off (with overlap, maybe two).
            failed_here = (res["rc"] != 0 or bool(res["killed"])) and _record(run_dir, node)[0].get("status") != "done"
            st = {"status": "ok" if m else "timeout" if failed_here and res["killed"] else "failed",
                  "wall_s": round(t_stop - t_start, 2), "peak_gpu_gb": gpus.peak_gb(t_start, t_stop)}
            if failed_here and m:
                st["killed_after_publishing"] = res["killed"] or f"exit status {res['rc']}"
            elif failed_here:
                st["error"] = res["killed"] or _record_error(run_dir, node) or res["error"]
                st["exception"] = res["exception"]
            timing = (m or {}).get("timing")
            if node in res.get("elsewhere", ()):
                # Its output was made by another stage (rules scored in the rollout): the manifest's
                # timing is that stage's, and this node had no process to start.
                st.update(wall_s=0.0, made_elsewhere=True)
                timing = None
            if timing and all(timing.get(k) for k in ("process_start", "work_start", "work_end")):
                st.update(launch_s=round(timing["process_start"] - t_start, 2),
                          startup_s=round(timing["work_start"] - timing["process_start"], 2),
                          to_first_work_s=round(timing["work_start"] - t_start, 2),
                          work_s=round(timing["work_end"] - timing["work_start"], 2),
                          after_work_s=round(t_stop - timing["work_end"], 2),
                          # on the run's clock (seconds since the script started it): for the idle time
                          work_at_s=[round(timing["work_start"] - res["t0"], 3), round(timing["work_end"] - res["t0"], 3)])
                st["first_work_fraction_of_wall"] = round(st["to_first_work_s"] / st["wall_s"], 3) if st["wall_s"] else None
            else:
                st.update(launch_s=None, startup_s=None, to_first_work_s=None, work_s=None, after_work_s=None,
                          first_work_fraction_of_wall=None)
            _stage_throughput(node, out, m, st, world)
        stages[node] = st
    return stages


def _record_error(run_dir: str, node: str) -> str | None:
    return _record(run_dir, node)[0].get("error")


def _stage_throughput(node: str, out: str, m: dict | None, st: dict, world: int) -> None:
    wall, work = st.get("wall_s"), st.get("work_s")
    if m is None:
        return
    if node.startswith("shard/") or node == "export":
        nbytes = sum(f.get("bytes", 0) for f in m.get("files", {}).values())
        st.update(bytes=nbytes, gb_s_wall=_rate(nbytes / 1e9, wall), gb_s_work=_rate(nbytes / 1e9, work))
    elif node.endswith("/rollout"):
        rows, resp, _ = _parquet_lengths(out)
        st.update(sequences=rows, generated_tokens=resp, tok_s_wall=_rate(resp, wall), tok_s_work=_rate(resp, work),
                  tok_s_per_gpu_wall=_rate(resp / world, wall), tok_s_per_gpu_work=_rate(resp / world, work),
                  rank0_new_tok_s_reported=m.get("new_tokens_per_s_rank0"))
        engine = (m.get("stats") or {}).get("engine_s")
        # issue 15's goal: the stage's wall time within 1.15x of the engine's own time
        st.update(engine_s=engine, wall_over_engine=round(wall / engine, 3) if engine and wall else None,
                  work_over_engine=round(work / engine, 3) if engine and work else None,
                  not_engine_s=round(wall - engine, 2) if engine and wall else None,
                  # rank 0's steps (stages/rollout.py: imports, manifest, prompts, process group, …,
                  # engine, last part written) and what ran beside them (tokenizer, sampler compile)
                  spans_s=m.get("spans_s"), background_s=m.get("background_s"))
    elif node.endswith("/scores"):
        rows = m.get("rows")
        st.update(sequences=rows, seq_s_wall=_rate(rows, wall), seq_s_work=_rate(rows, work))
    elif node.endswith("/ppo"):
        epochs = (m.get("request", {}).get("config") or {}).get("ppo_epochs", 1)
        rollout = out.rsplit("/", 1)[0] + "/rollout"
        _, _, trained = _parquet_lengths(rollout)
        trained *= epochs
        steps = []
        try:
            with open(f"{out}/metrics.jsonl") as f:
                steps = [json.loads(line) for line in f if line.strip()]
        except OSError:
            pass
        summary = m.get("summary", {})
        # Each step's wall time: the summary's (older results: metrics.jsonl's per-step "seconds").
        loop = sum(summary.get("step_seconds") or [s.get("seconds", 0.0) for s in steps])
        kl = [s["kl"] for s in steps if "kl" in s]
        st.update(trained_tokens=trained, optimizer_steps=len(steps), tok_s_wall=_rate(trained, wall),
                  tok_s_work=_rate(trained, work), tok_s_per_gpu_wall=_rate(trained / world, wall),
                  tok_s_per_gpu_work=_rate(trained / world, work), update_loop_s=round(loop, 2) if steps else None, update_tok_s=_rate(trained, loop),
                  mean_score=summary.get("mean_score"), kl=sum(kl) / len(kl) if kl else None,
                  mean_response_length=summary.get("mean_response_length"), dtype=summary.get("dtype"),
                  phases_s=summary.get("seconds") if isinstance(summary.get("seconds"), dict) else None,
                  update_tok_s_reported=summary.get("update_tokens_per_s"),
                  models_from=summary.get("models_from"), reference_from=summary.get("reference_from"))
        st["score_and_kl_finite"] = all(isinstance(v, (int, float)) and math.isfinite(v)
                                        for v in (st["mean_score"], st["kl"]))


def iteration_numbers(stages: dict, res: dict, world: int) -> dict:
    """The first iteration of a sequential run, its stages' walls summed."""
    it = [stages.get(n, {}) for n in iteration_nodes(1)]
    if not all(s.get("status") == "ok" for s in it):
        return {"complete": False}
    wall = sum(s["wall_s"] for s in it)
    everything = sum(s.get("wall_s", 0) for s in stages.values())
    gen, trained = it[0]["generated_tokens"], it[2]["trained_tokens"]
    return {"complete": True, "gpus": world, "wall_s": round(wall, 2),
           "wall_with_shard_export_s": round(everything, 2), "llamarl_run_wall_s": round(res["t_end"] - res["t0"], 2),
           "generated_tokens": gen, "trained_tokens": trained,
           "generated_tok_s_per_gpu": _rate(gen / world, wall), "trained_tok_s_per_gpu": _rate(trained / world, wall),
           "generated_tok_s_per_gpu_with_shard_export": _rate(gen / world, everything),
           "mean_score": it[2].get("mean_score"), "kl": it[2].get("kl")}


def _overlap_s(spans: list[tuple[float, float]]) -> float:
    """Seconds during which at least two of ``spans`` ran at once."""
    edges = sorted([(a, 1) for a, _ in spans] + [(b, -1) for _, b in spans])
    both, running, last = 0.0, 0, None
    for t, step in edges:
        if running >= 2:
            both += t - last
        running, last = running + step, t
    return both


def _idle(stages: dict, start: float, end: float, t0: float) -> dict:
    """Iteration k's window — from the end of iteration k-1 (its ppo recorded done; the first
    rollout's start for k = 1) to the end of its own ppo — and the seconds of it in which no stage of
    the run did its own work: start-ups, hand-overs, the driver's bookkeeping. Stages side by side
    count once, whichever iteration they belong to."""
    clipped = ((max(a + t0, start), min(b + t0, end)) for s in stages.values() if (w := s.get("work_at_s"))
               for a, b in [w])
    spans = sorted((a, b) for a, b in clipped if a < b)
    busy, reach = 0.0, start
    for a, b in spans:
        if b > reach:
            busy += b - max(a, reach)
            reach = b
    return {"window_s": round(end - start, 2), "idle_s": round(end - start - busy, 2)}


def iterations_numbers(stages: dict, res: dict, run_dir: str, iterations: int, staleness: int, devices: int) -> dict:
    """All iterations of a run together: their wall (the first rollout's start to the end of the
    last of their stages: rollout, score and ppo with the pipeline's bookkeeping, stages side by
    side counted once; export, which may start from the last actor before that ppo ends, left
    out), tokens/s in total and per device, and each iteration's stages."""
    names = [n for k in range(1, iterations + 1) for n in iteration_nodes(k)]
    its = [stages.get(n, {}) for n in names]
    if not all(s.get("status") == "ok" for s in its):
        return {"complete": False, "iterations": iterations, "max_staleness": staleness}
    spans = stage_spans(run_dir, res)
    t_first = res["starts"][names[0]]
    wall = max(spans[n][1] for n in names) - t_first
    gen = sum(stages[n]["generated_tokens"] for n in names if n.endswith("/rollout"))
    trained = sum(stages[n]["trained_tokens"] for n in names if n.endswith("/ppo"))
    per = []
    for k in range(1, iterations + 1):
        ro, sc, po = (stages[n] for n in iteration_nodes(k))
        per.append({"iteration": k, "rollout_s": ro["wall_s"], "rollout_startup_s": ro.get("to_first_work_s"),
                    "rollout_engine_s": ro.get("engine_s"), "rollout_wall_over_engine": ro.get("wall_over_engine"),
                    "scores_s": sc["wall_s"], "ppo_s": po["wall_s"],
                    "generated_tokens": ro["generated_tokens"], "trained_tokens": po["trained_tokens"],
                    "mean_score": po.get("mean_score"), "kl": po.get("kl"),
                    "sampled_from": _sampled_from(run_dir, iteration_nodes(k)[0]),
                    "rollout_started_s": round(res["starts"][iteration_nodes(k)[0]] - t_first, 2),
                    "ppo_done_s": round(spans[iteration_nodes(k)[2]][1] - t_first, 2),
                    **_idle(stages, spans[iteration_nodes(k - 1)[2]][1] if k > 1 else res["starts"][names[0]],
                            spans[iteration_nodes(k)[2]][1], res["t0"])})
    return {"complete": True, "iterations": iterations, "max_staleness": staleness, "gpus": devices,
            "overlapped": res["overlapped"], "wall_s": round(wall, 2),
            "stage_sum_s": round(sum(s["wall_s"] for s in its), 2),
            "two_stages_at_once_s": round(_overlap_s([spans[n] for n in names]), 2),
            "llamarl_run_wall_s": round(res["t_end"] - res["t0"], 2),
            "generated_tokens": gen, "trained_tokens": trained,
            "generated_tok_s": _rate(gen, wall), "trained_tok_s": _rate(trained, wall),
            "generated_tok_s_per_gpu": _rate(gen / devices, wall),
            "trained_tok_s_per_gpu": _rate(trained / devices, wall), "per_iteration": per}


def _sampled_from(run_dir: str, rollout: str) -> str | None:
    """The actor a rollout sampled from (its manifest's ``request.actor``), relative to the run."""
    actor = ((_manifest(f"{run_dir}/{rollout}") or {}).get("request") or {}).get("actor")
    return os.path.relpath(actor, run_dir) if actor and actor.startswith(run_dir) else actor


def attach_staleness_ratios(inv: dict) -> None:
    """``vs_sequential`` of every complete run with staleness > 0: its tokens/s over those of the
    staleness-0 run of the same workload and layout, and of the workload's fastest staleness-0 run."""
    done = [r for r in inv["runs"] if (r.get("iterations") or {}).get("complete")]
    for run in done:
        it = run["iterations"]
        if not it["max_staleness"]:
            continue
        base = [r for r in done if r["workload"] == run["workload"] and not r["iterations"]["max_staleness"]]
        same = next((r for r in base if r["layout"] == run["layout"]), None)
        best = max(base, key=lambda r: r["iterations"]["generated_tok_s"], default=None)

        def ratios(b):
            if b is None:
                return None
            bi = b["iterations"]
            return {"baseline": b["name"], "baseline_wall_s": bi["wall_s"],
                    "generated_tok_s_ratio": round(it["generated_tok_s"] / bi["generated_tok_s"], 3),
                    "trained_tok_s_ratio": round(it["trained_tok_s"] / bi["trained_tok_s"], 3),
                    "generated_tok_s_per_gpu_ratio": round(it["generated_tok_s_per_gpu"]
                                                           / bi["generated_tok_s_per_gpu"], 3),
                    "wall_ratio_sequential_over_overlapped": round(bi["wall_s"] / it["wall_s"], 3)}

        it["vs_sequential"] = {"same_layout": ratios(same), "best_sequential": ratios(best),
                               "goal": "issue 18: >= 1.3x generated tokens/s on 2 GPUs"}


# ---- TRL ---------------------------------------------------------------------------------------------


def trl_worker(cfg_path: str) -> None:
    """TRL's GRPOTrainer on the same actor, prompts and reward; one JSON result, rewritten after
    every iteration (so a run killed at the deadline still leaves what it measured)."""
    with open(cfg_path) as f:
        cfg = json.load(f)
    out = cfg["result"]
    state = {"status": "loading", "iterations": []}

    def save():
        tmp = out + ".tmp"
        with open(tmp, "w") as f:
            json.dump(state, f, indent=1)
        os.replace(tmp, out)

    save()
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from llamarl.lib.rl import rewards

    cuda = torch.cuda.is_available()
    p = cfg["params"]
    rule, rule_args = rewards.resolve(p["reward"]["name"]), p["reward"]["args"]
    tok = AutoTokenizer.from_pretrained(cfg["actor"])
    prompts = [json.loads(line)["prompt"] for line in open(cfg["prompts"])]
    prompt_len = {text: len(tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True,
                                                    tokenize=True, return_dict=False)) for text in prompts}
    counts = {"generated": 0, "trained": 0, "completions": 0}

    def length_reward(prompts, completions, completion_ids, **kwargs):
        """lib.rewards' rule, called exactly as the score stage calls it."""
        scores = []
        for prompt, completion, ids in zip(prompts, completions, completion_ids):
            text = completion[-1]["content"] if isinstance(completion, list) else completion
            scores.append(rule(text, {"response_token_ids": ids}, **rule_args))
            counts["generated"] += len(ids)
            counts["trained"] += len(ids) + prompt_len[prompt[-1]["content"]]
            counts["completions"] += 1
        return scores

    steps = p["optimizer_steps"]
    args = GRPOConfig(
        output_dir=cfg["output_dir"], report_to="none", save_strategy="no", disable_tqdm=True, seed=0,
        per_device_train_batch_size=p["trl_micro_batch"],
        gradient_accumulation_steps=p["mini_batch"] // p["trl_micro_batch"],
        generation_batch_size=p["completions"], num_generations=p["samples"],
        max_completion_length=p["max_new_tokens"], temperature=1.0, beta=0.05, use_vllm=False,
        bf16=cuda, use_cpu=not cuda, model_init_kwargs={"dtype": "bfloat16" if cuda else "float32"},
        gradient_checkpointing=cfg["gradient_checkpointing"], max_steps=steps * cfg["iterations"], logging_steps=steps,
    )
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": t}]} for t in prompts])

    class Timer(TrainerCallback):
        def on_train_begin(self, args, st, control, **kw):
            if cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            self.t = time.perf_counter()
            state["status"] = "training"
            save()

        def on_step_end(self, args, st, control, **kw):
            if st.global_step % steps:
                return
            if cuda:
                torch.cuda.synchronize()
            now = time.perf_counter()
            seconds = now - self.t
            state["iterations"].append({
                "iteration": st.global_step // steps, "seconds": round(seconds, 3), "optimizer_steps": steps,
                "completions": counts["completions"], "generated_tokens": counts["generated"],
                "trained_tokens": counts["trained"], "generated_tok_s": _rate(counts["generated"], seconds),
                "trained_tok_s": _rate(counts["trained"], seconds),
                "peak_gpu_gb_allocated": round(torch.cuda.max_memory_allocated() / 1e9, 2) if cuda else None,
                "peak_gpu_gb_reserved": round(torch.cuda.max_memory_reserved() / 1e9, 2) if cuda else None})
            counts.update(generated=0, trained=0, completions=0)
            if cuda:
                torch.cuda.reset_peak_memory_stats()
            save()
            self.t = time.perf_counter()

    state["grpo_config"] = {k: getattr(args, k) for k in (
        "per_device_train_batch_size", "gradient_accumulation_steps", "generation_batch_size", "steps_per_generation",
        "num_generations", "max_completion_length", "temperature", "beta", "loss_type", "learning_rate", "bf16",
        "gradient_checkpointing", "use_vllm", "max_steps", "model_init_kwargs")}
    state["reward"] = f"llamarl.lib.rl.rewards.{p['reward']['name']} {rule_args} (the score stage's rule)"
    t = time.perf_counter()
    trainer = GRPOTrainer(model=cfg["actor"], reward_funcs=length_reward, args=args, train_dataset=dataset,
                          processing_class=tok, callbacks=[Timer()])
    state["load_s"] = round(time.perf_counter() - t, 2)
    trainer.train()
    logs = [x for x in trainer.state.log_history if "loss" in x or "kl" in x]
    state["last_log"] = {k: v for k, v in (logs[-1] if logs else {}).items() if isinstance(v, (int, float))}
    state["status"] = "ok"
    save()


def run_trl(work: str, paths: dict, p: dict, deadline: float, iterations: int, grad_ckpt: bool, python: str, echo) -> dict:
    d = f"{work}/trl"
    shutil.rmtree(d, ignore_errors=True)
    os.makedirs(d)
    cfg = {"actor": paths["actor"], "prompts": paths["prompts"], "params": p, "iterations": iterations,
           "gradient_checkpointing": grad_ckpt, "output_dir": f"{d}/out", "result": f"{d}/result.json"}
    with open(f"{d}/config.json", "w") as f:
        json.dump(cfg, f)
    t0 = time.time()
    with open(f"{d}/log.txt", "w") as log:
        proc = subprocess.Popen([python, os.path.abspath(__file__), "--trl-worker", f"{d}/config.json"], stdout=log,
                                stderr=subprocess.STDOUT, cwd=d, start_new_session=True,
                                env={**os.environ, "PYTHONUNBUFFERED": "1"})
        killed = None
        while proc.poll() is None:
            if time.time() > deadline:
                killed = "budget: killed at its deadline"
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
                break
            time.sleep(0.5)
    try:
        with open(cfg["result"]) as f:
            result = json.load(f)
    except (OSError, json.JSONDecodeError):
        result = {"iterations": []}
    result["wall_s"] = round(time.time() - t0, 2)
    result["log"] = f"{d}/log.txt"
    its = result["iterations"]
    if proc.returncode != 0 or killed:
        result["status"] = "timeout" if killed else "failed"
        result["error"] = killed or _last_error_line(f"{d}/log.txt")
    result["timed"] = ("one whole iteration, from the step that generates to the end of its last optimizer step: "
                       "generation, reward, old and reference log-probs, all optimizer steps; not the model load nor "
                       "the trainer's construction" + ("; the last iteration (the first warms up)" if len(its) > 1 else
                                                       "; the first iteration (warm-up included)"))
    if its:
        timed = its[-1]
        result.update(timed_iteration=timed["iteration"], iteration_s=timed["seconds"],
                      generated_tok_s_per_gpu=timed["generated_tok_s"], trained_tok_s_per_gpu=timed["trained_tok_s"],
                      first_iteration_s=its[0]["seconds"])
    echo(f"  TRL: {result.get('status')}, iterations {[i['seconds'] for i in its]} s, "
         f"{result.get('generated_tok_s_per_gpu')} generated tok/s/GPU" + (f" ({result['error']})" if result.get("error") else ""))
    return result


def _last_error_line(path: str) -> str | None:
    try:
        with open(path) as f:
            lines = [line.strip() for line in f if line.strip()]
    except OSError:
        return None
    hits = [line for line in lines if re.match(r"^[A-Za-z_.]*(Error|Exception)\b", line) or line.startswith("error:")]
    return (hits or lines or [None])[-1]


# ---- results -----------------------------------------------------------------------------------------


def device_info() -> dict:
    """GPU name and count without creating a CUDA context here (nvidia-smi, else torch)."""
    import torch

    if not torch.cuda.is_available():
        return {"kind": "cpu", "name": "cpu", "count": 0, "slug": "cpu"}
    names = []
    if shutil.which("nvidia-smi"):
        q = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"], capture_output=True, text=True)
        names = [n.strip() for n in q.stdout.splitlines() if n.strip()]
    if not names:
        names = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())]
    m = re.search(r"\b([A-Z]{1,3}\d{2,4}[A-Z]?)\b", names[0])
    return {"kind": "cuda", "name": names[0], "count": len(names), "slug": m.group(1).lower() if m else "gpu"}


def versions() -> dict:
    import importlib.metadata as md

    out = {"python": sys.version.split()[0]}
    for pkg in ("torch", "transformers", "trl", "accelerate", "datasets", "megatron-core", "llamarl"):
        try:
            out[pkg] = md.version(pkg)
        except md.PackageNotFoundError:
            out[pkg] = None
    return out


def attach_trl_ratios(inv: dict) -> None:
    trl = inv.get("trl") or {}
    for run in inv["runs"]:
        it = run.get("iteration", {})
        if run["workload"] != "grpo" or not it.get("complete") or not trl.get("generated_tok_s_per_gpu"):
            it.pop("vs_trl", None)
            continue
        it["vs_trl"] = {
            "generated_tok_s_per_gpu_ratio": round(it["generated_tok_s_per_gpu"] / trl["generated_tok_s_per_gpu"], 3),
            "trained_tok_s_per_gpu_ratio": round(it["trained_tok_s_per_gpu"] / trl["trained_tok_s_per_gpu"], 3)
            if trl.get("trained_tok_s_per_gpu") else None,
            "iteration_time_ratio_trl_over_llamarl": round(trl["iteration_s"] / it["wall_s"], 3),
            "note": "llamarl: rollout+score+ppo stage wall times (process starts and checkpoint hand-offs included); "
                    "TRL: one in-process iteration (see trl.timed); per GPU"}


def write_results(path: str, inv: dict) -> None:
    attach_trl_ratios(inv)
    attach_staleness_ratios(inv)
    data = {"bench": "e2e", "invocations": []}
    if os.path.exists(path):
        try:
            with open(path) as f:
                old = json.load(f)
            if isinstance(old.get("invocations"), list):
                data = old
        except (OSError, json.JSONDecodeError):
            pass
    data["invocations"] = [x for x in data["invocations"] if x.get("id") != inv["id"]] + [inv]
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1)
    os.replace(tmp, path)


def table(inv: dict) -> str:
    def f(v, fmt="{:.1f}"):
        return "-" if v is None else fmt.format(v)

    width = max([11] + [len(r.get("name", "")) for r in inv["runs"]])

    def row(name, stage, status, wall="", to_work="", work="", rest=""):
        return f"{name:<{width}} {stage:<17} {status:<8} {wall:>7} {to_work:>8} {work:>7}  {rest}"

    lines = [row("run", "stage", "status", "wall s", "to work", "work s", "throughput (wall) | peak GPU GB")]
    lines.append("-" * len(lines[0]))
    for run in inv["runs"]:
        name = run.get("name") or f"{run['workload']}/{run['layout']}"
        if not run["stages"]:
            lines.append(row(name, "-", run["status"], rest=run.get("error") or ""))
        for node, st in run["stages"].items():
            thr = next((fmt.format(st[k]) for k, fmt in (
                ("tok_s_per_gpu_wall", "{:,.0f} gen tok/s/GPU" if node.endswith("rollout") else "{:,.0f} trained tok/s/GPU"),
                ("seq_s_wall", "{:,.1f} seq/s"), ("gb_s_wall", "{:.2f} GB/s")) if st.get(k) is not None), "-")
            rest = f"{thr} | {f(st.get('peak_gpu_gb'))}" if "error" not in st else (st["error"] or "")[:100]
            lines.append(row(name, node, st["status"], f(st.get("wall_s")), f(st.get("to_first_work_s")), f(st.get("work_s")),
                             rest))
            if st.get("wall_over_engine"):
                lines.append(row("", "  engine", "", f(st.get("engine_s")), rest=(
                    f"wall / engine {st['wall_over_engine']:.2f}×, work / engine {st['work_over_engine']:.2f}×, "
                    f"not engine {f(st.get('not_engine_s'))} s")))
        it = run.get("iteration", {})
        if it.get("complete"):
            vs = it.get("vs_trl", {}).get("generated_tok_s_per_gpu_ratio")
            lines.append(row("", "= iteration", "", f(it["wall_s"]), rest=(
                f"{it['generated_tok_s_per_gpu']:,.0f} gen, {it['trained_tok_s_per_gpu']:,.0f} trained tok/s/GPU"
                + (f", {vs}× TRL" if vs else "") + f"; with shard + export {f(it['wall_with_shard_export_s'])} s")))
        its = run.get("iterations") or {}
        if its.get("complete"):
            lines.append(row("", f"= {its['iterations']} iterations", f"s={its['max_staleness']}", f(its["wall_s"]), rest=(
                f"{its['generated_tok_s']:,.1f} gen, {its['trained_tok_s']:,.1f} trained tok/s "
                f"({its['generated_tok_s_per_gpu']:,.1f}, {its['trained_tok_s_per_gpu']:,.1f} per GPU of "
                f"{its['gpus']}); two stages at once {its['two_stages_at_once_s']:.1f} s; mean score "
                + " → ".join(f(x["mean_score"], "{:.3f}") for x in its["per_iteration"]))))
            labels = {"same_layout": "  vs s=0, layout", "best_sequential": "  vs best s=0"}
            for which, r in (its.get("vs_sequential") or {}).items():
                if isinstance(r, dict):
                    lines.append(row("", labels[which], "", rest=(
                        f"{r['generated_tok_s_ratio']:.2f}× generated tok/s, {r['trained_tok_s_ratio']:.2f}× trained "
                        f"tok/s, {r['wall_ratio_sequential_over_overlapped']:.2f}× wall (over {r['baseline']})")))
    trl = inv.get("trl")
    if trl:
        its = [i["seconds"] for i in trl.get("iterations", [])]
        lines.append(row("TRL", "GRPOTrainer", trl.get("status", "?"), f(trl.get("iteration_s")), rest=(
            f"{trl['generated_tok_s_per_gpu']:,.0f} gen tok/s/GPU (iterations {its} s)"
            if trl.get("generated_tok_s_per_gpu") else trl.get("error") or "")))
    return "\n".join(lines)


# ---- main --------------------------------------------------------------------------------------------


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--work", default="/tmp/e2e", help="work dir: inputs, runs, logs (default /tmp/e2e)")
    ap.add_argument("--workloads", default="grpo,ppo", help="grpo, ppo or both (default grpo,ppo)")
    ap.add_argument("--gpus", type=int, choices=(1, 2), default=1)
    ap.add_argument("--layouts", help="layouts of rollout/score/ppo (shard's tp follows): tp1 | tp2 | dp2 … | "
                                      f"{SPLIT} (every stage tp1 on one of 2 GPUs, 2 stages at once); default tp1 on "
                                      f"1 GPU, tp2,dp2 on 2; with a --max-staleness above 0: {SPLIT} on 2 GPUs and --tiny")
    ap.add_argument("--shape", choices=("1b", "135m"), default="1b",
                    help="the actor and its workload: 1b (Llama-3.2-1B, 256 prompts × 4 × 256 tokens) or 135m "
                         "(SmolLM2-135M, 128 prompts × 8 × 48 tokens); --tiny overrides it")
    ap.add_argument("--resident", default="off", choices=("off", "on", "both"),
                    help="the local executor's resident workers: off, on, or both (each a fresh run, same invocation)")
    ap.add_argument("--iterations", type=int, default=1, help="PPO iterations per run (default 1)")
    ap.add_argument("--max-staleness", default="0", help="comma-separated max_staleness values, each a fresh run of "
                                                         "every workload and layout (default 0: sequential), e.g. 0,1")
    ap.add_argument("--train-state-every", type=int, default=1,
                    help="retention.train_state_every of the llamarl runs (default 1: every state written; needs "
                         "--resident on)")
    ap.add_argument("--skip-trl", action="store_true", help="do not run TRL (grpo)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: tiny models, few prompts and tokens, gloo")
    ap.add_argument("--budget-s", type=float, default=540, help="the whole script ends within this (default 540)")
    ap.add_argument("--stage-timeout-s", type=float, default=None, help="kill a stage running longer than this")
    ap.add_argument("--prompts", type=int, default=None, help="prompts per iteration (default 256; tiny 16)")
    ap.add_argument("--micro-batch-tokens", type=int, default=None, help="ppo's micro_batch_tokens (default 4096)")
    ap.add_argument("--export-procs", type=int, default=None, help="export's processes (default 4; tiny 1)")
    ap.add_argument("--trl-iterations", type=int, default=2, help="TRL iterations; the last is timed (default 2)")
    ap.add_argument("--trl-gradient-checkpointing", choices=("on", "off"), default="on",
                    help="TRL's gradient_checkpointing (its default: on)")
    ap.add_argument("--trl-python", default=sys.executable, help="interpreter for TRL's process (default this one)")
    ap.add_argument("--compile-cache", choices=("fresh", "machine"), default="fresh",
                    help="torch.compile's and Triton's caches: fresh (default): an empty TORCHINDUCTOR_CACHE_DIR and "
                         "TRITON_CACHE_DIR per run, so its "
                         "first rollout compiles cold and later ones find what it left, whatever ran on this machine "
                         "before; machine: torch's default (/tmp/torchinductor_$USER), as a user's stages get it")
    ap.add_argument("--keep-runs", action="store_true", help="keep run directories (a 1B run holds 25-50 GB of checkpoints)")
    ap.add_argument("--out", help="results JSON (default bench/results/e2e-<gpu>-<date>.json; tiny: WORK/…)")
    ap.add_argument("--make-inputs", help=argparse.SUPPRESS)
    ap.add_argument("--trl-worker", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.make_inputs:
        return _build_inputs(json.loads(args.make_inputs))
    if args.trl_worker:
        return trl_worker(args.trl_worker)

    t_start = time.time()
    deadline = t_start + args.budget_s - 5  # a few seconds to write the results
    work = os.path.abspath(args.work)
    os.makedirs(f"{work}/logs", exist_ok=True)
    workloads = [w.strip() for w in args.workloads.split(",") if w.strip()]
    if not workloads or any(w not in ("grpo", "ppo") for w in workloads):
        raise SystemExit(f"--workloads {args.workloads!r}: use grpo, ppo or grpo,ppo")
    try:
        stalenesses = [int(x) for x in args.max_staleness.split(",") if x.strip()]
    except ValueError:
        stalenesses = []
    if not stalenesses or min(stalenesses) < 0 or len(set(stalenesses)) < len(stalenesses):
        raise SystemExit(f"--max-staleness {args.max_staleness!r}: use distinct values >= 0, e.g. 0,1")
    if args.iterations < 1:
        raise SystemExit(f"--iterations {args.iterations}: at least 1")
    if args.train_state_every < 1 or (args.train_state_every > 1 and args.resident != "on"):
        raise SystemExit(f"--train-state-every {args.train_state_every}: at least 1, and above 1 only with "
                         "--resident on (it leaves the states in the resident workers)")
    # Several iterations or staleness values: runs are named and reported per staleness ("iterations");
    # otherwise one iteration a run, named by workload and layout alone and reported as "iteration".
    several = args.iterations > 1 or stalenesses != [0]
    overlap = max(stalenesses) > 0
    default_layouts = (SPLIT if overlap and (args.gpus == 2 or args.tiny) else
                       "tp1" if args.gpus == 1 or args.tiny else "tp2,dp2")
    layouts = [x.strip() for x in (args.layouts or default_layouts).split(",")]
    dev = device_info()
    split_gpus = args.gpus if dev["kind"] == "cuda" else 0  # what the split placement shares out
    for name in layouts:
        world = run_devices(name)
        if name == SPLIT and dev["kind"] == "cuda" and args.gpus != 2:
            raise SystemExit(f"--layouts {SPLIT}: puts two stages on two GPUs at once; use --gpus 2")
        if world > args.gpus and not args.tiny:
            raise SystemExit(f"--layouts {name}: needs {world} GPUs, --gpus is {args.gpus}")
        if dev["kind"] == "cuda" and world > dev["count"]:
            raise SystemExit(f"--layouts {name}: needs {world} GPUs, this machine has {dev['count']}")
    if dev["kind"] == "cpu" and not args.tiny:
        raise SystemExit("no GPU here: use --tiny for the CPU smoke run")
    shape = "tiny" if args.tiny else args.shape
    p = workload_params(shape, args.prompts, args.micro_batch_tokens)
    export_procs = args.export_procs or (1 if args.tiny else 4)
    date = time.strftime("%Y-%m-%d")
    out = args.out or (f"{work}/e2e-tiny-{date}.json" if args.tiny else f"{HERE}/results/e2e-{dev['slug']}-{date}.json")

    def echo(msg):
        print(msg, flush=True)

    inv = {"id": uuid.uuid4().hex[:12], "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
           "date": date, "device": dev, "versions": versions(), "tiny": args.tiny, "argv": sys.argv[1:],
           "budget_s": args.budget_s, "workload": {k: v for k, v in p.items()},
           "shape": shape, "shapes": {"actor": actor_shape(shape), "rm": RM_TINY if args.tiny else RM_SMALL},
           "measured": {
               "stage wall_s": "from `llamarl run`'s '[stage] running' line to the next stage's (or its exit): process "
                               "start, load, work, save, publish, pipeline bookkeeping",
               "launch_s / startup_s / work_s": "from the stage manifest's timing (rank 0): line → process_start → "
                                                "work_start → work_end; null when the stage writes no timing",
               "iteration": "rollout + score + ppo wall times; per GPU = divided by the layout's processes",
               "rollout tokens": "generated (response_token_ids)", "ppo tokens": "(prompt + response) × ppo_epochs",
               "ppo update_tok_s": "ppo tokens / the summed per-step seconds of metrics.jsonl (the optimizer-step "
                                   "loop: actor, and the critic with gae), all ranks together",
               "peak_gpu_gb": "max of nvidia-smi memory.used over all GPUs during the stage (includes other processes)",
               "rollout engine_s": "the engine's own time (manifest stats.engine_s; the first prefill and CUDA graph "
                                   "captures included, the sampler's compile not: it runs beside the weight load); "
                                   "wall_over_engine: the stage's wall over it (issue 15: <= 1.15); not_engine_s: "
                                   "wall - engine_s; spans_s: rank 0's steps from process start",
               "compile cache": "--compile-cache: fresh = an empty TORCHINDUCTOR_CACHE_DIR per run (iteration 1 cold, "
                                "later iterations warm); machine = torch's default"},
           "inputs": None, "runs": [], "trl": None}
    if args.train_state_every > 1:
        inv["train_state_every"] = args.train_state_every
    if several:
        inv.update(iterations=args.iterations, max_staleness=stalenesses)
        inv["measured"].update({
            "stage wall_s": inv["measured"]["stage wall_s"] + "; when stages overlapped, to `llamarl run` recording it "
                                                              "done (pipeline/<node>.json written)",
            "iterations": "all iterations of a run: wall from the first rollout's '[stage] running' line to the "
                          "end of the last iteration stage (overlapping stages counted once; export, which may "
                          "start before the last ppo ends, left out); tokens/s over that wall; per GPU = divided "
                          f"by the run's GPUs ({SPLIT}: 2; else the layout's processes); two_stages_at_once_s: "
                          "seconds with two stages running",
            "vs_sequential": "runs with max_staleness > 0: tokens/s over the staleness-0 run of the same layout "
                             "(same_layout) and over the workload's fastest staleness-0 run (best_sequential)"})
    echo(f"e2e: {dev['name']} × {dev['count']}, workloads {workloads}, layouts {layouts}, budget {args.budget_s:.0f} s → {out}")
    try:
        inv["inputs"] = make_inputs(work, shape, p["prompts"], deadline)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        inv["inputs"] = {"error": f"making the inputs failed: {e}"}
        write_results(out, inv)
        raise SystemExit(inv["inputs"]["error"]) from None
    paths = {k: inv["inputs"][k] for k in ("actor", "rm", "prompts")}
    echo(f"inputs: {'reused' if inv['inputs']['reused'] else 'made in %.1f s' % inv['inputs']['seconds']} in {work}/inputs")
    write_results(out, inv)

    # TRL first: it is short and predictable, and whatever it leaves goes to the llamarl runs.
    jobs = [("trl", "grpo", None)] if "grpo" in workloads and not args.skip_trl else []
    residents = {"off": [False], "on": [True], "both": [False, True]}[args.resident]
    jobs += [("llamarl", w, lay, s, r) for w in ("grpo", "ppo") if w in workloads for lay in layouts
             for s in stalenesses for r in residents]
    reserve = {"llamarl": (60 if args.tiny else 150) + (args.iterations - 1) * (30 if args.tiny else 90),
               "trl": 60 if args.tiny else 150}  # 1B: its cold first iteration alone takes 50-60 s
    gpus = GpuMemory()
    try:
        for j, (kind, workload, lay, *rest) in enumerate(jobs):
            staleness = rest[0] if several and rest else None  # None: one iteration, no staleness in the name
            resident = bool(rest and rest[1])
            name = run_name(workload, lay or "", staleness, resident)
            label = name if several else f"{workload} {lay}"
            now = time.time()
            later = sum(reserve[job[0]] for job in jobs[j + 1:])
            job_deadline = min(deadline, max(deadline - later, now + min(reserve[kind], deadline - now)))
            if now >= deadline - 1:
                echo(f"[{'TRL' if kind == 'trl' else f'llamarl {label}'}] not started: the budget is spent")
                skipped = {"status": "not run", "error": "budget spent before it could start"}
                if kind == "trl":
                    inv["trl"] = {**skipped, "iterations": []}
                else:
                    inv["runs"].append({"workload": workload, "layout": lay, **skipped, "stages": {}, "iteration": {}}
                                       | ({"name": name, "max_staleness": staleness, "iterations": {}} if several else {}))
                continue
            if kind == "trl":
                echo(f"[TRL GRPOTrainer] {args.trl_iterations} iteration(s), deadline in {job_deadline - now:.0f} s")
                inv["trl"] = run_trl(work, paths, p, job_deadline, args.trl_iterations,
                                     args.trl_gradient_checkpointing == "on", args.trl_python, echo)
                write_results(out, inv)
                continue
            world = parse_layout(lay)["tp"] * parse_layout(lay)["dp"]  # each stage's processes
            devices = run_devices(lay)  # the run's
            spec, run_dir = write_spec(work, paths, workload, lay, p, export_procs, iterations=args.iterations,
                                       staleness=staleness, gpus=split_gpus, resident=resident,
                                       train_state_every=args.train_state_every)
            echo(f"[llamarl {label}] {spec}, deadline in {job_deadline - now:.0f} s")
            log = f"{work}/logs/{name}.log"
            cache = f"{work}/compile-cache/{name}" if args.compile_cache == "fresh" else None
            res = run_pipeline(spec, run_dir, job_deadline, args.stage_timeout_s, log, echo, cache)
            stages = measure_run(run_dir, res, world, gpus, workload, args.iterations)
            ok = res["rc"] == 0 and not res["killed"]
            run = {"workload": workload, "layout": lay, "layout_detail": parse_layout(lay), "processes": world,
                   "resident": resident,
                   "spec": spec, "log": log, "status": "ok" if ok else ("timeout" if res["killed"] else "failed"),
                   "error": None if ok else (res["killed"] or res["error"] or res["exception"] or f"exit status {res['rc']}"),
                   "stages": stages, "disk": res["disk"],
                   "iteration": iteration_numbers(stages, res, devices) if args.iterations == 1 else {}}
            if several:
                run.update(name=name, max_staleness=staleness, gpus=devices, executor=executor_spec(lay, split_gpus, resident),
                           iterations=iterations_numbers(stages, res, run_dir, args.iterations, staleness, devices))
            inv["runs"].append(run)
            if not args.keep_runs:
                shutil.rmtree(run_dir, ignore_errors=True)
            write_results(out, inv)
            it = run["iterations"] if several else run["iteration"]
            if not it.get("complete"):
                echo(f"  {run['status']}: {run['error'] or 'incomplete'}")
            elif several:
                echo(f"  {run['status']}: {args.iterations} iteration(s) in {it['wall_s']} s (two stages at once "
                     f"{it['two_stages_at_once_s']} s), {it['generated_tok_s']:,.1f} generated tok/s "
                     f"({it['generated_tok_s_per_gpu']:,.1f}/GPU), {it['trained_tok_s']:,.1f} trained tok/s "
                     f"({it['trained_tok_s_per_gpu']:,.1f}/GPU); mean score "
                     + " → ".join(f"{x['mean_score']:.3f}" for x in it["per_iteration"]))
            else:
                echo(f"  {run['status']}: iteration {it['wall_s']} s, {it['generated_tok_s_per_gpu']:,.0f} generated "
                     f"tok/s/GPU, {it['trained_tok_s_per_gpu']:,.0f} trained tok/s/GPU")
    finally:
        gpus.close()
    inv["finished"] = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
    inv["wall_s"] = round(time.time() - t_start, 1)
    write_results(out, inv)
    echo("")
    echo(table(inv))
    echo(f"\nresults: {out}")


if __name__ == "__main__":
    main()
