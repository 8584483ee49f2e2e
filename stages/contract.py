"""The contract between stages, in one place: what their files hold (docs/formats.md). Below, a
section each: what each stage publishes (its manifest's ``kind``) and the facts a rollout's manifest
gives the stages after it, the rollout and scores columns, the Parquet parts, the checkpoint
manifest with its folders and HF side files, and ppo's outputs. When an output is current is
stages/identity.py's; dtype names (manifests say torch's own: ``bfloat16``) are lib/dtypes.py's.
Stages import this module and ``stages.config``, never each other.
"""

from __future__ import annotations

import io
import operator
import posixpath
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import fsspec

from llamarl.lib import dtypes
from llamarl.lib.model import hf_mapping
from llamarl.lib.files import outputs, publish
from llamarl.lib.model.config import LlamaConfig
from llamarl.lib.errors import UserError

if TYPE_CHECKING:
    import pyarrow as pa
    import pyarrow.parquet as pq

# No pyarrow at import: the pipeline reads this module's names to check a spec, and pyarrow is
# imported where a part is built, read or written.

# ---- what each stage publishes: the manifest's kind ------------------------------------------------------

CHECKPOINT = "checkpoint"  # shard, and each role ppo updates
ROLLOUT = "rollout"
SCORES = "scores"
PPO = "ppo"
HF_EXPORT = "hf_export"
TRAIN_STATE = "train_state"  # ppo: a role's optimizer state, published apart from (and after) its weights


@dataclass(frozen=True)
class RolloutFacts:
    """What a rollout's manifest tells the stages after it: the actor it sampled from (its location
    and output id) and how (``temperature``, ``max_new_tokens``; None where an older manifest does
    not say)."""

    url: str
    actor: str
    actor_id: str
    temperature: float | None
    max_new_tokens: int | None

    @classmethod
    def read(cls, url: str, manifest: dict) -> RolloutFacts:
        request = manifest["request"]
        sampling = request.get("config", {}).get("sampling", {})
        return cls(url, request["actor"], request["actor_id"], sampling.get("temperature"),
                   sampling.get("max_new_tokens"))

    def check_temperature(self, temperature: float, reader: str) -> None:
        """Refuse, in one line, a reader (``reader``: its output) that takes the rollout's log-probs
        at another temperature than they were sampled at; greedy samples (0) have no temperature."""
        if self.temperature and self.temperature != temperature:
            raise UserError(f"{reader}: temperature={temperature} differs from {self.url}/{publish.MANIFEST}, "
                            f"sampled at temperature={self.temperature}: the log-probs ppo trains on are of the "
                            f"rollout's temperature; set ppo's temperature to {self.temperature}")


# ---- rollout columns: one row per (prompt, sample) ----------------------------------------------------

PROMPT_ID = "prompt_id"
SAMPLE_INDEX = "sample_index"
PROMPT = "prompt"
PROMPT_TOKEN_IDS = "prompt_token_ids"
RESPONSE = "response"
RESPONSE_TOKEN_IDS = "response_token_ids"
RESPONSE_LOGPROBS = "response_logprobs"
FINISH_REASON = "finish_reason"
ROLLOUT_COLUMNS = (PROMPT_ID, SAMPLE_INDEX, PROMPT, PROMPT_TOKEN_IDS, RESPONSE, RESPONSE_TOKEN_IDS, RESPONSE_LOGPROBS,
                   FINISH_REASON)
"""The columns every rollout part has, in this order; then the prompts' ``keep_columns``, as they were."""


def rollout_table(columns: dict[str, list], keep: dict[str, list], metadata: dict[str, str]) -> pa.Table:
    """A rollout part: ``columns``, those of ``ROLLOUT_COLUMNS`` with their types, then the kept
    prompt columns (their types inferred), with ``metadata`` (actor, sampling, …) in the Parquet schema."""
    import pyarrow as pa

    types = (pa.string(), pa.int32(), pa.string(), pa.list_(pa.int32()), pa.string(), pa.list_(pa.int32()),
             pa.list_(pa.float32()), pa.string())
    table = pa.Table.from_pydict(columns, schema=pa.schema(list(zip(ROLLOUT_COLUMNS, types))))
    for name, values in keep.items():
        table = table.append_column(name, pa.array(values))
    return table.replace_schema_metadata({k.encode(): v.encode() for k, v in metadata.items()})


