"""docs/benchmarks.md's generated part: the goals against the newest results in bench/results/.

    python bench/report.py            # the generated part, to stdout
    python bench/report.py --write    # the same, written into docs/benchmarks.md between its markers
    python bench/report.py FILE...    # those files' tables only

A results file is named ``<bench>-[<qualifier>-]<machine>-<date>[-<label>].json`` (``.jsonl`` for
GPU checks); its kind is its bench on its machine. The newest file of a kind has the latest date,
then the latest start time where the file records one, then the latest commit adding it (a file
not yet committed is newer than any): these say when a measurement was made, which a label does
not. Files equal on all three are newest together. Each goal takes its number from the newest
file of each machine that measures it; tables follow for the newest file of every kind and every
file a goal cites (bench/tables.py: every row names its file, every ratio is within one file).
"""

from __future__ import annotations

import functools
import glob
import os
import subprocess
import sys
from dataclasses import dataclass
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # bench/tables.py, even under PYTHONSAFEPATH
import tables  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RESULTS = os.path.join(ROOT, "bench", "results")
DOC = os.path.join(ROOT, "docs", "benchmarks.md")
BEGIN = "<!-- bench/report.py: begin. Edit bench/report.py or bench/tables.py, then `python bench/report.py --write`. -->"
END = "<!-- bench/report.py: end -->"
Measure = Callable[[object], "tuple[str, str] | None"]  # a file's data → (what it measured, verdict), or None


GPU = ("h100", "h200")  # the machines the speed goals are set on; a shared 2-core CPU says little of them


@dataclass(frozen=True)
class Goal:
    issue: str
    text: str
    bench: str
    measure: Measure
    machines: tuple[str, ...] | None = GPU  # None: any machine


def _verdict(*checks: tuple[bool, str]) -> str:
    """``met`` or ``**not met**``, per issue where a goal has one level per issue."""
    if len(checks) == 1:
        return "met" if checks[0][0] else "**not met**"
    return "; ".join(f"{issue}: {'met' if ok else '**not met**'}" for ok, issue in checks)


def _runs(r: dict):
    for inv in r["invocations"]:
        for run in inv["runs"]:
            yield inv, run


def _hidden(inv: dict) -> int | None:
    return ((inv.get("shapes") or {}).get("actor") or {}).get("hidden_size")


def _last_iteration(run: dict) -> tuple[str, list[dict]] | None:
    """The last iteration's name and its stages, for a run whose stages ran one after another."""
    names = sorted({n.split("/")[0] for n in run["stages"] if n.startswith("iter-")})
    if not names or (run.get("iterations") or {}).get("overlapped") or run["layout"] == "shared":
        return None
    return names[-1], [s for n, s in run["stages"].items() if n.startswith(names[-1] + "/") and s.get("wall_s")]


def _times(ratio: float, level: float) -> str:
    """``ratio`` as ``1.23×``; with more digits where two would round it onto the other side of
    ``level`` (0.9995 is not 1.00: the goal is not met)."""
    text = f"{ratio:.2f}"
    return f"{ratio:.4f}×" if (float(text) >= level) != (ratio >= level) else f"{text}×"


def vs_trl(hidden: int, staleness: int, level: float) -> Measure:
    """The best llamarl run of the shape and staleness in the file against its TRL (a file may
    compare executors or placements: the goal is met by the best of them)."""
    def measure(r):
        found = [(ratio, run) for inv, run in _runs(r) if _hidden(inv) == hidden
                 and (run.get("max_staleness") or 0) == staleness and (ratio := tables._vs_trl(inv, run)) is not None]
        if found:
            ratio, run = max(found, key=lambda x: x[0])
            how = f"{run['workload']} at {run['layout']}" + (", resident workers" if run.get("resident") else "")
            if (iterations := (run.get("iterations") or {}).get("iterations")) is not None:
                how += f", {iterations} iterations"
            if (mounted := tables.discard(run.get("disk"))) is not None:
                how += f", disk {mounted}"
            if (every := _state_every(r, run)) > 1:
                how += f", training state written every {every} iterations"
            return f"{_times(ratio, level)} ({how})", _verdict((ratio >= level, ""))
    return measure


