"""Kubernetes executor: each stage an Indexed Job (a pod per node) and a headless Service that
gives rank 0's pod the DNS name torchrun's rendezvous needs (``<job>-0.<service>``).

A stage's pods fail and restart together (``backoffLimit: 0``; ``wait`` creates the Job again,
whole, up to ``restarts`` times): one torchrun world cannot take back a single restarted pod.
docs/pipeline.md ("Executors") says the rest: storage, ``/dev/shm``, the pods' user, exit status 2,
and the manifests written without ``apply``.
"""

from __future__ import annotations

import hashlib
import re
import shlex
import sys
import time
from typing import Annotated, Any

import yaml
from pydantic import ConfigDict, Field

from llamarl.lib.errors import EXIT_STATUS_ENV, EXIT_USER_ERROR, UserError
from llamarl.lib.options import Strict

from .executor import Executor, StageResult, per_node, stage_args

NOT_APPLIED = 4
"""``wait``'s code for a stage whose manifests were written, not applied: nothing ran (not a stage's
exit status: 2 and 3 are taken by ``EXIT_USER_ERROR`` and ``EXIT_PEER_LOST``)."""

GPU_STAGES = ("rollout", "score", "ppo")
"""Stages that compute on GPUs: their pods get one GPU per process unless ``gpus_per_node`` says."""


def _end_condition(job: Any) -> Any:
    """The Job's Complete or Failed condition; None while it runs."""
    return next((c for c in job.status.conditions or [] if c.status == "True" and c.type in ("Complete", "Failed")), None)


def _dns_name(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:50]


# YAML reads `cpu: 32` or `OMP_NUM_THREADS: 8` as a number; the API takes such values as strings.
AsText = Annotated[str, Field(strict=False)]


class KubernetesOptions(Strict):
    model_config = ConfigDict(coerce_numbers_to_str=True)

    image: str = Field(description="Container image with llamarl installed.")
    pvc: str = Field(description="PersistentVolumeClaim holding the run's storage.")
    mount_path: str = Field("/shared", description="Where the PVC is mounted in the pods (storage URLs must point "
                                                   "under it).")
    namespace: str = Field("default", description="Namespace of the Jobs and Services.")
    gpus_per_node: int | None = Field(None, ge=0, description="GPUs of each pod (nvidia.com/gpu). Default: one per "
                                                             "process for the stages that compute on GPUs (rollout, "
                                                             "score, ppo), none for shard and export; 0 for none.")
    cpu: AsText | None = Field(None, description="CPU request of each pod, e.g. 32 or 500m.")
    memory: AsText | None = Field(None, description="Memory request of each pod, e.g. 256Gi.")
    restarts: int = Field(2, ge=0, description="Times a failed stage's pods are all replaced and the stage resumed "
                                               "(a user error is never retried).")
    shm_size: AsText | None = Field(None, description="Size limit of the memory-backed /dev/shm, e.g. 64Gi (counted "
                                                   "against the pod's memory); default: no limit of its own.")
    run_as_user: int = Field(1000, ge=1, description="Non-root user (and group, and fsGroup of the storage) the "
                                                      "pods run as.")
    master_port: int = Field(29500, ge=1, le=65535, description="torchrun's rendezvous port on the first pod.")
    apply: bool = Field(False, description="Create the objects and follow the Job; otherwise only write the YAML.")
    manifests_dir: str | None = Field(None, description="Where the YAML is written without apply (one file per "
                                                        "stage); default RUN/pipeline/k8s.")
    env: dict[str, AsText] = Field(default_factory=dict, description="Extra environment variables of the pods.")
    node_selector: dict[str, AsText] = Field(default_factory=dict, description="nodeSelector of the pods.")
    poll_s: float = Field(5.0, gt=0, description="Seconds between reads of a Job's status.")
    driver_restarts: int = Field(10, ge=0, description="`llamarl run --detach`: times the driver pod (which runs the "
                                                       "resumable `llamarl run` in the cluster) is restarted after a "
                                                       "failure.")


