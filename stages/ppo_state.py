"""What a ppo run keeps on storage: each role's published weights and training state at the end,
and during the run the resumable states under ``OUT/.state`` (docs/formats.md, "What ppo writes,
when"). A saved state ``OUT/.state/step-NNNNNN`` is whole once its ``done.json`` exists: written
last, with every file's checksum and the metrics of the steps so far (a resumed run reports every
step).
"""

from __future__ import annotations

import json

import fsspec
import torch
import torch.distributed as dist

from llamarl.lib.distributed import collectives
from llamarl.lib.files import outputs, publish
from llamarl.lib.errors import UserError
from llamarl.lib.distributed.parallel import Topology
from llamarl.stages import contract
from llamarl.stages.ppo_metrics import dumps
from llamarl.stages.ppo_trainer import Trainer


def _start(root: str) -> None:
    """Rank 0: ``root`` emptied and marked ours. It lies inside our own unpublished output, so
    whatever an interrupted run left there is ours to replace."""
    fs, path = fsspec.core.url_to_fs(root)
    if fs.exists(path):
        fs.rm(path, recursive=True)
    publish.prepare(root, lambda m: False)


def _entries(root: str, subs: tuple[str, ...]) -> dict:
    """Collective: the manifest entries of every file under ``root``'s folders ``subs``."""
    fs, path = fsspec.core.url_to_fs(root)
    return outputs.file_entries(root, sorted(p[len(path) + 1 :] for sub in subs for p in fs.find(f"{path}/{sub}")))


def save_weights(root: str, role: str, trainer: Trainer, source: str, source_manifest: dict, step: int,
                 store_dtype: torch.dtype) -> None:
    """Collective: a published checkpoint (the format shard writes) of ``trainer``'s model as of
    ``step``: weights and HF side files (from the checkpoint ``source``), no optimizer state; its
    manifest points at ``role``'s training state, which ``save_train_state`` publishes next."""
    rank = dist.get_rank()
    if rank == 0:
        _start(root)
        contract.copy_side_files(f"{source}/{contract.HF}", contract.hf_side_files(source_manifest), f"{root}/{contract.HF}")
    dist.barrier()
    trainer.save_weights(root, store_dtype)
    dist.barrier()
    files = _entries(root, (contract.MODEL, contract.HF))
    if rank == 0:
        model = trainer.model
        publish.publish(root, contract.checkpoint_manifest(
            model.cfg, model.hf_head, store_dtype, source_manifest.get("hf_config", {}), source_manifest.get("source", {}),
            files, model.topology, train_state=contract.train_state_pointer(role, step)))
    dist.barrier()


def save_train_state(out: str, role: str, trainer: Trainer, step: int) -> None:
    """Collective: ``role``'s optimizer state as of ``step`` published under ``OUT/train_state/<role>``,
    after its weights ``OUT/<role>``, whose id its manifest records."""
    root = f"{out}/{contract.TRAIN_STATE}/{role}"
    if dist.get_rank() == 0:
        _start(root)
    dist.barrier()
    trainer.save_optimizer(root)
    dist.barrier()
    files = _entries(root, (contract.OPTIM,))
    if dist.get_rank() == 0:
        publish.publish(root, contract.train_state_manifest(role, step, publish.output_id(f"{out}/{role}"), files))
    dist.barrier()


def save_unwritten_state(out: str, role: str, step: int) -> None:
    """Collective: ``role``'s training state as of ``step`` published under ``OUT/train_state/<role>``
    as not written (``publish.unwritten``): the next ppo takes it from this worker's memory
    (stages/ppo_kept.py), and what else needs it makes it again (retention.train_state_every)."""
    root = f"{out}/{contract.TRAIN_STATE}/{role}"
    if dist.get_rank() == 0:
        _start(root)
        manifest = contract.train_state_manifest(role, step, publish.output_id(f"{out}/{role}"), {})
        publish.publish_unwritten(root, manifest, "the next ppo takes it from memory (retention.train_state_every)")
    dist.barrier()


