"""Kubernetes executor: manifests valid offline, rendezvous and rank wiring, apply against a fake API."""

from __future__ import annotations

import json
import shlex
import types

import kubernetes_validate
import pytest
import yaml

from llamarl.cluster.kubernetes import NOT_APPLIED, KubernetesExecutor, KubernetesOptions
from llamarl.lib.errors import EXIT_USER_ERROR, UserError
from llamarl.pipeline import demo
from llamarl.pipeline.run import run_spec
from llamarl.pipeline.dag import load_spec
from llamarl.stages.config import PPOConfig

K8S_VERSION = "1.32"  # the kubectl client on these machines


def _executor(apis=(None, None), **options):
    options = KubernetesOptions(image="registry.example/llamarl:1", pvc="runs", mount_path="/shared", gpus_per_node=8,
                                cpu=32, memory="256Gi", **{"manifests_dir": "/unused", **options})
    return KubernetesExecutor(options, batch_api=apis[0], core_api=apis[1])


def _config():
    return PPOConfig(rollout="/shared/r/iter-001/rollout", scores="/shared/r/iter-001/scores",
                     actor="/shared/r/shard/actor", out="/shared/r/iter-001/ppo", tp=8, pp=2, dp=1)


def test_manifests_validate_against_the_kubernetes_schemas():
    for obj in _executor().manifests("ppo", _config(), nprocs=16, nodes=2, name="iter-001/ppo"):
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_rendezvous_and_rank_wiring():
    service, job = _executor().manifests("ppo", _config(), nprocs=16, nodes=2, name="iter-001/ppo")
    spec = job["spec"]
    assert spec["completionMode"] == "Indexed" and spec["completions"] == spec["parallelism"] == 2
    pod = spec["template"]["spec"]
    name = job["metadata"]["name"]
    assert name == "llamarl-iter-001-ppo"
    # headless service selecting exactly this job's pods, named in their subdomain
    assert service["spec"]["clusterIP"] == "None" and service["spec"]["selector"] == {"job-name": name}
    assert pod["subdomain"] == service["metadata"]["name"]
    command = pod["containers"][0]["command"]
    assert command[:2] == ["bash", "-c"]
    torchrun = command[2][command[2].index("torchrun "):command[2].index("; rc=$?")]
    argv = shlex.split(torchrun)
    args = dict(a.split("=", 1) for a in argv if a.startswith("--") and "=" in a)
    assert args["--nnodes"] == "2" and args["--nproc_per_node"] == "8"
    assert args["--node_rank"] == "${JOB_COMPLETION_INDEX}"  # expanded by bash in each pod
    assert args["--master_addr"] == f"{name}-0.{service['metadata']['name']}"
    assert argv[argv.index("-m") + 1] == "llamarl.stages.ppo"
    assert json.loads(argv[argv.index("--config-json") + 1]) == _config().to_json()
    assert pod["containers"][0]["resources"] == {"limits": {"nvidia.com/gpu": 8}, "requests": {"cpu": "32", "memory": "256Gi"}}
    assert {"name": "NCCL_NVLS_ENABLE", "value": "0"} in pod["containers"][0]["env"]
    assert pod["volumes"][0]["persistentVolumeClaim"]["claimName"] == "runs"
    rules = spec["podFailurePolicy"]["rules"]
    assert rules == [{"action": "FailJob", "onExitCodes": {"containerName": "stage", "operator": "In", "values": [2]}}]
    assert spec["backoffLimit"] == 0 and "backoffLimitPerIndex" not in spec  # pods restart together (see wait)


