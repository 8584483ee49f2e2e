"""Scoring a published rollout into a scores output: what the score stage and the rollout stage
share (the rollout runs it itself when every term is a rule: docs/formats.md, "Scores"). Either
way the parts and the manifest's ``request`` are the score stage's, and a term or a total that ppo
could not train on stops the stage before its part is written, naming the term and the row. Rules
run on the rows as read back from the published rollout parts: the very values the score stage reads.
"""

from __future__ import annotations

import math
import numbers
import time
from dataclasses import dataclass
from typing import Callable

import fsspec

from llamarl.lib.distributed import collectives
from llamarl.lib.errors import UserError
from llamarl.lib.files import outputs, publish
from llamarl.lib.rl import core as rl, rewards
from llamarl.stages import contract, identity, space
from llamarl.stages.config import RewardTerm, ScoreConfig

# The rollout columns score reads (rules may read more: the response, kept columns).
REQUIRED = (*contract.KEY, contract.PROMPT, contract.PROMPT_TOKEN_IDS, contract.RESPONSE_TOKEN_IDS)
FLOAT32_MAX = 3.4028234663852886e38  # the scores' columns are float32: torch.finfo(torch.float32).max
DONE = "already scored with this rollout, reward model and config"


# The reward model, loaded: collective over its ranks, each row's score (None off the last
# pipeline stage) and how many rows had their prompt cut.
RewardModel = Callable[[list[dict]], tuple[list[float] | None, int]]


