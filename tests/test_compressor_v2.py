"""Format version 2 (docs/format.md, "Format version 2"): headers, kernels, add, robustness."""

from __future__ import annotations

import numpy as np
import pytest

from ccoll.compressor import format as fmt
from ccoll.errors import FormatError

# The worked example of docs/format.md, "Example (version 2)".
EXAMPLE_HEX = (
    "43434f4c020101002000000001000000" "4600000000000000000000000000e03f"
    "000000000000e03f0300000000000000" "04000000000000000100000003000000"
    "46000000000000000700000022002104" "40040000210000005040800823 1a1182"
    "208831a3440ac04014010000"
).replace(" ", "")
EXAMPLE = np.frombuffer(bytes.fromhex(EXAMPLE_HEX), np.uint8)


def example_q() -> np.ndarray:
    q = np.zeros(70, np.int64)
    q[3], q[17] = 2, -1
    q[32:64] = [0, 1, -1, 0, 2, 0, -3, 1, 0, 0, 1, -1, 0, 0, 2, 1,
                0, -1, 0, 0, 1, 0, 0, -2, 1, 0, 0, 9, 0, -1, 0, 0]
    q[64:70] = [1, 0, -1, 0, 0, 1]
    return q


def test_example_header_fields_and_section_offsets():
    h = fmt.parse_header(EXAMPLE)
    assert (h.version, h.nmask, h.ntab, h.nnz, h.payload_words) == (2, 1, 3, 3, 4)
    assert h.index_bits == 2
    assert (h.table_offset, h.index_offset, h.mask_offset, h.payload_offset) == (76, 84, 88, 92)
    assert h.nbytes == EXAMPLE.size == 108
    assert np.array_equal(h.pack(), EXAMPLE[:72])


def _edit_v2(buf: np.ndarray, off: int, fmtc: str, val) -> np.ndarray:
    import struct

    out = bytearray(buf.tobytes())
    struct.pack_into(fmtc, out, off, val)
    return np.frombuffer(bytes(out), np.uint8)


@pytest.mark.parametrize("off, fmtc, val, match", [
    (12, "<I", 4, "nmask"),
    (60, "<I", 0, "ntab"),
    (60, "<I", 4, "ntab"),
    (7, "<B", 1, "reserved"),
    (16, "<Q", 1 << 37, "shape|2\\^37"),
])
def test_v2_header_fields_are_checked(off, fmtc, val, match):
    with pytest.raises(FormatError, match=match):
        fmt.parse_header(_edit_v2(EXAMPLE, off, fmtc, val))


def test_v2_refuses_2_to_the_37_elements():
    import struct

    n = 1 << 37
    raw = bytearray(EXAMPLE[:72].tobytes())
    struct.pack_into("<Q", raw, 16, n)
    struct.pack_into("<Q", raw, 64, n)
    with pytest.raises(FormatError, match="2\\^37"):
        fmt.parse_header(np.frombuffer(bytes(raw), np.uint8), exact=False, total_nbytes=1 << 50)
