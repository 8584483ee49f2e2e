"""Stage export: a llamarl sharded checkpoint → an HF directory that ``transformers`` loads.

Run with any number of processes (``llamarl stage export SRC DST``). Output files are planned
up front (safetensors split by size, HF's names and index); each rank loads only the tensors of
the files it writes, up to ``FILES_AT_ONCE`` files at a time (one file's tensors are written by
``THREADS`` threads: a 3 GB model in four files exports in 0.8 s on one process of an H200,
against 1.7 s one file at a time), so no rank gathers the whole model: a rank holds at most about
``FILES_AT_ONCE`` files' bytes (``max_shard_gb`` each, or one tensor larger). Actors export as
``LlamaForCausalLM``, critics and reward models as ``LlamaForSequenceClassification`` (one label).

Before publishing, what was written is checked against the checkpoint: every tensor name, shape
and dtype, and the byte total. A smaller or renamed model fails loudly instead of loading.
"""

from __future__ import annotations

if __name__ == "__main__":  # a stage process: its imports run with the collector off (job.main turns it on)
    import gc

    gc.disable()

import json
import math
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from llamarl.lib.files import checkpoint, outputs, publish, ranges
from llamarl.lib import dtypes
from llamarl.lib.model import hf_mapping
from llamarl.lib.runtime import job
from llamarl.lib.distributed import collectives, parallel
from llamarl.lib.model.config import LlamaConfig
from llamarl.lib.errors import UserError
from llamarl.lib.files.safetensors_io import Deferred, SafetensorsFile, write_file
from llamarl.stages import contract, identity, space
from llamarl.stages.config import ExportConfig

THREADS = 4  # tensors read, converted and written at once in a file (safetensors_io.write_file)
FILES_AT_ONCE = 4  # files a rank writes at once


def plan_files(shapes: dict[str, tuple], itemsize: int, max_bytes: int) -> list[list[str]]:
    """Tensors in checkpoint order, grouped into files of at most ``max_bytes`` (a bigger single
    tensor gets a file of its own)."""
    files, current, size = [], [], 0
    for name, shape in shapes.items():
        n = itemsize * math.prod(shape)
        if current and size + n > max_bytes:
            files.append(current)
            current, size = [], 0
        current.append(name)
        size += n
    if current:
        files.append(current)
    return files


def file_names(n: int) -> list[str]:
    return ["model.safetensors"] if n == 1 else [f"model-{i + 1:05d}-of-{n:05d}.safetensors" for i in range(n)]


def hf_config_for(manifest: dict, head: str, dtype: str) -> dict:
    cfg = LlamaConfig.from_dict(manifest["model_config"])
    out = {**manifest.get("hf_config", {})}
    out.update(cfg.to_hf("LlamaForCausalLM" if head == "lm" else "LlamaForSequenceClassification"))
    out.pop("rope_parameters", None)  # rope_theta / rope_scaling above are the source of truth
    out["torch_dtype"] = dtype
    if head == "score":
        out.update(num_labels=1, id2label={"0": "LABEL_0"}, label2id={"LABEL_0": 0})
    return out


class _Unreadable(Exception):
    """The checkpoint's files do not hold what its metadata says (a failure to read, never to write)."""


def _tensor(url: str, index: dict, name: str, dtype: torch.dtype):
    """Tensor ``name`` of the checkpoint as ``dtype``: whole, or, stored in row chunks that are
    plain items of local files and not converted, those chunks' pages as its rows (``Deferred``'s
    pieces: written as stored, never copied into one tensor first)."""
    stored = index[name]
    try:
        if dtype == stored.dtype and (rows := _mapped_rows(url, stored)) is not None:
            return rows
        t = checkpoint.mapped(url, index, name)  # a tensor stored whole in a local file: its pages
        if t is None:
            t = ranges.empty(stored.size, stored.dtype)
            checkpoint.read({name: t}, url, index)
    except Exception as e:  # whatever reading met: a file gone, cut short, or not DCP's
        raise _Unreadable(f"{name}: {type(e).__name__}: {e}") from e
    return t.to(dtype)


