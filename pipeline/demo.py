"""``make demo``: the whole pipeline on CPU at TP=2, on tiny models it makes itself.

A tiny random Llama actor with its tokenizer, a tiny reward model with a *different* tokenizer (so
scoring re-tokenizes) and a prompts file, then a run spec of shard → 3 × (rollout → score → ppo) →
export with the local executor (2 processes per stage, gloo). The reward is the RM's score plus a
rule the tiny actor learns quickly (the share of vowels in its response), so the mean score
visibly rises. Rerunning resumes: finished stages are skipped. ``--help`` lists the variants.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
import typing

import yaml

DEMO_DIR = os.environ.get("LLAMARL_DEMO_DIR", "demo-run")
# The overlap placement on a small machine: one process (one core) a stage, two stages at once, so that
# with max_staleness 1 a rollout runs on one core while the ppo before it trains on the other.
OVERLAP_LAYOUT = {"shard": {"tp": 1}, "rollout": {"tp": 1}, "score": {"tp": 1}, "ppo": {"tp": 1}, "export": {"procs": 1}}
OVERLAP_EXECUTOR = {"kind": "local", "options": {"threads_per_process": 1, "max_concurrent_stages": 2}}


def vowel_ratio(response: str, row: dict) -> float:
    """The share of letters in the response that are vowels (a dense, learnable reward)."""
    letters = [c for c in response.lower() if c.isalpha()]
    return sum(c in "aeiou" for c in letters) / len(letters) if letters else 0.0


def make_inputs(root: str, staleness: int | None = None, policy_loss: str = "ppo") -> str:
    """Models, prompts and the run spec under ``root``; returns the spec's path. ``staleness``
    None: the demo of ``make demo`` (``demo.yaml``, run ``demo``); 0 or 1: the overlap placement
    with that ``max_staleness`` (``demo-s0.yaml``, run ``demo-s0``; ``demo-s1`` …). Another
    ``policy_loss`` than ppo's own is a run of its own, its name suffixed (``demo-gspo``)."""
    from llamarl.pipeline import toy

    inputs = os.path.join(root, "inputs")
    if not os.path.exists(os.path.join(inputs, "actor", "config.json")):
        toy.make_llama(os.path.join(inputs, "actor"), tokenizer_corpus=toy.CORPUS_A)
        toy.make_llama(os.path.join(inputs, "rm"), kind="score", seed=1, tokenizer_corpus=toy.CORPUS_B)
        toy.make_prompts(os.path.join(inputs, "prompts.jsonl"), n=32)
    if not os.path.exists(os.path.join(inputs, "validation.jsonl")):
        toy.make_prompts(os.path.join(inputs, "validation.jsonl"), n=8, first=1000, id_prefix="v")
    name = ("demo" if staleness is None else f"demo-s{staleness}") + ("" if policy_loss == "ppo" else f"-{policy_loss}")
    spec = {
        "name": name,
        "storage": os.path.abspath(root),
        "actor": os.path.abspath(os.path.join(inputs, "actor")),
        "reward_model": os.path.abspath(os.path.join(inputs, "rm")),
        "prompts": os.path.abspath(os.path.join(inputs, "prompts.jsonl")),
        "seed": 0,
        "iterations": 3,
        # The held-out prompts, validated after every iteration: metrics.png draws them beside the training score.
        "validation": {"prompts": os.path.abspath(os.path.join(inputs, "validation.jsonl")), "every": 1,
                       "pass_threshold": 0.5},
        "layout": {"shard": {"tp": 2}, "rollout": {"tp": 2}, "score": {"tp": 2}, "ppo": {"tp": 2}, "export": {"procs": 2}},
        "rollout": {"id_column": "id", "chunk_size": 32, "max_batch": 64,
                    "sampling": {"samples_per_prompt": 4, "max_new_tokens": 12, "temperature": 1.0}},
        "score": {"rewards": [{"name": "rm", "weight": 0.1},
                              {"name": "llamarl.pipeline.demo:vowel_ratio", "weight": 1.0}]},
        "ppo": {"mini_batch_size": 32, "ppo_epochs": 2, "actor_lr": 0.01, "critic_lr": 0.01, "kl_coef": 0.01,
                "micro_batch_tokens": 4096, "seed": 0},
        "export": {},
    }
    if staleness is not None:
        spec.update(max_staleness=staleness, layout=OVERLAP_LAYOUT, executor=OVERLAP_EXECUTOR)
    if policy_loss != "ppo":
        spec["ppo"]["policy_loss"] = policy_loss
    path = os.path.join(root, f"{name}.yaml")
    with open(path, "w") as f:
        yaml.safe_dump(spec, f, sort_keys=False)
    return path