# ---- scores columns: one row per rollout row -------------------------------------------------------------

SCORE = "score"
RM_ID = "rm_id"
KEY = (PROMPT_ID, SAMPLE_INDEX)  # joins a scores row with its rollout row
row_key = operator.itemgetter(*KEY)  # a row's KEY values, as a tuple


def term_column(term: str) -> str:
    """The column of one reward term's (unweighted) score: ``score_rm``, ``score_exact_match``, …"""
    return f"{SCORE}_{term}"


def scores_table(rows: list[dict], total: list[float], terms: dict[str, list[float]], rm_id: str | None) -> pa.Table:
    """A scores part: the key of each rollout row, its ``total`` and each term's score."""
    import pyarrow as pa

    data = {PROMPT_ID: [r[PROMPT_ID] for r in rows], SAMPLE_INDEX: [r[SAMPLE_INDEX] for r in rows], SCORE: total,
            **{term_column(t): v for t, v in terms.items()}, RM_ID: [rm_id] * len(rows)}
    # sample_index is int64 here (int32 in the rollout) and rm_id has Arrow's null type when there
    # is no reward model: the format scores parts have always had, kept so old and new parts agree.
    schema = pa.schema([(PROMPT_ID, pa.string()), (SAMPLE_INDEX, pa.int64()), (SCORE, pa.float32())]
                       + [(term_column(t), pa.float32()) for t in terms]
                       + [(RM_ID, pa.string() if rm_id is not None else pa.null())])
    return pa.Table.from_pydict(data, schema=schema)


# ---- parts ------------------------------------------------------------------------------------------------

PARTS = "parts"


def part_name(index: int) -> str:
    return f"part-{index:06d}.parquet"


def published_parts(root: str) -> list[str]:
    """Names of the parts already published under ``root`` (none when it has no parts yet)."""
    fs, path = fsspec.core.url_to_fs(root)
    if not fs.exists(f"{path}/{PARTS}"):
        return []
    return sorted(n for n in (p.rsplit("/", 1)[-1] for p in fs.ls(f"{path}/{PARTS}", detail=False)) if n.endswith(".parquet"))


def write_part(root: str, name: str, table: pa.Table) -> None:
    """Publish one part: written under a temporary name, then renamed, so it appears whole or not at all."""
    import pyarrow.parquet as pq

    buf = io.BytesIO()
    pq.write_table(table, buf)
    fs, path = fsspec.core.url_to_fs(root)
    fs.makedirs(f"{path}/{PARTS}", exist_ok=True)
    tmp = f"{path}/{PARTS}/.{name}.tmp"
    fs.pipe_file(tmp, buf.getvalue())
    fs.mv(tmp, f"{path}/{PARTS}/{name}")


def manifest_parts(manifest: dict) -> list[str]:
    """Names of the parts a published output's manifest lists, in order."""
    return sorted(k.removeprefix(f"{PARTS}/") for k in manifest["files"] if k.startswith(f"{PARTS}/"))


def part_entries(root: str, names: list[str]) -> dict[str, dict[str, Any]]:
    return {f"{PARTS}/{n}": publish.file_entry(f"{root}/{PARTS}/{n}") for n in names}


def read_part(root: str, name: str, columns: list[str] | None = None) -> pa.Table:
    import pyarrow.parquet as pq

    fs, path = fsspec.core.url_to_fs(root)
    with fs.open(f"{path}/{PARTS}/{name}", "rb") as f:
        return pq.read_table(f, columns=columns)


def part_metadata(root: str, name: str) -> pq.FileMetaData:
    """A part's Parquet footer: its rows (``num_rows``) and schema, no data read."""
    import pyarrow.parquet as pq

    fs, path = fsspec.core.url_to_fs(root)
    with fs.open(f"{path}/{PARTS}/{name}", "rb") as f:
        return pq.read_metadata(f)


def read_rows(root: str, manifest: dict) -> list[dict]:
    """Every row of a published output's parts, in part order."""
    return [row for name in manifest_parts(manifest) for row in read_part(root, name).to_pylist()]


