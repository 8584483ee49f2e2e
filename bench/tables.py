"""Markdown tables of one results file each, for docs/benchmarks.md (bench/report.py chooses the files).

``RENDER`` maps a bench (the start of a results file's name) to the function that renders its
files: only what a file says, every table naming its file, every ratio within that file (one run).
"""

from __future__ import annotations

import json
import os
import re


def _fmt(x, spec=",.0f"):
    return "–" if x is None else format(x, spec)


def _load(path: str):
    with open(path) as f:
        return [json.loads(line) for line in f] if path.endswith(".jsonl") else json.load(f)


def discard(disk: dict | None) -> str | None:
    """"with `discard`" or "without `discard`": how a run's disk was mounted (``DiskActivity``'s
    ``mount_options``), None where the run did not record it."""
    options = (disk or {}).get("mount_options")
    if options is None:
        return None
    return "with `discard`" if "discard" in options.split(",") else "without `discard`"


def e2e(path: str) -> list[str]:
    out = []
    for inv in _load(path)["invocations"]:
        trl = inv.get("trl") or {}
        timed = (trl.get("iterations") or [None])[-1]
        for run in inv["runs"]:
            it, its = run.get("iteration") or {}, run.get("iterations") or {}
            stale = f", max_staleness {run['max_staleness']}" if run.get("max_staleness") else ""
            out.append(f"\n**{run['workload']} at {run['layout']}{stale}** — {inv['device']['name']} × "
                       f"{inv['device']['count']}, {inv['date']} (`{os.path.basename(path)}`, invocation {inv['id']})\n")
            out.append("| stage | wall s | process start → work s | work s | throughput (wall) | peak GPU GB |")
            out.append("|---|---|---|---|---|---|")
            for name, s in run["stages"].items():  # in the run's order (bench/e2e.py's run_nodes)
                if s.get("status") == "ok" and name.split("/")[-1] == "scores" and (
                        s.get("made_elsewhere") or (s.get("wall_s") is not None and s["wall_s"] <= 0.05)):
                    out.append(f"| {name} | – | – | – | scored in the rollout | – |")
                elif s.get("status") != "not run":
                    out.append(f"| {name} | {_fmt(s.get('wall_s'), '.1f')} | {_fmt(s.get('to_first_work_s'), '.1f')} | "
                               f"{_fmt(s.get('work_s'), '.1f')} | {_throughput(s)} | {_fmt(s.get('peak_gpu_gb'), '.1f')} |")
            if it:
                out.append(f"| **iteration** (rollout + score + ppo) | **{it['wall_s']:.1f}** | | | "
                           f"**{_fmt(it['generated_tok_s_per_gpu'])} gen, {_fmt(it['trained_tok_s_per_gpu'])} trained "
                           f"tok/s/GPU**; with shard + export {it['wall_with_shard_export_s']:.1f} s | |")
            if its.get("complete"):
                out.append(f"| **{its['iterations']} iterations** (first rollout → last ppo) | **{its['wall_s']:.1f}** "
                           f"| | | **{_fmt(its['generated_tok_s_per_gpu'])} gen, {_fmt(its['trained_tok_s_per_gpu'])} "
                           f"trained tok/s/GPU**; two stages at once {its['two_stages_at_once_s']:.1f} s | |")
            if disk := run.get("disk"):
                mounted = "" if (how := discard(disk)) is None else f", mounted {how}"
                out.append(f"| disk (device {disk['device']}{mounted}, the whole `llamarl run`) | | | | "
                           f"{disk['written_gb']:.1f} GB written ({_fmt(disk['written_gb_per_s'], '.2f')} GB/s), "
                           f"{disk['discarded_gb']:.1f} GB discarded; page cache dirty at most "
                           f"{disk['dirty_gb_max']:.1f} GB, {disk['dirty_gb_mean']:.1f} on average"
                           + (f" (the kernel's limit at least {disk['dirty_limit_gb_min']:.1f} GB)"
                              if "dirty_limit_gb_min" in disk else "") + " | |")
            ratio = _vs_trl(inv, run)
            if timed and ratio is not None:
                out.append(f"| TRL {inv['versions'].get('trl')} GRPOTrainer, same run, iteration {timed['iteration']} "
                           f"| {timed['seconds']:.1f} | | | {_fmt(timed['generated_tok_s'])} gen tok/s/GPU; "
                           f"llamarl/TRL = **{ratio:.3g}×** | {timed.get('peak_gpu_gb_allocated')} (allocated) |")
                whole = _trl_whole(trl)
                if its.get("complete") and whole and len(trl["iterations"]) > 1:
                    out.append(f"| TRL, all {len(trl['iterations'])} iterations (its cold first included, as in "
                               f"llamarl's row above) | {sum(i['seconds'] for i in trl['iterations']):.1f} | | | "
                               f"{_fmt(whole)} gen tok/s/GPU; llamarl/TRL, whole runs = "
                               f"**{its['generated_tok_s_per_gpu'] / whole:.3g}×** | |")
    return out


