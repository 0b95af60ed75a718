"""CUDA backend of the ccoll compressor (numba-cuda), stream formats v1 and v2 (docs/format.md).

Entry points, all taking an optional ``stream`` (a numba stream, a CuPy or PyTorch stream,
or a raw ``cudaStream_t`` as int) on which every copy and kernel is enqueued:

- ``compress_abs(x, eb_abs)``: a float32/float64 device array (CuPy, PyTorch, numba, or
  anything with ``__cuda_array_interface__`` / DLPack) to a uint8 stream on the device;
- ``decompress(buf, out=None)``: a device stream back to an array of its dtype and shape;
- ``add(a, b, out=None)``: homomorphic sum of two device streams;
- ``header(buf)``: the parsed header of a device stream;
- ``finite_range(x)``: min and max of the finite values (for ``REL`` bounds).

Results are arrays of the input's kind (CuPy in, CuPy out; PyTorch in, PyTorch out) that
share memory allocated by numba. Streams are byte-identical to the CPU backend's. Kernels
live in ``_cuda_kernels``; docs/cuda.md describes the design, registers and buffers.

Host round trips: compression and add read back two totals (non-zero blocks, payload
words) to allocate the exact output; decompression and add read the stream header(s)
first, and read the validation flag at the end so that a malformed stream raises
:class:`ccoll.FormatError` instead of producing garbage. Work buffers (look-back flags,
scratch) live per (device, stream) and are reused and grown, never freed per call.
"""

from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

import numpy as np
from numba import cuda
from numba.core import config

from ccoll.compressor import _cuda_kernels as K
from ccoll.compressor import _cuda_kernels_v2 as K2
from ccoll.compressor import format as fmt
from ccoll.errors import DTypeError, ErrorBoundError, FormatError, InputError, MismatchError

__all__ = ["compress_abs", "decompress", "add", "header", "finite_range"]

_SIM = bool(getattr(config, "ENABLE_CUDASIM", 0))
_PREFIX = fmt.HEADER_NBYTES + 8 * fmt.MAX_NDIM  # header bytes read back in one copy
_EPOCH_LIMIT = 1 << 30  # look-back flags hold (epoch << 2) | state in 32 bits
_MAX_WORKSETS = 16

# Reasons the index kernel reports in ``bad[slot] = (epoch << 4) | reason`` (the largest
# reason found wins, so the order is the order of precedence).
_BAD_REASONS = {
    1: "stream code padding bytes are not zero",
    2: "stream block sizes do not add up to the payload length in its header",
    3: "stream bitmap's count of non-zero blocks does not match its header",
    4: "stream holds an invalid block code byte",
    5: "stream bitmap has bits set beyond its last block",
}

# The same for version-2 streams (index2_kernel, decode2_kernel).
_BAD2_REASONS = {
    1: "stream padding bits (table, index or payload tail) are not zero",
    2: "stream block sizes do not add up to the payload length in its header",
    3: "stream count of patched-planes blocks does not match its mask count nmask",
    4: "stream bitmap's count of non-zero blocks does not match its header",
    5: "stream sparse block positions are not strictly increasing",
    6: "stream index field points past the end of its code table",
    7: "stream table holds an invalid block code or is not strictly increasing",
    8: "stream bitmap has bits set beyond its last block",
}


# --------------------------------------------------------------------------- inputs


@dataclass
class _Dev:
    """A device array imported from some framework, with what is needed to answer in kind."""

    arr: Any  # numba device array (or simulator array)
    kind: str  # "numba", "cupy", "torch"
    obj: Any  # the caller's object
    device: int | None  # CUDA ordinal, None for "current"
    producer: Any  # stream the data was produced on (None: nothing to wait for)


def _module_of(obj: Any) -> str:
    return type(obj).__module__.split(".", 1)[0]


def _import(obj: Any, what: str) -> _Dev:
    """Wrap a device array without copying; a clear error for anything else."""
    from numba.cuda.cudadrv import devicearray

    if devicearray.is_cuda_ndarray(obj):
        return _Dev(obj, "numba", obj, None, None)
    mod = _module_of(obj)
    if mod == "torch":
        import torch

        if not obj.is_cuda:
            raise InputError(f"{what} is a PyTorch tensor on {obj.device}, not on a CUDA device")
        t = obj.detach()
        dev = t.device.index if t.device.index is not None else torch.cuda.current_device()
        producer = torch.cuda.current_stream(t.device).cuda_stream
        _check_torch_dtype(t, what)
        with cuda.gpus[dev]:
            arr = cuda.as_cuda_array(t, sync=False)
        return _Dev(arr, "torch", obj, dev, producer)
    if hasattr(obj, "__cuda_array_interface__"):
        desc = obj.__cuda_array_interface__
        ordinal = int(obj.device.id) if mod == "cupy" else None
        cai_stream = desc.get("stream") if desc.get("version", 0) >= 3 else None
        with _device_ctx(ordinal):
            arr = cuda.as_cuda_array(obj, sync=False)
        return _Dev(arr, "cupy" if mod == "cupy" else "numba", obj, ordinal, cai_stream)
    if hasattr(obj, "__dlpack__") and hasattr(obj, "__dlpack_device__"):
        dev_type, _ = obj.__dlpack_device__()
        if int(dev_type) in (2, 3, 13):  # kDLCUDA, kDLCUDAHost, kDLCUDAManaged
            try:
                import cupy

                return _import(cupy.from_dlpack(obj), what)
            except ImportError:
                pass
            try:
                import torch

                return _import(torch.from_dlpack(obj), what)
            except ImportError:
                pass
            raise InputError(f"{what} is a DLPack CUDA array; importing it needs CuPy or PyTorch")
    raise InputError(
        f"{what} must be a CUDA device array (CuPy, PyTorch, numba or any object with "
        f"__cuda_array_interface__ or DLPack), got {type(obj).__name__}"
    )


