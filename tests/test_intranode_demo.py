"""CPU tests of the intranode demo: inputs, the CPU simulation, the report, the main job."""

from __future__ import annotations

import argparse
import subprocess
import sys

import pytest
import torch
from moelink import intranode_demo as demo

from tests.conftest import cuda_device_count

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

    def broken(ref, ys, topk_weights=None, biases=None):
        out = real(ref, ys, topk_weights=topk_weights, biases=biases)
        x, w = out[0]
        x = x.clone()
        x[0] += 1.0
        return [(x, w)] + out[1:]

    monkeypatch.setattr(reference, "combine", broken)
    result = demo.run_cpu_simulation(2, small_args())
    assert not result["correct"]
    assert any("combine[rank 0]" in c["name"] for c in result["checks"] if not c["ok"])


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
    ranks = []
    for r in range(2):
        ranks.append(
            {
                "mode": "gpu",
                "rank": r,
                "num_ranks": 2,
                "device": "NVIDIA H200",
                "workload": {**SMALL, "seed": 0},
                "timing": {"clock": "CUDA events", "iters": 3, "warmup": 1, "l2_flush_bytes": 1},
                "recv_tokens": [100, 120],
                "correct": True,
                "checks": [{"name": "x", "ok": True, "detail": ""}],
                "rows": rows,
            }
        )
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
