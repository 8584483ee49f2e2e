"""Kubernetes executor: each stage an Indexed Job with a headless Service for rendezvous.

For a stage on N nodes × G processes: ``completionMode: Indexed`` with completions = parallelism
= N; pods are ``<job>-<index>``; a headless Service (``clusterIP: None``, selecting the job's pods)
named in the pods' ``subdomain`` gives each a DNS name, so rank 0's node is
``<job>-0.<service>``. Each pod runs ``torchrun --nnodes=N --node_rank=$JOB_COMPLETION_INDEX
--nproc_per_node=G --master_addr=<job>-0.<service>``. Storage is a PVC mounted at the same path
as the run directory. A pod failing with exit status 2 (a user error, already reported) fails
the Job at once; a pod evicted by a disruption does not count against ``backoffLimitPerIndex``.

Without ``apply`` the manifests are written as YAML; with it they are created through the
kubernetes client and the Job is followed to completion.
"""

from __future__ import annotations

import dataclasses
import json
import re
import shlex
import time
from dataclasses import dataclass, field

from llamarl.lib.errors import UserError

USER_ERROR_EXIT = 2


def _dns_name(text: str) -> str:
    return re.sub(r"[^a-z0-9-]+", "-", text.lower()).strip("-")[:50]


@dataclass
class KubernetesExecutor:
    image: str
    """Container image with llamarl installed."""
    pvc: str
    """PersistentVolumeClaim holding the run's storage."""
    mount_path: str = "/shared"
    """Where the PVC is mounted in the pods (storage URLs must point under it)."""
    namespace: str = "default"
    gpus_per_node: int = 0
    cpu: str | None = None
    memory: str | None = None
    backoff_limit_per_index: int = 2
    """Retries of each node's pod (preemptions not counted)."""
    master_port: int = 29500
    apply: bool = False
    """Create the objects and follow the Job; otherwise only write the YAML."""
    manifests_dir: str | None = None
    """Where YAML is written (one file per stage)."""
    env: dict = field(default_factory=dict)
    node_selector: dict = field(default_factory=dict)
    poll_s: float = 5.0
    batch_api: object = None
    core_api: object = None
    last_error: str | None = None
    counter: int = 0

    # ---- manifests ------------------------------------------------------------------------

    def manifests(self, name: str, stage: str, config, nprocs: int, nodes: int = 1) -> list[dict]:
        if nprocs % nodes:
            raise UserError(f"{nprocs} processes do not spread evenly over {nodes} nodes")
        job, svc = _dns_name(f"llamarl-{name}"), _dns_name(f"llamarl-{name}") + "-svc"
        per_node = nprocs // nodes
        stage_args = f"-m llamarl.stages.{stage} --config-json {shlex.quote(json.dumps(dataclasses.asdict(config)))}"
        torchrun = (f"exec torchrun --nnodes={nodes} --node_rank=${{JOB_COMPLETION_INDEX}} --nproc_per_node={per_node} "
                    f"--master_addr={job}-0.{svc} --master_port={self.master_port} {stage_args}")
        resources: dict = {}
        if self.gpus_per_node:
            resources["limits"] = {"nvidia.com/gpu": self.gpus_per_node}
        requests = {k: v for k, v in (("cpu", self.cpu), ("memory", self.memory)) if v}
        if requests:
            resources["requests"] = requests
        env = [{"name": "NCCL_NVLS_ENABLE", "value": "0"}, {"name": "PYTHONUNBUFFERED", "value": "1"}]
        env += [{"name": k, "value": str(v)} for k, v in self.env.items()]
        labels = {"app.kubernetes.io/part-of": "llamarl", "llamarl/stage": stage}
        service = {
            "apiVersion": "v1", "kind": "Service",
            "metadata": {"name": svc, "namespace": self.namespace, "labels": labels},
            "spec": {"clusterIP": "None", "selector": {"job-name": job}, "publishNotReadyAddresses": True,
                     "ports": [{"name": "rendezvous", "port": self.master_port}]},
        }
        pod_spec = {
            "subdomain": svc,
            "restartPolicy": "Never",
            "containers": [{
                "name": "stage", "image": self.image, "command": ["bash", "-c", torchrun], "env": env,
                "resources": resources,
                "volumeMounts": [{"name": "storage", "mountPath": self.mount_path}],
            }],
            "volumes": [{"name": "storage", "persistentVolumeClaim": {"claimName": self.pvc}}],
        }
        if self.node_selector:
            pod_spec["nodeSelector"] = dict(self.node_selector)
        job_obj = {
            "apiVersion": "batch/v1", "kind": "Job",
            "metadata": {"name": job, "namespace": self.namespace, "labels": labels},
            "spec": {
                "completionMode": "Indexed", "completions": nodes, "parallelism": nodes,
                "backoffLimitPerIndex": self.backoff_limit_per_index,
                "podFailurePolicy": {"rules": [
                    {"action": "FailJob", "onExitCodes": {"containerName": "stage", "operator": "In", "values": [USER_ERROR_EXIT]}},
                    {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
                ]},
                "template": {"metadata": {"labels": labels}, "spec": pod_spec},
            },
        }
        return [service, job_obj]

    # ---- running ---------------------------------------------------------------------------

    def run(self, stage: str, config, nprocs: int, nodes: int = 1) -> int:
        self.counter += 1
        name = f"{self.counter:02d}-{stage}-{int(time.time())}"
        objects = self.manifests(name, stage, config, nprocs, nodes)
        if not self.apply:
            self._write(name, objects)
            self.last_error = f"manifests written to {self.manifests_dir} (apply them, or set apply: true)"
            return 3
        return self._apply_and_follow(objects)

    def _write(self, name: str, objects: list[dict]) -> str:
        import yaml

        from llamarl.lib import publish

        if not self.manifests_dir:
            raise UserError("kubernetes executor: set manifests_dir, or apply: true")
        url = f"{self.manifests_dir.rstrip('/')}/{name}.yaml"
        publish.write_bytes(url, yaml.safe_dump_all(objects, sort_keys=False).encode())
        return url

    def _apis(self):
        if self.batch_api is None or self.core_api is None:
            from kubernetes import client, config

            try:
                config.load_incluster_config()
            except config.ConfigException:
                config.load_kube_config()
            self.batch_api = self.batch_api or client.BatchV1Api()
            self.core_api = self.core_api or client.CoreV1Api()
        return self.batch_api, self.core_api

    def _apply_and_follow(self, objects: list[dict]) -> int:
        batch, core = self._apis()
        service, job = objects
        ns = self.namespace
        core.create_namespaced_service(namespace=ns, body=service)
        batch.create_namespaced_job(namespace=ns, body=job)
        name = job["metadata"]["name"]
        while True:
            status = batch.read_namespaced_job_status(name=name, namespace=ns).status
            for cond in status.conditions or []:
                if cond.status == "True" and cond.type == "Complete":
                    self.last_error = None
                    return 0
                if cond.status == "True" and cond.type == "Failed":
                    self.last_error = f"job {name} failed: {cond.reason}: {cond.message}"
                    return 1
            time.sleep(self.poll_s)