def _state_every(r: dict, run: dict) -> int:
    """The run's retention.train_state_every (bench/e2e.py ``--train-state-every``; 1: every state written)."""
    inv = next(inv for inv, other in _runs(r) if other is run)
    return inv.get("train_state_every") or 1


def outside_work(r):
    """The last iteration's share of wall in which no stage worked (bench/e2e.py ``_idle``); for
    files without it, and runs of one stage at a time, its stages' walls against their work."""
    for inv, run in _runs(r):
        last = ((run.get("iterations") or {}).get("per_iteration") or [{}])[-1]
        if _hidden(inv) == 2048 and last.get("idle_s") is not None and last.get("window_s"):
            share = last["idle_s"] / last["window_s"]
            return (f"{share:.0%} (iteration {last['iteration']}: {last['window_s']:.1f} s, of which no stage worked "
                    f"{last['idle_s']:.1f} s)", _verdict((share <= 0.10, "")))
    for inv, run in _runs(r):
        last = _last_iteration(run) if _hidden(inv) == 2048 and run.get("status", "ok") == "ok" else None
        if last and all(s.get("work_s") is not None for s in last[1]) and sum(s["wall_s"] for s in last[1]) > 0:
            wall, work = sum(s["wall_s"] for s in last[1]), sum(s["work_s"] for s in last[1])
            share = 1 - work / wall
            return (f"{share:.0%} ({last[0]}: stages {wall:.1f} s, their work {work:.1f} s)",
                    _verdict((share <= 0.10, "")))


def state_write(r):
    for inv, run in _runs(r):
        # Of runs that write every iteration's state: the cost of one write.
        last = _last_iteration(run) if _hidden(inv) == 2048 and _state_every(r, run) == 1 else None
        phase = (run["stages"].get(f"{last[0]}/ppo", {}).get("phases_s") or {}).get("train_state") if last else None
        if phase is not None:
            wall = sum(s["wall_s"] for s in last[1])
            return f"{phase / wall:.0%} ({last[0]}: {phase:.1f} s of {wall:.1f} s)", _verdict((phase / wall <= 0.10, ""))


def _made_elsewhere(s: dict) -> bool:
    """A node with no process of its own (rules scored in the rollout): files before
    ``made_elsewhere`` give it the rollout's timing, and a wall of about 0 s or less."""
    return bool(s.get("made_elsewhere")) or (s.get("wall_s") is not None and s["wall_s"] <= 0.05)


def first_work(r):
    for inv, run in _runs(r):
        share = {n: s["to_first_work_s"] / s["wall_s"] for n, s in run["stages"].items()
                 if s.get("to_first_work_s") is not None and not _made_elsewhere(s) and s.get("wall_s")}
        if share:
            worst = max(share, key=share.get)
            return (f"{sum(v <= 0.10 for v in share.values())} of {len(share)} stages; the worst {share[worst]:.0%} "
                    f"({worst})", _verdict((share[worst] <= 0.10, "")))


def dp2(r):
    for inv, run in _runs(r):
        one = [o for o in inv["runs"] if o["layout"] == "tp1" and o["workload"] == run["workload"]]
        wall = (run.get("iterations") or run.get("iteration") or {}).get("wall_s")
        base = (one[0].get("iterations") or one[0].get("iteration") or {}).get("wall_s") if one else None
        if run["layout"] == "dp2" and wall and base:
            return f"{wall / base:.2f}× ({wall:.1f} s against {base:.1f} s)", _verdict((wall / base <= 0.55, ""))


def _step(r, hidden: int, tp: int = 1) -> dict | None:
    shape, layout = r.get("shape") or {}, r.get("layout") or {}
    if shape.get("hidden_size") == hidden and layout.get("tp", 1) == tp and isinstance(r.get("llamarl"), dict):
        return r["llamarl"]
    return None


def step_mfu(r):
    if v := _step(r, 2048):
        return f"{v['mfu']:.1%}", _verdict((v["mfu"] >= 0.50, "#16"), (v["mfu"] >= 0.60, "#29"))


def step_vs_hf(r):
    v, hf = _step(r, 2048), r.get("hf")
    if v and hf:
        speed, memory = v["tok_s"] / hf["tok_s"], v["peak_gb"] / hf["peak_gb"]
        return f"{speed:.2f}× HF's tokens/s, {memory:.2f}× its peak memory", _verdict((speed >= 1.35 and memory <= 0.8, ""))


