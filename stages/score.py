"""Stage score: reward-model scores and rule-based rewards for each rollout row.

Run with tp × pp × dp processes (``llamarl stage score ROLLOUT OUT --rm RM``). Every rollout
part becomes one scores part (the unit of resumption), data-parallel groups taking every dp-th.

The reward model (``ParallelLlamaForScore``: a Llama with a one-label score head, sharded from an
HF ``LlamaForSequenceClassification``) reads prompt + response. When its tokenizer differs from
the actor's (by content: ``lib.tokenizer.fingerprint``), the response is decoded from the actor's
tokens and the conversation is encoded again with the RM's tokenizer and chat template; the
prompt is cut from the left to ``max_length``. With the same tokenizer the token ids are reused.
Between parts the RM's parameters wait in host memory (``offload``).

The total score is ``Σ weight × term`` over ``rewards`` (``rm`` or a rule of ``lib.rewards``).
Inputs are checked before anything is written. A term that is not a finite float32 (its column's
type), or a total beyond ±``rl.MAX_ABS_SCORE`` (where ppo's fp32 arithmetic overflows), stops the
stage before its part is written, naming the term and the row. Formats: docs/formats.md.
"""

from __future__ import annotations

import json
import math
import numbers
from dataclasses import dataclass

import fsspec
import torch
import torch.distributed as dist

from llamarl.lib.files import checkpoint, outputs, publish
from llamarl.lib.runtime import job
from llamarl.lib.distributed import collectives, parallel
from llamarl.lib.rl import core as rl, rewards
from llamarl.lib.model import schedule
from llamarl.lib.engine import tokenizer as toklib
from llamarl.lib.model.config import LlamaConfig, ParallelLayout, compute_dtype
from llamarl.lib.errors import UserError
from llamarl.lib.model.offload import ParamOffload
from llamarl.stages import contract, identity, space
from llamarl.stages.config import RewardTerm, ScoreConfig

# The rollout columns score reads (rules may read more: the response, kept columns).
REQUIRED = (*contract.KEY, contract.PROMPT, contract.PROMPT_TOKEN_IDS, contract.RESPONSE_TOKEN_IDS)
FLOAT32_MAX = float(torch.finfo(torch.float32).max)  # the scores' columns are float32


# ---- re-tokenization ---------------------------------------------------------------------------


def rm_inputs(rows: list[dict], actor_tok, rm_tok, max_length: int, chat_template: str = "auto") -> tuple[list[list[int]], int]:
    """RM token ids for each rollout row, and how many rows had their prompt cut."""
    same = toklib.fingerprint(actor_tok) == toklib.fingerprint(rm_tok)
    use_template = bool(getattr(rm_tok, "chat_template", None)) and chat_template != "never"
    out, truncated = [], 0
    for row in rows:
        if same:
            prompt, response = list(row[contract.PROMPT_TOKEN_IDS]), list(row[contract.RESPONSE_TOKEN_IDS])
        else:
            text = actor_tok.decode(row[contract.RESPONSE_TOKEN_IDS], skip_special_tokens=True)
            prompt, response = _encode_conversation(rm_tok, row[contract.PROMPT], text, use_template)
        if len(prompt) + len(response) > max_length:
            truncated += 1
            keep = max(max_length - len(response), 0)
            prompt = prompt[len(prompt) - keep:] if keep else []
            response = response[-max_length:]
        out.append(prompt + response)
    return out, truncated


def _encode_conversation(tok, prompt: str, response: str, use_template: bool) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids) as the RM's tokenizer makes them of the decoded conversation."""
    messages = _messages(prompt)
    if use_template:
        full = tok.apply_chat_template(messages + [{"role": "assistant", "content": response}], tokenize=False)
        head = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        ids = tok(full, add_special_tokens=False)["input_ids"]
        n = len(tok(head, add_special_tokens=False)["input_ids"]) if full.startswith(head) else 0
        return ids[:n], ids[n:]
    text = "\n".join(m["content"] for m in messages)
    p = tok(text, add_special_tokens=True)["input_ids"]
    return p, tok(response, add_special_tokens=False)["input_ids"]


def _messages(prompt: str) -> list[dict]:
    if prompt.startswith("["):
        try:
            value = json.loads(prompt)
            if isinstance(value, list) and all(isinstance(m, dict) and "content" in m for m in value):
                return value
        except json.JSONDecodeError:
            pass
    return [{"role": "user", "content": prompt}]


# ---- the reward model --------------------------------------------------------------------------


