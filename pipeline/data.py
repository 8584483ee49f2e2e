"""What each iteration of a run draws: its prompts and its random streams (docs/pipeline.md, "A
long run": the dataset across iterations, and random streams). Both are pure functions of the
run's seed, the iteration and the dataset's size: a rerun or a resume draws the same, and extending
``iterations`` draws the next.
"""

from __future__ import annotations

import hashlib

from llamarl.stages.config import PromptSelection

from .spec import RunSpec


def _derived(*parts: object) -> int:
    """A non-negative 63-bit seed from ``parts`` (stable across Python versions and platforms)."""
    digest = hashlib.sha256(":".join(map(str, ("llamarl", *parts))).encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


def iteration_seed(run_seed: int, iteration: int) -> int:
    """The sampling seed of iteration ``iteration``'s rollout."""
    return _derived("iteration", run_seed, iteration)


def validation_seed(run_seed: int) -> int:
    """The sampling seed of every validation rollout of the run: the validated actors differ, the
    noise they are compared under does not."""
    return _derived("validation", run_seed)


def prompts_index(run_dir: str) -> str:
    """Where a run's rollouts keep the prompts' row index (stages/prompts.py)."""
    return f"{run_dir}/pipeline/prompts-index"


def iteration_selection(spec: RunSpec, iteration: int) -> PromptSelection | None:
    """The rows iteration ``iteration`` (from 1) takes; None: every row (no prompts_per_iteration)."""
    if (count := spec.prompts_per_iteration) is None:
        return None
    return PromptSelection(seed=spec.seed, shuffle=spec.shuffle is not False,  # null: shuffled
                           start=(iteration - 1) * count, count=count)


def describe_position(select: PromptSelection, rows: int) -> str:
    """Where ``select`` lies in the stream of epochs of a dataset of ``rows`` rows, e.g. ``epoch 2,
    prompts 17–32 of 48`` or ``epochs 1–2, prompts 41–48 and 1–8 of 48``."""
    end = select.start + select.count - 1
    epoch, last_epoch = select.start // rows + 1, end // rows + 1
    first, last = select.start % rows + 1, end % rows + 1
    if epoch == last_epoch:
        return f"epoch {epoch}, prompts {first}–{last} of {rows}"
    return f"epochs {epoch}–{last_epoch}, prompts {first}–{rows} and 1–{last} of {rows}"
