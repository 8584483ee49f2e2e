"""HF → shard → export entirely on fsspec's memory:// filesystem, in one process (world size 1).

Used by test_shard_export.py: memory:// is per-process, so the whole round trip runs here.
"""

import os
import sys

import fsspec
import torch

sys.path.insert(0, os.path.dirname(__file__))
os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1")

from distpool import _free_port  # noqa: E402

os.environ["MASTER_PORT"] = str(_free_port())

import tiny  # noqa: E402
from safetensors.torch import load  # noqa: E402

from llamarl.stages import export, shard  # noqa: E402
from llamarl.stages.config import ExportConfig, ShardConfig

tmp = sys.argv[1]
tiny.hf_model().save_pretrained(f"{tmp}/hf")
mem = fsspec.filesystem("memory")
for name in os.listdir(f"{tmp}/hf"):
    mem.pipe_file(f"/hf/{name}", open(f"{tmp}/hf/{name}", "rb").read())

shard.run(ShardConfig(src="memory://hf", dst="memory://ckpt"))
export.run(ExportConfig(src="memory://ckpt", dst="memory://out"))

a = load(open(f"{tmp}/hf/model.safetensors", "rb").read())
b = load(mem.cat_file("/out/model.safetensors"))
same = sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)
print("IDENTICAL" if same else "DIFFERENT", sorted(mem.ls("/ckpt", detail=False)))
sys.exit(0 if same else 1)
