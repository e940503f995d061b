"""Argument checks run before any kernel is launched.

Each check raises ``TypeError`` for an argument of the wrong kind (not a tensor, not
an integer, not a sequence), ``DtypeError`` (both a ``TypeError`` and a
``ValueError``) for a tensor of the wrong dtype, and ``ValueError`` for a wrong
value, with a message that names the argument and says what was expected and what
was given. Tensors may live on any device unless a check asks for one, so everything
here also runs on CPU tensors.

The checks and output shapes of the ``Buffer``'s calls live in Rust
(``ep_core::calls``, shared with the Rust API); the ``Buffer`` hands them each
tensor's ``tensor_meta`` and raises here only what is Python's to see: an argument
that is not a tensor, an int or a bool (``check_int``, ``check_bool``), and the
values of ``topk_idx`` (``check_topk_values``, a device sync). The native plans
raise the same three kinds of error (``DtypeError`` is this module's). The checks
below also serve the CPU reference (``moelink.reference``) and the torch ops.

The limits (``LIMITS``) come from the Rust definitions through
``moelink._native.limits()``; ``docs/api-notes.md`` has them as a table.
"""

from __future__ import annotations

import operator
from collections.abc import Mapping

import torch

from . import _native

__all__ = [
    "LIMITS",
    "MAX_TOPK",
    "DtypeError",
    "check_bool",
    "check_experts_ranks",
    "check_int",
    "check_keys",
    "check_multiple",
    "check_rank_list",
    "check_row_bytes",
    "check_tensor",
    "check_topk_idx",
    "check_topk_values",
    "device_index",
    "optional_meta",
    "tensor_meta",
    "tensor_sig",
]


class DtypeError(TypeError, ValueError):
    """A tensor of the wrong dtype. A ``TypeError`` (the tensor is of the wrong kind)
    and, as before it existed, a ``ValueError``."""


#: Every limit of the API, name -> value, as defined in Rust (``ep_kernels::limits``
#: and ``collectives::args``).
LIMITS = {name: value for name, value, _ in _native.limits()}
#: Largest number of experts per token (``topk_idx.shape[1]``) the kernels handle.
MAX_TOPK = LIMITS["max_topk"]
#: Row sizes in bytes must be multiples of this.
HIDDEN_BYTES_ALIGN = LIMITS["row_bytes_alignment"]


def tensor_ptr(t) -> int:
    """Device address of ``t``; 0 for None or an empty tensor (what the native
    calls take for an absent tensor)."""
    return 0 if t is None or t.numel() == 0 else t.data_ptr()


#: ``tensor_sig`` of anything that is not exactly a ``torch.Tensor``: unhashable,
#: so a key holding it misses every ``PlanCache`` and the call takes the checked path.
_NO_SIG: list = []


def tensor_sig(t):
    """What the checks read of a tensor argument, hashable: (dtype, shape, device,
    contiguous); ``None`` for None; an unhashable marker for anything else
    (non-tensors and tensor subclasses are always checked in full)."""
    if t is None:
        return None
    if type(t) is not torch.Tensor:
        return _NO_SIG
    return (t.dtype, t.shape, t.device, t.is_contiguous())


def device_index(device: torch.device) -> int:
    """``device`` as the native plans take it: a CUDA device's index,
    ``_native.CPU_DEVICE`` for the CPU, ``_native.OTHER_DEVICE`` for any other."""
    if device.type == "cuda":
        return device.index
    return _native.CPU_DEVICE if device.type == "cpu" else _native.OTHER_DEVICE


def tensor_meta(name: str, t) -> tuple:
    """What the native plans (``ep_core::calls::TensorMeta``) read of the tensor
    argument ``name``: ``(dtype name, shape, strides, device_index)``; ``TypeError``
    naming it where ``t`` is not a tensor."""
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    return (str(t.dtype), t.shape, t.stride(), device_index(t.device))


def optional_meta(name: str, t):
    """``tensor_meta`` of an optional tensor argument (None for None)."""
    return None if t is None else tensor_meta(name, t)