def ppo_update(r):
    v = _step(r, 2048)
    if v and isinstance(r.get("ppo"), dict):
        ppo = r["ppo"]["tok_s"] / v["tok_s"]
        ragged = r["ppo-ragged"]["tok_s"] / v["tok_s"] if isinstance(r.get("ppo-ragged"), dict) else None
        return (f"{ppo:.2f}× (micro-batches of {r['ppo']['ppo']['micro_batch_tokens']} tokens); ragged {_fmt2(ragged)}×",
                _verdict((ppo >= 0.8, "#16"), (min(ppo, ragged or 0) >= 0.9, "#29")))


def step_8b_tp2(r):
    if v := _step(r, 4096, tp=2):
        return f"{v['mfu']:.1%} MFU", _verdict((v["mfu"] >= 0.45, ""))


def engine_vs_hf(r):
    hf, fixed = r.get("hf_static_compiled") or {}, (r.get("fixed") or {}).get("64")
    if hf.get("batch") == 64 and fixed:
        ratio = fixed["new_tok_s"] / hf["new_tok_s"]
        return (f"{ratio:.2f}× ({fixed['new_tok_s']:,.0f} against {hf['new_tok_s']:,.0f} new tok/s)",
                _verdict((ratio >= 2, "#15"), (ratio >= 3, "#29")))


def engine_bound(r):
    fraction = ((r.get("fixed") or {}).get("256") or {}).get("fraction_of_bandwidth_bound")
    if fraction is not None:
        return f"{fraction:.2f} of the bound", _verdict((fraction >= 0.5, ""))


def random_stops(r):
    found = [(cb["prompts"], cb["ratio_every4"]) for cb in tables._continuous(r) if "ratio_every4" in cb]
    if found:
        return (", ".join(f"{x:.2f} at {n} prompts" for n, x in found) + " (`check_every` 4)",
                _verdict((min(x for _, x in found) >= 0.8, "")))


def rollout_dp2(r):
    if (r.get("parallel") or {}).get("dp") == 2 and r.get("dp_speedup") is not None:
        return f"{r['dp_speedup']:.2f}× one GPU", _verdict((r["dp_speedup"] >= 1.8, ""))


def stage_over_engine(r):
    runs = [x for x in r["runs"] if x.get("process_wall_over_engine")]
    if runs:
        return (", ".join(f"{x['process_wall_over_engine']:.2f}× ({x['prompts']} prompts, {x['caches']})" for x in runs),
                _verdict((all(x["process_wall_over_engine"] <= 1.15 for x in runs), "")))


def whole_command(cmd: str) -> Measure:
    def measure(r):
        ratio = r["save_pretrained_s"] / r[f"{cmd}_wall_s"]
        return (f"{_times(ratio, 1)} ({r[f'{cmd}_wall_s']:.2f} s against {r['save_pretrained_s']:.2f} s, "
                f"{r['procs']} process{'es' if r['procs'] != 1 else ''}, torch {r.get('torch')})", _verdict((ratio >= 1, "")))
    return measure


def lib_load(r):
    if r.get("lib_load_GB_s"):
        ratio = r["lib_load_GB_s"] / r["from_pretrained_GB_s"]
        return (f"{ratio:.2f}× ({r['lib_load_GB_s']:.2f} against {r['from_pretrained_GB_s']:.2f} GB/s)",
                _verdict((ratio >= 1, "")))


def first_byte(r):
    limits = {"1": 3.0, "4": 5.0}
    seen = {n: v["median"]["first_byte_s"] for n, v in r["runs"].items() if v["median"].get("first_byte_s") is not None}
    if any(n.rpartition("-")[2] in limits for n in seen):
        return (", ".join(f"{n} {s:.2f} s" for n, s in seen.items()),
                _verdict((all(s <= limits.get(n.rpartition("-")[2], float("inf")) for n, s in seen.items()), "")))


def handoff_s(shape: str, limit: float) -> Measure:
    def measure(r):
        if r["shape"] == shape:
            s = r["median"]["handoff_s"]
            return f"{s:.2f} s ({r['median']['GB']:.1f} GB)", _verdict((s <= limit, ""))
    return measure