def _check_torch_dtype(t: Any, what: str) -> None:
    import torch

    if t.dtype not in (torch.float32, torch.float64, torch.uint8):
        raise DTypeError(f"{what} has dtype {t.dtype}; ccoll handles float32 and float64 data "
                         "and uint8 streams")


def _contiguous(src: _Dev, what: str) -> Any:
    """Return the array flattened to 1-D; a clear error when it is not C-contiguous."""
    arr = src.arr
    if arr.size and not arr.is_c_contiguous():
        raise InputError(f"{what} must be C-contiguous (got strides {arr.strides}); make a "
                         "contiguous copy first")
    return arr.reshape(arr.size)


def _ptr(arr: Any) -> int | None:
    if _SIM:
        return None
    return int(arr.__cuda_array_interface__["data"][0])


def _device_ctx(dev: int | None) -> Any:
    if dev is None or _SIM:
        return _Null()
    return cuda.gpus[dev]


class _Null:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc: Any) -> None:
        return None


def _export(arr: Any, like: _Dev, shape: tuple[int, ...] | None = None) -> Any:
    """``arr`` (numba) as an array of the caller's kind, sharing memory.

    The result was produced on the stream the call used; it is handed over without a stream
    in its ``__cuda_array_interface__`` so that CuPy does not wait for it on the host (work
    on that stream is ordered after it, which is the default stream choice).
    """
    if like.kind in ("torch", "cupy"):
        arr = arr.bind(0)
    if like.kind == "torch":
        import torch

        dev = torch.device("cuda", like.device if like.device is not None else 0)
        t = torch.as_tensor(arr, device=dev)
        return t.reshape(shape) if shape is not None else t
    if like.kind == "cupy":
        import cupy

        c = cupy.asarray(arr)
        return c.reshape(shape) if shape is not None else c
    if shape is not None and tuple(arr.shape) != shape:
        return arr.reshape(shape) if len(shape) else arr.reshape(())
    return arr


# --------------------------------------------------------------------------- streams


def _stream_from_handle(h: int) -> Any:
    if h == 0:
        return cuda.default_stream()
    if h == 1:
        return cuda.legacy_default_stream()
    if h == 2:
        return cuda.per_thread_default_stream()
    return cuda.external_stream(h)


def _resolve_stream(stream: Any, src: _Dev) -> Any:
    """Pick the numba stream to enqueue on: the caller's, else the producer's current one."""
    if _SIM:  # one simulated stream: a raw handle or a torch/CuPy stream stands for it
        if stream is None or isinstance(stream, int) or hasattr(stream, "cuda_stream") or (
                hasattr(stream, "ptr") and not hasattr(stream, "handle")):
            return cuda.default_stream()
        if hasattr(stream, "synchronize"):  # numba's (simulated) stream
            return stream
        raise InputError(f"stream must be a numba, CuPy or PyTorch stream or an int handle, "
                         f"got {type(stream).__name__}")
    if stream is None:
        if src.kind == "torch":
            import torch

            return _stream_from_handle(int(torch.cuda.current_stream(src.device).cuda_stream))
        if src.kind == "cupy":
            import cupy

            return _stream_from_handle(int(cupy.cuda.get_current_stream().ptr))
        return cuda.default_stream()
    if isinstance(stream, int):
        return _stream_from_handle(stream)
    if hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
        return _stream_from_handle(int(stream.cuda_stream))
    if hasattr(stream, "ptr") and not hasattr(stream, "handle"):  # cupy.cuda.Stream
        return _stream_from_handle(int(stream.ptr))
    if hasattr(stream, "handle"):  # numba stream
        return stream
    raise InputError(f"stream must be a numba, CuPy or PyTorch stream or an int handle, got "
                     f"{type(stream).__name__}")


def _handle(s: Any) -> int:
    """Return the raw ``cudaStream_t`` of a numba stream as an int (0: default stream)."""
    if _SIM:
        return 0
    h = getattr(s, "handle", s)
    h = getattr(h, "value", h)  # a ctypes handle with older bindings
    return int(h) if h else 0


def _after_producer(src: _Dev, s: Any, work: _Work) -> None:
    """Make stream ``s`` wait (on the device, not the host) for the stream that made ``src``."""
    if _SIM or src.producer is None:
        return
    h = int(src.producer)
    if h == _handle(s) or (h in (0, 1) and _handle(s) in (0, 1)):
        return
    ev = work.event
    assert ev is not None  # created for every work set outside the simulator
    ev.record(stream=_stream_from_handle(h))
    ev.wait(stream=s)


# ----------------------------------------------------------------------- work buffers


