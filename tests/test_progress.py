"""``llamarl run``'s progress line: the iteration of how many, and the time the rest takes at the
pace of the iterations this run trained."""

from llamarl.pipeline.dag import TRAIN, VALIDATE, Node
from llamarl.pipeline.progress import Progress, duration


def _node(name: str, stage: str, iteration: int, role: str = TRAIN) -> Node:
    return Node(name=name, stage=stage, out=f"/run/{name}", inputs=[], layout=None, make_config=lambda: None,
                role=role, iteration=iteration)


def test_a_duration_reads_in_two_units_at_most():
    assert [duration(s) for s in (0, 44.6, 60, 192, 3599, 3600, 7500, 86399, 86400 * 3 + 4 * 3600 + 59)] == \
        ["0s", "45s", "1m00s", "3m12s", "59m59s", "1h00m", "2h05m", "23h59m", "3d04h"]


def test_each_trained_iteration_says_how_many_are_left_and_how_long_they_take():
    said, now = [], [100.0]
    progress = Progress(10, said.append, clock=lambda: now[0])
    nodes = {}
    finished = {"iter-001/ppo", "iter-002/ppo"}  # done before this run: they count, but set no pace
    for i in range(1, 11):
        for stage in ("rollout", "ppo"):
            nodes[f"iter-{i:03d}/{stage}"] = _node(f"iter-{i:03d}/{stage}", stage, i)
    nodes["iter-003/val-rollout"] = _node("iter-003/val-rollout", "rollout", 3, VALIDATE)
    for name, after in (("iter-003/rollout", 5), ("iter-003/ppo", 20), ("iter-003/val-rollout", 1),
                        ("iter-004/ppo", 60), ("iter-005/ppo", 90)):
        now[0] += after
        finished.add(name)
        progress.ended(nodes[name], finished, nodes)
    assert said == [
        "[progress] iteration 3 of 10 trained; 7 to go",
        "[progress] iteration 4 of 10 trained (1m01s after the one before); 6 to go, about 6m06s at 1m01s an iteration",
        "[progress] iteration 5 of 10 trained (1m30s after the one before); 5 to go, about 6m18s at 1m16s an "
        "iteration",
    ]


def test_the_pace_is_that_of_the_newest_iterations_and_the_last_says_nothing_is_left():
    said, now = [], [0.0]
    progress = Progress(8, said.append, clock=lambda: now[0])
    nodes = {f"iter-{i:03d}/ppo": _node(f"iter-{i:03d}/ppo", "ppo", i) for i in range(1, 9)}
    finished = set()
    for i, after in enumerate((500, 10, 10, 10, 10, 10, 10, 10), start=1):  # the first compiles: 500 s
        now[0] += after
        finished.add(f"iter-{i:03d}/ppo")
        progress.ended(nodes[f"iter-{i:03d}/ppo"], finished, nodes)
    assert said[6] == "[progress] iteration 7 of 8 trained (10s after the one before); 1 to go, about 10s at 10s " \
                      "an iteration"
    assert said[-1] == "[progress] iteration 8 of 8 trained (10s after the one before)"
