"""Running a spec: the stages in order, resumed, and what the run directory says of them (status).

Run directory (``STORAGE/NAME``)::

    pipeline/spec.yaml          the spec of the latest ``llamarl run``
    pipeline/<node>.json        one record per stage: key, status, error, times, output id
    shard/actor  shard/rm       sharded initial actor and reward model
    pipeline/prompts.json       the prompts dataset the run takes rows of (prompts_per_iteration)
    pipeline/prompts-index/     its row index (stages/prompts.py)
    pipeline/monitor.json       what TensorBoard and W&B were sent
    iter-001/rollout  iter-001/scores  iter-001/ppo (actor/, critic/, train_state/, metrics.jsonl)
    iter-001/val-rollout  iter-001/val-scores       at the iterations the run validates
    …
    export/                     the final actor as an HF directory
    metrics.jsonl  metrics.png  per iteration: score, KL, losses, validation

A stage's *key* hashes its stage config (minus where it runs) and the ids of its inputs' published
outputs. A stage is skipped when its output is published and its record holds the same key and
output id; otherwise its stale output is removed and it runs — and, since its output id changes,
so does everything downstream. A stage killed half-way leaves an unpublished output that the stage
itself resumes.

The DAG is pipeline/dag.py's, the keys and the plan (what is done, what runs and why)
pipeline/records.py's, retention pipeline/retention.py's. A stage that reads only part of an input's output (rollout and export: ppo's ``actor/``, published
before ppo's training state) is keyed by that part's id and may start as soon as it is published,
while the stage making it still runs (``Node.reads``; with an executor that runs several stages
at once).
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass

import fsspec

from llamarl.cluster.executor import Executor
from llamarl.cluster.kinds import make_executor
from llamarl.lib.files import publish
from llamarl.lib.errors import Stopped, UserError

from .checks import check_prompts, check_storage
from .dag import VALIDATE, Node, build_dag, check_spec
from .metrics import update_metrics, validation_metrics
from .monitor import Monitor
from .records import (assess, fingerprints, input_url, must_redo, node_key, plan, published_id,
                      read_record, write_record)
from .retention import retire_done
from .spec import RunSpec


class PipelineError(UserError):
    pass


# ---- running ---------------------------------------------------------------------------------------------


def _beside(nodes: list[Node], shown: int = 4) -> dict[str, str]:
    """For each stage, the stages it may run at the same time with, in words: neither needs the
    other's output, directly or not (with max_staleness > 0: a rollout and the ppo before it; a
    validation and every stage after it). The shards, which everything needs, are left out. At
    most ``shown`` are named, then how many more: a validation of a long run may run beside
    thousands. Sets of stages are bits of one integer, so a run of n stages costs n²/64 word
    operations, not n² set lookups."""
    bit = {n.name: 1 << i for i, n in enumerate(nodes)}
    up, down = {}, dict.fromkeys(bit, 0)
    for n in nodes:  # in DAG order: a node's inputs come first
        up[n.name] = 0
        for i in n.inputs:
            up[n.name] |= bit[i] | up[i]
    for n in reversed(nodes):
        for i in n.inputs:
            down[i] |= bit[n.name] | down[n.name]
    others = ((1 << len(nodes)) - 1) & ~sum(bit[n.name] for n in nodes if n.stage == "shard")
    words = {}
    for n in nodes:
        mask = 0 if n.stage == "shard" else others & ~(bit[n.name] | up[n.name] | down[n.name])
        count, names = mask.bit_count(), []
        while mask and len(names) < (shown if count <= shown else shown - 1):
            low = mask & -mask
            names.append(nodes[low.bit_length() - 1].name)
            mask ^= low
        words[n.name] = ", ".join(names) + (f" and {count - len(names)} more" if count > len(names) else "")
    return words


def executor_for(spec: RunSpec) -> Executor:
    return make_executor(spec.executor.kind, spec.executor.options, spec.run_dir, f"{spec.source}: executor.options")


def run_spec(spec: RunSpec, *, dry_run: bool = False, show_launch: bool = False, detach: bool = False,
             echo=print, executor: Executor | None = None) -> list[tuple[str, str]]:
    """Run every stage that is not done, in order. Returns (node, what happened) pairs. A dry run
    plans instead, and with ``show_launch`` echoes what the executor would launch for each stage
    that would run (``Executor.render``). ``executor``: one to use instead of the spec's."""
    run = spec.run_dir
    nodes = check_spec(spec)
    check_storage(spec)
    by_name = {n.name: n for n in nodes}
    if dry_run:
        check_prompts(spec, record=False)
        report = []
        executor = (executor or executor_for(spec)) if show_launch else None
        beside = _beside(nodes)
        states = plan(run, nodes, by_name)
        for n in nodes:
            done, why = states[n.name]
            if not done:
                if executor is not None:
                    echo(executor.render(n.stage, n.make_config(), n.nprocs, n.layout.nodes, name=n.name))
                if beside[n.name]:
                    why += f"; may run beside {beside[n.name]}"
            report.append((n.name, ("skip: " if done else "run: ") + why))
        return report

    from .lock import RunLock

    with RunLock(run, echo=echo) as lock:  # one `llamarl run` at a time per run directory
        executor = executor or executor_for(spec)
        executor.registry = lock  # the stages' processes on this host, for a takeover after a crash
        try:
            in_flight = _jobs_in_flight(run, nodes, executor)
            if in_flight:
                listed = ", ".join(f"{n} (job {j}: {state})" for n, j, state in in_flight[:3])
                raise PipelineError(f"{run}: stages of a detached run are still queued or running: {listed}"
                                    f"{' …' if len(in_flight) > 3 else ''}; follow them with `llamarl status {run}`, "
                                    f"or cancel them (scancel) before running it again")
            check_prompts(spec, record=True)
            if detach:
                return _submit_nodes(spec, nodes, by_name, executor, echo)
            return _run_nodes(spec, nodes, by_name, executor, echo)
        finally:
            executor.close()  # what it keeps between stages (resident workers) ends with the run


