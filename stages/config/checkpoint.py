"""The configs of the stages that move checkpoints: shard (HF → sharded) and export (sharded → HF)."""

from __future__ import annotations

from pydantic import Field

from .base import OUTPUT, StageConfig, StoredDtype, Url, layout, path, placement


class ShardConfig(StageConfig):
    src: Url = path("HF checkpoint directory (any fsspec URL): config.json, *.safetensors, tokenizer files.")
    dst: Url = path("Output directory (any fsspec URL); created, or resumed if an earlier run was interrupted.",
                    kind=OUTPUT)
    tp: int = layout("Tensor-parallel size of the job (the checkpoint itself loads at any layout).")
    pp: int = layout("Pipeline-parallel size of the job.")
    dtype: StoredDtype | None = Field(None, description="Stored dtype: bf16 | fp16 | fp32; default: the source's.")


class ExportConfig(StageConfig):
    src: Url = path("A published llamarl checkpoint directory (any fsspec URL).")
    dst: Url = path("Output HF directory (any fsspec URL).", kind=OUTPUT)
    dtype: StoredDtype | None = Field(None, description="Output dtype: bf16 | fp16 | fp32; default: the checkpoint's.")
    max_shard_gb: float = Field(1.0, gt=0, description="Largest safetensors file, in GB; bigger models are split "
                                                       "with an index, as HF does. A file is what one process "
                                                       "writes (and a loader reads) at once: more files, more "
                                                       "of them in parallel.")
    verify: bool = placement(True, "Check the checkpoint's files against their checksums before reading.")
    procs: int = layout("Processes writing files in parallel (each writes whole files).")

