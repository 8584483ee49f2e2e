"""Start-up profile of `llamarl stage shard` / `export`: command start → first byte written.

    python bench/startup.py [--procs 1 4] [--repeat 3] [--importtime] [--out FILE]

A tiny Llama (so the work itself is negligible) is sharded and exported with 1 and 4 processes
(`--tp N`, `--procs N`), each whole command timed from its launch. Every stage process records when
it reached each step (``lib/runtime/job.py``'s start-up profile, LLAMARL_PROFILE_DIR):

  cli            command launched → stage process started (the CLI's imports, config, spawn)
  imports        process start → the stage module imported (interpreter, torch, lib/)
  config         → config parsed and validated
  process_group  → process group joined (``parallel.init``)
  planning       → first byte of data written (inputs read and checked, output prepared, the
                   DCP / file plan)
  work           → the stage's end;   exit: → the command has exited

The steps are per rank, taken at the slowest rank (its start-up is what the others wait for);
``first_byte_s`` is the first data byte any rank wrote, ``all_writing_s`` the last rank's first
byte. A poll of the output folder checks the first byte from outside (10 ms resolution).
Writes JSON to bench/results/startup-cpu-<date>.json and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time

HERE = os.path.dirname(os.path.abspath(__file__))
STEPS = ("process_start", "imported", "config", "process_group", "first_byte", "end")
SPANS = ("cli", "imports", "config", "process_group", "planning", "work", "exit")


def tiny_hf(path: str) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=128)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(path)


def _first_data_byte(folder: str, suffixes: tuple[str, ...], stop: threading.Event, seen: list) -> None:
    """Poll ``folder`` (recursively) until a data file has a byte in it; record when."""
    while not stop.is_set():
        for root, _, names in os.walk(folder):
            for n in names:
                if n.endswith(suffixes):
                    try:
                        if os.path.getsize(os.path.join(root, n)) > 0:
                            seen.append(time.time())
                            return
                    except OSError:
                        pass
        time.sleep(0.01)


def run_once(args: list[str], out: str, suffixes: tuple[str, ...], prof: str) -> dict:
    shutil.rmtree(prof, ignore_errors=True)
    env = {**os.environ, "LLAMARL_PROFILE_DIR": prof}
    stop, seen = threading.Event(), []
    poll = threading.Thread(target=_first_data_byte, args=(out, suffixes, stop, seen), daemon=True)
    launch = time.time()
    proc = subprocess.Popen([sys.executable, "-m", "llamarl.pipeline.cli", *args], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    poll.start()
    stdout, stderr = proc.communicate(timeout=600)
    done = time.time()
    stop.set()
    poll.join()
    if proc.returncode:
        raise SystemExit(f"{args} failed ({proc.returncode}):\n{stdout}\n{stderr}")
    ranks = []
    for name in sorted(os.listdir(prof)) if os.path.isdir(prof) else []:  # none: a version without the profile
        with open(os.path.join(prof, name)) as f:
            ranks.append({k: (v - launch if v is not None else None) for k, v in json.load(f).items()})
    polled = seen[0] - launch if seen else None
    if not ranks:
        return {"wall_s": done - launch, "first_byte_s": polled, "all_writing_s": None, "first_byte_polled_s": polled,
                "spans_s": {s: None for s in SPANS}, "ranks": []}
    # A rank with nothing to write (export: more processes than files) has no first byte.
    slowest = {s: max(r[s] for r in ranks if r.get(s) is not None) for s in STEPS}
    spans = {"cli": slowest["process_start"]}
    for name, (a, b) in zip(SPANS[1:6], zip(STEPS, STEPS[1:])):
        spans[name] = slowest[b] - slowest[a]
    spans["exit"] = (done - launch) - slowest["end"]
    return {"wall_s": done - launch, "first_byte_s": min(r["first_byte"] for r in ranks if r["first_byte"] is not None),
            "all_writing_s": slowest["first_byte"], "first_byte_polled_s": polled,
            "spans_s": spans, "ranks": ranks}


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def _f(v) -> str:
    return "     -" if v is None else f"{v:6.2f}"


def importtime(module: str, top: int = 12) -> list[tuple[str, float]]:
    """The slowest imports (cumulative seconds) of ``module`` in a fresh interpreter."""
    proc = subprocess.run([sys.executable, "-X", "importtime", "-c", f"import {module}"], capture_output=True, text=True)
    rows = []
    for line in proc.stderr.splitlines():
        if line.startswith("import time:") and "|" in line and "cumulative" not in line:
            _, cum, name = line.split("|")
            depth = (len(name) - len(name.lstrip())) // 2
            if depth <= 2:
                rows.append((name.strip(), int(cum) / 1e6))
    return sorted(rows, key=lambda r: -r[1])[:top]


def has_bytecode() -> bool:
    """Whether the installed packages have their bytecode (an ordinary pip install): without it
    every process compiles what it imports (the GPU machines before bench/gpu_env.sh compiles it)."""
    import importlib.util

    spec = importlib.util.find_spec("numpy")
    return bool(spec and spec.origin and os.path.exists(importlib.util.cache_from_source(spec.origin)))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--importtime", action="store_true", help="also list the slowest imports of each stage module")
    ap.add_argument("--out", default=None, help="JSON path (default bench/results/startup-cpu-<date>.json)")
    args = ap.parse_args()

    work = tempfile.mkdtemp(prefix="llamarl-startup-")
    src = os.path.join(work, "hf")
    tiny_hf(src)
    res = {"date": time.strftime("%Y-%m-%d"), "cpus": os.cpu_count(), "python": sys.version.split()[0],
           "bytecode": has_bytecode(),
           "model": "tiny Llama (2 layers, hidden 64)", "repeat": args.repeat, "runs": {}}
    try:
        import torch

        res["torch"] = torch.__version__
        for n in args.procs:
            for stage in ("shard", "export"):
                runs = []
                for i in range(args.repeat):
                    ckpt, out = os.path.join(work, f"ckpt{n}-{i}"), os.path.join(work, f"out{n}-{i}")
                    if stage == "shard":
                        shutil.rmtree(ckpt, ignore_errors=True)
                        cmd, dst, suffixes = ["stage", "shard", src, ckpt, "--tp", str(n)], ckpt, (".distcp",)
                    else:
                        cmd, dst, suffixes = ["stage", "export", ckpt, out, "--procs", str(n)], out, (".safetensors",)
                    runs.append(run_once(cmd, dst, suffixes, os.path.join(work, "prof")))
                med = {k: _median(r[k] for r in runs) for k in ("wall_s", "first_byte_s", "all_writing_s")}
                med["spans_s"] = {s: _median(r["spans_s"][s] for r in runs) for s in SPANS}
                res["runs"][f"{stage}-{n}"] = {"median": med, "runs": runs}
        if args.importtime:
            res["importtime_s"] = {m: importtime(m) for m in ("llamarl.stages.shard", "llamarl.stages.export")}
    finally:
        shutil.rmtree(work, ignore_errors=True)

    print(f"{'command':<10} {'wall':>6} {'1st byte':>8} {'all wrt':>8} | " + " ".join(f"{s:>9}" for s in SPANS))
    for name, r in res["runs"].items():
        m = r["median"]
        print(f"{name:<10} {_f(m['wall_s'])} {_f(m['first_byte_s']):>8} {_f(m['all_writing_s']):>8} | "
              + " ".join(f"{_f(m['spans_s'][s]):>9}" for s in SPANS))
    for mod, rows in res.get("importtime_s", {}).items():
        print(f"slowest imports of {mod}: " + ", ".join(f"{n} {t:.2f}s" for n, t in rows))
    out = args.out or os.path.join(HERE, "results", f"startup-cpu-{res['date']}.json")
    os.makedirs(os.path.dirname(out), exist_ok=True)
    with open(out, "w") as f:
        json.dump(res, f, indent=1)
    print(out)


if __name__ == "__main__":
    main()
