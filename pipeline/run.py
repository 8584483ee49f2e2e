"""Running a spec: the stages in order, resumed, and what the run directory says of them (status).

Run directory (``STORAGE/NAME``)::

    pipeline/spec.yaml          the spec of the latest ``llamarl run``
    pipeline/<node>.json        one record per stage: key, status, error, times, output id
    shard/actor  shard/rm       sharded initial actor and reward model
    pipeline/prompts.json       the prompts dataset the run takes rows of (prompts_per_iteration)
    pipeline/prompts-index/     its row index (stages/prompts.py)
    pipeline/monitor.json       what TensorBoard and W&B were sent
    pipeline/trash/             what retention deletes, while it is deleted
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
pipeline/records.py's, retention pipeline/retention.py's. A stage that reads only part of an
input's output (rollout and export: ppo's ``actor/``, published before ppo's training state) is
keyed by that part's id and may start as soon as it is published, while the stage making it still
runs (``Node.reads``; with an executor that runs several stages at once).
"""

from __future__ import annotations

import time
from concurrent.futures import FIRST_COMPLETED, ThreadPoolExecutor, wait
from dataclasses import dataclass

import fsspec

from llamarl.cluster.executor import Executor
from llamarl.cluster.kinds import make_executor
from llamarl.lib.files import publish
from llamarl.lib.errors import Stopped, UserError

from .checks import check_prompts, check_storage
from .dag import VALIDATE, Node, build_dag, check_spec, early_parts, load_spec, may_run_beside
from .lock import RunLock
from .metrics import update_metrics, validation_metrics
from .monitor import Monitor
from .records import (assess, fingerprints, input_url, must_redo, node_key, plan, published_current, published_id,
                      read_record, write_record)
from .retention import Trash, retire_done
from .spec import RunSpec


class PipelineError(UserError):
    pass


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
        beside = may_run_beside(nodes)
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
        spec = load_spec(f"{self.run_dir}/pipeline/spec.yaml")
        nodes = build_dag(spec)
        return next(n for n in nodes if n.name == self.node), nodes, spec

    def started(self, job_id: str) -> None:
        node, _, _ = self._node()
        write_record(self.run_dir, node, status="running", job=job_id, started=_now(), error=None)

    def ended(self, result) -> None:
        node, nodes, spec = self._node()
        by_name = {n.name: n for n in nodes}
        if _record_end(spec, node, by_name, result):
            monitor = Monitor(spec)
            try:
                _after_done(spec, node, nodes, by_name, monitor, print)
            finally:
                monitor.close()


def _now() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())


def _record_end(spec: RunSpec, n: Node, by_name: dict[str, Node], result, key: str | None = None) -> bool:
    """Record how ``n`` ended, done or failed (its ``StageResult``); whether it is done."""
    if result.ok:
        _record_done(spec, n, by_name, key)
    else:
        write_record(spec.run_dir, n, status="failed", error=result.error, finished=None)
    return result.ok


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
                echo, trash: Trash | None = None) -> None:
    """What follows a stage's end: whatever retention now lets go of, and the run's metrics."""
    retire_done(spec, nodes, by_name, echo, trash)
    _update_metrics(spec, n, monitor)


def _update_metrics(spec: RunSpec, n: Node, monitor: Monitor) -> None:
    """The run's metrics, to its sinks and its plot, when ``n``'s end changed them."""
    if n.stage == "ppo" or (n.role == VALIDATE and n.stage == "score"):
        monitor.update(update_metrics(spec.run_dir, spec.iterations))


def _remove_stale(n: Node, parts: set[str] = frozenset()) -> None:
    """Before ``n`` runs: its published output, whose config or inputs changed, removed; or, when
    it is unfinished, the ``parts`` of it that other stages read early (a killed run of ``n``
    published them): the stage writes them again, and nothing may start from the old ones."""
    # A rollout's rules' scores (RolloutConfig.scores) are made from the rollout that runs again:
    # stale, and the rollout that publishes the new ones would refuse to overwrite them.
    scores = n.make_config().scores if n.stage == "rollout" else None
    stale = [scores.out] if scores is not None else []
    stale += [n.out] if published_id(n.out) is not None else [f"{n.out}/{part}" for part in parts]
    for url in stale:
        if published_id(url) is not None:
            fs, path = fsspec.core.url_to_fs(url)
            fs.rm(path, recursive=True)


MADE_ELSEWHERE = "its output was published with this config and inputs"


def _made_by(n: Node, by_name: dict[str, Node]) -> str:
    if n.stage == "score" and by_name[n.inputs[0]].make_config().scores is not None:  # its rollout's rules
        return "scored in the rollout"
    return MADE_ELSEWHERE


