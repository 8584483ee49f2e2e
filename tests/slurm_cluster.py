"""A real one-node Slurm cluster for the tests (Debian's slurm-wlm and munge, run as root).

``start(tmp)`` writes a minimal slurm.conf under ``tmp``, starts munged, slurmctld and slurmd,
and waits until the node is idle; ``stop`` ends the daemons it started. Any failure raises with
the daemons' logs: the Slurm tests fail loudly rather than skip.
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import time


class SlurmError(RuntimeError):
    pass


def _run(*cmd, **kw):
    return subprocess.run(list(cmd), capture_output=True, text=True, **kw)


class Cluster:
    def __init__(self, root: str):
        self.root = root
        self.host = socket.gethostname().split(".")[0]
        self.conf = os.path.join(root, "slurm.conf")
        self.env = {**os.environ, "SLURM_CONF": self.conf}
        self.pids: list[str] = []

    def _write_conf(self) -> None:
        for d in ("state", "spool", "log", "run"):
            os.makedirs(os.path.join(self.root, d), exist_ok=True)
        cpus = os.cpu_count() or 1
        r = self.root
        conf = f"""ClusterName=llamarl-test
SlurmctldHost={self.host}(127.0.0.1)
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.log
SlurmctldPort={_free_port()}
SlurmdPort={_free_port()}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SchedulerType=sched/backfill
NodeName={self.host} NodeAddr=127.0.0.1 CPUs={cpus} RealMemory=8000 State=UNKNOWN
PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""
        with open(self.conf, "w") as f:
            f.write(conf)

    def start(self) -> Cluster:
        for tool in ("slurmctld", "slurmd", "munged", "sinfo"):
            if shutil.which(tool) is None:
                raise SlurmError(f"{tool} not found: install Debian's slurm-wlm and munge (.ci/run does)")
        self._write_conf()
        if _run("pgrep", "-x", "munged").returncode != 0:
            if not os.path.exists("/etc/munge/munge.key"):
                _run("mungekey", "-c")
            os.makedirs("/run/munge", exist_ok=True)
            _run("chown", "-R", "munge:munge", "/etc/munge", "/run/munge", "/var/lib/munge", "/var/log/munge")
            started = _run("runuser", "-u", "munge", "--", "munged")
            if started.returncode != 0:
                started = _run("munged", "--force")
            if started.returncode != 0:
                raise SlurmError(f"munged did not start: {started.stderr}")
        for daemon in ("slurmctld", "slurmd"):
            res = _run(daemon, env=self.env)
            if res.returncode != 0:
                raise SlurmError(f"{daemon} did not start: {res.stderr}{self.logs()}")
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            out = _run("sinfo", "-h", "-o", "%T", env=self.env).stdout.strip()
            if out in ("idle", "mixed"):
                return self
            time.sleep(0.5)
        raise SlurmError(f"the node never became idle (sinfo: {out!r}){self.logs()}")

    def logs(self) -> str:
        text = ""
        for name in ("slurmctld.log", "slurmd.log"):
            p = os.path.join(self.root, "log", name)
            if os.path.exists(p):
                text += f"\n--- {name}\n" + "".join(open(p).readlines()[-20:])
        return text

    def stop(self) -> None:
        # Cancel what still runs, and give its step daemons a moment to go, before the daemons.
        _run("scancel", "--user", "root", env=self.env)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _run("pgrep", "-f", "slurmstepd").returncode == 0:
            time.sleep(0.2)
        _run("pkill", "-9", "-f", "slurmstepd")  # it ignores SIGTERM
        for name in ("slurmd.pid", "slurmctld.pid"):
            p = os.path.join(self.root, "run", name)
            if os.path.exists(p):
                try:
                    os.kill(int(open(p).read().strip()), signal.SIGTERM)
                except (ProcessLookupError, ValueError):
                    pass


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
