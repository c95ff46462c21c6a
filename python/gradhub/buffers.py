"""Zero-copy access to numpy arrays and CPU torch tensors, and pinned host
copies of CUDA tensors.

`get_buffer` returns the raw pointer, size and dtype of a contiguous, writable
buffer; the caller keeps the object alive for as long as the pointer is used
(the core holds a reference until the operation completes). `host_memory`
gives the host memory an operation works on: the object itself, or a pinned host copy of
a CUDA tensor. torch is never imported here (a CUDA tensor implies it is
loaded already), so servers and numpy-only users don't pay for it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np

_NUMPY_DTYPES = {np.dtype(np.float32): "float32", np.dtype(np.float16): "float16", np.dtype(np.float64): "float64",
                 np.dtype(np.int32): "int32", np.dtype(np.int64): "int64"}
_TORCH_DTYPES = {"torch.float32": "float32", "torch.float16": "float16", "torch.bfloat16": "bfloat16",
                 "torch.float64": "float64", "torch.int32": "int32", "torch.int64": "int64"}
# What the servers sum: float64 and the integers exactly, in their own type
# (integers wrap as torch's do); float16/bfloat16 in float32, rounded once.
WIRE_DTYPES = ("float32", "float16", "bfloat16", "float64", "int32", "int64")
INTEGER_DTYPES = ("int32", "int64")


@dataclass
class Buffer:
    ptr: int
    nbytes: int
    dtype: str
    obj: Any


def is_torch_tensor(x: Any) -> bool:
    return type(x).__module__.startswith("torch") and hasattr(x, "data_ptr") and hasattr(x, "is_contiguous")


def get_buffer(x: Any, dtype: str | None = None) -> Buffer:
    """Describe `x` for an in-place operation. `dtype` overrides the element
    type for raw buffers (e.g. a uint16 numpy array holding bfloat16 bits)."""
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous:
            raise ValueError("gradhub needs a C-contiguous array (use np.ascontiguousarray and copy back)")
        if not x.flags.writeable:
            raise ValueError("gradhub works in place and needs a writable array")
        own = _NUMPY_DTYPES.get(x.dtype) or ("bfloat16" if x.dtype.name == "bfloat16" else None)
        dt = _check_override(dtype, own, str(x.dtype), x.dtype.itemsize)
        return Buffer(x.ctypes.data, x.nbytes, dt, x)
    if is_torch_tensor(x):
        if x.device.type != "cpu":
            raise ValueError(f"gradhub needs host memory; got a tensor on {x.device} (see buffers.host_memory)")
        dt = _check_tensor(x, dtype)
        return Buffer(x.data_ptr(), x.numel() * x.element_size(), dt, x)
    raise TypeError(f"gradhub works on numpy arrays and CPU or CUDA torch tensors, not {type(x).__name__}")


def raw_buffer(x: Any) -> Buffer:
    """The bytes of `x` as they are (any dtype): a C-contiguous numpy array
    or a contiguous CPU torch tensor; to move, not to sum."""
    if isinstance(x, np.ndarray):
        if not x.flags.c_contiguous or not x.flags.writeable:
            raise ValueError("gradhub needs a C-contiguous, writable array")
        return Buffer(x.ctypes.data, x.nbytes, "bytes", x)
    if is_torch_tensor(x):
        if x.device.type != "cpu" or not x.is_contiguous():
            raise ValueError(f"gradhub needs contiguous host memory; got a tensor on {x.device}"
                             + ("" if x.is_contiguous() else " that is not contiguous"))
        return Buffer(x.data_ptr(), x.numel() * x.element_size(), "bytes", x)
    raise TypeError(f"gradhub moves the bytes of numpy arrays and torch tensors, not {type(x).__name__}")


def _check_tensor(x: Any, dtype: str | None) -> str:
    """Checks for an in-place operation on a torch tensor; returns its wire dtype."""
    if not x.is_contiguous():
        raise ValueError("gradhub needs a contiguous tensor (call .contiguous() and copy back)")
    if x.requires_grad:
        raise ValueError(
            "gradhub works in place and cannot modify a tensor that requires grad; "
            "pass tensor.detach() or a gradient (param.grad)"
        )
    return _check_override(dtype, _TORCH_DTYPES.get(str(x.dtype)), str(x.dtype), x.element_size())


def _check_override(dtype: str | None, own: str | None, name: str, itemsize: int) -> str:
    """The wire dtype of a buffer whose own element type is `own` (None:
    not a supported float). `dtype=` may only restate it, or say that
    2-byte raw elements (e.g. uint16) hold bfloat16 bits: anything else
    would sum the bits as garbage."""
    if dtype is None:
        if own is None:
            raise TypeError(f"unsupported dtype {name} (use {', '.join(WIRE_DTYPES)})")
        return own
    if dtype not in WIRE_DTYPES:
        raise ValueError(f"dtype={dtype!r}: use one of {', '.join(repr(d) for d in WIRE_DTYPES)}")
    if dtype == own:
        return dtype
    if dtype == "bfloat16" and own is None and itemsize == 2:
        return dtype
    raise ValueError(f"dtype={dtype!r} does not match the data's {name}"
                     + (" (dtype='bfloat16' takes 2-byte raw elements, e.g. uint16 bit patterns)"
                        if dtype == "bfloat16" else ""))


def validate(x: Any, dtype: str | None = None) -> None:
    """Raise what an in-place operation on `x` would raise, without copying
    or touching it."""
    if is_torch_tensor(x) and x.device.type == "cuda":
        _check_tensor(x, dtype)
    else:
        get_buffer(x, dtype)


def host_memory(x: Any, dtype: str | None = None) -> Any:
    """The host memory an in-place operation on `x` works on: `x` itself for
    numpy arrays and CPU tensors (zero-copy), a pinned host copy for a CUDA
    tensor (the caller copies the result back with `x.copy_(host)`)."""
    device = getattr(x, "device", None)
    kind = getattr(device, "type", None)
    if isinstance(x, np.ndarray) or kind is None or kind == "cpu":
        return x
    if kind != "cuda":
        raise ValueError(f"gradhub supports CPU and CUDA tensors, not {device}")
    import torch  # loaded already: x is a torch tensor

    if not torch.cuda.is_available():
        raise RuntimeError("a CUDA tensor was given but no GPU is available")
    _check_tensor(x, dtype)
    host = torch.empty(x.shape, dtype=x.dtype, pin_memory=True)
    host.copy_(x)
    return host


def describe(x: Any) -> tuple[int, str]:
    """(number of elements, dtype name) of an array or tensor, for declarations."""
    if isinstance(x, np.ndarray):
        dt = _NUMPY_DTYPES.get(x.dtype) or ("bfloat16" if x.dtype.name == "bfloat16" else None)
    elif is_torch_tensor(x):
        dt = _TORCH_DTYPES.get(str(x.dtype))
    else:
        raise TypeError(f"cannot declare a {type(x).__name__}; pass an array, a tensor or (numel, dtype)")
    if dt is None:
        raise TypeError(f"unsupported dtype {x.dtype} (use {', '.join(WIRE_DTYPES)})")
    return int(x.size if isinstance(x, np.ndarray) else x.numel()), dt
