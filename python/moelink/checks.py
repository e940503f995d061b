"""Argument checks run before any kernel is launched.

Each check raises ``TypeError`` for an argument of the wrong kind (not a tensor, not
an integer, not a sequence), ``DtypeError`` (both a ``TypeError`` and a
``ValueError``) for a tensor of the wrong dtype, and ``ValueError`` for a wrong
value, with a message that names the argument and says what was expected and what
was given. Tensors may live on any device unless a check asks for one, so everything
here also runs on CPU tensors.

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
    "check_bias",
    "check_bool",
    "check_dispatch_x",
    "check_experts_ranks",
    "check_hidden_bytes",
    "check_int",
    "check_keys",
    "check_multiple",
    "check_rank_list",
    "check_row_bytes",
    "check_same_device",
    "check_tensor",
    "check_topk_idx",
    "check_topk_weights",
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
#: Channels per fp8 scale.
SCALE_BLOCK = LIMITS["fp8_group_size"]
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
    if check_values and topk_idx.numel() > 0:
        lo, hi = torch.stack(torch.aminmax(topk_idx)).tolist()
        bad = lo if lo < -1 else hi if hi >= num_experts else None
        if bad is not None:
            where = (topk_idx == bad).nonzero()[0].tolist()
            raise ValueError(
                f"{name} values must be in [-1, num_experts={num_experts}), got {bad} at {where}"
            )
    return topk_idx


def check_topk_weights(topk_weights, topk_idx):
    """Checks top-k weights: float32 with the shape of ``topk_idx``. Returns them."""
    return check_tensor(
        "topk_weights", topk_weights, dtype=torch.float32, shape=tuple(topk_idx.shape)
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


def check_hidden_bytes(hidden: int, element_size: int) -> int:
    """Checks that a row of ``hidden`` elements of ``element_size`` bytes is a
    positive multiple of 128 bytes, at most ``max_hidden_bytes``; returns the row
    size in bytes."""
    hidden = check_int("hidden", hidden, minimum=1)
    element_size = check_int("element_size", element_size, minimum=1)
    hidden_bytes = hidden * element_size
    if hidden_bytes % HIDDEN_BYTES_ALIGN != 0 or hidden_bytes > LIMITS["max_hidden_bytes"]:
        raise ValueError(
            f"hidden * element_size must be a multiple of {HIDDEN_BYTES_ALIGN} bytes up to "
            f"{LIMITS['max_hidden_bytes']}, got hidden={hidden} * element_size={element_size} "
            f"= {hidden_bytes}"
        )
    return hidden_bytes


def check_dispatch_x(x, num_tokens: int | None = None):
    """Checks the ``x`` of ``dispatch``; returns ``(data, scales or None)``.

    ``x`` is a contiguous bf16 [N, H] tensor, or a tuple ``(data, scales)`` of a
    contiguous float8_e4m3fn [N, H] tensor and float32 scales of shape exactly
    [N, H / 128] with any strides (column-major views are common), on the data's
    device. Rows must be a multiple of 128 bytes. ``num_tokens``, when given, is N.
    """
    is_pair = isinstance(x, tuple)
    if is_pair:
        if len(x) != 2:
            raise ValueError(f"x must be a tensor or a (data, scales) pair, got a {len(x)}-tuple")
        data, scales = x
        data_name = "x[0]"
        check_tensor(data_name, data, dtype=torch.float8_e4m3fn, dims=2, contiguous=True)
    elif isinstance(x, torch.Tensor):
        data, scales = x, None
        data_name = "x"
        check_tensor(data_name, data, dtype=torch.bfloat16, dims=2, contiguous=True)
    else:
        raise TypeError(
            f"x must be a torch.Tensor or a (data, scales) tuple, got {type(x).__name__}"
        )
    n, hidden = data.shape
    if num_tokens is not None:
        num_tokens = check_int("num_tokens", num_tokens, minimum=0)
        if n != num_tokens:
            raise ValueError(f"{data_name} must have {num_tokens} rows (tokens), got {n}")
    check_row_bytes(data_name, data)
    if is_pair:
        check_tensor("x[1] (scales)", scales, dtype=torch.float32, shape=(n, hidden // SCALE_BLOCK))
        check_same_device(**{"x[0]": data, "x[1] (scales)": scales})
    return data, scales


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


def check_bias(bias, num_tokens: int, hidden: int):
    """Checks the ``bias`` of ``combine``: ``None``, one tensor, or a pair of tensors
    or ``None``; each a contiguous bf16 [num_tokens, hidden]. Returns a pair."""
    num_tokens = check_int("num_tokens", num_tokens, minimum=0)
    hidden = check_int("hidden", hidden, minimum=1)
    if bias is None:
        return (None, None)
    if isinstance(bias, torch.Tensor):
        pair, names = (bias, None), ("bias", None)
    elif isinstance(bias, tuple):
        if len(bias) != 2:
            raise ValueError(f"bias must be None, a tensor or a pair, got a {len(bias)}-tuple")
        pair, names = bias, ("bias[0]", "bias[1]")
    else:
        raise TypeError(
            f"bias must be None, a torch.Tensor or a tuple of two, got {type(bias).__name__}"
        )
    for name, b in zip(names, pair):
        if b is not None:
            check_tensor(name, b, dtype=torch.bfloat16, shape=(num_tokens, hidden), contiguous=True)
    if pair[0] is not None and pair[1] is not None:
        check_same_device(**{"bias[0]": pair[0], "bias[1]": pair[1]})
    return tuple(pair)


def check_same_device(*tensors, **named_tensors) -> torch.device | None:
    """Checks that all given tensors share one device; ``None`` entries are skipped.

    Pass tensors by keyword to have them named in the message
    (``check_same_device(x=x, topk_idx=topk_idx)``); positional ones are called
    ``tensors[i]``. Returns the common device (``None`` when no tensor was given).
    """
    items = [(f"tensors[{i}]", t) for i, t in enumerate(tensors)]
    items += list(named_tensors.items())
    first_name, first_device = None, None
    for name, t in items:
        if t is None:
            continue
        check_tensor(name, t)
        if first_device is None:
            first_name, first_device = name, t.device
        elif t.device != first_device:
            raise ValueError(
                f"{name} must be on the same device as {first_name} ({first_device}), "
                f"got {t.device}"
            )
    return first_device
