"""Made again as it was (pipeline/remakes.py): a new validation of an iteration retention deleted
remakes it, and what comes out byte for byte as it was keeps its id, so nothing after it runs
again — with stages at once, after a remake that failed once, where only some parts come out as
they were, for two validations at once, and detached. Stages here only publish files whose bytes
depend on the stage alone (or, where a test says, on how often it ran)."""

from __future__ import annotations

import threading
import time

import pytest
import yaml

from llamarl.cluster.executor import Executor, StageResult
from llamarl.lib.files import publish
from llamarl.pipeline import demo
from llamarl.pipeline.dag import build_dag, load_spec

PPO_PARTS = ("actor", "critic", "train_state/actor", "train_state/critic")
READS = {"ppo": ("rollout", "scores", "actor", "critic"), "rollout": ("actor",), "score": ("rollout",), "export": ("src",)}


class Publisher(Executor):
    """Each stage publishes what its real one does, in the same order (ppo its ``actor/`` first,
    then, ``pause`` seconds later, the rest and its root naming the parts' ids), and refuses an
    input retention deleted as the real ones do. ``fail``: stages that fail once, writing nothing;
    ``differ``: ppo parts (by stage) whose bytes change each time the stage runs; ``fail_after``:
    stages that publish all, then end failed once (a crash at teardown)."""

    launches = True

    def __init__(self, concurrency: int = 1, pause: float = 0.3, fail=(), differ=None, fail_after=()):
        self.concurrency, self.pause = concurrency, pause
        self.fail, self.differ, self.fail_after = set(fail), differ or {}, set(fail_after)
        self.ran: list[str] = []
        self._lock = threading.Lock()

    def _bytes(self, name: str, part: str) -> bytes:
        return f"{name}/{part}:{self.ran.count(name) if part in self.differ.get(name, ()) else 0}".encode()

    def _part(self, url: str, kind: str, data: bytes, **extra) -> None:
        publish.prepare(url, lambda m: False)
        entry = publish.write_bytes(f"{url}/data.bin", data)
        publish.publish(url, {"kind": kind, "files": {"data.bin": entry}, "at": time.time(), **extra})

    def run(self, stage, config, nprocs, nodes=1, *, name=None):
        with self._lock:
            self.ran.append(name)
        if name in self.fail:
            self.fail.discard(name)
            return StageResult(1, "node lost")
        for field in READS.get(stage, ()):
            if getattr(config, field, None):
                try:
                    publish.require_published(getattr(config, field))
                except Exception as e:  # what the stage's one-line error would say
                    return StageResult(2, str(e).splitlines()[0])
        out = getattr(config, "out", None) or config.dst
        summary = {"mean_score": 0.0, "mean_response_length": 0.0}
        if stage != "ppo":
            self._part(out, stage, self._bytes(name, ""), summary=summary)
            if stage == "rollout" and config.scores is not None:
                self._part(config.scores.out, "scores", self._bytes(name, "scores"))
            return StageResult(0)
        publish.prepare(out, lambda m: False)
        for part in PPO_PARTS:
            self._part(f"{out}/{part}", "checkpoint", self._bytes(name, part), at=time.time())
            if part == "actor":
                time.sleep(self.pause)  # the training state is written after the actor
        from llamarl.stages.identity import declare

        metrics = publish.write_bytes(f"{out}/metrics.jsonl", b"")
        publish.publish(out, {"kind": "ppo", "files": {"metrics.jsonl": metrics}, "at": time.time(),
                              "summary": summary, "outputs": {p: publish.output_id(f"{out}/{p}") for p in PPO_PARTS},
                              "request": declare(config).request()})  # as stages/ppo.py records it
        if name in self.fail_after:
            self.fail_after.discard(name)
            return StageResult(1, "exit 1 at teardown, after publishing")
        return StageResult(0)

    def stop_all(self):
        return []


class Submitter(Publisher):
    """Detached: each job runs as it is submitted (its inputs' jobs ran before it), its recorder
    around it, as a stage's job records itself."""

    detach = "jobs"

    def submit_after(self, stage, config, nprocs, nodes=1, *, name=None, after=(), recorder=None):
        recorder.started(str(len(self.ran)))
        recorder.ended(self.run(stage, config, nprocs, nodes, name=name))
        return str(len(self.ran))