def _trl_whole(trl: dict) -> float | None:
    """TRL's generated tok/s/GPU over all its iterations, the first (cold) one included: what
    llamarl's rate over its iterations compares with like for like."""
    its = trl.get("iterations") or []
    seconds = sum(i["seconds"] for i in its)
    return sum(i["generated_tokens"] for i in its) / seconds if seconds and all("generated_tokens" in i for i in its) else None


def _throughput(s: dict) -> str:
    if "generated_tokens" in s:
        text = f"{_fmt(s.get('tok_s_per_gpu_wall'))} gen tok/s/GPU"
        if s.get("wall_over_engine"):
            text += (f"; engine {s['engine_s']:.1f} s, wall / engine {s['wall_over_engine']:.2f}×, "
                     f"work / engine {s['work_over_engine']:.2f}×")
        return text
    if "trained_tokens" in s:
        return (f"{_fmt(s.get('tok_s_per_gpu_wall'))} trained tok/s/GPU; update loop {_fmt(s.get('update_tok_s'))} "
                "tok/s; phases s: " + ", ".join(f"{k} {v:.1f}" for k, v in (s.get("phases_s") or {}).items()))
    if "bytes" in s:
        return f"{s.get('gb_s_wall')} GB/s"
    return f"{_fmt(s.get('seq_s_wall'), ',.1f')} seq/s"


def _vs_trl(inv: dict, run: dict) -> float | None:
    """llamarl's generated tok/s/GPU over TRL's, same invocation (one iteration or several); none
    where TRL did not finish (a timeout's rate is of its cold first iteration alone)."""
    it = run.get("iterations") or run.get("iteration") or {}
    if (inv.get("trl") or {}).get("status") not in (None, "ok"):
        return None
    trl = (inv.get("trl") or {}).get("generated_tok_s_per_gpu")
    if (it.get("vs_trl") or {}).get("generated_tok_s_per_gpu_ratio") is not None:
        return it["vs_trl"]["generated_tok_s_per_gpu_ratio"]
    return it["generated_tok_s_per_gpu"] / trl if trl and it.get("complete") and run["workload"] == "grpo" else None


