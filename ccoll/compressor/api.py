"""Public entry points of the compressor: checked arguments in front of the kernels.

``compress`` resolves an error bound (``ABS``/``REL``) and ``compress_abs`` takes an absolute
one already resolved (the collectives resolve ``REL`` over the global range). ``decompress``,
``add`` and ``header`` read the self-describing stream of docs/format.md. float16 and
bfloat16 data (host or device) is compressed as its exact float32 copy
(:mod:`ccoll.compressor.precision`; the stream is a float32 stream). Host data goes to
the numba CPU kernels (``cpu``), device data to the CUDA backend (``_cuda``); the choice
is made in :mod:`ccoll.compressor._backend` only.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from ccoll.compressor import _backend, cpu
from ccoll.compressor.format import SOURCE_CODES, SOURCE_NAMES, StreamHeader
from ccoll.compressor.precision import (
    DeviceNarrow,
    Narrow,
    device_low_precision,
    low_precision,
    stage_bound,
    widen,
    widen_device,
)
from ccoll.errorbound import REL, ErrorBound, as_bound
from ccoll.errors import DTypeError, ErrorBoundError, InputError, MismatchError

__all__ = ["compress", "compress_abs", "decompress", "add", "add_data", "header"]

_FLOATS = (np.dtype(np.float32), np.dtype(np.float64))
_TORCH_FLOATS: dict[str, np.dtype] = {
    "torch.float32": np.dtype(np.float32),
    "torch.float64": np.dtype(np.float64),
}


def dtype_fix(what: object, name: str = "x") -> str:
    """Return the advice for data of dtype ``what`` that ccoll does not take.

    Complex data has two parts, and a cast to a real dtype would drop the imaginary one
    silently: the advice is to pass both parts as real data instead.
    """
    if "complex" in str(what):
        return (f"a complex array has a real and an imaginary part, and a cast to float "
                f"drops the imaginary one: pass {name}.real and {name}.imag separately, or "
                f"both as one real array (numpy: {name}.view({name}.real.dtype); torch: "
                f"torch.view_as_real({name}))")
    return f"pass {name}.astype(np.float32) (a torch tensor: {name}.float())"


def _dtype_error(what: object, name: str = "x") -> DTypeError:
    return DTypeError(
        f"{name} has dtype {what}; ccoll compresses float16, bfloat16, float32 or float64 "
        f"data: {dtype_fix(what, name)}"
    )


def _host_array(x: Any) -> np.ndarray:
    """Convert host data to a C-contiguous native-endian float32/float64 numpy array.

    float16 and bfloat16 (numpy, torch, ``ml_dtypes``) become their exact float32 copy.
    """
    low = widen(x)
    if low is not None:
        return low[0]
    if _backend.is_torch(x):
        if str(x.dtype) not in _TORCH_FLOATS:
            raise _dtype_error(x.dtype)
        x = x.detach().resolve_neg().resolve_conj().numpy()
    elif type(x) is not np.ndarray:  # np.matrix, masked arrays, ...: their plain data
        try:
            x = np.asarray(x)
        except Exception as exc:  # noqa: BLE001 - reported with what was expected
            raise DTypeError(
                f"x of type {type(x).__name__} cannot be read as an array ({exc}); ccoll "
                "compresses numpy arrays, torch tensors and device arrays of floats"
            ) from None
    dt = x.dtype
    if dt.kind != "f" or dt.itemsize not in (4, 8):
        raise _dtype_error(dt)
    if not dt.isnative:
        x = x.astype(dt.newbyteorder("="))
    # Not np.ascontiguousarray: it turns a 0-d array into a 1-d one.
    return x if x.flags.c_contiguous else x.copy(order="C")


def _device_dtype(x: Any) -> np.dtype:
    """Check and return the dtype of a device array (torch, CuPy, numba, CAI objects)."""
    if _backend.is_torch(x):
        if str(x.dtype) not in _TORCH_FLOATS:
            raise _device_dtype_error(x.dtype)
        return _TORCH_FLOATS[str(x.dtype)]
    dt = getattr(x, "dtype", None)
    if dt is None:
        dt = x.__cuda_array_interface__["typestr"]
    try:
        npdt = np.dtype(dt)
    except TypeError:
        raise _device_dtype_error(dt) from None
    if npdt not in _FLOATS:
        raise _device_dtype_error(npdt)
    return npdt


def _device_dtype_error(what: object) -> DTypeError:
    return DTypeError(
        f"x is a device array of dtype {what}; ccoll compresses float16, bfloat16 (torch, "
        "CuPy), float32 or float64 device data: pass x.float() (torch) or "
        "x.astype(cupy.float32)"
    )


def _device_input(x: Any, stream: Any) -> Any:
    """Device data as the kernels take it: float16/bfloat16 become their exact float32 copy.

    The copy is made on the default stream; a caller's ``stream`` waits for it.
    """
    low = widen_device(x)
    if low is None:
        return x
    _join(stream)
    return low[0]


def _join(stream: Any) -> None:
    """Order work on the default stream and on a caller's ``stream`` (the casts use the former)."""
    if stream is not None:
        from numba import cuda

        cuda.synchronize()


