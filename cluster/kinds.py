"""The executor kinds a spec names (``executor.kind``): each one's options model and class, imported
on demand, so that a spec naming one executor loads neither of the others."""

from __future__ import annotations

from typing import Callable

from pydantic import BaseModel

from llamarl.lib.errors import UserError

from .executor import Executor


KINDS = ("local", "slurm", "kubernetes")


def _classes(kind: str, source: str) -> tuple[type[BaseModel], Callable[..., Executor]]:
    if kind == "local":
        from .local import LocalOptions

        return LocalOptions, _local
    if kind == "slurm":
        from .slurm import SlurmExecutor, SlurmOptions

        return SlurmOptions, SlurmExecutor
    if kind == "kubernetes":
        from .kubernetes import KubernetesExecutor, KubernetesOptions

        return KubernetesOptions, KubernetesExecutor
    raise UserError(f"{source}: {kind!r} is no executor kind; use one of {', '.join(KINDS)}")


def _local(options, *, run_dir: str) -> Executor:
    """With ``resident``, the stages run in resident workers (cluster/resident.py)."""
    from .local import LocalExecutor
    from .resident import ResidentExecutor

    return (ResidentExecutor if options.resident else LocalExecutor)(options, run_dir=run_dir)


def validate_options(kind: str, options: dict, source: str) -> BaseModel:
    """The options of a ``kind`` executor, checked; otherwise a one-line UserError naming
    ``source`` (where the options are, e.g. ``spec.yaml: executor.options``) and the field."""
    from llamarl.lib.options import validate

    options_class, _ = _classes(kind, source)
    return validate(options_class, options, source)


def make_executor(kind: str, options: dict, run_dir: str, source: str) -> Executor:
    """The executor of ``kind`` with ``options`` for the run in ``run_dir`` (whose folders hold
    what the cluster executors write: ``pipeline/slurm``, ``pipeline/k8s``)."""
    _, make = _classes(kind, source)
    return make(validate_options(kind, options, source), run_dir=run_dir)
