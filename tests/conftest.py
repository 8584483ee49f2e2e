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


def pytest_collection_modifyitems(items):
    """Under pytest-xdist's ``--dist loadgroup`` (``make test``): a file's tests run on one worker,
    so its module fixtures are made once, and the ``SERIAL_FILES`` of one name on the same one;
    the ``LONGEST_FIRST`` groups come first (a stable sort: a file's tests keep their order)."""
    for item in items:
        name = os.path.basename(str(item.fspath))
        item.add_marker(pytest.mark.xdist_group(SERIAL_FILES.get(name, name)))

    def rank(item):
        group = item.get_closest_marker("xdist_group").args[0]
        return LONGEST_FIRST.index(group) if group in LONGEST_FIRST else len(LONGEST_FIRST)

    items.sort(key=rank)


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
