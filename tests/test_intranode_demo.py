"""CPU tests of the intranode demo: inputs, the CPU simulation, the report, the main job."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch
from moelink import intranode_demo as demo

from tests.conftest import cuda_device_count
from tests.test_launch import one_error_line

SMALL = {"num_tokens": 64, "hidden": 256, "num_experts": 16, "num_topk": 4}


def small_args(**overrides) -> argparse.Namespace:
    parser = demo.add_arguments(argparse.ArgumentParser())
    argv = [f"--{k.replace('_', '-')}={v}" for k, v in {**SMALL, **overrides}.items()]
    return demo.normalize_args(parser.parse_args(argv + ["--iters=2"]))


def test_make_inputs_shapes_and_dtypes():
    inp = demo.make_inputs(1, 4, **SMALL)
    n, h, e, k = SMALL["num_tokens"], SMALL["hidden"], SMALL["num_experts"], SMALL["num_topk"]
    assert inp["x"].shape == (n, h) and inp["x"].dtype == torch.bfloat16
    assert inp["x_fp8"].shape == (n, h) and inp["x_fp8"].dtype == torch.float8_e4m3fn
    assert inp["x_scales"].shape == (n, h // 128) and inp["x_scales"].dtype == torch.float32
    assert inp["topk_idx"].shape == (n, k) and inp["topk_idx"].dtype == torch.int64
    assert inp["topk_weights"].shape == (n, k) and inp["topk_weights"].dtype == torch.float32
    assert not (inp["x"] == 0).any()
    idx = inp["topk_idx"]
    assert ((idx >= 0) & (idx < e)).all()
    assert all(len(set(row.tolist())) == k for row in idx)  # k distinct experts per token
    torch.testing.assert_close(inp["topk_weights"].sum(dim=1), torch.ones(n))
    assert (inp["topk_weights"] > 0).all()


def test_make_inputs_is_deterministic_per_rank_and_seed():
    a = demo.make_inputs(2, 4, **SMALL)
    b = demo.make_inputs(2, 4, **SMALL)
    for key in a:
        assert torch.equal(a[key].view(torch.uint8), b[key].view(torch.uint8)), key
    other_rank = demo.make_inputs(3, 4, **SMALL)
    other_seed = demo.make_inputs(2, 4, seed=1, **SMALL)
    assert not torch.equal(a["x"], other_rank["x"])
    assert not torch.equal(a["topk_idx"], other_rank["topk_idx"])
    assert not torch.equal(a["x"], other_seed["x"])


def test_make_inputs_rejects_bad_workloads():
    with pytest.raises(ValueError, match="hidden"):
        demo.make_inputs(0, 4, num_tokens=8, hidden=100, num_experts=16, num_topk=4)
    with pytest.raises(ValueError, match="num_experts"):
        demo.make_inputs(0, 3, num_tokens=8, hidden=128, num_experts=16, num_topk=4)
    with pytest.raises(ValueError, match="rank"):
        demo.make_inputs(4, 4, **SMALL)


def test_fp8_round_trip_within_e4m3_precision():
    x = demo.make_inputs(0, 4, **SMALL)["x"].float()
    fp8, scales = demo.cast_to_fp8(x)
    back = demo.dequantize_fp8(fp8, scales)
    # e4m3: 3 mantissa bits (relative error <= 2^-4 of normal values); values
    # below 2^-6 of the scale are subnormal, with an absolute error <= 2^-10.
    per_channel_scale = scales.repeat_interleave(128, dim=1)
    bound = x.abs() * 2**-4 + per_channel_scale * 2**-10 + 1e-12
    assert ((back - x).abs() <= bound).all()
    # Every block's largest element maps to the top of the fp8 range exactly.
    amax = x.abs().view(x.shape[0], -1, 128).amax(dim=2)
    torch.testing.assert_close(scales, amax / 448.0)
    assert fp8.float().abs().amax() == 448.0


@pytest.mark.parametrize("num_ranks", [2, 4])
def test_cpu_simulation_is_correct(num_ranks):
    result = demo.run_cpu_simulation(num_ranks, small_args())
    failures = [c for c in result["checks"] if not c["ok"]]
    assert result["correct"], failures
    assert result["mode"] == "cpu-simulation"
    assert len(result["recv_tokens"]) == num_ranks
    assert sum(result["recv_tokens"]) >= SMALL["num_tokens"] * num_ranks  # each token >= once
    ops = [r["op"] for r in result["rows"]]
    assert ops == [
        demo.LAYOUT,
        demo.DISPATCH_BF16,
        demo.DISPATCH_FP8,
        demo.COMBINE_BF16,
        demo.BASELINE,
    ]
    for row in result["rows"]:
        assert row["median_us"] > 0 and row["min_us"] <= row["median_us"] <= row["max_us"]
    bf16 = next(r for r in result["rows"] if r["op"] == demo.DISPATCH_BF16)
    fp8 = next(r for r in result["rows"] if r["op"] == demo.DISPATCH_FP8)
    assert bf16["bytes"] == pytest.approx(
        sum(result["recv_tokens"]) / num_ranks * SMALL["hidden"] * 2
    )
    assert fp8["bytes"] == pytest.approx(bf16["bytes"] * (1 + 4 / 128) / 2)


def test_cpu_simulation_catches_a_wrong_reference(monkeypatch):
    """The CPU checks are not vacuous: a reference that drops a row fails them."""
    from moelink import reference

    real = reference.combine

    def broken(ref, ys, topk_weights=None, biases=None, ranks_per_node=None):
        out = real(ref, ys, topk_weights=topk_weights, biases=biases, ranks_per_node=ranks_per_node)
        x, w = out[0]
        x = x.clone()
        x[0] += 1.0
        return [(x, w)] + out[1:]

    monkeypatch.setattr(reference, "combine", broken)
    result = demo.run_cpu_simulation(2, small_args())
    assert not result["correct"]
    assert any("combine[rank 0]" in c["name"] for c in result["checks"] if not c["ok"])


@pytest.mark.parametrize("num_ranks, nodes", [(4, 2), (6, 2), (6, 3)])
def test_cpu_simulation_across_nodes_is_correct(num_ranks, nodes):
    """--nodes: the per-node token counts of the layout and the internode combine
    model (per-node partials rounded to bf16) against a direct computation."""
    args = small_args(num_experts=4 * num_ranks, nodes=nodes)
    result = demo.run_cpu_simulation(num_ranks, args)
    failures = [c for c in result["checks"] if not c["ok"]]
    assert result["correct"], failures
    assert result["nodes"] == nodes
    names = [c["name"] for c in result["checks"]]
    assert sum("num_tokens_per_rdma_rank" in n for n in names) == num_ranks
    assert any("sum over nodes of bf16" in n for n in names)
    assert f"{nodes} emulated nodes" in demo.format_report(result)


def test_cpu_simulation_across_nodes_catches_the_single_node_combine(monkeypatch):
    """The internode check is not vacuous: with 3 ranks per node a token's
    partial (up to 3 copies) rounds in bf16, so the single-node combine (no
    per-node rounding) fails it."""
    from moelink import reference

    real = reference.combine

    def single_node(ref, ys, topk_weights=None, biases=None, ranks_per_node=None):
        return real(ref, ys, topk_weights=topk_weights, biases=biases)

    monkeypatch.setattr(reference, "combine", single_node)
    result = demo.run_cpu_simulation(6, small_args(num_experts=24, nodes=2))
    assert not result["correct"]
    assert any("sum over nodes" in c["name"] for c in result["checks"] if not c["ok"])


def test_format_report_has_the_table():
    result = demo.run_cpu_simulation(2, small_args())
    text = demo.format_report(result)
    assert demo.TABLE_HEADER in text
    assert "SIMULATED ON THE CPU" in text
    assert "correctness: PASS" in text
    for label in ("layout", "dispatch bf16", "dispatch fp8", "combine bf16", "all_to_all_single"):
        assert label in text


def test_format_report_of_gpu_shaped_results():
    """Targets and verdicts as on a GPU run (synthetic numbers)."""

    def row(op, sms, us, nbytes):
        return demo._row(op, sms, [us, us * 1.1, us * 0.9], nbytes)

    nbytes = 211e6
    rows = [row(demo.LAYOUT, None, 15.0, None)]
    for sms, us in ((24, 600.0), (48, 500.0), (64, 450.0)):
        rows += [
            row(demo.DISPATCH_BF16, sms, us, nbytes),
            row(demo.DISPATCH_FP8, sms, us / 2, nbytes * demo.FP8_BYTES_FACTOR),
            row(demo.COMBINE_BF16, sms, us, nbytes),
        ]
    rows.append(row(demo.BASELINE, None, 700.0, nbytes))
    ranks = [_gpu_result(r, num_ranks=2, rows=rows) for r in range(2)]
    agg = demo.aggregate(ranks)
    assert agg["correct"] and agg["ranks_aggregated"] == 2
    text = demo.format_report(agg)
    assert demo.TABLE_HEADER in text
    assert ">= 330 at 24 SMs" in text  # dispatch bf16 at 24 SMs
    assert "- (> 48 SMs)" in text
    assert "target 400 met" in text  # 211 MB in 500 us = 422 GB/s at 48 SMs
    assert "target <= 20 us met" in text
    ranks[1] = {**ranks[1], "correct": False, "checks": [{"name": "y", "ok": False, "detail": "d"}]}
    failed = demo.format_report(demo.aggregate(ranks))
    assert "correctness: FAIL" in failed and "rank 1: y" in failed


def test_main_job_without_gpu_runs_the_cpu_simulation():
    if cuda_device_count() != 0:
        pytest.skip("a CUDA device is present: python -m moelink would run the GPU workload")
    cmd = [sys.executable, "-m", "moelink", "--num-tokens", "64", "--hidden", "256"]
    cmd += ["--num-experts", "16", "--num-topk", "4", "--iters", "1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    out = p.stdout + p.stderr
    assert p.returncode == 0, out
    assert "No CUDA device" in out
    assert "correctness: PASS" in out
    assert demo.TABLE_HEADER in out


# ----------------------------------------------------------------------------
# Ranks that share GPUs: SM counts, the report


def test_sms_within_the_share_of_a_shared_gpu():
    alone = {"ranks_per_gpu": 1, "share_sms": 132}
    assert demo._sms_within_share([24, 32, 48], alone) == ([24, 32, 48], None)
    four = {"ranks_per_gpu": 4, "share_sms": 33}
    kept, note = demo._sms_within_share([24, 32, 48], four)
    assert kept == [24, 32] and "[24, 32, 48] reduced to [24, 32]" in note and "32 SMs" in note
    eight = {"ranks_per_gpu": 8, "share_sms": 15}
    assert demo._sms_within_share([24, 32, 48], eight)[0] == [14]  # the share, even
    tiny = {"ranks_per_gpu": 32, "share_sms": 1}
    assert demo._sms_within_share([24], tiny)[0] == [2]
    roomy = {"ranks_per_gpu": 2, "share_sms": 66}
    assert demo._sms_within_share([24, 48], roomy) == ([24, 48], None)


def test_shared_gpu_note_says_what_is_measured():
    assert demo.shared_gpu_note(4, 1, True) == (
        "4 ranks on 1 GPU (MPS): bandwidth figures measure one GPU's memory, not NVLink"
    )
    assert demo.shared_gpu_note(2, 1, False).startswith("2 ranks on 1 GPU (time-sliced, no MPS)")
    assert "mix one GPU's memory with NVLink" in demo.shared_gpu_note(8, 2, True)


def _gpu_result(rank: int, num_ranks: int = 4, rows: list | None = None, **extra) -> dict:
    """Rank ``rank``'s result of a GPU run of ``num_ranks`` ranks (synthetic
    numbers); ``rows`` default to a layout and a dispatch bf16 at 24 SMs."""
    if rows is None:
        row = demo._row(demo.DISPATCH_BF16, 24, [500.0, 510.0, 490.0], 211e6)  # 422 GB/s
        layout = demo._row(demo.LAYOUT, None, [15.0, 15.0, 15.0], None)
        rows = [layout, row]
    return {
        "mode": "gpu",
        "rank": rank,
        "num_ranks": num_ranks,
        "device": "NVIDIA H200",
        "workload": {**SMALL, "seed": 0},
        "timing": {"clock": "CUDA events", "iters": 3, "warmup": 1, "l2_flush_bytes": 1},
        "recv_tokens": [100, 120, 110, 90][:num_ranks],
        "correct": True,
        "checks": [{"name": "x", "ok": True, "detail": ""}],
        "rows": rows,
        **extra,
    }


def test_report_of_ranks_sharing_a_gpu_judges_no_target():
    shared = {
        "num_gpus": 1,
        "ranks_per_gpu": 4,
        "mps": True,
        "sms_note": "SM counts [24, 48] reduced to [24]: ...",
        "baseline_skipped": "all_to_all_single skipped: the group is gloo (...)",
    }
    text = demo.format_report(demo.aggregate([_gpu_result(r, **shared) for r in range(4)]))
    assert demo.shared_gpu_note(4, 1, True) in text
    assert "SM counts [24, 48] reduced to [24]" in text
    assert "all_to_all_single skipped: the group is gloo" in text
    assert "correctness: PASS" in text
    assert " met" not in text and "MISSED" not in text
    assert "not judged (ranks share a GPU)" in text
    bf16 = next(line for line in text.splitlines() if line.startswith("dispatch bf16"))
    assert " ok " not in bf16 and "n/a" in bf16 and bf16.rstrip().endswith("-")  # no a2a ratio
    # The same numbers with one rank per GPU are judged.
    alone = {"num_gpus": 4, "ranks_per_gpu": 1, "mps": False}
    judged = demo.format_report(demo.aggregate([_gpu_result(r, **alone) for r in range(4)]))
    assert "target 330 met" in judged and "target <= 20 us met" in judged
    assert "NVLink" not in judged and "not judged" not in judged


def _env_worker(rank, num_ranks, port, payload, queue):
    keys = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_PORT")
    keys += ("MOELINK_LAUNCH_GPUS", "MOELINK_LAUNCH_MPS", "NCCL_NVLS_ENABLE")
    import os

    queue.put(
        {"rank": rank, "port": port, "payload": payload, **{k: os.environ.get(k) for k in keys}}
    )


def test_local_ranks_start_with_the_launcher_variables():
    """The main job's spawned ranks get what ``moelink.launch`` gives its ranks
    (set before they start), and this process's environment is left as it was."""
    import os

    from moelink import _launch, launch

    before = dict(os.environ)
    with launch.gpu_sharing(3, 2, "off", log=lambda msg: None) as sharing:
        reports = _launch.run_local_ranks(_env_worker, 3, "payload", 120, sharing)
    assert dict(os.environ) == before
    assert [r["rank"] for r in reports] == [0, 1, 2]
    for r in reports:
        assert "error" not in r, r
        assert r["RANK"] == r["LOCAL_RANK"] == str(r["rank"])
        assert r["WORLD_SIZE"] == r["LOCAL_WORLD_SIZE"] == "3"
        assert r["MASTER_PORT"] == str(r["port"])
        assert (r["MOELINK_LAUNCH_GPUS"], r["MOELINK_LAUNCH_MPS"]) == ("2", "0")
        assert r["NCCL_NVLS_ENABLE"] == "0"
        assert r["payload"] == "payload"


