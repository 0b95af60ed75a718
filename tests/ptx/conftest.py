import os
import sys

import pytest

sys.path.insert(0, os.path.dirname(__file__))


def pytest_collection_modifyitems(config, items):
    if os.environ.get("NUMBA_ENABLE_CUDASIM") == "1":
        raise pytest.UsageError("tests/ptx compile real PTX: run them without NUMBA_ENABLE_CUDASIM")
