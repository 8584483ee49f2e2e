"""Stages as real multi-host jobs: one rank on each of two hosts (tests/hosts.py), over gloo.

Each run is compared with the same stage and layout on one host (the local executor): the
outputs are bit-identical, so spreading a stage over machines changes where it runs, never what it
computes. The ranks rendezvous as on a cluster: MASTER_ADDR is host 1's hostname, resolved through
the hosts' name tables, and gloo binds each host's own address (loopback in one namespace cannot
reach the other, so a run that passes has talked over the link between them).
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pyarrow.parquet as pq
import pytest
import torch
from hosts import Hosts, two_hosts  # noqa: F401 (a fixture)
from test_ppo import iteration  # noqa: F401 (a fixture: an actor, its rollout and scores)

from llamarl.cluster.executor import stage_command
from llamarl.cluster.kubernetes import KubernetesExecutor, KubernetesOptions
from llamarl.cluster.local import LocalExecutor, LocalOptions
from llamarl.lib.files import checkpoint, publish
from llamarl.lib.model import hf_mapping
from llamarl.lib.model.config import LlamaConfig
from llamarl.lib.errors import EXIT_PEER_LOST, EXIT_USER_ERROR
from llamarl.pipeline import toy
from llamarl.stages.config import PPOConfig, RolloutConfig, Sampling

pytestmark = pytest.mark.slow

STAGE_TIMEOUT_S = 240


def start_on_hosts(hosts: Hosts, stage: str, cfg, **popen) -> list[subprocess.Popen]:
    """The stage with rank r on host r+1: torchrun's environment for one process per node."""
    port = hosts.free_port(hosts[0])
    procs = []
    for rank, host in enumerate(hosts.hosts):
        env = {"RANK": str(rank), "WORLD_SIZE": str(len(hosts)), "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
               "GROUP_RANK": str(rank), "MASTER_ADDR": hosts[0].hostname, "MASTER_PORT": str(port),
               "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
        procs.append(hosts.start(host, stage_command(stage, cfg), env, **popen))
    return procs


def run_on_hosts(hosts: Hosts, stage: str, cfg) -> None:
    procs = start_on_hosts(hosts, stage, cfg)
    codes = [p.wait(STAGE_TIMEOUT_S) for p in procs]
    assert codes == [0] * len(procs), f"{stage} on {len(procs)} hosts: exit statuses {codes}"


def run_on_one_host(stage: str, cfg, nprocs: int) -> None:
    result = LocalExecutor(LocalOptions()).run(stage, cfg, nprocs)
    assert result.ok, result.error


def _ppo(root, out, **kw) -> PPOConfig:
    return PPOConfig(rollout=str(root / "rollout"), scores=str(root / "scores"), actor=str(root / "actor"),
                     out=str(out), tp=2, mini_batch_size=4, micro_batch_tokens=40, ppo_epochs=2, actor_lr=1e-3,
                     critic_lr=1e-3, kl_coef=0.1, entropy_coef=0.01, seed=1, **kw)


def _rollout(root, out) -> RolloutConfig:
    return RolloutConfig(actor=str(root / "actor"), prompts=str(root / "prompts.jsonl"), out=str(out), id_column="id",
                         chunk_size=2, dp=2, sampling=Sampling(samples_per_prompt=2, max_new_tokens=8, seed=11))


def _weights(ckpt: str) -> dict[str, torch.Tensor]:
    manifest = publish.require_published(ckpt, "checkpoint")
    cfg = LlamaConfig.from_dict(manifest["model_config"])
    state = {n: torch.empty(s) for n, s in hf_mapping.hf_shapes(cfg, manifest["head"]).items()}
    checkpoint.load(state, f"{ckpt}/model")
    return state


def _assert_bit_identical(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    differ = [k for k in a if not torch.equal(a[k], b[k])]
    assert not differ, f"differ: {differ}"


def _steps(out) -> list[dict]:
    return [json.loads(x) for x in open(out / "metrics.jsonl")]


def test_hosts_have_their_own_names_and_addresses(two_hosts):
    h1, h2 = two_hosts.hosts
    assert two_hosts.run(h1, ["hostname"]).strip() == h1.hostname
    assert two_hosts.run(h2, ["hostname"]).strip() == h2.hostname
    assert two_hosts.run(h1, ["getent", "hosts", h2.hostname]).split()[0] == h2.ip
    assert f"inet {h2.ip}/" in two_hosts.run(h2, ["ip", "-4", "addr"])
    assert f"inet {h1.ip}/" not in two_hosts.run(h2, ["ip", "-4", "addr"])


def test_ppo_tp2_across_two_hosts_equals_one_host(two_hosts, iteration, tmp_path):
    run_on_one_host("ppo", _ppo(iteration, tmp_path / "one"), 2)
    run_on_hosts(two_hosts, "ppo", _ppo(iteration, tmp_path / "two"))
    for part in ("actor", "critic"):
        _assert_bit_identical(_weights(str(tmp_path / "two" / part)), _weights(str(tmp_path / "one" / part)))
    assert _steps(tmp_path / "two") == _steps(tmp_path / "one")


def test_rollout_dp2_across_two_hosts_equals_one_host(two_hosts, iteration, tmp_path):
    run_on_one_host("rollout", _rollout(iteration, tmp_path / "one"), 2)
    run_on_hosts(two_hosts, "rollout", _rollout(iteration, tmp_path / "two"))
    one, two = (publish.require_published(str(tmp_path / d), "rollout") for d in ("one", "two"))
    parts = sorted(f for f in one["files"] if f.startswith("parts/"))
    assert len(parts) == 3  # 6 prompts in chunks of 2: both ranks wrote parts
    assert sorted(f for f in two["files"] if f.startswith("parts/")) == parts
    for part in parts:
        assert pq.read_table(tmp_path / "two" / part).equals(pq.read_table(tmp_path / "one" / part), check_metadata=True), part


def start_pods(hosts: Hosts, cfg, tmp_path, pods: tuple[int, ...] = (0, 1), **popen) -> list[subprocess.Popen]:
    """What the rendered Indexed Job gives each pod — its command, its environment, its
    JOB_COMPLETION_INDEX, the headless service's pod names — started as is, pod i on host i+1."""
    port = hosts.free_port(hosts[0])
    ex = KubernetesExecutor(KubernetesOptions(image="llamarl", pvc="runs", master_port=port,
                                              manifests_dir=str(tmp_path / "k8s")))
    _, job = ex.manifests("ppo", cfg, 2, 2, name="iter-001/ppo")
    pod = job["spec"]["template"]["spec"]
    container = pod["containers"][0]
    name = job["metadata"]["name"]
    # The cluster's DNS gives pod i of an Indexed Job under a headless service this name.
    hosts.add_names({f"{name}-{i}.{pod['subdomain']}": host for i, host in enumerate(hosts.hosts)})
    env = {e["name"]: e["value"] for e in container["env"]}
    env["PATH"] = f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}"  # the image's torchrun and python
    procs = []
    for i, host in enumerate(hosts.hosts):
        if i not in pods:
            continue
        tmp = tmp_path / f"pod-{i}"  # each pod's own /tmp
        tmp.mkdir()
        procs.append(hosts.start(host, container["command"], {**env, "JOB_COMPLETION_INDEX": str(i),
                                                              "OMP_NUM_THREADS": "1", "TMPDIR": str(tmp)}, **popen))
    return procs


def test_kubernetes_pods_command_runs_ppo_across_two_hosts(two_hosts, iteration, tmp_path):
    """The pods' command run as is on two hosts equals one host."""
    procs = start_pods(two_hosts, _ppo(iteration, tmp_path / "two"), tmp_path)
    codes = [p.wait(STAGE_TIMEOUT_S) for p in procs]
    assert codes == [0, 0], f"pods' exit statuses {codes}"
    run_on_one_host("ppo", _ppo(iteration, tmp_path / "one"), 2)
    for part in ("actor", "critic"):
        _assert_bit_identical(_weights(str(tmp_path / "two" / part)), _weights(str(tmp_path / "one" / part)))


def test_kubernetes_pods_exit_with_the_stages_user_error_status(two_hosts, iteration, tmp_path):
    """torchrun exits 1 whatever its workers did; the pods must exit 2, which the Job's
    podFailurePolicy fails at once (a user error is reported, never retried)."""
    cfg = _ppo(iteration, tmp_path / "out").model_copy(update={"rollout": str(tmp_path / "no-such-rollout")})
    procs = start_pods(two_hosts, cfg, tmp_path, stderr=subprocess.PIPE, text=True)
    results = [p.communicate(timeout=STAGE_TIMEOUT_S) for p in procs]
    codes = [p.returncode for p in procs]
    assert codes == [EXIT_USER_ERROR, EXIT_USER_ERROR], (codes, results[0][1][-2000:])
    assert "no-such-rollout" in _error_line(results[0][1])  # rank 0 reports it, once
    assert publish.read_manifest(str(tmp_path / "out")) is None


def test_kubernetes_pod_lost_mid_stage_then_all_pods_replaced_resume(two_hosts, iteration, tmp_path):
    """What the executor does when a pod dies: its peer's torchrun ends (the pod exits with the
    stage's own status 3, a lost peer: not the user-error status the Job's failure policy fails at
    once), the Job fails, and all its pods are replaced together; the new pods resume from the last
    saved step and end where one host does."""
    out = tmp_path / "two"
    cfg = _ppo(iteration, out, save_every=1)
    procs = start_pods(two_hosts, cfg, tmp_path, stderr=subprocess.PIPE, text=True)
    first_step = out / ".state" / "step-000001" / "done.json"
    deadline = time.monotonic() + STAGE_TIMEOUT_S
    while not first_step.exists() and time.monotonic() < deadline and procs[0].poll() is None:
        time.sleep(0.02)
    assert first_step.exists(), "the run never reached its first optimizer step"
    Hosts.kill_all(two_hosts[1])  # the pod and all it ran
    try:
        _, err = procs[0].communicate(timeout=90)
    except subprocess.TimeoutExpired:
        pytest.fail("pod 1 still runs 90 s after pod 2 was lost")
    assert procs[0].returncode == EXIT_PEER_LOST, err[-2000:]
    assert publish.read_manifest(str(out)) is None
    procs[1].wait()

    import shutil

    for i in range(2):  # the replaced pods' own /tmp is new
        shutil.rmtree(tmp_path / f"pod-{i}")
    again = start_pods(two_hosts, cfg, tmp_path, stdout=subprocess.PIPE, text=True)
    outs = [p.communicate(timeout=STAGE_TIMEOUT_S)[0] for p in again]
    assert [p.returncode for p in again] == [0, 0], outs
    assert f"{out}: resuming after optimizer step" in "".join(outs)
    run_on_one_host("ppo", _ppo(iteration, tmp_path / "one", save_every=1), 2)
    for part in ("actor", "critic"):
        _assert_bit_identical(_weights(str(out / part)), _weights(str(tmp_path / "one" / part)))


def test_kubernetes_pod_whose_peer_never_starts_gives_up_after_the_rendezvous_timeout(two_hosts, iteration, tmp_path):
    """Pod 2 never scheduled: pod 1's torchrun waits for it at most the rendezvous timeout (the
    stage's collective_timeout_s, passed as --rdzv-conf), then fails — not with the user-error
    status, so the executor replaces the pods (and fails the stage after its restarts)."""
    timeout_s = 5
    started = time.monotonic()
    [proc] = start_pods(two_hosts, _ppo(iteration, tmp_path / "run", collective_timeout_s=timeout_s), tmp_path,
                        pods=(0,), stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=timeout_s + 90)
    except subprocess.TimeoutExpired:
        pytest.fail(f"pod 1 still waits {timeout_s + 90} s after its rendezvous timeout of {timeout_s} s")
    print(f"pod 1 gave up after {time.monotonic() - started:.1f} s with status {proc.returncode}")
    assert proc.returncode not in (0, EXIT_USER_ERROR), err[-2000:]
    assert publish.read_manifest(str(tmp_path / "run")) is None


def test_host_lost_mid_ppo_ends_host_1_and_publishes_nothing(two_hosts, iteration, tmp_path):
    out = tmp_path / "run"
    procs = start_on_hosts(two_hosts, "ppo", _ppo(iteration, out, save_every=1), stderr=subprocess.PIPE, text=True)
    first_step = out / ".state" / "step-000001" / "done.json"
    deadline = time.monotonic() + STAGE_TIMEOUT_S
    while not first_step.exists() and time.monotonic() < deadline and procs[0].poll() is None:
        time.sleep(0.02)
    assert first_step.exists(), "the run never reached its first optimizer step"
    Hosts.kill(procs[1])
    # Host 2's kernel closes its sockets, so host 1's next collective fails at once; a host that
    # vanishes without a word (power, network) would hold it until the collective timeout.
    started = time.monotonic()
    try:
        _, err = procs[0].communicate(timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail("host 1 still runs 60 s after host 2 was lost")
    print(f"host 1 exited {time.monotonic() - started:.1f} s after host 2 was killed: {_error_line(err)}")
    assert procs[0].returncode == EXIT_PEER_LOST, err[-2000:]
    assert f"lost rank 1 on {two_hosts[1].hostname} ({two_hosts[1].ip})" in _error_line(err)
    assert publish.read_manifest(str(out)) is None
    assert publish.read_manifest(str(out / "actor")) is None


def test_host_frozen_mid_ppo_ends_host_1_within_the_timeout_and_a_rerun_finishes(two_hosts, iteration, tmp_path):
    """A host that vanishes without a word (frozen: its sockets stay open) holds host 1 only until
    the collective timeout; the rerun resumes from the last saved step and ends where one host does."""
    timeout_s = 8
    out = tmp_path / "run"
    cfg = _ppo(iteration, out, save_every=1, collective_timeout_s=timeout_s)
    procs = start_on_hosts(two_hosts, "ppo", cfg, stderr=subprocess.PIPE, text=True)
    first_step = out / ".state" / "step-000001" / "done.json"
    deadline = time.monotonic() + STAGE_TIMEOUT_S
    while not first_step.exists() and time.monotonic() < deadline and procs[0].poll() is None:
        time.sleep(0.02)
    assert first_step.exists(), "the run never reached its first optimizer step"
    Hosts.kill(procs[1], signal.SIGSTOP)
    started = time.monotonic()
    try:
        _, err = procs[0].communicate(timeout=timeout_s + 30)
    except subprocess.TimeoutExpired:
        pytest.fail(f"host 1 still runs {timeout_s + 30} s after host 2 froze (collective_timeout_s={timeout_s})")
    waited = time.monotonic() - started
    print(f"host 1 exited {waited:.1f} s after host 2 froze: {_error_line(err)}")
    assert procs[0].returncode == EXIT_PEER_LOST, err[-2000:]
    assert f"lost rank 1 on {two_hosts[1].hostname}" in _error_line(err)
    assert publish.read_manifest(str(out)) is None
    Hosts.kill(procs[1])
    procs[1].wait()

    rerun = start_on_hosts(two_hosts, "ppo", cfg, stdout=subprocess.PIPE, text=True)
    outs = [p.communicate(timeout=STAGE_TIMEOUT_S)[0] for p in rerun]
    assert [p.returncode for p in rerun] == [0, 0], outs
    assert f"{out}: resuming after optimizer step" in outs[0]  # resumed, not started again
    run_on_one_host("ppo", _ppo(iteration, tmp_path / "one", save_every=1), 2)
    for part in ("actor", "critic"):
        _assert_bit_identical(_weights(str(out / part)), _weights(str(tmp_path / "one" / part)))


def test_a_host_that_never_starts_ends_the_rendezvous_after_its_timeout(two_hosts, iteration, tmp_path):
    timeout_s = 5
    cfg = _ppo(iteration, tmp_path / "run", collective_timeout_s=timeout_s)
    port = two_hosts.free_port(two_hosts[0])
    env = {"RANK": "0", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1", "GROUP_RANK": "0",
           "MASTER_ADDR": two_hosts[0].hostname, "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1"}
    started = time.monotonic()
    proc = two_hosts.start(two_hosts[0], stage_command("ppo", cfg), env, stderr=subprocess.PIPE, text=True)
    try:
        _, err = proc.communicate(timeout=timeout_s + 60)  # + the stage's imports and input checks
    except subprocess.TimeoutExpired:
        pytest.fail("host 1 still waits for host 2 a minute past the rendezvous timeout")
    print(f"host 1 gave up after {time.monotonic() - started:.1f} s: {_error_line(err)}")
    assert proc.returncode == EXIT_PEER_LOST, err[-2000:]
    line = _error_line(err)
    assert "did not all join the rendezvous" in line and f"{two_hosts[0].hostname}:{port}" in line, line
    assert publish.read_manifest(str(tmp_path / "run")) is None


def _error_line(stderr: str) -> str:
    lines = [x for x in stderr.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1, stderr[-3000:]
    return lines[0]


@pytest.fixture
def slurm_on_two_hosts(two_hosts, tmp_path):
    import slurm_cluster

    cluster = slurm_cluster.TwoHostCluster(str(tmp_path / "slurm"), two_hosts).start()
    yield cluster
    cluster.stop()


_SUBMIT = """
import json, sys
from llamarl.cluster.kinds import make_executor
from llamarl.stages.config import RolloutConfig
cfg = RolloutConfig.model_validate_json(sys.argv[1])
result = make_executor("slurm", {"timeout_min": 10}, sys.argv[2], "test").run("rollout", cfg, 2, nodes=2)
print(json.dumps([result.code, result.error]))
"""


def test_slurm_job_spans_two_hosts_rendezvous_works_and_a_requeue_resumes(slurm_on_two_hosts, iteration, tmp_path):
    """Submitted through submitit from host 1: one task on each host (SLURM_NNODES=2), rank 0's
    address found by name; `scontrol requeue` mid-stage starts both tasks again, and they resume."""
    cluster = slurm_on_two_hosts
    # 48 chunks: after the second part, the stage runs on for longer than squeue and scontrol take
    # on a loaded machine (with 24 the stage can finish between the look and the suspend).
    prompts = toy.make_prompts(str(tmp_path / "prompts.jsonl"), n=48)
    cfg = RolloutConfig(actor=str(iteration / "actor"), prompts=prompts, out=str(tmp_path / "two"), id_column="id",
                        chunk_size=1, dp=2, sampling=Sampling(samples_per_prompt=2, max_new_tokens=24, seed=3))
    submit = subprocess.Popen(["ip", "netns", "exec", cluster.hosts[0].netns, sys.executable, "-c", _SUBMIT,
                               cfg.model_dump_json(), str(tmp_path / "run")], env=cluster.env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    parts_dir = tmp_path / "two" / "parts"
    deadline, job_id = time.monotonic() + STAGE_TIMEOUT_S, None
    while time.monotonic() < deadline and submit.poll() is None and job_id is None:
        queue = cluster.run(["squeue", "-h", "-o", "%i %T"]).stdout.split()
        if "RUNNING" in queue and len(list(parts_dir.glob("part-*.parquet"))) >= 2:
            job_id = queue[0]
            cluster.suspend(job_id)
            published_before = {p.name: p.stat().st_mtime_ns for p in parts_dir.glob("part-*.parquet")}
            assert not publish.read_manifest(str(tmp_path / "two")), "the stage finished before it was suspended"
            cluster.requeue_suspended(job_id)
        time.sleep(0.05)
    assert job_id is not None, "never caught the job running with parts published" + cluster.logs()
    out, err = submit.communicate(timeout=STAGE_TIMEOUT_S)
    assert json.loads(out.strip().splitlines()[-1]) == [0, None], out + err + cluster.logs()

    logs = tmp_path / "run" / "pipeline" / "slurm" / job_id
    task1 = (logs / f"{job_id}_1_log.out").read_text()
    assert f"hostname={cluster.hosts[1].hostname}" in task1 and "node=1(2)" in task1, task1[-2000:]
    manifest = publish.require_published(str(tmp_path / "two"), "rollout")
    assert manifest["stats"]["skipped_chunks"] >= 2  # the requeued job resumed
    for name, mtime in published_before.items():
        assert (parts_dir / name).stat().st_mtime_ns == mtime, name

    run_on_one_host("rollout", cfg.model_copy(update={"out": str(tmp_path / "one")}), 2)
    for part in sorted(p.name for p in parts_dir.glob("part-*.parquet")):
        assert pq.read_table(parts_dir / part).equals(pq.read_table(tmp_path / "one" / "parts" / part)), part


def test_the_local_executor_reports_a_frozen_rank_in_one_line(iteration, tmp_path):
    """What `llamarl status` shows of such a stage: the executor's result error, the lost rank's line."""
    out = tmp_path / "run"
    ex = LocalExecutor(LocalOptions(grace_s=1))
    run = ex.submit("ppo", _ppo(iteration, out, save_every=1, collective_timeout_s=5), 2)
    first_step = out / ".state" / "step-000001" / "done.json"
    deadline = time.monotonic() + STAGE_TIMEOUT_S
    while not first_step.exists() and time.monotonic() < deadline:
        time.sleep(0.02)
    run.procs[1].send_signal(signal.SIGSTOP)
    result = ex.wait(run)
    assert result.code == EXIT_PEER_LOST, result
    assert result.error.startswith("rank 0 on ") and " lost rank 1 on " in result.error, result.error
    assert publish.read_manifest(str(out)) is None
