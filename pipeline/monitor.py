"""The run's metrics rows, also to TensorBoard and W&B (the spec's ``metrics:``), from the driver:
docs/pipeline.md, "A long run", Monitoring. A row grows after it is first written (its validation
ends later), hence ``pipeline/monitor.json``: what each sink holds, so a point is sent again only
when its value changed."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import os
import re
import time
import uuid
from contextlib import suppress

import fsspec

from llamarl.lib.files import publish
from llamarl.lib.files.checksums import is_local
from llamarl.lib.errors import UserError, disk_full, unreadable

from .spec import MetricsSpec, RunSpec


def tag(key: str) -> str:
    """A metrics key as both sinks show it: ``val_pass@4`` → ``val/pass_at_4``, ``kl`` → ``train/kl``
    (TensorBoard takes letters, digits and ``-/_.`` in a name)."""
    name = f"val/{key.removeprefix('val_')}" if key.startswith("val_") else f"train/{key}"
    return re.sub(r"[^-/\w.]", "_", name.replace("@", "_at_"))


def points(rows: list[dict]) -> dict[str, dict[int, float]]:
    """{tag: {iteration: value}} of every finite number in ``rows``."""
    found: dict[str, dict[int, float]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "iteration" and isinstance(value, (int, float)) and not isinstance(value, bool) \
                    and math.isfinite(value):
                found.setdefault(tag(key), {})[row["iteration"]] = float(value)
    return found


def check_installed(metrics: MetricsSpec, source: str) -> None:
    """A spec naming a sink whose package is missing is refused in one line, before anything runs
    (found, not imported: tensorboardX imports torch, seconds of a spec's check)."""
    for field, package in (("tensorboard", "tensorboardX"), ("wandb", "wandb")):
        if getattr(metrics, field) is not None and importlib.util.find_spec(package) is None:
            raise UserError(f"{source}: metrics.{field} needs the {package} package, which is not installed; "
                            f"pip install {package}, or remove it")


def _changed_from(sent: dict, new: dict[str, dict[int, float]]) -> int | None:
    """The first iteration of which a point ``sent`` holds has another value now (the iteration ran
    again), or None."""
    return min((i for name, series in new.items() for i, v in series.items() if sent.get(f"{name}@{i}", v) != v),
               default=None)


def _unsent(sent: dict, new: dict[str, dict[int, float]]) -> list[tuple[int, str, float]]:
    """(iteration, tag, value) of the points of ``new`` that ``sent`` lacks or holds another value
    of, in iteration order; from now on in ``sent``."""
    unsent = sorted((i, name, v) for name, series in new.items() for i, v in series.items()
                    if sent.get(f"{name}@{i}") != v)
    sent.update((f"{name}@{i}", v) for i, name, v in unsent)
    return unsent


def _has_events(folder: str) -> bool:
    """Whether ``folder`` holds TensorBoard event files (on an object store: whether it exists)."""
    fs, path = fsspec.core.url_to_fs(folder)
    if not fs.exists(path):
        return False
    return not is_local(fs) or any(n.startswith("events.out.tfevents") for n in os.listdir(path))


class Monitor:
    """The sinks of one `llamarl run`: ``update(rows)`` after every change of the metrics rows."""

    def __init__(self, spec: RunSpec):
        self.spec, self.metrics = spec, spec.metrics
        self.state_url = f"{spec.run_dir}/pipeline/monitor.json"
        self._tb = self._wandb = None

    @property
    def active(self) -> bool:
        return self.metrics.tensorboard is not None or self.metrics.wandb is not None

    def update(self, rows: list[dict]) -> None:
        if not self.active:
            return
        fs, path = fsspec.core.url_to_fs(self.state_url)
        try:
            state = json.loads(fs.cat_file(path)) if fs.exists(path) else {}
        except (UnicodeDecodeError, ValueError):  # damaged: every sink is sent everything again
            state = {}
        new = points(rows)
        if self.metrics.tensorboard is not None:
            state["tensorboard"] = self._to_tensorboard(state.get("tensorboard"), new)
        if self.metrics.wandb is not None:
            logged = state.setdefault("wandb", {"id": None, "points": {}})
            run = self._wandb_run(logged)
            for i, found in itertools.groupby(_unsent(logged["points"], new), key=lambda p: p[0]):
                run.log({"iteration": i, **{name: value for _, name, value in found}})
        publish.replace(self.state_url, json.dumps(state, indent=1, sort_keys=True).encode())

    def _to_tensorboard(self, held: dict | None, new: dict[str, dict[int, float]]) -> dict:
        """Send what the folder lacks; what it holds afterwards (``{"dir", "points"}``). A folder the
        run has not written (another ``metrics.tensorboard``, or emptied) gets every point; a point
        whose iteration ran again makes TensorBoard forget that iteration and the ones after it
        (``purge_step``), which are sent again: one value a step, as ``metrics.jsonl`` has it."""
        folder = self.metrics.tensorboard
        if held is not None and "points" not in held:  # as an older llamarl kept it: the points alone
            held = {"dir": folder, "points": held}
        sent = held["points"] if held is not None and held.get("dir") == folder and _has_events(folder) else {}
        purge = _changed_from(sent, new)
        if purge is None and not sent and _has_events(folder):
            purge = min((i for series in new.values() for i in series), default=None)  # not ours: from the first
        if purge is not None:
            sent = {k: v for k, v in sent.items() if int(k.rpartition("@")[2]) < purge}
            self._close_tensorboard()
        unsent = _unsent(sent, new)
        try:
            if unsent:
                writer = self._tensorboard(purge)
                for i, name, value in unsent:
                    writer.add_scalar(name, value, i)
                writer.flush()
        except OSError as e:
            why = disk_full(e) or unreadable(e)
            raise UserError(f"metrics.tensorboard {folder}: cannot write there ({why}); free space there or point it "
                            f"at another folder, then rerun `llamarl run`: what is trained is kept, and the folder "
                            f"gets every point") from None
        return {"dir": folder, "points": sent}

    def _tensorboard(self, purge: int | None):
        if self._tb is None:
            from tensorboardX import SummaryWriter

            # A file of its own (TensorBoard reads every file of the folder): two drivers started
            # within a second would otherwise write to the same name. Named after the one before it,
            # whose points its purge step makes TensorBoard forget: TensorBoard reads the files in
            # the order of their names, and tensorboardX's name says only the second it was made in.
            self._tb = SummaryWriter(self.metrics.tensorboard, filename_suffix=f".{time.time_ns()}.{os.getpid()}",
                                     purge_step=purge)
        return self._tb

    def _close_tensorboard(self) -> None:
        if self._tb is not None:
            writer, self._tb = self._tb, None
            with suppress(OSError):  # every point is flushed as sent: a failure there was raised then
                writer.close()

    def _wandb_run(self, logged: dict):
        if self._wandb is None:
            import wandb

            w = self.metrics.wandb
            logged["id"] = logged["id"] or uuid.uuid4().hex[:8]  # a W&B run id: 8 lowercase letters and digits
            self._wandb = wandb.init(project=w.project, entity=w.entity, name=w.name or self.spec.name,
                                     id=logged["id"], resume="allow", mode=w.mode, tags=w.tags or None,
                                     config=self.spec.model_dump(mode="json"), dir=self._wandb_dir())
            self._wandb.define_metric("iteration")
            self._wandb.define_metric("*", step_metric="iteration")
        return self._wandb

    def _wandb_dir(self) -> str | None:
        """W&B's local files beside the run's records, where the run directory is local."""
        fs, path = fsspec.core.url_to_fs(f"{self.spec.run_dir}/pipeline")
        if "file" not in fs.protocol:
            return None
        fs.makedirs(path, exist_ok=True)
        return path

    def close(self) -> None:
        self._close_tensorboard()
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None
