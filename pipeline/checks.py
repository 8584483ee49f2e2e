"""What a run checks before anything runs, dry runs too: that its storage can hold the run
directory, and that every row of its prompts is one a rollout takes (stages/prompts.py: checked
once here, so no stage is started on a dataset a rollout would refuse) — with
``prompts_per_iteration``, of the very dataset it first took rows of (``pipeline/prompts.json``)."""

from __future__ import annotations

import json
import os

import fsspec

from llamarl.lib.files import publish
from llamarl.lib.errors import UserError

from .data import prompts_index
from .records import fingerprint
from .spec import RunSpec


def recorded(spec: RunSpec) -> dict | None:
    """What the run recorded of the dataset it takes rows of: prompts, fingerprint, rows."""
    fs, path = fsspec.core.url_to_fs(f"{spec.run_dir}/pipeline/prompts.json")
    return json.loads(fs.cat_file(path)) if fs.exists(path) else None


def check_prompts(spec: RunSpec, record: bool) -> int:
    """The number of training prompts, every row of them (and of the validation prompts) checked;
    refused in one line when an iteration would take more than there are, or when the dataset
    changed since the run first took rows of it. ``record``: remember the dataset, and the row
    index and check that the rollouts then find, in the run directory (a run, not a dry run)."""
    from llamarl.stages.prompts import Columns, check_dataset

    # A dry run writes nothing: it checks without keeping the index.
    index, columns = prompts_index(spec.run_dir) if record else None, Columns.of(spec.rollout)
    rows = check_dataset(spec.prompts, columns, index).rows
    if spec.validation is not None:
        check_dataset(spec.validation.prompts, columns, index)
    if spec.prompts_per_iteration is None:
        return rows
    before, now = recorded(spec), fingerprint(spec.prompts, checksums=True)
    # A run an older llamarl recorded hashed the prompts' modification times too.
    same = before is not None and before["prompts"] == spec.prompts and (
        before["fingerprint"] == now or before["fingerprint"] == fingerprint(spec.prompts, checksums=True, timed=True))
    if before is not None and not same:
        raise UserError(f"{spec.prompts}: the prompts changed since this run first took rows of them "
                        f"({before['prompts']}, {before['rows']} rows, fingerprint {before['fingerprint']}); its "
                        f"iterations would mix two datasets: restore them, or start a new run (another name)")
    if spec.prompts_per_iteration > rows:
        raise UserError(f"{spec.source}: prompts_per_iteration={spec.prompts_per_iteration} is more than the "
                        f"{rows} prompts in {spec.prompts}; lower it to at most {rows}")
    if record and before is None:
        publish.replace(f"{spec.run_dir}/pipeline/prompts.json",
                            json.dumps({"prompts": spec.prompts, "fingerprint": now, "rows": rows}).encode())
    return rows


def check_lr_schedule(spec: RunSpec, rows: int) -> None:
    """With ``ppo.lr_decay`` linear or cosine (to 0 at ``total_steps``), the run's last iteration
    still trains: each takes ``ppo_epochs × ⌈samples / mini_batch_size⌉`` optimizer steps of its
    rollout's ``rows × samples_per_prompt`` samples (fewer only where a response is empty, or
    with dynamic sampling, which this leaves to ppo), so iteration k starts at (k − 1) times that.
    Refused in one line naming ``ppo.total_steps`` before anything runs: ppo itself would refuse
    only when iteration k starts, hours in — and a new ``total_steps`` reschedules every step."""
    ppo = spec.ppo
    if ppo.lr_decay == "constant" or ppo.dynamic_sampling:
        return
    samples = (spec.prompts_per_iteration or rows) * spec.rollout.sampling.samples_per_prompt
    steps = ppo.ppo_epochs * -(-samples // ppo.mini_batch_size)
    if (spec.iterations - 1) * steps < ppo.total_steps:
        return
    dead = -(-ppo.total_steps // steps) + 1  # the first iteration whose every step comes at or after it
    which = f"iteration {dead}" if dead == spec.iterations else f"iterations {dead}–{spec.iterations}"
    raise UserError(f"{spec.source}: ppo.total_steps={ppo.total_steps}: lr_decay {ppo.lr_decay!r} brings the learning "
                    f"rate to 0 at that optimizer step, but each iteration takes {steps} ({ppo.ppo_epochs} epoch(s) of "
                    f"{samples} samples in mini-batches of {ppo.mini_batch_size}), so {which} would train nothing; set "
                    f"ppo.total_steps to {spec.iterations * steps} (the run's steps), or ppo.lr_decay: constant")


def check_storage(spec: RunSpec) -> None:
    """The run directory can live where the spec puts it, and so can its TensorBoard folder."""
    check_folder(spec.run_dir, spec.source, "storage", " (the run lives in STORAGE/NAME)")
    # A run makes pipeline/ before anything else (its lock): a folder with files and without it is
    # someone else's, whose files a run would write over.
    fs, path = publish.filesystem(spec.run_dir)
    if fs.isdir(path) and fs.ls(path, detail=False) and not fs.isdir(f"{path.rstrip('/')}/pipeline"):
        raise UserError(f"{spec.source}: {spec.run_dir} (STORAGE/NAME) holds files and is no llamarl run (no pipeline/ "
                        "in it), which the run would write over; change storage or name, or empty that folder")
    if spec.metrics.tensorboard is not None:
        check_folder(spec.metrics.tensorboard, spec.source, "metrics.tensorboard")


def _up(folder: str) -> list[str]:
    """``folder`` and each folder above it, nearest first."""
    parts = folder.rstrip("/").split("/")
    return ["/".join(parts[:i]) or "/" for i in range(len(parts), 0, -1)]


def check_outside_outputs(url: str, source: str, field: str) -> None:
    """``url`` lies inside no published output (a folder of a rollout, a checkpoint, …): files a
    stage wrote there would sit among another stage's, which its manifest does not list."""
    fs, path = publish.filesystem(url)
    for parent in _up(path)[1:]:
        if fs.exists(f"{parent.rstrip('/')}/{publish.MANIFEST}"):
            where = parent if "file" in fs.protocol else fs.unstrip_protocol(parent)
            raise UserError(f"{source}: {field}: {url} lies inside the published output {where}; point {field} at a "
                            "folder outside it")


def check_folder(url: str, source: str, field: str, note: str = "") -> None:
    """A folder that can be made at ``url`` (the spec's ``field``): no file on its way and, on a
    local file system, one this user may write to (or may create). A one-line error naming it
    otherwise. (An object store is not probed: that would mean writing to it.)"""
    fs, folder = publish.filesystem(url)
    existing = next((p for p in _up(folder) if fs.exists(p)), None)
    if existing is not None and not fs.isdir(existing):
        raise UserError(f"{source}: {field}: {existing} is a file, not a folder; point {field} at a folder{note}")
    if "file" not in fs.protocol or existing is None:
        return
    for path in dict.fromkeys(p for p in (existing, folder, f"{folder}/pipeline") if os.path.isdir(p)):
        if not os.access(path, os.W_OK | os.X_OK):
            why = "read-only file system" if os.statvfs(path).f_flag & os.ST_RDONLY else "permission denied"
            raise UserError(f"{source}: {field}: cannot write to {path} ({why}); point {field} at a folder you can "
                            f"write to")
