"""How far a run's training has come, said by ``llamarl run`` as each iteration's ppo ends: the
iteration of how many, and — at the pace of the iterations this ``llamarl run`` trained — about how
long the rest takes. A run of 200 iterations is watched for days; its per-stage lines alone do not
say when it ends."""

from __future__ import annotations

import time

from .dag import TRAIN, Node

PACE_OF = 5
"""Iterations the pace is measured over: the newest intervals between ppo ends, so that the first
iteration's compilation and a slower stretch long past weigh nothing."""


def duration(seconds: float) -> str:
    """``45s``, ``3m12s``, ``2h05m``, ``3d04h``: two units at most, as a person reads a wait."""
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    if s < 86400:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 86400}d{s % 86400 // 3600:02d}h"


class Progress:
    """The training iterations of one ``llamarl run``: ``ended(node, finished)`` after every stage
    this run ran or found done, with the names of every stage done so far."""

    def __init__(self, iterations: int, echo, clock=time.monotonic):
        self.total, self.echo, self.clock = iterations, echo, clock
        self.ends: list[float] = []  # when each ppo that this run trained ended

    def ended(self, n: Node, finished: set[str], by_name: dict[str, Node]) -> None:
        if n.stage != "ppo" or n.role != TRAIN:
            return
        self.ends.append(self.clock())
        done = sum(by_name[name].stage == "ppo" and by_name[name].role == TRAIN for name in finished)
        left = self.total - done
        line = f"[progress] iteration {n.iteration} of {self.total} trained"
        if len(self.ends) > 1:
            line += f" ({duration(self.ends[-1] - self.ends[-2])} after the one before)"
        if left > 0:
            line += f"; {left} to go"
            recent = self.ends[-PACE_OF - 1:]
            if len(recent) > 1:
                pace = (recent[-1] - recent[0]) / (len(recent) - 1)
                line += f", about {duration(pace * left)} at {duration(pace)} an iteration"
        self.echo(line)