def _jobs_in_flight(run: str, nodes: list[Node], executor) -> list[tuple[str, str, str]]:
    """(node, job id, state) of the detached jobs of ``run`` still in the cluster's queue."""
    found = []
    for n in nodes:
        record = read_record(run, n) or {}
        if record.get("job") and record.get("status") in ("submitted", "running"):
            state = executor.job_state(record["job"])
            if state is not None:
                found.append((n.name, record["job"], state))
    return found


@dataclass(frozen=True)
class NodeRecorder:
    """A detached stage's record, kept from inside its job (rank 0) since no `llamarl run` waits on
    it: "running" when the job starts (again, after a requeue), "done" with its key or "failed" with
    the error when the stage ends. Picklable: it travels with the job."""

    run_dir: str
    node: str

    def _node(self) -> tuple[Node, list[Node], RunSpec]:
        from .dag import load_spec

        spec = load_spec(f"{self.run_dir}/pipeline/spec.yaml")
        nodes = build_dag(spec)
        return next(n for n in nodes if n.name == self.node), nodes, spec

    def started(self, job_id: str) -> None:
        node, _, _ = self._node()
        write_record(self.run_dir, node, status="running", job=job_id, started=_now(), error=None)

    def ended(self, result) -> None:
        node, nodes, spec = self._node()
        if not result.ok:
            write_record(self.run_dir, node, status="failed", error=result.error, finished=None)
            return
        by_name = {n.name: n for n in nodes}
        _record_done(spec, node, by_name)
        monitor = Monitor(spec)
        try:
            _after_done(spec, node, nodes, by_name, monitor, print)
        finally:
            monitor.close()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _record_done(spec: RunSpec, n: Node, by_name: dict[str, Node], key: str | None = None) -> None:
    """``key``: the node's key when it started, if known (an input read early could have been
    rewritten since: then the record keeps the key of what the stage read, which is now stale). A
    validation's scores also record its metrics (retention may delete the scores)."""
    extra = {}
    if n.role == VALIDATE and n.stage == "score":
        extra["metrics"] = validation_metrics(n.out, spec.validation.pass_threshold)
    write_record(spec.run_dir, n, status="done", key=key or node_key(n, by_name), output_id=published_id(n.out),
                 external=fingerprints(n), finished=_now(), error=None, **extra)


def _after_done(spec: RunSpec, n: Node, nodes: list[Node], by_name: dict[str, Node], monitor: Monitor,
                echo) -> None:
    """What follows a stage's end: the run's metrics when they changed (to its sinks too), and
    whatever retention now lets go of."""
    if n.stage == "ppo" or (n.role == VALIDATE and n.stage == "score"):
        monitor.update(update_metrics(spec.run_dir, spec.iterations))
    retire_done(spec, nodes, by_name, echo)


def _remove_stale(n: Node, parts: set[str] = frozenset()) -> None:
    """Before ``n`` runs: its published output, whose config or inputs changed, removed; or, when
    it is unfinished, the ``parts`` of it that other stages read early (a killed run of ``n``
    published them): the stage writes them again, and nothing may start from the old ones."""
    fs, path = fsspec.core.url_to_fs(n.out)
    if published_id(n.out) is not None:
        fs.rm(path, recursive=True)
        return
    for part in parts:
        if published_id(f"{n.out}/{part}") is not None:
            fs.rm(f"{path}/{part}", recursive=True)


def _early_parts(nodes: list[Node]) -> dict[str, set[str]]:
    """For each node, the parts of its output that other nodes read before it ends."""
    parts: dict[str, set[str]] = {}
    for n in nodes:
        for name, sub in n.reads.items():
            parts.setdefault(name, set()).add(sub)
    return parts


