"""Property-based test of the CPU-reachable API: no input crashes, none passes silently.

Hypothesis feeds random types, shapes, dtypes, sizes from -2**63 to 2**64, NaN and
empty tensors to ``moelink.reference`` (layout, dispatch, dispatch_cached, combine,
ll_dispatch, ll_combine), the size hints, ``Config`` and ``allreduce.plan``. Each
call must return or raise ``ValueError`` / ``TypeError`` (``moelink.DtypeError`` is
both) with a message that names one of the call's arguments; anything else (a
``pyo3_runtime.PanicException``, an ``OverflowError``, a ``KeyError``, an abort of
the process) fails the test. Inputs are mostly valid with one part disturbed, so
calls get past the first check.

The CPU reference's output budget is lowered (``MOELINK_REFERENCE_MAX_BYTES``) so
that calls which are valid but huge are refused quickly instead of filling memory;
the example counts are bounded so that the file runs in well under a minute on two
cores (``MOELINK_HYPOTHESIS_EXAMPLES`` overrides the count; with
``MOELINK_HYPOTHESIS_RANDOM`` set, each run draws new examples).
"""

from __future__ import annotations

import os
from datetime import timedelta

import pytest
import torch
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st
from moelink import DtypeError, allreduce, reference
from moelink.config import Config, combine_record_bytes, get_dispatch_config, token_record_bytes
from moelink.low_latency import get_low_latency_rdma_size_hint

EXAMPLES = int(os.environ.get("MOELINK_HYPOTHESIS_EXAMPLES", "500"))
SETTINGS = settings(
    max_examples=EXAMPLES,
    deadline=timedelta(seconds=5),
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    # The same examples on every run (CI), unless asked for new ones.
    derandomize="MOELINK_HYPOTHESIS_RANDOM" not in os.environ,
)
BUDGET = 64 << 20


@pytest.fixture(autouse=True, scope="module")
def small_reference_budget():
    old = os.environ.get("MOELINK_REFERENCE_MAX_BYTES")
    os.environ["MOELINK_REFERENCE_MAX_BYTES"] = str(BUDGET)
    yield
    if old is None:
        del os.environ["MOELINK_REFERENCE_MAX_BYTES"]
    else:
        os.environ["MOELINK_REFERENCE_MAX_BYTES"] = old


def call(names, f, *args, **kwargs):
    """``f(*args, **kwargs)``, or None when it raised a documented error that names
    one of ``names``; any other outcome fails the test."""
    try:
        out = f(*args, **kwargs)
    except (ValueError, TypeError) as e:
        msg = str(e)
        assert any(n in msg for n in names), f"{type(e).__name__} names none of {names}: {msg}"
        event(f"{f.__name__}: {type(e).__name__} {msg[:60]}")
        return None
    except (KeyboardInterrupt, SystemExit):
        raise
    except BaseException as e:  # noqa: BLE001 - a PanicException is a BaseException
        pytest.fail(f"{type(e).__module__}.{type(e).__name__} escaped {f.__name__}: {e}")
    event(f"{f.__name__}: returned")
    return out


# ----- strategies ----------------------------------------------------------------------

#: Sizes: anything from -2**63 to 2**64, and the values near the limits more often.
SIZES = st.one_of(
    st.integers(min_value=-(2**63), max_value=2**64),
    st.sampled_from(
        [-1, 0, 1, 2, 3, 4, 7, 8, 16, 32, 33, 64, 100, 128, 256, 1024, 1025, 8192, 16384]
        + [2**21 - 1, 2**21, 2**26, 2**31, 2**40, 2**62, 2**63, 2**64]
    ),
)
DTYPES = [
    torch.bfloat16,
    torch.float32,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.uint8,
    torch.bool,
    torch.float8_e4m3fn,
]


