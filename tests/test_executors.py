"""The Executor protocol: results with the stage's one-line error, render, option validation."""

from __future__ import annotations

import json
import shlex
import sys

import pytest
import yaml

from llamarl.cluster.executor import Executor, StageResult
from llamarl.cluster.kinds import make_executor, validate_options
from llamarl.cluster.local import LocalExecutor, LocalOptions
from llamarl.lib.errors import EXIT_USER_ERROR, UserError
from llamarl.stages.config import ShardConfig


def _shard(tmp_path) -> ShardConfig:
    return ShardConfig(src=str(tmp_path / "no-such-model"), dst=str(tmp_path / "out"), tp=2)


def test_local_result_carries_the_stages_one_line_error(tmp_path):
    result = LocalExecutor().run("shard", _shard(tmp_path), nprocs=2)
    assert result.code == EXIT_USER_ERROR and not result.ok
    assert result.error == f"{tmp_path}/no-such-model/config.json not found; point SRC at an HF checkpoint directory"


class _Scripted(LocalExecutor):
    """Runs a Python one-liner in place of the stage: the executor's bookkeeping, without torch."""

    def __init__(self, script: str, **options):
        super().__init__(LocalOptions(**options))
        self.script = script

    def command(self, stage, config):
        return [sys.executable, "-c", self.script]


def test_local_crash_without_an_error_line_reports_its_status(tmp_path):
    result = _Scripted("import os, sys; sys.exit(3 if os.environ['RANK'] == '1' else 0)").run("shard", _shard(tmp_path), 2)
    assert result == StageResult(3, "exit status 3")


def test_local_stops_the_others_after_a_failure(tmp_path):
    script = "import os, sys, time; sys.exit(1) if os.environ['RANK'] == '1' else time.sleep(60)"
    result = _Scripted(script, grace_s=0.2).run("shard", _shard(tmp_path), 2)
    assert not result.ok and result.error.startswith("exit status")


def test_local_success_is_ok(tmp_path):
    assert _Scripted("pass").run("shard", _shard(tmp_path), 2) == StageResult(0, None)


def test_local_render_is_each_process_with_its_environment(tmp_path):
    cfg = _shard(tmp_path)
    lines = LocalExecutor(LocalOptions(threads_per_process=4)).render("shard", cfg, nprocs=2).splitlines()
    assert lines[0].startswith("# shard: 2 process(es)")
    for rank, line in enumerate(lines[1:]):
        words = shlex.split(line)
        env = dict(w.split("=", 1) for w in words[:words.index(sys.executable)])
        assert env["RANK"] == env["LOCAL_RANK"] == str(rank) and env["WORLD_SIZE"] == "2"
        assert env["OMP_NUM_THREADS"] == "4"
        assert json.loads(words[words.index("--config-json") + 1]) == cfg.to_json()
    assert len(lines) == 3


def test_local_runs_on_one_node_only(tmp_path):
    with pytest.raises(UserError, match="local executor runs on this machine only"):
        LocalExecutor().render("shard", _shard(tmp_path), nprocs=2, nodes=2)


def test_slurm_render_shows_the_job_parameters_and_the_tasks_command(tmp_path):
    ex = make_executor("slurm", {"partition": "gpu", "account": "rl", "gpus_per_node": 8,
                                 "additional": {"qos": "high"}}, "/runs/r", "spec.yaml: executor.options")
    text = ex.render("rollout", _shard(tmp_path), nprocs=16, nodes=2, name="iter-001/rollout")
    assert "# a submitit job in /runs/r/pipeline/slurm/%j" in text
    for line in ("nodes: 2", "tasks_per_node: 8", "gpus_per_node: 8", "slurm_partition: gpu",
                 "name: llamarl-iter-001-rollout", "  account: rl", "  qos: high"):
        assert line in text.splitlines(), line
    assert text.splitlines()[-1].startswith("python -m llamarl.stages.rollout --config-json ")
    with pytest.raises(UserError, match="16 processes do not spread evenly over 3 nodes"):
        ex.render("rollout", _shard(tmp_path), nprocs=16, nodes=3)


