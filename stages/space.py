"""Room on disk before a stage writes: what it will write, at most, against what its output's local
file system has free (an object store has none to ask), checked first in every stage's ``run()`` so
that a stage that cannot fit is refused in one line before it reads a weight. What each estimate
counts: docs/pipeline.md, "Free space before a stage writes".
"""

from __future__ import annotations

import math
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import fsspec

from llamarl.lib import dtypes
from llamarl.lib.runtime import job
from llamarl.lib.files import publish
from llamarl.lib.errors import UserError
from llamarl.stages import contract, identity
from llamarl.stages.config import (STAGES, ExportConfig, PPOConfig, RolloutConfig, ScoreConfig, ShardConfig,
                                   StageConfig, processes)

CHUNK_BYTES = 2 << 10  # a checkpoint chunk's own bytes: its torch.save records (~1 KiB), its .metadata entry (~0.3)
FOLDER_BYTES = 1 << 20  # a published folder's manifest and marker, its files' last partial blocks
PART_BYTES = 64 << 10  # a Parquet part's footer, schema and page headers
TENSOR_HEADER_BYTES = 512  # a tensor's entry in a safetensors header and in the index
ROW_BYTES = 256  # a rollout or score row's own columns: ids, sample index, finish reason, rm id
TEMPLATE_TOKENS = 256  # what a chat template may add around a prompt
TEXT_BYTES_PER_TOKEN = 16  # decoded response text (natural text: a few bytes a token)
STEP_BYTES = 2 << 10  # a line of ppo's metrics.jsonl


@dataclass(frozen=True)
class Need:
    bytes: int  # what the stage writes into its output, at most
    what: str  # the main parts, in words
    cleared: int = 0  # bytes of its unfinished output that the stage removes before writing


def check(cfg: StageConfig, defer: bool = False) -> Room:
    """Refuse, in one line, a stage whose output does not fit on its local file system. Where it
    fits only once the run's trash is deleted, wait for that now; with ``defer``, leave the check
    again and any wait to ``Room.wait``, which the stage calls before its first write (ppo, which
    writes only after its update or at its first ``save_every`` state, while the trash is deleted)."""
    out = identity.declare(cfg).out.rstrip("/")
    job.writes_to(out)
    fs, path = fsspec.core.url_to_fs(out)
    if "file" not in fs.protocol or publish.read_manifest(out) is not None:
        return Room(defer)
    try:
        need = _ESTIMATES[type(cfg)](cfg, path)
    except (UserError, OSError, KeyError, ValueError):
        return Room(defer)  # an input it cannot read: the stage's own checks say so, in their words
    where = next(str(p) for p in (Path(path), *Path(path).parents) if os.path.exists(p))  # where its bytes go
    if defer and (short := _short(need, where)) != "no":
        # Looked at again only where it waits for the trash: an estimate is an upper bound, and a
        # stage that fits now is not refused later for what a stage beside it wrote meanwhile.
        return Room(True, cfg if short == "wait" else None, out, where)
    if (error := _room(cfg, out, where, need)) is not None:
        raise UserError(error)
    return Room(defer)


def _short(need: Need, where: str) -> str | None:
    """Whether ``need`` fits at ``where``: None, "wait" (once the run's trash is deleted) or "no"."""
    free = shutil.disk_usage(where).free
    if need.bytes <= free + need.cleared:
        return None
    return "wait" if free + need.cleared + _being_deleted(where) >= need.bytes else "no"


def _room(cfg: StageConfig, out: str, where: str, need: Need) -> str | None:
    """None once ``need`` fits at ``where`` (waiting for the trash where it frees enough), else the refusal."""
    if _short(need, where) == "wait":
        _free_once_deleted(out, where, need.bytes - need.cleared)
    free = shutil.disk_usage(where).free  # the trash is not counted again: what it freed is free
    return None if need.bytes <= free + need.cleared else _refusal(cfg, out, need, free)


