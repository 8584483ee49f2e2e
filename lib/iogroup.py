"""A process group without torch, for stages that only move bytes (shard, export).

Such a stage needs few collectives — agree on errors, gather what each rank wrote, wait for rank 0
to publish — and none of them carries tensors; ``torch.distributed`` would cost every process
the torch import (4.5 s on the GPU machines) before its first byte. ``IOGroup`` does them over
TCP, every rank connected to rank 0 (a star: the objects are small), from the environment
torchrun and our executors give every process (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT).
Objects travel pickled, as ``torch.distributed``'s object collectives send them: the group's
processes trust each other, and a stranger is turned away by the job's token in the handshake.

Failure is one line on every rank, within ``timeout_s``: a rank that dies closes its socket, and
rank 0 names it to the others before it stops (``PeerLost``); a rank that never connects is
named after the rendezvous timeout.
"""

from __future__ import annotations

import hashlib
import os
import pickle
import socket
import struct
import time

_HEADER = struct.Struct("<Q")


class PeerLost(ConnectionError):
    """Another process of the stage is gone (or never came); the message names it."""


def _send(sock: socket.socket, obj) -> None:
    data = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
    sock.sendall(_HEADER.pack(len(data)) + data)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view, got = memoryview(buf), 0
    while got < n:
        k = sock.recv_into(view[got:])
        if k == 0:
            raise EOFError
        got += k
    return bytes(buf)


def _recv(sock: socket.socket):
    (n,) = _HEADER.unpack(_recv_exact(sock, _HEADER.size))
    return pickle.loads(_recv_exact(sock, n))


def port_of(env=os.environ) -> int:
    """The group's port: MASTER_PORT, or the next one where torchrun's agent holds MASTER_PORT
    (its rendezvous store) for the workers."""
    port = int(env.get("MASTER_PORT", 29500))
    return port + 1 if env.get("TORCHELASTIC_USE_AGENT_STORE", "").lower() == "true" else port


class IOGroup:
    """Collectives of small picklable objects among a stage's processes; every rank calls each
    one, in the same order."""

    def __init__(self, rank: int, world: int, addr: str, port: int, timeout_s: float, token: str = ""):
        self.rank, self.world, self.timeout_s = rank, world, timeout_s
        self._where = f"{addr}:{port}"
        self._token = hashlib.sha256(f"{token}|{world}".encode()).hexdigest()
        self._peers: dict[int, socket.socket] = {}  # rank 0: every other rank's socket
        self._root: socket.socket | None = None  # other ranks: rank 0's
        if world == 1:
            return
        if rank == 0:
            self._accept(addr, port)
        else:
            self._connect(addr, port)

    @classmethod
    def from_env(cls, timeout_s: float, token: str = "") -> IOGroup:
        env = os.environ
        return cls(int(env.get("RANK", 0)), int(env.get("WORLD_SIZE", 1)), env.get("MASTER_ADDR", "127.0.0.1"),
                   port_of(env), timeout_s, token)

    # ---- rendezvous --------------------------------------------------------------------------

    def _accept(self, addr: str, port: int) -> None:
        server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        server.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            server.bind(("", port))
        except OSError as e:
            raise PeerLost(f"rank 0 cannot listen on port {port} ({e.strerror}); is another job using it?") from None
        server.listen(self.world)
        deadline = time.monotonic() + self.timeout_s
        try:
            while len(self._peers) < self.world - 1:
                server.settimeout(max(0.01, deadline - time.monotonic()))
                try:
                    sock, _ = server.accept()
                except socket.timeout:
                    missing = sorted(set(range(1, self.world)) - set(self._peers))
                    raise PeerLost(f"ranks {missing} did not join the rendezvous at {self._where} within "
                                   f"{self.timeout_s:g} s; check that every node started and can reach it") from None
                sock.settimeout(self.timeout_s)
                try:
                    token, rank = _recv(sock)
                except (OSError, EOFError, pickle.UnpicklingError, ValueError):
                    sock.close()
                    continue
                if token != self._token or not 0 < rank < self.world or rank in self._peers:
                    sock.close()  # not one of ours (another job, a stale process)
                    continue
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                self._peers[rank] = sock
        finally:
            server.close()
        for sock in self._peers.values():
            _send(sock, "ready")

    def _connect(self, addr: str, port: int) -> None:
        deadline = time.monotonic() + self.timeout_s
        while True:
            try:
                sock = socket.create_connection((addr, port), timeout=max(0.01, deadline - time.monotonic()))
                sock.settimeout(self.timeout_s)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                _send(sock, (self._token, self.rank))
                if _recv(sock) == "ready":
                    self._root = sock
                    return
            except (OSError, EOFError):
                pass
            if time.monotonic() > deadline:
                raise PeerLost(f"rank {self.rank}: could not join the rendezvous at {self._where} within "
                               f"{self.timeout_s:g} s; check that rank 0 started and can be reached there")
            time.sleep(0.05)

    # ---- collectives -------------------------------------------------------------------------

    def all_gather(self, obj) -> list:
        """Every rank's ``obj``, by rank, on every rank."""
        if self.world == 1:
            return [obj]
        if self.rank != 0:
            self._to_root(obj)
            return self._from_root()
        out = [obj] + [self._from_peer(r) for r in range(1, self.world)]
        self._to_peers(("ok", out))
        return out

    def broadcast(self, obj=None):
        """Rank 0's ``obj`` on every rank."""
        if self.world == 1:
            return obj
        if self.rank != 0:
            return self._from_root()
        self._to_peers(("ok", obj))
        return obj

    def barrier(self) -> None:
        self.all_gather(None)

    def close(self) -> None:
        for sock in [*self._peers.values(), *([self._root] if self._root else [])]:
            sock.close()
        self._peers, self._root = {}, None

    def _to_root(self, obj) -> None:
        try:
            _send(self._root, obj)
        except OSError:
            self._from_root()  # rank 0 may have said who was lost before it went
            raise PeerLost(f"rank {self.rank}: lost rank 0 at {self._where}") from None

    def _from_root(self):
        try:
            kind, obj = _recv(self._root)
        except socket.timeout:
            raise PeerLost(f"rank {self.rank}: rank 0 did not answer within {self.timeout_s:g} s") from None
        except (OSError, EOFError):
            raise PeerLost(f"rank {self.rank}: lost rank 0 at {self._where}") from None
        if kind == "lost":
            raise PeerLost(f"rank {self.rank}: {obj}")
        return obj

    def _from_peer(self, rank: int):
        try:
            return _recv(self._peers[rank])
        except socket.timeout:
            error = f"rank {rank} did not answer within {self.timeout_s:g} s"
        except (OSError, EOFError):
            error = f"lost rank {rank}"
        self._to_peers(("lost", error))
        raise PeerLost(f"rank 0: {error}")

    def _to_peers(self, message) -> None:
        lost = []
        for rank, sock in self._peers.items():
            try:
                _send(sock, message)
            except OSError:
                lost.append(rank)
        if lost and message[0] != "lost":
            self._to_peers(("lost", f"lost rank {lost[0]}"))
            raise PeerLost(f"rank 0: lost rank {lost[0]}")
