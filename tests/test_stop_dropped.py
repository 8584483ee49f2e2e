"""A stop the interpreter dropped still stops the run. A signal's handler raises ``Stopped``
wherever the main thread is; inside a finalizer (a ``__del__``, a weakref callback) the
interpreter prints that exception and drops it, and a driver that ignores a second signal while it
stops would then run on until its stages end: `llamarl run`'s loop raises the stop again."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import pytest
import yaml

from llamarl.cluster.executor import Executor
from llamarl.lib.errors import Stopped
from llamarl.pipeline import demo
from llamarl.pipeline import run as run_module
from llamarl.pipeline.cli import stopped_by_signals
from llamarl.pipeline.dag import build_dag, load_spec
from llamarl.pipeline.records import read_record


class _SignalledInAFinalizer:
    def __del__(self):
        os.kill(os.getpid(), signal.SIGHUP)
        for _ in range(1000):  # the handler runs here, and what it raises is dropped
            pass


class _StageUntilStopped(Executor):
    """Every stage runs until ``stop_all`` (or ``limit_s``, then it succeeds)."""

    launches, concurrency = True, 1

    def __init__(self, limit_s: float):
        self.limit_s, self.stopped, self.running = limit_s, threading.Event(), None

    def run(self, stage, config, nprocs, nodes=1, *, name=None):
        from llamarl.cluster.executor import StageResult

        self.running = name
        self.stopped.wait(self.limit_s)
        return StageResult(1, "stopped") if self.stopped.is_set() else StageResult(0)

    def stop_all(self):
        self.stopped.set()
        return [self.running]


def test_a_stop_dropped_in_a_finalizer_still_stops_the_run(tmp_path, monkeypatch):
    data = yaml.safe_load(open(demo.make_inputs(str(tmp_path))))
    (tmp_path / "spec.yaml").write_text(yaml.safe_dump({**data, "iterations": 1}))
    spec = load_spec(str(tmp_path / "spec.yaml"))
    nodes = build_dag(spec)
    real_wait, waits = run_module.wait, []

    def wait(*args, **kwargs):  # the loop's first wait: a signal whose stop a finalizer drops
        waits.append(time.monotonic())
        if len(waits) == 1:
            _SignalledInAFinalizer()
        return real_wait(*args, **kwargs)

    monkeypatch.setattr(run_module, "wait", wait)
    dropped = []  # what the interpreter drops, it hands to sys.unraisablehook first
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_type))
    executor = _StageUntilStopped(limit_s=30)
    start = time.monotonic()
    with pytest.raises(Stopped) as stopped, stopped_by_signals():
        run_module._run_nodes(spec, nodes, {n.name: n for n in nodes}, executor, echo=lambda m: None)
    assert dropped == [Stopped]
    assert stopped.value.name == "SIGHUP" and stopped.value.stages == [executor.running]
    assert time.monotonic() - start < 10 and executor.stopped.is_set()
    node = next(n for n in nodes if n.name == executor.running)
    assert read_record(spec.run_dir, node)["status"] == "stopped"


def test_a_stop_dropped_in_a_finalizer_still_stops_a_stage_and_its_processes(monkeypatch):
    """`llamarl stage`: the executor waits for the stage's processes in the main thread."""
    from llamarl.cluster.local import LocalExecutor, LocalRun, survivors

    executor = LocalExecutor()
    monkeypatch.setattr(executor, "command", lambda stage, config: [sys.executable, "-c", "import time; time.sleep(60)"])
    real_status, polls, runs = LocalRun.status, [], []

    def status(run, rank):  # the first poll: a signal whose stop a finalizer drops
        polls.append(rank)
        if len(polls) == 1:
            runs.append(run)
            _SignalledInAFinalizer()
        return real_status(run, rank)

    monkeypatch.setattr(LocalRun, "status", status)
    dropped = []
    monkeypatch.setattr(sys, "unraisablehook", lambda u: dropped.append(u.exc_type))
    start = time.monotonic()
    with pytest.raises(Stopped), stopped_by_signals():
        executor.run("rollout", None, 1)
    assert dropped == [Stopped] and time.monotonic() - start < 10
    assert survivors(runs[0].groups) == {}