def rss(r):
    return (f"shard {r['shard_max_rss_GB']:.2f} GB, export {r['export_max_rss_GB']:.2f} GB a process for "
            f"{r['model_GB']:.1f} GB over {r['procs']} processes", _verdict((r["bounded"], "")))


def ci_time(r):
    return (f"{r['tests_s'] / 60:.1f} min of tests ({r['passed']} passed, {r['failed']} failed)",
            _verdict((r["tests_s"] <= 15 * 60, "")))


def _fmt2(x):
    return "–" if x is None else f"{x:.2f}"


GOALS = [
    Goal("#29", "1B shape, on-policy: ≥ 1.0× TRL's generated tok/s/GPU (TRL in the same run)", "e2e", vs_trl(2048, 0, 1.0)),
    Goal("#29", "1B shape, `max_staleness: 1`: ≥ 1.5× TRL", "e2e", vs_trl(2048, 1, 1.5)),
    Goal("#29", "135M shape, on-policy: ≥ 1.0× TRL", "e2e", vs_trl(576, 0, 1.0)),
    Goal("#29", "1B: an iteration's wall outside its stages' own work ≤ 10 %", "e2e", outside_work),
    Goal("#11", "process start to first work ≤ 10 % of each stage's wall", "e2e", first_work),
    Goal("#11", "DP2: ≤ 0.55× one GPU's iteration time", "e2e", dp2),
    Goal("#17", "the training-state write adds ≤ 10 % to an iteration", "e2e", state_write),
    Goal("#16, #29", "1B train step: ≥ 50 % MFU (#16); ≥ 60 % (#29)", "train_step", step_mfu),
    Goal("#16", "1B train step: ≥ 1.35× HF's tokens/s at ≤ 0.8× its peak memory", "train_step", step_vs_hf),
    Goal("#16, #29", "ppo update: ≥ 0.8× the raw step (#16); ≥ 0.9×, ragged batches too (#29)", "train_step", ppo_update),
    Goal("#16", "8B shape at TP2: ≥ 45 % MFU", "train_step", step_8b_tp2),
    Goal("#15, #29", "rollout engine, batch 64, 128 → 256: ≥ 2× HF static compiled (#15); ≥ 3× (#29)", "rollout",
         engine_vs_hf),
    Goal("#29", "rollout engine at 256 sequences: ≥ 0.5 of the memory-bandwidth bound", "rollout", engine_bound),
    Goal("#15", "random stops keep ≥ 80 % of the fixed-length throughput", "rollout", random_stops),
    Goal("#15", "rollout at DP2: ≥ 1.8× one GPU", "rollout", rollout_dp2),
    Goal("#15", "rollout stage wall ≤ 1.15× the engine's own time", "rollout_stage", stage_over_engine),
    Goal("#28", "shard, whole command: ≥ 1× `save_pretrained` (same run)", "shard_export", whole_command("shard")),
    Goal("#28", "export, whole command: ≥ 1× `save_pretrained` (same run)", "shard_export", whole_command("export")),
    Goal("#17", "lib/ load onto the GPU: ≥ 1× `from_pretrained`", "shard_export", lib_load),
    Goal("#17", "command → first byte: ≤ 3 s with 1 process, ≤ 5 s with 4", "startup", first_byte),
    Goal("#17", "hand-off (publish → on the GPU), 1B: ≤ 5 s", "handoff", handoff_s("1b", 5)),
    Goal("#17", "hand-off, 8B (16 GB, one host): ≤ 20 s", "handoff", handoff_s("8b", 20)),
    Goal("#17", "8B shard and export: no process holds the whole model", "peak_rss", rss, None),
    Goal("#14", "`make test` on a clean clone well under CI's time limit (aim: 15 min)", "ci", ci_time, None),
]


@dataclass(frozen=True)
class Result:
    path: str
    bench: str
    machine: str
    key: tuple  # (date, start time, commit time): larger is newer

    @property
    def name(self) -> str:
        return os.path.basename(self.path)


@functools.lru_cache(maxsize=None)
def _data(path: str):
    return tables._load(path)


def _started(data) -> str:
    if not isinstance(data, dict):
        return ""
    return max([data.get("started") or ""] + [inv.get("started") or "" for inv in data.get("invocations", [])])


