"""The stages of one ``llamarl run`` as they wait, run and end (``Schedule``), and what the run's
records say of each when it ends: the bookkeeping that pipeline/run.py's two drivers (the
foreground loop and ``--detach``) share."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor, wait
from datetime import datetime, timezone

import fsspec

from llamarl.cluster.executor import Executor
from llamarl.lib.errors import Stopped, UserError
from llamarl.lib.runtime.background import Behind

from .dag import VALIDATE, Node, early_parts
from .metrics import update_metrics, validation_metrics
from .monitor import Monitor
from .progress import Progress
from .records import (REDONE, assess, fingerprints, input_url, must_redo, node_key, published_current, published_id,
                      retired_parts, write_record)
from .remakes import being_remade, drop_before, manifests, remade_as_it_was, save_before
from .retention import Trash, retire_done
from .spec import RunSpec


class PipelineError(UserError):
    pass


def now() -> str:
    """UTC to the millisecond: a stage that ran beside another for under a second still overlaps it."""
    return datetime.now(timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def record_end(spec: RunSpec, n: Node, by_name: dict[str, Node], result, key: str | None = None) -> bool:
    """Record how ``n`` ended, done or failed (its ``StageResult``); whether it is done."""
    if result.ok:
        record_done(spec, n, by_name, key)
    else:
        write_record(spec.run_dir, n, status="failed", error=result.error, finished=None)
    return result.ok


def record_done(spec: RunSpec, n: Node, by_name: dict[str, Node], key: str | None = None) -> None:
    """``key``: the node's key when it started, if known (an input read early could have been
    rewritten since: then the record keeps the key of what the stage read, which is now stale). A
    validation's scores also record its metrics (retention may delete the scores)."""
    extra = {}
    if n.role == VALIDATE and n.stage == "score":
        extra["metrics"] = validation_metrics(n.out, spec.validation.pass_threshold)
    write_record(spec.run_dir, n, status="done", key=key or node_key(n, by_name), output_id=published_id(n.out),
                 external=fingerprints(n), finished=now(), error=None, **extra)


def update_metrics_after(spec: RunSpec, n: Node, monitor: Monitor) -> None:
    """The run's metrics, to its sinks and its plot, when ``n``'s end changed them."""
    if n.stage == "ppo" or (n.role == VALIDATE and n.stage == "score"):
        monitor.update(update_metrics(spec.run_dir, spec.iterations, spec.pass_threshold))


def made_by_stage(n: Node) -> list[str]:
    """What ``n``'s stage publishes: its output, and a rollout's rules' scores (RolloutConfig.scores)."""
    scores = n.make_config().scores if n.stage == "rollout" else None
    return [n.out] + ([scores.out] if scores is not None else [])


def _remove_stale(n: Node, parts: set[str] = frozenset()) -> None:
    """Before ``n`` runs: its published output, whose config or inputs changed, removed; or, when
    it is unfinished, the ``parts`` of it that other stages read early (a killed run of ``n``
    published them): the stage writes them again, and nothing may start from the old ones."""
    # A rollout's rules' scores are made from the rollout that runs again: stale, and the rollout
    # that publishes the new ones would refuse to overwrite them.
    stale = made_by_stage(n)[1:]
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


PART_POLL_S = 0.2  # how often a part of a running stage is looked for (a manifest's existence: cheap)


