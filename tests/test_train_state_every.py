"""retention.train_state_every: a ppo between every N-th leaves its training state in the resident
workers' memory for the next ppo and publishes it as not written; the weights are those of a run
that writes every state; a crash then costs a remake of the iterations since the newest state
written, which comes out as it was; retention keeps what that remake starts from. A ppo outside
a resident worker, which cannot keep its state: tests/test_ppo.py.

Every run here is a spec of tiny toy-model iterations at one path, as in tests/test_resident.py.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import yaml

from driver import ENV, start
from llamarl.lib.errors import EXIT_USER_ERROR, UserError
from llamarl.lib.files import publish
from llamarl.pipeline import toy
from llamarl.pipeline.dag import load_spec
from llamarl.pipeline.run import run_spec
from llamarl.stages import contract
from test_resident import LAYOUT, _registered, published

STATE = f"ppo/{contract.TRAIN_STATE}/{contract.ACTOR}"


@pytest.fixture(scope="module")
def toy_spec(tmp_path_factory):
    """``make(iterations, **retention)``: the spec's path and run directory, the run emptied."""
    root = tmp_path_factory.mktemp("state-every")
    toy.make_llama(str(root / "actor"), hidden_size=32)
    toy.make_prompts(str(root / "train.jsonl"), n=16)

    def make(iterations: int, **retention) -> tuple[str, str]:
        data = {"name": "toy", "storage": str(root / "runs"), "actor": str(root / "actor"),
                "prompts": str(root / "train.jsonl"), "prompts_per_iteration": 8, "seed": 7,
                "iterations": iterations, "retention": retention,
                "rollout": {"id_column": "id", "chunk_size": 4,
                            "sampling": {"samples_per_prompt": 2, "max_new_tokens": 4}},
                "score": {"rewards": [{"name": "llamarl.pipeline.demo:vowel_ratio"}]},
                "ppo": {"advantage": "grpo", "mini_batch_size": 16, "actor_lr": 0.01},
                "layout": LAYOUT, "executor": {"kind": "local", "options": {"resident": True, "grace_s": 1}}}
        shutil.rmtree(root / "runs", ignore_errors=True)
        path = root / "spec.yaml"
        path.write_text(yaml.safe_dump(data))
        return str(path), str(root / "runs" / "toy")

    return make


def _without_unwritten(found: dict, run: str) -> dict:
    """``published``'s files, less those of the training states a run with every state written has
    and this ``run`` published as not written."""
    gone = [rel for rel in (f"iter-{i:03d}/{STATE}" for i in range(1, 10)) if publish.unwritten(f"{run}/{rel}")]
    return {k: v for k, v in found.items() if not any(k.startswith(g + "/") for g in gone)}


def _summaries(run: str, iterations: int) -> list[dict]:
    return [publish.read_manifest(f"{run}/iter-{i:03d}/ppo")["summary"] for i in range(1, iterations + 1)]


@pytest.mark.slow
def test_states_between_every_nth_stay_in_memory_and_the_weights_are_those_of_every_state_written(toy_spec):
    spec, run = toy_spec(3)
    run_spec(load_spec(spec), echo=lambda m: None)
    expected = published(run)
    spec, run = toy_spec(3, train_state_every=2)
    run_spec(load_spec(spec), echo=lambda m: None)
    # Iteration 1's state stays in memory; 2's is written (every 2nd), and 3's (the last).
    assert [publish.unwritten(f"{run}/iter-00{i}/{STATE}") for i in (1, 2, 3)] == [True, False, False]
    assert sorted(os.listdir(f"{run}/iter-001/{STATE}")) == sorted([publish.MANIFEST, publish.RETIRED])
    summaries = _summaries(run, 3)
    assert [s["train_state"] for s in summaries] == ["kept in memory", "written", "written"]
    assert [s["models_from"] for s in summaries] == ["files", "memory", "memory"]
    found = published(run)
    assert found == _without_unwritten(expected, run) and len(found) < len(expected)
    status = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "status", run], capture_output=True,
                            text=True, env=ENV, timeout=120)
    assert "not written: train_state/actor/ (retention.train_state_every)" in status.stdout, status.stdout
    with pytest.raises(UserError, match=r"iter-001/ppo/train_state/actor was not written \(the next ppo takes it"):
        publish.require_published(f"{run}/iter-001/{STATE}")


