"""``llamarl status RUN``: each stage of a run directory — done, running, failed, stale — and why;
for a rollout that takes rows of the prompts, which ones (epoch and position); what retention deleted."""

from __future__ import annotations

from llamarl.lib.errors import UserError
from llamarl.lib.files import publish

from . import data
from .dag import VALIDATE, build_dag, load_spec
from .checks import recorded
from .records import assess, must_redo, one_look, read_record
from .retention import retained
from .run import executor_for


@one_look()
def status(run: str) -> list[tuple[str, str, str]]:
    """(node, state, why) for the run directory ``run``: also, for a rollout taking rows of the
    prompts, which (epoch and position), and what retention deleted."""
    fs, path = publish.filesystem(run.rstrip("/"))
    if not fs.exists(f"{path}/pipeline/spec.yaml"):
        raise UserError(f"{run} is not a run directory (no pipeline/spec.yaml); start it with `llamarl run SPEC`")
    spec = load_spec(f"{run.rstrip('/')}/pipeline/spec.yaml")
    nodes = build_dag(spec)
    by_name = {n.name: n for n in nodes}
    records = {n.name: read_record(spec.run_dir, n) or {} for n in nodes}
    executor = executor_for(spec)
    redo = must_redo(spec.run_dir, nodes, by_name)
    rows_in_prompts = (recorded(spec) or {}).get("rows")  # the prompts' rows when the run first took some
    rows = []
    for n in nodes:
        record = records[n.name]
        done, why = (False, redo[n.name]) if n.name in redo else assess(spec.run_dir, n, by_name, set())
        state = "done" if done else record.get("status", "pending")
        if state == "done" and not done:
            state = "stale"
        if state in ("submitted", "running") and record.get("job"):
            queued = executor.job_state(record["job"])
            if queued is not None:
                why = f"job {record['job']}: {queued}"
            else:  # left the queue without a record of its end: cancelled with a failed input, or lost
                failed = next((i for i in n.inputs if records[i].get("status") in ("failed", "cancelled", "lost")), None)
                state, why = (("cancelled", f"{failed} {records[failed]['status']}") if failed else
                              ("lost", f"job {record['job']} ended without reporting; see its log in "
                                       f"{spec.run_dir}/pipeline/slurm/{record['job']}"))
                record["status"] = state  # for the stages after it
        if n.stage == "rollout" and spec.max_staleness and n.role != VALIDATE:
            why += f"; samples {n.inputs[0]}'s actor"
        if n.stage == "rollout" and n.role != VALIDATE and rows_in_prompts and spec.prompts_per_iteration:
            why += f"; {data.describe_position(data.iteration_selection(spec, n.iteration), rows_in_prompts)}"
        gone = retained(n)
        if gone:
            why += f"; {gone}"
        beside = _ran_beside(n.name, records)
        if beside:
            why += f"; ran beside {', '.join(beside)}"
        rows.append((n.name, state, why))
    return rows


FULL_ROWS = 40
"""A run of at most this many stages is shown whole; a longer one folds its runs of done or pending
stages (a 200-iteration run has 1,400 stages: the ones that say something are the few between)."""


def folded(rows: list[tuple[str, str, str]], keep: int = 3) -> list[tuple[str, str, str]]:
    """``status``'s rows with every run of more than ``keep`` consecutive done, or pending, stages
    as one row (``iter-001/rollout … iter-036/ppo``, ``done``, how many): what is running, failed,
    stopped or stale stays a row of its own. Short runs (``FULL_ROWS``) come back whole."""
    if len(rows) <= FULL_ROWS:
        return rows
    out, i = [], 0
    while i < len(rows):
        j = i
        while j < len(rows) and rows[j][1] == rows[i][1]:
            j += 1
        if rows[i][1] in ("done", "pending") and j - i > keep:
            whys = {why for _, _, why in rows[i:j]}
            why = f"{j - i} stages" + (f", each {whys.pop()}" if len(whys) == 1 else "")
            out.append((f"{rows[i][0]} … {rows[j - 1][0]}", rows[i][1], why))
        else:
            out.extend(rows[i:j])
        i = j
    return out


def summary(rows: list[tuple[str, str, str]]) -> str:
    """One line: how many iterations are trained, and the stages that run or failed."""
    ppo = [state for name, state, _ in rows if name.startswith("iter-") and name.endswith("/ppo")]
    line = f"{ppo.count('done')} of {len(ppo)} iterations trained" if ppo else f"{len(rows)} stages"
    for state in ("running", "submitted", "failed", "stopped", "stale", "lost", "cancelled"):
        named = [name for name, s, _ in rows if s == state]
        if named:
            line += f"; {state}: {', '.join(named[:3])}" + (f" and {len(named) - 3} more" if len(named) > 3 else "")
    return line


def _ran_beside(name: str, records: dict[str, dict]) -> list[str]:
    """The stages whose last run overlapped ``name``'s in time, from their records."""
    mine = records[name]
    if not (mine.get("started") and mine.get("finished")):
        return []
    return [other for other, r in records.items() if other != name and r.get("started") and r.get("finished")
            and r["started"] < mine["finished"] and mine["started"] < r["finished"]]
