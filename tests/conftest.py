import os
import sys

# tests/kit.py is imported as `kit` from every test folder.
sys.path.insert(0, os.path.dirname(__file__))

# The calibration cache of this test session: a folder of its own (rank 0 of each MPI job
# reads and writes it), never the user's ~/.cache/ccoll. Subprocesses inherit it.
if "CCOLL_CACHE_DIR" not in os.environ:
    import atexit
    import shutil
    import tempfile

    _cache = tempfile.mkdtemp(prefix="ccoll-test-cache-")
    os.environ["CCOLL_CACHE_DIR"] = _cache
    atexit.register(shutil.rmtree, _cache, True)