@pytest.fixture(autouse=True)
def _no_real_scores(monkeypatch):
    """A validation's metrics and the run's plot read real score rows; these stages write none."""
    from llamarl.pipeline import run as run_mod, schedule

    monkeypatch.setattr(schedule, "validation_metrics", lambda url, threshold: {"val_score": 0.0})
    monkeypatch.setattr(schedule, "update_metrics_after", lambda spec, n, monitor: None)
    monkeypatch.setattr(run_mod, "update_metrics_after", lambda spec, n, monitor: None)


def _spec(tmp_path, name: str, every: int, iterations: int = 3, concurrency: int = 1, keep_samples: bool = True) -> str:
    path = demo.make_inputs(str(tmp_path))
    with open(path) as f:
        data = yaml.safe_load(f)
    data.update(layout=demo.OVERLAP_LAYOUT, iterations=iterations, validation=data["validation"] | {"every": every},
                retention={"keep_last": 1, "keep_samples": keep_samples},
                executor={"kind": "local", "options": {"max_concurrent_stages": concurrency}})
    out = tmp_path / name
    out.write_text(yaml.safe_dump(data))
    return str(out)


def _run(spec_path: str, executor: Publisher) -> list[str]:
    from llamarl.pipeline.run import _run_nodes

    spec = load_spec(spec_path)
    nodes = build_dag(spec)
    said: list[str] = []
    _run_nodes(spec, nodes, {n.name: n for n in nodes}, executor, echo=said.append)
    return said


def _not_done(spec_path: str) -> dict:
    from llamarl.pipeline.records import plan

    spec = load_spec(spec_path)
    nodes = build_dag(spec)
    return {k: why for k, (done, why) in plan(spec.run_dir, nodes, {n.name: n for n in nodes}).items() if not done}


def _ids(spec_path: str) -> dict[str, str | None]:
    from llamarl.pipeline.records import published_id

    return {n.name: published_id(n.out) for n in build_dag(load_spec(spec_path))}


VALIDATION_1 = ["iter-001/ppo", "iter-001/val-rollout", "iter-001/val-scores"]


@pytest.mark.slow
def test_stages_that_read_a_remake_early_wait_for_it_to_end(tmp_path):
    """Two stages at once: the next rollout and the new validation read ppo 1's actor/ only, and
    would start from it while the remake runs — before its ids go back."""
    _run(_spec(tmp_path, "a.yaml", every=2, concurrency=2), Publisher(2))
    spec = _spec(tmp_path, "b.yaml", every=1, concurrency=2)
    ex = Publisher(2)
    said = _run(spec, ex)
    assert "[iter-001/ppo] made again as it was: it keeps its id, and what was made from it stays done" in said
    assert sorted(ex.ran) == VALIDATION_1
    assert _not_done(spec) == {}


@pytest.mark.slow
def test_a_remade_chain_read_early_leaves_every_stage_done(tmp_path):
    _run(_spec(tmp_path, "a.yaml", every=3, concurrency=2, keep_samples=False), Publisher(2))
    spec = _spec(tmp_path, "b.yaml", every=2, concurrency=2, keep_samples=False)
    ex = Publisher(2)
    _run(spec, ex)
    assert sorted(ex.ran) == sorted([f"iter-00{k}/{s}" for k in (1, 2) for s in ("rollout", "scores", "ppo")]
                                    + ["iter-002/val-rollout", "iter-002/val-scores"])
    assert _not_done(spec) == {}


@pytest.mark.slow
def test_a_remake_that_failed_once_is_still_compared_with_what_it_was(tmp_path):
    from llamarl.pipeline.schedule import PipelineError

    _run(_spec(tmp_path, "a.yaml", every=2), Publisher())
    spec = _spec(tmp_path, "b.yaml", every=1)
    with pytest.raises(PipelineError, match="iter-001/ppo failed"):
        _run(spec, Publisher(fail={"iter-001/ppo"}))
    ex = Publisher()
    _run(spec, ex)
    assert sorted(ex.ran) == VALIDATION_1
    assert _not_done(spec) == {}