class _Work:
    """Look-back flags, scratch and staging of one (device, stream); grown, never shrunk."""

    def __init__(self, stream: Any) -> None:
        self.lock = threading.Lock()
        self.stream = stream
        self.epoch = 0
        self.ctr = cuda.to_device(np.zeros(1, np.int64), stream=stream)
        self.bad = cuda.to_device(np.zeros(2, np.int64), stream=stream)
        self.totals = cuda.device_array(2, np.int64, stream=stream)
        self.keys = cuda.device_array(2, np.int64, stream=stream)
        self.h_tot = cuda.pinned_array(4, np.int64)
        self.h_hdr = cuda.pinned_array((2, _PREFIX), np.uint8)
        self.event: Any = None if _SIM else cuda.event(timing=False)  # type: ignore[call-arg]
        self.v2: _Work2 | None = None  # version-2 buffers, made on first use
        self.cap_t = 0
        self.cap_codes = 0
        self.cap_pay = 0
        self._alloc_tiles(1)
        self._alloc_codes(1)
        self._alloc_pay(1)

    def _zeros(self, n: int, dtype: Any) -> Any:
        return cuda.to_device(np.zeros(n, dtype), stream=self.stream)

    def _alloc_tiles(self, n: int) -> None:
        s = self.stream
        self.flags_a = self._zeros(n, np.uint32)
        self.flags_b = self._zeros(n, np.uint32)
        self.vals_a = cuda.device_array(4 * n, np.int64, stream=s)
        self.vals_b = cuda.device_array(4 * n, np.int64, stream=s)
        self.pre = [cuda.device_array(2 * n, np.int64, stream=s) for _ in range(2)]
        self.bitmap = cuda.device_array(n, np.uint32, stream=s)
        self.cap_t = n

    def _alloc_codes(self, nwords: int) -> None:
        self.codes_w = cuda.device_array(nwords, np.uint32, stream=self.stream)
        self.codes_b = self.codes_w.view(np.uint8)
        self.cap_codes = nwords

    def _alloc_pay(self, nwords: int) -> None:
        self.pay = cuda.device_array(nwords, np.uint32, stream=self.stream)
        self.cap_pay = nwords

    def ensure(self, tiles: int, codes_bytes: int = 0, pay_words: int = 0) -> None:
        """Grow the buffers to hold ``tiles`` bitmap words, code bytes and payload words."""
        if tiles > self.cap_t:
            self._alloc_tiles(_grow(tiles))
        cw = (codes_bytes + 3) // 4
        if cw > self.cap_codes:
            self._alloc_codes(_grow(cw))
        if pay_words > self.cap_pay:
            self._alloc_pay(_grow(pay_words))

    def next_epoch(self) -> int:
        """Return a fresh epoch for one look-back launch; stale flags read as 'not ready'."""
        self.epoch += 1
        if self.epoch >= _EPOCH_LIMIT:
            self.flags_a = self._zeros(self.cap_t, np.uint32)
            self.flags_b = self._zeros(self.cap_t, np.uint32)
            self.bad = self._zeros(2, np.int64)
            if self.v2 is not None:
                self.v2.flags_c = self._zeros(self.v2.cap_t, np.uint32)
            self.epoch = 1
        return self.epoch


