"""Kernel entry points used by the tests (not part of the public API)."""

from __future__ import annotations

from . import _native


def reduce_rows_bf16(x, out=None):
    """``bf16(sum over rows of x in float32)`` computed by the CUDA kernel.

    ``x``: a bf16 CUDA tensor [rows, cols]. Returns a bf16 [cols] tensor (``out``
    when given: a contiguous bf16 [cols] tensor on the same device).
    """
    import torch

    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    if x.dtype != torch.bfloat16:
        raise ValueError(f"x must be bfloat16, got {x.dtype}")
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D [rows, cols], got shape {tuple(x.shape)}")
    if not x.is_cuda:
        raise ValueError(f"x must be a CUDA tensor, got device {x.device}")
    x = x.contiguous()
    if out is None:
        out = torch.empty(x.shape[1], dtype=torch.bfloat16, device=x.device)
    elif out.dtype != torch.bfloat16 or out.shape != (x.shape[1],) or out.device != x.device:
        raise ValueError(f"out must be bf16 [{x.shape[1]}] on {x.device}")
    elif not out.is_contiguous():
        raise ValueError("out must be contiguous")
    stream = torch.cuda.current_stream(x.device)
    _native.reduce_rows_bf16(
        x.device.index, stream.cuda_stream, x.data_ptr(), out.data_ptr(), x.shape[0], x.shape[1]
    )
    return out


class CheckedPath:
    """Stands in for a Buffer's ``_ll_state`` (``_native.LlCalls``) with its one-call
    path declining, so that every low-latency call takes the checked Python path
    (what ``async_finish=True`` takes); the bookkeeping stays the real one's. For
    benchmarks and tests that compare the two paths::

        buf._ll_state = CheckedPath(buf._ll_state)
    """

    def __init__(self, real) -> None:
        self.real = real

    def dispatch(self, *args):
        return None

    def combine(self, *args):
        return None

    def __getattr__(self, name):
        return getattr(self.real, name)