def _mapped_rows(url: str, stored) -> list[tuple[int, torch.Tensor]] | None:
    """(first row, mapped chunk) of a tensor stored as several chunks of whole rows (split over
    TP by rows) that follow each other; None for any other tensor, or a chunk that cannot be mapped."""
    chunks = sorted(stored.chunks, key=lambda c: c.offsets)
    first = 0
    for c in chunks:
        if not c.offsets or c.offsets[0] != first or any(c.offsets[1:]) or c.sizes[1:] != stored.size[1:]:
            return None
        first += c.sizes[0]
    if len(chunks) < 2 or first != stored.size[0]:
        return None
    rows = [(c.offsets[0], checkpoint.mapped_chunk(url, c, stored.dtype)) for c in chunks]
    return None if any(t is None for _, t in rows) else rows


def _index(src: str, shapes: dict[str, tuple], dtype: str) -> dict:
    """The checkpoint's index (``checkpoint.read_index``), checked against its manifest: every
    tensor of the model, with its shape and the manifest's dtype."""
    try:
        stored = checkpoint.read_index(f"{src}/{contract.MODEL}")
    except Exception as e:  # noqa: BLE001 — a .metadata damaged anyhow
        raise _Unreadable(f"{contract.MODEL}/{checkpoint.METADATA}: {type(e).__name__}: {e}") from e
    missing = [n for n in shapes if n not in stored]
    if missing:
        raise _Unreadable(f"it lacks {len(missing)} tensors of its model (first: {missing[0]})")
    for n, shape in shapes.items():
        if stored[n].size != tuple(shape) or dtypes.name(stored[n].dtype) != dtype:
            raise _Unreadable(f"{n} is stored as {dtypes.name(stored[n].dtype)} {list(stored[n].size)}, "
                              f"its manifest says {dtype} {list(shape)}")
    return stored


def _write(url: str, model_url: str, index: dict, names: list[str], shapes: dict, dtype: torch.dtype) -> dict:
    """One safetensors file of the tensors ``names``, each read (``_tensor``) when its turn comes;
    its manifest entry. ``_Unreadable`` for the input, ``OSError`` for the output's storage."""
    tensors = {n: Deferred(dtype, tuple(shapes[n]), lambda n=n: _tensor(model_url, index, n, dtype)) for n in names}
    try:
        return write_file(url, tensors, metadata={"format": "pt"}, threads=THREADS)
    except OSError as e:  # reading raises _Unreadable: this is the output's storage
        raise OSError(e.errno, f"writing {url}: {e.strerror or e}") from e


def run(cfg: ExportConfig) -> None:
    space.check(cfg)
    src, dst = cfg.src.rstrip("/"), cfg.dst.rstrip("/")
    manifest = publish.require_published(src, kind=contract.CHECKPOINT)
    model_cfg = LlamaConfig.from_dict(manifest["model_config"])
    head, src_dtype = manifest["head"], manifest["dtype"]
    shapes = hf_mapping.hf_shapes(model_cfg, head)
    out_dtype = dtypes.torch_name(cfg.dtype) if cfg.dtype else src_dtype

    # Any number of processes, each writing whole files; gloo also on GPU machines (export moves
    # bytes on the CPU).
    parallel.init(1, 1, backend="gloo", timeout_s=cfg.collective_timeout_s)
    rank, world = collectives.rank_world()
    t0 = time.perf_counter()  # after start-up (imports, process group): the work itself

    # The input's checksums are verified while it is read: nothing made from it is published
    # before every rank's share checked out (a damaged file's error wins over what reading it did).
    verifying = outputs.start_verify(src, manifest) if cfg.verify else None

    request = identity.declare(cfg).request()
    source = {"url": src, "created": manifest["created"], "files": manifest["files"]}
    recorded = {"kind": contract.HF_EXPORT, "head": head, "dtype": out_dtype, "source": source}
    if identity.skip_if_current(dst, request, "already exported from this checkpoint", recorded):
        return  # (the input's verification, a daemon thread, goes with the process)

    groups = plan_files(shapes, dtypes.itemsize(out_dtype), int(cfg.max_shard_gb * 2**30))
    names = file_names(len(groups))
    written, failure = {}, None
    try:
        index = _index(src, shapes, src_dtype)
        mine = range(rank, len(groups), world)  # rank k writes files k, k + world, …
        pool = ThreadPoolExecutor(max(1, min(FILES_AT_ONCE, len(mine))))
        try:
            jobs = {names[i]: pool.submit(_write, f"{dst}/{names[i]}", f"{src}/{contract.MODEL}", index, groups[i],
                                          shapes, dtypes.torch_dtype(out_dtype)) for i in mine}
            written = {name: pending.result() for name, pending in jobs.items()}
        finally:  # after a failure, files not begun are not written; those begun end before the discard
            pool.shutdown(wait=True, cancel_futures=True)
    except (_Unreadable, OSError) as e:
        failure = (("user", None, f"rank {rank}: {src}: {e}; the checkpoint is damaged: reshard it")
                   if isinstance(e, _Unreadable) else collectives.describe(e, rank))
    # A damaged input file (its checksum, any rank's) is the error to report, before what reading it did.
    verified = verifying.result() if verifying else None
    results = collectives.all_gather_object((verified, failure, written))
    failures = [("user", None, v) for v, _, _ in results if v] + [f for _, f, _ in results if f]
    if failures and rank == 0:  # what was written from bad input, or cut short, goes (it was only ever ours)
        publish.discard(dst)
    collectives.raise_first(f"exporting {src} to {dst}", failures)
    files = {k: v for _, _, part in results for k, v in part.items()}

    failure = None
    if rank == 0:
        try:
            _write_side_files(src, dst, manifest, head, out_dtype, shapes, groups, names, files)
            _check_written(dst, shapes, out_dtype, groups, names)
            publish.publish(dst, {**recorded, "request": request, "files": files, "timing": outputs.timing()})
        except (UserError, OSError) as e:
            failure = collectives.describe(e, rank)
    collectives.raise_first(f"exporting {src} to {dst}", [collectives.broadcast_object(failure)])
    if rank == 0:
        dt = time.perf_counter() - t0
        total = sum(v["bytes"] for k, v in files.items() if k.endswith(".safetensors"))
        print(f"{dst}: exported {total / 1e9:.2f} GB ({len(names)} file(s)) in {dt:.1f}s ({total / 1e9 / dt:.2f} GB/s)", flush=True)


