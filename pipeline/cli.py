"""The ``llamarl`` command line."""

from __future__ import annotations

import sys

import typer

app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Staged RLHF (PPO) for Llama: each stage a batch job, joined by files on shared storage.")
stage_app = typer.Typer(no_args_is_help=True, help="Run one stage by hand, on this machine.")
app.add_typer(stage_app, name="stage")


def _run_local(stage: str, config, nprocs: int) -> None:
    from llamarl.cluster.local import LocalExecutor

    code = LocalExecutor().run(stage, config, nprocs)
    if code:
        raise typer.Exit(code)


@stage_app.command("shard")
def shard(
    src: str = typer.Argument(..., help="HF checkpoint directory (any fsspec URL)."),
    dst: str = typer.Argument(..., help="Output directory for the sharded checkpoint."),
    tp: int = typer.Option(1, help="Tensor-parallel size (processes = tp × pp)."),
    pp: int = typer.Option(1, help="Pipeline-parallel size."),
    dtype: str = typer.Option(None, help="Stored dtype: bf16 | fp16 | fp32 (default: the source's)."),
):
    """HF checkpoint → sharded checkpoint (loadable at any TP×PP)."""
    from llamarl.stages.shard import ShardConfig

    _run_local("shard", ShardConfig(src=src, dst=dst, tp=tp, pp=pp, dtype=dtype), tp * pp)
    typer.echo(dst)


@stage_app.command("export")
def export(
    src: str = typer.Argument(..., help="A sharded checkpoint directory."),
    dst: str = typer.Argument(..., help="Output HF directory."),
    dtype: str = typer.Option(None, help="Output dtype: bf16 | fp16 | fp32 (default: the checkpoint's)."),
    max_shard_gb: float = typer.Option(2.0, help="Largest safetensors file, in GB."),
    procs: int = typer.Option(2, help="Processes writing files in parallel."),
):
    """Sharded checkpoint → HF safetensors directory (transformers loads it)."""
    from llamarl.stages.export import ExportConfig

    _run_local("export", ExportConfig(src=src, dst=dst, dtype=dtype, max_shard_gb=max_shard_gb), procs)
    typer.echo(dst)


def main() -> None:  # pragma: no cover - console entry point
    sys.exit(app())


if __name__ == "__main__":
    main()