# ----------------------------------------------------------------------------
# The command line: every invalid option exits 2 with one error line, before any work

BAD_OPTIONS = [
    (["--hidden", "100"], 0, "--hidden must be a multiple of 128, got 100"),
    (["--hidden", "0"], 0, "--hidden must be in 128..65536"),
    (["--hidden", str(1 << 20)], 1, "--hidden must be in 128..65536"),
    (["--num-experts", "7"], 0, "--num-experts 7 is not a multiple of the 4 ranks"),
    (["--num-experts", "0"], 1, "--num-experts must be positive"),
    (["--num-experts", "4096"], 1, "at most 1024 experts per rank"),
    (["--ranks", "3"], 0, "--num-experts 256 is not a multiple of the 3 ranks (--ranks)"),
    (["--ranks", "3"], 8, "--num-experts 256 is not a multiple of the 3 ranks"),
    (["--ranks", "0"], 1, "--ranks must be positive"),
    (["--ranks", "64", "--num-experts", "64"], 1, "--ranks must be in 1..32"),
    (["--ranks", "x"], 1, "argument --ranks: invalid int value"),
    (["--num-topk", "33"], 0, "--num-topk must be in 1..32"),
    (["--num-topk", "0"], 1, "--num-topk must be in 1..32"),
    (["--num-topk", "20", "--num-experts", "16"], 1, "--num-topk must be in 1..16"),
    (["--num-tokens", "0"], 0, "--num-tokens must be in 1..65536"),
    (["--num-tokens", "-5"], 1, "--num-tokens must be in 1..65536"),
    (["--num-tokens", str(1 << 40)], 1, "--num-tokens must be in 1..65536"),
    (["--sms", "3"], 1, "argument --sms: SM counts must be even"),
    (["--sms", "0"], 1, "argument --sms: SM counts must be even"),
    (["--sms", "24,abc"], 1, "argument --sms: SM counts are integers, got 'abc'"),
    (["--sms", ""], 1, "argument --sms: expected SM counts"),
    (["--sms", "4096"], 1, "SM counts must be even, 2..1024"),
    (["--iters", "0"], 0, "--iters must be in 1..100000"),
    (["--warmup", "-1"], 0, "--warmup must be in 0..100000"),
    (["--seed", "-1"], 0, "--seed must be in 0..4294967295"),
    (["--timeout", "0"], 0, "argument --timeout"),
    (["--timeout", "inf"], 0, "argument --timeout"),
    (["--words", "0", "--peer-write"], 1, "--words must be in 1..268435456"),
    (["--mps", "always"], 1, "argument --mps: invalid choice"),
    (["--no-such-option"], 0, "unrecognized arguments: --no-such-option"),
    (["--json", "/nonexistent/x.json"], 0, "--json: directory /nonexistent does not exist"),
    (["--nodes", "3"], 0, "--nodes 3 does not divide the 4 ranks"),
    (["--nodes", "0"], 0, "--nodes must be in 1..16"),
    # The output path is checked first.
    (["--hidden", "100", "--json", "/nonexistent/x.json"], 1, "--json: directory /nonexistent"),
]


