"""The stage DAG of a run spec (docs/pipeline.md draws it), and a spec checked whole.

Each node is one stage run: its config built from the spec, its inputs (upstream nodes) and where
it writes in the run directory. Validation nodes read an actor and feed nothing but the metrics:
no training stage waits for them. ``load_spec`` checks a spec whole, in one line before any stage
starts, without importing torch (docs/pipeline.md, "Configs are validated whole").
"""

from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import Callable

from llamarl.cluster.kinds import validate_options
from llamarl.lib.files import publish, yamlfile
from llamarl.lib.errors import UserError, unreadable
from llamarl.lib.options import Source, validate
from llamarl.stages.identity import Declared, declare
from llamarl.stages.config import (ExportConfig, PPOConfig, RolloutConfig, ScoreConfig, ShardConfig, StageConfig,
                                   beyond_vocab, processes)

from . import data
from .monitor import check_installed
from .spec import RunSpec, StageLayout

TRAIN, VALIDATE = "train", "validate"


@dataclass
class Node:
    name: str  # e.g. "iter-002/ppo"
    stage: str  # module under llamarl.stages
    out: str
    inputs: list[str]  # upstream node names
    layout: StageLayout
    make_config: Callable[[], StageConfig]
    # The part of an input's output that this stage reads, when only a part: {input node: sub-path},
    # e.g. {"iter-001/ppo": "actor"}. It is what the key names, and the stage may start once it is
    # published, before the input's stage ends.
    reads: dict[str, str] = dataclasses.field(default_factory=dict)
    role: str = TRAIN  # validate: a validation stage, which nothing downstream waits for
    iteration: int | None = None

    @property
    def nprocs(self) -> int:
        return processes(self.layout)

    @functools.cached_property
    def declared(self) -> Declared:
        """What the stage reads and what names its output, as the stage itself declares it."""
        return declare(self.make_config())


def actor_dir(run: str, node: str) -> str:
    """The actor weights a node's output holds: the shard itself, or a ppo's ``actor/``."""
    return f"{run}/{node}" if node == "shard/actor" else f"{run}/{node}/actor"


def _actor_only(node: str) -> dict[str, str]:
    """A ppo's actor/ is published before its training state: a stage that reads only the weights
    (rollout, export, validation) need not wait for the rest."""
    return {} if node == "shard/actor" else {node: "actor"}


def build_dag(spec: RunSpec) -> list[Node]:
    """The stages of ``spec`` in an order that respects their dependencies (validation right
    after the ppo it validates: first in line when there is room for it)."""
    run, L = spec.run_dir, spec.layout

    def cfg(cls, options, where: str, **wired):
        return lambda: spec.stage_config(cls, options, where, **wired)

    nodes = [Node(name, "shard", f"{run}/{name}", [], L.shard,
                  cfg(ShardConfig, {}, "shard", src=src, dst=f"{run}/{name}", tp=L.shard.tp, pp=L.shard.pp))
             for name, src in (("shard/actor", spec.actor), ("shard/rm", spec.reward_model)) if src]
    actor, critic = "shard/actor", None
    trained = ["shard/actor"]  # trained[k]: the actor after k ppo updates
    for i in range(1, spec.iterations + 1):
        it = f"iter-{i:03d}"
        ro, sc, po = f"{it}/rollout", f"{it}/scores", f"{it}/ppo"
        # With staleness s, rollout i samples from the actor of ppo i-1-s, so it need not wait for
        # ppo i-1 … i-s: those run while it does.
        sampler = trained[max(0, i - 1 - spec.max_staleness)]
        score = _score_node(spec, sc, ro, spec.score.model_dump(), "score", i)
        nodes.append(Node(ro, "rollout", f"{run}/{ro}", [sampler], L.rollout,
                          cfg(RolloutConfig, _rollout_options(spec, i), "rollout", actor=actor_dir(run, sampler),
                              prompts=spec.prompts, out=f"{run}/{ro}", tp=L.rollout.tp, dp=L.rollout.dp,
                              scores=_rules_only(score), **_selection(spec, i)),
                          reads=_actor_only(sampler), iteration=i))
        nodes.append(score)
        critic_dir = f"{run}/{critic}/critic" if critic else None
        stale = {"off_policy": True} if sampler != actor else {}  # its samples are an older actor's
        nodes.append(Node(po, "ppo", f"{run}/{po}", [ro, sc, actor, "shard/actor"] + ([critic] if critic else []), L.ppo,
                          cfg(PPOConfig, spec.ppo, "ppo", rollout=f"{run}/{ro}", scores=f"{run}/{sc}",
                              actor=actor_dir(run, actor), reference=f"{run}/shard/actor", critic=critic_dir,
                              out=f"{run}/{po}", tp=L.ppo.tp, pp=L.ppo.pp, dp=L.ppo.dp,
                              write_train_state=writes_train_state(spec, i), **stale), iteration=i))
        if spec.validation and (i % spec.validation.every == 0 or i == spec.iterations):
            nodes += _validation_nodes(spec, i, po)
        # GRPO trains no critic: the next iteration starts its own only if it needs one.
        actor, critic = po, (po if spec.ppo.advantage == "gae" else None)
        trained.append(po)
    nodes.append(Node("export", "export", f"{run}/export", [actor], L.export,
                      cfg(ExportConfig, spec.export, "export", src=actor_dir(run, actor), dst=f"{run}/export",
                          procs=L.export.procs), reads=_actor_only(actor)))
    return nodes


