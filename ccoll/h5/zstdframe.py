"""Optional lossless stage: a ccoll stream wrapped in one zstd frame (``--lossless zstd``).

The HDF5 zstd filter needs a plugin that plain h5py lacks, so the frame is stored as the
dataset's bytes and ``ccoll decompress`` unwraps it; ``zstandard`` is the ``zstd`` extra.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from ccoll.errors import FormatError, InputError

__all__ = ["require", "wrap", "unwrap"]

LEVEL = 3  # zstd's default: most of the gain for ccoll's already dense payload, at speed


def require() -> Any:
    """Import ``zstandard``, or raise :class:`InputError` saying how to install it."""
    try:
        import zstandard
    except ImportError:
        raise InputError(
            "--lossless zstd needs the zstandard package: pip install 'ccoll[zstd]'"
        ) from None
    return zstandard


def wrap(stream: np.ndarray) -> np.ndarray:
    """Compress the stream into one zstd frame (with its content size), as uint8."""
    zstd = require()
    frame = zstd.ZstdCompressor(level=LEVEL, write_content_size=True).compress(stream.tobytes())
    return np.frombuffer(frame, dtype=np.uint8)


def unwrap(frame: np.ndarray, max_nbytes: int) -> np.ndarray:
    """Extract the stream from a zstd frame; :class:`FormatError` if damaged or over ``max_nbytes``.

    ``max_nbytes`` (the largest stream the dataset's shape allows and the frame's bytes can
    hold) stops a damaged or hostile frame from claiming gigabytes: the frame must state
    its content size, at most ``max_nbytes``, before anything is allocated for it.
    """
    zstd = require()
    try:
        params = zstd.get_frame_parameters(frame.tobytes())
        size = params.content_size
        if size > max_nbytes:
            raise FormatError(
                f"zstd frame says {size} bytes, more than the {max_nbytes} bytes that a stream "
                "of this shape, in a frame of this size, can take"
            )
        # Bytes after the frame are damage, as after a plain stream (zstandard >= 0.19 has
        # allow_extra_data; the extra requires 0.22).
        data = zstd.ZstdDecompressor().decompress(frame.tobytes(), max_output_size=max_nbytes,
                                                  allow_extra_data=False)
    except zstd.ZstdError as exc:
        raise FormatError(f"damaged zstd frame: {exc}") from None
    return np.frombuffer(data, dtype=np.uint8)
