"""Two "hosts" on one machine, for multi-host tests: network namespaces joined by a veth pair.

Each host is a network namespace with its own interface, IP address and hostname, and a hosts
table (``/etc/netns/<ns>/hosts``, which ``ip netns exec`` bind-mounts over ``/etc/hosts``) naming
both, so a process started on host 1 resolves host 2's name to host 2's address exactly as on a
real cluster. Processes start through ``ip netns exec NS unshare --uts``, which gives each its own
hostname: gloo finds the address it listens on from ``gethostname()`` resolved through that table,
so it binds the host's own interface, not loopback. The filesystem is not separated: the hosts
share the test's storage directory as cluster nodes share their network storage.

Names carry this process's pid, so parallel sessions never clash; namespaces left by a session that
was killed (its pid gone) are removed when the next one starts. Everything made here — processes,
namespaces with their veth ends, ``/etc/netns`` directories — is removed by ``close``, which the
``two_hosts`` fixture calls also when the test fails. Needs root (CAP_NET_ADMIN, CAP_SYS_ADMIN);
elsewhere the fixture skips with the reason.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import subprocess
import sys
from dataclasses import dataclass, field

import pytest

PREFIX = "llamarl-"
NETNS_ETC = "/etc/netns"
SUBNET = "10.231.0"  # namespaces are isolated from each other, so every pair may use the same one


@dataclass(frozen=True)
class Host:
    hostname: str
    netns: str
    ip: str


@dataclass
class Hosts:
    """A set of hosts (``hosts[0]`` is host 1) and the processes started on them."""

    hosts: list[Host]
    procs: list[subprocess.Popen] = field(default_factory=list)

    def __getitem__(self, i: int) -> Host:
        return self.hosts[i]

    def __len__(self) -> int:
        return len(self.hosts)

    def start(self, host: Host, argv: list[str], env: dict[str, str] | None = None, **popen) -> subprocess.Popen:
        """Start ``argv`` on ``host``: in its network namespace, with its hostname, with ``env``
        added to this process's environment. It leads its own process group, so that ``kill``
        reaches whatever it started."""
        wrapped = ["ip", "netns", "exec", host.netns, "unshare", "--uts",
                   "sh", "-c", 'hostname "$0" && exec "$@"', host.hostname, *argv]
        proc = subprocess.Popen(wrapped, env={**os.environ, **(env or {})}, start_new_session=True, **popen)
        self.procs.append(proc)
        return proc

    def run(self, host: Host, argv: list[str], timeout: float = 30) -> str:
        """``argv`` on ``host`` to its end; its stdout. A short command, e.g. to look around."""
        proc = self.start(host, argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        out, err = proc.communicate(timeout=timeout)
        if proc.returncode:
            raise RuntimeError(f"{argv} on {host.hostname}: exit status {proc.returncode}: {err.strip()}")
        return out

    def add_names(self, names: dict[str, Host]) -> None:
        """Make every host resolve each name to the given host's address (as a cluster's DNS
        would, e.g. a Kubernetes headless service's pod names)."""
        for h in self.hosts:
            with open(os.path.join(NETNS_ETC, h.netns, "hosts"), "a") as f:
                f.write("".join(f"{target.ip} {name}\n" for name, target in names.items()))

    def free_port(self, host: Host) -> int:
        """A TCP port nobody listens on in ``host``'s namespace (the kernel's choice, as torchrun's)."""
        code = "import socket; s = socket.socket(); s.bind(('', 0)); print(s.getsockname()[1])"
        return int(self.run(host, [sys.executable, "-c", code]))

    @staticmethod
    def kill(proc: subprocess.Popen, sig: int = signal.SIGKILL) -> None:
        """Signal a started process's whole group (the stage process and anything it forked)."""
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            pass

    @staticmethod
    def kill_all(host: Host, sig: int = signal.SIGKILL) -> None:
        """Signal every process in ``host``'s network namespace: what a machine (or a pod, its
        container) going away does to all of them — torchrun's workers lead sessions of their own,
        out of reach of a signal to the group that started them."""
        pids = subprocess.run(["ip", "netns", "pids", host.netns], capture_output=True, text=True).stdout.split()
        for pid in pids:
            try:
                os.kill(int(pid), sig)
            except ProcessLookupError:
                pass

    def close(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                self.kill(proc)
            proc.wait()
        self.procs.clear()
        for host in self.hosts:
            self.kill_all(host)  # what the started processes left running (torchrun's workers)
            _remove(host.netns)


def make_two_hosts() -> Hosts:
    """Two hosts joined by a veth pair (more would need a bridge in a namespace of its own)."""
    _remove_stale()
    pid = os.getpid()
    hosts = Hosts([Host(f"host{i}-{pid}", f"{PREFIX}{pid}-h{i}", f"{SUBNET}.{i}") for i in (1, 2)])
    try:
        for h in hosts.hosts:
            _ip("netns", "add", h.netns)
            _ip("-n", h.netns, "link", "set", "lo", "up")
        # Interface names are limited to 15 characters; each end lives only in its own namespace.
        ends = [f"lrl{pid}a", f"lrl{pid}b"]
        _ip("link", "add", ends[0], "netns", hosts[0].netns, "type", "veth", "peer", "name", ends[1], "netns",
            hosts[1].netns)
        for h, end in zip(hosts.hosts, ends):
            _ip("-n", h.netns, "addr", "add", f"{h.ip}/24", "dev", end)
            _ip("-n", h.netns, "link", "set", end, "up")
            etc = os.path.join(NETNS_ETC, h.netns)
            os.makedirs(etc)
            with open(os.path.join(etc, "hosts"), "w") as f:
                f.write("127.0.0.1 localhost\n" + "".join(f"{o.ip} {o.hostname}\n" for o in hosts.hosts))
            with open(os.path.join(etc, "hostname"), "w") as f:
                f.write(h.hostname + "\n")
    except BaseException:
        hosts.close()
        raise
    return hosts


def unavailable() -> str | None:
    """Why hosts cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespaces need root (CAP_NET_ADMIN)"
    missing = [tool for tool in ("ip", "unshare", "hostname") if shutil.which(tool) is None]
    if missing:
        return f"missing {', '.join(missing)}"
    probe = f"{PREFIX}{os.getpid()}-probe"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True)
    if made.returncode:
        return f"'ip netns add' is not permitted here: {made.stderr.strip()}"
    _remove(probe)
    return None


@pytest.fixture
def two_hosts():
    reason = unavailable()
    if reason:
        pytest.skip(reason)
    hosts = make_two_hosts()
    yield hosts
    hosts.close()


def _ip(*args: str) -> None:
    done = subprocess.run(["ip", *args], capture_output=True, text=True)
    if done.returncode:
        raise RuntimeError(f"ip {' '.join(args)}: {done.stderr.strip()}")


def _remove(netns: str) -> None:
    # Deleting a namespace deletes the veth end in it, and with it the peer.
    subprocess.run(["ip", "netns", "delete", netns], capture_output=True)
    shutil.rmtree(os.path.join(NETNS_ETC, netns), ignore_errors=True)


def _remove_stale() -> None:
    """Remove the namespaces of sessions whose process is gone (killed before their teardown)."""
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    for line in listed.splitlines():
        m = re.match(rf"({PREFIX}(\d+)-\S+)", line)
        if m and not os.path.exists(f"/proc/{m.group(2)}"):
            _remove(m.group(1))