def _skipped(run: str, n: Node, by_name: dict[str, Node], will_run: set[str], report: list, echo,
             parts: set[str] = frozenset(), redo: dict[str, str] | None = None) -> tuple[bool, str]:
    """(is ``n`` done, why); a done stage is reported skipped, a stale output (or its ``parts``
    read early) removed before it runs. ``redo``: stages to run again whatever their records say
    (``records.plan``: retention deleted their output and a stage that runs needs it)."""
    done, why = (False, redo[n.name]) if n.name in (redo or {}) else assess(run, n, by_name, will_run)
    if done:
        report.append((n.name, "skipped (done)"))
        echo(f"[{n.name}] done, skipped")
    else:
        _remove_stale(n, parts)
    return done, why


def _submit_nodes(spec: RunSpec, nodes: list[Node], by_name: dict[str, Node], executor: Executor,
                  echo) -> list[tuple[str, str]]:
    """``--detach``: submit every stage that is not done at once, each job after the jobs of its
    inputs (Slurm: ``--dependency=afterok``), or start the executor's in-cluster driver; return
    without waiting."""
    run, report = spec.run_dir, []
    if executor.detach is None:
        raise PipelineError(f"{spec.source}: --detach needs a cluster executor (slurm or kubernetes); the "
                            f"{spec.executor.kind} executor runs in the foreground")
    publish.write_bytes(f"{run}/pipeline/spec.yaml", spec.to_yaml().encode())
    if executor.detach == "driver":
        # A driver job runs this same resumable `llamarl run` inside the cluster.
        where = executor.start_driver(f"{run}/pipeline/spec.yaml", spec.name)
        echo(f"driver: {where}" + ("" if executor.launches else " (apply it: kubectl apply -f)"))
        return [("driver", where)]
    jobs: dict[str, str] = {}
    early, redo = _early_parts(nodes), must_redo(run, nodes, by_name)
    for n in nodes:
        done, why = _skipped(run, n, by_name, set(jobs), report, echo, early.get(n.name, set()), redo)
        if done:
            continue
        after = [jobs[i] for i in n.inputs if i in jobs]
        # Recorded before the job exists: a job that starts at once records "running" itself, and
        # the job id written after submitting must not take that back.
        write_record(run, n, status="submitted", job=None, after=after, submitted=_now(), started=None, error=None,
                     key=None)
        job = executor.submit_after(n.stage, n.make_config(), n.nprocs, n.layout.nodes, name=n.name, after=after,
                                    recorder=NodeRecorder(run, n.name))
        jobs[n.name] = job
        write_record(run, n, job=job)
        report.append((n.name, f"submitted as job {job}"))
        echo(f"[{n.name}] submitted as job {job}" + (f", after {', '.join(after)}" if after else "") + f": {why}")
    return report