def _device_narrow(buf: Any, narrow: DeviceNarrow, stream: Any,
                   have: np.dtype | None = None) -> Any:
    """Decode device stream ``buf`` (float32) to a float32 device array before rounding.

    ``have``: the stream's dtype where the caller has read its header already.
    """
    mod = _backend.cuda_module()
    if have is None:
        have = mod.header(buf).dtype
    if have != np.dtype(np.float32):
        raise MismatchError(
            f"the result is to be {narrow.name} but the stream holds {have}; decoding to "
            f"{narrow.name} takes a float32 stream: pass an array of dtype {have}")
    y32 = mod.decompress(buf, stream=stream)
    _join(stream)
    return y32


def _host_restore(y: np.ndarray, source: int, torch_stream: bool) -> Any:
    """``y`` (decoded, validated) in the source dtype its stream's header records, if any."""
    name = SOURCE_NAMES.get(source)
    if name is None:
        return y
    if name == "float16":
        return Narrow(name, np.dtype(np.float16), False).result(y)
    try:
        import ml_dtypes
    except ImportError:
        if not torch_stream:
            return y  # numpy has no bfloat16 of its own: the float32 values (documented)
        import torch

        return Narrow(name, torch.bfloat16, True).result(y)
    return Narrow(name, np.dtype(ml_dtypes.bfloat16), False).result(y)


def _device_restore(buf: Any, stream: Any) -> Any:
    """Decode device stream ``buf`` to its dtype, or to its header's source dtype."""
    from ccoll.compressor.precision import _kind

    mod = _backend.cuda_module()
    h = mod.header(buf, stream)
    name = h.source_dtype
    kind = _kind(buf)
    narrow = None
    if name is not None and kind == "torch":
        import torch

        narrow = DeviceNarrow(name, kind, getattr(torch, name), buf.device)
    elif name == "float16":  # CuPy and numba have float16, not bfloat16
        narrow = DeviceNarrow(name, kind, np.dtype(np.float16), None)
    if narrow is None:
        return mod.decompress(buf, stream=stream)
    return narrow.result(_device_narrow(buf, narrow, stream, h.dtype))


def _check_eb_abs(eb_abs: object) -> float:
    if isinstance(eb_abs, (bool, np.bool_)) or not isinstance(
        eb_abs, (int, float, np.integer, np.floating)
    ):
        raise ErrorBoundError(f"absolute bound must be a real number, got {type(eb_abs).__name__}")
    eb = float(eb_abs)
    if not math.isfinite(eb) or eb < 0.0:
        raise ErrorBoundError(f"absolute bound must be finite and >= 0, got {eb_abs!r}")
    return eb + 0.0  # -0.0 becomes +0.0: the header stores a canonical zero


def _device_range(x: Any, stream: Any) -> tuple[float, float]:
    cuda = _backend.cuda_module()
    rng = getattr(cuda, "finite_range", None)
    if rng is not None:
        lo, hi = rng(x, stream=stream)
        return float(lo), float(hi)
    # Without a device reduction, copy to the host (correct, slower).
    from numba import cuda as nbcuda

    host = nbcuda.as_cuda_array(x).copy_to_host()
    return cpu.finite_range(host if host.flags.c_contiguous else host.copy(order="C"))


