"""One whole PPO iteration through `llamarl run`, measured stage by stage, beside TRL in the same run.

    source bench/gpu_env.sh && python bench/e2e.py                  # 1 GPU: TRL, llamarl grpo, then ppo
    python bench/e2e.py --gpus 2 --layouts tp2,dp2 --skip-trl       # 2 GPUs
    python bench/e2e.py --workloads grpo --budget-s 300
    python bench/e2e.py --tiny                                     # CPU smoke run (gloo), a few minutes

Inputs, made once in WORK/inputs (default /tmp/e2e): a Llama-3.2-1B-shaped actor (random bf16
weights, vocab 128256, llama3 rope scaling) with a tokenizer made here (pipeline/toy.py, 301 tokens:
the model's vocabulary is larger, which is fine), a small reward model with a *different* tokenizer
and 256 prompts. Workloads, each a fresh 1-iteration run (shard → rollout → score → ppo → export):

* ``grpo``: 256 prompts × 4 samples × 256 new tokens, the rule reward ``length`` (lib/rewards.py),
  ``advantage: grpo`` with a KL loss (β 0.05), 16 optimizer steps of 64; and TRL's GRPOTrainer (run first) on
  the same model, prompts and reward function (HF generate, no vLLM, bf16), same batch shape.
* ``ppo``: the same sampling, scored by the reward model (re-tokenized), ``advantage: gae`` with a critic.

Per stage: wall time (from `llamarl run`'s own stage lines), and from the stage manifest's
``timing`` (when the stage writes one) process start → first work and work time; generated,
scored and trained tokens per second. Per iteration (rollout + score + ppo): generated and trained
tokens/s/GPU and the ratio to TRL's generated tokens/s/GPU. Results: bench/results/e2e-<gpu>-<date>.json
(appended to, one entry per invocation, rewritten after every workload); --tiny writes to WORK.
Everything ends within --budget-s: a stage still running at its deadline is killed and recorded.
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
NODES = ("shard/actor", "shard/rm", "iter-001/rollout", "iter-001/scores", "iter-001/ppo", "export")
ITERATION = ("iter-001/rollout", "iter-001/scores", "iter-001/ppo")

ACTOR_1B = dict(vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
                rms_norm_eps=1e-5, rope_theta=500000.0, tie_word_embeddings=False,
                rope_scaling={"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                              "original_max_position_embeddings": 8192})
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


def workload_params(tiny: bool, prompts: int | None, micro_batch_tokens: int | None = None) -> dict:
    """The shape of one iteration; TRL gets the same."""
    p = dict(prompts=16, samples=4, max_new_tokens=16, mini_batch=16, chunk_size=8, max_batch=32,
             micro_batch_tokens=4096, trl_micro_batch=4) if tiny else \
        dict(prompts=256, samples=4, max_new_tokens=256, mini_batch=64, chunk_size=64, max_batch=256,
             micro_batch_tokens=4096, trl_micro_batch=16)  # 4096: ppo's default, ≈ TRL's 16 sequences
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


def make_inputs(work: str, tiny: bool, prompts: int, deadline: float) -> dict:
    """Actor, reward model and prompts under WORK/inputs, built once (a child process does the
    building, so this process never holds a CUDA context)."""
    inputs = os.path.join(work, "inputs")
    stamp = {"tiny": tiny, "prompts": prompts, "actor": ACTOR_TINY if tiny else ACTOR_1B, "rm": RM_TINY if tiny else RM_SMALL}
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
    m = re.fullmatch(r"(?:tp(\d+))?(?:dp(\d+))?", name)
    if not name or not m:
        raise SystemExit(f"--layouts: {name!r} is not a layout; use e.g. tp1, tp2, dp2, tp2dp2")
    return {"tp": int(m.group(1) or 1), "dp": int(m.group(2) or 1)}


def write_spec(work: str, paths: dict, workload: str, layout_name: str, p: dict, export_procs: int) -> tuple[str, str]:
    lay = parse_layout(layout_name)
    stage = {"tp": lay["tp"], "dp": lay["dp"]}
    spec = {
        "name": f"{workload}-{layout_name}",
        "storage": f"{work}/runs",
        "actor": paths["actor"],
        "prompts": paths["prompts"],
        "iterations": 1,
        "layout": {"shard": {"tp": lay["tp"]}, "rollout": stage, "score": stage, "ppo": stage,
                   "export": {"procs": export_procs}},
        "rollout": {"id_column": "id", "chunk_size": p["chunk_size"], "max_batch": p["max_batch"],
                    "sampling": {"samples_per_prompt": p["samples"], "max_new_tokens": p["max_new_tokens"],
                                 "temperature": 1.0, "seed": 0}},
        "ppo": {"mini_batch_size": p["mini_batch"], "ppo_epochs": 1, "kl_coef": 0.05,
                "micro_batch_tokens": p["micro_batch_tokens"], "seed": 0},
        "export": {},
        "executor": {"kind": "local"},
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


def run_pipeline(spec: str, run_dir: str, deadline: float, stage_timeout: float | None, log_path: str, echo) -> dict:
    """`llamarl run SPEC` in its own process group; the start time of every stage (from its
    "[node] running" line), how it ended, and the error line of a failure."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run: every stage is measured
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "250"}
    cmd = [sys.executable, "-m", "llamarl.pipeline.cli", "run", spec]
    t0 = time.time()
    # cwd: not the repo root, whose llamarl/ folder would hide an installed (non-editable) llamarl.
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            cwd=os.path.dirname(spec), env=env, start_new_session=True)
    starts: dict[str, float] = {}
    order: list[str] = []
    errors: list[str] = []
    last_exception = [None]

    def read():
        with open(log_path, "w") as log:
            for line in proc.stdout:
                now = time.time()
                log.write(f"{now - t0:9.2f} {line}")
                log.flush()
                m = re.match(r"^\[([^\]]+)\] running ", line)
                if m:
                    starts[m.group(1)] = now
                    order.append(m.group(1))
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
    return {"rc": proc.returncode, "t0": t0, "t_end": t_end, "starts": starts, "order": order, "killed": killed,
            "error": errors[-1] if errors else None, "exception": last_exception[0]}


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