def clear_published(out: str) -> None:
    """Rank 0, when a rerun resumes ``out``: drop what the interrupted run had published inside it
    (weights, training state, metrics), keeping the saved state under ``.state``. The rerun writes
    them again, whole, rather than mix its new files with ones read already (a rollout may have
    started from those weights: its key names their id, which the rewrite changes)."""
    fs, path = fsspec.core.url_to_fs(out)
    for entry in fs.ls(path, detail=False):
        if entry.rstrip("/").rsplit("/", 1)[-1] not in (contract.STATE, publish.INCOMPLETE):
            fs.rm(entry, recursive=True)


def optim_url(root: str | None, manifest: dict | None, state: tuple[str, dict] | None) -> str | None:
    """Where the optimizer state of the checkpoint ``root`` is, if it has one (shard's have none):
    in its training state (``state``: ``contract.require_train_state``'s), or inside it (older ppo)."""
    if state is not None:
        return f"{state[0]}/{contract.OPTIM}"
    return f"{root}/{contract.OPTIM}" if manifest and contract.has_optimizer_state(manifest) else None


def verify_train_state(url: str, manifest: dict, checkpoint_url: str) -> None:
    """Collective: every file of the training state ``url`` checked against its manifest; a
    damaged one is refused in one line naming the fix."""
    try:
        outputs.verify_input(url, manifest)
    except UserError as e:
        raise UserError(f"{str(e).split('; ')[0]}: the training state of {checkpoint_url} is damaged; "
                        f"{contract.redo_train_state(checkpoint_url)}") from None


def metrics_on_rank0(lines: list[dict], topo: Topology) -> list[dict] | None:
    """Collective: the step metrics (kept on the last stage's first TP/DP rank of ``topo``), on rank 0."""
    gathered = collectives.all_gather_object(lines if topo.is_last_stage and topo.tp_rank == 0 and topo.dp_rank == 0
                                             else None)
    return next(g for g in gathered if g is not None) if dist.get_rank() == 0 else None


def _state_root(out: str, k: int) -> str:
    return f"{out}/{contract.STATE}/step-{k:06d}"


def save_state(out: str, k: int, trainers: dict[str, Trainer], store_dtype: torch.dtype, metrics: list[dict] | None) -> None:
    """Collective: the training state after ``k`` steps, and the ``metrics`` of those steps in the
    marker written last."""
    root = _state_root(out, k)
    for name, t in trainers.items():
        t.save_weights(f"{root}/{name}", store_dtype)
        t.save_optimizer(f"{root}/{name}")
    dist.barrier()
    files = _entries(root, tuple(trainers))
    if dist.get_rank() == 0:
        marker = {"step": k, "metrics": metrics, "files": files}
        publish.write_bytes(f"{root}/done.json", dumps(marker).encode())  # written last
    dist.barrier()


def resume(out: str, trainers: dict[str, Trainer], start_step: int) -> tuple[int, list[dict]]:
    """Collective: the number of optimizer steps an interrupted run already did (0 if none), its
    state loaded into ``trainers``, and the metrics of those steps (on the rank that keeps them)."""

    def damaged(root: str, what: str) -> str:
        return (f"{what}: the saved training state is damaged; delete {root} to resume from an earlier step (or the "
                "whole output to start over)")

    k, marker, error = contract.saved_step(out), None, None
    root = _state_root(out, k)
    if k and dist.get_rank() == 0:
        fs, path = fsspec.core.url_to_fs(root)
        try:
            marker = json.loads(fs.cat_file(f"{path}/done.json"))
        except json.JSONDecodeError:
            error = damaged(root, f"{root}/done.json is not valid JSON")
    collectives.check(error)
    k, marker = collectives.broadcast_object((k, marker))
    if not k:
        return 0, []
    root = _state_root(out, k)  # rank 0's
    try:
        outputs.verify_input(root, {"files": marker.get("files", {})})  # states saved before checksums: none
    except UserError as e:
        raise UserError(damaged(root, e.args[0].split("; ")[0])) from None
    for name, t in trainers.items():
        t.restore(f"{root}/{name}", start_step + k)
    if dist.get_rank() == 0:
        print(f"{out}: resuming after optimizer step {k}", flush=True)
    return k, list(marker.get("metrics") or [])


def clear_state(out: str) -> None:
    """Drop the saved training state once the outputs are published: it served its purpose."""
    fs, path = fsspec.core.url_to_fs(out)
    if fs.exists(f"{path}/{contract.STATE}"):
        fs.rm(f"{path}/{contract.STATE}", recursive=True)