def writes_train_state(spec: RunSpec, iteration: int) -> bool:
    """Whether iteration ``iteration``'s ppo writes its training state (retention.train_state_every):
    every N-th does, and the last (a longer run later starts from it)."""
    return iteration % spec.retention.train_state_every == 0 or iteration == spec.iterations


def _rollout_options(spec: RunSpec, iteration: int) -> dict:
    """The spec's rollout options with iteration ``iteration``'s own sampling seed."""
    options = spec.rollout.model_dump()
    options["sampling"]["seed"] = data.iteration_seed(spec.seed, iteration)
    return options


def _selection(spec: RunSpec, iteration: int) -> dict:
    select = data.iteration_selection(spec, iteration)
    if select is None:
        return {}
    return {"select": select.model_dump(), "index_cache": data.prompts_index(spec.run_dir)}


def _score_node(spec: RunSpec, name: str, rollout: str, options: dict, where: str, iteration: int,
                role: str = TRAIN) -> Node:
    run, L = spec.run_dir, spec.layout
    rm = {"reward_model": f"{run}/shard/rm"} if spec.reward_model else {}
    return Node(name, "score", f"{run}/{name}", [rollout] + (["shard/rm"] if spec.reward_model else []), L.score,
                lambda: spec.stage_config(ScoreConfig, options, where, rollout=f"{run}/{rollout}", out=f"{run}/{name}",
                                          tp=L.score.tp, pp=L.score.pp, dp=L.score.dp, **rm),
                role=role, iteration=iteration)


def _rules_only(score: Node) -> ScoreConfig | None:
    """The score config for its rollout to score itself (``RolloutConfig.scores``): when no term
    needs the reward model, the rules run in the rollout's processes and no score process starts."""
    cfg = score.make_config()
    return None if cfg.uses_rm() else cfg


