import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from distpool import DistPool  # noqa: E402

# Files whose tests share what one host has once: each starts Slurm daemons (and munged), and a
# cluster's teardown ends every slurmstepd on the host.
SERIAL_FILES = {"test_slurm.py": "slurm", "test_multihost.py": "slurm"}


def pytest_collection_modifyitems(items):
    """Under pytest-xdist's ``--dist loadgroup`` (``make test``): a file's tests run on one worker,
    so its module fixtures are made once, and the ``SERIAL_FILES`` of one name on the same one."""
    for item in items:
        name = os.path.basename(str(item.fspath))
        item.add_marker(pytest.mark.xdist_group(SERIAL_FILES.get(name, name)))


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