# ---- checkpoints ------------------------------------------------------------------------------------------

MODEL = "model"  # the weights, a DCP checkpoint of HF-named tensors
OPTIM = "optim"  # the optimizer state (fp32 masters and moments), in checkpoints ppo writes
HF = "hf"

# Files copied from an HF checkpoint next to the weights: what later stages and export need.
SIDE_FILES = ("config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json",
              "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt", "added_tokens.json",
              "chat_template.jinja", "chat_template.json")


def copy_side_files(src: str, names: Iterable[str], dst: str) -> dict[str, dict[str, Any]]:
    """Copy ``src/name`` to ``dst/name`` for each name that exists; returns their manifest entries.
    Rank 0's job: side files are small."""
    fs, path = fsspec.core.url_to_fs(src)
    return {name: publish.write_bytes(f"{dst}/{name}", fs.cat_file(f"{path}/{name}")) for name in names
            if fs.exists(f"{path}/{name}")}


# What one role's checkpoint must hold to serve it: its head, and what the message offers as the fix.
HEADS = {"lm": "a causal LM (an HF LlamaForCausalLM, sharded)",
         "score": "a score head (an HF LlamaForSequenceClassification with num_labels=1, sharded)"}


def require_checkpoint(url: str, head: str, role: str, like: tuple[str, dict] | None = None) -> dict:
    """The manifest of the published checkpoint ``url``; refused in one line unless its head is
    ``head``, what ``role`` (the actor, a reward model, …) needs, and, given ``like`` (another
    checkpoint's url and manifest), unless it is of that one's model."""
    manifest = publish.require_published(url, CHECKPOINT)
    if manifest["head"] != head:
        raise UserError(f"{url} has a {manifest['head']!r} head; {role} needs {HEADS[head]}")
    if like is not None and manifest["model_config"] != like[1]["model_config"]:
        raise UserError(f"{url}: {role} is not of the model of {like[0]}; point it at a checkpoint of that model")
    return manifest


def hf_side_files(manifest: dict) -> list[str]:
    return sorted(k.removeprefix(f"{HF}/") for k in manifest["files"] if k.startswith(f"{HF}/"))


def checkpoint_manifest(model_cfg: LlamaConfig, head: str, dtype, hf_config: dict, source: dict,
                        files: dict, topo, **extra: Any) -> dict:
    """The manifest of a checkpoint written at the layout ``topo`` (anything with ``tp`` and ``pp``);
    ``dtype``: torch's or its name; ``source``: ``{url, files}`` of the HF checkpoint the weights
    come from (ppo's carry their actor's along); ``extra``: what only one writer knows (shard's
    ``ranks``, ppo's ``train_state``)."""
    return {"kind": CHECKPOINT, "head": head, "dtype": dtype if isinstance(dtype, str) else dtypes.name(dtype),
            "model_config": model_cfg.to_dict(),
            "hf_config": hf_config, "written_layout": {"tp": topo.tp, "pp": topo.pp},
            "tensors": {n: list(s) for n, s in hf_mapping.hf_shapes(model_cfg, head).items()},
            "source": source, "files": files, "timing": outputs.timing(), **extra}


def has_optimizer_state(manifest: dict) -> bool:
    """Whether a checkpoint holds its optimizer state inside (``optim/``: the older layout, still read)."""
    return any(k.startswith(f"{OPTIM}/") for k in manifest["files"])


# ---- a role's training state: published apart from, and after, its weights (docs/formats.md) ----------------
# The checkpoint's manifest says where it is (``train_state: {step, url}``, the url relative to the
# checkpoint, so a copied ppo output keeps working); the state's manifest names its weights' id.


def resolve(root: str, relative: str) -> str:
    """``relative`` (``../train_state/actor``) taken from the directory ``root``, at any fsspec URL."""
    scheme, sep, path = root.rstrip("/").rpartition("://")
    joined = posixpath.normpath(posixpath.join(path, relative))
    return f"{scheme}{sep}{joined}" if sep else joined


def train_state_pointer(role: str, step: int) -> dict:
    """What a role's checkpoint manifest says of its training state: the optimizer steps behind
    the weights, and where the state is (ppo's ``OUT/train_state/<role>``, from ``OUT/<role>``)."""
    return {"step": step, "url": f"../{TRAIN_STATE}/{role}"}