@pytest.mark.parametrize("argv, num_gpus, message", BAD_OPTIONS)
def test_bad_options_exit_2_withone_error_line(argv, num_gpus, message, capsys):
    from moelink.__main__ import parse_args

    with pytest.raises(SystemExit) as e:
        parse_args(argv, num_gpus)
    assert e.value.code == 2
    out, err = capsys.readouterr()
    assert message in one_error_line(err)
    assert out == ""


def test_json_path_that_is_a_directory_is_refused(tmp_path, capsys):
    from moelink.__main__ import parse_args

    with pytest.raises(SystemExit):
        parse_args(["--json", str(tmp_path)], 0)
    assert "is a directory" in one_error_line(capsys.readouterr().err)


def test_mps_mode_from_the_environment_is_checked(monkeypatch, capsys):
    from moelink.__main__ import parse_args

    monkeypatch.setenv("MOELINK_MPS", "sometimes")
    with pytest.raises(SystemExit) as e:
        parse_args([], 1)
    assert e.value.code == 2
    assert "MOELINK_MPS must be one of auto, on, off" in one_error_line(capsys.readouterr().err)


@pytest.mark.parametrize(
    "argv, num_gpus, ranks, tokens",
    [
        ([], 0, 4, 1024),
        ([], 1, 1, 4096),
        ([], 4, 4, 4096),
        (["--ranks", "8"], 1, 8, 4096),  # more ranks than GPUs: several per GPU
        (["--ranks", "2", "--num-tokens", "64"], 0, 2, 64),
        (["--ranks", "32"], 1, 32, 4096),
    ],
)
def test_valid_options_and_machine_defaults(argv, num_gpus, ranks, tokens, monkeypatch, tmp_path):
    from moelink.__main__ import parse_args

    monkeypatch.delenv("MOELINK_MPS", raising=False)
    args, got = parse_args([*argv, "--json", str(tmp_path / "out.json")], num_gpus)
    assert got == ranks and args.num_tokens == tokens
    assert args.mps == "auto" and args.sms == [24, 32, 48]


