"""CPU tests of ``moelink.AllReduce``: the selector (the Rust one, through
``moelink.allreduce.plan``) and the argument checks that run before any launch.
The GPU tests are ``tests/multi_gpu/test_allreduce.py``."""

from __future__ import annotations

import json

import moelink
import pytest
import torch
import torch.distributed as dist
from moelink import allreduce as ar
from moelink.allreduce import check_all_gather_args, check_all_reduce_args, check_geometry, plan

KIB, MIB = 1 << 10, 1 << 20
CPU = torch.device("cpu")


def alg(nbytes, world_size=4, **kw):
    return plan(nbytes, world_size, **kw)[0]


# ----------------------------------------------------------------------------
# Selector
# ----------------------------------------------------------------------------


def test_algorithm_collection():
    assert ar.ALGORITHMS == {
        "oneshot_ll": "allreduce",
        "twoshot_ll": "allreduce",
        "rsag": "allreduce",
        "rsag_zc": "allreduce",
        "rsag_push": "allreduce",
        "ag_ll": "allgather",
        "ag_mesh": "allgather",
    }
    assert moelink.AllReduce is ar.AllReduce


def test_default_choice_follows_message_size():
    assert alg(2) == "oneshot_ll"
    assert alg(1 * KIB) == "oneshot_ll"
    assert alg(128 * KIB) == "oneshot_ll"
    assert alg(128 * KIB + 2) == "twoshot_ll"
    assert alg(512 * KIB) == "twoshot_ll"
    assert alg(512 * KIB + 2) == "rsag_push"
    assert alg(64 * MIB) == "rsag_push"
    assert alg(1 * MIB, registered=True) == "rsag_push"
    assert alg(2 * MIB, registered=True) == "rsag_push"
    # A registered small message still takes the LL path.
    assert alg(4 * KIB, registered=True) == "oneshot_ll"


def test_default_choice_depends_on_world_size():
    assert alg(200 * KIB, world_size=2) == "oneshot_ll"
    assert alg(200 * KIB, world_size=4) == "twoshot_ll"
    assert alg(64 * KIB, world_size=8) == "twoshot_ll"
    assert alg(16 * KIB, world_size=8) == "oneshot_ll"


def test_limits_move_the_crossovers():
    assert alg(8 * KIB, oneshot_max_bytes=4 * KIB) == "twoshot_ll"
    assert alg(8 * KIB, oneshot_max_bytes=4 * KIB, twoshot_max_bytes=0) == "rsag_push"
    assert alg(2 * MIB, max_bytes=2 * MIB) == "rsag_push"


def test_allgather_choice():
    assert alg(16 * KIB, collective="allgather") == "ag_ll"
    assert alg(64 * KIB, collective="allgather") == "ag_ll"  # 256 KiB of output
    assert alg(64 * KIB + 1, collective="allgather") == "ag_mesh"
    # The whole output (world_size x nbytes) must fit max_bytes, registered or not.
    assert alg(16 * MIB, collective="allgather", registered=True) == "ag_mesh"


def test_default_geometry_is_sane():
    for n in (1, 1000, 64 * KIB, 1 * MIB, 64 * MIB):
        _, blocks, threads = plan(n, 4)
        assert 1 <= blocks <= 128 and threads % 32 == 0 and 32 <= threads <= 1024
    assert plan(1 * KIB, 4) == ("oneshot_ll", 1, 128)
    # Never more blocks than the GPU allows.
    assert plan(256 * MIB, 4, max_bytes=256 * MIB, max_blocks=16)[1] <= 16