def train_step(path: str) -> list[str]:
    r = _load(path)
    out = [f"\n**train step** — {r['device']}, {r['date']} (`{os.path.basename(path)}`), {r['tokens_per_step']} "
           "tokens a step, bf16\n"]
    names = [n for n in r.get("variants", ("llamarl", "llamarl-eager", "hf")) if isinstance(r.get(n), dict)]
    if not names:  # the oldest files: flat keys only
        return out + ["| | tokens/s | MFU | peak GB |", "|---|---|---|---|",
                      f"| llamarl | {r['llamarl_tok_s']:,.0f} | {r['llamarl_mfu']:.1%} | {r['llamarl_peak_gb']:.1f} |",
                      f"| HF | {r['hf_tok_s']:,.0f} | {r['hf_mfu']:.1%} | {r['hf_peak_gb']:.1f} |",
                      f"| ratio | {r['ratio_llamarl_over_hf']:.2f}× | | |"]
    hf, raw = r.get("hf"), r.get("llamarl")
    ppo = any("ppo" in r[n] for n in names)
    out += ["| | tokens/s | MFU | peak GB | step ms (median, min–max) | tokens/s vs HF | peak memory vs HF"
            + (" | tokens/s vs llamarl | micro-batches |" if ppo else " |"),
            "|---|---|---|---|---|---|---|" + ("---|---|" if ppo else "")]
    for n in names:
        v = r[n]
        row = (f"| {n} | {v['tok_s']:,.0f} | {v['mfu']:.1%} | {_fmt(v['peak_gb'], '.1f')} | "
               f"{v['step_s_median'] * 1e3:.1f} ({v['step_s_min'] * 1e3:.1f}–{v['step_s_max'] * 1e3:.1f}) | "
               + (f"{v['tok_s'] / hf['tok_s']:.2f}× | " if hf else "– | ")
               + (f"{v['peak_gb'] / hf['peak_gb']:.2f}× |" if hf and v['peak_gb'] and hf['peak_gb'] else "– |"))
        if ppo:
            micro = v.get("ppo", {}).get("micro_batches")
            row += (f" **{v['tok_s'] / raw['tok_s']:.2f}×** |" if "ppo" in v and raw else " |") + f" {_fmt(micro, 'd')} |"
        out.append(row)
    profiled = [n for n in names if r[n].get("profile")]
    if profiled:
        cats = [c for c in r[profiled[0]]["profile"]["ms"]
                if c == "idle" or any(r[n]["profile"]["ms"].get(c) for n in profiled)]
        out += ["", "Where a step's GPU time goes (`--profile`, ms per step and share of the step's GPU span):", "",
                "| category | " + " | ".join(profiled) + " |", "|---|" + "---|" * len(profiled)]
        for c in cats:
            cells = [f"{r[n]['profile']['ms'].get(c, 0.0):.1f} "
                     f"({r[n]['profile']['ms'].get(c, 0.0) / r[n]['profile']['step_ms']:.0%})" for n in profiled]
            out.append(f"| {c} | " + " | ".join(cells) + " |")
        out.append("| **GPU span of a step** | " + " | ".join(f"**{r[n]['profile']['step_ms']:.1f}**" for n in profiled) + " |")
    return out


def rollout(path: str) -> list[str]:
    r = _load(path)
    out = [f"\n**rollout engine** — {r['device']}, {r['date']} (`{os.path.basename(path)}`), prompts of "
           f"{r['prompt_len']} → {r['new_tokens']} new tokens, {r['sampling']}\n"]
    if r.get("fixed"):
        out += ["| batch | llamarl new tok/s | HF static compiled | ratio | bandwidth bound | measured | fraction of bound |",
                "|---|---|---|---|---|---|---|"]
    hf = r.get("hf_static_compiled") or {}
    for bs, v in (r.get("fixed") or {}).items():
        ratio = f"**{v['new_tok_s'] / hf['new_tok_s']:.2f}×**" if hf and int(bs) == hf.get("batch") else ""
        out.append(f"| {bs} | {v['new_tok_s']:,.0f} | {_fmt(hf.get('new_tok_s')) if ratio else ''} | {ratio} | "
                   f"{_fmt(v.get('bandwidth_bound_s'), '.3f')} s | {v['seconds']:.3f} s | "
                   f"{_fmt(v.get('fraction_of_bandwidth_bound'), '.2f')} |")
    out += _rollout_drain(r) + _rollout_parallel(r)
    for cb in _continuous(r):
        out += ["", f"Continuous batching ({cb['slots']} slots, {cb['prompts']} prompts, a stop set of "
                    f"{cb['stop_tokens']} token ids):", "",
                "| prompts | `check_every` | fixed length tok/s | random stops tok/s | ratio | mean length | slot utilisation (stops) |",
                "|---|---|---|---|---|---|---|"]
        for k in sorted((k for k in cb if k.startswith("ratio_every")), key=lambda k: int(k[len("ratio_every"):])):
            e = k[len("ratio_every"):]
            f, s = cb[f"fixed_length_every{e}"], cb[f"random_stops_every{e}"]
            out.append(f"| {cb['prompts']} | {e} | {f['new_tok_s']:,.0f} | {s['new_tok_s']:,.0f} | **{cb[k]:.2f}** | "
                       f"{s['mean_len']:.0f} | {s['slot_utilisation']:.2f} |")
    return out


def _continuous(r: dict) -> list[dict]:
    return [r[k] for k in ("continuous_batching", "continuous_batching_2048_prompts") if r.get(k)]