def test_cluster_folders_default_to_the_run_directory():
    assert make_executor("slurm", {}, "/runs/r", "x").options.folder == "/runs/r/pipeline/slurm"
    assert make_executor("slurm", {"folder": "/s"}, "/runs/r", "x").options.folder == "/s"
    k8s = make_executor("kubernetes", {"image": "i", "pvc": "p"}, "/runs/r", "x")
    assert k8s.options.manifests_dir == "/runs/r/pipeline/k8s" and not k8s.launches
    assert make_executor("local", {}, "/runs/r", "x").launches


def _protocol_members() -> set[str]:
    from llamarl.cluster.executor import Executor

    return set(Executor.__annotations__) | {n for n, v in vars(Executor).items() if callable(v) and not n.startswith("_")}


@pytest.mark.parametrize("kind,options,detach,queue", [
    ("local", {}, None, False),
    ("local", {"resident": False}, None, False),
    ("slurm", {}, "jobs", True),
    ("kubernetes", {"image": "i", "pvc": "p"}, "driver", False),
])
def test_every_executor_implements_the_whole_protocol(kind, options, detach, queue):
    """The pipeline calls executors only through the protocol: every member is there, with the
    executor's own answer where it has one and the base's refusal where it has not."""
    ex = make_executor(kind, options, "/runs/r", "x")
    members = _protocol_members()
    assert {"submit", "wait", "run", "render", "stop_all", "close", "job_state", "submit_after", "start_driver",
            "launches", "concurrency", "detach", "prepare"} <= members
    assert not [m for m in members if not hasattr(ex, m)]
    assert ex.detach == detach
    if kind != "slurm":  # slurm asks squeue, which need not be here
        assert ex.job_state("123") is None
    if detach != "jobs":
        with pytest.raises(UserError, match="cannot submit a stage to start after others"):
            ex.submit_after("shard", None, 1, after=["1"])
    if detach != "driver":
        with pytest.raises(UserError, match="has no in-cluster driver"):
            ex.start_driver("/runs/r/pipeline/spec.yaml", "r")
    ex.stop_all()  # nothing started: nothing to stop, no error
    ex.close()
    assert queue == (type(ex).job_state is not Executor.job_state)


@pytest.mark.parametrize("kind,options,message", [
    ("local", {"threads": 2},
     "spec.yaml: executor.options: threads: unknown option; valid options: threads_per_process, grace_s"),
    ("local", {"threads_per_process": 0},
     "spec.yaml: executor.options: threads_per_process=0: Input should be greater than or equal to 1"),
    ("slurm", {"timeout_min": "soon"},
     "spec.yaml: executor.options: timeout_min='soon': Input should be a valid integer"),
    ("slurm", {"last_error": "x"}, "spec.yaml: executor.options: last_error: unknown option; valid options: folder, "),
    ("kubernetes", {"image": "i"}, "spec.yaml: executor.options: pvc: required, not given"),
    ("kubernetes", {"image": "i", "pvc": "p", "master_port": 70000},
     "spec.yaml: executor.options: master_port=70000: Input should be less than or equal to 65535"),
    ("lokal", {}, "spec.yaml: executor.options: 'lokal' is no executor kind; use one of local, slurm, kubernetes"),
])
def test_bad_options_are_one_line_errors_naming_the_field(kind, options, message):
    with pytest.raises(UserError) as e:
        validate_options(kind, options, "spec.yaml: executor.options")
    assert str(e.value).startswith(message) and "\n" not in str(e.value)
    with pytest.raises(UserError, match="^spec.yaml: executor.options: "):
        make_executor(kind, options, "/runs/r", "spec.yaml: executor.options")


def test_options_documented():
    from llamarl.cluster.kubernetes import KubernetesOptions
    from llamarl.cluster.slurm import SlurmOptions

    for model in (LocalOptions, SlurmOptions, KubernetesOptions):
        undocumented = [name for name, f in model.model_fields.items() if not f.description]
        assert not undocumented, (model.__name__, undocumented)