def git_added(results: str) -> Callable[[str], float]:
    """When each results file was last added to the repository (Unix seconds); uncommitted: +inf."""
    try:
        log = subprocess.run(["git", "log", "--format=%x00%ct", "--name-only", "--diff-filter=A", "--", "."],
                             cwd=results, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError) as e:
        raise SystemExit(f"bench/report.py orders results by the commits that added them: run it in a git checkout ({e})")
    added = {}
    for entry in log.split("\0")[1:]:
        when, *names = entry.strip().splitlines()
        for n in names:
            added.setdefault(os.path.basename(n.strip()), float(when))  # the log is newest first
    return lambda name: added.get(name, float("inf"))


def results(folder: str = RESULTS, added: Callable[[str], float] | None = None) -> tuple[list[Result], list[str]]:
    """The results files of a known bench, and the names of the others (logs, one-off records)."""
    added = added or git_added(folder)
    found, others = [], []
    for path in sorted(glob.glob(os.path.join(folder, "*"))):
        m = tables.NAME.fullmatch(os.path.basename(path))
        if not m:
            others.append(os.path.basename(path))
            continue
        key = (m["date"], _started(_data(path)), added(os.path.basename(path)))
        found.append(Result(path, m["bench"], m["machine"], key))
    return found, others


def _newest_first(files: list[Result]) -> list[list[Result]]:
    keys = sorted({f.key for f in files}, reverse=True)
    return [[f for f in files if f.key == k] for k in keys]


def _kinds(files: list[Result], bench: str, only: tuple[str, ...] | None = None) -> list[list[list[Result]]]:
    """Per machine (in name order; ``only`` those), that bench's files grouped newest first."""
    machines = sorted({f.machine for f in files if f.bench == bench and (only is None or f.machine in only)})
    return [_newest_first([f for f in files if f.bench == bench and f.machine == m]) for m in machines]


def goal_rows(files: list[Result]) -> tuple[list[str], set[str]]:
    rows, cited = ["| issue | goal | measured | file | |", "|---|---|---|---|---|"], set()
    for goal in GOALS:
        hits = []
        for groups in _kinds(files, goal.bench, goal.machines):
            for group in groups:
                found = [(f, m) for f in group if (m := goal.measure(_data(f.path)))]
                if found:
                    hits += found
                    break
        for f, (measured, verdict) in hits:
            rows.append(f"| {goal.issue} | {goal.text} | {measured} | `{f.name}` | {verdict} |")
            cited.add(f.path)
        if not hits:
            rows.append(f"| {goal.issue} | {goal.text} | no file in bench/results measures it | – | |")
    return rows, cited


def generate(folder: str = RESULTS, added: Callable[[str], float] | None = None) -> str:
    files, others = results(folder, added)
    rows, cited = goal_rows(files)
    out = [BEGIN, "", "## The goals, against the newest results", "",
           "Each row: the newest file of each machine that measures the goal (several when equally new).", ""]
    out += rows + ["", "## The newest results", "",
                   "The newest file of every bench on every machine, and every older file a goal above cites.", ""]
    for bench in tables.RENDER:
        for groups in _kinds(files, bench):
            shown = [f for group in groups for f in group if f in groups[0] or f.path in cited]
            for f in shown:
                out += tables.RENDER[bench](f.path)
    out += ["", "Not rendered (logs and one-off records): " + ", ".join(f"`{n}`" for n in others) + ".", "", END]
    return "\n".join(out) + "\n"


def splice(doc: str, generated: str) -> str:
    """``doc`` with the text from its begin marker to its end marker replaced by ``generated``."""
    begin, end = doc.find(BEGIN), doc.find(END)
    if begin < 0 or end < begin:
        raise SystemExit(f"{DOC}: no '{BEGIN}' … '{END}' markers to write between")
    return doc[:begin] + generated + doc[end + len(END) + 1:]


def main(argv: list[str]) -> None:
    if argv == ["--write"]:
        text = splice(open(DOC).read(), generate())
        with open(DOC, "w") as f:
            f.write(text)
        return
    if not argv:
        sys.stdout.write(generate())
        return
    lines = []
    for path in argv:
        m = tables.NAME.fullmatch(os.path.basename(path))
        if not m:
            raise SystemExit(f"{path}: not a results file of {', '.join(tables.RENDER)}")
        lines += tables.RENDER[m["bench"]](path)
    print("\n".join(lines))


if __name__ == "__main__":
    main(sys.argv[1:])