def _rollout_parallel(r: dict) -> list[str]:
    """``bench/rollout.py --tp N / --dp N``: one GPU against the layout, in the same run."""
    par = r.get("parallel")
    if not par:
        return []
    tp, dp = par["tp"], par["dp"]
    one, lay = r.get("one_gpu") or {}, r.get(f"tp{tp}_dp{dp}") or {}
    out = ["", f"Several devices ({r.get('gpus') or 'CPU'} × {r['device']}, {r.get('backend')}): {par['prompts']} prompts "
               f"in chunks of {par['chunk']}, {par['max_batch']} slots per engine, {par['engine']}:", "",
           "| layout | new tok/s | seconds | tokens | speed-up over one device | efficiency | same tokens as one device |",
           "|---|---|---|---|---|---|---|"]
    if one:
        out.append(f"| one device (TP1) | {one['new_tok_s']:,.0f} | {one['seconds']:.2f} | {one['tokens']:,} | 1.00× | | |")
    if lay:
        out.append(f"| TP{tp} × DP{dp} | {lay['new_tok_s']:,.0f} | {lay['seconds']:.2f} | {lay['tokens']:,} | "
                   f"**{lay['speedup_over_one_gpu']:.2f}×** | {lay['efficiency']:.0%} | {lay['same_tokens_as_one_gpu']:.2f} |")
    else:
        out.append(f"| TP{tp} × DP{dp} | – (not in the file: the run ended before it) | | | | | |")
    return out


def _rollout_drain(r: dict) -> list[str]:
    """``bench/rollout.py --drain-slots``: the batch-invariant stream against the default engine."""
    dr = r.get("drain")
    if not dr:
        return []
    out = ["", f"Batch invariance at a stream's end (the stage's stream: chunks of {dr['chunk']}, random stops from "
               f"{dr['stop_tokens']} stop ids, ≤ {dr['new_tokens']} new tokens; drain: from the window where nothing "
               "is left to admit to the end):", "",
           "| slots | prompts | batch-invariant tok/s | default tok/s | ratio | extra s | drain s (invariant / default) "
           "| drain slot-steps (invariant / default) |", "|---|---|---|---|---|---|---|---|"]
    for row in (v for v in dr.values() if isinstance(v, dict)):
        inv, base = row["batch_invariant"], row["default"]
        out.append(f"| {inv.get('engine_slots', row['slots'])} | {row['prompts']} | {inv['new_tok_s']:,.0f} | "
                   f"{base['new_tok_s']:,.0f} | **{row['invariant_over_default_tok_s']:.2f}** | {row['extra_s']:.2f} | "
                   f"{inv['drain_s']:.2f} / {base['drain_s']:.2f} | {inv['drain_slot_steps']:,} / "
                   f"{base['drain_slot_steps']:,} |")
    return out


def shard_export(path: str) -> list[str]:
    r, sp = _load(path), _load(path)["save_pretrained_s"]
    load = r.get("lib_load_GB_s")
    out = [f"\n**shard / export** — {r['device']}, {r['date']} (`{os.path.basename(path)}`), {r['GB']:.2f} GB bf16, "
           f"{r['procs']} processes, {r['cpus']} CPUs, torch {r.get('torch')}\n",
           "| | seconds (whole command) | stage's own work s | GB/s (whole command) | vs `save_pretrained` |",
           "|---|---|---|---|---|", f"| HF `save_pretrained` | {sp:.2f} | | {r['save_pretrained_GB_s']:.2f} | 1.00× |"]
    for cmd in ("shard", "export"):
        out.append(f"| `llamarl stage {cmd}` | {r[cmd + '_wall_s']:.2f} | {_fmt(r.get(cmd + '_work_s'), '.2f')} | "
                   f"{r[cmd + '_GB_s_wall']:.2f} | **{sp / r[cmd + '_wall_s']:.2f}×** |")
    out += ["", (f"Loading: lib/ `checkpoint.load_model` {load:.2f} GB/s against HF `from_pretrained` "
                 f"{r['from_pretrained_GB_s']:.2f} GB/s: **{load / r['from_pretrained_GB_s']:.2f}×**; " if load else "")
            + f"export bit-identical to the source: {r.get('export_bit_identical')}."]
    if "shard_vs_save_pretrained_paired" in r:
        out.append(f"Each run against the `save_pretrained` just before it (interleaved), median: shard "
                   f"**{r['shard_vs_save_pretrained_paired']:.2f}×**, export **{r['export_vs_save_pretrained_paired']:.2f}×**.")
    return out