def _submit_nodes(spec: RunSpec, nodes: list[Node], by_name: dict[str, Node], executor: Executor,
                  echo) -> list[tuple[str, str]]:
    """``--detach``: submit every stage that is not done at once, each job after the jobs of its
    inputs (Slurm: ``--dependency=afterok``), or start the executor's in-cluster driver; return
    without waiting."""
    run = spec.run_dir
    if executor.detach is None:
        raise PipelineError(f"{spec.source}: --detach needs a cluster executor (slurm or kubernetes); the "
                            f"{spec.executor.kind} executor runs in the foreground")
    publish.write_bytes(f"{run}/pipeline/spec.yaml", spec.to_yaml().encode())
    if executor.detach == "driver":
        # A driver job runs this same resumable `llamarl run` inside the cluster.
        where = executor.start_driver(f"{run}/pipeline/spec.yaml", spec.name)
        echo(f"driver: {where}" + ("" if executor.launches else " (apply it: kubectl apply -f)"))
        return [("driver", where)]
    schedule, jobs = _Schedule(spec, nodes, by_name, executor, echo), {}
    for n in nodes:
        done, why = schedule.skipped(n, set(jobs))
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
        schedule.report.append((n.name, f"submitted as job {job}"))
        echo(f"[{n.name}] submitted as job {job}" + (f", after {', '.join(after)}" if after else "") + f": {why}")
    return schedule.report


def _run_nodes(spec: RunSpec, nodes: list[Node], by_name: dict[str, Node], executor: Executor,
               echo) -> list[tuple[str, str]]:
    publish.write_bytes(f"{spec.run_dir}/pipeline/spec.yaml", spec.to_yaml().encode())
    if not executor.launches:
        # Nothing runs here: every stage is written, and applying them in order runs the pipeline.
        report = []
        for n in nodes:
            where = executor.submit(n.stage, n.make_config(), n.nprocs, n.layout.nodes, name=n.name)
            report.append((n.name, f"written {where}"))
            echo(f"[{n.name}] written: {where}")
        return report
    schedule = _Schedule(spec, nodes, by_name, executor, echo)
    pool = ThreadPoolExecutor(max_workers=min(schedule.limit, len(nodes)), thread_name_prefix="stage")
    schedule.trash = Trash.open(spec.run_dir)
    try:
        if schedule.monitor.active:  # a resumed run: what the sinks missed while no `llamarl run` ran
            schedule.monitor.update(update_metrics(spec.run_dir, spec.iterations))
        while schedule.waiting or schedule.running:
            schedule.start_ready(pool)
            if not schedule.running:
                if schedule.failure is not None or not schedule.waiting:
                    break
                continue  # skipped stages made others ready
            # About once a second while a waiting stage may start from a part of a running one.
            ended, _ = wait(schedule.running, timeout=1.0 if schedule.may_start_early() else None,
                            return_when=FIRST_COMPLETED)
            # Retention's deletions (moved to the trash, emptied beside) before what the ended
            # stages made ready starts; the run's metrics and their plot (a second or so) after.
            done = schedule.collect(ended)
            if done:
                retire_done(spec, nodes, by_name, echo, schedule.trash)
            schedule.start_ready(pool)
            for n in done:
                _update_metrics(spec, n, schedule.monitor)
    except BaseException as e:  # stopped (a signal, Ctrl-C) or failed: no stage process may outlive us
        schedule.stop(e)
        raise
    finally:
        schedule.monitor.close()
        if schedule.trash is not None:
            schedule.trash.close()
        # Not waited for when stopped: a cluster's stage runs on, and so does the thread following it.
        pool.shutdown(wait=False, cancel_futures=True)
    return schedule.outcome()


