"""Collectives over the stage's process group for the work around the model: objects gathered and
broadcast, barriers, and errors agreed on, so that no rank is left waiting in a collective and every
rank raises the same one line. In a world of one (or a process outside any group) they run no
collective: on NCCL the first one would build a communicator, most of a second.
"""

from __future__ import annotations

import sys

from llamarl.lib.errors import UserError


def _dist():
    """torch.distributed when this process is in its process group, else None (without importing
    torch: a process that never imported it is in no such group)."""
    dist = sys.modules.get("torch.distributed")
    return dist if dist is not None and dist.is_available() and dist.is_initialized() else None


def joined() -> bool:
    """Whether this process is in a process group."""
    return _dist() is not None


def rank_world() -> tuple[int, int]:
    if (dist := _dist()) is not None:
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def all_gather_object(obj) -> list:
    """Collective: every rank's ``obj``, by rank."""
    if (dist := _dist()) is not None and dist.get_world_size() > 1:
        out: list = [None] * dist.get_world_size()
        dist.all_gather_object(out, obj)
        return out
    return [obj]


def broadcast_object(obj=None):
    """Collective: rank 0's ``obj`` on every rank."""
    if (dist := _dist()) is not None and dist.get_world_size() > 1:
        box = [obj]
        dist.broadcast_object_list(box, src=0)
        return box[0]
    return obj


def barrier() -> None:
    if (dist := _dist()) is not None and dist.get_world_size() > 1:
        dist.barrier()


def leave() -> None:
    """Leave the process group (the end of a stage process)."""
    if (dist := _dist()) is not None:
        dist.destroy_process_group()


def agree(error: str | None) -> str | None:
    """Collective: the first error any rank hit (by rank), or None if none did."""
    return next((e for e in all_gather_object(error) if e is not None), None)


def check(error: str | None) -> None:
    """Raise the first error of any rank on every rank (a collective)."""
    if (first := agree(error)) is not None:
        raise UserError(first)


def describe(e: BaseException | None, rank: int) -> tuple | None:
    """A failure as it travels to the other ranks: ``(kind, errno, message)``; kind ``user`` (a
    ``UserError``: its own line), ``os`` (storage refused a read or write: full, read-only, gone)
    or ``bug``."""
    if e is None:
        return None
    if isinstance(e, UserError):
        return "user", None, str(e)
    if isinstance(e, OSError):
        return "os", e.errno, f"rank {rank}: {e.strerror or e}" + (f": {e.filename}" if e.filename else "")
    return "bug", None, f"rank {rank}: {type(e).__name__}: {e}"


def raise_first(what: str, failures: list[tuple | None]) -> None:
    """Raise the first of ``failures`` (one per rank, ``describe``'s) on this rank as its kind: a
    ``UserError`` stays one; an ``OSError`` keeps its errno, so that every rank reports a full disk
    as one (never as damaged input); anything else is a ``RuntimeError``."""
    first = next((f for f in failures if f is not None), None)
    if first is None:
        return
    kind, errno, message = first
    if kind == "user":
        raise UserError(message)
    if kind == "os":
        raise OSError(errno, f"{what} failed: {message}")
    raise RuntimeError(f"{what} failed: {message}")