def test_tuned_entries_take_precedence_where_they_apply():
    tuned = [
        ("allreduce", False, False, 10, "rsag", 4, 256),
        ("allreduce", True, False, 10, "twoshot_ll", 2, 128),
        ("allreduce", False, False, 23, "oneshot_ll", 8, 512),  # 8 MiB > oneshot limit
        ("allgather", False, False, 12, "ag_mesh", 3, 64),
    ]
    assert plan(1000, 4, tuned=tuned) == ("rsag", 4, 256)
    assert plan(513, 4, tuned=tuned) == ("rsag", 4, 256)  # same power-of-two bucket
    assert plan(512, 4, tuned=tuned)[0] == "oneshot_ll"  # no entry: thresholds
    assert plan(1000, 4, capturing=True, tuned=tuned) == ("twoshot_ll", 2, 128)
    assert plan(1000, 4, registered=True, tuned=tuned) == ("rsag", 4, 256)
    assert plan(8 * MIB, 4, tuned=tuned)[0] == "rsag_push"  # the entry does not apply
    assert plan(4 * KIB, 4, collective="allgather", tuned=tuned) == ("ag_mesh", 3, 64)
    # Too many blocks for this GPU: the entry is skipped.
    assert plan(1000, 4, max_blocks=2, tuned=tuned)[0] == "oneshot_ll"
    with pytest.raises(ValueError, match="algorithm"):
        plan(1000, 4, tuned=[("allreduce", False, False, 10, "ag_ll", 1, 32)])


def test_pins_and_geometry_overrides():
    assert plan(64 * KIB, 4, algorithm="rsag", num_blocks=3, num_threads=96) == ("rsag", 3, 96)
    assert plan(64 * KIB, 4, algorithm="twoshot_ll")[0] == "twoshot_ll"
    with pytest.raises(ValueError, match="oneshot_max_bytes"):
        plan(1 * MIB, 4, algorithm="oneshot_ll")
    with pytest.raises(ValueError, match="register"):
        plan(1 * MIB, 4, algorithm="rsag_zc")
    assert plan(1 * MIB, 4, algorithm="rsag_zc", registered=True)[0] == "rsag_zc"
    with pytest.raises(ValueError, match="unknown allreduce algorithm"):
        plan(1 * KIB, 4, algorithm="ag_ll")
    with pytest.raises(ValueError, match="unknown allgather algorithm"):
        plan(1 * KIB, 4, collective="allgather", algorithm="oneshot_ll")
    with pytest.raises(ValueError, match="num_blocks"):
        plan(1 * KIB, 4, num_blocks=129)
    # Above the blocks every rank's share allows (max_blocks), but within the
    # kernels' 128: capped, so ranks that share a GPU stay resident.
    assert plan(1 * KIB, 4, num_blocks=17, max_blocks=16)[1] == 16
    with pytest.raises(ValueError, match="num_threads"):
        plan(1 * KIB, 4, num_threads=48)
    with pytest.raises(TypeError, match="algorithm"):
        plan(1 * KIB, 4, algorithm=3)


def test_every_size_gets_an_applicable_algorithm():
    for r in (1, 2, 3, 4, 8):
        for k in range(1, 27):
            for n in ((1 << k) - 1, 1 << k):
                for registered in (False, True):
                    a, b, t = plan(n, r, registered=registered)
                    # Pinning what the selector chose must be accepted.
                    assert plan(n, r, registered=registered, algorithm=a)[0] == a


# ----------------------------------------------------------------------------
# Argument checks (before any launch)
# ----------------------------------------------------------------------------


def check(t, op="sum", out=None, accum=None, device=CPU, max_bytes=1 << 20):
    return check_all_reduce_args(t, op, out, accum, device, max_bytes)


@pytest.mark.parametrize(
    "dtype, name",
    [
        (torch.bfloat16, "bf16"),
        (torch.float16, "fp16"),
        (torch.float32, "fp32"),
        (torch.int32, "int32"),
        (torch.float8_e4m3fn, "fp8_e4m3"),
        (torch.float8_e5m2, "fp8_e5m2"),
    ],
)
def test_supported_dtypes_and_ops(dtype, name):
    t = torch.zeros(17, dtype=dtype)
    for op in ("sum", "min", "max", "SUM"):
        d, o, a, out = check(t, op)
        assert (d, o, a) == (name, op.lower(), None) and out is t
    if hasattr(dist, "ReduceOp"):
        assert check(t, dist.ReduceOp.MAX)[1] == "max"