def _validation_nodes(spec: RunSpec, i: int, ppo: str) -> list[Node]:
    """The validation of the actor ppo ``ppo`` wrote: its rollout of the validation prompts, scored."""
    run, L, v = spec.run_dir, spec.layout, spec.validation
    it = f"iter-{i:03d}"
    ro, sc = f"{it}/val-rollout", f"{it}/val-scores"
    options = spec.rollout.model_dump()
    overrides = {k: x for k, x in v.sampling.model_dump().items() if x is not None}
    options["sampling"] = options["sampling"] | overrides | {"seed": data.validation_seed(spec.seed)}
    score_options = spec.score.model_dump()
    score_options["rewards"] = [t.model_dump() for t in v.rewards] if v.rewards else score_options["rewards"]
    score_options["references"] = v.references
    score = _score_node(spec, sc, ro, score_options, "validation", i, role=VALIDATE)
    rollout = Node(ro, "rollout", f"{run}/{ro}", [ppo], L.rollout,
                   lambda: spec.stage_config(RolloutConfig, options, "validation", actor=actor_dir(run, ppo),
                                             prompts=v.prompts, out=f"{run}/{ro}", tp=L.rollout.tp, dp=L.rollout.dp,
                                             scores=_rules_only(score)),
                   reads=_actor_only(ppo), role=VALIDATE, iteration=i)
    return [rollout, score]


def may_run_beside(nodes: list[Node], shown: int = 4) -> dict[str, str]:
    """For each stage, in words, the stages that neither need its output nor make what it needs,
    shards aside; at most ``shown`` named, then how many more (a validation of a long run may run
    beside thousands). Sets of stages are bits of one integer: n²/64 word operations, not n² set
    lookups."""
    bit = {n.name: 1 << i for i, n in enumerate(nodes)}
    up, down = {}, dict.fromkeys(bit, 0)
    for n in nodes:  # in DAG order: a node's inputs come first
        up[n.name] = 0
        for i in n.inputs:
            up[n.name] |= bit[i] | up[i]
    for n in reversed(nodes):
        for i in n.inputs:
            down[i] |= bit[n.name] | down[n.name]
    others = ((1 << len(nodes)) - 1) & ~sum(bit[n.name] for n in nodes if n.stage == "shard")
    words = {}
    for n in nodes:
        mask = 0 if n.stage == "shard" else others & ~(bit[n.name] | up[n.name] | down[n.name])
        count, names = mask.bit_count(), []
        while mask and len(names) < (shown if count <= shown else shown - 1):
            low = mask & -mask
            names.append(nodes[low.bit_length() - 1].name)
            mask ^= low
        words[n.name] = ", ".join(names) + (f" and {count - len(names)} more" if count > len(names) else "")
    return words


def early_parts(nodes: list[Node]) -> dict[str, set[str]]:
    """For each node, the parts of its output that other nodes read before it ends."""
    parts: dict[str, set[str]] = {}
    for n in nodes:
        for name, sub in n.reads.items():
            parts.setdefault(name, set()).add(sub)
    return parts


def check_spec(spec: RunSpec) -> list[Node]:
    """The DAG, with every stage's config of every iteration built (validated) — before anything runs."""
    nodes = build_dag(spec)
    for n in nodes:
        n.make_config()
    return nodes


def check_models(spec: RunSpec) -> None:
    """Each stage's tp and pp, and the sampling, against the ``config.json`` of the actor and
    reward model where they exist (plain HF folders): the check a stage makes when it starts, hours
    later (lib/model/config.py, torch-free)."""
    L = spec.layout
    uses_rm = any(t.name == "rm" for t in spec.score.rewards)
    models = {"actor": (spec.actor, [("shard", L.shard.tp, L.shard.pp, False), ("rollout", L.rollout.tp, 1, False),
                                     ("ppo", L.ppo.tp, L.ppo.pp, spec.ppo.sequence_parallel)]),
              "reward_model": (spec.reward_model, [("shard", L.shard.tp, L.shard.pp, False)]
                               + ([("score", L.score.tp, L.score.pp, False)] if uses_rm else []))}
    for key, (url, stages) in models.items():
        if not url:
            continue
        config_url = f"{url.rstrip('/')}/config.json"
        fs, path = publish.filesystem(config_url)
        if not fs.exists(path):
            continue  # not there yet (or not an HF folder): shard checks it when it starts
        from llamarl.lib.model.config import ConfigError, LlamaConfig, ParallelLayout

        try:
            model = LlamaConfig.from_json(config_url)
        except ConfigError as e:
            raise UserError(f"{spec.source}: {key}: {e}") from None
        for stage, tp, pp, sp in stages:
            try:
                ParallelLayout(tp=tp, pp=pp, sequence_parallel=sp).check(model)
            except ConfigError as e:
                raise UserError(f"{spec.source}: layout.{stage}: {e} (the {key.replace('_', ' ')}: {config_url})") from None
        if key == "actor":
            _check_sampling(spec, model, config_url)