def score_sequences(model, seqs: list[list[int]], micro_batch: int, padding_side: str = "right") -> list[float] | None:
    """The RM's score for each sequence; None on ranks that are not the last pipeline stage."""
    dev = next(model.parameters()).device
    batches = []
    for i in range(0, len(seqs), micro_batch):
        group = seqs[i : i + micro_batch]
        width = max(len(s) for s in group)
        ids = torch.zeros(len(group), width, dtype=torch.long)
        mask = torch.zeros(len(group), width, dtype=torch.long)
        for j, s in enumerate(group):
            sl = slice(width - len(s), width) if padding_side == "left" else slice(0, len(s))
            ids[j, sl], mask[j, sl] = torch.tensor(s), 1
        batches.append(model.make_batch(ids.to(dev), mask.to(dev)))
    outs = schedule.forward(model, batches)
    if not model.topology.is_last_stage:
        return None
    return [float(x) for o in outs for x in o.float().cpu()]


# ---- the stage ---------------------------------------------------------------------------------


def _load_references(url: str) -> dict[str, dict]:
    import pyarrow.dataset as pads

    fs, path = fsspec.core.url_to_fs(url)
    if not fs.exists(path):
        raise UserError(f"{url}: no such file; check the references path")
    fmt = "parquet" if path.endswith(".parquet") else "json"
    table = pads.dataset(path, format=fmt, filesystem=fs).to_table()
    if contract.PROMPT_ID not in table.column_names:
        raise UserError(f"{url}: needs a {contract.PROMPT_ID} column to be joined with the rollout")
    rows = table.to_pylist()
    return {str(r[contract.PROMPT_ID]): r for r in rows}


def _check_inputs(cfg: ScoreConfig, rollout: str, parts: list[str], refs) -> None:
    """Columns, keys and references of every part, before any work (metadata and keys only)."""
    seen: set = set()
    for p in parts:
        missing = [c for c in REQUIRED if c not in contract.read_part_schema(rollout, p).names]
        if missing:
            raise UserError(f"{rollout}/{contract.PARTS}/{p}: missing column(s) {', '.join(missing)}; "
                            "score reads rollout outputs")
        for k in contract.read_part(rollout, p, columns=list(contract.KEY)).to_pylist():
            key = (k[contract.PROMPT_ID], k[contract.SAMPLE_INDEX])
            if key in seen:
                raise UserError(f"{rollout}: key {key} appears twice; the rollout is inconsistent, rerun it")
            seen.add(key)
            if refs is not None and k[contract.PROMPT_ID] not in refs:
                raise UserError(f"{cfg.references}: no row for {contract.PROMPT_ID} {k[contract.PROMPT_ID]!r} of the "
                                "rollout; every rollout prompt needs a reference")


def _rule_scores(term: RewardTerm, fn, rows: list[dict], refs, where: str) -> tuple[list[float] | None, str | None]:
    """A rule's score of every row, or the one-line error of the first row it fails on (the rule
    raised, read a column the row lacks, or returned no number)."""
    out = []
    for row in rows:
        key = (row[contract.PROMPT_ID], row[contract.SAMPLE_INDEX])
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
        except OverflowError:  # an int beyond any float: checked with the others (``_unfit``)
            out.append(math.inf if value > 0 else -math.inf)
    return out, None


def _unfit(rows: list[dict], columns: dict[str, list[float]], terms: list[RewardTerm], total: list[float]) -> str | None:
    """Why the first row that ppo could not train on cannot be written, naming its term: a term
    that is not a finite float32, or a total beyond ±``rl.MAX_ABS_SCORE``; None if every row fits."""
    def who(t: RewardTerm) -> str:
        return "the reward model ('rm')" if t.name == "rm" else f"rule {t.name!r}"

    for j, row in enumerate(rows):
        key = (row[contract.PROMPT_ID], row[contract.SAMPLE_INDEX])
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


@dataclass
class _RewardModel:
    """The reward model, loaded, with the tokenizers its inputs are made with."""

    cfg: ScoreConfig
    model: object
    offload: ParamOffload
    actor_tok: object
    rm_tok: object
    max_length: int

    @classmethod
    def load(cls, cfg: ScoreConfig, manifest: dict, actor: str, dtype) -> _RewardModel:
        """Collective: its files verified, its weights loaded; ``actor``: the rollout's actor, whose
        tokenizer made the responses."""
        from llamarl.lib.model.llama import ParallelLlamaForScore

        outputs.verify_input(cfg.reward_model, manifest, f"{contract.MODEL}/")
        rm_cfg = LlamaConfig.from_dict(manifest["model_config"])
        with torch.device(parallel.device()):
            model = ParallelLlamaForScore(rm_cfg, ParallelLayout(tp=cfg.tp, pp=cfg.pp, remove_padding=True), dtype=dtype)
        checkpoint.load_model(model, f"{cfg.reward_model}/{contract.MODEL}")
        model.eval()
        return cls(cfg, model, ParamOffload(model, parallel.device()), toklib.load(actor), toklib.load(cfg.reward_model),
                   cfg.max_length or rm_cfg.max_position_embeddings)

    def score(self, rows: list[dict]) -> tuple[list[float] | None, int]:
        """Collective over the model's ranks: each row's score (None off the last pipeline stage),
        and how many rows had their prompt cut."""
        seqs, truncated = rm_inputs(rows, self.actor_tok, self.rm_tok, self.max_length, self.cfg.chat_template)
        self.offload.to_device()
        scores = score_sequences(self.model, seqs, self.cfg.micro_batch)
        if self.cfg.offload:
            self.offload.to_host()
        return scores, truncated


