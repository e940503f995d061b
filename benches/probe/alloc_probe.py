"""Host cost of making a call's output tensors, one GPU: the ways a library can
hand a low-latency dispatch's five outputs to Python, timed on this CPU.

    python benches/probe/alloc_probe.py [--iters 2000] [--json OUT.json]

Each variant makes the five outputs of a low-latency dispatch (T=128, H=7168, 8
ranks, 36 local experts, fp8 with scales) and is timed from its first call to its
last (creation only: the tensors are dropped outside the timed region). Medians
of ``--iters`` samples, in us, beside ``x.add_(0)`` in the same run:

- ``empty_strided x5``: five ``torch.empty_strided`` (what the Buffer does today);
- ``one empty + 5 views``: one byte tensor, then a slice, ``view(dtype)`` and
  ``as_strided`` per output;
- ``one empty + split``: one byte tensor, ``split_with_sizes`` into five, then
  ``view(dtype)`` and ``as_strided`` per output;
- ``from_dlpack x5``: ``torch._C._from_dlpack`` of five capsules made beforehand
  (the import alone, the cost of a tensor made outside torch);
- ``aoti empty+delete``: torch's stable C shim (``aoti_torch_empty_strided`` and
  ``aoti_torch_delete_tensor_object``, through ctypes: an upper bound for a native
  caller) for one output;
- ``raw stream``, ``data_ptr x5``: the other per-call lookups;
- ``moelink OutputSet x5 / x1 (C shim)``: moelink's native outputs (one call
  making all five, or the first alone), where moelink is importable.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time

import torch

T, H, R, E_LOCAL = 128, 7168, 8, 36


def specs():
    rows = T * R
    return [
        ((E_LOCAL, rows, H), (rows * H, H, 1), torch.float8_e4m3fn),
        ((E_LOCAL, rows, H // 128), (rows * (H // 128), 1, rows), torch.float32),
        ((E_LOCAL,), (1,), torch.int32),
        ((E_LOCAL, rows), (rows, 1), torch.int32),
        ((E_LOCAL, R), (R, 1), torch.int64),
    ]


def nbytes(shape, dtype):
    n = 1
    for d in shape:
        n *= d
    return (n * torch.empty((), dtype=dtype).element_size() + 255) // 256 * 256


def median_us(fn, iters):
    samples = []
    for _ in range(iters):
        t0 = time.perf_counter_ns()
        out = fn()
        t1 = time.perf_counter_ns()
        del out
        samples.append((t1 - t0) / 1e3)
    return statistics.median(samples)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--iters", type=int, default=2000)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    dev = torch.device("cuda", 0)
    torch.cuda.set_device(dev)
    x = torch.ones(16, device=dev)
    sp = specs()
    sizes = [nbytes(s, d) for s, _, d in sp]
    offsets = [sum(sizes[:i]) for i in range(len(sizes))]
    total = sum(sizes)

    def empty5():
        return [torch.empty_strided(s, st, dtype=d, device=dev) for s, st, d in sp]

    def views5():
        flat = torch.empty(total, dtype=torch.uint8, device=dev)
        return [
            flat[o : o + n].view(d).as_strided(s, st)
            for o, n, (s, st, d) in zip(offsets, sizes, sp)
        ]

    def split5():
        flat = torch.empty(total, dtype=torch.uint8, device=dev)
        parts = flat.split_with_sizes(sizes)
        return [t.view(d).as_strided(s, st) for t, (s, st, d) in zip(parts, sp)]

    imp = torch._C._from_dlpack
    caps_pool = []
    small = [((1,) * len(s), (1,) * len(s), d) for s, _, d in sp]  # the import cost is per tensor
    for _ in range(a.iters + 30):
        caps_pool.append(
            [torch.empty_strided(s, st, dtype=d, device=dev).__dlpack__() for s, st, d in small]
        )
    it = iter(caps_pool)

    def from_dlpack5():
        return [imp(c) for c in next(it)]

    lib = ctypes.CDLL(None)
    try:
        empty_fn = lib.aoti_torch_empty_strided
        del_fn = lib.aoti_torch_delete_tensor_object
    except AttributeError:
        import os

        lib = ctypes.CDLL(os.path.join(os.path.dirname(torch.__file__), "lib", "libtorch_cpu.so"))
        empty_fn = lib.aoti_torch_empty_strided
        del_fn = lib.aoti_torch_delete_tensor_object
    shape0 = (ctypes.c_int64 * 3)(*sp[0][0])
    stride0 = (ctypes.c_int64 * 3)(*sp[0][1])
    handle = ctypes.c_void_p()
    fp8_code = 24  # c10::ScalarType::Float8_e4m3fn

    def aoti1():
        rc = empty_fn(ctypes.c_int64(3), shape0, stride0, ctypes.c_int32(fp8_code),
                      ctypes.c_int32(1), ctypes.c_int32(0), ctypes.byref(handle))  # fmt: skip
        del_fn(handle)
        return rc

    raw = torch._C._cuda_getCurrentRawStream
    outs = empty5()

    native = None
    try:  # moelink's native outputs (torch's C shim), where moelink is importable
        from moelink._buffer_common import OutputSet

        native = OutputSet([(s, st, d, False) for s, st, d in sp], dev)
        if native.native is None:
            native = None
    except ImportError:
        pass

    variants = {
        "x.add_(0)": lambda: x.add_(0),
        "empty_strided x5": empty5,
        "one empty + 5 views": views5,
        "one empty + split": split5,
        "one empty + split, no views": lambda: torch.empty(
            total, dtype=torch.uint8, device=dev
        ).split_with_sizes(sizes),
        "one view(dtype) + as_strided": lambda: outs[0].view(torch.uint8).as_strided((16,), (1,)),
        "from_dlpack x5": from_dlpack5,
        "aoti empty+delete (ctypes)": aoti1,
        "empty_strided x1": lambda: torch.empty_strided(
            sp[0][0], sp[0][1], dtype=sp[0][2], device=dev
        ),  # fmt: skip
        "raw stream": lambda: raw(0),
        **({"moelink OutputSet x5 (C shim)": native.empty} if native is not None else {}),
        **(
            {"moelink OutputSet x1 (C shim)": OutputSet([(*sp[0], False)], dev).empty}
            if native is not None
            else {}
        ),  # fmt: skip
        "data_ptr x5": lambda: [t.data_ptr() for t in outs],
    }
    for fn in variants.values():  # warm up the caching allocator and the code paths
        for _ in range(20):
            fn()
    results = {}
    for name, fn in variants.items():
        results[name] = median_us(fn, a.iters)
        torch.cuda.synchronize()
    ref = results["x.add_(0)"]
    for name, us in results.items():
        print(f"{name:30s} {us:8.2f} us  {us / ref:5.2f}x")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(0), "us": results}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