def _check_sampling(spec: RunSpec, model, config_url: str) -> None:  # model: the actor's LlamaConfig
    """The rollout's and the validation's stop tokens within the actor's vocabulary (a token it
    cannot sample would never stop a response), then their max_new_tokens within its context."""
    samplings = [("rollout.sampling", spec.rollout.sampling)]
    if spec.validation:  # its fields left None take the rollout's
        samplings.append(("validation.sampling", spec.validation.sampling))
    for where, sampling in samplings:
        if (beyond := beyond_vocab(sampling.stop_token_ids, model.vocab_size)) is not None:
            i, token = beyond
            raise UserError(f"{spec.source}: {where}.stop_token_ids.{i}={token} is no token of the actor, whose "
                            f"vocabulary has {model.vocab_size} ({config_url}); give ids below {model.vocab_size}")
    for where, sampling in samplings:
        if (new := sampling.max_new_tokens) is not None and new >= model.max_position_embeddings:
            raise UserError(f"{spec.source}: {where}.max_new_tokens={new} leaves no room for a prompt within the "
                            f"actor's max_position_embeddings={model.max_position_embeddings} ({config_url}); lower it")


def check_columns(spec: RunSpec) -> None:
    """Each built-in rule's column (exact_match's ``answer``) among the columns the rollout writes:
    its own and ``rollout.keep_columns`` — or references to bring it (their columns are not read
    here). Otherwise a misspelt column fails the first score, after the first rollout."""
    from llamarl.stages.contract import ROLLOUT_COLUMNS

    v = spec.validation
    scored = [("score.rewards", spec.score.rewards, spec.score.references, "score.references")]
    if v is not None:  # a validation is scored with its own references, and by default with score's rewards
        scored.append(("validation.rewards" if v.rewards else "score.rewards", v.rewards or spec.score.rewards,
                       v.references, "validation.references"))
    have = [*ROLLOUT_COLUMNS, *spec.rollout.keep_columns]
    for where, terms, references, named in scored:
        for i, term in enumerate(terms):
            missing = next((c for c in term.columns() if c not in have), None)
            if missing is not None and references is None:
                raise UserError(f"{spec.source}: {where}.{i}: rule {term.name!r} reads column {missing!r}, which no row "
                                f"of the rollout has (rollout.keep_columns={spec.rollout.keep_columns!r}); keep it in "
                                f"rollout.keep_columns, or give {named} that have it")


def parse_spec(data_, source: str) -> RunSpec:
    """The spec in ``data_`` (read from ``source``), checked whole (docs/pipeline.md lists what, in this order)."""
    spec = validate(RunSpec, data_ if data_ is not None else {}, source)
    spec._source = source
    validate_options(spec.executor.kind, spec.executor.options, Source(source, at="executor.options"))
    check_installed(spec.metrics, source)
    check_spec(spec)
    check_columns(spec)
    check_models(spec)
    return spec


def load_spec(path: str) -> RunSpec:
    if not path:
        raise UserError("the run spec's path is empty; give the spec's YAML file")
    fs, local = publish.filesystem(path)
    try:
        with fs.open(local, "r") as f:
            loaded = yamlfile.load(f, path)
    except FileNotFoundError:
        raise UserError(f"{path}: no such run spec") from None
    except (OSError, UnicodeDecodeError) as e:  # a folder, no permission, not text
        raise UserError(f"{path}: cannot be read as a run spec ({unreadable(e)}); give the spec's YAML file") from None
    return parse_spec(loaded, path)