def test_unsupported_dtype_op_and_kinds():
    with pytest.raises(TypeError, match="float64"):
        check(torch.zeros(4, dtype=torch.float64))
    with pytest.raises(TypeError, match="int64"):
        check(torch.zeros(4, dtype=torch.int64))
    with pytest.raises(TypeError, match="torch.Tensor"):
        check([1.0, 2.0])
    with pytest.raises(ValueError, match="op must be one of"):
        check(torch.zeros(4), "prod")
    with pytest.raises(TypeError, match="op must be"):
        check(torch.zeros(4), 3)


def test_layout_device_and_size():
    with pytest.raises(ValueError, match="contiguous"):
        check(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match="contiguous"):
        check(torch.zeros(8)[::2])
    with pytest.raises(ValueError, match="runs on cuda:0"):
        check(torch.zeros(4), device=torch.device("cuda", 0))
    with pytest.raises(ValueError, match="max_bytes=1024"):
        check(torch.zeros(257), max_bytes=1024)
    check(torch.zeros(256), max_bytes=1024)
    # A contiguous view at an offset is fine (the kernels take any alignment).
    check(torch.zeros(9)[1:])


def test_out_argument():
    t = torch.zeros(10, dtype=torch.bfloat16)
    o = torch.empty(10, dtype=torch.bfloat16)
    assert check(t, out=o)[3] is o
    assert check(t, out=torch.empty(2, 5, dtype=torch.bfloat16))[3].numel() == 10
    with pytest.raises(TypeError, match="dtype"):
        check(t, out=torch.empty(10, dtype=torch.float16))
    with pytest.raises(ValueError, match="elements"):
        check(t, out=torch.empty(11, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="contiguous"):
        check(t, out=torch.empty(20, dtype=torch.bfloat16)[::2])
    with pytest.raises(TypeError, match="torch.Tensor"):
        check(t, out="x")


def test_accumulation_types():
    x8 = torch.zeros(4, dtype=torch.float8_e4m3fn)
    assert check(x8, accum=torch.float16)[2] == "fp16"
    assert check(x8, accum=torch.float32)[2] == "fp32"
    assert check(x8, "max", accum=torch.float16)[2] == "fp16"
    assert check(torch.zeros(4, dtype=torch.bfloat16), accum=torch.float32)[2] == "fp32"
    with pytest.raises(ValueError, match="accum"):
        check(torch.zeros(4, dtype=torch.bfloat16), accum=torch.float16)
    with pytest.raises(ValueError, match="accum"):
        check(torch.zeros(4, dtype=torch.int32), accum=torch.float32)
    with pytest.raises(ValueError, match="accum_dtype"):
        check(x8, accum=torch.bfloat16)
    with pytest.raises(TypeError, match="accum_dtype"):
        check(x8, accum="double")
    # The kernel variant each combination maps to.
    v = moelink._native.AllReduceComm.variant
    assert v("fp8_e4m3", "sum") == "fp8e4m3_sum_acc32"
    assert v("fp8_e5m2", "sum", "fp16") == "fp8e5m2_sum_acc16"
    assert v("int32", "max") == "int32_max"


def test_all_gather_arguments():
    inp = torch.zeros(5, dtype=torch.float32)
    out = torch.zeros(20, dtype=torch.float32)
    assert check_all_gather_args(out, inp, 4, CPU, 1 << 20) == 20
    # Any dtype moves (bytes), in place too.
    assert check_all_gather_args(out.view(torch.int32), out[5:10].view(torch.int32), 4, CPU, 80)
    with pytest.raises(ValueError, match="world_size"):
        check_all_gather_args(out, inp, 3, CPU, 1 << 20)
    with pytest.raises(TypeError, match="dtype"):
        check_all_gather_args(out, inp.to(torch.float16), 4, CPU, 1 << 20)
    with pytest.raises(ValueError, match="max_bytes"):
        check_all_gather_args(out, inp, 4, CPU, 79)
    with pytest.raises(ValueError, match="runs on cuda:0"):
        check_all_gather_args(out, inp, 4, torch.device("cuda", 0), 1 << 20)


def test_tensor_checks_are_the_native_ones_and_name_the_argument():
    """The tensors' checks are ``ep_core::calls::all_reduce`` / ``all_gather``
    (``_native.all_reduce_plan`` / ``all_gather_plan``), shared with the Rust API."""
    meta = moelink.checks.tensor_meta("tensor", torch.zeros(3, 4, dtype=torch.bfloat16))
    assert moelink._native.all_reduce_plan(moelink._native.CPU_DEVICE, meta, None, MIB) == {
        "dtype": "bf16",
        "count": 12,
        "nbytes": 24,
    }
    with pytest.raises(ValueError, match=r"^tensor must be contiguous \(got strides \(1, 4\)\)$"):
        check(torch.zeros(4, 4).t())
    with pytest.raises(ValueError, match=r"^tensor must be contiguous \(got strides \(2,\)\)$"):
        check(torch.zeros(8)[::2])
    with pytest.raises(
        ValueError, match=r"^tensor has 1028 bytes, more than this communicator's max_bytes=1024$"
    ):
        check(torch.zeros(257), max_bytes=1024)
    with pytest.raises(
        ValueError, match=r"^tensor is on cpu, but this communicator runs on cuda:1$"
    ):
        check(torch.zeros(4), device=torch.device("cuda", 1))
    t = torch.zeros(10, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match=r"^out has dtype torch\.float16, tensor torch\.bfloat16$"):
        check(t, out=torch.empty(10, dtype=torch.float16))
    with pytest.raises(ValueError, match=r"^out has 11 elements, tensor 10$"):
        check(t, out=torch.empty(11, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match=r"^out is on a device that is neither CUDA nor the CPU"):
        check(t, out=torch.empty(10, dtype=torch.bfloat16, device="meta"))
    with pytest.raises(TypeError, match=r"^tensor dtype torch\.complex64 is not supported"):
        check(torch.zeros(4, dtype=torch.complex64))
    # An allgather moves any dtype, one the Rust side has no name for too.
    c64 = torch.zeros(6, dtype=torch.complex64)
    assert check_all_gather_args(c64, c64[:3], 2, CPU, MIB) == 24
    with pytest.raises(ValueError, match=r"^out has 48 bytes, more than .* max_bytes=47$"):
        check_all_gather_args(c64, c64[:3], 2, CPU, 47)
    with pytest.raises(ValueError, match=r"^inp must be contiguous"):
        check_all_gather_args(c64, c64[::2], 2, CPU, MIB)
    with pytest.raises(TypeError, match=r"^inp must be a torch\.Tensor, got list$"):
        check_all_gather_args(c64, [1], 2, CPU, MIB)


class _FakeComm:
    """What ``AllReduce``'s calls use of ``_native.AllReduceComm``."""

    def __init__(self):
        self.calls = []

    def all_reduce(self, *args):
        self.calls.append(("all_reduce", args))
        return ("oneshot_ll", 1, 32)

    def all_gather(self, *args):
        self.calls.append(("all_gather", args))
        return ("ag_ll", 1, 32)

    def register(self, ptr, nbytes):
        self.calls.append(("register", nbytes))
        return 7


@pytest.fixture
def cpu_comm(monkeypatch):
    """An ``AllReduce`` of 4 ranks on the CPU (max_bytes 1 KiB) over a stand-in
    native communicator: its calls' checks, without a GPU."""
    monkeypatch.setattr(ar, "current_raw_stream", lambda device: 0)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    comm = object.__new__(ar.AllReduce)
    comm._native, comm._registered, comm._checked = _FakeComm(), {}, ar.PlanCache()
    comm.device, comm.max_bytes, comm.world_size, comm.last_choice = CPU, KIB, 4, None
    yield comm
    comm._native = None


def test_calls_check_once_per_signature_and_refuse_every_bad_call(cpu_comm, monkeypatch):
    checked = []
    real = ar.check_all_reduce_args

    def counting(*args):
        checked.append(args[1])
        return real(*args)

    monkeypatch.setattr(ar, "check_all_reduce_args", counting)
    t = torch.zeros(16, dtype=torch.bfloat16)
    for _ in range(3):
        assert cpu_comm.all_reduce(t) is t
    assert cpu_comm.all_reduce(torch.ones(16, dtype=torch.bfloat16), "max") is not t
    assert checked == ["sum", "max"]  # one check per signature
    args = cpu_comm._native.calls[-1][1]
    assert args[3:7] == (16, "bf16", "max", None)
    o = torch.empty(16, dtype=torch.bfloat16)
    assert cpu_comm.all_reduce(t, out=o) is o
    # A call that differs in what the checks read is checked again.
    with pytest.raises(TypeError, match="out has dtype torch.float16"):
        cpu_comm.all_reduce(t, out=torch.empty(16, dtype=torch.float16))
    with pytest.raises(ValueError, match="tensor must be contiguous"):
        cpu_comm.all_reduce(torch.zeros(4, 4, dtype=torch.bfloat16).t())
    with pytest.raises(ValueError, match="max_bytes=1024"):
        cpu_comm.all_reduce(torch.zeros(513, dtype=torch.bfloat16))
    with pytest.raises(ValueError, match="op must be one of"):
        cpu_comm.all_reduce(t, "prod")
    with pytest.raises(TypeError, match="op must be"):
        cpu_comm.all_reduce(t, True)
    with pytest.raises(TypeError, match="tensor must be a torch.Tensor"):
        cpu_comm.all_reduce([1.0])
    out = torch.zeros(20, dtype=torch.float32)
    for _ in range(2):
        assert cpu_comm.all_gather(out, out[5:10]) is out
    assert cpu_comm._native.calls[-1][1][3] == 20
    with pytest.raises(ValueError, match="world_size"):
        cpu_comm.all_gather(out, out[:4])


def test_register_checks_the_tensor(cpu_comm):
    with pytest.raises(ValueError, match="^cannot register an empty tensor$"):
        cpu_comm.register(torch.zeros(0, 4))
    with pytest.raises(ValueError, match=r"^tensor must be contiguous \(got strides \(1, 4\)\)$"):
        cpu_comm.register(torch.zeros(4, 4).t())
    with pytest.raises(
        ValueError, match="^tensor is on cpu, but this communicator runs on cuda:0$"
    ):
        cpu_comm.device = torch.device("cuda", 0)
        cpu_comm.register(torch.zeros(4))
    cpu_comm.device = CPU
    with pytest.raises(TypeError, match="^tensor must be a torch.Tensor, got list$"):
        cpu_comm.register([1])
    t = torch.zeros(3, 4, dtype=torch.bfloat16)
    assert cpu_comm.register(t) == 7
    assert cpu_comm._native.calls[-1] == ("register", 24)


def test_geometry_arguments():
    assert check_geometry(None, None) == (0, 0)
    assert check_geometry(4, 256) == (4, 256)
    for bad in ((0, None), (None, 16), (None, 1056), (None, 100)):
        with pytest.raises(ValueError):
            check_geometry(*bad)
    with pytest.raises(TypeError):
        check_geometry(2.5, None)
    with pytest.raises(TypeError):
        check_geometry(None, True)


# ----------------------------------------------------------------------------
# Tuning file
# ----------------------------------------------------------------------------


def test_tune_file_location(monkeypatch, tmp_path):
    monkeypatch.delenv(ar.TUNE_FILE_ENV, raising=False)
    p = ar.default_tune_file("NVIDIA H200", 4)
    assert p.parts[-3:] == (".cache", "moelink", "allreduce-nvidia-h200-4gpu.json")
    monkeypatch.setenv(ar.TUNE_FILE_ENV, str(tmp_path / "t.json"))
    assert ar.default_tune_file("NVIDIA H200", 4) == tmp_path / "t.json"


def test_tune_file_contents():
    doc = {
        "format": ar.TUNE_FORMAT,
        "gpu": "NVIDIA H200",
        "world_size": 4,
        "entries": [
            {
                "collective": "allreduce",
                "graph": True,
                "registered": False,
                "log2_bytes": 12,
                "algorithm": "oneshot_ll",
                "num_blocks": 2,
                "num_threads": 256,
            }
        ],
    }
    doc = json.loads(json.dumps(doc))
    entries = ar._entries_from_json(doc, "NVIDIA H200", 4)
    assert entries == [("allreduce", True, False, 12, "oneshot_ll", 2, 256)]
    # What the selector does with them.
    assert plan(4000, 4, capturing=True, tuned=entries) == ("oneshot_ll", 2, 256)
    with pytest.raises(ValueError, match="tuned for"):
        ar._entries_from_json(doc, "NVIDIA H100", 4)
    with pytest.raises(ValueError, match="tuned for"):
        ar._entries_from_json(doc, "NVIDIA H200", 2)
    with pytest.raises(ValueError, match="format"):
        ar._entries_from_json({**doc, "format": "other"}, "NVIDIA H200", 4)
    assert ar._bucket(1) == 0 and ar._bucket(1024) == 10 and ar._bucket(1025) == 11


def test_gpu_worker_declares_its_scenarios():
    from tests.multi_gpu.test_allreduce import WORKER
    from tests.multi_gpu.torchrun_suite import scenario_names

    names = scenario_names(WORKER)
    for want in (
        "oneshot_ll",
        "twoshot_ll",
        "rsag",
        "rsag_zc",
        "rsag_push",
        "cuda_graph",
        "back_to_back",
        "reuse_race",
    ):
        assert want in names
    assert len(set(names)) == len(names)


def test_needs_a_gpu_and_a_process_group():
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU (the GPU tests construct communicators)")
    with pytest.raises(RuntimeError, match="CUDA"):
        moelink.AllReduce(None)
    with pytest.raises(ValueError, match="max_bytes"):
        moelink.AllReduce(None, max_bytes=0)


@pytest.mark.parametrize("bad", [0, -1.0, 1e-12, float("nan"), float("inf")])
def test_device_timeout_must_be_positive(monkeypatch, bad):
    # Checked before anything needs a GPU or a process group.
    monkeypatch.delenv(ar.DEVICE_TIMEOUT_ENV, raising=False)
    with pytest.raises(ValueError, match="device_timeout_s"):
        moelink.AllReduce(None, device_timeout_s=bad)
    monkeypatch.setenv(ar.DEVICE_TIMEOUT_ENV, str(bad))
    with pytest.raises(ValueError, match=ar.DEVICE_TIMEOUT_ENV):
        moelink.AllReduce(None)


def test_device_timeout_types(monkeypatch):
    with pytest.raises(TypeError, match="device_timeout_s"):
        moelink.AllReduce(None, device_timeout_s="30")
    with pytest.raises(TypeError, match="device_timeout_s"):
        moelink.AllReduce(None, device_timeout_s=True)
    monkeypatch.setenv(ar.DEVICE_TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match=f"{ar.DEVICE_TIMEOUT_ENV} must be a number"):
        moelink.AllReduce(None)
