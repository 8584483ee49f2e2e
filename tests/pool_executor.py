"""An executor that runs each stage in a test's ``DistPool`` (processes already started, torch
imported): the stage's own ``run`` on its config, as a stage process would, in a fraction of a
process's start-up. A ``UserError`` comes back as the stage's one-line error and status 2."""

from __future__ import annotations

import importlib

from llamarl.cluster.executor import Executor, StageResult
from llamarl.lib.errors import EXIT_USER_ERROR


def run_stage(stage: str, config) -> tuple[int, str | None]:
    """What a stage process does with its config, minus leaving the pool's process group
    (importable: the pool pickles it by name)."""
    from llamarl.lib.errors import UserError

    try:
        importlib.import_module(f"llamarl.stages.{stage}").run(config)
    except UserError as e:
        return EXIT_USER_ERROR, str(e)
    return 0, None


class PoolExecutor(Executor):
    """Stages of one process each, in ``pool`` (a ``DistPool(1)``), one at a time."""

    def __init__(self, pool):
        self.pool, self.concurrency, self.ran = pool, 1, []

    def submit(self, stage, config, nprocs, nodes=1, *, name=None):
        assert nprocs == self.pool.world, f"{name}: {nprocs} processes, the pool has {self.pool.world}"
        self.ran.append(name)
        (code, error), *_ = self.pool.run(run_stage, stage, config)
        return StageResult(code, error) if code else StageResult(0)

    def wait(self, handle):
        return handle

    def render(self, stage, config, nprocs, nodes=1, *, name=None):
        return f"{name}: {stage} in the test's pool"