def _run_nodes(spec: RunSpec, nodes: list[Node], by_name: dict[str, Node], executor: Executor,
               echo) -> list[tuple[str, str]]:
    run, report = spec.run_dir, []
    publish.write_bytes(f"{run}/pipeline/spec.yaml", spec.to_yaml().encode())
    if not executor.launches:
        # Nothing runs here: every stage is written, and applying them in order runs the pipeline.
        for n in nodes:
            where = executor.submit(n.stage, n.make_config(), n.nprocs, n.layout.nodes, name=n.name)
            report.append((n.name, f"written {where}"))
            echo(f"[{n.name}] written: {where}")
        return report
    # Every stage whose inputs are done starts, up to the executor's concurrency (the local
    # executor's max_concurrent_stages; a cluster queues what it cannot run yet): with
    # max_staleness > 0 a rollout runs beside the ppo before it. A stage that reads only a part
    # of a running input (Node.reads) starts once that part is published: polled, while there is
    # room for it.
    limit = executor.concurrency or len(nodes)
    early, redo = _early_parts(nodes), must_redo(run, nodes, by_name)
    waiting, finished, running, failure = list(nodes), set(), {}, None
    keys: dict[str, str | None] = {}  # each started node's key when it started
    # A failed validation stops only what reads it: training goes on, and the run reports it at the end.
    given_up: dict[str, str] = {}
    monitor = Monitor(spec)

    def ready(n: Node) -> bool:
        # A part of a running input is this run's: the input's stale parts were removed when it started.
        started = {m.name for m in running.values()}
        return all(i in finished or (i in n.reads and i in started and published_id(input_url(n, i, by_name)))
                   for i in n.inputs)

    def may_start_early() -> bool:
        started = {m.name for m in running.values()}
        return failure is None and len(running) < limit and any(i in started for n in waiting for i in n.reads)

    with _StageThreads(max_workers=min(limit, len(nodes)), thread_name_prefix="stage") as pool:
        try:
            if monitor.active:  # a resumed run: what the sinks missed while no `llamarl run` ran
                monitor.update(update_metrics(run, spec.iterations))
            while waiting or running:
                for n in list(waiting) if failure is None else []:
                    if len(running) >= limit:
                        break
                    lost = next((i for i in n.inputs if i in given_up), None)
                    if lost is not None:
                        waiting.remove(n)
                        given_up[n.name] = f"{lost} failed"
                        report.append((n.name, f"not run: {lost} failed"))
                        continue
                    if not ready(n):
                        continue
                    waiting.remove(n)
                    done, why = _skipped(run, n, by_name, set(), report, echo, early.get(n.name, set()), redo)
                    if done:
                        finished.add(n.name)
                        continue
                    early_from = [input_url(n, i, by_name)[len(run) + 1 :] for i in n.inputs if i not in finished]
                    if early_from:
                        why += f"; {', '.join(early_from)} published"
                    beside = f" (beside {', '.join(m.name for m in running.values())})" if running else ""
                    echo(f"[{n.name}] running {n.stage} on {n.nprocs} process(es): {why}{beside}")
                    write_record(run, n, status="running", started=_now(), error=None, key=None, job=None)
                    keys[n.name] = node_key(n, by_name)
                    running[pool.submit(executor.run, n.stage, n.make_config(), n.nprocs, n.layout.nodes,
                                        name=n.name)] = n
                if not running:
                    if failure is not None or not waiting:
                        break
                    continue  # skipped stages made others ready
                # About once a second while a waiting stage may start from a part of a running one.
                ended, _ = wait(running, timeout=1.0 if may_start_early() else None, return_when=FIRST_COMPLETED)
                for future in ended:
                    n, result = running.pop(future), future.result()
                    if not result.ok:
                        write_record(run, n, status="failed", error=result.error, finished=None)
                        if n.role == VALIDATE:
                            given_up[n.name] = result.error
                            echo(f"[{n.name}] failed ({result.error}); training goes on")
                        else:
                            failure = failure or (n, result)
                        continue
                    _record_done(spec, n, by_name, keys.get(n.name))
                    finished.add(n.name)
                    report.append((n.name, "ran"))
                    _after_done(spec, n, nodes, by_name, monitor, echo)
        except BaseException as e:  # stopped (a signal, Ctrl-C) or failed: no stage process may outlive us
            _stop_stages(spec, executor, running, by_name, keys, e)
            raise
        finally:
            monitor.close()
    if failure is not None:
        n, result = failure
        raise PipelineError(f"stage {n.name} failed ({result.error}); fix it and rerun `llamarl run` — finished stages are kept")
    failed = [name for name, why in given_up.items() if by_name[name].role == VALIDATE and "failed" not in why]
    if failed:
        raise PipelineError(f"validation {', '.join(failed)} failed ({given_up[failed[0]]}); every training stage "
                            f"ran — fix it and rerun `llamarl run`, which runs only what is not done")
    return report


class _StageThreads(ThreadPoolExecutor):
    """The threads that follow running stages. Left by an exception (the driver stopping) it does
    not wait for them: a cluster's stage runs on, and so does the thread following it."""

    def __exit__(self, exc_type, exc, tb):
        self.shutdown(wait=exc_type is None, cancel_futures=exc_type is not None)
        return False


def _stop_stages(spec: RunSpec, executor: Executor, running: dict[Future, Node], by_name: dict[str, Node],
                 keys: dict[str, str | None], why: BaseException) -> None:
    """The driver stops (``why``: a signal, Ctrl-C, an error of its own). The executor stops what
    is its to stop — every process of each local stage, before it returns — and each stage's
    record says how it ended: done or failed if it ended just before the stop, else stopped. A
    cluster's job runs on and keeps its "running" record: a later ``llamarl run`` follows or
    resumes it."""
    stopped = set(executor.stop_all() or ())
    cause = why.name if isinstance(why, Stopped) else f"{type(why).__name__}: {why}".splitlines()[0][:200]
    ours = {f: n for f, n in running.items() if n.name in stopped or f.done()}
    wait(ours)  # a stopped stage's thread ends with its processes, which are gone now
    for future, n in ours.items():
        result = None if future.exception() is not None else future.result()
        if result is not None and result.ok:  # it ended well as the stop came
            _record_done(spec, n, by_name, keys.get(n.name))
            stopped.discard(n.name)
        elif n.name in stopped:
            write_record(spec.run_dir, n, status="stopped", finished=None,
                         error=f"llamarl run stopped it at {_now()} ({cause}); rerun to resume")
        elif result is not None:  # it had failed on its own, just before the stop
            write_record(spec.run_dir, n, status="failed", error=result.error, finished=None)
    if isinstance(why, Stopped):
        why.stages = sorted(stopped)
