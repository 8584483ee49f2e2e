"""Stage shard: an HF Llama checkpoint → a llamarl sharded checkpoint, streamed.

Run with tp × pp processes (``llamarl stage shard SRC DST --tp T --pp P``). Each rank reads only
the slices of the HF tensors that its part of the layout owns (range reads over fsspec) and writes
them as DCP chunks; no rank ever holds the whole model. The result loads into any layout; its
files and manifest: docs/formats.md, "Sharded checkpoint".
"""

from __future__ import annotations

if __name__ == "__main__":  # a stage process: its imports run with the collector off (job.main turns it on)
    import gc

    gc.disable()

import json
import os
import re
import resource
import time
from concurrent.futures import ThreadPoolExecutor

import fsspec
import torch

from llamarl.lib.files import dcp_format, outputs, publish
from llamarl.lib import dtypes
from llamarl.lib.model import hf_mapping
from llamarl.lib.runtime import job
from llamarl.lib.distributed import collectives, parallel
from llamarl.lib.model.config import LlamaConfig, ParallelLayout
from llamarl.lib.errors import UserError
from llamarl.lib.distributed.parallel import Topology
from llamarl.lib.files.safetensors_io import SafetensorsCheckpoint
from llamarl.stages import contract, identity, space
from llamarl.stages.config import ShardConfig


def head_of(hf_config: dict) -> str:
    archs = hf_config.get("architectures") or ["LlamaForCausalLM"]
    if any(a.endswith("ForSequenceClassification") for a in archs):
        if hf_config.get("num_labels", len(hf_config.get("id2label") or {0: 0})) != 1:
            raise UserError("config.json: a sequence classifier must have num_labels=1 to be a reward model")
        return "score"
    return "lm"


# Rotary frequencies: a buffer older checkpoints saved beside the parameters; the config makes it.
_ROTARY_BUFFER = re.compile(r"(.+\.)?rotary_emb\.inv_freq")


def _check_weights(src: SafetensorsCheckpoint, cfg: LlamaConfig, head: str, root: str) -> str:
    """Every tensor the config implies exists with the implied shape, and no other is there to be
    dropped; returns the source dtype's name."""
    expected = hf_mapping.hf_shapes(cfg, head)
    missing = [n for n in expected if n not in src.where]
    if missing:
        raise UserError(f"{root}: {len(missing)} tensors that config.json implies are missing (first: {missing[0]}); "
                        "the weights do not match the config")
    # With tied embeddings a saved head is the embedding's copy: the embedding is what the model uses.
    tied_copy = {"lm_head.weight"} if head == "lm" and cfg.tie_word_embeddings else set()
    extra = sorted(n for n in src.where if n not in expected and n not in tied_copy and not _ROTARY_BUFFER.fullmatch(n))
    if extra:
        raise UserError(f"{root}: {len(extra)} tensors that config.json does not imply would be dropped "
                        f"({', '.join(extra[:3])}{', …' if len(extra) > 3 else ''}); fix config.json (num_hidden_layers, "
                        "attention_bias, mlp_bias, tie_word_embeddings, architectures) or remove them from the weights")
    found = set()
    for name, shape in expected.items():
        info = src.info(name)
        if tuple(info.shape) != tuple(shape):
            raise UserError(f"{root}/{src.where[name]}: {name} has shape {list(info.shape)} but config.json implies "
                            f"{list(shape)}; the config and the weights disagree")
        found.add(info.dtype)
    if len(found) != 1:
        raise UserError(f"{root}: mixed weight dtypes {sorted(found)}; pass --dtype to choose one")
    return found.pop()


def _pieces(weights: SafetensorsCheckpoint, cfg: LlamaConfig, head: str, topo: Topology,
            dtype: torch.dtype) -> list[dcp_format.Piece]:
    """The chunks this rank's place in the layout owns (the slices of the HF tensors its
    parameters are made of), each read from the source files when it is written."""
    shapes = hf_mapping.hf_shapes(cfg, head)
    pieces: dict[tuple, dcp_format.Piece] = {}
    for name in hf_mapping.stage_param_names(cfg, head, topo.pp, topo.pp_rank):
        for s in hf_mapping.param_slices(cfg, topo.tp, topo.tp_rank, name):
            size = shapes[s.hf_name]
            stop = min(s.stop, size[s.dim])  # rows past the end are vocabulary padding: not stored
            if stop <= s.start:
                continue
            off, shape = [0] * len(size), list(size)
            off[s.dim], shape[s.dim] = s.start, stop - s.start
            pieces[(s.hf_name, tuple(off))] = dcp_format.Piece(
                s.hf_name, size, tuple(off), tuple(shape), dtype,
                lambda s=s, stop=stop: _finite(weights, s.hf_name, weights.read(s.hf_name, s.dim, s.start, stop).to(dtype)))
    return list(pieces.values())


