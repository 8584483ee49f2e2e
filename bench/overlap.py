"""The demo with ``max_staleness`` 0 and 1 (nothing else differs) on the overlap placement of
``python -m llamarl.pipeline.demo --overlap``: every stage on one process, two stages at once.

    python bench/overlap.py --repeats 3        # fresh runs of each, alternating which goes first

Prints every run, the median walls and the median of each back-to-back pair's ratio (on a machine
others share, a pair sees about the same load), and writes them to DEMO_DIR/compare-overlap.json
(``LLAMARL_DEMO_DIR``, default demo-run). docs/pipeline.md "Overlapped iterations" has its numbers.
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

from llamarl.pipeline.demo import DEMO_DIR, OVERLAP_EXECUTOR, OVERLAP_LAYOUT, make_inputs


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
    """``repeats`` fresh runs each of the demo with max_staleness 0 and 1 (alternating which goes
    first) under ``root``: every run, the median walls and the pairs' ratios, printed, returned
    and written to ROOT/compare-overlap.json."""
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
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--repeats", type=int, default=2, help="fresh runs of each (default 2)")
    args = ap.parse_args(argv)
    os.makedirs(DEMO_DIR, exist_ok=True)
    compare_overlap(DEMO_DIR, max(1, args.repeats))


if __name__ == "__main__":
    main()
