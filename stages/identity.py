"""What each stage reads and what names its output, declared once per stage (``declare``): its
inputs by role, what it reads from outside any run (which the pipeline fingerprints), where it
writes, and its identity (``StageConfig.identity``). Both views of "is this output current?" come
from it: the pipeline's key of a node (pipeline/records.py) and the stage's own ``request``,
recorded in its manifest and compared by a rerun (``skip_if_current``). No torch and no pyarrow:
the pipeline imports it.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from llamarl.lib.distributed import collectives
from llamarl.lib.files import outputs, publish

from . import contract
from .config import ExportConfig, PPOConfig, RolloutConfig, ScoreConfig, ShardConfig, StageConfig


@dataclass(frozen=True)
class Declared:
    """One stage run, as the files know it."""

    kind: str  # what it publishes: its manifest's kind
    out: str  # where
    identity: dict  # its config as it names the output: options and input locations
    inputs: dict[str, str | None] = field(default_factory=dict)  # published outputs it reads, by role (None: unused)
    external: tuple[str, ...] = ()  # what it reads from outside any run

    def request(self, **facts) -> dict:
        """What its manifest records, and a rerun compares, to say the output is current: the kind,
        each input's output id (``<role>_id``), the identity, and ``facts`` only the running stage
        knows (the sampler's version, the source's checksums)."""
        ids = {f"{role}_id": publish.output_id(url) if url else None for role, url in self.inputs.items()}
        return {"kind": self.kind, **ids, **facts, "config": self.identity}


def declare(cfg: StageConfig) -> Declared:
    c, identity = cfg, cfg.identity()
    if isinstance(c, ShardConfig):
        return Declared(contract.CHECKPOINT, c.dst, identity, external=(c.src,))
    if isinstance(c, RolloutConfig):
        return Declared(contract.ROLLOUT, c.out, identity, {"actor": c.actor}, external=(c.prompts,))
    if isinstance(c, ScoreConfig):
        return Declared(contract.SCORES, c.out, identity, {"rollout": c.rollout,
                                                           "rm": c.reward_model if c.uses_rm() else None})
    if isinstance(c, PPOConfig):
        critic = c.critic if c.advantage == "gae" else None  # only gae trains (and reads) a critic
        return Declared(contract.PPO, c.out, identity, {"actor": c.actor, "rollout": c.rollout, "scores": c.scores,
                                                        "reference": c.reference or c.actor, "critic": critic})
    if isinstance(c, ExportConfig):
        return Declared(contract.HF_EXPORT, c.dst, identity, {"src": c.src})
    raise TypeError(f"no declaration for {type(cfg).__name__}")


def skip_if_current(out: str, request: dict | None, done: str, recorded: dict | None = None) -> bool:
    """Collective: True when ``out`` already holds a published output of this ``request`` (rank 0
    says so: ``done``, "nothing to do"). Otherwise ``out`` is made ready for this run: resumed when
    it holds our unfinished output of the same ``request``, else emptied. A published output of
    another request is refused, never overwritten. ``recorded``: for a checkpoint or an export
    whose manifest holds no request (published before they recorded one), the manifest's own
    fields that must match instead."""

    def current(m: dict) -> bool:
        if "request" in m:
            return request is not None and m["request"] == request
        return recorded is not None and all(m.get(k) == v for k, v in recorded.items())

    if outputs.prepare_output(out, current, request) != "skip":
        return False
    if collectives.rank_world()[0] == 0:
        print(f"{out}: {done}, nothing to do", flush=True)
    return True