@dataclass
class Room:
    """What ``check(defer=True)`` leaves to the stage's first write: where the output fits only
    once the run's trash is deleted, the check again on its rank 0 and the wait (``cfg``; None
    where nothing is to wait for: it fits, an object store, an input the estimate cannot read)."""

    deferred: bool = False
    cfg: StageConfig | None = None
    out: str = ""
    where: str = ""

    def wait(self) -> None:
        """Collective on every rank that deferred: once the output fits — at once, or once the
        trash has freed what is missing (estimated again: what the stage cleared is free now) —
        or refused on every rank in one line. Its rank 0 alone looks (one file system), so every
        rank goes on alike; the others wait in the collective (``collective_timeout_s``). A stage
        that needed the trash may so be refused after its update, when another writer took the
        room meanwhile: nothing is published, and a rerun resumes. The first call does it; the
        others return."""
        if not self.deferred:
            return
        from llamarl.lib.distributed import collectives

        self.deferred = False
        error = None
        if self.cfg is not None and collectives.rank_world()[0] == 0:
            try:
                need = _ESTIMATES[type(self.cfg)](self.cfg, fsspec.core.url_to_fs(self.out)[1])
                error = _room(self.cfg, self.out, self.where, need)
            except (UserError, OSError, KeyError, ValueError):
                pass  # as in ``check``: the write says what is wrong, in its words
        collectives.check(error)


def _refusal(cfg: StageConfig, out: str, need: Need, free: int) -> str:
    cleared = f" (and {size(need.cleared)} it clears first)" if need.cleared else ""
    return (f"{out}: {_stage(cfg)} needs {size(need.bytes)} there ({need.what}), but its file system has "
            f"{size(free)} free{cleared}; free space, or set `retention: {{keep_last: N}}` in the run spec so older "
            "iterations are deleted")