def handoff(path: str) -> list[str]:
    r = _load(path)
    m = r["median"]
    out = [f"\n**weight hand-off** — {r['device_full']}, {r['date']} (`{os.path.basename(path)}`), shape {r['shape']}, "
           f"{m['GB']:.2f} GB bf16, median of {len(r['runs'])}{', cold page cache' if r.get('cold') else ''}\n",
           "| save s | verify s | build s | load s | **hand-off s** | save GB/s | verify GB/s | load GB/s | bit-identical |",
           "|---|---|---|---|---|---|---|---|---|",
           f"| {m['save_s']:.2f} | {m['verify_s']:.2f} | {m['build_s']:.2f} | {m['load_s']:.2f} | **{m['handoff_s']:.2f}** | "
           f"{m['save_GB_s']:.2f} | {m['verify_GB_s']:.2f} | {m['load_GB_s']:.2f} | {r['bit_identical']} |"]
    if c := r.get("checksums"):
        out += ["", f"Checksums on one core ({c['MB']:.0f} MB): xxh3_128 {c['xxh3_128_GB_s']:.2f} GB/s, sha256 "
                    f"{c['sha256_GB_s']:.2f}, blake2b {c['blake2b_GB_s']:.2f}; a write {c['write_s']:.2f} s, hashed while "
                    f"written {c['write_hashing_xxh3_128_s']:.2f} s, a second xxh3 pass {c['second_pass_xxh3_128_s']:.2f} s."]
    return out


def state_write(path: str) -> list[str]:
    r = _load(path)
    out = [f"\n**training-state write** — {r['device']}, {r['date']} (`{os.path.basename(path)}`), "
           f"{r['bytes'] / 1e9:.1f} GB of fp32 in {r['tensors']} tensors on the device"
           + (f"; {r['note']}" if r.get("note") else "") + "\n",
           "| what | s | GB/s |", "|---|---|---|"]
    out += [f"| {name} | {v['s']:.2f} | {v['GB_per_s']:.2f} |" for name, v in r["rows"].items()]
    if r.get("rounds_s"):
        pinned = [p for p in r.get("rounds_pinned_gb") or [] if p is not None]
        out += ["", f"Written again {len(r['rounds_s'])} times, {r['gap_s']:g} s apart, the one before deleted "
                    f"after each (ppo's iterations): {', '.join(f'{s:.2f}' for s in r['rounds_s'])} s"
                    + (f"; torch's host cache held {', '.join(f'{p:g}' for p in pinned)} GB pinned after each"
                       + (", given back each time" if r.get("free_pinned") else "") if pinned else "") + "."]
    vm = r.get("vm", {})
    out += ["", f"Page cache: dirty_background_ratio {vm.get('dirty_background_ratio')}, dirty_ratio "
                f"{vm.get('dirty_ratio')}; {r['disk_free_bytes'] / 1e9:.0f} GB free on the disk."]
    return out