def _check_version(version: object, x: Any) -> int:
    """Check ``version=`` (1 or 2)."""
    if (isinstance(version, (bool, np.bool_)) or not isinstance(version, (int, np.integer))
            or version not in (1, 2)):
        raise InputError(
            f"version={version!r} is not a ccoll stream format: pass version=1 or version=2"
        )
    return int(version)


def compress(x: Any, eb: object, *, version: int = 1, stream: Any = None) -> Any:
    """Compress ``x`` (float16/bfloat16/float32/float64, any shape) within the bound ``eb``.

    ``eb`` is ``ccoll.ABS(v)``, ``ccoll.REL(v)`` (``v * (max - min)`` of the finite values;
    constant data gives a lossless stream) or anything :func:`ccoll.errorbound.as_bound`
    accepts. Returns a uint8 stream of the caller's kind on the device of ``x``: a numpy
    array for numpy data, a uint8 tensor for a torch tensor (sharing the stream's memory),
    a CuPy array for CuPy. Every finite element decompresses within the bound, NaN and ±Inf
    come back as they were. float16 and bfloat16 data is compressed as its exact float32
    copy: the stream is a float32 stream whose header records the source dtype, and
    ``decompress(buf)`` rounds the decoded float32 once back to it (see
    :func:`decompress`). The bound holds on that result: the float32 copy is compressed
    with what the final rounding leaves of ``eb`` (half of it at most, less where the
    dtype's gaps at the data's magnitude are narrower:
    :func:`ccoll.compressor.precision.stage_bound`), which is the bound the stream's
    header records. A tensor that requires grad is read through ``x.detach()`` (a
    stream is no part of an autograd graph; the collectives, whose results replace data,
    refuse such tensors instead). ``version`` is the stream format (docs/format.md): 1 (the
    default) or 2, which codes the same quantized values in fewer bytes (arrays of fewer
    than 2^37 elements; both backends write the same bytes). ``decompress``, ``add`` and ``header``
    read the version from the stream; two streams to add must have the same version.

    Every stream has a fixed cost: ``64 + 8 * x.ndim`` bytes of header and shape, 4 bytes
    of bitmap per 1,024 elements (at least 4), and in version 1 per non-zero block of 32
    elements a code byte and at least a 4-byte sign word (docs/format.md, "Fixed
    cost"). An array of
    a few elements therefore comes back larger than its data (3 float32 values: 120
    bytes); where that matters, keep such arrays as they are (``ccoll compress`` does so
    for HDF5 datasets whose stream would not be smaller).
    """
    version = _check_version(version, x)
    bound = as_bound(eb)
    if _backend.backend_of(x) == "cuda":
        name = device_low_precision(x)
        x = _device_input(x, stream)
        _device_dtype(x)
        lo, hi = (_device_range(x, stream) if isinstance(bound, REL) or name is not None
                  else (0.0, 0.0))
        eb_abs = _stage(bound, lo, hi, name)
        return _backend.cuda_module().compress_abs(
            x, eb_abs, stream=stream, version=version,
            source=0 if name is None else SOURCE_CODES[name])
    name = low_precision(x)
    arr = _host_array(x)
    lo, hi = (cpu.finite_range(arr) if isinstance(bound, REL) or name is not None
              else (0.0, 0.0))
    buf = cpu.compress_abs(arr, _stage(bound, lo, hi, name), version)
    if name is not None:  # the header's source dtype (docs/format.md, byte 7)
        buf[7] = SOURCE_CODES[name]
    if _backend.is_torch(x):
        import torch

        return torch.from_numpy(buf)
    return buf


def _stage(bound: ErrorBound, lo: float, hi: float, name: str | None) -> float:
    """Return the absolute bound to compress with.

    That is ``bound`` resolved on ``[lo, hi]``, for float16/bfloat16 data (``name``) less
    what the final rounding to that dtype takes.
    """
    eb_abs = _check_eb_abs(bound.resolve(lo, hi))
    if name is None:
        return eb_abs
    return stage_bound(eb_abs, name, lo, hi, asked=bound)