def measure_run(run_dir: str, res: dict, world: int, gpus: GpuMemory, workload: str) -> dict:
    """Per-stage and per-iteration numbers of a finished (or cut off) `llamarl run`."""
    stages = {}
    nodes = [n for n in NODES if n != "shard/rm" or workload == "ppo"]
    order = res["order"]
    for node in nodes:
        out = f"{run_dir}/{node}"
        st = {"status": "not run"}
        if node in res["starts"]:
            i = order.index(node)
            t_start = res["starts"][node]
            t_stop = res["starts"][order[i + 1]] if i + 1 < len(order) else res["t_end"]
            m = _manifest(out)
            failed_here = i == len(order) - 1 and (res["rc"] != 0 or res["killed"])
            st = {"status": "ok" if m else "timeout" if failed_here and res["killed"] else "failed",
                  "wall_s": round(t_stop - t_start, 2), "peak_gpu_gb": gpus.peak_gb(t_start, t_stop)}
            if failed_here and m:
                st["killed_after_publishing"] = res["killed"] or f"exit status {res['rc']}"
            elif failed_here:
                st["error"] = res["killed"] or _record_error(run_dir, node) or res["error"]
                st["exception"] = res["exception"]
            timing = (m or {}).get("timing")
            if timing and all(timing.get(k) for k in ("process_start", "work_start", "work_end")):
                st.update(launch_s=round(timing["process_start"] - t_start, 2),
                          startup_s=round(timing["work_start"] - timing["process_start"], 2),
                          to_first_work_s=round(timing["work_start"] - t_start, 2),
                          work_s=round(timing["work_end"] - timing["work_start"], 2),
                          after_work_s=round(t_stop - timing["work_end"], 2))
                st["first_work_fraction_of_wall"] = round(st["to_first_work_s"] / st["wall_s"], 3) if st["wall_s"] else None
            else:
                st.update(launch_s=None, startup_s=None, to_first_work_s=None, work_s=None, after_work_s=None,
                          first_work_fraction_of_wall=None)
            _stage_throughput(node, out, m, st, world)
        stages[node] = st
    return stages


def _record_error(run_dir: str, node: str) -> str | None:
    try:
        with open(f"{run_dir}/pipeline/{node.replace('/', '.')}.json") as f:
            return json.load(f).get("error")
    except (OSError, json.JSONDecodeError):
        return None


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
                  work_over_engine=round(work / engine, 3) if engine and work else None)
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
        loop = sum(s.get("seconds", 0.0) for s in steps)
        kl = [s["kl"] for s in steps if "kl" in s]
        summary = m.get("summary", {})
        st.update(trained_tokens=trained, optimizer_steps=len(steps), tok_s_wall=_rate(trained, wall),
                  tok_s_work=_rate(trained, work), tok_s_per_gpu_wall=_rate(trained / world, wall),
                  tok_s_per_gpu_work=_rate(trained / world, work), update_loop_s=round(loop, 2) if steps else None, update_tok_s=_rate(trained, loop),
                  mean_score=summary.get("mean_score"), kl=sum(kl) / len(kl) if kl else None,
                  mean_response_length=summary.get("mean_response_length"), dtype=summary.get("dtype"),
                  phases_s=summary.get("seconds") if isinstance(summary.get("seconds"), dict) else None,
                  update_tok_s_reported=summary.get("update_tokens_per_s"))
        st["score_and_kl_finite"] = all(isinstance(v, (int, float)) and math.isfinite(v)
                                        for v in (st["mean_score"], st["kl"]))