def run(cfg: ScoreConfig) -> None:
    space.check(cfg)
    rollout, out = cfg.rollout.rstrip("/"), cfg.out.rstrip("/")
    manifest = publish.require_verified(rollout, contract.ROLLOUT, f"{contract.PARTS}/")
    parts = contract.manifest_parts(manifest)
    rules = {t.name: rewards.resolve(t.name) for t in cfg.rewards if t.name != "rm"}
    refs = _load_references(cfg.references) if cfg.references else None
    _check_inputs(cfg, rollout, parts, refs)
    rm_manifest = None
    if any(t.name == "rm" for t in cfg.rewards):
        rm_manifest = contract.require_checkpoint(cfg.reward_model, "score", "a reward model")
        ParallelLayout(tp=cfg.tp, pp=cfg.pp).check(LlamaConfig.from_dict(rm_manifest["model_config"]))

    topo = parallel.init(cfg.tp, cfg.pp, dp=cfg.dp, timeout_s=cfg.collective_timeout_s, stage="score")
    request = identity.declare(cfg).request()
    if identity.skip_if_current(out, request, "already scored with this rollout, reward model and config"):
        return
    rm = None
    if rm_manifest is not None:
        actor = contract.RolloutFacts.read(rollout, manifest).actor
        rm = _RewardModel.load(cfg, rm_manifest, actor, compute_dtype(cfg.dtype, parallel.device()))
    done = set(contract.published_parts(out))
    writer = topo.tp_rank == 0 and topo.is_last_stage
    stats = {"parts": 0, "rows": 0, "truncated": 0, "skipped_parts": 0}
    # Rounds in lockstep: in round r, DP group g scores part r*dp + g. Every rank runs every round
    # and the ranks agree on errors after each, so nobody is left waiting in a collective.
    for r in range(-(-len(parts) // topo.dp)):
        i = r * topo.dp + topo.dp_rank
        error = None
        if i < len(parts) and parts[i] in done:
            stats["skipped_parts"] += 1
        elif i < len(parts):
            error = _score_part(cfg, rollout, out, parts[i], rules, refs, rm, request["rm_id"], writer, stats)
        collectives.check(error)

    all_stats: list = [None] * dist.get_world_size()
    dist.all_gather_object(all_stats, stats if writer else None)
    if dist.get_rank() == 0:
        names = contract.published_parts(out)
        if len(names) != len(parts):
            raise RuntimeError(f"{out}: {len(names)} parts written, {len(parts)} expected")
        totals = {k: sum(s[k] for s in all_stats if s) for k in stats}
        publish.publish(out, {"kind": contract.SCORES, "timing": outputs.timing(), "request": request,
                              "files": contract.part_entries(out, names), "rows": manifest["rows"],
                              "terms": [t.model_dump() for t in cfg.rewards], "rm_id": request["rm_id"], "stats": totals})
        print(f"{out}: scored {manifest['rows']} rows ({totals['truncated']} truncated for the RM)", flush=True)
    dist.barrier()


def _score_part(cfg: ScoreConfig, rollout: str, out: str, name: str, rules: dict, refs, rm: _RewardModel | None,
                rm_id: str | None, writer: bool, stats: dict) -> str | None:
    """Score the rollout part ``name`` and (the ``writer``) publish its scores part; the one-line
    error of a rule or a score that cannot be written, or None."""
    rows = contract.read_part(rollout, name).to_pylist()
    where = f"{rollout}/{contract.PARTS}/{name}"
    columns: dict[str, list[float]] = {}  # by term name
    if rm is not None:
        columns["rm"], truncated = rm.score(rows)
        stats["truncated"] += truncated
    for t in cfg.rewards:
        if t.name != "rm":
            columns[t.name], error = _rule_scores(t, rules[t.name], rows, refs, where)
            if error is not None:
                return error
    if not writer:
        return None
    total = [sum(t.weight * columns[t.name][j] for t in cfg.rewards) for j in range(len(rows))]
    unfit = _unfit(rows, columns, cfg.rewards, total)
    if unfit is not None:
        return f"{where}: {unfit}; nothing was written for this part"
    contract.write_part(out, name, contract.scores_table(rows, total, columns, rm_id))
    stats["parts"] += 1
    stats["rows"] += len(rows)
    return None


if __name__ == "__main__":
    job.main(ScoreConfig, run)