def check_int(name: str, value, *, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as a Python ``int`` (any integer type but ``bool``), within bounds."""
    if isinstance(value, bool) or isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be an int, got {type(value).__name__}")
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if minimum is not None and value < minimum:
        what = "positive" if minimum == 1 else f">= {minimum}"
        raise ValueError(f"{name} must be {what}, got {value}")
    if maximum is not None and value > maximum:
        raise ValueError(f"{name} must be <= {maximum}, got {value}")
    return value


def check_multiple(name: str, value, unit: int, maximum: int) -> int:
    """``value`` as an ``int``: a positive multiple of ``unit``, at most ``maximum``."""
    value = check_int(name, value)
    if value <= 0 or value % unit != 0 or value > maximum:
        raise ValueError(
            f"{name} must be a positive multiple of {unit} up to {maximum}, got {value}"
        )
    return value


def check_bool(name: str, value) -> bool:
    """``value`` as a ``bool``: ``True`` / ``False`` (or an integer 0 / 1)."""
    if isinstance(value, bool):
        return value
    if not isinstance(value, torch.Tensor):
        try:
            if operator.index(value) in (0, 1):
                return bool(value)
        except TypeError:
            pass
    raise TypeError(f"{name} must be a bool, got {type(value).__name__}")


def check_rank_list(name: str, value, num_ranks: int | None = None) -> list:
    """``value`` (a list or tuple with one entry per rank) as a list: ``num_ranks``
    entries when given, else 1 to ``max_ranks``."""
    if not isinstance(value, (list, tuple)):
        raise TypeError(
            f"{name} must be a list with one entry per rank, got {type(value).__name__}"
        )
    if num_ranks is not None and len(value) != num_ranks:
        raise ValueError(f"{name} must have one entry per rank ({num_ranks}), got {len(value)}")
    if not 1 <= len(value) <= LIMITS["max_ranks"]:
        raise ValueError(
            f"{name} must have one entry per rank, 1 to {LIMITS['max_ranks']}, got {len(value)}"
        )
    return list(value)


def check_keys(name: str, value, required, optional=()) -> Mapping:
    """``value``: a mapping with every key of ``required`` and no key beyond
    ``required`` and ``optional``."""
    if not isinstance(value, Mapping):
        raise TypeError(f"{name} must be a dict, got {type(value).__name__}")
    missing = [k for k in required if k not in value]
    if missing:
        raise ValueError(f"{name} must have the keys {list(required)}, missing {missing}")
    unknown = [k for k in value if k not in required and k not in optional]
    if unknown:
        raise ValueError(
            f"{name} has unknown keys {unknown}; known: {list(required) + list(optional)}"
        )
    return value


def _shape_str(shape) -> str:
    return "[" + ", ".join("*" if s is None else str(s) for s in shape) + "]"


def _device_matches(actual: torch.device, expected: torch.device) -> bool:
    if actual.type != expected.type:
        return False
    return expected.index is None or actual.index == expected.index


def check_tensor(
    name: str,
    t,
    *,
    dtype=None,
    dims: int | None = None,
    shape=None,
    device=None,
    contiguous: bool = False,
):
    """Checks that ``t`` is a ``torch.Tensor`` as described; returns ``t``.

    - ``dtype``: a ``torch.dtype`` or a tuple of accepted ones.
    - ``dims``: number of dimensions.
    - ``shape``: expected sizes; ``None`` entries accept any size (implies ``dims``).
    - ``device``: ``"cuda"`` (or ``torch.device("cuda")``) accepts any CUDA device;
      a device with an index (``"cuda:1"``) only that one; ``"cpu"`` the CPU.
    - ``contiguous``: require a contiguous tensor.
    """
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if dtype is not None:
        accepted = tuple(dtype) if isinstance(dtype, (tuple, list, set, frozenset)) else (dtype,)
        if t.dtype not in accepted:
            want = str(accepted[0]) if len(accepted) == 1 else f"one of {list(map(str, accepted))}"
            raise DtypeError(f"{name} must have dtype {want}, got {t.dtype}")
    if shape is not None:
        shape = tuple(shape)
        if dims is not None and dims != len(shape):
            raise ValueError(f"check_tensor: dims={dims} contradicts shape {_shape_str(shape)}")
        dims = len(shape)
    if dims is not None and t.dim() != dims:
        raise ValueError(f"{name} must be {dims}-D, got {t.dim()}-D with shape {list(t.shape)}")
    if shape is not None and any(w is not None and w != s for w, s in zip(shape, t.shape)):
        raise ValueError(f"{name} must have shape {_shape_str(shape)}, got {list(t.shape)}")
    if device is not None:
        expected = torch.device(device)
        if not _device_matches(t.device, expected):
            want = "a CUDA device" if expected == torch.device("cuda") else str(expected)
            raise ValueError(f"{name} must be on {want}, got {t.device}")
    if contiguous and not t.is_contiguous():
        raise ValueError(
            f"{name} must be contiguous, got shape {list(t.shape)} with strides {list(t.stride())}"
        )
    return t


def check_topk_idx(topk_idx, num_experts: int, *, check_values: bool = True, name="topk_idx"):
    """Checks top-k expert ids (called ``name``): int64 [N, K] with 1 <= K <= 32,
    every value in ``[-1, num_experts)`` (-1 = no expert). Returns ``topk_idx``.

    The value check is one min/max reduction; on a CUDA tensor reading its result
    waits for the device, so paths that must not synchronise (``num_worst_tokens``,
    CUDA-graph capture) pass ``check_values=False``.
    """
    num_experts = check_int("num_experts", num_experts, minimum=1)
    check_tensor(name, topk_idx, dtype=torch.int64, dims=2)
    k = topk_idx.shape[1]
    if not 1 <= k <= MAX_TOPK:
        raise ValueError(
            f"{name} must have 1 to {MAX_TOPK} columns (experts per token), "
            f"got shape {list(topk_idx.shape)}"
        )
    if check_values:
        check_topk_values(topk_idx, num_experts, name)
    return topk_idx


def check_topk_values(topk_idx, num_experts: int, name: str = "topk_idx") -> None:
    """Checks that every id of the int64 tensor ``topk_idx`` (called ``name``) is in
    ``[-1, num_experts)``: one min/max reduction, whose result a CUDA tensor's host
    read waits for."""
    if topk_idx.numel() > 0:
        lo, hi = torch.stack(torch.aminmax(topk_idx)).tolist()
        bad = lo if lo < -1 else hi if hi >= num_experts else None
        if bad is not None:
            where = (topk_idx == bad).nonzero()[0].tolist()
            raise ValueError(
                f"{name} values must be in [-1, num_experts={num_experts}), got {bad} at {where}"
            )


def check_experts_ranks(num_experts: int, num_ranks: int, ranks_name: str = "num_ranks") -> int:
    """Checks that ``num_experts`` (>= 1) splits evenly over ``num_ranks`` (1 to
    ``max_ranks``, called ``ranks_name``), at most ``max_experts_per_rank`` each;
    returns the number of experts per rank."""
    num_ranks = check_int(ranks_name, num_ranks, minimum=1, maximum=LIMITS["max_ranks"])
    num_experts = check_int("num_experts", num_experts, minimum=1, maximum=LIMITS["max_experts"])
    if num_experts % num_ranks != 0:
        raise ValueError(
            f"num_experts must be a multiple of {ranks_name}, got num_experts={num_experts} "
            f"and {ranks_name}={num_ranks}"
        )
    per_rank = num_experts // num_ranks
    if per_rank > LIMITS["max_experts_per_rank"]:
        raise ValueError(
            f"num_experts must be at most {LIMITS['max_experts_per_rank']} per rank, got "
            f"num_experts={num_experts} over {ranks_name}={num_ranks} ({per_rank} per rank)"
        )
    return per_rank


def check_row_bytes(name: str, t) -> int:
    """Checks that the rows of the 2-D tensor ``t`` (called ``name``) are a
    positive multiple of 128 bytes, at most ``max_hidden_bytes``; returns their size."""
    hidden = t.shape[1]
    row_bytes = hidden * t.element_size()
    max_bytes = LIMITS["max_hidden_bytes"]
    if row_bytes == 0 or row_bytes % HIDDEN_BYTES_ALIGN != 0 or row_bytes > max_bytes:
        raise ValueError(
            f"{name} rows must be a positive multiple of {HIDDEN_BYTES_ALIGN} bytes up to "
            f"{max_bytes}, got hidden={hidden} of {t.dtype} ({row_bytes} bytes)"
        )
    return row_bytes