def test_pods_have_shared_memory_and_run_as_non_root():
    _, job = _executor(shm_size="64Gi", run_as_user=4242).manifests("ppo", _config(), nprocs=16, nodes=2)
    pod = job["spec"]["template"]["spec"]
    mounts = {m["name"]: m["mountPath"] for m in pod["containers"][0]["volumeMounts"]}
    volumes = {v["name"]: v for v in pod["volumes"]}
    assert mounts["shm"] == "/dev/shm" and volumes["shm"]["emptyDir"] == {"medium": "Memory", "sizeLimit": "64Gi"}
    assert pod["securityContext"]["runAsNonRoot"] and pod["securityContext"]["runAsUser"] == 4242
    assert pod["securityContext"]["fsGroup"] == 4242  # the storage is writable by that user
    assert pod["containers"][0]["securityContext"] == {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


@pytest.mark.parametrize("stage,gpus", [("ppo", 8), ("rollout", 8), ("score", 8), ("shard", None), ("export", None)])
def test_gpus_follow_the_layout_unless_set(stage, gpus):
    options = KubernetesOptions(image="i", pvc="runs", manifests_dir="/unused")
    _, job = KubernetesExecutor(options).manifests(stage, _config(), nprocs=16, nodes=2)
    limits = job["spec"]["template"]["spec"]["containers"][0]["resources"].get("limits", {})
    assert limits.get("nvidia.com/gpu") == gpus  # one GPU per process where the stage computes on GPUs
    _, job = KubernetesExecutor(options.model_copy(update={"gpus_per_node": 0})).manifests(stage, _config(), 16, 2)
    assert "limits" not in job["spec"]["template"]["spec"]["containers"][0]["resources"]


def test_uneven_spread_is_a_clear_error():
    with pytest.raises(UserError, match="16 processes do not spread evenly over 3 nodes"):
        _executor().manifests("ppo", _config(), nprocs=16, nodes=3)


class _FakeBatch:
    """A Job that ends with ``outcomes[i]`` on its i-th creation (after two reads as running)."""

    def __init__(self, outcome, reason, *more):
        self.created, self.deleted, self.reads = [], [], 0
        self.outcomes = [(outcome, reason), *more]
        self.gone = False

    def create_namespaced_job(self, namespace, body):
        self.created.append((namespace, body))
        self.reads, self.gone = 0, False

    def delete_namespaced_job(self, name, namespace, propagation_policy):
        self.deleted.append((name, propagation_policy))
        self.gone = True

    def read_namespaced_job_status(self, name, namespace):
        if self.gone:
            raise _NotFound()
        self.reads += 1
        outcome, reason = self.outcomes[min(len(self.created), len(self.outcomes)) - 1]
        conditions = []
        if self.reads >= 3:
            conditions = [types.SimpleNamespace(type=outcome, status="True", reason=reason, message="M")]
        return types.SimpleNamespace(status=types.SimpleNamespace(conditions=conditions))


class _NotFound(Exception):
    status = 404


class _FakeCore:
    def __init__(self):
        self.created = []

    def create_namespaced_service(self, namespace, body):
        self.created.append((namespace, body))


def test_render_is_the_manifests_yaml():
    text = _executor().render("ppo", _config(), nprocs=16, nodes=2, name="iter-001/ppo")
    assert list(yaml.safe_load_all(text)) == _executor().manifests("ppo", _config(), 16, 2, name="iter-001/ppo")


@pytest.mark.parametrize("outcome,reason,code", [("Complete", None, 0), ("Failed", "BackoffLimitExceeded", 1),
                                                 ("Failed", "PodFailurePolicy", EXIT_USER_ERROR)])
def test_apply_creates_service_and_job_and_follows_it(outcome, reason, code):
    batch, core = _FakeBatch(outcome, reason), _FakeCore()
    ex = _executor(apis=(batch, core), apply=True, namespace="rl", poll_s=0.001, restarts=0)
    assert ex.launches
    result = ex.run("ppo", _config(), 16, nodes=2, name="iter-001/ppo")
    assert core.created[0][0] == "rl" and core.created[0][1]["kind"] == "Service"
    assert batch.created[0][1]["kind"] == "Job" and batch.reads == 3
    assert batch.created[0][1]["metadata"]["name"].startswith("llamarl-iter-001-ppo-")  # unique per submission
    assert result.code == code
    if code:
        assert result.error == f"job {batch.created[0][1]['metadata']['name']} failed: {reason}: M"


def test_without_apply_submit_writes_the_manifests_and_nothing_runs(tmp_path):
    ex = _executor(manifests_dir=str(tmp_path))
    assert not ex.launches
    first = ex.submit("ppo", _config(), 16, nodes=2, name="iter-001/ppo")
    result = ex.wait(ex.submit("ppo", _config(), 16, nodes=2, name="iter-002/ppo"))
    assert first == f"{tmp_path}/00-iter-001-ppo.yaml"
    assert result.code == NOT_APPLIED and result.error.startswith(f"manifests written to {tmp_path}/01-iter-002-ppo.yaml")
    assert list(yaml.safe_load_all(open(first))) == ex.manifests("ppo", _config(), 16, 2, name="iter-001/ppo")


def test_pipeline_renders_every_stage_without_apply(tmp_path):
    spec_path = demo.make_inputs(str(tmp_path))
    data = yaml.safe_load(open(spec_path))
    data["executor"] = {"kind": "kubernetes", "options": {"image": "llamarl:dev", "pvc": "runs"}}
    (tmp_path / "k8s.yaml").write_text(yaml.safe_dump(data))
    spec = load_spec(str(tmp_path / "k8s.yaml"))
    report = run_spec(spec, echo=lambda m: None)
    assert len(report) == 18 and all(what.startswith("written ") for _, what in report)
    assert report[0] == ("shard/actor", f"written {spec.run_dir}/pipeline/k8s/00-shard-actor.yaml")
    for _, what in report:
        for obj in yaml.safe_load_all(open(what.split(" ", 1)[1])):
            kubernetes_validate.validate(obj, K8S_VERSION, strict=True)


def test_a_failed_pod_restarts_the_whole_stage_and_a_user_error_does_not(capsys):
    # Two failures (a pod lost, say) then success: the Job is deleted with its pods and created
    # again, whole, twice; the same names keep the rendezvous address valid.
    batch = _FakeBatch("Failed", "BackoffLimitExceeded", ("Failed", "BackoffLimitExceeded"), ("Complete", None))
    ex = _executor(apis=(batch, _FakeCore()), apply=True, poll_s=0.001, restarts=2)
    assert ex.run("ppo", _config(), 16, nodes=2, name="iter-001/ppo").code == 0
    name = batch.created[0][1]["metadata"]["name"]
    assert [b["metadata"]["name"] for _, b in batch.created] == [name] * 3
    assert batch.deleted == [(name, "Foreground")] * 2
    assert "replacing all its pods, restart 2 of 2" in capsys.readouterr().err
    # Out of restarts: the stage fails, saying how often it was tried.
    batch = _FakeBatch("Failed", "BackoffLimitExceeded")
    result = _executor(apis=(batch, _FakeCore()), apply=True, poll_s=0.001, restarts=1).run("ppo", _config(), 16, 2)
    assert result.code == 1 and "(and 1 restart(s) of all its pods)" in result.error and len(batch.created) == 2
    # A user error (exit 2 through the pod failure policy) is never retried.
    batch = _FakeBatch("Failed", "PodFailurePolicy")
    result = _executor(apis=(batch, _FakeCore()), apply=True, poll_s=0.001, restarts=3).run("ppo", _config(), 16, 2)
    assert result.code == EXIT_USER_ERROR and len(batch.created) == 1 and batch.deleted == []


def test_detach_writes_a_driver_that_runs_the_resumable_run_in_the_cluster(tmp_path):
    spec_path = demo.make_inputs(str(tmp_path))
    data = yaml.safe_load(open(spec_path))
    data["executor"] = {"kind": "kubernetes", "options": {"image": "llamarl:dev", "pvc": "runs", "driver_restarts": 7}}
    (tmp_path / "k8s.yaml").write_text(yaml.safe_dump(data))
    spec = load_spec(str(tmp_path / "k8s.yaml"))
    report = run_spec(spec, detach=True, echo=lambda m: None)
    assert report == [("driver", f"{spec.run_dir}/pipeline/k8s/driver.yaml")]
    objects = list(yaml.safe_load_all(open(f"{spec.run_dir}/pipeline/k8s/driver.yaml")))
    assert [o["kind"] for o in objects] == ["ServiceAccount", "Role", "RoleBinding", "Job"]
    for obj in objects:
        kubernetes_validate.validate(obj, K8S_VERSION, strict=True)
    job = objects[-1]
    pod = job["spec"]["template"]["spec"]
    assert pod["restartPolicy"] == "OnFailure" and job["spec"]["backoffLimit"] == 7
    assert pod["containers"][0]["command"] == ["llamarl", "run", f"{spec.run_dir}/pipeline/spec.yaml", "--apply"]
    assert pod["serviceAccountName"] == objects[0]["metadata"]["name"] == objects[2]["subjects"][0]["name"]
    assert load_spec(f"{spec.run_dir}/pipeline/spec.yaml").name == spec.name  # what the driver will read
    rules = {(g, r): set(v) for rule in objects[1]["rules"] for g in rule["apiGroups"] for r in rule["resources"]
             for v in [rule["verbs"]]}
    assert {"create", "get", "delete"} <= rules[("batch", "jobs")] and "create" in rules[("", "services")]


def test_detach_with_the_local_executor_is_refused(tmp_path):
    spec = load_spec(demo.make_inputs(str(tmp_path)))
    with pytest.raises(UserError, match="--detach needs a cluster executor"):
        run_spec(spec, detach=True, echo=lambda m: None)


class _ListingBatch(_FakeBatch):
    """A namespace that already holds Jobs: ``jobs`` maps name → ended (True/False)."""

    def __init__(self, jobs: dict[str, bool], labels: dict[str, str]):
        super().__init__("Complete", None)
        self.jobs, self.labels, self.selectors = jobs, labels, []

    def list_namespaced_job(self, namespace, label_selector):
        self.selectors.append(label_selector)
        wanted = dict(kv.split("=") for kv in label_selector.split(","))
        if any(self.labels.get(k) != v for k, v in wanted.items()):
            return types.SimpleNamespace(items=[])
        items = []
        for name, ended in self.jobs.items():
            cond = [types.SimpleNamespace(type="Complete", status="True")] if ended else []
            items.append(types.SimpleNamespace(metadata=types.SimpleNamespace(name=name),
                                               status=types.SimpleNamespace(conditions=cond)))
        return types.SimpleNamespace(items=items)


def test_a_restarted_driver_follows_the_stages_running_job_instead_of_starting_another():
    options = KubernetesOptions(image="llamarl:1", pvc="runs", apply=True, poll_s=0.001)
    probe = KubernetesExecutor(options, run_dir="/shared/runs/a")
    labels = probe.manifests("ppo", _config(), 16, 2, name="iter-001/ppo")[1]["metadata"]["labels"]
    assert labels["llamarl/node"] == "iter-001-ppo" and len(labels["llamarl/run"]) == 16

    batch = _ListingBatch({"llamarl-iter-001-ppo-100": True, "llamarl-iter-001-ppo-200": False}, labels)
    ex = KubernetesExecutor(options, run_dir="/shared/runs/a", batch_api=batch, core_api=_FakeCore())
    assert ex.run("ppo", _config(), 16, 2, name="iter-001/ppo").code == 0
    assert batch.created == []  # followed llamarl-iter-001-ppo-200, created nothing
    # Another run's Jobs (another run directory) are not this run's: a new Job is created.
    other = KubernetesExecutor(options, run_dir="/shared/runs/b", batch_api=batch, core_api=_FakeCore())
    assert other.run("ppo", _config(), 16, 2, name="iter-001/ppo").code == 0
    assert len(batch.created) == 1 and batch.created[0][1]["metadata"]["labels"]["llamarl/run"] != labels["llamarl/run"]


def _existing_objects(monkeypatch) -> list[str]:
    """``kubernetes.utils.create_from_dict`` in a namespace where every object exists already
    (each create answers 409); the kinds asked for, in order."""
    from kubernetes import utils

    asked = []

    def create(client, obj, namespace):
        asked.append(obj["kind"])
        raise utils.FailToCreateError([types.SimpleNamespace(status=409, reason="AlreadyExists")])

    monkeypatch.setattr(utils, "create_from_dict", create)
    return asked


@pytest.mark.parametrize("ended", [False, True])
def test_detach_again_replaces_an_ended_driver_and_refuses_a_running_one(monkeypatch, ended):
    """A rerun of --detach after the driver ended (done, or failed past its restarts) starts a new
    driver, which resumes the run; while one still runs, it is refused in one line."""
    asked = _existing_objects(monkeypatch)
    batch = _FakeBatch("Complete" if ended else "Failed", None)
    batch.reads = 2 if ended else -10**6  # the fake shows a condition from its third read on
    ex = _executor(apis=(batch, types.SimpleNamespace(api_client=None)), apply=True, poll_s=0.001)
    if not ended:
        with pytest.raises(UserError, match=r"the driver Job llamarl-driver-r1 exists and still runs"):
            ex.start_driver("/shared/runs/r1/pipeline/spec.yaml", "r1")
        assert batch.deleted == [] and batch.created == []
        return
    assert ex.start_driver("/shared/runs/r1/pipeline/spec.yaml", "r1") == "llamarl-driver-r1"
    assert asked == ["ServiceAccount", "Role", "RoleBinding", "Job"]  # those that exist are kept
    assert batch.deleted == [("llamarl-driver-r1", "Foreground")]
    assert [b["kind"] for _, b in batch.created] == ["Job"]
    assert batch.created[0][1]["spec"]["template"]["spec"]["restartPolicy"] == "OnFailure"


def test_a_stopped_driver_releases_the_run_and_leaves_the_stages_job_running(tmp_path, monkeypatch):
    """A detached driver's pod told to stop (SIGTERM: the pod deleted, evicted, its node drained)
    releases the lock at once, so its replacement — a new pod, another host — need not wait out
    the lease; the stage's Job runs on (its record says so) for that driver to follow."""
    import os
    import signal
    import threading

    from llamarl.lib.errors import Stopped
    from llamarl.pipeline.cli import stopped_by_signals
    from llamarl.pipeline.dag import build_dag
    from llamarl.pipeline.records import read_record

    data = yaml.safe_load(open(demo.make_inputs(str(tmp_path))))
    data["executor"] = {"kind": "kubernetes", "options": {"image": "llamarl:dev", "pvc": "runs", "apply": True,
                                                          "poll_s": 0.01}}
    (tmp_path / "k8s.yaml").write_text(yaml.safe_dump(data))
    spec = load_spec(str(tmp_path / "k8s.yaml"))
    ended = threading.Event()

    class Running(_FakeBatch):
        def read_namespaced_job_status(self, name, namespace):
            if self.reads == 1:  # the Job runs: the driver's pod is told to stop
                os.kill(os.getpid(), signal.SIGTERM)
            self.reads = min(self.reads, 1) if not ended.is_set() else 5
            return super().read_namespaced_job_status(name, namespace)

    batch = Running("Complete", None)
    monkeypatch.setattr(KubernetesExecutor, "_apis", lambda self: (batch, _FakeCore()))
    monkeypatch.setattr(KubernetesExecutor, "_running_job", lambda self, node: None)
    try:
        with pytest.raises(Stopped) as stopped, stopped_by_signals():
            run_spec(spec, echo=lambda m: None)
        assert stopped.value.name == "SIGTERM" and stopped.value.stages == []  # nothing of its own to stop
        assert not os.path.exists(f"{spec.run_dir}/pipeline/lock.json")
        shards = build_dag(spec)[:2]  # both shards' Jobs were created: the cluster queues them
        assert [n.name for n in shards] == ["shard/actor", "shard/rm"] and len(batch.created) == 2
        assert [read_record(spec.run_dir, n)["status"] for n in shards] == ["running", "running"]
        assert batch.deleted == []  # the Jobs run on
    finally:
        ended.set()  # the Job completes: the thread that followed it ends