def test_bad_options_from_the_shell():
    """A few of the invalid options through ``python -m moelink`` on this machine:
    exit 2, one ``error:`` line on stderr, nothing on stdout (no work started)."""
    picks = [BAD_OPTIONS[i] for i in (0, 3, 6, 11, 14, 17, 30)]
    procs = [
        (
            subprocess.Popen(
                [sys.executable, "-m", "moelink", *argv],
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                text=True,
            ),
            message,
        )
        for argv, num_gpus, message in picks
        if num_gpus == 0 or cuda_device_count() > 0
    ]
    for p, message in procs:
        out, err = p.communicate(timeout=120)
        assert p.returncode == 2, err
        assert message in one_error_line(err)
        assert out == ""


def test_cli_parser_property():
    """Random option values (any integer, text, NaN, empty): parse_args either
    exits 2 with one ``error:`` line or returns options the workload can take."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    import contextlib
    import io

    from moelink.__main__ import parse_args

    ints = st.integers(min_value=-(2**63), max_value=2**64)
    values = st.one_of(
        ints.map(str),
        st.sampled_from(["", "nan", "inf", "-0", "1e3", "0x10", " 8", "24,32", "2,,4"]),
        st.text(max_size=8),
    )
    options = st.sampled_from(
        [
            "--num-tokens",
            "--hidden",
            "--num-experts",
            "--num-topk",
            "--sms",
            "--iters",
            "--warmup",
            "--seed",
            "--ranks",
            "--timeout",
            "--mps",
            "--words",
        ]
    )
    argv_lists = st.lists(st.tuples(options, values), max_size=5).map(
        lambda pairs: [f"{k}={v}" for k, v in pairs]
    )

    @hypothesis.settings(max_examples=300, deadline=None)
    @hypothesis.given(argv=argv_lists, num_gpus=st.sampled_from([0, 1, 2, 8]))
    def check(argv, num_gpus):
        err = io.StringIO()
        with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
            try:
                args, ranks = parse_args(argv, num_gpus)
            except SystemExit as e:
                assert e.code == 2
                one_error_line(err.getvalue())
                return
        assert err.getvalue() == ""
        assert 1 <= ranks <= demo.MAX_RANKS
        assert 1 <= args.num_tokens <= demo.MAX_TOKENS
        assert args.hidden % 128 == 0 and 128 <= args.hidden <= demo.MAX_HIDDEN
        assert args.num_experts % ranks == 0
        assert 1 <= args.num_experts // ranks <= demo.MAX_EXPERTS_PER_RANK
        assert 1 <= args.num_topk <= min(demo.MAX_TOPK, args.num_experts)
        assert args.sms and all(s % 2 == 0 and 2 <= s <= demo.MAX_SMS for s in args.sms)
        assert args.iters >= 1 and args.warmup >= 0 and 0 <= args.seed <= demo.MAX_SEED
        assert args.timeout > 0 and args.timeout != float("inf")
        assert args.mps in ("auto", "on", "off")

    check()


def test_reference_turns_follow_host_memory():
    # 8 ranks x 4096 tokens, top-8 of hidden 7168: 8 * 4096 * 8 rows of 7168
    # elements at 20 bytes each, 37.6 GB per rank computing the reference.
    w = {"num_tokens": 4096, "hidden": 7168, "num_topk": 8}
    peak = demo.REFERENCE_BYTES_PER_ELEMENT * 8 * 4096 * 8 * 7168
    for avail, want in ((128 << 30, 2), (10 << 30, 1), (int(8 * peak / 0.7) + 1, 8), (None, 8)):
        assert demo._reference_builders(8, w, avail) == want, avail
    # Fewer ranks than fit: all of them.
    assert demo._reference_builders(2, w, 1 << 50) == 2


def test_own_reference_is_this_ranks_part_of_the_whole():
    from moelink import reference

    w = demo._workload(small_args(num_tokens=96))
    inputs = demo._all_inputs(4, w)
    ref = reference.dispatch(demo._reference_inputs(inputs, fp8=False), 16)
    ys = [ref.ranks[d].recv_x for d in range(4)]
    ws = [ref.ranks[d].recv_topk_weights for d in range(4)]
    combined = reference.combine(ref, ys, topk_weights=ws)
    for rank in range(4):
        mine, own = demo._own_reference(rank, 4, w, torch.device("cpu"))
        assert torch.equal(mine["x"], inputs[rank]["x"])
        assert torch.equal(own["want"].recv_x, ref.ranks[rank].recv_x)
        assert torch.equal(own["want"].recv_src_idx, ref.ranks[rank].recv_src_idx)
        assert own["want_fp8"].recv_scales is not None
        assert torch.equal(own["combined_x"], combined[rank][0])
        assert torch.equal(own["combined_w"], combined[rank][1])
        assert torch.equal(own["rank_prefix"], ref.rank_prefix_matrix.to(torch.int64))
        assert own["recv_tokens"] == [int(ref.ranks[d].num_recv_tokens) for d in range(4)]


def test_gpu_placement_gathers_the_host_memory(gloo_world, monkeypatch):
    from types import SimpleNamespace

    from moelink import _native

    monkeypatch.setattr(
        torch.cuda, "get_device_properties", lambda d: SimpleNamespace(uuid="GPU-0")
    )
    monkeypatch.setattr(_native, "local_sm_counts", lambda i: (132, None))
    monkeypatch.setenv("MOELINK_LAUNCH_MPS", "1")
    dev = torch.device("cuda", 0)
    for avail in (64 << 30, None):
        monkeypatch.setattr(demo, "_mem_available_bytes", lambda a=avail: a)
        got = demo._gpu_placement(gloo_world, dev)
        assert got == {
            "num_gpus": 1,
            "ranks_per_gpu": 1,
            "mps": True,
            "share_sms": _native.device_share_sms(132, None, 1),
            "mem_available": avail,
        }


def test_cross_node_bytes_count_each_token_once_per_node():
    # Rank 2 of 4 in 2 nodes of 2 (node 1): its tokens per node are [30, 50].
    rdma, xnode = demo._cross_node_bf16_bytes(2, torch.tensor([30, 50]), 2, 128)
    assert (rdma, xnode) == (80 * 128 * 2, 30 * 128 * 2)  # DeepEP's formula, then other nodes
    assert demo._cross_node_bf16_bytes(1, torch.tensor([30, 50]), 2, 128)[1] == 50 * 128 * 2
    assert demo._cross_node_bf16_bytes(0, None, None, 128) is None  # one node
    row = demo._row(demo.DISPATCH_FP8, 24, [100.0, 100.0, 100.0], 1000 * demo.FP8_BYTES_FACTOR)
    x = demo._with_cross_node(row, (800, 400), 1000)  # fp8: scaled like the row's bytes
    assert x["rdma_bytes"] == pytest.approx(800 * demo.FP8_BYTES_FACTOR)
    assert x["xnode_bytes"] == pytest.approx(400 * demo.FP8_BYTES_FACTOR)
    assert x["xnode_GBps"] == pytest.approx(400 * demo.FP8_BYTES_FACTOR / 100e-6 / 1e9)
    assert "xnode_GBps" not in demo._with_cross_node(row, None, 1000)


def test_report_across_nodes_has_the_cross_node_columns():
    rows = []
    for r in range(4):
        row = demo._row(demo.DISPATCH_BF16, 24, [500.0, 500.0, 500.0], 211e6)
        rows.append([demo._with_cross_node(row, (150e6, 100e6 + r * 10e6), 211e6)])
    ranks = [_gpu_result(r, rows=rows[r], nodes=2) for r in range(4)]
    agg = demo.aggregate(ranks)
    assert agg["rows"][0]["xnode_GBps"] == pytest.approx(230.0)  # median of 200..260
    assert agg["rows"][0]["rdma_GBps"] == pytest.approx(300.0)
    text = demo.format_report(agg)
    assert "rdma GB/s" in text and "x-node GB/s" in text and "2 emulated nodes" in text
    assert "(own node included) * hidden * 2" in text  # the formula is printed
    one_node = demo.aggregate([_gpu_result(r) for r in range(4)])
    assert "x-node GB/s" not in demo.format_report(one_node)


def test_report_of_emulated_nodes_says_why_no_target_is_judged():
    # One rank per GPU but two emulated nodes: the targets (one node's NVLink
    # figures) are shown, not judged, and the reason is the nodes, not sharing.
    split = {"num_gpus": 4, "ranks_per_gpu": 1, "mps": False, "nodes": 2}
    text = demo.format_report(demo.aggregate([_gpu_result(r, **split) for r in range(4)]))
    assert "not judged (emulated nodes: the targets are one node's NVLink figures)" in text
    assert "ranks share a GPU" not in text
    assert " met" not in text and "MISSED" not in text