@st.composite
def tensors(draw, dtype=None, shape=None):
    """A small CPU tensor; floats may hold NaN and infinities, ints small ids."""
    if dtype is None:
        dtype = draw(st.sampled_from(DTYPES))
    if shape is None:
        lead = draw(st.lists(st.integers(0, 4), max_size=2))
        shape = [*lead, draw(st.sampled_from([0, 1, 2, 3, 32, 64, 128, 256]))]
        shape = shape[: draw(st.integers(0, len(shape)))]
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    if dtype.is_floating_point:
        t = torch.randn(shape, generator=g)
        if t.numel() and draw(st.booleans()):
            t.view(-1)[0] = draw(st.sampled_from([float("nan"), float("inf"), -float("inf")]))
        return t.to(dtype)
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=g).bool()
    return torch.randint(-2, 9, shape, generator=g).to(dtype)


#: Anything that is not what an argument wants.
JUNK = st.one_of(
    st.none(),
    st.booleans(),
    st.floats(allow_nan=True, allow_infinity=True),
    st.just(float("nan")),
    st.text(max_size=3),
    st.lists(st.integers(-2, 4), max_size=3),
    st.dictionaries(st.sampled_from(["x", "topk_idx", "y"]), st.integers(), max_size=2),
    st.complex_numbers(max_magnitude=2),
    tensors(),
)
#: What a disturbed argument gets: any size, or anything else.
ANY = st.one_of(SIZES, JUNK)


def sized(valid):
    """A size argument: mostly (7 in 8) drawn from ``valid``, else any size at all."""
    return st.one_of(*[valid] * 7, SIZES)


def rarely(draw, rate: int) -> bool:
    """True about one time in ``rate`` (not at 0, which Hypothesis draws most)."""
    return draw(st.integers(0, rate - 1)) == rate - 1


def disturb(draw, value, rate: int = 12):
    """``value``, or one time in ``rate`` anything (a size, junk, a random tensor)."""
    return draw(ANY) if rarely(draw, rate) else value