def test_the_pipeline_records_a_failed_stage_with_its_one_line_error(tmp_path):
    from llamarl.pipeline import demo
    from llamarl.pipeline.dag import build_dag, load_spec
    from llamarl.pipeline.records import read_record
    from llamarl.pipeline.run import PipelineError, run_spec

    data = yaml.safe_load(open(demo.make_inputs(str(tmp_path))))
    (tmp_path / "empty").mkdir()
    data.update(name="broken", actor=str(tmp_path / "empty"))
    (tmp_path / "broken.yaml").write_text(yaml.safe_dump(data))
    spec = load_spec(str(tmp_path / "broken.yaml"))
    error = f"{tmp_path}/empty/config.json not found; point SRC at an HF checkpoint directory"
    with pytest.raises(PipelineError, match=f"stage shard/actor failed \\({error}\\)"):
        run_spec(spec, echo=lambda m: None)
    shard_actor = build_dag(spec)[0]
    assert shard_actor.name == "shard/actor" and read_record(spec.run_dir, shard_actor)["error"] == error


def test_free_ports_come_from_below_the_ephemeral_range():
    """Outgoing connections take their ports from the ephemeral range: a rendezvous port drawn
    there (binding port 0) was now and then taken before the stage bound it."""
    import socket

    from llamarl.cluster.executor import free_port

    low = int(open("/proc/sys/net/ipv4/ip_local_port_range").read().split()[0])
    ports = {free_port() for _ in range(20)}
    assert all(p < low for p in ports) and len(ports) > 1
    with socket.create_server(("", ports.pop())):
        pass  # and free to listen on


# ---- a stage's processes: each leads a process group, stopped whole (#27) ----------------------------

_WITH_CHILD = ("import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); "
               "{then}")


class _Registry:
    """A ProcessRegistry that remembers what it was told."""

    def __init__(self):
        self.groups, self.gone = {}, []

    def started(self, name, groups):
        self.groups[name] = groups

    def ended(self, name):
        self.gone.append(name)


def test_stop_all_kills_every_process_of_each_stage_and_waits_for_them(tmp_path):
    """A stage's ranks and what they started (a rollout's tokenizer process) are stopped together."""
    import threading
    import time

    from llamarl.cluster.local import survivors

    executor = _Scripted(_WITH_CHILD.format(then="time.sleep(60)"))
    executor.registry = seen = _Registry()
    results = []
    thread = threading.Thread(target=lambda: results.append(executor.run("shard", _shard(tmp_path), 2, name="iter-001/x")))
    thread.start()
    deadline = time.monotonic() + 60
    while not seen.groups or sum(map(len, survivors(seen.groups["iter-001/x"]).values())) < 4:
        assert time.monotonic() < deadline, "the stage's processes and their children did not start"
        time.sleep(0.02)
    groups = seen.groups["iter-001/x"]
    assert executor.stop_all() == ["iter-001/x"]
    assert survivors(groups) == {}  # all four gone when stop_all returns
    thread.join(30)
    assert results and not results[0].ok and seen.gone == ["iter-001/x"]
    with pytest.raises(UserError, match="not started: the run is stopping"):
        executor.run("shard", _shard(tmp_path), 1, name="iter-001/y")


def test_what_a_stage_started_ends_with_it(tmp_path):
    from llamarl.cluster.local import survivors

    executor = _Scripted(_WITH_CHILD.format(then="sys.exit(0)"))
    executor.registry = seen = _Registry()
    assert executor.run("shard", _shard(tmp_path), 2, name="s").ok
    assert survivors(seen.groups["s"]) == {} and seen.gone == ["s"]


def test_the_user_error_of_one_rank_is_the_stages_and_shown_once(tmp_path, capfd):
    """Rank 1's write failed (a full disk, its one line, status 2); rank 0 then lost its peer
    (status 3): the stage failed for rank 1's reason. A line several ranks print shows once."""
    script = ("import os, sys, time\nrank = os.environ['RANK']\nprint('error: same on every rank', file=sys.stderr)\n"
              "if rank == '1':\n    print('error: /out: no space left on device', file=sys.stderr); sys.exit(2)\n"
              "time.sleep(0.3); print('error: rank 0: lost rank 1', file=sys.stderr); sys.exit(3)\n")
    result = _Scripted(script).run("shard", _shard(tmp_path), 2)
    assert result == StageResult(EXIT_USER_ERROR, "/out: no space left on device")
    assert capfd.readouterr().err.count("error: same on every rank") == 1


def test_the_local_executor_runs_resident_workers_unless_told_not_to():
    from llamarl.cluster.resident import ResidentExecutor

    assert type(make_executor("local", {}, "/runs/r", "x")) is ResidentExecutor
    assert type(make_executor("local", {"resident": False}, "/runs/r", "x")) is LocalExecutor