@pytest.mark.slow
def test_a_remake_with_one_part_otherwise_gets_a_new_id_whole(tmp_path):
    """ppo 1's actor comes out as it was, its training state not: none of its manifests go back
    (its root would name an actor id that is no longer actor/'s). The readers of its training
    state run again; everything is done at the end."""
    _run(_spec(tmp_path, "a.yaml", every=2), Publisher())
    spec = _spec(tmp_path, "b.yaml", every=1)
    before = _ids(spec)
    ex = Publisher(differ={"iter-001/ppo": {"train_state/actor"}})
    said = _run(spec, ex)
    assert not any("made again as it was" in line for line in said)
    assert _ids(spec)["iter-001/ppo"] != before["iter-001/ppo"] and "iter-002/ppo" in ex.ran
    assert _not_done(spec) == {}


@pytest.mark.slow
def test_two_new_validations_remake_what_the_later_one_needs(tmp_path):
    """Validations of iterations 1 and 3, both deleted: ppo 3's remake needs ppo 2's training
    state, rollout 3 and scores 3, deleted too — which run only if ppo 1 came out otherwise, were
    it not for ppo 3."""
    _run(_spec(tmp_path, "a.yaml", every=2, iterations=4, keep_samples=False), Publisher())
    spec = _spec(tmp_path, "b.yaml", every=1, iterations=4, keep_samples=False)
    states = _not_done(spec)
    assert states["iter-002/ppo"].startswith("deleted by retention, and iter-003/ppo needs it")
    ex = Publisher()
    _run(spec, ex)
    assert "iter-003/ppo" in ex.ran and "iter-004/ppo" not in ex.ran
    assert _not_done(spec) == {}


@pytest.mark.slow
def test_a_detached_run_leaves_what_comes_out_as_it_was_with_its_id(tmp_path):
    """Detached, every stage after a remake is submitted (nothing waits to see how it comes out):
    they run again, and each that comes out as it was keeps its id."""
    from llamarl.pipeline.run import run_spec

    _run(_spec(tmp_path, "a.yaml", every=2), Publisher())
    spec = _spec(tmp_path, "b.yaml", every=1)
    before = _ids(spec)
    ex = Submitter()
    run_spec(load_spec(spec), detach=True, executor=ex, echo=lambda m: None)
    assert set(VALIDATION_1) < set(ex.ran) and "iter-003/ppo" in ex.ran
    after = _ids(spec)
    assert {k: v for k, v in after.items() if before.get(k) is not None} == {k: v for k, v in before.items() if v}
    assert _not_done(spec) == {}


def _kept(spec_path: str) -> list[str]:
    """What remakes kept of their outputs (``pipeline/<stage>.before.json``)."""
    folder = f"{load_spec(spec_path).run_dir}/pipeline"
    import os

    return sorted(f for f in os.listdir(folder) if f.endswith(".before.json"))


@pytest.mark.slow
def test_a_remake_that_published_all_then_failed_keeps_its_id_and_what_it_kept_goes(tmp_path):
    from llamarl.pipeline.schedule import PipelineError

    _run(_spec(tmp_path, "a.yaml", every=2), Publisher())
    spec = _spec(tmp_path, "b.yaml", every=1)
    before = _ids(spec)
    with pytest.raises(PipelineError, match="iter-001/ppo failed"):
        _run(spec, Publisher(fail_after={"iter-001/ppo"}))
    assert _kept(spec) == ["iter-001.ppo.before.json"]
    ex = Publisher()
    _run(spec, ex)  # its output was published with this config and inputs: done, as it was
    assert _ids(spec)["iter-001/ppo"] == before["iter-001/ppo"] and sorted(ex.ran) == VALIDATION_1[1:]
    assert _kept(spec) == [] and _not_done(spec) == {}


@pytest.mark.slow
def test_a_detached_submission_that_fails_leaves_what_it_did_not_submit(tmp_path):
    from llamarl.pipeline.run import run_spec

    class Refusing(Submitter):
        def submit_after(self, *args, **kwargs):
            raise RuntimeError("sbatch: error: Batch job submission failed")

    _run(_spec(tmp_path, "a.yaml", every=2), Publisher())
    spec = _spec(tmp_path, "b.yaml", every=1)
    with pytest.raises(RuntimeError, match="submission failed"):
        run_spec(load_spec(spec), detach=True, executor=Refusing(), echo=lambda m: None)
    ex = Publisher()
    _run(spec, ex)
    assert sorted(ex.ran) == VALIDATION_1 and _not_done(spec) == {}
