import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))

from distpool import DistPool  # noqa: E402


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
