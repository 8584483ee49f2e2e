"""The pipeline on a real (one-node) Slurm cluster through submitit, with a requeued stage.

Needs Debian's slurm-wlm and munge and root (``.ci/run`` installs them). If the cluster cannot
start, these tests fail — they never skip.
"""

from __future__ import annotations

import glob
import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest
import yaml

import slurm_cluster
from llamarl.cluster.kinds import make_executor
from llamarl.cluster.slurm import agree_on_port
from llamarl.lib.files import publish
from llamarl.lib.errors import EXIT_USER_ERROR
from llamarl.pipeline import demo
from llamarl.pipeline.dag import load_spec
from llamarl.stages.config import ShardConfig

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = slurm_cluster.Cluster(str(tmp_path_factory.mktemp("slurm"))).start()
    yield c
    c.stop()


@pytest.fixture(autouse=True)
def _queue_emptied(request):
    """The module's tests share one cluster: whatever a test leaves queued is cancelled after it."""
    yield
    if "cluster" in request.fixturenames:
        request.getfixturevalue("cluster").cancel_all()


def test_tasks_agree_on_a_master_port_free_on_the_master(tmp_path):
    # The port submitit would take (seeded by the job id) busy on the master node: the tasks
    # must agree on another, free one.
    with socket.create_server(("", 0)) as busy:
        taken = busy.getsockname()[1]
        ports: dict[int, int] = {}
        others = [threading.Thread(target=lambda r=r: ports.__setitem__(r, agree_on_port(str(tmp_path), r, "0")))
                  for r in (1, 2, 3)]
        for t in others:
            t.start()
        time.sleep(0.3)  # the others start first and wait for rank 0
        ports[0] = agree_on_port(str(tmp_path), 0, "0")
        for t in others:
            t.join(timeout=10)
    assert len(set(ports.values())) == 1 and len(ports) == 4 and ports[0] != taken
    with socket.create_server(("", ports[0])):  # free indeed
        pass


def test_a_requeued_job_never_reads_its_previous_attempts_port(tmp_path):
    (tmp_path / "master_port.0").write_text("43107")
    with pytest.raises(RuntimeError, match="rank 0 published no master port within 0 s"):
        agree_on_port(str(tmp_path), 1, "1", timeout_s=0.2)
    port = agree_on_port(str(tmp_path), 0, "1")
    assert agree_on_port(str(tmp_path), 1, "1") == port
    assert agree_on_port(str(tmp_path), 2, "0") == 43107


def test_a_user_error_comes_back_as_the_result(cluster, tmp_path):
    ex = make_executor("slurm", {"timeout_min": 5}, str(tmp_path), "test")
    cfg = ShardConfig(src=str(tmp_path / "no-such-model"), dst=str(tmp_path / "out"), tp=2)
    env = os.environ.copy()
    os.environ["SLURM_CONF"] = cluster.conf
    try:
        result = ex.run("shard", cfg, nprocs=2)
    finally:
        os.environ.clear()
        os.environ.update(env)
    assert result.code == EXIT_USER_ERROR, result
    assert result.error.endswith(f": {tmp_path}/no-such-model/config.json not found; point SRC at an HF checkpoint directory")
    assert result.error.startswith("slurm job ")


def _spec(tmp_path) -> str:
    path = demo.make_inputs(str(tmp_path))
    data = yaml.safe_load(open(path))
    data.update(name="slurm", iterations=1,
                executor={"kind": "slurm", "options": {"timeout_min": 20, "cpus_per_task": 1}})
    # Validation's jobs through Slurm are the detached test's; here they would only lengthen the
    # chain after ppo (≈ 20 s on 2 cores).
    del data["validation"]
    # Enough rollout work (32 one-prompt chunks) for the requeue to land while it runs.
    data["rollout"].update(chunk_size=1, max_batch=8)
    data["rollout"]["sampling"].update(samples_per_prompt=2, max_new_tokens=48)
    out = tmp_path / "slurm.yaml"
    out.write_text(yaml.safe_dump(data))
    return str(out)


def _squeue(cluster, name):
    out = subprocess.run(["squeue", "-h", "-o", "%i %j %T"], env=cluster.env, capture_output=True, text=True).stdout
    return [line.split() for line in out.splitlines() if line.split()[1:2] == [name]]