def startup(path: str) -> list[str]:
    r = _load(path)
    out = [f"\n**start-up** — {r.get('device') or str(r.get('cpus')) + ' CPUs'}, {r['date']} (`{os.path.basename(path)}`), "
           f"{r.get('model')}, median of {r['repeat']}, seconds from the command's launch\n",
           "| command | whole command | first byte | all ranks writing | cli | imports | config | process group | planning | work | exit |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for name, v in r["runs"].items():
        m, sp = v["median"], v["median"]["spans_s"]
        out.append(f"| {name} | {_fmt(m['wall_s'], '.2f')} | **{_fmt(m['first_byte_s'], '.2f')}** | "
                   f"{_fmt(m['all_writing_s'], '.2f')} | " + " | ".join(
                       _fmt(sp.get(s), ".2f") for s in ("cli", "imports", "config", "process_group", "planning", "work", "exit"))
                   + " |")
    return out


def rollout_stage(path: str) -> list[str]:
    """``bench/rollout_stage.py``: the stage alone, per run its wall against the engine's own time."""
    r = _load(path)
    d, w = r["device"], r["workload"]
    out = [f"\n**rollout stage** — {d['name']} × {d['count']}, {r['date']} (`{os.path.basename(path)}`), "
           f"{w['samples']} samples × {w['max_new_tokens']} new tokens a prompt, chunks of {w['chunk_size']}, "
           f"max_batch {w['max_batch']}; seconds\n",
           "| prompts | caches | new tokens | engine | engine tok/s | process wall | **wall / engine** | command / engine "
           "| imports | build + load | waiting: tokenizer, kernels | first tokens |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for run in r["runs"]:
        if "engine_s" not in run:
            out.append(f"| {run['prompts']} | {run['caches']} | failed (rc {run['rc']}) | | | | | | | | | |")
            continue
        sp = run.get("spans_s") or {}
        out.append(f"| {run['prompts']} | {run['caches']} | {run['new_tokens']:,} | {run['engine_s']:.2f} | "
                   f"{run['engine_tok_s']:,} | {_fmt(run.get('process_wall_s'), '.2f')} | "
                   f"**{_fmt(run.get('process_wall_over_engine'), '.2f')}×** | {run['command_wall_over_engine']:.2f}× | "
                   f"{_fmt(sp.get('imports'), '.2f')} | {sp.get('build', 0) + sp.get('load', 0):.2f} | "
                   f"{_fmt(sp.get('tokenizer_wait'), '.2f')}, {_fmt(sp.get('compile_wait'), '.2f')} | "
                   f"{_fmt(sp.get('first_tokens'), '.2f')} |")
    return out


def gpu_checks(path: str) -> list[str]:
    out = [f"\n**GPU checks** (`{os.path.basename(path)}`, from `pytest -m gpu tests/test_gpu.py`)\n",
           "| check | GPUs | result |", "|---|---|---|"]
    for r in _load(path):
        nums = {k: v for k, v in r.items() if k not in ("check", "gpu", "gpus", "torch", "stages")}
        out.append(f"| {r['check']} | {r['gpus']} × {r['gpu']} | "
                   + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}" for k, v in nums.items()) + " |")
    return out


def peak_rss(path: str) -> list[str]:
    r = _load(path)
    return [f"\n**peak RSS of shard and export** — {r['cpus']} CPUs, {r['date']} (`{os.path.basename(path)}`), shape "
            f"{r['shape']}, {r['model_GB']:.2f} GB, {r['procs']} processes\n",
            "| command | seconds | largest peak RSS of a process, GB | weights a shard rank owns, GB | bounded |",
            "|---|---|---|---|---|",
            f"| `llamarl stage shard` | {r['shard_s']:.1f} | {r['shard_max_rss_GB']:.2f} | "
            f"{max(x['owned_GB'] for x in r['shard_ranks']):.2f} | {r['bounded']} |",
            f"| `llamarl stage export` | {r['export_s']:.1f} | {r['export_max_rss_GB']:.2f} | | {r['bounded']} |"]


def ci(path: str) -> list[str]:
    r = _load(path)
    return [f"\n**CI** — {r['date']} (`{os.path.basename(path)}`): `{r['command']}` on a clean clone, {r['machine']}\n",
            "| tests s | passed | failed | skipped | pytest's summary |", "|---|---|---|---|---|",
            f"| {r['tests_s']:.0f} | {r['passed']} | {r['failed']} | {r['skipped']} | {r['summary']} |"]


RENDER = {"e2e": e2e, "train_step": train_step, "rollout": rollout, "rollout_stage": rollout_stage,
          "shard_export": shard_export, "startup": startup, "handoff": handoff, "peak_rss": peak_rss,
          "gpu-checks": gpu_checks, "ci": ci, "state_write": state_write}
NAME = re.compile(r"(?P<bench>" + "|".join(sorted(map(re.escape, RENDER), key=len, reverse=True))
                  + r")-(?:[\w.]+-)?(?P<machine>[a-z0-9]+)-(?P<date>\d{4}-\d\d-\d\d)(?:-[\w.-]+)?\.jsonl?")
