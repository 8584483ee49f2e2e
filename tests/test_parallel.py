"""Process groups and seeding."""

from __future__ import annotations

import torch

import tiny
from llamarl.lib.distributed import parallel
from llamarl.lib.model.config import ParallelLayout
from llamarl.lib.model.llama import ParallelLlamaForCausalLM


def seeded_draws(tp):
    topo = parallel.init(tp, 1)
    gen = parallel.manual_seed(1234)
    return topo.tp_rank, torch.rand(3).tolist(), torch.rand(3, generator=gen).tolist()


def test_seeding_same_default_stream_distinct_tp_streams(pool2):
    (r0, shared0, own0), (r1, shared1, own1) = pool2.run(seeded_draws, 2)
    assert (r0, r1) == (0, 1)
    assert shared0 == shared1  # replicated work (sampling, replicated init) agrees across TP
    assert own0 != own1  # per-shard work (dropout on sharded activations) differs


def random_init_logits(tp, sp):
    parallel.init(tp, 1)
    cfg = tiny.our_config(tiny.hf_model())
    model = ParallelLlamaForCausalLM(cfg, ParallelLayout(tp=tp, sequence_parallel=sp))
    model.init_random(seed=7)
    ids, mask, pos = tiny.batch("left")
    with torch.no_grad():
        return tiny.gather_tp(model.run(ids, mask, pos))[mask.bool()][:, : cfg.vocab_size]


def test_random_init_does_not_depend_on_layout(pool2):
    tp1 = pool2.run(random_init_logits, 1, False)[0]
    tp2 = pool2.run(random_init_logits, 2, True)[0]
    assert tp1.abs().max() > 0.01
    assert (tp1 - tp2).abs().max() < 1e-5


def layout_mismatch():
    parallel.init(1, 1)
    try:
        ParallelLlamaForCausalLM(tiny.our_config(tiny.hf_model()), ParallelLayout(tp=2))
    except ValueError as e:
        return str(e)
    return None


def test_model_layout_must_match_process_groups(pool2):
    msg = pool2.run(layout_mismatch)[0]
    assert msg and "tp=2" in msg and "lib.distributed.parallel.init" in msg


def wrong_number_of_processes() -> str | None:
    from llamarl.lib.errors import UserError

    try:
        parallel.init(2, 1, dp=2, stage="score")
    except UserError as e:
        return str(e)
    return None


def test_a_job_launched_with_another_number_of_processes_is_one_line_naming_the_stage(pool2):
    assert pool2.run(wrong_number_of_processes) == [
        "score runs with tp*pp*dp = 2*1*2 = 4 processes, not 2; launch it through `llamarl stage` or `llamarl run`, "
        "which start that many"] * 2


def group_timeouts(seconds: int) -> list[float]:
    g = parallel.init(2, 1, dp=1, timeout_s=seconds).groups
    groups = (g.tp, g.dp, g.pp, g.model_parallel)
    out = [g._get_backend(torch.device("cpu")).options._timeout.total_seconds() for g in groups]
    parallel.destroy_model_parallel()
    return out


def test_the_collective_timeout_bounds_every_group(pool2):
    # A lost peer shows first in a TP or DP collective: those groups must not keep torch's default
    # (30 minutes on gloo, 10 on NCCL) when a stage asked for collective_timeout_s.
    assert pool2.run(group_timeouts, 45) == [[45.0] * 4] * 2


def sums_over_given_groups() -> tuple[float, float, float]:
    import torch.distributed as dist
    from llamarl.lib.model import mappings

    parallel.init(2, 1)
    alone = [dist.new_group([r]) for r in range(2)][dist.get_rank()]  # collective: every rank makes both
    x = torch.tensor([dist.get_rank() + 1.0])
    return (mappings.reduce_from_tp(x, parallel.tp_group()).item(), mappings.reduce_from_tp(x, alone).item(),
            mappings.reduce_from_tp(x, None).item())


def test_mappings_communicate_over_the_group_they_are_given(pool2):
    # Not over whatever group is current: a one-rank group (or None, no groups) is the identity.
    assert pool2.run(sums_over_given_groups) == [(3.0, 1.0, 1.0), (3.0, 2.0, 2.0)]


