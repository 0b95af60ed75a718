"""The CPU kernels' cache is dropped when any source file of the package changed.

numba checks only the defining file of a cached kernel, and ccoll's kernels inline helpers
from other files (ccoll/compressor/cpu/_cachestamp.py).
"""

from __future__ import annotations

from pathlib import Path

import ccoll.compressor.cpu  # noqa: F401 - runs the check at import
from ccoll.compressor.cpu import _cachestamp


def _touch(folder: Path, *names: str) -> None:
    for n in names:
        (folder / n).write_bytes(b"x")


def test_a_new_digest_drops_the_package_kernels_only(tmp_path: Path) -> None:
    _touch(tmp_path, "v2._decode_v2-643.py311.nbi", "v2._decode_v2-643.py311.1.nbc",
           "intrinsics._x-3.py311.nbi", "nodeshm._sum_share-46.py311.nbi", "v2.cpython-311.pyc")
    assert _cachestamp.refresh(tmp_path, "a" * 64)
    left = sorted(p.name for p in tmp_path.iterdir())
    # Another package's kernels, byte code and the stamp stay.
    assert left == [_cachestamp.STAMP, "nodeshm._sum_share-46.py311.nbi", "v2.cpython-311.pyc"]
    assert (tmp_path / _cachestamp.STAMP).read_text().strip() == "a" * 64
    # The same sources again: the kernels compiled since are kept.
    _touch(tmp_path, "v2._decode_v2-643.py311.nbi")
    assert not _cachestamp.refresh(tmp_path, "a" * 64)
    assert (tmp_path / "v2._decode_v2-643.py311.nbi").exists()
    # A change in any file of the package: dropped again.
    assert _cachestamp.refresh(tmp_path, "b" * 64)
    assert not (tmp_path / "v2._decode_v2-643.py311.nbi").exists()


def test_a_missing_cache_folder_gets_the_stamp(tmp_path: Path) -> None:
    folder = tmp_path / "cache" / "deeper"
    assert not _cachestamp.refresh(folder, "c" * 64)
    assert (folder / _cachestamp.STAMP).read_text().strip() == "c" * 64


def test_the_digest_follows_every_source_file(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_text("x = 1\n")
    (tmp_path / "b.py").write_text("y = 2\n")
    d0 = _cachestamp.source_digest(tmp_path)
    (tmp_path / "b.py").write_text("y = 3\n")
    d1 = _cachestamp.source_digest(tmp_path)
    (tmp_path / "c.py").write_text("")
    d2 = _cachestamp.source_digest(tmp_path)
    assert len({d0, d1, d2}) == 3
    assert _cachestamp.source_digest(tmp_path) == d2


def test_the_package_stamp_is_where_numba_caches() -> None:
    from ccoll.compressor.cpu import blocks, v2

    folder = _cachestamp.cache_folder()
    assert folder is not None
    # Every cached kernel of the package shares the folder the stamp is in.
    assert Path(v2._decode_v2._cache._cache_path) == folder
    assert Path(blocks._block_words._cache._cache_path) == folder
    assert (folder / _cachestamp.STAMP).read_text().strip() == _cachestamp.source_digest()