class KubernetesExecutor(Executor):
    detach = "driver"

    def __init__(self, options: KubernetesOptions, *, run_dir: str | None = None, batch_api: Any = None,
                 core_api: Any = None):
        """``run_dir``: the run whose stages this executor starts (its Jobs are labelled with it, so
        that a restarted driver follows a stage's running Job instead of starting a second one;
        ``manifests_dir`` defaults to its ``pipeline/k8s``). ``batch_api`` / ``core_api``:
        kubernetes clients (BatchV1Api, CoreV1Api); by default built from the in-cluster or
        kubeconfig credentials on first use."""
        if not options.apply and not options.manifests_dir:
            if run_dir is None:
                raise UserError("kubernetes executor: set manifests_dir, or apply: true")
            options = options.model_copy(update={"manifests_dir": f"{run_dir.rstrip('/')}/pipeline/k8s"})
        self.options = options
        self.launches = options.apply
        self._batch_api, self._core_api = batch_api, core_api
        # A label value (at most 63 characters) that names the run directory.
        self.run_label = hashlib.sha256(run_dir.rstrip("/").encode()).hexdigest()[:16] if run_dir else None
        self._written = 0  # manifests written so far: their files are numbered in the order to apply them
        self._jobs: dict[str, dict] = {}  # submitted Jobs by name, to create again on a restart

    # ---- manifests ------------------------------------------------------------------------

    def manifests(self, stage: str, config: Any, nprocs: int, nodes: int = 1, *, name: str | None = None,
                  job_name: str | None = None) -> list[dict]:
        """The stage's headless Service and Indexed Job (named ``job_name``, default from ``name``)."""
        o = self.options
        job = job_name or _dns_name(f"llamarl-{name or stage}")
        svc = f"{job}-svc"
        args = shlex.join(stage_args(stage, config))
        torchrun = (f"torchrun --nnodes={nodes} --node_rank=${{JOB_COMPLETION_INDEX}} "
                    f"--nproc_per_node={per_node(nprocs, nodes)} --master_addr={job}-0.{svc} "
                    f"--master_port={o.master_port} --rdzv-conf=timeout={config.collective_timeout_s} {args}")
        # torchrun exits 1 whatever its workers did: the pod exits with the stage's own status
        # (2 for a user error, which the podFailurePolicy fails at once), the lowest any worker
        # reported, or with torchrun's where none did.
        command = (f'export {EXIT_STATUS_ENV}="${{TMPDIR:-/tmp}}/llamarl-exit-status"; rm -f "${EXIT_STATUS_ENV}"; '
                   f'{torchrun}; rc=$?; '
                   f'if [ "$rc" -ne 0 ] && [ -s "${EXIT_STATUS_ENV}" ]; then '
                   f'rc=$(sort -n "${EXIT_STATUS_ENV}" | head -n 1 | cut -d " " -f 1); fi; exit "$rc"')
        gpus = o.gpus_per_node if o.gpus_per_node is not None else (per_node(nprocs, nodes) if stage in GPU_STAGES else 0)
        requests = {k: v for k, v in (("cpu", o.cpu), ("memory", o.memory)) if v}
        resources = {**({"limits": {"nvidia.com/gpu": gpus}} if gpus else {}),
                     **({"requests": requests} if requests else {})}
        labels = {"app.kubernetes.io/part-of": "llamarl", "llamarl/stage": stage, "llamarl/node": _dns_name(name or stage)}
        if self.run_label:
            labels["llamarl/run"] = self.run_label
        service = {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": svc, "namespace": o.namespace, "labels": labels},
            "spec": {"clusterIP": "None", "selector": {"job-name": job}, "publishNotReadyAddresses": True,
                     "ports": [{"name": "rendezvous", "port": o.master_port}]},
        }
        pod_spec = self._pod({"subdomain": svc, "restartPolicy": "Never"}, "stage", ["bash", "-c", command],
                             [{"name": "NCCL_NVLS_ENABLE", "value": "0"}], resources, shm=True)
        job_obj = {
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": job, "namespace": o.namespace, "labels": labels},
            "spec": {
                "completionMode": "Indexed", "completions": nodes, "parallelism": nodes,
                "backoffLimit": 0,  # one failed pod fails the Job; `wait` replaces all of them together
                "podFailurePolicy": {"rules": [
                    {"action": "FailJob", "onExitCodes": {"containerName": "stage", "operator": "In", "values": [EXIT_USER_ERROR]}},
                ]},
                "template": {"metadata": {"labels": labels}, "spec": pod_spec},
            },
        }
        return [service, job_obj]

    def _pod(self, head: dict, name: str, command: list[str], env: list[dict], resources: dict,
             shm: bool = False) -> dict:
        """A pod spec (``head``: its first fields) of one unprivileged, non-root container ``name``
        with the PVC mounted and, with ``shm``, a memory-backed /dev/shm."""
        o = self.options
        mounts = [{"name": "storage", "mountPath": o.mount_path}]
        volumes = [{"name": "storage", "persistentVolumeClaim": {"claimName": o.pvc}}]
        if shm:
            mounts.append({"name": "shm", "mountPath": "/dev/shm"})
            limit = {"sizeLimit": o.shm_size} if o.shm_size else {}  # default: no limit of its own
            volumes.append({"name": "shm", "emptyDir": {"medium": "Memory", **limit}})
        env = [*env, {"name": "PYTHONUNBUFFERED", "value": "1"}, *({"name": k, "value": v} for k, v in o.env.items())]
        pod = {**head,
               "securityContext": {"runAsNonRoot": True, "runAsUser": o.run_as_user, "runAsGroup": o.run_as_user,
                                   "fsGroup": o.run_as_user, "seccompProfile": {"type": "RuntimeDefault"}},
               "containers": [{"name": name, "image": o.image, "command": command, "env": env, "resources": resources,
                               "securityContext": {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}},
                               "volumeMounts": mounts}],
               "volumes": volumes}
        if o.node_selector:
            pod["nodeSelector"] = dict(o.node_selector)
        return pod

    def render(self, stage: str, config: Any, nprocs: int, nodes: int = 1, *, name: str | None = None) -> str:
        """The manifests as one YAML document stream (what ``kubectl apply -f`` takes)."""
        return yaml.safe_dump_all(self.manifests(stage, config, nprocs, nodes, name=name), sort_keys=False)

    # ---- running ---------------------------------------------------------------------------

    def submit(self, stage: str, config: Any, nprocs: int, nodes: int = 1, *, name: str | None = None) -> str:
        """With ``apply``: create the Service and Job, and return the Job's name. Without: write
        the manifests to ``manifests_dir/NN-NAME.yaml`` and return that URL."""
        from llamarl.lib.files import publish

        if not self.options.apply:
            url = f"{self.options.manifests_dir.rstrip('/')}/{self._written:02d}-{_dns_name(name or stage)}.yaml"
            publish.write_bytes(url, self.render(stage, config, nprocs, nodes, name=name).encode())
            self._written += 1
            return url
        batch, core = self._apis()
        running = self._running_job(name or stage)
        if running is not None:  # started by an earlier driver that was restarted: follow it
            print(f"following {name or stage}'s Job {running}, still running", file=sys.stderr, flush=True)
            self._jobs[running] = self.manifests(stage, config, nprocs, nodes, name=name, job_name=running)[1]
            return running
        # Job names must be unique in the namespace while an earlier run's Job is kept.
        job_name = _dns_name(f"llamarl-{name or stage}-{int(time.time())}")
        service, job = self.manifests(stage, config, nprocs, nodes, name=name, job_name=job_name)
        core.create_namespaced_service(namespace=self.options.namespace, body=service)
        batch.create_namespaced_job(namespace=self.options.namespace, body=job)
        self._jobs[job["metadata"]["name"]] = job
        return job["metadata"]["name"]

    def wait(self, handle: str) -> StageResult:
        """Follow the Job to its Complete or Failed condition; a failure other than a user error
        (the pod failure policy's) replaces all its pods and the stage resumes."""
        if not self.options.apply:
            return StageResult(NOT_APPLIED, f"manifests written to {handle}: apply them, or set apply: true")
        restarts = 0
        while True:
            cond = self._ended(handle)
            if cond is None:
                time.sleep(self.options.poll_s)
                continue
            if cond.type == "Complete":
                return StageResult(0)
            if cond.reason == "PodFailurePolicy":
                return StageResult(EXIT_USER_ERROR, f"job {handle} failed: {cond.reason}: {cond.message}")
            if restarts == self.options.restarts:
                tries = f" (and {restarts} restart(s) of all its pods)" if restarts else ""
                return StageResult(1, f"job {handle} failed{tries}: {cond.reason}: {cond.message}")
            restarts += 1
            print(f"job {handle} failed ({cond.reason}: {cond.message}); replacing all its pods, restart {restarts} "
                  f"of {self.options.restarts}", file=sys.stderr, flush=True)
            # The Job created again whole: its new pods keep the names (and DNS names) the rendezvous needs.
            self._delete(handle)
            self._apis()[0].create_namespaced_job(namespace=self.options.namespace, body=self._jobs[handle])

    def _running_job(self, node: str) -> str | None:
        """The name of this run's Job of ``node`` that has not ended, if there is one."""
        if not self.run_label:
            return None
        batch, _ = self._apis()
        selector = f"llamarl/run={self.run_label},llamarl/node={_dns_name(node)}"
        jobs = batch.list_namespaced_job(namespace=self.options.namespace, label_selector=selector).items
        return next((job.metadata.name for job in jobs if _end_condition(job) is None), None)

    # ---- detached runs ---------------------------------------------------------------------

    def driver_manifests(self, spec_url: str, run_name: str) -> list[dict]:
        """What runs a whole run inside the cluster: a Job (restartPolicy OnFailure) whose pod runs
        the resumable ``llamarl run SPEC --apply``, and the ServiceAccount, Role and RoleBinding that
        let it create and follow the stages' Jobs and Services."""
        o = self.options
        name = _dns_name(f"llamarl-driver-{run_name}")
        meta = {"name": name, "namespace": o.namespace, "labels": {"app.kubernetes.io/part-of": "llamarl"}}
        account = {"apiVersion": "v1", "kind": "ServiceAccount", "metadata": meta}
        role = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "Role", "metadata": meta, "rules": [
            {"apiGroups": ["batch"], "resources": ["jobs"], "verbs": ["create", "get", "list", "watch", "delete"]},
            {"apiGroups": ["batch"], "resources": ["jobs/status"], "verbs": ["get"]},
            {"apiGroups": [""], "resources": ["services"], "verbs": ["create", "get", "list", "delete"]},
        ]}
        binding = {"apiVersion": "rbac.authorization.k8s.io/v1", "kind": "RoleBinding", "metadata": meta,
                   "roleRef": {"apiGroup": "rbac.authorization.k8s.io", "kind": "Role", "name": name},
                   "subjects": [{"kind": "ServiceAccount", "name": name, "namespace": o.namespace}]}
        # restartPolicy OnFailure: a lost driver pod starts again and resumes the run.
        pod = self._pod({"serviceAccountName": name, "restartPolicy": "OnFailure"}, "driver",
                        ["llamarl", "run", spec_url, "--apply"], [], {"requests": {"cpu": "1", "memory": "2Gi"}})
        job = {"apiVersion": "batch/v1", "kind": "Job", "metadata": meta,
               "spec": {"backoffLimit": o.driver_restarts, "template": {"metadata": {"labels": meta["labels"]},
                                                                        "spec": pod}}}
        return [account, role, binding, job]

    def start_driver(self, spec_url: str, run_name: str) -> str:
        """``llamarl run --detach``: with ``apply``, create the driver's objects (those that exist
        already are kept) and return the driver Job's name; without, write them to
        ``manifests_dir/driver.yaml`` and return that URL."""
        objects = self.driver_manifests(spec_url, run_name)
        if not self.options.apply:
            from llamarl.lib.files import publish

            url = f"{self.options.manifests_dir.rstrip('/')}/driver.yaml"
            publish.write_bytes(url, yaml.safe_dump_all(objects, sort_keys=False).encode())
            return url
        from kubernetes import utils

        batch, core = self._apis()
        for obj in objects:
            try:
                utils.create_from_dict(core.api_client, obj, namespace=self.options.namespace)
            except utils.FailToCreateError as e:
                if not all(getattr(x, "status", None) == 409 for x in e.api_exceptions):
                    raise UserError(f"kubernetes: cannot create {obj['kind']} {obj['metadata']['name']}: "
                                    f"{e.api_exceptions[0].reason}") from None
                if obj["kind"] == "Job":
                    name = obj["metadata"]["name"]
                    if self._ended(name) is None:
                        raise UserError(f"kubernetes: the driver Job {name} exists and still runs: the run is being "
                                        f"driven; follow it with `llamarl status`, or delete the Job first") from None
                    # An earlier --detach's driver, ended (done, or failed after its restarts): a
                    # new one resumes the run, doing only what is missing.
                    self._delete(name)
                    batch.create_namespaced_job(namespace=self.options.namespace, body=obj)
        return objects[-1]["metadata"]["name"]

    def _ended(self, name: str) -> Any:
        """The ``_end_condition`` of the Job ``name``."""
        batch, _ = self._apis()
        return _end_condition(batch.read_namespaced_job_status(name=name, namespace=self.options.namespace))

    def _delete(self, name: str) -> None:
        """Delete the Job with its pods and wait until it is gone (its name is free again)."""
        batch, _ = self._apis()
        ns = self.options.namespace
        batch.delete_namespaced_job(name=name, namespace=ns, propagation_policy="Foreground")
        while True:
            try:
                batch.read_namespaced_job_status(name=name, namespace=ns)
            except Exception as e:  # kubernetes.client.ApiException; 404 once the Job and its pods are gone
                if getattr(e, "status", None) == 404:
                    break
                raise
            time.sleep(self.options.poll_s)

    def _apis(self) -> tuple[Any, Any]:
        if self._batch_api is None or self._core_api is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self._batch_api = self._batch_api or client.BatchV1Api()
            self._core_api = self._core_api or client.CoreV1Api()
        return self._batch_api, self._core_api
