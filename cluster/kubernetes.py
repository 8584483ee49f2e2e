"""Kubernetes executor: each stage an Indexed Job with a headless Service for rendezvous.

For a stage on N nodes × G processes: ``completionMode: Indexed`` with completions = parallelism
= N; pods are ``<job>-<index>``; a headless Service (``clusterIP: None``, selecting the job's pods)
named in the pods' ``subdomain`` gives each a DNS name, so rank 0's node is
``<job>-0.<service>``. Each pod runs ``torchrun --nnodes=N --node_rank=$JOB_COMPLETION_INDEX
--nproc_per_node=G --master_addr=<job>-0.<service>``. Storage is a PVC mounted at the same path
as the run directory. A pod failing with exit status 2 (a user error, already reported) fails
the Job at once; a pod evicted by a disruption does not count against ``backoffLimitPerIndex``.

Without ``apply`` nothing runs here: ``submit`` writes the stage's manifests as YAML to
``manifests_dir``, numbered in submission order, and the pipeline writes every stage's, to be
applied in that order. With it they are created through the kubernetes client and ``wait``
follows the Job to its Complete or Failed condition.
"""

from __future__ import annotations

import re
import shlex
import time
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, Field

from llamarl.lib.errors import EXIT_USER_ERROR, UserError

from .executor import StageResult, per_node, stage_args

NOT_APPLIED = 3
"""``wait``'s code for a stage whose manifests were written, not applied: nothing ran."""


def _dns_name(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:50]


class KubernetesOptions(BaseModel):
    # YAML reads `cpu: 32` as a number; the API takes quantities as strings.
    model_config = ConfigDict(extra="forbid", coerce_numbers_to_str=True)

    image: str = Field(description="Container image with llamarl installed.")
    pvc: str = Field(description="PersistentVolumeClaim holding the run's storage.")
    mount_path: str = Field("/shared", description="Where the PVC is mounted in the pods (storage URLs must point "
                                                   "under it).")
    namespace: str = Field("default", description="Namespace of the Jobs and Services.")
    gpus_per_node: int = Field(0, ge=0, description="GPUs of each pod (nvidia.com/gpu), one process per GPU.")
    cpu: str | None = Field(None, description="CPU request of each pod, e.g. 32 or 500m.")
    memory: str | None = Field(None, description="Memory request of each pod, e.g. 256Gi.")
    backoff_limit_per_index: int = Field(2, ge=0, description="Retries of each node's pod (disruptions not counted).")
    master_port: int = Field(29500, ge=1, le=65535, description="torchrun's rendezvous port on the first pod.")
    apply: bool = Field(False, description="Create the objects and follow the Job; otherwise only write the YAML.")
    manifests_dir: str | None = Field(None, description="Where the YAML is written without apply (one file per "
                                                        "stage); default RUN/pipeline/k8s.")
    env: dict[str, str] = Field(default_factory=dict, description="Extra environment variables of the pods.")
    node_selector: dict[str, str] = Field(default_factory=dict, description="nodeSelector of the pods.")
    poll_s: float = Field(5.0, gt=0, description="Seconds between reads of a Job's status.")