class _Work2:
    """Version-2 buffers of a work set: a third look-back, codes, masks, bit payload, table."""

    def __init__(self, work: _Work) -> None:
        s = self.stream = work.stream
        self.pres = cuda.to_device(np.zeros(K2.NCODES_SET // 32, np.uint32), stream=s)
        self.tab = cuda.device_array(K2.NCODES_SET, np.int32, stream=s)
        self.rank = cuda.device_array(K2.NCODES_SET, np.int32, stream=s)
        self.totals = cuda.device_array(4, np.int64, stream=s)
        self.h_tot = cuda.pinned_array(8, np.int64)
        self.cap_t = self.cap_b = self.cap_p = 0
        self._tiles(1)
        self._blocks(1)
        self._pay(1)

    def _tiles(self, n: int) -> None:
        s = self.stream
        self.flags_c = cuda.to_device(np.zeros(n, np.uint32), stream=s)
        self.vals_c = cuda.device_array(4 * n, np.int64, stream=s)
        self.pre = [cuda.device_array(3 * (n + 1), np.int64, stream=s) for _ in range(2)]
        self.cap_t = n

    def _blocks(self, n: int) -> None:
        self.codes = cuda.device_array(n, np.int32, stream=self.stream)
        self.masks = cuda.device_array(n, np.uint32, stream=self.stream)
        self.cap_b = n

    def _pay(self, n: int) -> None:
        self.pay = cuda.device_array(n, np.uint32, stream=self.stream)
        self.cap_p = n

    def ensure(self, tiles: int, blocks: int = 0, pay_words: int = 0) -> None:
        if tiles > self.cap_t:
            self._tiles(_grow(tiles))
        if blocks > self.cap_b:
            self._blocks(_grow(blocks))
        if pay_words > self.cap_p:
            self._pay(_grow(pay_words))


def _v2(work: _Work) -> _Work2:
    if work.v2 is None:
        work.v2 = _Work2(work)
    return work.v2


def _grow(n: int) -> int:
    return max(n, 1) + max(n, 1) // 4


_WORKSETS: OrderedDict[tuple[int, int], _Work] = OrderedDict()
_WORKSETS_LOCK = threading.Lock()


def _work(s: Any) -> _Work:
    """Return the work buffers of the current device and stream ``s`` (made on first use)."""
    dev = 0 if _SIM else cuda.get_current_device().id
    key = (dev, _handle(s))
    with _WORKSETS_LOCK:
        w = _WORKSETS.get(key)
        if w is None:
            w = _WORKSETS[key] = _Work(s)
            while len(_WORKSETS) > _MAX_WORKSETS:
                _WORKSETS.popitem(last=False)
        else:
            _WORKSETS.move_to_end(key)
        return w


# ----------------------------------------------------------------------------- helpers


def _grid(n: int, per: int) -> int:
    return max(1, (n + per - 1) // per)


def _upload(dst: Any, host: np.ndarray, s: Any) -> None:
    dst[: host.size].copy_to_device(host, stream=s)


def _stream_bytes(src: _Dev, what: str) -> Any:
    """Return a device stream as a flat uint8 array; FormatError for anything else."""
    arr = src.arr
    if np.dtype(arr.dtype) != np.uint8:
        raise FormatError(f"{what}: a ccoll stream is a uint8 array, got dtype {arr.dtype}")
    if arr.size and not arr.is_c_contiguous():
        raise FormatError(f"{what}: a ccoll stream must be a contiguous array")
    return arr.reshape(arr.size)


def _enqueue_prefix(buf8: Any, s: Any, host_row: np.ndarray) -> int:
    m = min(int(buf8.size), _PREFIX)
    if m:
        buf8[:m].copy_to_host(host_row[:m], stream=s)
    return m


def _parse(host_row: np.ndarray, m: int, total: int) -> fmt.StreamHeader:
    """Parse and validate a stream header of either version from its first ``m`` bytes."""
    return fmt.parse_header(np.array(host_row[:m], copy=True), total_nbytes=total)


def _aligned(buf8: Any, s: Any) -> Any:
    """Return the stream itself when word-aligned, else an aligned device copy of it."""
    p = _ptr(buf8)
    if p is None or p % 8 == 0:
        return buf8
    cp = cuda.device_array(buf8.size, np.uint8, stream=s)
    cp.copy_to_device(buf8, stream=s)
    return cp


def _index(work: _Work, slot: int, buf8: Any, hdr: fmt.StreamHeader, s: Any) -> tuple[Any, int]:
    """Launch validation + indexing of a stream; returns (word view, validation epoch)."""
    nbw = hdr.bitmap_words
    buf32 = buf8.view(np.uint32)
    epoch = work.next_epoch()
    ntiles = _grid(nbw, K.WARPS)
    K.index_kernel[ntiles, K.TPB, s](
        buf8, buf32, hdr.bitmap_offset // 4, hdr.codes_offset, hdr.nnz, hdr.payload_words,
        hdr.nblocks, nbw, int(hdr.dtype == np.float32), ntiles, work.ctr, work.flags_a,
        work.vals_a, work.flags_b, work.vals_b, epoch, work.pre[slot], work.bad, slot,
    )
    return buf32, epoch


def _raise_if_bad(bad: int, epoch: int, what: str) -> None:
    if bad >> 4 == epoch:
        raise FormatError(f"{what}: {_BAD_REASONS.get(bad & 15, 'malformed stream')}")


def _new_stream(hdr: fmt.StreamHeader, s: Any) -> Any:
    out = cuda.device_array(hdr.nbytes, np.uint8, stream=s)
    _upload(out, hdr.pack(), s)
    return out


def _assemble(work: _Work, out: Any, hdr: fmt.StreamHeader, s: Any) -> None:
    nbw = hdr.bitmap_words
    total = nbw + (hdr.nnz + 3) // 4 + hdr.payload_words
    grid = min(_grid(total, K.TPB), 65536)
    K.assemble_kernel[grid, K.TPB, s](
        out.view(np.uint32), hdr.bitmap_offset // 4, nbw, work.bitmap, work.codes_w, hdr.nnz,
        hdr.payload_words, work.pay,
    )


def _check_out_stream(out: Any, nbytes: int) -> Any:
    """Check a caller's stream buffer (uint8, contiguous, aligned, large enough); flatten it."""
    src = _import(out, "out")
    arr = src.arr
    if np.dtype(arr.dtype) != np.uint8 or (arr.size and not arr.is_c_contiguous()):
        raise MismatchError("out for a stream must be a contiguous uint8 device array")
    if arr.size < nbytes:
        raise MismatchError(
            f"out holds {arr.size} bytes, the stream needs {nbytes} (size it with max_nbytes)"
        )
    p = _ptr(arr)
    if p is not None and p % 4:
        raise MismatchError("out for a stream must be 4-byte aligned")
    return arr.reshape(arr.size)[:nbytes]


# ------------------------------------------------------------------------ public API


def compress_abs(
    x: Any, eb_abs: float, stream: Any = None, *, max_blocks: int | None = None,
    version: int = 1, source: int = 0,
) -> Any:
    """Compress a float32/float64 device array with absolute bound ``eb_abs`` (0: lossless).

    Returns a uint8 device array of the input's kind holding a stream of format
    ``version`` (1 or 2), byte-identical to the CPU backend's for the same data and bound.
    ``max_blocks`` (an int >= 1, e.g. ``Scheduler.grid_limit("compress")``) caps the thread
    blocks of the compression kernel, leaving the other SMs to concurrent work; the stream
    is the same bytes for any cap. ``None``: one thread block per tile of 1024 elements.
    ``source``: the header's source dtype code (``format.SOURCE_CODES``; float16/bfloat16
    data compressed as its float32 copy), 0 otherwise.
    """
    if isinstance(version, bool) or version not in (1, 2):
        raise InputError(f"version must be 1 or 2, got {version!r}")
    eb = float(eb_abs) + 0.0  # -0.0 becomes +0.0, as in the CPU backend's headers
    if not (math.isfinite(eb) and eb >= 0.0):
        raise ErrorBoundError(f"absolute error bound must be finite and >= 0, got {eb_abs!r}")
    if max_blocks is not None and (
        isinstance(max_blocks, bool) or not isinstance(max_blocks, (int, np.integer))
        or max_blocks < 1
    ):
        raise InputError(f"max_blocks must be None or an int >= 1, got {max_blocks!r}")
    src = _import(x, "x")
    dtype = np.dtype(src.arr.dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise DTypeError(f"ccoll compresses float32 or float64 data, got {dtype}")
    with _device_ctx(src.device):
        s = _resolve_stream(stream, src)
        flat = _contiguous(src, "x")
        shape = tuple(int(d) for d in src.arr.shape)
        n = int(flat.size)
        nblocks = (n + fmt.BLOCK - 1) // fmt.BLOCK
        nbw = (nblocks + 31) // 32
        if version == 2:
            return _compress2(src, flat, shape, dtype, eb, s, max_blocks, source)
        if nblocks == 0:
            hdr = fmt.StreamHeader(dtype=dtype, shape=shape, eb=eb, bound=eb, nnz=0,
                                   payload_words=0, source=source)
            return _export(_new_stream(hdr, s), src)
        work = _work(s)
        with work.lock:
            _after_producer(src, s, work)
            raw = 32 if dtype == np.float32 else 64
            work.ensure(nbw, nblocks, nblocks * raw)
            _launch_compress(work, flat.view(np.int32 if raw == 32 else np.int64), n, eb, s,
                             max_blocks)
            work.totals.copy_to_host(work.h_tot[:2], stream=s)
            s.synchronize()
            nnz, pwords = int(work.h_tot[0]), int(work.h_tot[1])
            hdr = fmt.StreamHeader(dtype=dtype, shape=shape, eb=eb, bound=eb, nnz=nnz,
                                   payload_words=pwords, source=source)
            out = _new_stream(hdr, s)
            _assemble(work, out, hdr, s)
        return _export(out, src)


def _compress2(
    src: _Dev, flat: Any, shape: tuple[int, ...], dtype: np.dtype, eb: float, s: Any,
    max_blocks: int | None, source: int = 0,
) -> Any:
    """Version-2 compression: plan, place and write in one kernel, then table and assembly."""
    n = int(flat.size)
    if n >= fmt.MAX_N_V2:
        raise InputError(f"an array of {n} elements (2^37 or more) cannot be written as format "
                         "version 2; compress it with version=1")
    nblocks = (n + fmt.BLOCK - 1) // fmt.BLOCK
    nbw = (nblocks + 31) // 32
    if nblocks == 0:
        hdr = fmt.StreamHeader(version=fmt.VERSION2, dtype=dtype, shape=shape, eb=eb, bound=eb,
                               nnz=0, payload_words=0, source=source)
        return _export(_new_stream(hdr, s), src)
    work = _work(s)
    with work.lock:
        _after_producer(src, s, work)
        raw = 32 if dtype == np.float32 else 64
        w2 = _v2(work)
        work.ensure(nbw)
        pay_max = nblocks * raw + 2  # every block raw, and a word of slack at each end
        w2.ensure(nbw, nblocks, pay_max)
        _zero(w2.pay, pay_max, s)
        grid = nbw if max_blocks is None else max(1, min(nbw, int(max_blocks)))
        K2.compress2_kernel[grid, K.TPB, s](
            flat.view(np.int32 if raw == 32 else np.int64), n, eb, 2.0 * eb, nbw, work.ctr,
            work.flags_a, work.vals_a, work.next_epoch(), work.bitmap, w2.codes, w2.masks,
            w2.pay, w2.pres, w2.totals,
        )
        K2.table_kernel[1, K2.NCODES_SET // 32, s](w2.pres, w2.tab, w2.rank, w2.totals)
        w2.totals.copy_to_host(w2.h_tot[:4], stream=s)
        s.synchronize()
        nnz, nmask, nbits, ntab = (int(v) for v in w2.h_tot[:4])
        hdr = fmt.StreamHeader(version=fmt.VERSION2, dtype=dtype, shape=shape, eb=eb, bound=eb,
                               nnz=nnz, payload_words=(nbits + 31) // 32, nmask=nmask,
                               ntab=ntab, source=source)
        out = _new_stream(hdr, s)
        _assemble2(work, w2, out, hdr, s)
    return _export(out, src)


def _zero(arr: Any, n: int, s: Any) -> None:
    K2.zero_kernel[min(_grid(n, K.TPB), 4096), K.TPB, s](arr, n)


def _assemble2(work: _Work, w2: _Work2, out: Any, hdr: fmt.StreamHeader, s: Any) -> None:
    nbw = hdr.bitmap_words
    total = (nbw + (hdr.ntab + 1) // 2 + (hdr.nnz * hdr.index_bits + 31) // 32 + hdr.nmask
             + hdr.payload_words)
    K2.assemble2_kernel[min(_grid(total, K.TPB), 65536), K.TPB, s](
        out.view(np.uint32), hdr.bitmap_offset // 4, nbw, work.bitmap, hdr.ntab, w2.tab,
        hdr.nnz, hdr.index_bits, w2.codes, w2.rank, hdr.nmask, w2.masks, hdr.payload_words, w2.pay,
    )


def _index2(work: _Work, w2: _Work2, slot: int, buf8: Any, hdr: fmt.StreamHeader, s: Any
            ) -> tuple[Any, int]:
    """Launch validation + indexing of a v2 stream; returns (word view, validation epoch)."""
    nbw = hdr.bitmap_words
    buf32 = buf8.view(np.uint32)
    epoch = work.next_epoch()
    ntiles = _grid(nbw, K.WARPS)
    K2.index2_kernel[ntiles, K.TPB, s](
        buf8, buf32, hdr.bitmap_offset // 4, hdr.table_offset, hdr.index_offset // 4,
        hdr.mask_offset // 4, hdr.payload_offset // 4, hdr.nnz, hdr.ntab, hdr.index_bits, hdr.nmask,
        hdr.payload_words, hdr.nblocks, nbw, int(hdr.dtype == np.float32), ntiles, work.ctr,
        work.flags_a, work.vals_a, work.flags_b, work.vals_b, w2.flags_c, w2.vals_c, epoch,
        w2.pre[slot], work.bad, slot,
    )
    return buf32, epoch


def _raise_if_bad2(bad: int, epoch: int, what: str) -> None:
    if bad >> 4 == epoch:
        raise FormatError(f"{what}: {_BAD2_REASONS.get(bad & 15, 'malformed stream')}")


def _parse_any(row: np.ndarray, m: int, total: int) -> fmt.StreamHeader:
    """Parse a stream header of either version from its first ``m`` bytes."""
    return _parse(row, m, total)


def _launch_compress(
    work: _Work, xb: Any, n: int, eb: float, s: Any, max_blocks: int | None = None
) -> None:
    """Enqueue the compression kernel (scratch sized by the caller); no host wait.

    Its thread blocks are persistent (they take tiles until none is left), so a grid
    capped at ``max_blocks`` covers every tile and writes the same bytes.
    """
    nbw = (n + 32 * fmt.BLOCK - 1) // (32 * fmt.BLOCK)
    grid = nbw if max_blocks is None else max(1, min(nbw, int(max_blocks)))
    K.compress_kernel[grid, K.TPB, s](
        xb, n, eb, 2.0 * eb, nbw, work.ctr, work.flags_a, work.vals_a, work.next_epoch(),
        work.bitmap, work.codes_b, work.pay, work.totals,
    )


def header(buf: Any, stream: Any = None) -> fmt.StreamHeader:
    """Parse and validate the header of a device stream (copies its first bytes back).

    Both versions give a :class:`ccoll.compressor.format.StreamHeader` (``version`` says which).
    """
    src = _import(buf, "stream")
    with _device_ctx(src.device):
        s = _resolve_stream(stream, src)
        b8 = _stream_bytes(src, "stream")
        host = np.empty(_PREFIX, np.uint8)
        m = _enqueue_prefix(b8, s, host)
        s.synchronize()
        return _parse_any(host, m, int(b8.size))


def _check_out_array(out: Any, hdr: fmt.StreamHeader) -> tuple[_Dev, Any]:
    src = _import(out, "out")
    arr = src.arr
    if np.dtype(arr.dtype) != hdr.dtype:
        raise MismatchError(f"out has dtype {arr.dtype}, the stream holds {hdr.dtype}")
    if tuple(arr.shape) != hdr.shape and arr.size != hdr.n:
        raise MismatchError(
            f"out has shape {tuple(arr.shape)} ({arr.size} elements), the stream holds shape "
            f"{hdr.shape} ({hdr.n} elements)"
        )
    if arr.size and not arr.is_c_contiguous():
        raise MismatchError("out must be C-contiguous")
    return src, arr.reshape(arr.size)


def decompress(buf: Any, out: Any = None, stream: Any = None) -> Any:
    """Decode a device stream; returns ``out`` or a new device array of the stream's shape.

    A malformed, truncated or foreign stream raises :class:`ccoll.FormatError`; the payload
    is read only after the bitmap and codes were validated on the device.
    """
    src = _import(buf, "stream")
    with _device_ctx(src.device):
        s = _resolve_stream(stream, src)
        b8 = _stream_bytes(src, "stream")
        work = _work(s)
        with work.lock:
            _after_producer(src, s, work)
            m = _enqueue_prefix(b8, s, work.h_hdr[0])
            s.synchronize()
            hdr = _parse_any(work.h_hdr[0], m, int(b8.size))
            if out is None:
                flat = cuda.device_array(hdr.n, hdr.dtype, stream=s)
                res_src = src
            else:
                res_src, flat = _check_out_array(out, hdr)
            if hdr.n and hdr.version == fmt.VERSION2:
                _decode2(work, b8, hdr, flat, s)
            elif hdr.n and isinstance(hdr, fmt.StreamHeader):
                b8 = _aligned(b8, s)
                work.ensure(hdr.bitmap_words)
                buf32, vep = _index(work, 0, b8, hdr, s)
                is32 = hdr.dtype == np.float32
                bits = flat.view(np.uint32 if is32 else np.int64)
                K.decode_kernel[_grid(hdr.bitmap_words, K.WARPS), K.TPB, s](
                    b8, buf32, hdr.bitmap_offset // 4, hdr.codes_offset, hdr.payload_offset // 4,
                    hdr.n, hdr.bitmap_words, int(is32), 2.0 * hdr.eb, work.pre[0], work.bad, 0,
                    vep, flat, bits,
                )
                work.bad.copy_to_host(work.h_tot[:2], stream=s)
                s.synchronize()
                _raise_if_bad(int(work.h_tot[0]), vep, "stream")
    if out is not None:
        return out
    return _export(flat, res_src, hdr.shape)


def _decode2(work: _Work, b8: Any, hdr: fmt.StreamHeader, flat: Any, s: Any) -> None:
    """Validate, index and decode a v2 stream into ``flat``; FormatError if malformed."""
    b8 = _aligned(b8, s)
    w2 = _v2(work)
    work.ensure(hdr.bitmap_words)
    w2.ensure(hdr.bitmap_words)
    buf32, vep = _index2(work, w2, 0, b8, hdr, s)
    is32 = hdr.dtype == np.float32
    bits = flat.view(np.uint32 if is32 else np.int64)
    K2.decode2_kernel[_grid(hdr.bitmap_words, K.WARPS), K.TPB, s](
        b8, buf32, hdr.table_offset, hdr.index_offset // 4, hdr.mask_offset // 4,
        hdr.payload_offset // 4, hdr.index_bits, hdr.n, hdr.bitmap_words, int(is32), 2.0 * hdr.eb,
        w2.pre[0], work.bad, 0, vep, hdr.bitmap_offset // 4, flat, bits,
    )
    work.bad.copy_to_host(work.h_tot[:2], stream=s)
    s.synchronize()
    _raise_if_bad2(int(work.h_tot[0]), vep, "stream")


def add(a: Any, b: Any, out: Any = None, stream: Any = None) -> Any:
    """Homomorphic sum of two device streams (docs/format.md, "Homomorphic add").

    Byte-identical to the CPU backend's sum. With ``out`` (a contiguous, word-aligned uint8
    device array; ``format.max_nbytes`` always suffices) the stream is written there and
    the used prefix is returned.
    """
    from ccoll.compressor.cpu.add import sum_bound

    sa = _import(a, "a")
    sb = _import(b, "b")
    with _device_ctx(sa.device):
        s = _resolve_stream(stream, sa)
        a8 = _stream_bytes(sa, "a")
        b8 = _stream_bytes(sb, "b")
        work = _work(s)
        with work.lock:
            _after_producer(sa, s, work)
            _after_producer(sb, s, work)
            ma = _enqueue_prefix(a8, s, work.h_hdr[0])
            mb = _enqueue_prefix(b8, s, work.h_hdr[1])
            s.synchronize()
            ha2 = _parse_any(work.h_hdr[0], ma, int(a8.size))
            hb2 = _parse_any(work.h_hdr[1], mb, int(b8.size))
            if ha2.version != hb2.version:
                raise FormatError("streams of format versions 1 and 2 cannot be added; "
                                  "compress both with the same version")
            if ha2.version == fmt.VERSION2 and hb2.version == fmt.VERSION2:
                return _add2(work, sa, a8, b8, ha2, hb2, out, s)
            ha, hb = ha2, hb2
            _check_addable(ha, hb)
            bound = sum_bound(ha.bound, hb.bound)
            if not math.isfinite(bound):
                raise MismatchError(f"the sum of bounds {ha.bound!r} + {hb.bound!r} overflows")
            nterms = ha.nterms + hb.nterms
            if nterms >= 1 << 32:
                raise MismatchError(f"a sum of {nterms} streams does not fit the header's nterms")
            nbw = ha.bitmap_words
            if ha.nblocks == 0:
                hdr = fmt.StreamHeader(dtype=ha.dtype, shape=ha.shape, eb=ha.eb, bound=bound,
                                       nnz=0, payload_words=0, nterms=nterms)
                return _finish_add(hdr, out, s, sa, None)
            a8 = _aligned(a8, s)
            b8 = _aligned(b8, s)
            is32 = ha.dtype == np.float32
            pay_max = 64 * min(ha.nnz + hb.nnz, ha.nblocks)
            work.ensure(nbw, ha.nblocks, pay_max)
            a32, vea = _index(work, 0, a8, ha, s)
            b32, veb = _index(work, 1, b8, hb, s)
            epoch = work.next_epoch()
            K.add_kernel[nbw, K.TPB, s](
                a8, a32, ha.bitmap_offset // 4, ha.codes_offset, ha.payload_offset // 4,
                work.pre[0], b8, b32, hb.bitmap_offset // 4, hb.codes_offset,
                hb.payload_offset // 4, work.pre[1], work.bad, vea, veb, ha.n, int(is32),
                2.0 * ha.eb, nbw, work.ctr, work.flags_a, work.vals_a, epoch, work.bitmap,
                work.codes_b, work.pay, work.totals,
            )
            work.bad.copy_to_host(work.h_tot[:2], stream=s)
            work.totals.copy_to_host(work.h_tot[2:4], stream=s)
            s.synchronize()
            _raise_if_bad(int(work.h_tot[0]), vea, "a")
            _raise_if_bad(int(work.h_tot[1]), veb, "b")
            hdr = fmt.StreamHeader(dtype=ha.dtype, shape=ha.shape, eb=ha.eb, bound=bound,
                                   nnz=int(work.h_tot[2]), payload_words=int(work.h_tot[3]),
                                   nterms=nterms)
            return _finish_add(hdr, out, s, sa, work)


def _add2(work: _Work, sa: _Dev, a8: Any, b8: Any, ha: fmt.StreamHeader,
          hb: fmt.StreamHeader, out: Any,
          s: Any) -> Any:
    """Homomorphic sum of two v2 streams (format.md, "Homomorphic add (version 2)")."""
    from ccoll.compressor.cpu.add import sum_bound

    _check_addable(ha, hb)
    bound = sum_bound(ha.bound, hb.bound)
    if not math.isfinite(bound):
        raise MismatchError(f"the sum of bounds {ha.bound!r} + {hb.bound!r} overflows")
    nterms = ha.nterms + hb.nterms
    if nterms >= 1 << 32:
        raise MismatchError(f"a sum of {nterms} streams does not fit the header's nterms")
    nbw = ha.bitmap_words
    if ha.nblocks == 0:
        hdr = fmt.StreamHeader(version=fmt.VERSION2, dtype=ha.dtype, shape=ha.shape, eb=ha.eb,
                               bound=bound, nnz=0,
                      payload_words=0, nterms=nterms)
        return _finish_add2(hdr, out, s, sa, None, None)
    a8 = _aligned(a8, s)
    b8 = _aligned(b8, s)
    is32 = ha.dtype == np.float32
    w2 = _v2(work)
    pay_max = 64 * min(ha.nnz + hb.nnz, ha.nblocks) + 2
    work.ensure(nbw)
    w2.ensure(nbw, ha.nblocks, pay_max)
    _zero(w2.pay, pay_max, s)
    a32, vea = _index2(work, w2, 0, a8, ha, s)
    b32, veb = _index2(work, w2, 1, b8, hb, s)
    epoch = work.next_epoch()
    K2.add2_kernel[nbw, K.TPB, s](
        a8, a32, ha.table_offset, ha.index_offset // 4, ha.mask_offset // 4,
        ha.payload_offset // 4, ha.bitmap_offset // 4, ha.index_bits, w2.pre[0],
        b8, b32, hb.table_offset, hb.index_offset // 4, hb.mask_offset // 4,
        hb.payload_offset // 4, hb.bitmap_offset // 4, hb.index_bits, w2.pre[1],
        work.bad, vea, veb, ha.n, int(is32), 2.0 * ha.eb, nbw, work.ctr, work.flags_a,
        work.vals_a, epoch, work.bitmap, w2.codes, w2.masks, w2.pay, w2.pres, w2.totals,
    )
    K2.table_kernel[1, K2.NCODES_SET // 32, s](w2.pres, w2.tab, w2.rank, w2.totals)
    work.bad.copy_to_host(w2.h_tot[4:6], stream=s)
    w2.totals.copy_to_host(w2.h_tot[:4], stream=s)
    s.synchronize()
    _raise_if_bad2(int(w2.h_tot[4]), vea, "a")
    _raise_if_bad2(int(w2.h_tot[5]), veb, "b")
    nnz, nmask, nbits, ntab = (int(v) for v in w2.h_tot[:4])
    hdr = fmt.StreamHeader(version=fmt.VERSION2, dtype=ha.dtype, shape=ha.shape, eb=ha.eb,
                           bound=bound, nnz=nnz,
                  payload_words=(nbits + 31) // 32, nterms=nterms, nmask=nmask, ntab=ntab)
    return _finish_add2(hdr, out, s, sa, work, w2)


def _finish_add2(hdr: fmt.StreamHeader, out: Any, s: Any, like: _Dev, work: _Work | None,
                 w2: _Work2 | None) -> Any:
    if out is None:
        res = _new_stream(hdr, s)
    else:
        res = _check_out_stream(out, hdr.nbytes)
        _upload(res, hdr.pack(), s)
    if work is not None and w2 is not None:
        _assemble2(work, w2, res, hdr, s)
    if out is not None:
        return _export_prefix(out, hdr.nbytes)
    return _export(res, like)


def _check_addable(ha: fmt.StreamHeader, hb: fmt.StreamHeader) -> None:
    """Check that two streams can be added (same checks and messages as the CPU backend)."""
    if ha.dtype != hb.dtype:
        raise MismatchError(f"cannot add a {ha.dtype} stream to a {hb.dtype} stream")
    if ha.n != hb.n:
        raise MismatchError(f"cannot add streams of {ha.n} and {hb.n} elements")
    if np.float64(ha.eb).view(np.uint64) != np.float64(hb.eb).view(np.uint64):
        raise MismatchError(
            f"cannot add streams quantized with different bounds eb={ha.eb!r} and eb={hb.eb!r}"
        )


def _finish_add(hdr: fmt.StreamHeader, out: Any, s: Any, like: _Dev, work: _Work | None) -> Any:
    if out is None:
        res = _new_stream(hdr, s)
    else:
        res = _check_out_stream(out, hdr.nbytes)
        _upload(res, hdr.pack(), s)
    if work is not None:
        _assemble(work, res, hdr, s)
    if out is not None:
        return _export_prefix(out, hdr.nbytes)
    return _export(res, like)


def _export_prefix(out: Any, nbytes: int) -> Any:
    flat = out.reshape(-1) if hasattr(out, "reshape") else out
    return flat[:nbytes]


def finite_range(x: Any, stream: Any = None) -> tuple[float, float]:
    """Min and max of the finite values of a device array (``(inf, -inf)`` if none)."""
    src = _import(x, "x")
    dtype = np.dtype(src.arr.dtype)
    if dtype not in (np.dtype(np.float32), np.dtype(np.float64)):
        raise DTypeError(f"finite_range takes float32 or float64 data, got {dtype}")
    with _device_ctx(src.device):
        s = _resolve_stream(stream, src)
        flat = _contiguous(src, "x")
        n = int(flat.size)
        if n == 0:
            return math.inf, -math.inf
        is32 = dtype == np.float32
        work = _work(s)
        with work.lock:
            _after_producer(src, s, work)
            init = np.array([np.iinfo(np.int64).max, np.iinfo(np.int64).min], np.int64)
            work.keys.copy_to_device(init, stream=s)
            xb = flat.view(np.int32 if is32 else np.int64)
            grid = min(_grid(n, K.TPB), 4096)
            K.range_kernel[grid, K.TPB, s](xb, n, work.keys)
            work.keys.copy_to_host(work.h_tot[:2], stream=s)
            s.synchronize()
            klo, khi = int(work.h_tot[0]), int(work.h_tot[1])
    if klo > khi:
        return math.inf, -math.inf
    return _key_to_float(klo, is32), _key_to_float(khi, is32)


def _key_to_float(key: int, is32: bool) -> float:
    if is32:
        s = key if key >= 0 else key ^ 0x7FFFFFFF
        return float(np.array([s], np.int32).view(np.float32)[0])
    s = key if key >= 0 else key ^ 0x7FFFFFFFFFFFFFFF
    return float(np.array([s], np.int64).view(np.float64)[0])
