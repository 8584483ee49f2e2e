"""``make demo``: build a tiny random Llama and check lib/ against transformers at TP=2 on CPU.

Launches itself under torchrun with two processes (gloo). Prints, per layout, the largest logit
difference from HF ``LlamaForCausalLM`` with the same weights.
"""

from __future__ import annotations

import os
import subprocess
import sys


def _worker() -> None:
    import torch
    import torch.distributed as dist
    from transformers import LlamaConfig as HFConfig
    from transformers import LlamaForCausalLM

    from llamarl.lib import parallel
    from llamarl.lib.config import LlamaConfig, ParallelLayout
    from llamarl.lib.model import ParallelLlamaForCausalLM

    torch.set_num_threads(1)
    hf_cfg = HFConfig(vocab_size=1001, hidden_size=128, intermediate_size=256, num_hidden_layers=4,
                      num_attention_heads=8, num_key_value_heads=2, max_position_embeddings=512)
    torch.manual_seed(0)
    hf = LlamaForCausalLM(hf_cfg).eval()
    ids = torch.randint(1, 1001, (4, 48))
    mask = torch.ones_like(ids)
    for row, n in enumerate((48, 30, 9, 41)):  # left padding, unequal lengths
        mask[row, : 48 - n] = 0
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        ref = hf(input_ids=ids, attention_mask=mask, position_ids=pos).logits

    parallel.init(tp=2)
    rows = []
    for sp in (False, True):
        for rmpad in (True, False):
            model = ParallelLlamaForCausalLM(LlamaConfig.from_hf(hf_cfg.to_dict()),
                                             ParallelLayout(tp=2, sequence_parallel=sp, remove_padding=rmpad))
            model.load_hf_state_dict(hf.state_dict())
            with torch.no_grad():
                local = model.run(ids, mask, pos)
            parts = [torch.empty_like(local) for _ in range(2)]
            dist.all_gather(parts, local, group=parallel.tp_group())
            full = torch.cat(parts, -1)[..., :1001]
            rows.append((sp, rmpad, (full - ref)[mask.bool()].abs().max().item()))
    if dist.get_rank() == 0:
        from rich.console import Console
        from rich.table import Table

        table = Table(title="lib/ vs transformers.LlamaForCausalLM, TP=2 over gloo (fp32)")
        for col in ("sequence parallel", "remove padding", "max |Δ logits|", "ok (< 1e-4)"):
            table.add_column(col)
        for sp, rmpad, err in rows:
            table.add_row(str(sp), str(rmpad), f"{err:.2e}", "yes" if err < 1e-4 else "NO")
        Console().print(table)
    parallel.shutdown()
    if any(err >= 1e-4 for *_, err in rows):
        sys.exit(1)


def main() -> None:
    if os.environ.get("LLAMARL_DEMO_WORKER"):
        _worker()
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = {**os.environ, "LLAMARL_DEMO_WORKER": "1", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr", "127.0.0.1",
           "--master-port", str(port), "-m", "llamarl.pipeline.demo"]
    sys.exit(subprocess.call(cmd, env=env))


if __name__ == "__main__":
    main()
