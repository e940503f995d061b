"""Outputs made natively through torch's C shim (``_native.TorchOutputs``, used by
``_buffer_common.OutputSet``), on the CPU: the same code path as on a GPU but for
the device type."""

from __future__ import annotations

import pytest
import torch
from moelink import _buffer_common, _native
from moelink._buffer_common import OutputSet

pytestmark = pytest.mark.skipif(
    not _buffer_common._TORCH_ALLOC, reason="this torch has no C shim to allocate through"
)

CPU = torch.device("cpu")

#: Specs as ``output_specs`` gives them: (shape, strides, dtype, zeroed).
SPECS = (
    ((3, 5, 8), (40, 8, 1), torch.float8_e4m3fn, False),
    ((3, 5, 2), (10, 1, 5), torch.float32, False),  # column-major inner dims
    None,
    ((7,), (1,), torch.int32, True),
    ((3, 4), (4, 1), torch.int64, False),
    ((2, 6), (6, 1), torch.bfloat16, False),
)


def test_outputs_have_the_specs_shapes_strides_and_dtypes():
    outs = OutputSet(SPECS, CPU)
    assert outs.native is not None
    made = outs.empty()
    assert len(made) == len(SPECS)
    for t, spec in zip(made, SPECS):
        if spec is None:
            assert t is None
            continue
        shape, strides, dtype, _ = spec
        assert type(t) is torch.Tensor
        assert tuple(t.shape) == shape and t.stride() == strides and t.dtype == dtype
        assert t.device == CPU


def test_outputs_are_distinct_writable_tensors():
    made = [t for t in OutputSet(SPECS, CPU).empty() if t is not None]
    ptrs = {t.data_ptr() for t in made}
    assert len(ptrs) == len(made)
    for t in made:
        if t.dtype == torch.float8_e4m3fn:
            t.view(torch.uint8).fill_(0x5A)
        else:
            t.fill_(3)
    assert all(int(v) == 3 for v in made[2])  # int32 output kept what was written


#: A second output: a set of one is made through torch.empty_strided (cheaper).
SMALL = ((4,), (1,), torch.int64, False)


def test_a_single_output_goes_through_torch():
    assert OutputSet((SMALL, None), CPU).native is None
    assert OutputSet((SMALL, SMALL), CPU).native is not None


def test_zeroed_output_is_zero_filled_over_reused_memory():
    # An unzeroed allocation of the same size poisoned and freed first: the
    # allocator hands its memory back, so an output left unfilled shows 0x7f7f7f7f.
    spec = ((1 << 16,), (1,), torch.int32, True)
    for _ in range(3):
        junk = OutputSet(((spec[0], spec[1], spec[2], False), SMALL), CPU).empty()[0]
        junk.fill_(0x7F7F7F7F)
        del junk
        t, _ = OutputSet((spec, SMALL), CPU).empty()
        assert int(t.abs().max()) == 0


def test_refused_allocation_raises_torchs_own_error():
    # The shim refuses (no memory for 2**60 bytes); OutputSet then allocates through
    # torch.empty_strided, which raises torch's error, not a silent None.
    huge = (((1 << 60),), (1,), torch.uint8, False)
    outs = OutputSet((SMALL, huge), CPU)
    assert outs.native is not None and outs.native.empty(-1) is None
    with pytest.raises(RuntimeError):
        outs.empty()


def test_unknown_dtype_is_a_value_error():
    with pytest.raises(ValueError, match="not torch's"):
        _native.TorchOutputs([((1,), (1,), "no_such_dtype", False)])


def test_shape_and_strides_must_match():
    with pytest.raises(ValueError, match="shape and strides"):
        _native.TorchOutputs([((1, 2), (1,), "float32", False)])


def test_outputs_are_freed_with_their_tensors():
    import weakref

    t, _ = OutputSet((((1024,), (1,), torch.float32, False), SMALL), CPU).empty()
    storage = t.untyped_storage()
    ref = weakref.ref(t)
    del t
    assert ref() is None  # no reference kept on the native side
    assert storage.nbytes() == 4096


def test_outputs_after_the_first_are_views_of_one_allocation_that_never_overlap():
    # The first output (a call's recv_x) is an allocation of its own; the others
    # share one, each 256 bytes aligned within it, their bytes disjoint.
    made = [t for t in OutputSet(SPECS, CPU).empty() if t is not None]
    first, rest = made[0], made[1:]
    shared = {t.untyped_storage().data_ptr() for t in rest}
    assert len(shared) == 1 and first.untyped_storage().data_ptr() not in shared
    spans = []
    base = rest[0].untyped_storage().data_ptr()
    for t in rest:
        assert (t.data_ptr() - base) % 256 == 0
        last = sum((n - 1) * s for n, s in zip(t.shape, t.stride()))
        spans.append((t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()))
    spans.sort()
    assert all(a_end <= b_start for (_, a_end), (b_start, _) in zip(spans, spans[1:]))
    # Each output written whole keeps its own values.
    for i, t in enumerate(rest):
        t.fill_(i + 1)
    for i, t in enumerate(rest):
        assert bool((t == i + 1).all()), f"output {i + 1} was overwritten"


def test_views_keep_their_shared_allocation_alive():
    import weakref

    made = [t for t in OutputSet(SPECS, CPU).empty() if t is not None]
    keep = made[-1]
    others = [weakref.ref(t) for t in made[1:-1]]
    del made
    assert all(r() is None for r in others)
    keep.fill_(7)  # its storage is still alive and writable
    assert bool((keep == 7).all())


# ----- tensor arguments read through the shim (``_native.tensor_args``) -----------------

NAMED_DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                torch.float16, torch.bfloat16, torch.float32, torch.float64,
                torch.float8_e4m3fn, torch.float8_e5m2)  # fmt: skip


def as_read(t):
    """What the one-call paths must read of plain tensor ``t``."""
    name = str(t.dtype).removeprefix("torch.")
    return (name, list(t.shape), list(t.stride()), -1, t.data_ptr())


def test_tensor_args_read_meta_and_address_as_torch_gives_them():
    base = torch.arange(96, dtype=torch.float32).view(4, 6, 4)
    tensors = [
        base,
        base[:, ::2, 1:],  # strided, offset
        base.transpose(0, 2),
        torch.tensor(3),  # 0-dim
        torch.empty(0, 7),
        *(torch.empty(2, 3).to(d) for d in NAMED_DTYPES),
    ]
    got = _native.tensor_args([None, *tensors, None])
    assert got[0] is None and got[-1] is None
    assert got[1:-1] == [as_read(t) for t in tensors]


@pytest.mark.parametrize(
    "bad",
    [
        torch.empty(2).as_subclass(type("Sub", (torch.Tensor,), {})),
        torch.empty(2, dtype=torch.complex64),  # a dtype the calls do not name
        3,
        [torch.empty(2)],
    ],
    ids=["subclass", "complex64", "int", "list"],
)
def test_tensor_args_decline_anything_else(bad):
    assert _native.tensor_args([torch.empty(2), bad]) is None


def test_tensor_args_never_meet_a_torch_function_mode():
    from torch.overrides import TorchFunctionMode

    seen = []

    class Recording(TorchFunctionMode):
        def __torch_function__(self, func, types, args=(), kwargs=None):
            seen.append(func)
            return func(*args, **(kwargs or {}))

    x = torch.randn(3, 4)
    xt = x.t()
    with Recording():
        got = _native.tensor_args([x, xt])
    assert seen == []
    assert got == [as_read(x), as_read(xt)]
