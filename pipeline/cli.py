"""The ``llamarl`` command line."""

from __future__ import annotations

import functools
import os
import signal
import sys
from contextlib import contextmanager, suppress

import typer

from llamarl.lib.errors import (EXIT_USER_ERROR, Stopped, UserError, disk_full, disk_full_error, forget_stop, one_line,
                                raise_stop, unreadable)
from llamarl.lib.options import Source, validate
from llamarl.stages.config import (WIRED, ExportConfig, PPOConfig, RolloutConfig, ScoreConfig, ShardConfig, StageConfig,
                                   describe, describe_rules, kind_of, options_model, processes)


app = typer.Typer(no_args_is_help=True, add_completion=False,
                  help="Staged RLHF (PPO) for Llama: each stage a batch job, joined by files on shared storage.")
stage_app = typer.Typer(no_args_is_help=True, help="Run one stage by hand, on this machine.")
app.add_typer(stage_app, name="stage")


@app.command("run")
def run(
    spec: str = typer.Argument(..., help="Run spec (YAML)."),
    dry_run: bool = typer.Option(False, "--dry-run", help="Print which stages would run and why; run nothing."),
    show_launch: bool = typer.Option(False, "--show-launch", help="With --dry-run: also print what each stage that "
                                                                  "would run launches (commands, sbatch, manifests)."),
    apply: bool = typer.Option(False, "--apply", help="Kubernetes: create the Jobs and follow them (default: write YAML)."),
    detach: bool = typer.Option(False, "--detach", help="Submit and return: Slurm gets every stage that is not done "
                                                        "at once, chained with --dependency=afterok; follow it with "
                                                        "`llamarl status RUN`."),
):
    """Run (or resume) every stage of a spec that is not done yet."""
    from rich.table import Table
    from rich.text import Text

    from llamarl.pipeline.run import run_spec
    from llamarl.pipeline.dag import load_spec

    console = _console()
    loaded = None
    try:
        with stopped_by_signals():
            loaded = load_spec(spec)
            if apply:
                if loaded.executor.kind != "kubernetes":
                    raise UserError(f"{spec}: --apply creates Kubernetes Jobs, but executor.kind is "
                                    f"{loaded.executor.kind!r}; drop --apply, or use executor.kind: kubernetes")
                loaded.executor.options["apply"] = True
            report = run_spec(loaded, dry_run=dry_run, show_launch=show_launch, detach=detach and not dry_run,
                              echo=lambda m: _say(console, m, markup=False, wrap=True))
    except UserError as e:
        _error(str(e))
        raise typer.Exit(EXIT_USER_ERROR)
    except Stopped as e:
        stages = f": stopped {', '.join(e.stages)}, every process of each" if e.stages else ""
        _error(f"llamarl run got {e.name}{stages}; rerun `llamarl run {spec}` to resume")
        _leave(e.exit_status)
    except OSError as e:  # the driver's own writes (records, the spec's copy) to a full run directory
        if (words := disk_full(e)) is None:
            raise
        _error(disk_full_error(e.filename or (loaded.run_dir if loaded else spec), words))
        raise typer.Exit(EXIT_USER_ERROR)
    if dry_run:
        table = Table(title=Text(f"{loaded.run_dir} (dry run)"))
        table.add_column("stage")
        table.add_column("plan")
        for name, what in report:
            table.add_row(Text(name), Text(what))
        console.print(table)
        return
    if detach:
        console.print(f"submitted; follow it with `llamarl status {loaded.run_dir}`", highlight=False, markup=False)
        return
    _print_metrics(console, loaded.run_dir, loaded.iterations, loaded.pass_threshold)


@contextmanager
def stopped_by_signals():
    """SIGTERM and SIGHUP stop a driver as Ctrl-C does, raising ``errors.Stopped`` in the main
    thread (docs/pipeline.md, "Stopping a run"). A signal already ignored stays ignored (``nohup``);
    a second one while stopping is ignored, so that it cannot cut the stop short."""
    stopping = False

    def stop(signum, frame):
        nonlocal stopping
        if not stopping:
            stopping = True
            raise_stop(signum)

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    for sig, handler in previous.items():
        if handler is not signal.SIG_IGN:
            signal.signal(sig, stop)
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        forget_stop()


