"""`llamarl run` stopped by a signal stops every process of its stages; a driver killed outright
takes its stages' processes with it, and the run that takes over stops what they started (#27): a
real `llamarl run` on the demo's tiny models, its stage processes checked by pid."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest
import yaml

from driver import ENV, alive, start
from llamarl.cluster.local import survivors
from llamarl.pipeline import demo

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def small(tmp_path_factory):
    """``small(name, rewards)``: a spec of one iteration on the demo's models, every stage on one
    process and rules as the only rewards (the reward model too where a term is 'rm'), in a run
    directory of its own; (spec, run dir)."""
    root = tmp_path_factory.mktemp("stop")
    base = yaml.safe_load(open(demo.make_inputs(str(root))))

    def make(name: str, rewards=({"name": "llamarl.pipeline.demo:vowel_ratio", "weight": 1.0},),
             resident: bool = True) -> tuple[str, str]:
        uses_rm = any(r["name"] == "rm" for r in rewards)
        data = {**base, "name": name, "iterations": 1, "reward_model": base["reward_model"] if uses_rm else None,
                "layout": demo.OVERLAP_LAYOUT,
                "executor": {"kind": "local", "options": {"threads_per_process": 1, "resident": resident}},
                "score": {"rewards": list(rewards)}}
        path = root / f"{name}.yaml"
        path.write_text(yaml.safe_dump(data))
        return str(path), str(root / name)

    return make


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", *args], capture_output=True, text=True,
                          timeout=900, env=ENV)


def _running(run: str, node: str, processes: int, driver: subprocess.Popen) -> tuple[list, list[int]]:
    """Once ``node`` runs with at least ``processes`` live processes in its groups, as the run's
    lock records them: (its groups, their pids)."""
    lock = os.path.join(run, "pipeline", "lock.json")
    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        assert driver.poll() is None, driver.communicate()[0]
        try:
            groups = [tuple(g) for g in json.load(open(lock))["stages"][node]["procs"]]
        except (OSError, ValueError, KeyError):
            groups = []
        pids = sorted(p for found in survivors(groups).values() for p in found) if groups else []
        if len(pids) >= processes:
            return groups, pids
        time.sleep(0.02)
    raise AssertionError(f"{node} did not run with {processes} processes")


@pytest.mark.parametrize("sig,resident", [(signal.SIGTERM, False), (signal.SIGHUP, True)],
                         ids=["SIGTERM-process-per-stage", "SIGHUP-resident"])
def test_a_signal_stops_the_run_and_every_process_of_its_stage(small, sig, resident):
    """A process per stage: stopped in the rollout, whose rank starts a tokenizer process before its
    imports. Resident workers: stopped in the ppo (held once its weights are published, so that it
    still runs), its worker with it."""
    spec, run = small(f"stopped-by-{sig.name.lower()}", resident=resident)
    node = "iter-001/ppo" if resident else "iter-001/rollout"
    driver = start(spec, env={**ENV, "LLAMARL_TEST_PPO_AT": "published actor:sleep=600"})
    groups, pids = _running(run, node, 1 if resident else 2, driver)
    driver.send_signal(sig)
    out, _ = driver.communicate(timeout=120)
    assert driver.returncode == 128 + sig, out
    assert out.strip().splitlines()[-1] == (f"error: llamarl run got {sig.name}: stopped {node}, every "
                                            f"process of each; rerun `llamarl run {spec}` to resume")
    assert "Traceback" not in out
    assert not [p for p in pids if alive(p)] and survivors(groups) == {}
    assert not os.path.exists(os.path.join(run, "pipeline", "lock.json"))
    record = json.load(open(os.path.join(run, "pipeline", f"{node.replace('/', '.')}.json")))
    assert record["status"] == "stopped" and f"({sig.name}); rerun to resume" in record["error"]
    status = _cli("status", run)
    assert re.search(rf"│ {node} +│ stopped +│ stopped: llamarl run stopped it at ", status.stdout), status.stdout
    rerun = _cli("run", spec)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    assert f"[{node}] running {node.split('/')[1]}" in rerun.stdout
    assert os.path.exists(os.path.join(run, "export"))


@pytest.mark.parametrize("resident", [False, True], ids=["process-per-stage", "resident"])
def test_a_killed_drivers_stage_dies_with_it_and_the_next_run_stops_what_it_left(small, resident):
    """SIGKILL leaves no driver to stop anything. Its stage's process dies with it (the parent-death
    signal), but what that process started lives on, reparented to init: here a reward rule's
    sandbox process. The next `llamarl run` takes the lock over ("its process is gone") and stops
    it before it starts its own score (a reward model beside the rule: rules alone are scored in the
    rollout's process, and this is about a score process)."""
    rewards = [{"name": "rules_for_tests:sandboxed"}, {"name": "rm", "weight": 0.1}]
    spec, run = small(f"killed-{resident}", rewards=rewards, resident=resident)
    tests = os.path.dirname(__file__)
    env = {**ENV, "PYTHONPATH": os.pathsep.join(filter(None, [tests, os.environ.get("PYTHONPATH")]))}
    driver = start(spec, env={**env, "LLAMARL_TEST_SANDBOX": "1"})
    groups, pids = _running(run, "iter-001/scores", 2, driver)  # the rank and its sandbox
    driver.kill()
    driver.wait(timeout=60)
    rank = groups[0][0]
    deadline = time.monotonic() + 30
    while alive(rank) and time.monotonic() < deadline:
        time.sleep(0.02)
    assert not alive(rank), "the stage's process should die with its driver"
    sandbox = [p for p in pids if p != rank]
    assert sandbox and all(alive(p) for p in sandbox), "its sandbox should outlive it"
    rerun = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "run", spec], capture_output=True, text=True,
                           timeout=900, env=env)
    assert rerun.returncode == 0, rerun.stdout + rerun.stderr
    lines = rerun.stdout.splitlines()
    # With resident workers the score's rank is a worker, in the lock both as the stage's and as one
    # of the run's workers: the first of the two names what it stops.
    stopped = next(i for i, line in enumerate(lines)
                   if re.match(r"stopped (iter-001/scores|resident workers) of the previous run by ", line))
    taken = next(i for i, line in enumerate(lines) if line.startswith("taking over the run lock of "))
    started = next(i for i, line in enumerate(lines) if line.startswith("[iter-001/scores] running score"))
    assert stopped < taken < started, rerun.stdout
    assert lines[stopped].endswith(f"which is gone: its process(es) {', '.join(map(str, sandbox))} still ran")
    assert lines[taken].endswith("its process is gone")
    assert survivors(groups) == {} and not [p for p in pids if alive(p)]
    driver.stdout.close()