def size(n: int) -> str:
    """Bytes in words: 3.02 GB, 512 kB, 812 bytes."""
    for unit, scale in (("TB", 1e12), ("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.3g} {unit}"
    return f"{n} bytes"


# ---- what each stage writes -------------------------------------------------------------------


def _shard(cfg: ShardConfig, path: str) -> Need:
    from llamarl.lib.files.safetensors_io import SafetensorsCheckpoint

    src = cfg.src.rstrip("/")
    weights = SafetensorsCheckpoint(src)
    infos = [weights.info(name) for name in weights.where]
    dtype = dtypes.torch_name(cfg.dtype) if cfg.dtype else None
    tensors = sum(math.prod(i.shape) * dtypes.itemsize(dtype or i.dtype) for i in infos)
    fs, src_path = fsspec.core.url_to_fs(src)
    side = sum(fs.size(f"{src_path}/{n}") for n in contract.SIDE_FILES if fs.exists(f"{src_path}/{n}"))
    chunks = len(infos) * cfg.tp * cfg.pp
    return Need(tensors + side + chunks * CHUNK_BYTES + FOLDER_BYTES, f"weights {size(tensors)}", _unfinished(path))


def _export(cfg: ExportConfig, path: str) -> Need:
    manifest = publish.require_published(cfg.src.rstrip("/"), contract.CHECKPOINT)
    dtype = dtypes.torch_name(cfg.dtype) if cfg.dtype else manifest["dtype"]
    tensors = sum(math.prod(s) for s in manifest["tensors"].values()) * dtypes.itemsize(dtype)
    side = _hf_side_bytes(manifest)
    headers = len(manifest["tensors"]) * TENSOR_HEADER_BYTES
    return Need(tensors + side + headers + FOLDER_BYTES, f"weights {size(tensors)} as {dtype}", _unfinished(path))


def _ppo(cfg: PPOConfig, path: str) -> Need:
    from llamarl.lib.distributed import parallel
    from llamarl.lib.model.config import compute_dtype

    actor = publish.require_published(cfg.actor.rstrip("/"), contract.CHECKPOINT)
    roles = {contract.ACTOR: actor["tensors"]}
    if cfg.advantage == "gae":
        roles[contract.CRITIC] = (publish.require_published(cfg.critic.rstrip("/"), contract.CHECKPOINT)["tensors"]
                                  if cfg.critic else _value_model(actor))
    stored = dtypes.itemsize(actor["dtype"])
    trained = dtypes.name(compute_dtype(cfg.dtype, parallel.device()))
    state_per_param = 8 + (4 if trained != "float32" else 0)  # Adam's two moments, and fp32 masters of lower precision
    world = processes(cfg)
    params = sum(math.prod(s) for t in roles.values() for s in t.values())
    chunks = sum(len(t) for t in roles.values()) * world
    weights = params * stored + chunks * CHUNK_BYTES
    state = params * state_per_param + 3 * chunks * CHUNK_BYTES
    rows = publish.require_published(cfg.rollout.rstrip("/"), contract.ROLLOUT)["rows"]
    steps = cfg.ppo_epochs * -(-rows // cfg.mini_batch_size)
    saves = len(range(contract.saved_step(path) + cfg.save_every, steps, cfg.save_every)) if cfg.save_every else 0
    outputs = weights + state + len(roles) * (2 * FOLDER_BYTES + _hf_side_bytes(actor))
    total = outputs + saves * (weights + state + FOLDER_BYTES) + steps * STEP_BYTES + FOLDER_BYTES
    what = f"weights {size(weights)}, training state {size(state)}" + (f", {saves} saved state(s)" if saves else "")
    return Need(total, what, _du(path, keep=(contract.STATE, publish.INCOMPLETE)))


def _rollout(cfg: RolloutConfig, path: str) -> Need:
    actor = publish.require_published(cfg.actor.rstrip("/"), contract.CHECKPOINT)
    s = cfg.sampling
    room = max(1, actor["model_config"]["max_position_embeddings"] - s.max_new_tokens)
    rows, text = _prompts(cfg.prompts)
    prompts = cfg.select.count if cfg.select else rows
    # Each selected position takes a row; an epoch boundary inside the selection can take a row twice.
    text *= (prompts // max(rows, 1) + 2) if cfg.select else 1
    prompt_tokens = min(prompts * min(cfg.max_prompt_tokens or room, room), text + prompts * TEMPLATE_TOKENS)
    chunks = -(-prompts // cfg.chunk_size)
    left = max(0, chunks - len(contract.published_parts(cfg.out)))
    responses = min(prompts, left * cfg.chunk_size) * s.samples_per_prompt
    per_response = s.max_new_tokens * (4 + 4 + TEXT_BYTES_PER_TOKEN) + ROW_BYTES
    prompt_bytes = s.samples_per_prompt * (text + 4 * prompt_tokens)  # whole: which rows are left is not known here
    total = prompt_bytes + responses * per_response + left * PART_BYTES + FOLDER_BYTES
    return Need(total, f"{responses} responses of up to {s.max_new_tokens} tokens in {left} part(s)")


def _score(cfg: ScoreConfig, path: str) -> Need:
    rollout = publish.require_published(cfg.rollout.rstrip("/"), contract.ROLLOUT)
    parts = contract.manifest_parts(rollout)
    left = max(0, len(parts) - len(contract.published_parts(cfg.out)))
    rows = rollout["rows"] * left // max(len(parts), 1) + left  # parts are even but for the last
    total = rows * (ROW_BYTES + 4 * len(cfg.rewards)) + left * PART_BYTES + FOLDER_BYTES
    return Need(total, f"scores of {rows} rows in {left} part(s)")


_ESTIMATES = {ShardConfig: _shard, ExportConfig: _export, PPOConfig: _ppo, RolloutConfig: _rollout, ScoreConfig: _score}


# ---- helpers ----------------------------------------------------------------------------------


def _stage(cfg: StageConfig) -> str:
    return next(name for name, cls in STAGES.items() if cls is type(cfg))


def _free_once_deleted(out: str, where: str, wanted: int) -> int:
    """The bytes free at ``where`` once the run's trash has freed ``wanted`` of them, or once it
    frees no more: it is waited for, not counted as free, since a stage writes as fast as the trash
    is deleted (seconds for a 1B training state) and a file system may return freed blocks later
    still. Called only where the trash holds enough. Gives up when the free space has not grown nor
    the trash shrunk for ``STALLED_S`` (the trash is emptied already, ``SETTLE_S``). Each rank of
    a stage waits on the same disk, so they end together, but for a disk other writers change
    meanwhile."""
    told, most_free, least_pending, since = False, -1, None, time.monotonic()
    while (free := shutil.disk_usage(where).free) < wanted:
        pending, now = _being_deleted(where), time.monotonic()
        if free > most_free or least_pending is None or pending < least_pending:  # it moves on
            most_free, least_pending, since = max(free, most_free), pending, now
        elif now - since > (STALLED_S if pending else SETTLE_S):
            break
        if not told and os.environ.get("RANK", "0") == "0":  # every rank waits; one says so
            print(f"{out}: waiting for the run's retention to delete {size(pending)} before writing "
                  f"({size(wanted)} needed, {size(free)} free)", flush=True)
            told = True
        time.sleep(POLL_S)
    return free


STALLED_S = 60.0  # how long the trash may free nothing before the stage is refused
SETTLE_S = 30.0  # after the trash is empty: how long freed blocks may take to be free (btrfs commits: 30 s)
POLL_S = 0.2


def _being_deleted(where: str) -> int:
    """Bytes that ``llamarl run`` is deleting as this stage starts (retention's trash, ``TRASH_ENV``),
    on the file system of ``where``."""
    trash = os.environ.get(publish.TRASH_ENV)
    try:
        return _du(trash) if trash and os.stat(trash).st_dev == os.stat(where).st_dev else 0
    except OSError:  # emptied meanwhile
        return 0


def _du(path: str, keep: tuple[str, ...] = ()) -> int:
    """Bytes on disk under ``path``, but for its entries named in ``keep``."""
    if not os.path.isdir(path):
        return 0
    total = 0
    for e in os.scandir(path):
        if e.name in keep:
            continue
        try:  # an entry may go while it is counted (the trash being emptied): it holds nothing then
            total += _du(e.path) if e.is_dir(follow_symlinks=False) else e.stat(follow_symlinks=False).st_blocks * 512
        except FileNotFoundError:
            pass
    return total


def _unfinished(path: str) -> int:
    """Bytes of the unfinished output of ours at ``path`` (a marker, no manifest), which a stage
    that redoes its work (shard, export) clears first."""
    return _du(path) if os.path.exists(os.path.join(path, publish.INCOMPLETE)) else 0


def _hf_side_bytes(manifest: dict) -> int:
    """The HF side files (config, tokenizer) of a checkpoint, which the next checkpoint copies."""
    return sum(e["bytes"] for name, e in manifest["files"].items() if name.startswith(f"{contract.HF}/"))


def _value_model(actor: dict) -> dict:
    """The tensors of a critic made from ``actor``: its backbone and a value head (one row)."""
    tensors = {n: s for n, s in actor["tensors"].items() if n != "lm_head.weight"}
    tensors["score.weight"] = [1, actor["model_config"]["hidden_size"]]
    return tensors


def _prompts(url: str) -> tuple[int, int]:
    """(rows, bytes) of the prompts: the rows their row index counts (built here, not kept: the
    rollout's manifest says whether it built the index), a JSON lines file's size, a Parquet file's
    uncompressed bytes (its footer)."""
    from llamarl.stages import prompt_files, prompt_index

    ds = prompt_files.open_dataset(url)
    rows = prompt_index.row_index(ds).n_rows
    if ds.kind == prompt_files.JSONL:
        return rows, sum(ds.sizes)
    nbytes = 0
    for f, path in enumerate(ds.files):
        with ds.fs.open(path, "rb") as fh:
            meta = prompt_files.open_parquet(ds, f, fh).metadata
        nbytes += sum(meta.row_group(g).total_byte_size for g in range(meta.num_row_groups))
    return rows, nbytes