@functools.cache
def _console_class():
    from rich.console import Console

    class UnreadConsole(Console):
        """rich's console, but a reader that leaves (``llamarl run | head``, a pager quit) stops what
        it shows, not the run: rich would exit, stopping a driver whose stages run on."""

        def on_broken_pipe(self) -> None:
            self.quiet = True
            with suppress(OSError):
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, (sys.stderr if self.stderr else sys.stdout).fileno())
                os.close(null)

    return UnreadConsole


def _console(**kw):
    return _console_class()(**kw)


def _say(console, text, markup: bool = True, wrap: bool = False) -> None:
    """A line to the terminal, which may be gone (SIGHUP) or no longer read: then it is dropped."""
    with suppress(OSError):
        console.print(text, highlight=False, markup=markup, soft_wrap=not wrap)


def _error(message: str) -> None:
    """``error: MESSAGE`` in one line on stderr, as a stage's error is, the message as written: never
    read as rich markup (a path may hold ``[/x]``), its control characters escaped (``errors.one_line``)."""
    from rich.text import Text

    with suppress(OSError):  # what was said before it comes before it, where both streams meet
        sys.stdout.flush()
    _say(_console(stderr=True), Text.assemble(("error:", "red"), " ", one_line(message)))


def _leave(status: int) -> None:
    """Exit now, without waiting for the threads that follow a cluster's stages (they run on, and
    a later run follows them): everything of the run is recorded and its lock released already."""
    for stream in (sys.stdout, sys.stderr):
        with suppress(OSError):
            stream.flush()
    os._exit(status)


def _print_metrics(console, run_dir: str, iterations: int, pass_threshold: float | None) -> None:
    from rich.table import Table

    from llamarl.pipeline.metrics import iteration_metrics

    rows = iteration_metrics(run_dir, iterations, pass_threshold)
    if not rows:
        return
    table = Table(title="per iteration (score: mean of that iteration's rollout)")
    columns = {"iteration": "iteration", "mean score": "mean_score", "KL": "kl", "policy loss": "policy_loss",
               "value loss": "value_loss", "entropy": "entropy"}
    if any("val_score" in r for r in rows):
        columns["val score"] = "val_score"
    for col in columns:
        table.add_column(col, justify="right")
    for r in rows:
        table.add_row(*(_cell(r.get(key)) for key in columns.values()))
    console.print(table)
    console.print(f"plot: {run_dir}/metrics.png   export: {run_dir}/export", markup=False, soft_wrap=True)


def _cell(value) -> str:
    if value is None:  # no step defines it (the value loss without a critic)
        return "–"
    return str(value) if isinstance(value, int) else f"{value:.4f}"


@app.command("status")
def status_cmd(run: str = typer.Argument(..., help="Run directory (STORAGE/NAME)."),
               every: bool = typer.Option(False, "--all", help="A row for every stage: a long run otherwise "
                                                               "folds its runs of done or pending stages.")):
    """Show the run's stages: done / running / failed / pending, and why."""
    from rich.table import Table
    from rich.text import Text

    from llamarl.pipeline.status import folded, status, summary

    console = _console()
    try:
        rows = status(run)
    except UserError as e:
        _error(str(e))
        raise typer.Exit(EXIT_USER_ERROR)
    colors = {"done": "green", "failed": "red", "running": "yellow", "stale": "yellow"}
    table = Table(title=Text(run))
    for col in ("stage", "state", "why"):
        table.add_column(col)
    for name, state, why in rows if every else folded(rows):
        table.add_row(Text(name), Text(state, style=colors.get(state, "white")), Text(why))
    console.print(table)
    console.print(summary(rows), highlight=False, markup=False)
    from llamarl.pipeline.lock import RunLock

    holder = RunLock(run).holder()
    console.print(f"being run by {holder}" if holder else "no `llamarl run` holds this run now", highlight=False,
                  markup=False)


def _field(model, name: str, *decls: str, **kw):
    """A command-line option for a config field: its default and its help come from the model, so
    the flag and the YAML option can never disagree."""
    field = model.model_fields[name]
    return typer.Option(None if field.is_required() else field.default, *decls, help=field.description, **kw)


