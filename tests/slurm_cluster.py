"""A real one-node Slurm cluster for the tests (Debian's slurm-wlm and munge, run as root).

``start(tmp)`` writes a minimal slurm.conf under ``tmp``, starts munged, slurmctld and slurmd,
and waits until the node is idle; ``stop`` ends the daemons it started. Any failure raises with
the daemons' logs: the Slurm tests fail loudly rather than skip.
"""

from __future__ import annotations

import glob
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time

LAUNCHED_S = 8  # a relaunch that fails shows the job running for a few seconds first (2.5 s seen, loaded)


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

    def _write_conf(self, controller: tuple[str, str] | None = None, nodes: list[tuple[str, str]] | None = None,
                    ports: tuple[int, int] | None = None, spool: str | None = None) -> None:
        """``controller``/``nodes``: (name, address) pairs; default this host on 127.0.0.1.
        ``spool``: the slurmds' folder (default under the root; its unix sockets' paths must stay short)."""
        controller = controller or (self.host, "127.0.0.1")
        nodes = nodes or [controller]
        spool = spool or os.path.join(self.root, "spool")
        for d in ("state", "log", "run"):
            os.makedirs(os.path.join(self.root, d), exist_ok=True)
        for name, _ in nodes:
            os.makedirs(os.path.join(spool, name), exist_ok=True)
        cpus = os.cpu_count() or 1
        r = self.root
        ctld_port, slurmd_port = ports or (_free_port(), _free_port())
        node_lines = "".join(f"NodeName={name} NodeAddr={addr} CPUs={cpus} RealMemory=8000 State=UNKNOWN\n"
                             for name, addr in nodes)
        conf = f"""ClusterName=llamarl-test
SlurmctldHost={controller[0]}({controller[1]})
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
StateSaveLocation={r}/state
SlurmdSpoolDir={spool}/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd.%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd.%n.log
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
MpiDefault=none
SchedulerType=sched/backfill
{node_lines}PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP OverSubscribe=FORCE:4
"""
        with open(self.conf, "w") as f:
            f.write(conf)

    def _check_tools(self) -> None:
        for tool in ("slurmctld", "slurmd", "munged", "sinfo"):
            if shutil.which(tool) is None:
                raise SlurmError(f"{tool} not found: install Debian's slurm-wlm and munge (.ci/run does)")

    def start(self) -> Cluster:
        self._check_tools()
        self._write_conf()
        _start_munge()
        for daemon in ("slurmctld", "slurmd"):
            res = _run(daemon, env=self.env)
            if res.returncode != 0:
                raise SlurmError(f"{daemon} did not start: {res.stderr}{self.logs()}")
        self._wait_idle(1, lambda: _run("sinfo", "-h", "-N", "-o", "%T", env=self.env).stdout)
        return self

    def _wait_idle(self, n: int, sinfo) -> None:
        deadline, out = time.monotonic() + 60, ""
        while time.monotonic() < deadline:
            out = sinfo()
            if sum(state in ("idle", "mixed") for state in out.split()) == n:
                return
            time.sleep(0.5)
        raise SlurmError(f"the nodes never became idle (sinfo: {out!r}){self.logs()}")

    def logs(self) -> str:
        text = ""
        for p in sorted(glob.glob(os.path.join(self.root, "log", "*.log"))):
            text += f"\n--- {os.path.basename(p)}\n" + "".join(open(p).readlines()[-20:])
        return text

    def run(self, argv: list[str], check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """A Slurm command in the cluster's environment."""
        res = subprocess.run(argv, env={**self.env, **kw.pop("env", {})}, capture_output=True, text=True,
                             timeout=timeout, **kw)
        if check and res.returncode:
            raise SlurmError(f"{argv}: {res.stderr.strip()}{self.logs()}")
        return res

    def cancel_all(self, timeout_s: float = 60) -> None:
        """Cancel every job and wait until the queue is empty: what a failed test left (a job held
        after a requeue) would otherwise hold up the tests after it."""
        self.run(["scancel", "--user", "root"], check=False)
        deadline = time.monotonic() + timeout_s
        while self.run(["squeue", "-h", "-o", "%i"], check=False).stdout.strip() and time.monotonic() < deadline:
            time.sleep(0.5)

    def suspend(self, job_id: str) -> None:
        """Stop a running job's tasks where they are, so it cannot finish while a test looks at it."""
        self.run(["scontrol", "suspend", job_id])

    def requeue_suspended(self, job_id: str, timeout_s: float = 180) -> None:
        """``scontrol requeue`` a suspended job and start it again at once.

        A requeue of a running job races it: a fast stage may finish first and the test proves
        nothing, hence suspended. Slurm holds a job requeued while suspended, and delays any
        requeued job's start by minutes: both are undone once it is pending again."""
        self.run(["scontrol", "requeue", job_id])
        deadline = time.monotonic() + timeout_s
        # Its suspended tasks are killed first (slurmd, busy under a loaded CI, took over 60 s once).
        while (state := self.run(["squeue", "-h", "-j", job_id, "-o", "%T"], check=False).stdout.strip()) != "PENDING":
            if time.monotonic() > deadline:
                raise SlurmError(f"job {job_id} not pending {timeout_s} s after its requeue (state {state!r}){self.logs()}")
            time.sleep(0.2)
        self.run(["scontrol", "release", job_id])
        self.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"])
        # Its relaunch may fail while slurmd still tears the suspended tasks down (the spool's job
        # script still there, or already gone): Slurm then holds it again ("launch failed requeued
        # held"), seconds after it showed it running; release it. Done once it has stayed out of
        # the pending state for LAUNCHED_S.
        until, out_since = time.monotonic() + 60, None
        while time.monotonic() < until:
            row = self.run(["squeue", "-h", "-j", job_id, "-o", "%T %r"], check=False).stdout.strip()
            if not row.startswith("PENDING"):
                out_since = out_since or time.monotonic()
                if time.monotonic() - out_since > LAUNCHED_S:
                    break
            else:
                out_since = None
                if "held" in row.lower():
                    self.run(["scontrol", "release", job_id], check=False)
                    self.run(["scontrol", "update", f"JobId={job_id}", "StartTime=now"], check=False)
            time.sleep(0.5)

    def stop(self) -> None:
        # Cancel what still runs, and give its step daemons a moment to go, before the daemons.
        _run("scancel", "--user", "root", env=self.env)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _run("pgrep", "-f", "slurmstepd").returncode == 0:
            time.sleep(0.2)
        _run("pkill", "-9", "-f", "slurmstepd")  # it ignores SIGTERM
        for p in glob.glob(os.path.join(self.root, "run", "*.pid")):
            try:
                os.kill(int(open(p).read().strip()), signal.SIGTERM)
            except (ProcessLookupError, ValueError):
                pass


class TwoHostCluster(Cluster):
    """Slurm over the two hosts of ``tests/hosts.py``: slurmctld and a slurmd on host 1, a slurmd on
    host 2, each daemon in its host's network namespace with its hostname, so a two-node job's
    tasks run on two machines as far as Slurm, torch and the network can tell.

    Slurm's commands must run on a host too (the controller listens on host 1's address): ``run``.
    slurmd enters only its host's network (``nsenter``), not ``ip netns exec``'s fresh /sys, so the
    cgroup hierarchy it needs stays mounted; it gets the host's name table bound on /etc/hosts."""

    def __init__(self, root: str, hosts):
        super().__init__(root)
        self.hosts = hosts

    def start(self) -> TwoHostCluster:
        self._check_tools()
        h1 = self.hosts[0]
        self.spool = tempfile.mkdtemp(prefix="slurmd-", dir="/tmp")  # a pytest tmp path is too long for a socket
        self._write_conf(controller=(h1.hostname, h1.ip), nodes=[(h.hostname, h.ip) for h in self.hosts.hosts],
                         ports=(6817, 6818), spool=self.spool)  # each host has its own ports: no clash outside
        _start_munge()
        self.hosts.start(h1, ["slurmctld", "-D"], {"SLURM_CONF": self.conf}, stderr=subprocess.DEVNULL)
        for h in self.hosts.hosts:
            script = f'mount --bind /etc/netns/{h.netns}/hosts /etc/hosts && hostname {h.hostname} && exec "$@"'
            proc = subprocess.Popen(["nsenter", f"--net=/run/netns/{h.netns}", "unshare", "--mount", "--uts",
                                     "--propagation", "private", "sh", "-c", script, "sh", "slurmd", "-D", "-N",
                                     h.hostname], env=self.env, stderr=subprocess.DEVNULL, start_new_session=True)
            self.hosts.procs.append(proc)  # ended with the hosts
        self._wait_idle(2, lambda: self.run(["sinfo", "-h", "-N", "-o", "%T"], check=False).stdout)
        return self

    def run(self, argv: list[str], check: bool = True, timeout: float = 60, **kw) -> subprocess.CompletedProcess:
        """``argv`` on host 1 (where the controller's address is), in the cluster's environment."""
        res = subprocess.run(["ip", "netns", "exec", self.hosts[0].netns, *argv], env={**self.env, **kw.pop("env", {})},
                             capture_output=True, text=True, timeout=timeout, **kw)
        if check and res.returncode:
            raise SlurmError(f"{argv}: {res.stderr.strip()}{self.logs()}")
        return res

    def stop(self) -> None:
        self.run(["scancel", "--user", "root"], check=False)
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and _run("pgrep", "-f", "slurmstepd").returncode == 0:
            time.sleep(0.2)
        _run("pkill", "-9", "-f", "slurmstepd")
        self.hosts.close()  # the daemons run as the hosts' processes
        shutil.rmtree(self.spool, ignore_errors=True)


def _start_munge() -> None:
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


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