def _write_side_files(src, dst, manifest, head, dtype, shapes, groups, names, files) -> None:
    def put(name: str, data: bytes) -> None:
        files[name] = publish.write_bytes(f"{dst}/{name}", data)

    put("config.json", json.dumps(hf_config_for(manifest, head, dtype), indent=2).encode())
    copied = [n for n in contract.hf_side_files(manifest) if n != "config.json"]  # ours says what was exported
    files.update(contract.copy_side_files(f"{src}/{contract.HF}", copied, dst))
    if "generation_config.json" not in files:
        cfg = manifest["model_config"]
        gen = {k: cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
        put("generation_config.json", json.dumps(gen, indent=2).encode())
    if len(names) > 1:
        total = sum(dtypes.itemsize(dtype) * math.prod(s) for s in shapes.values())
        index = {"metadata": {"total_size": total},
                 "weight_map": {n: fname for group, fname in zip(groups, names) for n in group}}
        put("model.safetensors.index.json", json.dumps(index, indent=2).encode())


def _check_written(dst, shapes, dtype, groups, names) -> None:
    """Re-read every written header: the exact set of names, shapes, dtype and bytes expected."""
    itemsize = dtypes.itemsize(dtype)
    seen: dict[str, str] = {}
    total = 0
    for group, fname in zip(groups, names):
        f = SafetensorsFile(f"{dst}/{fname}")
        if set(f.tensors) != set(group):
            raise UserError(f"{dst}/{fname}: holds {sorted(set(f.tensors) ^ set(group))[:3]}… against the plan; export failed, nothing published")
        for n, info in f.tensors.items():
            if n in seen:
                raise UserError(f"{dst}: {n} written twice ({seen[n]} and {fname}); export failed, nothing published")
            seen[n] = fname
            if tuple(info.shape) != tuple(shapes[n]) or info.dtype != dtype:
                raise UserError(f"{dst}/{fname}: {n} is {info.dtype} {list(info.shape)}, expected "
                                f"{dtype} {list(shapes[n])}; export failed, nothing published")
            total += info.end - info.begin
    if set(seen) != set(shapes):
        raise UserError(f"{dst}: {len(set(shapes) - set(seen))} tensors were not written; export failed, nothing published")
    expected = sum(itemsize * math.prod(s) for s in shapes.values())
    if total != expected:
        raise UserError(f"{dst}: wrote {total} bytes of weights, expected {expected}; export failed, nothing published")


if __name__ == "__main__":
    job.main(ExportConfig, run)