def compress_abs(
    x: Any, eb_abs: float, *, version: int = 1, stream: Any = None,
    max_blocks: int | None = None
) -> Any:
    """Compress ``x`` with an absolute bound already resolved (finite, ``>= 0``; 0 = lossless).

    ``version`` is the stream format, as in :func:`compress`. ``stream`` is a CUDA stream
    and ``max_blocks`` a cap on the compression kernel's thread blocks (e.g.
    ``Scheduler.grid_limit("compress")``; the stream bytes do not depend on it) for device
    data; both are ignored for host data.
    """
    version = _check_version(version, x)
    eb = _check_eb_abs(eb_abs)
    if _backend.backend_of(x) == "cuda":
        x = _device_input(x, stream)
        _device_dtype(x)
        return _backend.cuda_module().compress_abs(x, eb, stream=stream, max_blocks=max_blocks,
                                                    version=version)
    return cpu.compress_abs(_host_array(x), eb, version)


def _host_stream(buf: Any) -> np.ndarray:
    if _backend.is_torch(buf):
        buf = buf.detach().numpy()
    return cpu.as_stream(buf)


def _host_out(out: Any) -> np.ndarray:
    if _backend.is_torch(out):
        if str(out.dtype) not in _TORCH_FLOATS:
            raise MismatchError(
                f"out has dtype {out.dtype}; expected the stream's dtype (float32 or float64), "
                "or float16/bfloat16 for a float32 stream: pass an out of one of those"
            )
        return out.detach().numpy()
    if not isinstance(out, np.ndarray):
        raise MismatchError(
            f"out must be a numpy array or a CPU tensor, got {type(out).__name__}: pass "
            "np.empty(shape, dtype) or leave out=None"
        )
    return out


def _decompress_narrow(stream: np.ndarray, out: Any, narrow: Narrow) -> Any:
    """Decode a float32 stream and round it once into float16/bfloat16 ``out``."""
    h = cpu.header(stream)
    if h.dtype != np.dtype(np.float32):
        raise MismatchError(
            f"out has dtype {narrow.name} but the stream holds {h.dtype}; decoding into "
            f"{narrow.name} takes a float32 stream: pass an out of dtype {h.dtype}"
        )
    numel = int(math.prod(out.shape))
    if numel != h.n:
        raise MismatchError(
            f"out has {numel} elements, the stream {h.n}: pass an out of shape {h.shape}"
        )
    if _backend.is_torch(out):
        ok = out.is_contiguous()
    else:
        ok = bool(out.flags.c_contiguous and out.flags.writeable)
    if not ok:
        raise MismatchError("out must be C-contiguous and writeable: pass a fresh array")
    narrow.into(out, cpu.decompress(stream))
    return out


def _like_dtype(like: Any) -> np.dtype | None:
    """Return the float32/float64 dtype ``like`` asks for (``None`` for float16/bfloat16)."""
    if Narrow.of(like) is not None:
        return None
    if _backend.is_torch(like):
        if str(like.dtype) not in _TORCH_FLOATS:
            raise _like_dtype_error(like.dtype)
        return _TORCH_FLOATS[str(like.dtype)]
    dt = getattr(like, "dtype", None)
    try:
        npdt = np.dtype(dt) if dt is not None else None
    except TypeError:
        npdt = None
    if npdt not in _FLOATS:
        raise _like_dtype_error(dt if dt is not None else type(like).__name__)
    return npdt


def _like_dtype_error(what: object) -> DTypeError:
    return DTypeError(
        f"like has dtype {what}; decompress returns float16, bfloat16, float32 or float64: "
        "pass like= an array or tensor of one of those (e.g. the data that was compressed)"
    )