def timed_run(spec: str, log: str) -> dict:
    """A fresh `llamarl run SPEC` (its run directory removed first): its wall time, the CPU time of
    it and its stages, the machine's load average (1 min) before and after, and the mean score of
    each iteration."""
    from llamarl.pipeline.dag import load_spec

    run_dir = load_spec(spec).run_dir
    shutil.rmtree(run_dir, ignore_errors=True)
    cpu, load = _children_cpu_s(), os.getloadavg()[0]
    started = time.monotonic()
    with open(log, "w") as out:
        proc = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "run", spec], stdout=out,
                              stderr=subprocess.STDOUT)
    wall = time.monotonic() - started
    cpu = _children_cpu_s() - cpu
    if proc.returncode:
        raise SystemExit(f"`llamarl run {spec}` failed (exit status {proc.returncode}); see {log}")
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        scores = [json.loads(line)["mean_score"] for line in f if line.strip()]
    return {"wall_s": round(wall, 1), "cpu_s": round(cpu, 1), "load": [round(load, 2), round(os.getloadavg()[0], 2)],
            "mean_score": [round(s, 4) for s in scores]}


def _children_cpu_s() -> float:
    """User + system seconds of every finished child process (and theirs)."""
    import resource

    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def compare_overlap(root: str, repeats: int) -> dict:
    """The demo with max_staleness 0 and 1 (nothing else differs) on the overlap placement,
    ``repeats`` fresh runs each (alternating which goes first); prints, returns and writes to
    ROOT/compare-overlap.json every run, the median walls and the median of each back-to-back
    pair's ratio (on a machine others share, a pair sees about the same load)."""
    specs = {s: make_inputs(root, s) for s in (0, 1)}
    os.makedirs(os.path.join(root, "logs"), exist_ok=True)
    print(f"overlap comparison: {os.cpu_count()} cores, every stage on 1 process, max_concurrent_stages 2, "
          f"3 iterations, {repeats} fresh run(s) each", flush=True)
    runs: dict[int, list[dict]] = {0: [], 1: []}
    for r in range(repeats):
        for s in ((0, 1) if r % 2 == 0 else (1, 0)):
            result = timed_run(specs[s], os.path.join(root, "logs", f"demo-s{s}-{r + 1}.log"))
            runs[s].append(result)
            print(f"  max_staleness {s}, run {r + 1}: {result['wall_s']:6.1f} s (CPU {result['cpu_s']:.0f} s, load "
                  f"{result['load'][0]:.1f} → {result['load'][1]:.1f})   mean score "
                  + " → ".join(f"{x:.3f}" for x in result["mean_score"]), flush=True)
    median = {s: statistics.median(x["wall_s"] for x in runs[s]) for s in runs}
    pairs = [a["wall_s"] / b["wall_s"] for a, b in zip(runs[0], runs[1])]
    summary = {"cores": os.cpu_count(), "repeats": repeats, "placement": {"layout": OVERLAP_LAYOUT,
                                                                         "executor": OVERLAP_EXECUTOR},
               "runs": {f"max_staleness_{s}": runs[s] for s in runs},
               "median_wall_s": {f"max_staleness_{s}": median[s] for s in runs},
               "speedup": round(median[0] / median[1], 3), "pair_speedups": [round(x, 3) for x in pairs],
               "median_pair_speedup": round(statistics.median(pairs), 3)}
    with open(os.path.join(root, "compare-overlap.json"), "w") as f:
        json.dump(summary, f, indent=1)
    print(f"median wall: sequential (max_staleness 0) {median[0]:.1f} s, overlapped (max_staleness 1) "
          f"{median[1]:.1f} s: {summary['speedup']:.2f}x (run by run: "
          f"{', '.join(f'{x:.2f}x' for x in pairs)})", flush=True)
    return summary


def main(argv: list[str] | None = None) -> None:
    from llamarl.stages.config import PPOConfig

    ap = argparse.ArgumentParser(prog="python -m llamarl.pipeline.demo", description=__doc__.split("\n\n")[0])
    how = ap.add_mutually_exclusive_group()
    how.add_argument("--overlap", action="store_true", help="run the demo overlapped: max_staleness 1, every stage "
                                                            "on 1 process, 2 stages at once (run demo-s1)")
    how.add_argument("--compare-overlap", action="store_true", help="time fresh runs with max_staleness 0 and 1 "
                                                                    "on that placement and print both walls")
    ap.add_argument("--repeats", type=int, default=2, help="--compare-overlap: fresh runs of each (default 2)")
    ap.add_argument("--policy-loss", choices=typing.get_args(PPOConfig.model_fields["policy_loss"].annotation),
                    default="ppo", help="ppo's policy_loss (docs/rl.md); another than ppo is a run of its own, "
                                        "demo-MODE")
    args = ap.parse_args(argv)
    if args.compare_overlap and args.policy_loss != "ppo":
        ap.error("--policy-loss does not apply to --compare-overlap")
    os.makedirs(DEMO_DIR, exist_ok=True)
    if args.compare_overlap:
        compare_overlap(DEMO_DIR, max(1, args.repeats))
        return
    from llamarl.pipeline.cli import app

    spec = make_inputs(DEMO_DIR, 1 if args.overlap else None, args.policy_loss)
    print(f"run spec: {spec}", flush=True)
    sys.argv = ["llamarl", "run", spec]
    app()


if __name__ == "__main__":
    main()
