"""The rollout stage alone, as a user runs it: ``llamarl stage rollout`` on the 1B actor of
``bench/e2e.py`` (its inputs, the grpo workload's sampling), and where its wall time goes.

For each ``--prompts`` count it runs the stage ``--repeats`` times, each into a fresh output;
the invocation's first run finds empty compile caches (``TORCHINDUCTOR_CACHE_DIR``,
``TRITON_CACHE_DIR``: cold), later ones what it left (warm). Per run: the command's wall, the
process's wall (its start to its manifest), the engine's own time (``stats.engine_s``) and issue
15's ratio ``wall / engine`` (goal ≤ 1.15) for both, rank 0's ``spans_s`` and ``background_s``.
``--stacks`` samples every thread's Python stack (``LLAMARL_STACKS_DIR``, lib/runtime/stack_sampler.py:
``WORK/<run>-stacks/rank-0-<PID>.stacks.jsonl``, timestamped: cut it by the manifest's spans).

    python bench/rollout_stage.py --prompts 256,1216 --repeats 2

Results: bench/results/rollout_stage-<gpu>-<date>.json (``--out`` to change).
"""

from __future__ import annotations

import argparse
import datetime
import glob
import json
import os
import shutil
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/e2e.py, even under PYTHONSAFEPATH
import e2e  # noqa: E402


def _stage(argv: list[str], env: dict, cwd: str, log: str, timeout: float) -> tuple[int, float]:
    t = time.time()
    with open(log, "w") as f:
        rc = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "stage", *argv], stdout=f,
                            stderr=subprocess.STDOUT, env=env, cwd=cwd, timeout=timeout).returncode
    return rc, time.time() - t


def _prompt_file(source: str, n: int, path: str) -> str:
    with open(source) as f:
        lines = f.readlines()
    if len(lines) < n:
        raise SystemExit(f"{source} has {len(lines)} prompts, fewer than {n}")
    with open(path, "w") as f:
        f.writelines(lines[:n])
    return path


def run_once(work: str, actor: str, prompts: str, cfg: str, env: dict, name: str, stacks: bool,
             deadline: float) -> dict:
    out = f"{work}/out/{name}"
    shutil.rmtree(out, ignore_errors=True)
    argv = ["rollout", actor, prompts, out, "--config", cfg]
    log = f"{work}/{name}.log"
    stacks_dir = f"{work}/{name}-stacks" if stacks else None
    if stacks_dir:
        shutil.rmtree(stacks_dir, ignore_errors=True)
        env = {**env, "LLAMARL_STACKS_DIR": stacks_dir}
    rc, wall = _stage(argv, env, work, log, max(deadline - time.time(), 1))
    res = {"name": name, "rc": rc, "command_wall_s": round(wall, 3)}
    with open(log) as f:
        res["tail"] = f.read()[-1500:]
    try:
        with open(f"{out}/llamarl.json") as f:  # the manifest (lib/files/publish.py)
            m = json.load(f)
    except OSError:
        return res
    engine, timing = m["stats"]["engine_s"], m["timing"]
    process_wall = timing["work_end"] - timing["process_start"] if timing.get("process_start") else None
    res.update(engine_s=engine, new_tokens=m["stats"]["new_tokens"], rows=m["rows"],
               engine_tok_s=round(m["stats"]["new_tokens"] / engine), spans_s=m.get("spans_s"),
               background_s=m.get("background_s"), process_wall_s=process_wall and round(process_wall, 3),
               command_wall_over_engine=round(wall / engine, 3),
               process_wall_over_engine=process_wall and round(process_wall / engine, 3),
               stacks=stacks_dir and next(iter(glob.glob(f"{stacks_dir}/rank-0-*.stacks.jsonl")), None))
    return res


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", default="/tmp/e2e", help="work dir, shared with bench/e2e.py's inputs (default /tmp/e2e)")
    ap.add_argument("--prompts", default="256", help="comma-separated prompt counts, each its own runs (default 256)")
    ap.add_argument("--repeats", type=int, default=2, help="runs per prompt count (default 2: cold, then warm)")
    ap.add_argument("--stacks", action="store_true", help="sample every thread's stack (LLAMARL_STACKS_DIR)")
    ap.add_argument("--budget-s", type=float, default=500, help="the whole script ends within this (default 500)")
    ap.add_argument("--tiny", action="store_true", help="CPU smoke run: the tiny actor, 16 new tokens")
    ap.add_argument("--out", help="results JSON (default bench/results/rollout_stage-<gpu>-<date>.json)")
    args = ap.parse_args()
    deadline = time.time() + args.budget_s
    counts = [int(x) for x in args.prompts.split(",")]
    work = os.path.abspath(args.work)
    os.makedirs(work, exist_ok=True)
    p = e2e.workload_params("tiny" if args.tiny else "1b", max(counts))
    inputs = e2e.make_inputs(work, "tiny" if args.tiny else "1b", max(counts), deadline)
    env = {**os.environ, "PYTHONUNBUFFERED": "1", "COLUMNS": "200"}
    actor = f"{work}/actor-tp1"
    if not os.path.exists(f"{actor}/llamarl.json"):
        rc, _ = _stage(["shard", inputs["actor"], actor, "--tp", "1"], env, work, f"{work}/shard.log", 600)
        if rc:
            raise SystemExit(f"shard failed: {work}/shard.log")
    cache = f"{work}/compile-cache"  # empty at the invocation's first run: that run compiles cold
    shutil.rmtree(cache, ignore_errors=True)
    env.update(TORCHINDUCTOR_CACHE_DIR=cache, TRITON_CACHE_DIR=f"{cache}/triton")
    import yaml

    cfg = f"{work}/rollout-stage.yaml"
    with open(cfg, "w") as f:
        yaml.safe_dump({"id_column": "id", "chunk_size": p["chunk_size"], "max_batch": p["max_batch"],
                        "sampling": {"samples_per_prompt": p["samples"], "max_new_tokens": p["max_new_tokens"],
                                     "temperature": 1.0, "seed": 0}}, f)
    device = e2e.device_info()
    res = {"bench": "rollout_stage", "date": datetime.date.today().isoformat(), "device": device,
           "versions": e2e.versions(), "argv": sys.argv[1:], "workload": p, "runs": []}
    for n in counts:
        prompts = _prompt_file(inputs["prompts"], n, f"{work}/prompts-{n}.jsonl")
        for i in range(args.repeats):
            if time.time() > deadline - 30:
                res["stopped"] = "budget"
                break
            r = run_once(work, actor, prompts, cfg, env, f"p{n}-r{i}", args.stacks, deadline)
            r.update(prompts=n, caches="cold" if not res["runs"] else "warm")
            res["runs"].append(r)
            print(json.dumps({k: v for k, v in r.items() if k != "tail"}), flush=True)
    gpu = device["slug"]
    path = args.out or os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                    f"rollout_stage-{gpu}-{res['date']}.json")
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        json.dump(res, f, indent=1)
    print(f"results: {path}")


if __name__ == "__main__":
    main()