class KubernetesExecutor:
    def __init__(self, options: KubernetesOptions, *, batch_api: Any = None, core_api: Any = None):
        """``batch_api`` / ``core_api``: kubernetes clients (BatchV1Api, CoreV1Api); by default
        built from the in-cluster or kubeconfig credentials on first use."""
        if not options.apply and not options.manifests_dir:
            raise UserError("kubernetes executor: set manifests_dir, or apply: true")
        self.options = options
        self.launches = options.apply
        self._batch_api, self._core_api = batch_api, core_api
        self._written = 0  # manifests written so far: their files are numbered in the order to apply them

    # ---- manifests ------------------------------------------------------------------------

    def manifests(self, stage: str, config: Any, nprocs: int, nodes: int = 1, *, name: str | None = None) -> list[dict]:
        """The stage's headless Service and Indexed Job."""
        o = self.options
        job = _dns_name(f"llamarl-{name or stage}")
        svc = f"{job}-svc"
        args = shlex.join(stage_args(stage, config))
        torchrun = (f"exec torchrun --nnodes={nodes} --node_rank=${{JOB_COMPLETION_INDEX}} "
                    f"--nproc_per_node={per_node(nprocs, nodes)} --master_addr={job}-0.{svc} "
                    f"--master_port={o.master_port} {args}")
        resources: dict = {}
        if o.gpus_per_node:
            resources["limits"] = {"nvidia.com/gpu": o.gpus_per_node}
        requests = {k: v for k, v in (("cpu", o.cpu), ("memory", o.memory)) if v}
        if requests:
            resources["requests"] = requests
        env = [{"name": "NCCL_NVLS_ENABLE", "value": "0"}, {"name": "PYTHONUNBUFFERED", "value": "1"}]
        env += [{"name": k, "value": v} for k, v in o.env.items()]
        labels = {"app.kubernetes.io/part-of": "llamarl", "llamarl/stage": stage}
        service = {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": svc, "namespace": o.namespace, "labels": labels},
            "spec": {"clusterIP": "None", "selector": {"job-name": job}, "publishNotReadyAddresses": True,
                     "ports": [{"name": "rendezvous", "port": o.master_port}]},
        }
        pod_spec = {
            "subdomain": svc,
            "restartPolicy": "Never",
            "containers": [{
                "name": "stage", "image": o.image, "command": ["bash", "-c", torchrun], "env": env,
                "resources": resources,
                "volumeMounts": [{"name": "storage", "mountPath": o.mount_path}],
            }],
            "volumes": [{"name": "storage", "persistentVolumeClaim": {"claimName": o.pvc}}],
        }
        if o.node_selector:
            pod_spec["nodeSelector"] = dict(o.node_selector)
        job_obj = {
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": job, "namespace": o.namespace, "labels": labels},
            "spec": {
                "completionMode": "Indexed", "completions": nodes, "parallelism": nodes,
                "backoffLimitPerIndex": o.backoff_limit_per_index,
                "podFailurePolicy": {"rules": [
                    {"action": "FailJob", "onExitCodes": {"containerName": "stage", "operator": "In", "values": [EXIT_USER_ERROR]}},
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                ]},
                "template": {"metadata": {"labels": labels}, "spec": pod_spec},
            },
        }
        return [service, job_obj]

    def render(self, stage: str, config: Any, nprocs: int, nodes: int = 1, *, name: str | None = None) -> str:
        """The manifests as one YAML document stream (what ``kubectl apply -f`` takes)."""
        return yaml.safe_dump_all(self.manifests(stage, config, nprocs, nodes, name=name), sort_keys=False)

    # ---- running ---------------------------------------------------------------------------

    def submit(self, stage: str, config: Any, nprocs: int, nodes: int = 1, *, name: str | None = None) -> str:
        """With ``apply``: create the Service and Job, and return the Job's name. Without: write
        the manifests to ``manifests_dir/NN-NAME.yaml`` and return that URL."""
        from llamarl.lib import publish

        if not self.options.apply:
            url = f"{self.options.manifests_dir.rstrip('/')}/{self._written:02d}-{_dns_name(name or stage)}.yaml"
            publish.write_bytes(url, self.render(stage, config, nprocs, nodes, name=name).encode())
            self._written += 1
            return url
        # Job names must be unique in the namespace while an earlier run's Job is kept.
        service, job = self.manifests(stage, config, nprocs, nodes, name=f"{name or stage}-{int(time.time())}")
        batch, core = self._apis()
        core.create_namespaced_service(namespace=self.options.namespace, body=service)
        batch.create_namespaced_job(namespace=self.options.namespace, body=job)
        return job["metadata"]["name"]

    def wait(self, handle: str) -> StageResult:
        """Follow the Job to its Complete or Failed condition. A failure by the pod failure policy
        is a stage's user error (exit status 2, reported in its pod's log)."""
        if not self.options.apply:
            return StageResult(NOT_APPLIED, f"manifests written to {handle}: apply them, or set apply: true")
        batch, _ = self._apis()
        while True:
            status = batch.read_namespaced_job_status(name=handle, namespace=self.options.namespace).status
            for cond in status.conditions or []:
                if cond.status == "True" and cond.type == "Complete":
                    return StageResult(0)
                if cond.status == "True" and cond.type == "Failed":
                    code = EXIT_USER_ERROR if cond.reason == "PodFailurePolicy" else 1
                    return StageResult(code, f"job {handle} failed: {cond.reason}: {cond.message}")
            time.sleep(self.options.poll_s)

    def run(self, stage: str, config: Any, nprocs: int, nodes: int = 1, *, name: str | None = None) -> StageResult:
        return self.wait(self.submit(stage, config, nprocs, nodes, name=name))

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