def _run_local(stage: str, config: StageConfig, made: str) -> None:
    """Run the stage on this machine; then print ``made``, where its output is (a folder this user
    can make, checked before any rank starts)."""
    from llamarl.cluster.local import LocalExecutor
    from llamarl.pipeline.checks import check_folder, check_outside_outputs

    field = "DST" if stage in ("shard", "export") else "OUT"
    try:
        check_folder(made, f"llamarl stage {stage}", field)
        check_outside_outputs(made, f"llamarl stage {stage}", field)
    except UserError as e:
        _fail(str(e))
    try:
        with stopped_by_signals():
            result = LocalExecutor().run(stage, config, processes(config))
    except Stopped as e:  # the stage's processes are gone
        typer.echo(f"error: llamarl stage {stage} got {e.name}: its processes are stopped; rerun it to resume",
                   err=True)
        raise typer.Exit(e.exit_status)
    if not result.ok:  # the stage has printed its error
        raise typer.Exit(result.code)
    typer.echo(made)


@stage_app.command("shard")
def shard(
    src: str = typer.Argument(..., help="HF checkpoint directory (any fsspec URL)."),
    dst: str = typer.Argument(..., help="Output directory for the sharded checkpoint."),
    tp: int = _field(ShardConfig, "tp"),
    pp: int = _field(ShardConfig, "pp"),
    dtype: str = _field(ShardConfig, "dtype"),
):
    """HF checkpoint → sharded checkpoint (loadable at any TP×PP)."""
    given = {"src": src, "dst": dst, "tp": tp, "pp": pp, "dtype": dtype}
    _run_local("shard", _config(ShardConfig, None, given, ("src", "dst")), dst)


@stage_app.command("export")
def export(
    src: str = typer.Argument(..., help="A sharded checkpoint directory."),
    dst: str = typer.Argument(..., help="Output HF directory."),
    dtype: str = _field(ExportConfig, "dtype"),
    max_shard_gb: float = _field(ExportConfig, "max_shard_gb"),
    procs: int = _field(ExportConfig, "procs"),
    verify: bool = _field(ExportConfig, "verify", "--verify/--no-verify"),
):
    """Sharded checkpoint → HF safetensors directory (transformers loads it)."""
    given = {"src": src, "dst": dst, "dtype": dtype, "max_shard_gb": max_shard_gb, "verify": verify, "procs": procs}
    _run_local("export", _config(ExportConfig, None, given, ("src", "dst")), dst)


def _fail(message: str):
    typer.echo(f"error: {one_line(message)}", err=True)
    raise typer.Exit(EXIT_USER_ERROR)


def _config(cls: type[StageConfig], config: str | None, given: dict, arguments: tuple[str, ...], **flags: str):
    """A stage's config from its ``--config`` file and its command line (``given``: the fields its
    arguments and flags set); a bad value or file is one line naming the file's field, the flag
    (``--tp``; ``flags`` where it is not the field's name), the argument (``SRC``) or the file."""
    from llamarl.lib.files import yamlfile

    names = {k: k.upper() if k in arguments else flags.get(k, "--" + k.replace("_", "-")) for k in given}
    try:
        # The file first, on its own: it may not set what the command line sets (which would
        # silently win), and its errors name the file.
        options = {}
        if config:
            with open(config) as f:
                data = yamlfile.load(f, config) or {}
            options = validate(options_model(cls), data, Source(config, names=names)).model_dump()
        return validate(cls, options | given, Source("", names=names))
    except FileNotFoundError:
        _fail(f"{config}: no such options file; check the --config path")
    except (OSError, UnicodeDecodeError) as e:
        _fail(f"{config}: cannot be read as an options file ({unreadable(e)}); check the --config path")
    except UserError as e:
        _fail(str(e))


def epilog(cls: type[StageConfig], *more: str) -> str:
    """The YAML options of a stage command (those the command line does not set), for ``--help``."""
    wired = tuple(name for name, f in cls.model_fields.items() if kind_of(f) in WIRED)
    return "\n\n".join(["Options for --config (YAML):", *describe(cls, wired), *more])