def test_pipeline_through_submitit_with_a_requeued_stage(cluster, tmp_path):
    spec = _spec(tmp_path)
    run_dir = load_spec(spec).run_dir
    env = {**cluster.env, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.Popen([sys.executable, "-m", "llamarl.pipeline.cli", "run", spec], env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    parts_dir = os.path.join(run_dir, "iter-001", "rollout", "parts")
    deadline, job_id, requeued_after = time.monotonic() + 600, None, None
    while time.monotonic() < deadline and proc.poll() is None:
        running = [j for j in _squeue(cluster, "llamarl-iter-001-rollout") if j[2] == "RUNNING"]
        parts = glob.glob(os.path.join(parts_dir, "part-*.parquet"))
        if running and len(parts) >= 2:
            job_id = running[0][0]
            cluster.suspend(job_id)
            requeued_after = {os.path.basename(p): os.stat(p).st_mtime_ns
                              for p in glob.glob(os.path.join(parts_dir, "part-*.parquet"))}
            assert not publish.read_manifest(os.path.dirname(parts_dir)), "rollout finished before it was suspended"
            cluster.requeue_suspended(job_id)
            break
        time.sleep(0.05)
    if job_id is None:
        out = proc.communicate(timeout=60)[0] if proc.poll() is not None else "(still running)"
        pytest.fail("never caught the rollout job running with parts published:\n" + out[-3000:] + cluster.logs())
    out, _ = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-3000:] + cluster.logs()

    rollout = publish.require_published(os.path.join(run_dir, "iter-001", "rollout"), "rollout")
    assert rollout["rows"] == 64
    # The requeued job started again and resumed: it skipped the parts published before.
    log = open(glob.glob(os.path.join(run_dir, "pipeline", "slurm", job_id, f"{job_id}_0_log.out"))[0]).read()
    assert rollout["stats"]["skipped_chunks"] >= 2, log[-2000:]
    for name, mtime in requeued_after.items():
        assert os.stat(os.path.join(parts_dir, name)).st_mtime_ns == mtime, name
    record = json.load(open(os.path.join(run_dir, "pipeline", "iter-001.rollout.json")))
    assert record["status"] == "done"
    assert publish.require_published(os.path.join(run_dir, "export"), "hf_export")
    assert os.path.isdir(os.path.join(run_dir, "pipeline", "slurm", job_id))


def _wait_until_queue_empty(cluster, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        out = subprocess.run(["squeue", "-h", "-o", "%i"], env=cluster.env, capture_output=True, text=True).stdout
        if not out.strip():
            return
        time.sleep(1)
    pytest.fail(f"jobs still queued after {timeout_s:.0f} s:\n{out}" + cluster.logs())


def _status(env, run_dir) -> dict[str, tuple[str, str]]:
    proc = subprocess.run([sys.executable, "-c", "from llamarl.pipeline.status import status; import json, sys; "
                           "print(json.dumps(status(sys.argv[1])))", run_dir], env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    return {name: (state, why) for name, state, why in json.loads(proc.stdout)}


def test_detached_run_chains_the_dag_cancels_after_a_failure_and_a_rerun_submits_the_rest(cluster, tmp_path):
    path = demo.make_inputs(str(tmp_path))
    data = yaml.safe_load(open(path))
    data.update(name="detached", iterations=1, executor={"kind": "slurm", "options": {"timeout_min": 20}})
    data["score"]["rewards"] = [{"name": "rules_for_tests:raises"}]
    spec = tmp_path / "detached.yaml"
    spec.write_text(yaml.safe_dump(data))
    run_dir = load_spec(str(spec)).run_dir
    # The jobs import the reward rule from tests/, as a user's own module on their PYTHONPATH.
    env = {**cluster.env, "PYTHONPATH": os.pathsep.join([os.path.dirname(__file__), os.environ.get("PYTHONPATH", "")])}

    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "run", str(spec), "--detach"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert time.monotonic() - started < 60, "--detach waited for the jobs"
    # 2 shards, rollout, scores, ppo, its validation's rollout and scores, export
    assert proc.stdout.count("submitted as job") == 8, proc.stdout
    rerun = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "run", str(spec)], env=env,
                           capture_output=True, text=True, timeout=120)
    assert rerun.returncode == 2 and "still queued or running" in rerun.stderr, rerun.stdout + rerun.stderr  # no second copy
    # The login side is gone: only Slurm moves the run on.
    _wait_until_queue_empty(cluster, 600)
    st = _status(env, run_dir)
    # Rules only: the rollout scores its rows itself, and its job fails with the rule.
    assert st["shard/actor"][0] == st["shard/rm"][0] == "done", st
    assert st["iter-001/rollout"][0] == "failed" and "ValueError" in st["iter-001/rollout"][1], st
    assert st["iter-001/scores"] == st["iter-001/ppo"] == ("cancelled", "iter-001/rollout failed"), st
    assert st["export"] == ("cancelled", "iter-001/ppo cancelled"), st
    assert st["iter-001/val-scores"] == ("cancelled", "iter-001/val-rollout cancelled"), st

    data["score"]["rewards"] = [{"name": "llamarl.pipeline.demo:vowel_ratio"}]
    spec.write_text(yaml.safe_dump(data))
    proc = subprocess.run([sys.executable, "-m", "llamarl.pipeline.cli", "run", str(spec), "--detach"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert proc.stdout.count("submitted as job") == 6 and proc.stdout.count("done, skipped") == 2, proc.stdout
    _wait_until_queue_empty(cluster, 600)
    st = _status(env, run_dir)
    assert {state for state, _ in st.values()} == {"done"}, st
    assert publish.require_published(os.path.join(run_dir, "export"), "hf_export")
    # The recorders of ppo and of the validation's scores updated the run's metrics.
    assert "val_score" in json.loads(open(os.path.join(run_dir, "metrics.jsonl")).readline())
