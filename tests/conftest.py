import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from distpool import DistPool  # noqa: E402

# Files whose tests share what one host has once: each starts Slurm daemons (and munged), and a
# cluster's teardown ends every slurmstepd on the host.
SERIAL_FILES = {"test_slurm.py": "slurm", "test_multihost.py": "slurm"}
# The longest groups (seconds of a serial run on 2 cores), handed out first so that no worker is
# left with one of them at the end.
LONGEST_FIRST = ("slurm", "test_faults.py", "test_ppo.py", "test_resident.py", "test_overlap.py",
                 "test_driver_stop.py", "test_shard_export.py", "test_fusions.py", "test_rollout.py")


def _group(path: str) -> str:
    name = os.path.basename(path.split("::", 1)[0])
    return SERIAL_FILES.get(name, name)


def pytest_collection_modifyitems(items):
    """The ``LONGEST_FIRST`` groups first (a stable sort: a file's tests keep their order)."""
    def rank(item):
        group = _group(item.nodeid)
        return LONGEST_FIRST.index(group) if group in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)


@pytest.hookimpl(optionalhook=True)  # a hook of xdist's: pytest without it runs the suite in one process
def pytest_xdist_make_scheduler(config, log):
    """Under pytest-xdist's ``--dist loadfile --no-loadscope-reorder`` (``make test``): a file's
    tests run on one worker, in order, so its module fixtures are made once (tests of a file may
    build on each other's outputs), and the ``SERIAL_FILES`` of one group on the same one, the
    groups handed out in collection order. A scheduler of our own rather than ``--dist
    loadgroup``: xdist 3.8 names a test's group by rewriting ``item._nodeid``, which pytest 9 no
    longer reads, so its groups are silently every test alone (pytest-xdist#1386)."""
    if config.getvalue("dist") != "loadfile":
        return None
    from xdist.scheduler import LoadFileScheduling

    class ByGroup(LoadFileScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)

    return ByGroup(config, log)


@pytest.fixture(scope="session")
def pool1():
    pool = DistPool(1)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool2():
    pool = DistPool(2)
    yield pool
    pool.close()


@pytest.fixture(scope="session")
def pool4():
    pool = DistPool(4)
    yield pool
    pool.close()
