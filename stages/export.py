"""Stage export: a llamarl sharded checkpoint → an HF directory that ``transformers`` loads.

Run with any number of processes (``llamarl stage export SRC DST``). Output files are planned
up front (safetensors split by size, HF's names and index); each rank loads only the tensors of
the files it writes, one file at a time, so no rank gathers the whole model. Actors export as
``LlamaForCausalLM``, critics and reward models as ``LlamaForSequenceClassification`` (one label).

Before publishing, what was written is checked against the checkpoint: every tensor name, shape
and dtype, and the byte total. A smaller or renamed model fails loudly instead of loading.
"""

from __future__ import annotations

import json
import math
import time

from llamarl.lib import dcp_format, dtypes, hf_mapping, job, publish
from llamarl.lib.config import LlamaConfig
from llamarl.lib.errors import UserError
from llamarl.lib.safetensors_io import Deferred, SafetensorsFile, write_file
from llamarl.stages import contract, space
from llamarl.stages.config import ExportConfig

# No torch here: export moves bytes (numpy arrays of the tensors' storage, lib/dtypes.HostTensor)
# over a torch-free process group (lib/iogroup.py), and starts in a fraction of a second.

THREADS = 4  # tensors read, converted and written at once by each rank (safetensors_io.write_file)


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


def _read_metadata(url: str):
    try:
        return dcp_format.read_metadata(url)
    except dcp_format.FormatError:  # another DCP version's classes: read through torch's (rare)
        from llamarl.lib import checkpoint

        return checkpoint.read_metadata(url)


def run(cfg: ExportConfig) -> None:
    space.check(cfg)
    src, dst = cfg.src.rstrip("/"), cfg.dst.rstrip("/")
    manifest = publish.require_published(src, kind=contract.CHECKPOINT)
    model_cfg = LlamaConfig.from_dict(manifest["model_config"])
    head = manifest["head"]
    shapes = hf_mapping.hf_shapes(model_cfg, head)
    model_url = f"{src}/{contract.MODEL}"
    md = _read_metadata(model_url)
    stored = md.state_dict_metadata
    missing = [n for n in shapes if n not in stored]
    if missing:
        raise UserError(f"{src}: the checkpoint lacks {len(missing)} tensors of its model (first: {missing[0]}); "
                        "it is damaged: reshard it")
    for n, shape in shapes.items():
        if tuple(stored[n].size) != tuple(shape):
            raise UserError(f"{src}: {n} is stored with shape {list(stored[n].size)}, its config implies {list(shape)}")
    src_dtype = str(stored[next(iter(shapes))].properties.dtype)
    out_dtype = dtypes.torch_name(cfg.dtype) if cfg.dtype else src_dtype

    # Any number of processes, each writing whole files.
    job.join_io_group(cfg.collective_timeout_s)
    rank, world = job.rank_world()
    t0 = time.perf_counter()  # after start-up (imports, process group): the work itself

    # The input's checksums are verified while it is read: nothing made from it is published
    # before every rank's share checked out (a damaged file's error wins over what reading it did).
    verifying = job.start_verify(src, manifest) if cfg.verify else None

    expect = {"kind": contract.HF_EXPORT, "head": head, "dtype": out_dtype,
              "source": {"url": src, "created": manifest["created"], "files": manifest["files"]}}
    if contract.skip_if_current(dst, expect, "already exported from this checkpoint"):
        return  # (the input's verification, a daemon thread, goes with the process)

    groups = plan_files(shapes, dtypes.itemsize(out_dtype), int(cfg.max_shard_gb * 2**30))
    names = file_names(len(groups))
    written: dict[str, dict] = {}
    error = None
    try:
        for i in range(rank, len(groups), world):  # rank k writes files k, k + world, …
            tensors = {n: Deferred(out_dtype, tuple(shapes[n]),
                                   lambda n=n: dcp_format.read_whole(model_url, md, n).to(out_dtype))
                       for n in groups[i]}
            written[names[i]] = write_file(f"{dst}/{names[i]}", tensors, metadata={"format": "pt"}, threads=THREADS)
    except (OSError, dcp_format.FormatError, ValueError) as e:
        error = f"rank {rank}: {src}: {e}; the checkpoint is damaged: reshard it"
    error = job.agree((verifying.result() if verifying else None) or error)
    if error is not None:  # bad input: what was written from it goes (it was only ever ours, unpublished)
        if rank == 0:
            publish.discard(dst)
        raise UserError(error)
    files = {k: v for part in job.all_gather_object(written) for k, v in part.items()}

    if rank == 0:
        try:
            _write_side_files(src, dst, manifest, head, out_dtype, groups, names, files)
            _check_written(dst, shapes, out_dtype, groups, names)
        except UserError as e:
            error = str(e)
    job.check(error)
    if rank == 0:
        publish.publish(dst, {**expect, "files": files, "timing": job.timing()})
        dt = time.perf_counter() - t0
        total = sum(v["bytes"] for k, v in files.items() if k.endswith(".safetensors"))
        print(f"{dst}: exported {total / 1e9:.2f} GB ({len(names)} file(s)) in {dt:.1f}s ({total / 1e9 / dt:.2f} GB/s)", flush=True)
    job.barrier()


def _write_side_files(src, dst, manifest, head, dtype, groups, names, files) -> None:
    def put(name: str, data: bytes) -> None:
        publish.write_bytes(f"{dst}/{name}", data)
        files[name] = publish.file_entry(f"{dst}/{name}")

    put("config.json", json.dumps(hf_config_for(manifest, head, dtype), indent=2).encode())
    copied = [n for n in contract.hf_side_files(manifest) if n != "config.json"]  # ours says what was exported
    files.update(contract.copy_side_files(f"{src}/{contract.HF}", copied, dst))
    if "generation_config.json" not in files:
        cfg = manifest["model_config"]
        gen = {k: cfg.get(k) for k in ("bos_token_id", "eos_token_id", "pad_token_id") if cfg.get(k) is not None}
        put("generation_config.json", json.dumps(gen, indent=2).encode())
    if len(names) > 1:
        itemsize = dtypes.itemsize(dtype)
        total = sum(itemsize * math.prod(s) for s in hf_mapping.hf_shapes(LlamaConfig.from_dict(manifest["model_config"]), head).values())
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