def _groups_ours_and_megatrons(tp, pp):
    import torch.distributed as dist

    def ranks(g):
        return dist.get_process_group_ranks(g)

    topo = parallel.init(tp, pp)
    g = topo.groups
    ours = {"tp": ranks(g.tp), "dp": ranks(g.dp), "pp": ranks(g.pp), "mp": sorted(ranks(g.model_parallel)),
            "next": topo.next_stage_rank, "prev": topo.prev_stage_rank,
            "coords": (topo.tp_rank, topo.dp_rank, topo.pp_rank), "emb": ranks(g.embedding) if pp > 1 else None}
    parallel.destroy_model_parallel()
    from megatron.core import parallel_state as ps

    ps.initialize_model_parallel(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp)
    theirs = {"tp": ranks(ps.get_tensor_model_parallel_group()), "dp": ranks(ps.get_data_parallel_group()),
              "pp": ranks(ps.get_pipeline_model_parallel_group()), "mp": sorted(ranks(ps.get_model_parallel_group())),
              "next": ps.get_pipeline_model_parallel_next_rank(), "prev": ps.get_pipeline_model_parallel_prev_rank(),
              "coords": (ps.get_tensor_model_parallel_rank(), ps.get_data_parallel_rank(),
                         ps.get_pipeline_model_parallel_rank()),
              "emb": ranks(ps.get_embedding_group()) if pp > 1 else None}
    ps.destroy_model_parallel()
    parallel.destroy_model_parallel()  # megatron-core's groups too
    return ours, theirs


import pytest  # noqa: E402


@pytest.mark.parametrize("tp,pp", [(2, 2), (1, 2), (2, 1), (1, 1)])
def test_groups_are_megatron_cores(pool4, tp, pp):
    # Our own groups (no megatron-core import at stage start) in megatron-core's rank order.
    for ours, theirs in pool4.run(_groups_ours_and_megatrons, tp, pp):
        assert ours == theirs


_JOIN = """
import os, sys, time
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK=sys.argv[1], WORLD_SIZE="3")
from llamarl.lib.distributed import parallel
ready = os.path.join(sys.argv[3], "ready-")
if sys.argv[1] == "0":
    # The others are trying to join first, however long their imports took (a loaded machine
    # skews them by seconds): the time measured is the join's alone.
    deadline = time.time() + 60
    while not all(os.path.exists(ready + r) for r in "12") and time.time() < deadline:
        time.sleep(0.01)
    time.sleep(1.5)
else:
    open(ready + sys.argv[1], "w").close()
t = time.time()
parallel.init(1, 1, backend="gloo", timeout_s=60)
print(sys.argv[1], t, time.time(), flush=True)
parallel.shutdown()
"""


def test_ranks_that_try_to_join_before_rank_0_listens_join_as_soon_as_it_does(tmp_path):
    # torch's store client backs off between tries (up to about a second): ranks that arrive
    # before rank 0 must not add that wait to every multi-process stage's start-up.
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])
    procs = [subprocess.Popen([sys.executable, "-c", _JOIN, str(r), port, str(tmp_path)], stdout=subprocess.PIPE,
                              text=True) for r in range(3)]
    out = {int(line.split()[0]): [float(x) for x in line.split()[1:]]
           for p in procs for line in [p.communicate(timeout=120)[0].strip()]}
    assert all(p.returncode == 0 for p in procs)
    called_by_0 = out[0][0]
    joined = max(done for _, done in out.values())
    print(f"joined {joined - called_by_0:.3f} s after rank 0 called")
    assert joined - called_by_0 < 0.3


_NEVER = """
import os, sys, time
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1], RANK="1", WORLD_SIZE="2")
from llamarl.lib.distributed import parallel
from llamarl.lib.runtime import job
started = time.monotonic()
try:
    parallel.init(1, 1, backend="gloo", timeout_s=1)
except Exception as e:
    print(time.monotonic() - started, job._lost_peer(e), job._peer_error(e), sep="|")
"""


def test_a_rank_whose_rank_0_never_listens_stops_after_the_timeout_naming_the_rendezvous():
    # In a fresh process, as a stage's rank joins: the error comes once the timeout is over (not
    # after the store's own wait on top of it) and reads as the rendezvous's.
    import socket
    import subprocess
    import sys

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = str(s.getsockname()[1])  # nobody listens on it
    out = subprocess.run([sys.executable, "-c", _NEVER, port], capture_output=True, text=True, timeout=120).stdout
    waited, lost, error = out.strip().split("|")
    assert 1.0 <= float(waited) < 2.5 and lost == "True", out
    assert "did not all join the rendezvous" in error and f"127.0.0.1:{port}" in error, error


_EXIT = """
import os, sys
os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[2], RANK=sys.argv[1], WORLD_SIZE="2")
from llamarl.lib.distributed import liveness, parallel
liveness.INTERVAL_S = 0.0  # the heartbeat is always inside a store call when the interpreter exits
parallel.init(1, 1, backend="gloo", timeout_s=60)
"""


def test_a_process_that_leaves_with_its_heartbeat_running_exits_cleanly():
    # A script (a benchmark under torchrun) that ends without shutting down: the heartbeat's daemon
    # thread, caught in a store call by the interpreter's finalization, aborted the process.
    import socket
    import subprocess
    import sys

    for _ in range(3):  # without the join at exit, every try aborts
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = str(s.getsockname()[1])
        procs = [subprocess.Popen([sys.executable, "-c", _EXIT, str(r), port], stderr=subprocess.PIPE, text=True)
                 for r in range(2)]
        errs = [p.communicate(timeout=120)[1] for p in procs]
        assert [p.returncode for p in procs] == [0, 0], errs