@pytest.mark.slow
def test_a_crash_remakes_the_iterations_since_the_newest_state_written_as_they_were(toy_spec):
    spec, run = toy_spec(4, train_state_every=2, keep_last=1)
    run_spec(load_spec(spec), echo=lambda m: None)
    expected = published(run)
    spec, run = toy_spec(4, train_state_every=2, keep_last=1)  # the same run, from the start
    # Killed in ppo 4, whose start (state 3) was never written.
    driver = start(spec, env={**ENV, "LLAMARL_TEST_PPO_AT": "step 4:sleep=60"})
    procs = _registered(run, "iter-004/ppo", driver)
    time.sleep(2)
    # keep_last: 1 let ppo 2's output go but for what a rerun starts from: its weights and state.
    assert not publish.unwritten(f"{run}/iter-002/{STATE}") and publish.retired(f"{run}/iter-002/{STATE}") is None
    assert publish.retired(f"{run}/iter-001/ppo/actor") is not None
    os.kill(procs["iter-004/ppo"][1], signal.SIGKILL)
    out, _ = driver.communicate(timeout=120)
    assert driver.returncode == EXIT_USER_ERROR, out
    rerun = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "run", spec], capture_output=True,
                           text=True, env=ENV, timeout=600)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    # ppo 3 again, from state 2 — and as it was: the rollout after it stays done.
    assert "[iter-003/ppo] running ppo" in rerun.stdout and "[iter-002/ppo] done, skipped" in rerun.stdout
    assert "[iter-003/ppo] made again as it was" in rerun.stdout and "[iter-004/rollout] done, skipped" in rerun.stdout
    assert _summaries(run, 4)[3]["models_from"] == "memory"
    assert published(run) == expected
    assert publish.retired(f"{run}/iter-002/{STATE}") is not None  # state 4 is written now


def test_train_state_every_needs_resident_workers(toy_spec):
    spec, _ = toy_spec(2, train_state_every=2)
    data = yaml.safe_load(open(spec))
    data["executor"]["options"]["resident"] = False
    with open(spec, "w") as f:
        yaml.safe_dump(data, f)
    with pytest.raises(UserError, match=r"retention.train_state_every=2 leaves training states in the resident "
                                        r"workers' memory") as e:
        load_spec(spec)
    assert "\n" not in str(e.value)


def test_a_rerun_starts_from_the_newest_state_whole(tmp_path):
    """Retention keeps what a rerun starts from: the newest done ppo whose training state is on
    disk — not one published as not written, nor one whose files retention deleted."""
    from types import SimpleNamespace

    from llamarl.pipeline.retention import _restart_from

    ppos = []
    for i, state in enumerate(["whole", "deleted", "unwritten", None], start=1):  # None: ppo 4 not done
        out = tmp_path / f"iter-00{i}" / "ppo"
        root = str(out / contract.TRAIN_STATE / contract.ACTOR)
        os.makedirs(root)
        manifest = {"kind": contract.TRAIN_STATE, "files": {}}
        if state == "unwritten":
            publish.publish_unwritten(root, manifest, "kept")
        elif state is not None:
            publish.publish(root, manifest)
        if state == "deleted":
            publish.retire(root, "retention keep_last: 1")
        ppos.append(SimpleNamespace(name=f"iter-00{i}/ppo", out=str(out), iteration=i, state=state))
    spec = SimpleNamespace(retention=SimpleNamespace(train_state_every=2))
    done = lambda name: not name.startswith("iter-004")  # noqa: E731
    assert _restart_from(spec, ppos, done) == 1
    assert _restart_from(spec, ppos[1:], done) == 0  # none whole: the shard
    spec.retention.train_state_every = 1  # every state written: nothing to keep for it
    assert _restart_from(spec, ppos, done) == -1