def _finite(weights: SafetensorsCheckpoint, name: str, t: torch.Tensor) -> torch.Tensor:
    """``t``, a slice of ``name`` as it is stored, if every value is finite: nothing non-finite is
    published (docs/rl.md §6), and a NaN in an actor's weights shows up far from its cause (a
    rollout of padding, then a ppo whose log-probs are NaN)."""
    # aminmax: NaN reaches both ends and ±inf one of them, at 27× isfinite().all()'s speed on a CPU
    # (15 against 0.55 GB/s for bf16), which would otherwise be most of the stage's work.
    lo, hi = torch.aminmax(t) if t.numel() else (torch.zeros(()), torch.zeros(()))
    if not (torch.isfinite(lo) and torch.isfinite(hi)):
        raise UserError(f"{weights.root}/{weights.where[name]}: {name} holds values that are not finite as "
                        f"{dtypes.name(t.dtype)} (NaN, ±inf, or beyond its range); the checkpoint is damaged, or its "
                        "training diverged: shard another one (or another --dtype)")
    return t


def run(cfg: ShardConfig) -> None:
    if os.environ.get("RANK", "0") == "0":  # the writer of .metadata: its import beside the start-up
        dcp_format.start_metadata_import()
    space.check(cfg)
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
    out_dtype = dtypes.torch_name(cfg.dtype) if cfg.dtype else src_dtype

    # gloo also on GPU machines: shard moves bytes on the CPU.
    topo = parallel.init(cfg.tp, cfg.pp, dp=1, backend="gloo", timeout_s=cfg.collective_timeout_s, stage="shard")
    rank, world = collectives.rank_world()
    t0 = time.perf_counter()  # after start-up (imports, process group): the work itself

    source_files = sorted(set(weights.where.values()) | {n for n in contract.SIDE_FILES if fs.exists(f"{src_path}/{n}")}
                          | ({"model.safetensors.index.json"} if fs.exists(f"{src_path}/model.safetensors.index.json") else set()))
    # The source's checksums go into the manifest, and say whether a published output is current.
    # When the output is not published (the usual case) nothing waits for them: each rank hashes its
    # share of the source files on a thread while it writes its chunks (``TREE``: a 3 GB file in
    # blocks, by several threads; the files are read, not written, here).
    # A published output's own algorithm is used to compare with it (older ones: xxh3_128 streams).
    published = collectives.broadcast_object(publish.read_manifest(dst) if rank == 0 else None)
    before = {n: next((a for a in publish.ALGORITHMS if a in e), publish.TREE)
              for n, e in ((published or {}).get("source") or {}).get("files", {}).items()}
    mine = source_files[rank::world]
    hashing = ThreadPoolExecutor(1, thread_name_prefix="llamarl-hash").submit(
        lambda: {n: publish.file_entry(f"{src}/{n}", before.get(n, publish.TREE)) for n in mine})

    def source() -> dict:
        return {"url": src, "files": {k: v for part in collectives.all_gather_object(hashing.result()) for k, v in part.items()}}

    # What the stage alone knows of its identity: the source's checksums (an unpublished output is
    # never current, so they are only awaited to compare with a published one).
    declared = identity.declare(cfg)
    sources = source() if published else None
    recorded = {"kind": contract.CHECKPOINT, "head": head, "dtype": out_dtype, "source": sources}
    if identity.skip_if_current(dst, declared.request(source=sources) if published else None,
                                "already sharded from this source", recorded):
        return

    with open("/proc/self/statm") as f:
        rss_before = int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    pieces = _pieces(weights, model_cfg, head, topo, dtypes.torch_dtype(out_dtype))
    dcp_format.save(pieces, f"{dst}/{contract.MODEL}")
    nbytes = sum(p.nbytes for p in pieces)
    ranks = collectives.all_gather_object({"rank": rank, "owned_bytes": nbytes, "rss_before_bytes": rss_before,
                                   "peak_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024})  # KiB

    sources = sources or source()
    fs_dst, dst_path = fsspec.core.url_to_fs(dst)
    written = sorted(p.rsplit("/", 1)[-1] for p in fs_dst.ls(f"{dst_path}/{contract.MODEL}", detail=False))
    files = {f"{contract.MODEL}/{k}": v for k, v in outputs.file_entries(f"{dst}/{contract.MODEL}", written).items()}
    if rank == 0:
        side = contract.copy_side_files(src, contract.SIDE_FILES, f"{dst}/{contract.HF}")
        files.update({f"{contract.HF}/{name}": entry for name, entry in side.items()})
        publish.publish(dst, contract.checkpoint_manifest(model_cfg, head, out_dtype, hf_config, sources, files,
                                                          layout, ranks=ranks, request=declared.request(source=sources)))
    collectives.barrier()
    if rank == 0:
        dt = time.perf_counter() - t0
        total = sum(r["owned_bytes"] for r in ranks)
        print(f"{dst}: sharded {total / 1e9:.2f} GB for tp={cfg.tp} pp={cfg.pp} in {dt:.1f}s "
              f"({total / 1e9 / dt:.2f} GB/s)", flush=True)


if __name__ == "__main__":
    job.main(ShardConfig, run)