class Schedule:
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
        self.prepared: set[str] = set()  # the nodes the executor was told come next (``prepare_next``)
        self.given_up: dict[str, str] = {}
        self.report: list[tuple[str, str]] = []
        self.monitor = Monitor(spec)
        # The run's metrics and their plot (a second or so, more as the run grows) are written in a
        # thread of their own, in order: the loop goes on starting stages meanwhile.
        self.metrics = Behind(lambda n: update_metrics_after(spec, n, self.monitor), depth=8, background=True,
                              name="metrics")
        self.trash: Trash | None = None  # while stages run here (``_run_nodes``)
        self.rebuilt: set[str] = set()  # running or waiting nodes made again, what they were kept (remakes.py)
        self.kept = being_remade(spec.run_dir, [n.name for n in nodes])  # what was kept of them, on disk
        self.detached = False  # every stage submitted at once (``run._submit_nodes``)
        self.progress = Progress(spec.iterations, echo)

    def skipped(self, n: Node, will_run: set[str], clear: bool = True) -> tuple[bool, str]:
        """(is ``n`` done, why), given the stages before it that ``will_run``; a done stage is
        reported skipped, one that runs made ready for it (``clear``, unless ``clear`` is False). A
        stage whose output another stage published for it (a rollout its rules' scores) is recorded
        done here, no process started: then ``why`` is ``MADE_ELSEWHERE``."""
        run = self.spec.run_dir
        redo = n.name in self.redo  # retention deleted its output, and a stage that runs needs it
        done, why = (False, self.redo[n.name]) if redo else assess(run, n, self.by_name, will_run)
        fresh = not any(i in will_run for i in n.inputs)  # else what it was made from is about to change
        whole = not redo or not retired_parts(n.out)  # a stage of this run made it again (a rollout its scores)
        if not done and fresh and whole and published_current(n):
            if n.name in self.kept:  # a remake whose stage published all but did not end well
                self.kept.discard(n.name)
                remade_as_it_was(run, n.name, made_by_stage(n))
            record_done(self.spec, n, self.by_name)
            self.report.append((n.name, "done: " + _made_by(n, self.by_name)))
            self.echo(f"[{n.name}] done: {_made_by(n, self.by_name)}")
            return True, MADE_ELSEWHERE
        if done:
            if n.name in self.kept:  # a done stage is not being made again
                self.kept.discard(n.name)
                drop_before(run, n.name)
            self.report.append((n.name, "skipped (done)"))
            self.echo(f"[{n.name}] done, skipped")
        elif clear:
            self.clear(n, why)
        return done, why

    def clear(self, n: Node, why: str) -> None:
        """Before ``n`` runs: what its outputs were kept where it is made again (remakes.py), then
        its stale output (or its parts read early) removed."""
        run = self.spec.run_dir
        # Detached, a stage that runs only if an input comes out of its remake otherwise is
        # submitted all the same (nothing waits to see): kept too, it keeps its id if it comes out
        # as it was, and so what follows stays current for later runs.
        conditional = self.detached and why == REDONE
        published = published_id(n.out) is not None
        if published and (n.name in self.redo or conditional):
            save_before(run, n.name, {url: manifests(url) for url in made_by_stage(n)})
            self.kept.add(n.name)
            self.rebuilt.add(n.name)
        elif n.name in self.kept:
            if not published:  # a remake that did not end: it compares with what it kept
                self.rebuilt.add(n.name)
            else:  # its output is published since: what was kept of an older one is stale
                self.kept.discard(n.name)
                drop_before(run, n.name)
        _remove_stale(n, self.early.get(n.name, set()))

    def remaking(self) -> frozenset[str]:
        """The stages this run makes again, retention having deleted what a stage that runs needs,
        that have not ended yet."""
        return frozenset(self.redo) - self.finished

    def ready(self, n: Node) -> bool:
        # A part of a running input is this run's: the input's stale parts were removed when it started.
        # Not of a remake's, whose ids may yet go back to what they were when it ends.
        early = {m.name for m in self.running.values()} - self.rebuilt
        return all(i in self.finished or (i in n.reads and i in early and published_id(input_url(n, i, self.by_name)))
                   for i in n.inputs)

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
                    retire_done(self.spec, self.nodes, self.by_name, self.echo, self.trash, self.remaking())
                    self.metrics.put(n)
                continue
            early_from = [input_url(n, i, self.by_name)[len(run) + 1 :] for i in n.inputs if i not in self.finished]
            if early_from:
                why += f"; {', '.join(early_from)} published"
            beside = f" (beside {', '.join(m.name for m in self.running.values())})" if self.running else ""
            self.echo(f"[{n.name}] running {n.stage} on {n.nprocs} process(es): {why}{beside}")
            write_record(run, n, status="running", started=now(), error=None, key=None, job=None)
            self.keys[n.name] = node_key(n, self.by_name)
            self.running[pool.submit(self.executor.run, n.stage, n.make_config(), n.nprocs, n.layout.nodes,
                                     name=n.name)] = n
        self.prepare_next()

    def poll_s(self) -> float:
        """How long the driver may wait for a stage to end before it looks again: a fifth of a second
        while a waiting stage may start from a part of a running one (a rollout from its ppo's
        ``actor/``: each wait is on the iteration's critical path), else a second."""
        if len(self.running) < self.limit:
            running = {m.name for m in self.running.values()}
            if any(i in running for n in self.waiting for i in n.reads):
                return PART_POLL_S
        return 1.0

    def prepare_next(self) -> None:
        """Tell the executor, once each, of the waiting stages that come next: each of whose inputs
        is done, running, or itself waits only on done or running stages (``Executor.prepare``:
        resident workers get ready for them — ppo's compiled kernels — while the running stages
        work)."""
        if self.failure is not None or not self.running:
            return
        near = self.finished | {m.name for m in self.running.values()}
        waiting = {n.name: n for n in self.waiting}
        for n in self.waiting:
            if n.name not in self.prepared and all(
                    i in near or (i in waiting and set(waiting[i].inputs) <= near) for i in n.inputs):
                self.prepared.add(n.name)
                self.executor.prepare(n.stage, n.make_config(), n.nprocs, name=n.name)

    def step(self, ended, pool: ThreadPoolExecutor) -> None:
        """After a wait: record the stages that ``ended``, and start what they made ready. Retention's
        deletions (moved to the trash, emptied beside) come before the start, for the started
        stage's free-space check; the run's metrics after, behind (``metrics``)."""
        done = self.collect(ended)
        for n in done:
            self.progress.ended(n, self.finished, self.by_name)
        if done:
            retire_done(self.spec, self.nodes, self.by_name, self.echo, self.trash, self.remaking())
        self.start_ready(pool)
        for n in done:
            self.metrics.put(n)

    def collect(self, ended) -> list[Node]:
        """Record the stages that ended, done or failed; the done ones."""
        done = []
        for future in ended:
            n, result = self.running.pop(future), future.result()
            if self._record_end(n, result):
                self.finished.add(n.name)
                self.report.append((n.name, "ran"))
                done.append(n)
            elif n.role == VALIDATE:
                self.given_up[n.name] = result.error
                self.echo(f"[{n.name}] failed ({result.error}); training goes on")
            else:
                self.failure = self.failure or (n, result)
        return done

    def _record_end(self, n: Node, result) -> bool:
        """``record_end``, a remake's ids first put back where it came out as it was; whether it is done."""
        if n.name in self.rebuilt:
            self.rebuilt.discard(n.name)
            if result.ok:  # what was kept goes; a failed remake's stays, for its next run
                self.kept.discard(n.name)
                if remade_as_it_was(self.spec.run_dir, n.name, made_by_stage(n)):
                    self.echo(f"[{n.name}] made again as it was: it keeps its id, and what was made from it "
                              "stays done")
        return record_end(self.spec, n, self.by_name, result, self.keys.get(n.name))

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
                self._record_end(n, result)
                stopped.discard(n.name)
            elif n.name in stopped:
                write_record(self.spec.run_dir, n, status="stopped", finished=None,
                             error=f"llamarl run stopped it at {now()} ({cause}); rerun to resume")
        if isinstance(why, Stopped):
            why.stages = sorted(stopped)