class _Schedule:
    """The stages of one ``llamarl run`` as they wait, run and end. Every stage whose inputs are
    done starts, up to the executor's concurrency (the local executor's max_concurrent_stages; a
    cluster queues what it cannot run yet): with max_staleness > 0 a rollout runs beside the ppo
    before it. A stage that reads only a part of a running input (Node.reads) starts once that
    part is published: polled, while there is room for it. A failed validation stops only what
    reads it: training goes on, and the run reports it at the end."""

    def __init__(self, spec: RunSpec, nodes: list[Node], by_name: dict[str, Node], executor: Executor, echo):
        self.spec, self.nodes, self.by_name, self.executor, self.echo = spec, nodes, by_name, executor, echo
        self.limit = executor.concurrency or len(nodes)
        self.early, self.redo = early_parts(nodes), must_redo(spec.run_dir, nodes, by_name)
        self.waiting, self.finished, self.running = list(nodes), set(), {}
        self.failure = None
        self.keys: dict[str, str | None] = {}  # each started node's key when it started
        self.given_up: dict[str, str] = {}
        self.report: list[tuple[str, str]] = []
        self.monitor = Monitor(spec)
        self.trash: Trash | None = None  # while stages run here (``_run_nodes``)

    def skipped(self, n: Node, will_run: set[str]) -> tuple[bool, str]:
        """(is ``n`` done, why), given the stages before it that ``will_run``; a done stage is
        reported skipped, a stale output (or its parts read early) removed before it runs. A stage
        whose output another stage published for it (a rollout its rules' scores) is recorded done
        here, no process started: then ``why`` is ``MADE_ELSEWHERE``."""
        redo = n.name in self.redo  # retention deleted its output, and a stage that runs needs it
        done, why = (False, self.redo[n.name]) if redo else assess(self.spec.run_dir, n, self.by_name, will_run)
        fresh = not any(i in will_run for i in n.inputs)  # else what it was made from is about to change
        if not done and fresh and not redo and published_current(n):
            _record_done(self.spec, n, self.by_name)
            self.report.append((n.name, "done: " + _made_by(n, self.by_name)))
            self.echo(f"[{n.name}] done: {_made_by(n, self.by_name)}")
            return True, MADE_ELSEWHERE
        if done:
            self.report.append((n.name, "skipped (done)"))
            self.echo(f"[{n.name}] done, skipped")
        else:
            _remove_stale(n, self.early.get(n.name, set()))
        return done, why

    def ready(self, n: Node) -> bool:
        # A part of a running input is this run's: the input's stale parts were removed when it started.
        started = {m.name for m in self.running.values()}
        return all(i in self.finished or (i in n.reads and i in started and published_id(input_url(n, i, self.by_name)))
                   for i in n.inputs)

    def may_start_early(self) -> bool:
        started = {m.name for m in self.running.values()}
        return (self.failure is None and len(self.running) < self.limit
                and any(i in started for n in self.waiting for i in n.reads))

    def start_ready(self, pool: ThreadPoolExecutor) -> None:
        """Start (or skip, when done) every waiting stage that is ready, while there is room."""
        for n in list(self.waiting) if self.failure is None else []:
            if len(self.running) >= self.limit:
                break
            lost = next((i for i in n.inputs if i in self.given_up), None)
            if lost is None and not self.ready(n):
                continue
            self.waiting.remove(n)
            if lost is not None:
                self.given_up[n.name] = f"{lost} failed"
                self.report.append((n.name, f"not run: {lost} failed"))
                continue
            run = self.spec.run_dir
            done, why = self.skipped(n, set())
            if done:
                self.finished.add(n.name)
                if why == MADE_ELSEWHERE:
                    _after_done(self.spec, n, self.nodes, self.by_name, self.monitor, self.echo, self.trash)
                continue
            early_from = [input_url(n, i, self.by_name)[len(run) + 1 :] for i in n.inputs if i not in self.finished]
            if early_from:
                why += f"; {', '.join(early_from)} published"
            beside = f" (beside {', '.join(m.name for m in self.running.values())})" if self.running else ""
            self.echo(f"[{n.name}] running {n.stage} on {n.nprocs} process(es): {why}{beside}")
            write_record(run, n, status="running", started=_now(), error=None, key=None, job=None)
            self.keys[n.name] = node_key(n, self.by_name)
            self.running[pool.submit(self.executor.run, n.stage, n.make_config(), n.nprocs, n.layout.nodes,
                                     name=n.name)] = n

    def collect(self, ended) -> list[Node]:
        """Record the stages that ended, done or failed; the done ones, whose bookkeeping
        (retention, metrics) is the caller's."""
        done = []
        for future in ended:
            n, result = self.running.pop(future), future.result()
            if _record_end(self.spec, n, self.by_name, result, self.keys.get(n.name)):
                self.finished.add(n.name)
                self.report.append((n.name, "ran"))
                done.append(n)
            elif n.role == VALIDATE:
                self.given_up[n.name] = result.error
                self.echo(f"[{n.name}] failed ({result.error}); training goes on")
            else:
                self.failure = self.failure or (n, result)
        return done

    def outcome(self) -> list[tuple[str, str]]:
        """The report, or the run's one-line error: a failed training stage, else a failed validation."""
        if self.failure is not None:
            n, result = self.failure
            raise PipelineError(f"stage {n.name} failed ({result.error}); fix it and rerun `llamarl run` — finished "
                                "stages are kept")
        failed = [name for name, why in self.given_up.items()
                  if self.by_name[name].role == VALIDATE and "failed" not in why]
        if failed:
            raise PipelineError(f"validation {', '.join(failed)} failed ({self.given_up[failed[0]]}); every training "
                                f"stage ran — fix it and rerun `llamarl run`, which runs only what is not done")
        return self.report

    def stop(self, why: BaseException) -> None:
        """The driver stops (``why``: a signal, Ctrl-C, an error of its own). The executor stops
        what is its to stop — every process of each local stage, before it returns — and each
        stage's record says how it ended: done or failed if it ended just before the stop, else
        stopped. A cluster's job runs on and keeps its "running" record: a later ``llamarl run``
        follows or resumes it."""
        stopped = set(self.executor.stop_all() or ())
        cause = why.name if isinstance(why, Stopped) else f"{type(why).__name__}: {why}".splitlines()[0][:200]
        ours = {f: n for f, n in self.running.items() if n.name in stopped or f.done()}
        wait(ours)  # a stopped stage's thread ends with its processes, which are gone now
        for future, n in ours.items():
            result = None if future.exception() is not None else future.result()
            if result is not None and (result.ok or n.name not in stopped):  # it ended just before the stop
                _record_end(self.spec, n, self.by_name, result, self.keys.get(n.name))
                stopped.discard(n.name)
            elif n.name in stopped:
                write_record(self.spec.run_dir, n, status="stopped", finished=None,
                             error=f"llamarl run stopped it at {_now()} ({cause}); rerun to resume")
        if isinstance(why, Stopped):
            why.stages = sorted(stopped)