def train_state_manifest(role: str, step: int, checkpoint_id: str, files: dict) -> dict:
    return {"kind": TRAIN_STATE, "role": role, "step": step, "checkpoint_id": checkpoint_id, "files": files,
            "timing": outputs.timing()}


def require_train_state(url: str, manifest: dict, unwritten_ok: bool = False) -> tuple[str, dict] | None:
    """(its URL, its manifest) of the published training state of the checkpoint ``url``, or None
    when the state is inside the checkpoint (older ppo) or there is none (shard: step 0). Refused in
    one line when it is missing, unfinished or not of these weights; or published as not written
    (``publish.unwritten``: its ppo left it in memory), unless ``unwritten_ok`` — the reader's,
    then, to take it from memory or refuse. Sizes and checksums are the reader's to verify
    (``outputs.verify_input``, over its ranks)."""
    pointer = manifest.get("train_state") or {}
    if has_optimizer_state(manifest) or not pointer.get("url"):
        return None
    state = resolve(url, pointer["url"])
    fs, path = fsspec.core.url_to_fs(state)
    if not fs.exists(path) and not _unfinished(resolve(url, "..")):
        raise UserError(f"{state} does not exist: {url} says its training state is there; copy the whole ppo "
                        f"output, not only {url.rstrip('/').rsplit('/', 1)[-1]}/, or rerun the ppo stage that wrote it")
    if not fs.exists(path):
        raise UserError(f"{state} does not exist yet: the ppo stage writing {url} stopped after its weights; "
                        f"{redo_train_state(url)}")
    if publish.unwritten(state):
        if not unwritten_ok:
            raise UserError(unwritten_train_state(state))
        found = publish.read_manifest(state)
    else:
        try:
            found = publish.require_published(state, TRAIN_STATE)
        except UserError as e:
            raise UserError(f"{str(e).split('; ')[0]}: the training state of {url} is not whole; "
                            f"{redo_train_state(url)}") from None
    if found.get("step") != pointer["step"] or found.get("checkpoint_id") != publish.output_id(url):
        raise UserError(f"{state} is the training state of other weights than {url} (step {found.get('step')}, "
                        f"checkpoint {found.get('checkpoint_id')}); {redo_train_state(url)}")
    return state, found


def _unfinished(root: str) -> bool:
    fs, path = fsspec.core.url_to_fs(root)
    return fs.exists(f"{path}/{publish.INCOMPLETE}") and not fs.exists(f"{path}/{publish.MANIFEST}")


def unwritten_train_state(state: str) -> str:
    """The one line of a reader that needs the training state ``state``, which its ppo did not write."""
    return (f"{state} was not written: its ppo left it in its run's resident workers, for the next ppo "
            "(retention.train_state_every); rerun `llamarl run`, which makes it again from the newest training "
            "state written")


def redo_train_state(url: str) -> str:
    """The fix for a missing or damaged training state of ppo's checkpoint ``url``: that ppo
    again, which rewrites its whole output (deleted first when it was published, or it is skipped)."""
    out = resolve(url, "..")
    if _unfinished(out):
        return f"rerun the ppo stage that writes {out} (it writes it again, whole)"
    return f"delete {out} and rerun the ppo stage that wrote it"


# ---- ppo's output: one checkpoint per role, its training state, and the step metrics ------------------------
# OUT/<role>/ (weights), then OUT/train_state/<role>/, then OUT/metrics.jsonl and OUT's manifest.

ACTOR = "actor"
CRITIC = "critic"
METRICS = "metrics.jsonl"
STATE = ".state"  # while ppo runs: its resumable training states, STATE/step-NNNNNN, each whole once done.json is


def saved_step(out: str) -> int:
    """The optimizer step of the latest whole training state a ppo saved in ``out`` (0: none)."""
    fs, path = fsspec.core.url_to_fs(out)
    if not fs.exists(f"{path}/{STATE}"):
        return 0
    return max((int(p.rstrip("/").rsplit("-", 1)[-1]) for p in fs.ls(f"{path}/{STATE}", detail=False)
                if fs.exists(f"{p}/done.json")), default=0)