@st.composite
def dispatch_job(draw):
    """Mostly valid arguments of ``reference.dispatch``, a part now and then disturbed."""
    r = draw(st.integers(1, 3))
    k = draw(st.integers(1, 3))
    e = r * draw(st.sampled_from([1, 2, 4]))
    fp8 = draw(st.booleans())
    cols = draw(st.sampled_from([64, 128])) * (2 if fp8 else 1)
    weights = draw(st.booleans())
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    inputs = []
    for _ in range(r):
        n = draw(st.integers(0, 4))
        lo = -2 if rarely(draw, 16) else -1  # ids below -1 now and then
        idx = torch.randint(lo, e + rarely(draw, 16), (n, k), generator=g)
        x = torch.randn(n, cols, generator=g).to(torch.float8_e4m3fn if fp8 else torch.bfloat16)
        inp = {"x": x, "topk_idx": idx}
        if fp8:
            inp["scales"] = torch.rand(n, cols // 128, generator=g)
        if weights:
            inp["topk_weights"] = torch.rand(n, k, generator=g)
        for key in [*inp, "extra"]:
            if rarely(draw, 24):
                if key in inp and draw(st.booleans()):
                    del inp[key]
                else:
                    inp[key] = draw(st.one_of(ANY, tensors()))
        inputs.append(disturb(draw, inp, 24))
    kwargs = {}
    if draw(st.booleans()):
        kwargs["expert_alignment"] = draw(sized(st.integers(1, 8)))
    if draw(st.booleans()):
        kwargs["num_worst_tokens"] = draw(sized(st.integers(0, 16)))
    inputs = disturb(draw, inputs, 24)
    return inputs, disturb(draw, draw(sized(st.just(e)))), kwargs


@st.composite
def ll_job(draw):
    """Mostly valid arguments of ``reference.ll_dispatch``."""
    r = draw(st.integers(1, 3))
    k = draw(st.integers(1, 3))
    e = r * draw(st.sampled_from([1, 2, 4]))
    t = draw(st.integers(1, 4))
    hidden = draw(st.sampled_from([128, 128, 256, 256, 64, 16384]))
    g = torch.Generator().manual_seed(draw(st.integers(0, 2**31)))
    xs, idxs = [], []
    for _ in range(r):
        n = draw(st.integers(0, t + rarely(draw, 16)))
        x = torch.randn(n, hidden, generator=g).bfloat16()
        if n and rarely(draw, 16):
            x[0, 0] = float("nan")
        xs.append(disturb(draw, x, 24))
        idxs.append(disturb(draw, torch.randint(-1, e, (n, k), generator=g), 24))
    use_fp8 = disturb(draw, draw(st.booleans()))
    round_scale = disturb(draw, draw(st.booleans()))
    use_ue8m0 = disturb(draw, round_scale if draw(st.booleans()) else draw(st.booleans()))
    return (
        disturb(draw, xs, 24),
        disturb(draw, idxs, 24),
        disturb(draw, draw(sized(st.just(t)))),
        disturb(draw, draw(sized(st.just(e)))),
        use_fp8,
        round_scale,
        use_ue8m0,
    )


# ----- the reference -------------------------------------------------------------------


@SETTINGS
@given(
    shape=st.tuples(st.integers(0, 6), st.integers(1, 4)),
    num_ranks=sized(st.integers(1, 4)),
    experts_per_rank=st.integers(1, 4),
    seed=st.integers(0, 2**31),
    data=st.data(),
)
def test_layout(shape, num_ranks, experts_per_rank, seed, data):
    e = num_ranks * experts_per_rank if isinstance(num_ranks, int) else experts_per_rank
    g = torch.Generator().manual_seed(seed)
    topk_idx = torch.randint(-1, max(1, min(e, 64)), shape, generator=g)
    if rarely(data.draw, 8):
        topk_idx = data.draw(st.one_of(tensors(torch.int64), tensors()))
    num_experts = data.draw(sized(st.just(e)))
    names = ["topk_idx", "num_experts", "num_ranks"]
    call(names, reference.layout, disturb(data.draw, topk_idx), num_experts, num_ranks)


#: Rust names a rank's dict entry as `key` and says which rank.
DISPATCH_NAMES = ["inputs", "num_experts", "expert_alignment", "num_worst_tokens",
                  "`topk_idx`", "`x`", "`scales`", "`topk_weights`"]  # fmt: skip


@SETTINGS
@given(job=dispatch_job(), data=st.data())
def test_dispatch_cached_and_combine(job, data):
    inputs, num_experts, kwargs = job
    ref = call(DISPATCH_NAMES, reference.dispatch, inputs, num_experts, **kwargs)
    if ref is None:
        return

    def draw(value):
        return disturb(data.draw, value)

    rank = data.draw(sized(st.integers(0, len(inputs) - 1)))
    call(["rank"], ref.num_tokens, disturb(data.draw, rank))
    call(["rank"], ref.is_token_in_rank, disturb(data.draw, rank))
    # Cached dispatch with the same data.
    xs = [(inp["x"], inp["scales"]) if "scales" in inp else inp["x"] for inp in inputs]
    call(["ref", "xs"], reference.dispatch_cached, draw(ref), draw(xs))
    # Combine: every rank returns one row per received row.
    hidden = data.draw(st.sampled_from([64, 64, 128, 0, 32]))
    dtype = data.draw(st.sampled_from([torch.bfloat16, torch.bfloat16, torch.float32]))
    ys = [torch.ones(o.recv_x.shape[0], hidden, dtype=dtype) for o in ref.ranks]
    k = inputs[0]["topk_idx"].shape[1]
    weights = [torch.ones(o.recv_x.shape[0], k) for o in ref.ranks]
    biases = [torch.zeros(ref.num_tokens(r), hidden) for r in range(ref.num_ranks)]
    call(
        ["ref", "ys", "topk_weights", "biases"],
        reference.combine,
        draw(ref),
        draw(ys),
        draw(data.draw(st.sampled_from([None, weights]))),
        draw(data.draw(st.sampled_from([None, biases, [(b, b) for b in biases]]))),
    )


@SETTINGS
@given(job=ll_job(), data=st.data())
def test_ll_dispatch_and_combine(job, data):
    xs, idxs, t, e, use_fp8, round_scale, use_ue8m0 = job
    names = ["xs", "topk_idxs", "num_max_dispatch_tokens_per_rank", "num_experts", "use_fp8",
             "round_scale", "use_ue8m0", "`x`", "`topk_idx`"]  # fmt: skip
    outs = call(names, reference.ll_dispatch, xs, idxs, t, e, use_fp8, round_scale, use_ue8m0)
    if outs is None:
        return

    def draw(value):
        return disturb(data.draw, value)

    ys = [torch.ones(o["src_info"].shape + (xs[0].shape[1],), dtype=torch.bfloat16) for o in outs]
    weights = [torch.rand(i.shape) for i in idxs]
    handles = [(o["src_info"], o["layout_range"]) for o in outs]
    if rarely(data.draw, 8):
        handles = [h[::-1] for h in handles]  # swapped: a dtype error
    names = ["ys", "topk_idxs", "topk_weights", "handles", "num_max_dispatch_tokens_per_rank",
             "num_experts", "`topk_idx`", "`topk_weights`", "`src_info`", "`layout_range`",
             "`x`"]  # fmt: skip
    call(
        names,
        reference.ll_combine,
        draw(ys),
        draw(data.draw(st.sampled_from([idxs, idxs, idxs, [i.int() for i in idxs]]))),
        draw(weights),
        draw(handles),
        draw(t),
        draw(e),
    )


# ----- sizes, Config, allreduce.plan ---------------------------------------------------

HIDDEN_BYTES = sized(st.integers(1, 64).map(lambda n: 128 * n))
RANKS = sized(st.integers(1, 8))


@SETTINGS
@given(
    hidden_bytes=HIDDEN_BYTES,
    num_ranks=RANKS,
    tokens=sized(st.integers(1, 4096)),
    hidden=sized(st.sampled_from([128, 256, 7168])),
    num_experts=sized(st.integers(1, 8).map(lambda n: 8 * n)),
    topk=sized(st.integers(0, 32)),
    sms=st.one_of(st.none(), sized(st.integers(1, 70).map(lambda n: 2 * n))),
    chunks=st.lists(sized(st.integers(1, 300)), min_size=4, max_size=4),
    data=st.data(),
)
def test_size_hints_and_config(
    hidden_bytes, num_ranks, tokens, hidden, num_experts, topk, sms, chunks, data
):
    def draw(value):
        return disturb(data.draw, value)

    cfg = Config()
    call(["hidden_bytes", "num_ranks", "max_tokens_per_rank"], cfg.get_nvl_buffer_size_hint,
         draw(hidden_bytes), draw(num_ranks), max_tokens_per_rank=draw(tokens))  # fmt: skip
    call(["hidden_bytes", "num_ranks"], cfg.get_rdma_buffer_size_hint,
         draw(hidden_bytes), draw(num_ranks))  # fmt: skip
    call(["num_max_dispatch_tokens_per_rank", "hidden", "num_ranks", "num_experts"],
         get_low_latency_rdma_size_hint, draw(tokens), draw(hidden), draw(num_ranks),
         draw(num_experts))  # fmt: skip
    call(["hidden_bytes", "num_topk", "num_scales"], token_record_bytes,
         draw(hidden_bytes), draw(topk), draw(topk))  # fmt: skip
    call(["hidden_bytes", "num_topk"], combine_record_bytes, draw(hidden_bytes), draw(topk))
    names = ["num_sms", "num_max_nvl_chunked_send_tokens", "num_max_nvl_chunked_recv_tokens",
             "num_max_rdma_chunked_send_tokens", "num_max_rdma_chunked_recv_tokens"]  # fmt: skip
    call(names, Config, draw(sms or 20), *(draw(c) for c in chunks))
    call(["num_ranks", "num_sms"], get_dispatch_config, draw(num_ranks), num_sms=draw(sms))


@SETTINGS
@given(
    nbytes=sized(st.integers(0, 64 << 20)),
    world_size=sized(st.integers(1, 9)),
    collective=st.sampled_from(["allreduce", "allgather", "allreduce", "bogus"]),
    max_bytes=sized(st.sampled_from([64 << 20, 1 << 20, 1 << 30])),
    caps=st.lists(sized(st.integers(0, 1 << 22)), min_size=3, max_size=3),
    max_blocks=sized(st.sampled_from([128, 64, 132])),
    flags=st.lists(st.booleans(), min_size=2, max_size=2),
    algorithm=st.one_of(st.none(), st.none(), st.sampled_from(["oneshot_ll", "rsag", "ag_mesh"])),
    blocks=st.one_of(st.none(), sized(st.integers(1, 128))),
    threads=st.one_of(st.none(), sized(st.integers(1, 32).map(lambda n: 32 * n))),
    tuned=st.sampled_from([(), [("allreduce", False, False, 12, "rsag", 3, 64)]]),
    data=st.data(),
)
def test_allreduce_plan(
    nbytes, world_size, collective, max_bytes, caps, max_blocks, flags, algorithm, blocks,
    threads, tuned, data,
):  # fmt: skip
    def draw(value):
        return disturb(data.draw, value, 16)

    if rarely(data.draw, 16):
        tuned = data.draw(st.lists(st.tuples(*[ANY] * 7), max_size=2))
    names = ["nbytes", "world_size", "collective", "max_bytes", "oneshot_max_bytes",
             "twoshot_max_bytes", "allgather_ll_max_bytes", "max_blocks", "registered",
             "capturing", "algorithm", "num_blocks", "num_threads", "tuned"]  # fmt: skip
    call(
        names,
        allreduce.plan,
        draw(nbytes),
        draw(world_size),
        collective=draw(collective),
        max_bytes=draw(max_bytes),
        oneshot_max_bytes=draw(caps[0]),
        twoshot_max_bytes=draw(caps[1]),
        allgather_ll_max_bytes=draw(caps[2]),
        max_blocks=draw(max_blocks),
        registered=draw(flags[0]),
        capturing=draw(flags[1]),
        algorithm=draw(algorithm),
        num_blocks=draw(blocks),
        num_threads=draw(threads),
        tuned=draw(tuned),
    )


# ----- the table of bad inputs -------------------------------------------------


def _ll(hidden=128, t=4, e=16, **kw):
    return reference.ll_dispatch(
        [torch.zeros(2, hidden, dtype=torch.bfloat16)], [torch.zeros(2, 2, dtype=torch.long)],
        t, e, **kw,
    )  # fmt: skip


def _ll_combine(topk_dtype=torch.long, t=4):
    o = _ll(use_fp8=False)[0]
    return reference.ll_combine(
        [o["recv_x"]], [torch.zeros(2, 2, dtype=topk_dtype)], [torch.ones(2, 2)],
        [(o["src_info"], o["layout_range"])], t, 16,
    )  # fmt: skip


def _dispatch(k1=2, **kw):
    x = torch.zeros(4, 64, dtype=torch.bfloat16)
    ranks = [{"x": x, "topk_idx": torch.zeros(4, 2, dtype=torch.long)},
             {"x": x, "topk_idx": torch.zeros(4, k1, dtype=torch.long)}]  # fmt: skip
    return reference.dispatch(ranks, kw.pop("num_experts", 8), **kw)


BAD_INPUTS = [
    ("layout E=2**40", lambda: reference.layout(torch.zeros(8, 4, dtype=torch.long), 2**40, 2),
     ValueError, r"num_experts must be <= 32768"),
    ("layout E=2**62", lambda: reference.layout(torch.zeros(8, 4, dtype=torch.long), 2**62, 2),
     ValueError, r"num_experts must be <= 32768"),
    ("dispatch num_worst_tokens=2**40", lambda: _dispatch(num_worst_tokens=2**40),
     ValueError, r"num_worst_tokens must be <= 2147483616"),
    ("dispatch num_worst_tokens=2**62", lambda: _dispatch(num_worst_tokens=2**62),
     ValueError, r"num_worst_tokens must be <= 2147483616"),
    ("dispatch num_experts=2**40", lambda: _dispatch(num_experts=2**40),
     ValueError, r"num_experts must be <= 32768"),
    ("dispatch num_worst_tokens at the limit", lambda: _dispatch(num_worst_tokens=2**31 - 32),
     ValueError, r"invalid argument `num_worst_tokens`: the outputs would take \d+ bytes"),
    ("ll_dispatch T=2**29", lambda: _ll(t=2**29),
     ValueError, r"num_max_dispatch_tokens_per_rank must be <= 2097151"),
    ("ll_dispatch T=2**62", lambda: _ll(t=2**62),
     ValueError, r"num_max_dispatch_tokens_per_rank must be <= 2097151"),
    ("ll_dispatch hidden 16384", lambda: _ll(hidden=16384),
     ValueError, r"xs\[0\]\.shape\[1\] \(hidden\) must be a positive multiple of 128 up to 8192"),
    ("plan nbytes > max_bytes", lambda: allreduce.plan(1 << 30, 4, max_bytes=1 << 20),
     ValueError, r"`nbytes`: 1073741824 bytes: more than max_bytes=1048576"),
    ("plan 16 ranks", lambda: allreduce.plan(1024, 16),
     ValueError, r"world_size must be <= 8, got 16"),
    ("nvl hint 100 bytes", lambda: Config().get_nvl_buffer_size_hint(100, 4),
     ValueError, r"hidden_bytes must be a positive multiple of 128 up to 1048576, got 100"),
    ("Config(num_sms=10**6)", lambda: Config(num_sms=10**6),
     ValueError, r"num_sms must be <= 1024, got 1000000"),
    ("use_ue8m0 without use_fp8", lambda: _ll(use_fp8=False, use_ue8m0=True, round_scale=True),
     ValueError, r"use_ue8m0=True needs use_fp8=True"),
    ("ll_combine int32 topk_idx", lambda: _ll_combine(torch.int32),
     TypeError, r"topk_idxs\[0\] must have dtype torch\.int64, got torch\.int32"),
    ("K differs between ranks", lambda: _dispatch(k1=3),
     ValueError, r"inputs\[1\]\['topk_idx'\] has 3 columns \(K\), but inputs\[0\].* has 2"),
    ("negative size", lambda: _ll(e=-16),
     ValueError, r"num_experts must be positive, got -16"),
    ("negative T in ll_combine", lambda: _ll_combine(t=-4),
     ValueError, r"num_max_dispatch_tokens_per_rank must be positive, got -4"),
    ("dict missing a key", lambda: reference.dispatch([{"x": torch.zeros(4, 64).bfloat16()}], 8),
     ValueError, r"inputs\[0\] must have the keys \['x', 'topk_idx'\], missing \['topk_idx'\]"),
    ("combine(None, ...)", lambda: reference.combine(None, []),
     TypeError, r"ref must be the RefDispatch that moelink.reference.dispatch .*, got NoneType"),
]  # fmt: skip


@pytest.mark.parametrize("what,f,exc,match", BAD_INPUTS, ids=[row[0] for row in BAD_INPUTS])
def test_bad_inputs_raise_clear_errors(what, f, exc, match):
    """The issue's table: each input raises the documented class, naming the argument.
    None of them aborts the process or lets a PanicException through."""
    with pytest.raises(exc, match=match) as info:
        call_or_panic(f)
    assert type(info.value).__name__ != "PanicException"


def call_or_panic(f):
    try:
        return f()
    except (ValueError, TypeError):
        raise
    except BaseException as e:  # noqa: BLE001
        pytest.fail(f"{type(e).__module__}.{type(e).__name__}: {e}")


def test_dtype_error_is_both_type_and_value_error():
    with pytest.raises(DtypeError):
        _ll_combine(torch.int32)
    assert issubclass(DtypeError, TypeError) and issubclass(DtypeError, ValueError)