def _decompress_like(buf: Any, like: Any, stream: Any) -> Any:
    """Decode ``buf`` into a new array of ``like``'s kind and dtype (see :func:`decompress`)."""
    where = _backend.backend_of(buf)
    if _backend.backend_of(like) != where:
        raise MismatchError(
            f"like lives on the {'device' if where == 'cpu' else 'host'} but the stream on "
            f"the {'host' if where == 'cpu' else 'device'}: pass like= an array where the "
            "stream lives, or move the stream there first"
        )
    want = _like_dtype(like)
    narrow = Narrow.of(like)
    if where == "cuda":
        dnarrow = DeviceNarrow.of(like)
        if dnarrow is not None:
            return dnarrow.result(_device_narrow(buf, dnarrow, stream))
        mod = _backend.cuda_module()
        _check_stream_dtype(mod.header(buf).dtype, want)
        return _device_kind(mod.decompress(buf, stream=stream), like)
    host = _host_stream(buf)
    h = cpu.header(host)
    if narrow is not None:
        if h.dtype != np.dtype(np.float32):
            raise MismatchError(
                f"like has dtype {narrow.name} but the stream holds {h.dtype}; decoding to "
                f"{narrow.name} takes a float32 stream: pass like= an array of dtype {h.dtype}"
            )
        return narrow.result(cpu.decompress(host))
    _check_stream_dtype(h.dtype, want)
    y = cpu.decompress(host)
    if _backend.is_torch(like):
        import torch

        return torch.from_numpy(y)
    return y


def _check_stream_dtype(have: np.dtype, want: np.dtype | None) -> None:
    if want is not None and have != want:
        raise MismatchError(
            f"like has dtype {want} but the stream holds {have}: pass like= an array of "
            f"dtype {have} (or float16/bfloat16 for a float32 stream of such data)"
        )


def _device_kind(y: Any, like: Any) -> Any:
    """Return device array ``y`` as ``like``'s kind (torch, CuPy, numba), sharing memory."""
    if _backend.is_torch(like):
        import torch

        return torch.as_tensor(y, device=like.device)
    if type(like).__module__.split(".", 1)[0] == "cupy":
        import cupy

        return cupy.asarray(y)
    return y


def decompress(buf: Any, out: Any = None, *, like: Any = None, stream: Any = None) -> Any:
    """Decode a stream; dtype and shape come from the stream.

    Without ``out`` or ``like`` the result is a numpy array for a host stream (a numpy
    array or a CPU uint8 tensor) and a device array of the stream's kind for a device
    stream, of the stream's dtype, or of the dtype its header records as the data's
    source (byte 7, docs/format.md: float16 or bfloat16 data that :func:`compress` took
    as its float32 copy), rounded once to nearest to it. numpy has no bfloat16 of its
    own: such a host stream decodes to ``ml_dtypes``' bfloat16 where that package is
    installed, else to a torch bfloat16 tensor where the stream is a tensor, else to
    float32; a device stream to a torch bfloat16 tensor for torch, float32 for CuPy and
    numba (which have no bfloat16). ``like`` (an array or tensor, e.g. the data that was
    compressed; only its kind, device and dtype are read) asks for a new result of its
    kind and dtype: a torch tensor for a tensor, a CuPy array for CuPy, on ``like``'s
    device. ``like`` of dtype float16 or bfloat16 (host or device) decodes a float32
    stream and rounds it once to nearest to that dtype. ``out`` (same dtype, same shape or
    element count, writable, C-contiguous, on the stream's device) receives the values and
    is returned; a host float32 stream also decodes into a float16 or bfloat16 ``out``
    (numpy, torch, ``ml_dtypes``). For data ``x`` of such a dtype compressed by
    :func:`compress` with the bound ``eb``, every finite element of the float16/bfloat16
    result ``z`` has ``|z - x| <= eb``, and of the float32 result (a float32 ``out``)
    ``|y - x| <=`` the stream's own, smaller bound
    (docs/error-bound.md, "float16 and bfloat16").
    Malformed, truncated or foreign bytes raise :class:`ccoll.FormatError`.
    """
    if like is not None:
        if out is not None:
            raise InputError("decompress takes out= or like=, not both: out already says "
                             "where and in which dtype the result goes; drop like=")
        return _decompress_like(buf, like, stream)
    if out is not None and _backend.is_torch(out) and out.requires_grad:
        # As the collectives: writing it in place would go behind autograd's back.
        raise InputError("out is a torch tensor that requires grad: pass out.detach() or "
                         "out=None")
    if _backend.backend_of(buf) == "cuda":
        if out is not None and _backend.backend_of(out) != "cuda":
            raise MismatchError("out must live on the same device as the stream (CUDA)")
        dnarrow = None if out is None else DeviceNarrow.of(out)
        if dnarrow is not None:
            y32 = _device_narrow(buf, dnarrow, stream)
            if tuple(out.shape) != tuple(y32.shape) and math.prod(out.shape) != y32.size:
                raise MismatchError(
                    f"out has shape {tuple(out.shape)} but the stream holds "
                    f"{tuple(y32.shape)}: pass an out of that shape or element count")
            dnarrow.into(out, y32)
            return out
        if out is None:
            return _device_restore(buf, stream)
        return _backend.cuda_module().decompress(buf, out=out, stream=stream)
    if out is None:
        host = _host_stream(buf)
        return _host_restore(cpu.decompress(host), int(host[7]), _backend.is_torch(buf))
    if _backend.backend_of(out) != "cpu":
        raise MismatchError("out must live on the same device as the stream (host)")
    narrow = Narrow.of(out)
    if narrow is not None:
        return _decompress_narrow(_host_stream(buf), out, narrow)
    cpu.decompress(_host_stream(buf), _host_out(out))
    return out


