"""Stage shard: an HF Llama checkpoint → a llamarl sharded checkpoint, streamed.

Run with tp × pp processes (``llamarl stage shard SRC DST --tp T --pp P``). Each rank reads only
the slices of the HF tensors that its part of the layout owns (range reads over fsspec) and writes
them as DCP chunks; no rank ever holds the whole model. The result loads into any layout.

Output directory (see docs/formats.md):
    llamarl.json   manifest, written last: model config, head, dtype, layout written, the source's
                   files with their checksums, every output file with size and checksum
    model/         DCP checkpoint of HF-named tensors
    hf/            config.json, generation_config.json and tokenizer files, copied from the source
"""

from __future__ import annotations

import json
import os
import resource
import time

import fsspec
import torch
import torch.distributed as dist

from llamarl.lib import checkpoint, dtypes, hf_mapping, job, parallel, publish
from llamarl.lib.config import LlamaConfig, ParallelLayout
from llamarl.lib.errors import UserError
from llamarl.lib.safetensors_io import SafetensorsCheckpoint
from llamarl.stages import contract
from llamarl.stages.config import ShardConfig


def head_of(hf_config: dict) -> str:
    archs = hf_config.get("architectures") or ["LlamaForCausalLM"]
    if any(a.endswith("ForSequenceClassification") for a in archs):
        if hf_config.get("num_labels", len(hf_config.get("id2label") or {0: 0})) != 1:
            raise UserError("config.json: a sequence classifier must have num_labels=1 to be a reward model")
        return "score"
    return "lm"


def _model_class(head: str):
    from llamarl.lib.model import ParallelLlamaForCausalLM, ParallelLlamaForScore

    return ParallelLlamaForCausalLM if head == "lm" else ParallelLlamaForScore


def _check_weights(src: SafetensorsCheckpoint, cfg: LlamaConfig, head: str, root: str) -> torch.dtype:
    """Every tensor the config implies exists with the implied shape; returns the source dtype."""
    expected = hf_mapping.hf_shapes(cfg, head)
    missing = [n for n in expected if n not in src.where]
    if missing:
        raise UserError(f"{root}: {len(missing)} tensors that config.json implies are missing (first: {missing[0]}); "
                        "the weights do not match the config")
    dtypes = set()
    for name, shape in expected.items():
        info = src.info(name)
        if tuple(info.shape) != tuple(shape):
            raise UserError(f"{root}/{src.where[name]}: {name} has shape {list(info.shape)} but config.json implies "
                            f"{list(shape)}; the config and the weights disagree")
        dtypes.add(info.dtype)
    if len(dtypes) != 1:
        raise UserError(f"{root}: mixed weight dtypes {sorted(map(str, dtypes))}; pass --dtype to choose one")
    return dtypes.pop()


def _local_param_names(cfg: LlamaConfig, head: str, layout: ParallelLayout) -> list[str]:
    # The model is built for its parameter names only: on the CPU, and its weights never touched
    # (its layers allocate with torch.empty: no memory is committed; test_peak_memory_... checks).
    # Not on the meta device: its first computation there (the rotary frequencies) imports
    # torch._dynamo, 0.3-0.8 s and ~80 MB in every process.
    with torch.device("cpu"):
        model = _model_class(head)(cfg, layout, dtype=torch.bfloat16)
    return [n for n, _ in model.named_parameters()]


def _rss_bytes() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_rss_bytes() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB


def run(cfg: ShardConfig) -> None:
    src, dst = cfg.src.rstrip("/"), cfg.dst.rstrip("/")
    fs, src_path = fsspec.core.url_to_fs(src)
    if not fs.exists(f"{src_path}/config.json"):
        raise UserError(f"{src}/config.json not found; point SRC at an HF checkpoint directory")
    with fs.open(f"{src_path}/config.json", "r") as f:
        hf_config = json.load(f)
    model_cfg = LlamaConfig.from_hf(hf_config, source=f"{src}/config.json")
    head = head_of(hf_config)
    layout = ParallelLayout(tp=cfg.tp, pp=cfg.pp)
    layout.check(model_cfg)
    weights = SafetensorsCheckpoint(src)
    src_dtype = _check_weights(weights, model_cfg, head, src)
    out_dtype = dtypes.torch_dtype(cfg.dtype) if cfg.dtype else src_dtype

    # Pure I/O on CPU tensors: gloo even where GPUs are present.
    topo = parallel.init(cfg.tp, cfg.pp, dp=1, backend="gloo", timeout_s=cfg.collective_timeout_s, stage="shard")
    rank = dist.get_rank()
    t0 = time.perf_counter()  # after start-up (imports, process groups): the work itself

    source_files = sorted(set(weights.where.values()) | {n for n in contract.SIDE_FILES if fs.exists(f"{src_path}/{n}")}
                          | ({"model.safetensors.index.json"} if fs.exists(f"{src_path}/model.safetensors.index.json") else set()))
    source = {"url": src, "files": job.file_entries(src, source_files)}
    expect = {"kind": contract.CHECKPOINT, "head": head, "dtype": dtypes.name(out_dtype), "source": source}
    if contract.skip_if_current(dst, expect, "already sharded from this source"):
        return

    # This rank's slices, read straight from the source files.
    rss_before = _rss_bytes()
    state: dict[str, checkpoint.Chunks] = {}
    shapes = hf_mapping.hf_shapes(model_cfg, head)
    nbytes = 0
    for name in _local_param_names(model_cfg, head, layout):
        for s in hf_mapping.param_slices(model_cfg, topo.tp, topo.tp_rank, name):
            stop = min(s.stop, shapes[s.hf_name][s.dim])
            if stop <= s.start:
                continue
            piece = weights.read(s.hf_name, s.dim, s.start, stop).to(out_dtype)
            off = [0] * len(shapes[s.hf_name])
            off[s.dim] = s.start
            chunks = state.setdefault(s.hf_name, checkpoint.Chunks(shapes[s.hf_name], {}))
            chunks.pieces[tuple(off)] = piece
            nbytes += piece.numel() * piece.element_size()
    checkpoint.save(state, f"{dst}/{contract.MODEL}")
    del state
    ranks: list = [None] * dist.get_world_size()
    dist.all_gather_object(ranks, {"rank": rank, "owned_bytes": nbytes, "rss_before_bytes": rss_before,
                                   "peak_rss_bytes": _peak_rss_bytes()})

    fs_dst, dst_path = fsspec.core.url_to_fs(dst)
    written = sorted(p.rsplit("/", 1)[-1] for p in fs_dst.ls(f"{dst_path}/{contract.MODEL}", detail=False))
    files = {f"{contract.MODEL}/{k}": v for k, v in job.file_entries(f"{dst}/{contract.MODEL}", written).items()}
    if rank == 0:
        side = contract.copy_side_files(src, contract.SIDE_FILES, f"{dst}/{contract.HF}")
        files.update({f"{contract.HF}/{name}": entry for name, entry in side.items()})
        publish.publish(dst, contract.checkpoint_manifest(model_cfg, head, out_dtype, hf_config, source, files, topo,
                                                          ranks=ranks))
    dist.barrier()
    total = torch.tensor([nbytes], dtype=torch.float64)
    dist.all_reduce(total)
    if rank == 0:
        dt = time.perf_counter() - t0
        print(f"{dst}: sharded {total.item() / 1e9:.2f} GB for tp={cfg.tp} pp={cfg.pp} in {dt:.1f}s "
              f"({total.item() / 1e9 / dt:.2f} GB/s)", flush=True)


if __name__ == "__main__":
    job.main(ShardConfig, run)
