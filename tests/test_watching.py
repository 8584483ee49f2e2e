"""What a long run says of itself: ``llamarl run``'s progress line (the iteration of how many, and
the time the rest takes at the pace of the iterations this run trained) and ``llamarl status``'s
folded table with its summary line."""

from llamarl.pipeline.dag import TRAIN, VALIDATE, Node
from llamarl.pipeline.progress import Progress, duration
from llamarl.pipeline.status import FULL_ROWS, folded, summary


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


def _rows(iterations: int, trained: int, running: str | None = None) -> list[tuple[str, str, str]]:
    rows = [("shard/actor", "done", "done T")]
    for i in range(1, iterations + 1):
        for stage in ("rollout", "scores", "ppo"):
            name = f"iter-{i:03d}/{stage}"
            state = "done" if i <= trained else "running" if name == running else "pending"
            rows.append((name, state, "done T" if state == "done" else "not run before"))
    return rows + [("export", "pending", "not run before")]


def test_a_long_runs_status_folds_its_runs_of_done_and_pending_stages_and_keeps_the_rest():
    rows = _rows(200, 36, running="iter-037/rollout")
    rows[10] = (rows[10][0], "stale", "its config or inputs changed")  # iter-004/rollout
    assert folded(rows) == [
        ("shard/actor … iter-003/ppo", "done", "10 stages, each done T"),
        ("iter-004/rollout", "stale", "its config or inputs changed"),
        ("iter-004/scores … iter-036/ppo", "done", "98 stages, each done T"),
        ("iter-037/rollout", "running", "not run before"),
        ("iter-037/scores … export", "pending", "492 stages, each not run before"),
    ]
    assert summary(rows) == "36 of 200 iterations trained; running: iter-037/rollout; stale: iter-004/rollout"


def test_a_short_run_or_a_short_stretch_is_shown_whole():
    short = _rows(3, 1)
    assert len(short) <= FULL_ROWS and folded(short) == short
    rows = _rows(20, 19)
    rows[-2] = ("iter-020/ppo", "failed", "failed: boom")  # runs of at most three stages stay rows
    assert folded(rows) == [("shard/actor … iter-019/ppo", "done", "58 stages, each done T"), *rows[-4:]]
    assert summary(rows) == "19 of 20 iterations trained; failed: iter-020/ppo"