def add(a: Any, b: Any, out: Any = None, *, stream: Any = None) -> Any:
    """Homomorphic sum of two streams of equal dtype, count and ``eb`` (docs/format.md).

    The result decodes to the sum of what ``a`` and ``b`` decode to (exactly for ordinary
    blocks) and its header bound is the sum of theirs. With ``out`` (uint8, at least
    ``max_nbytes`` bytes) the stream is written there and the used prefix is returned.
    Streams that cannot be added raise :class:`ccoll.MismatchError`; a version-1 and a
    version-2 stream raise :class:`ccoll.FormatError` (compress both with one version).
    """
    where = _backend.backend_of(a)
    if _backend.backend_of(b) != where or (out is not None and _backend.backend_of(out) != where):
        raise MismatchError("streams to add (and out) must live on the same device")
    if where == "cuda":
        return _backend.cuda_module().add(a, b, out=out, stream=stream)
    if _backend.is_torch(out):
        out = out.detach().numpy()
    return cpu.add(_host_stream(a), _host_stream(b), out)


def add_data(a: Any, x: Any, eb: float | None = None, *, stream: Any = None) -> Any:
    """Add the array ``x`` to the stream ``a``: ``add(a, compress_abs(x, eb))`` byte for byte.

    ``eb`` is ``a``'s own quantization bound (when given, it must equal it bit for bit, or
    :class:`ccoll.MismatchError` is raised), and ``x`` has ``a``'s dtype and element count
    and lives on its device. The CPU backend does it in one pass, without encoding ``x``
    and decoding it again (a homomorphic ring step adds its own share of a block this
    way); on a GPU it is the two calls.
    """
    if eb is not None:
        eb = _check_eb_abs(eb)  # eb="abc" raised float()'s ValueError
    where = _backend.backend_of(a)
    if _backend.backend_of(x) != where:
        raise MismatchError("the stream and the data to add must live on the same device")
    if where == "cuda":
        mod = _backend.cuda_module()
        ha = mod.header(a)
        grid = ha.eb if eb is None else eb
        x = _device_input(x, stream)  # float16 as its float32 copy, as on the host
        return mod.add(a, mod.compress_abs(x, grid, stream=stream, version=ha.version),
                       stream=stream)
    return cpu.add_data(_host_stream(a), _host_array(x), eb)


def header(buf: Any) -> StreamHeader:
    """Parse and validate a stream's header (dtype, shape, bounds, sizes)."""
    if _backend.backend_of(buf) == "cuda":
        return _backend.cuda_module().header(buf)
    return cpu.header(_host_stream(buf))