@dataclass
class Scoring:
    """A scores output of ``cfg`` in the making: its rollout's manifest and parts, checked, its rules
    resolved and its references loaded."""

    cfg: ScoreConfig
    rollout: str
    out: str
    manifest: dict
    parts: list[str]
    rules: dict
    refs: dict | None
    opened: float  # when its inputs began to be checked: a guest's timing starts here

    @classmethod
    def open(cls, cfg: ScoreConfig) -> Scoring:
        """Every input, and room for the output (``space.check``), checked before anything is written
        (the rollout's files verified; columns, keys and references of every part): a ``UserError`` otherwise."""
        space.check(cfg)
        opened, rollout = time.time(), cfg.rollout.rstrip("/")
        manifest = publish.require_verified(rollout, contract.ROLLOUT, f"{contract.PARTS}/")
        parts = contract.manifest_parts(manifest)
        rules = {t.name: rewards.resolve(t.name) for t in cfg.rewards if t.name != "rm"}
        refs = _load_references(cfg.references) if cfg.references else None
        _check_inputs(cfg, rollout, parts, refs)
        return cls(cfg, rollout, cfg.out.rstrip("/"), manifest, parts, rules, refs, opened)

    def run(self, dp: int, dp_rank: int, writer: bool, load_rm: Callable[[], RewardModel] | None = None,
            guest: bool = False) -> None:
        """Collective: score every part not yet published, data-parallel group ``dp_rank`` of ``dp``
        taking every dp-th, the ``writer`` of each group writing; then rank 0 publishes. Skipped when
        the output is already published with this request. ``load_rm``: the reward model, loaded
        only when there is work for it. ``guest``: run in another stage's process (the rollout's),
        whose start is none of the scores' time: their manifest's timing is the scoring's own, from
        ``open``."""
        request = identity.declare(self.cfg).request()
        if identity.skip_if_current(self.out, request, DONE):
            return
        rm = load_rm() if load_rm is not None else None
        done = set(contract.published_parts(self.out))
        stats = {"parts": 0, "rows": 0, "truncated": 0, "skipped_parts": 0}
        # Rounds in lockstep: in round r, DP group g scores part r*dp + g. Every rank runs every
        # round and the ranks agree on errors after each, so nobody is left waiting in a collective.
        for r in range(-(-len(self.parts) // dp)):
            i = r * dp + dp_rank
            error = None
            if i < len(self.parts) and self.parts[i] in done:
                stats["skipped_parts"] += 1
            elif i < len(self.parts):
                error = self._score_part(self.parts[i], rm, request["rm_id"], writer, stats)
            collectives.check(error)
        all_stats = collectives.all_gather_object(stats if writer else None)
        if collectives.rank_world()[0] == 0:
            timing = {"process_start": self.opened, "work_start": self.opened, "work_end": time.time()} if guest else None
            self._publish(request, [s for s in all_stats if s], timing or outputs.timing())
        collectives.barrier()

    def _publish(self, request: dict, all_stats: list[dict], timing: dict) -> None:
        names = contract.published_parts(self.out)
        if len(names) != len(self.parts):
            raise RuntimeError(f"{self.out}: {len(names)} parts written, {len(self.parts)} expected")
        totals = {k: sum(s[k] for s in all_stats) for k in all_stats[0]}
        rows = self.manifest["rows"]
        publish.publish(self.out, {"kind": contract.SCORES, "timing": timing, "request": request,
                                   "files": contract.part_entries(self.out, names), "rows": rows,
                                   "terms": [t.model_dump() for t in self.cfg.rewards], "rm_id": request["rm_id"],
                                   "stats": totals})
        print(f"{self.out}: scored {rows} rows ({totals['truncated']} truncated for the RM)", flush=True)

    def _score_part(self, name: str, rm: RewardModel | None, rm_id: str | None, writer: bool, stats: dict) -> str | None:
        """Score the rollout part ``name`` and (the ``writer``) publish its scores part; the one-line
        error of a rule or a score that cannot be written, or None."""
        rows = contract.read_part(self.rollout, name).to_pylist()
        where = f"{self.rollout}/{contract.PARTS}/{name}"
        columns: dict[str, list[float]] = {}  # by term name
        if rm is not None:
            columns["rm"], truncated = rm(rows)
            stats["truncated"] += truncated
        for t in self.cfg.rewards:
            if t.name != "rm":
                columns[t.name], error = rule_scores(t, self.rules[t.name], rows, self.refs, where)
                if error is not None:
                    return error
        if not writer:
            return None
        total = [sum(t.weight * columns[t.name][j] for t in self.cfg.rewards) for j in range(len(rows))]
        why = unfit(rows, columns, self.cfg.rewards, total)
        if why is not None:
            return f"{where}: {why}; nothing was written for this part"
        contract.write_part(self.out, name, contract.scores_table(rows, total, columns, rm_id))
        stats["parts"] += 1
        stats["rows"] += len(rows)
        return None


def _load_references(url: str) -> dict[str, dict]:
    import pyarrow.dataset as pads

    fs, path = fsspec.core.url_to_fs(url)
    if not fs.exists(path):
        raise UserError(f"{url}: no such file; check the references path")
    fmt = "parquet" if path.endswith(".parquet") else "json"
    table = pads.dataset(path, format=fmt, filesystem=fs).to_table()
    if contract.PROMPT_ID not in table.column_names:
        raise UserError(f"{url}: needs a {contract.PROMPT_ID} column to be joined with the rollout")
    return {str(r[contract.PROMPT_ID]): r for r in table.to_pylist()}


def _check_inputs(cfg: ScoreConfig, rollout: str, parts: list[str], refs) -> None:
    """Columns, keys and references of every part, before any work (metadata and keys only)."""
    seen: set = set()
    for p in parts:
        missing = [c for c in REQUIRED if c not in contract.part_metadata(rollout, p).schema.to_arrow_schema().names]
        if missing:
            raise UserError(f"{rollout}/{contract.PARTS}/{p}: missing column(s) {', '.join(missing)}; "
                            "score reads rollout outputs")
        for k in contract.read_part(rollout, p, columns=list(contract.KEY)).to_pylist():
            key = contract.row_key(k)
            if key in seen:
                raise UserError(f"{rollout}: key {key} appears twice; the rollout is inconsistent, rerun it")
            seen.add(key)
            if refs is not None and k[contract.PROMPT_ID] not in refs:
                raise UserError(f"{cfg.references}: no row for {contract.PROMPT_ID} {k[contract.PROMPT_ID]!r} of the "
                                "rollout; every rollout prompt needs a reference")


def rule_scores(term: RewardTerm, fn, rows: list[dict], refs, where: str) -> tuple[list[float] | None, str | None]:
    """A rule's score of every row, or the one-line error of the first row it fails on (the rule
    raised, read a column the row lacks, or returned no number)."""
    out = []
    for row in rows:
        key = contract.row_key(row)
        try:
            value = fn(row.get(contract.RESPONSE) or "", {**(refs or {}).get(row[contract.PROMPT_ID], {}), **row}, **term.args)
        except KeyError as e:
            return None, (f"{where}: rule {term.name!r} reads column {e} that row {key} does not have; "
                          "bring it with rollout's keep_columns or score's references")
        except Exception as e:  # noqa: BLE001 - user code: its failure is the user's to fix
            return None, f"{where}: rule {term.name!r} failed on {key}: {type(e).__name__}: {e}"
        if not isinstance(value, numbers.Real):  # int, float, bool, numpy scalars
            return None, f"{where}: rule {term.name!r} returned {value!r} for {key}; a rule returns a number"
        try:
            out.append(float(value))
        except OverflowError:  # an int beyond any float: checked with the others (``unfit``)
            out.append(math.inf if value > 0 else -math.inf)
    return out, None


def unfit(rows: list[dict], columns: dict[str, list[float]], terms: list[RewardTerm], total: list[float]) -> str | None:
    """Why the first row that ppo could not train on cannot be written, naming its term: a term
    that is not a finite float32, or a total beyond ±``rl.MAX_ABS_SCORE``; None if every row fits."""
    def who(t: RewardTerm) -> str:
        return "the reward model ('rm')" if t.name == "rm" else f"rule {t.name!r}"

    for j, row in enumerate(rows):
        key = contract.row_key(row)
        for t in terms:
            if not abs(columns[t.name][j]) <= FLOAT32_MAX:
                return (f"{who(t)} scored {key} {columns[t.name][j]!r}: a score must be a finite number that "
                        f"float32 holds (its column {contract.term_column(t.name)}); fix the "
                        + ("reward model" if t.name == "rm" else "rule"))
        if not abs(total[j]) <= rl.MAX_ABS_SCORE:
            big = max(terms, key=lambda t: abs(t.weight * columns[t.name][j]))
            return (f"the score of {key} is {total[j]:g}, beyond ±{rl.MAX_ABS_SCORE:g}, where ppo's float32 arithmetic "
                    f"overflows (advantages, their whitening, the value loss); {who(big)} gives "
                    f"{big.weight:g} × {columns[big.name][j]:g} of it: scale it down (its weight) or bound its values")
    return None