def _rules_epilog() -> str:
    return "\n\n".join(["Built-in rules, as rewards: [{name: NAME, weight: W, args: {ARG: VALUE}}] (the response and "
                         "its row are passed first):", *describe_rules()])


def _check_rollout_inputs(cfg: RolloutConfig) -> None:
    """What the rollout's ranks would refuse first, refused here before any of them starts (each
    imports torch: seconds): an actor that is no published checkpoint, a prompts file with a bad
    row (every row checked, stages/prompts.py; torch-free). The ranks check again: the files may
    change in between."""
    from llamarl.stages import contract, prompts

    try:
        contract.require_checkpoint(cfg.actor.rstrip("/"), "lm", "rollout's actor")
        prompts.check_dataset(cfg.prompts, prompts.Columns.of(cfg), cfg.index_cache)
    except UserError as e:
        _fail(str(e))


@stage_app.command("rollout", epilog=epilog(RolloutConfig))
def rollout(
    actor: str = typer.Argument(..., help="Published actor checkpoint."),
    prompts: str = typer.Argument(..., help="Parquet or JSONL prompts (file or folder, any fsspec URL)."),
    out: str = typer.Argument(..., help="Output folder for the Parquet parts."),
    tp: int = _field(RolloutConfig, "tp"),
    dp: int = _field(RolloutConfig, "dp"),
    config: str = typer.Option(None, help="YAML with further options (sampling, columns, chunk_size…)."),
):
    """Actor + prompts → responses with log-probs (Parquet parts, resumable)."""
    cfg = _config(RolloutConfig, config, {"actor": actor, "prompts": prompts, "out": out, "tp": tp, "dp": dp},
                  ("actor", "prompts", "out"))
    _check_rollout_inputs(cfg)
    _run_local("rollout", cfg, out)


@stage_app.command("score", epilog=epilog(ScoreConfig, _rules_epilog()))
def score(
    rollout: str = typer.Argument(..., help="Published rollout folder."),
    out: str = typer.Argument(..., help="Output folder for the scores."),
    rm: str = typer.Option(None, "--rm", help="Published reward-model checkpoint (for the 'rm' term)."),
    tp: int = _field(ScoreConfig, "tp"),
    pp: int = _field(ScoreConfig, "pp"),
    dp: int = _field(ScoreConfig, "dp"),
    config: str = typer.Option(None, help="YAML with further options (rewards, references, max_length…)."),
):
    """Rollout → scores from a reward model and/or rule-based rewards (Parquet, resumable)."""
    given = {"rollout": rollout, "out": out, "reward_model": rm, "tp": tp, "pp": pp, "dp": dp}
    _run_local("score", _config(ScoreConfig, config, given, ("rollout", "out"), reward_model="--rm"), out)


@stage_app.command("ppo", epilog=epilog(PPOConfig))
def ppo(
    rollout: str = typer.Argument(..., help="Published rollout folder."),
    scores: str = typer.Argument(..., help="Published scores of that rollout."),
    actor: str = typer.Argument(..., help="Actor checkpoint to update."),
    out: str = typer.Argument(..., help="Output folder: actor/, critic/, metrics.jsonl."),
    critic: str = typer.Option(None, help="Critic checkpoint (default: the actor's backbone, zero value head)."),
    reference: str = typer.Option(None, help="Frozen reference (default: the actor)."),
    tp: int = _field(PPOConfig, "tp"),
    pp: int = _field(PPOConfig, "pp"),
    dp: int = _field(PPOConfig, "dp"),
    config: str = typer.Option(None, help="YAML with PPO options (lr, clip, kl, epochs, batch sizes…)."),
):
    """Rollout + scores → updated actor and critic (one PPO iteration, resumable)."""
    given = {"rollout": rollout, "scores": scores, "actor": actor, "out": out, "critic": critic, "reference": reference,
             "tp": tp, "pp": pp, "dp": dp}
    _run_local("ppo", _config(PPOConfig, config, given, ("rollout", "scores", "actor", "out")), out)


if __name__ == "__main__":
    app()
