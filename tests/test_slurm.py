"""The pipeline on a real (one-node) Slurm cluster through submitit, with a requeued stage.

Needs Debian's slurm-wlm and munge and root (``.ci/run`` installs them). If the cluster cannot
start, these tests fail — they never skip.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys
import time

import pytest
import yaml

import slurm_cluster
from llamarl.lib import publish
from llamarl.pipeline import demo
from llamarl.pipeline.spec import load_spec

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    c = slurm_cluster.Cluster(str(tmp_path_factory.mktemp("slurm"))).start()
    yield c
    c.stop()


def _spec(tmp_path) -> str:
    path = demo.make_inputs(str(tmp_path))
    data = yaml.safe_load(open(path))
    data.update(name="slurm", iterations=1,
                executor={"kind": "slurm", "options": {"timeout_min": 20, "cpus_per_task": 1}})
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
        running = [j for j in _squeue(cluster, "llamarl-rollout") if j[2] == "RUNNING"]
        parts = glob.glob(os.path.join(parts_dir, "part-*.parquet"))
        if running and len(parts) >= 2:
            job_id = running[0][0]
            requeued_after = {os.path.basename(p): os.stat(p).st_mtime_ns for p in parts}
            res = subprocess.run(["scontrol", "requeue", job_id], env=cluster.env, capture_output=True, text=True)
            assert res.returncode == 0, res.stderr
            break
        time.sleep(0.2)
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
