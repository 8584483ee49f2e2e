"""Markdown tables for docs/benchmarks.md, made from the JSON files in bench/results/.

    python bench/report.py            # prints the tables; paste them under "Measured" in the docs

Only what the files say: every row names its file, and ratios are within one file (one run).
"""

from __future__ import annotations

import glob
import json
import os

RESULTS = os.path.join(os.path.dirname(__file__), "results")
STAGES = ("shard/actor", "shard/rm", "iter-001/rollout", "iter-001/scores", "iter-001/ppo", "export")


def _fmt(x, spec=",.0f"):
    return "–" if x is None else format(x, spec)


def e2e(path: str) -> list[str]:
    data = json.load(open(path))
    out = []
    for inv in data["invocations"]:
        trl = inv.get("trl") or {}
        timed = (trl.get("iterations") or [None])[-1]
        for run in inv["runs"]:
            it = run.get("iteration") or {}
            out.append(f"\n**{run['workload']} at {run['layout']}** — {inv['device']['name']} × {inv['device']['count']}, "
                       f"{inv['date']} (`{os.path.basename(path)}`, invocation {inv['id']})\n")
            out.append("| stage | wall s | process start → work s | work s | throughput (wall) | peak GPU GB |")
            out.append("|---|---|---|---|---|---|")
            for name in STAGES:
                s = run["stages"].get(name)
                if not s:
                    continue
                if "generated_tokens" in s:
                    tput = f"{_fmt(s.get('tok_s_per_gpu_wall'))} gen tok/s/GPU"
                elif "trained_tokens" in s:
                    tput = (f"{_fmt(s.get('tok_s_per_gpu_wall'))} trained tok/s/GPU; update loop "
                            f"{_fmt(s.get('update_tok_s'))} tok/s; phases s: "
                            + ", ".join(f"{k} {v:.1f}" for k, v in (s.get("phases_s") or {}).items()))
                elif "bytes" in s:
                    tput = f"{s.get('gb_s_wall')} GB/s"
                else:
                    tput = f"{_fmt(s.get('seq_s_wall'), ',.1f')} seq/s"
                out.append(f"| {name} | {_fmt(s.get('wall_s'), '.1f')} | {_fmt(s.get('to_first_work_s'), '.1f')} | "
                           f"{_fmt(s.get('work_s'), '.1f')} | {tput} | {_fmt(s.get('peak_gpu_gb'), '.1f')} |")
            if it:
                line = (f"| **iteration** (rollout + score + ppo) | **{it['wall_s']:.1f}** | | | "
                        f"**{_fmt(it['generated_tok_s_per_gpu'])} gen, {_fmt(it['trained_tok_s_per_gpu'])} trained "
                        f"tok/s/GPU**; with shard + export {it['wall_with_shard_export_s']:.1f} s | |")
                out.append(line)
            if run["workload"] == "grpo" and timed:
                ratio = (it.get("vs_trl") or {}).get("generated_tok_s_per_gpu_ratio")
                out.append(f"| TRL {inv['versions'].get('trl')} GRPOTrainer, same run, iteration {timed['iteration']} "
                           f"| {timed['seconds']:.1f} | | | {_fmt(timed['generated_tok_s'])} gen tok/s/GPU; "
                           f"llamarl/TRL = **{ratio}×** | {timed.get('peak_gpu_gb_allocated')} (allocated) |")
    return out


def train_step(path: str) -> list[str]:
    r = json.load(open(path))
    out = [f"\n**train step** — {r['device']}, {r['date']} (`{os.path.basename(path)}`), {r['tokens_per_step']} "
           "tokens a step, bf16\n"]
    names = [n for n in ("llamarl", "llamarl-eager", "hf") if isinstance(r.get(n), dict)]
    if not names:  # files before 2026-11-24: flat keys only
        return out + ["| | tokens/s | MFU | peak GB |", "|---|---|---|---|",
                      f"| llamarl | {r['llamarl_tok_s']:,.0f} | {r['llamarl_mfu']:.1%} | {r['llamarl_peak_gb']:.1f} |",
                      f"| HF | {r['hf_tok_s']:,.0f} | {r['hf_mfu']:.1%} | {r['hf_peak_gb']:.1f} |",
                      f"| ratio | {r['ratio_llamarl_over_hf']:.2f}× | | |"]
    hf = r["hf"]
    out += ["| | tokens/s | MFU | peak GB | step ms (median, min–max) | tokens/s vs HF | peak memory vs HF |",
            "|---|---|---|---|---|---|---|"]
    for n in names:
        v = r[n]
        out.append(f"| {n} | {v['tok_s']:,.0f} | {v['mfu']:.1%} | {_fmt(v['peak_gb'], '.1f')} | "
                   f"{v['step_s_median'] * 1e3:.1f} ({v['step_s_min'] * 1e3:.1f}–{v['step_s_max'] * 1e3:.1f}) | "
                   f"{v['tok_s'] / hf['tok_s']:.2f}× | "
                   + (f"{v['peak_gb'] / hf['peak_gb']:.2f}× |" if v['peak_gb'] and hf['peak_gb'] else "– |"))
    profiled = [n for n in names if r[n].get("profile")]
    if profiled:
        cats = list(r[profiled[0]]["profile"]["ms"])
        out += ["", "Where a step's GPU time goes (`--profile`, ms per step and share of the step's GPU span):", "",
                "| category | " + " | ".join(profiled) + " |", "|---|" + "---|" * len(profiled)]
        for c in cats:
            cells = []
            for n in profiled:
                p = r[n]["profile"]
                cells.append(f"{p['ms'][c]:.1f} ({p['ms'][c] / p['step_ms']:.0%})")
            out.append(f"| {c} | " + " | ".join(cells) + " |")
        out.append("| **GPU span of a step** | " + " | ".join(f"**{r[n]['profile']['step_ms']:.1f}**" for n in profiled) + " |")
    return out


def gpu_checks(path: str) -> list[str]:
    out = [f"\n**GPU checks** (`{os.path.basename(path)}`, from `pytest -m gpu tests/test_gpu.py`)\n",
           "| check | GPUs | result |", "|---|---|---|"]
    for line in open(path):
        r = json.loads(line)
        nums = {k: v for k, v in r.items() if k not in ("check", "gpu", "gpus", "torch", "stages")}
        out.append(f"| {r['check']} | {r['gpus']} × {r['gpu']} | "
                   + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in nums.items()) + " |")
    return out


def main() -> None:
    lines = []
    for path in sorted(glob.glob(f"{RESULTS}/e2e-*.json")):
        lines += e2e(path)
    for path in sorted(glob.glob(f"{RESULTS}/train_step-*.json")):
        lines += train_step(path)
    for path in sorted(glob.glob(f"{RESULTS}/gpu-checks-*.jsonl")):
        lines += gpu_checks(path)
    print("\n".join(lines))


if __name__ == "__main__":
    main()