def iteration_numbers(stages: dict, res: dict, world: int) -> dict:
    it = [stages.get(n, {}) for n in ITERATION]
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

    from llamarl.lib import rewards

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
    state["reward"] = f"llamarl.lib.rewards.{p['reward']['name']} {rule_args} (the score stage's rule)"
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

    def row(name, stage, status, wall="", to_work="", work="", rest=""):
        return f"{name:<11} {stage:<17} {status:<8} {wall:>7} {to_work:>8} {work:>7}  {rest}"

    lines = [row("run", "stage", "status", "wall s", "to work", "work s", "throughput (wall) | peak GPU GB")]
    lines.append("-" * len(lines[0]))
    for run in inv["runs"]:
        name = f"{run['workload']}/{run['layout']}"
        if not run["stages"]:
            lines.append(row(name, "-", run["status"], rest=run.get("error") or ""))
        for node, st in run["stages"].items():
            thr = next((fmt.format(st[k]) for k, fmt in (
                ("tok_s_per_gpu_wall", "{:,.0f} gen tok/s/GPU" if node.endswith("rollout") else "{:,.0f} trained tok/s/GPU"),
                ("seq_s_wall", "{:,.1f} seq/s"), ("gb_s_wall", "{:.2f} GB/s")) if st.get(k) is not None), "-")
            rest = f"{thr} | {f(st.get('peak_gpu_gb'))}" if "error" not in st else (st["error"] or "")[:100]
            lines.append(row(name, node, st["status"], f(st.get("wall_s")), f(st.get("to_first_work_s")), f(st.get("work_s")),
                             rest))
        it = run.get("iteration", {})
        if it.get("complete"):
            vs = it.get("vs_trl", {}).get("generated_tok_s_per_gpu_ratio")
            lines.append(row("", "= iteration", "", f(it["wall_s"]), rest=(
                f"{it['generated_tok_s_per_gpu']:,.0f} gen, {it['trained_tok_s_per_gpu']:,.0f} trained tok/s/GPU"
                + (f", {vs}× TRL" if vs else "") + f"; with shard + export {f(it['wall_with_shard_export_s'])} s")))
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
    ap.add_argument("--layouts", help="layouts of rollout/score/ppo (shard's tp follows): tp1 | tp2 | dp2 …; "
                                      "default tp1 on 1 GPU, tp2,dp2 on 2")
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
    layouts = [x.strip() for x in (args.layouts or ("tp1" if args.gpus == 1 or args.tiny else "tp2,dp2")).split(",")]
    dev = device_info()
    for name in layouts:
        lay = parse_layout(name)
        world = lay["tp"] * lay["dp"]
        if world > args.gpus and not args.tiny:
            raise SystemExit(f"--layouts {name}: needs {world} GPUs, --gpus is {args.gpus}")
        if dev["kind"] == "cuda" and world > dev["count"]:
            raise SystemExit(f"--layouts {name}: needs {world} GPUs, this machine has {dev['count']}")
    if dev["kind"] == "cpu" and not args.tiny:
        raise SystemExit("no GPU here: use --tiny for the CPU smoke run")
    p = workload_params(args.tiny, args.prompts, args.micro_batch_tokens)
    export_procs = args.export_procs or (1 if args.tiny else 4)
    date = time.strftime("%Y-%m-%d")
    out = args.out or (f"{work}/e2e-tiny-{date}.json" if args.tiny else f"{HERE}/results/e2e-{dev['slug']}-{date}.json")

    def echo(msg):
        print(msg, flush=True)

    inv = {"id": uuid.uuid4().hex[:12], "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t_start)),
           "date": date, "device": dev, "versions": versions(), "tiny": args.tiny, "argv": sys.argv[1:],
           "budget_s": args.budget_s, "workload": {k: v for k, v in p.items()},
           "shapes": {"actor": ACTOR_TINY if args.tiny else ACTOR_1B, "rm": RM_TINY if args.tiny else RM_SMALL},
           "measured": {
               "stage wall_s": "from `llamarl run`'s '[stage] running' line to the next stage's (or its exit): process "
                               "start, load, work, save, publish, pipeline bookkeeping",
               "launch_s / startup_s / work_s": "from the stage manifest's timing (rank 0): line → process_start → "
                                                "work_start → work_end; null when the stage writes no timing",
               "iteration": "rollout + score + ppo wall times; per GPU = divided by the layout's processes",
               "rollout tokens": "generated (response_token_ids)", "ppo tokens": "(prompt + response) × ppo_epochs",
               "ppo update_tok_s": "ppo tokens / the summed per-step seconds of metrics.jsonl (the optimizer-step "
                                   "loop: actor, and the critic with gae), all ranks together",
               "peak_gpu_gb": "max of nvidia-smi memory.used over all GPUs during the stage (includes other processes)"},
           "inputs": None, "runs": [], "trl": None}
    echo(f"e2e: {dev['name']} × {dev['count']}, workloads {workloads}, layouts {layouts}, budget {args.budget_s:.0f} s → {out}")
    try:
        inv["inputs"] = make_inputs(work, args.tiny, p["prompts"], deadline)
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired) as e:
        inv["inputs"] = {"error": f"making the inputs failed: {e}"}
        write_results(out, inv)
        raise SystemExit(inv["inputs"]["error"]) from None
    paths = {k: inv["inputs"][k] for k in ("actor", "rm", "prompts")}
    echo(f"inputs: {'reused' if inv['inputs']['reused'] else 'made in %.1f s' % inv['inputs']['seconds']} in {work}/inputs")
    write_results(out, inv)

    # TRL first: it is short and predictable, and whatever it leaves goes to the llamarl runs.
    jobs = [("trl", "grpo", None)] if "grpo" in workloads and not args.skip_trl else []
    jobs += [("llamarl", w, lay) for w in ("grpo", "ppo") if w in workloads for lay in layouts]
    reserve = {"llamarl": 60 if args.tiny else 150, "trl": 60 if args.tiny else 90}
    gpus = GpuMemory()
    try:
        for j, (kind, workload, lay) in enumerate(jobs):
            now = time.time()
            later = sum(reserve[k] for k, _, _ in jobs[j + 1:])
            job_deadline = min(deadline, max(deadline - later, now + min(reserve[kind], deadline - now)))
            if now >= deadline - 1:
                echo(f"[{'TRL' if kind == 'trl' else f'llamarl {workload} {lay}'}] not started: the budget is spent")
                skipped = {"status": "not run", "error": "budget spent before it could start"}
                if kind == "trl":
                    inv["trl"] = {**skipped, "iterations": []}
                else:
                    inv["runs"].append({"workload": workload, "layout": lay, **skipped, "stages": {}, "iteration": {}})
                continue
            if kind == "trl":
                echo(f"[TRL GRPOTrainer] {args.trl_iterations} iteration(s), deadline in {job_deadline - now:.0f} s")
                inv["trl"] = run_trl(work, paths, p, job_deadline, args.trl_iterations,
                                     args.trl_gradient_checkpointing == "on", args.trl_python, echo)
                write_results(out, inv)
                continue
            world = parse_layout(lay)["tp"] * parse_layout(lay)["dp"]
            spec, run_dir = write_spec(work, paths, workload, lay, p, export_procs)
            echo(f"[llamarl {workload} {lay}] {spec}, deadline in {job_deadline - now:.0f} s")
            log = f"{work}/logs/{workload}-{lay}.log"
            res = run_pipeline(spec, run_dir, job_deadline, args.stage_timeout_s, log, echo)
            stages = measure_run(run_dir, res, world, gpus, workload)
            ok = res["rc"] == 0 and not res["killed"]
            run = {"workload": workload, "layout": lay, "layout_detail": parse_layout(lay), "processes": world,
                   "spec": spec, "log": log, "status": "ok" if ok else ("timeout" if res["killed"] else "failed"),
                   "error": None if ok else (res["killed"] or res["error"] or res["exception"] or f"exit status {res['rc']}"),
                   "stages": stages, "iteration": iteration_numbers(stages, res, world)}
            inv["runs"].append(run)
            if not args.keep_runs:
                shutil.rmtree(run_dir, ignore_errors=True)
            write_results(out, inv)
            it = run["iteration"]
            echo(f"  {run['status']}" + (f": iteration {it['wall_s']} s, {it['generated_tok_s_per_gpu']:,.0f} generated "
                                        f"tok/s/GPU, {it['trained_tok_s_per_gpu']:,.0f} trained tok/s/GPU"
                                        if it.get("complete") else f": {run['error']}"))
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
