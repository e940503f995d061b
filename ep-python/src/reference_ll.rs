//! Bindings of the CPU reference of low-latency dispatch / combine
//! (`ep_reference::low_latency`), the oracle behind `moelink.reference.ll_*`.
//! Arrays cross as raw little-endian bytes, row-major (the scales in the
//! column-major receive layout the module documents); the checks and all
//! semantics live in ep-reference, whose errors become `ValueError`.

use ep_reference::low_latency::{
    self as r, unpack_layout_range, LlCombineInput, LlRankInput, LowLatencyArgs, RecvScales, RecvX,
};
use ep_reference::normal::{bf16_bits_to_f32, f32_to_bf16_bits};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::reference::{decode, encode, raw_bytes};
use crate::to_py;

type Bytes<'py> = Bound<'py, PyBytes>;

/// `low_latency_dispatch` over all ranks. `inputs[r] = (x f32 bytes [T_r, H],
/// topk_idx int64 bytes [T_r, K])`. Returns one dict per rank: `recv_x`
/// (bf16 bytes, rounded to nearest even, for bf16; u8 for fp8), `scales` (f32 or int32 bytes, or None),
/// `recv_count` (int32), `src_info` (int32), `layout_range` (int64). With
/// `only_rank`, that rank's dict alone is computed and the others are None.
#[pyfunction]
#[pyo3(signature = (inputs, max_tokens, hidden, num_experts, num_topk, use_fp8, round_scale, use_ue8m0, only_rank=None))]
#[allow(clippy::too_many_arguments)]
pub fn ref_ll_dispatch<'py>(
    py: Python<'py>,
    inputs: Vec<(Bytes<'py>, Bytes<'py>)>,
    max_tokens: usize,
    hidden: usize,
    num_experts: usize,
    num_topk: usize,
    use_fp8: bool,
    round_scale: bool,
    use_ue8m0: bool,
    only_rank: Option<usize>,
) -> PyResult<Vec<Option<Bound<'py, PyDict>>>> {
    let args = LowLatencyArgs {
        num_max_dispatch_tokens_per_rank: max_tokens,
        hidden,
        num_experts,
        num_topk,
        use_fp8,
        round_scale,
        use_ue8m0,
    };
    let mut xs = Vec::with_capacity(inputs.len());
    let mut ids = Vec::with_capacity(inputs.len());
    for (x, t) in &inputs {
        xs.push(decode("x", x.as_bytes(), f32::from_le_bytes)?);
        ids.push(decode("topk_idx", t.as_bytes(), i64::from_le_bytes)?);
    }
    let ins: Vec<LlRankInput<'_>> = xs
        .iter()
        .zip(&ids)
        .map(|(x, t)| LlRankInput { x, topk_idx: t })
        .collect();
    let ranks: Vec<Option<r::LlRankOutput>> = match only_rank {
        None => py
            .detach(|| r::low_latency_dispatch(&ins, &args))
            .map_err(to_py)?
            .ranks
            .into_iter()
            .map(Some)
            .collect(),
        Some(k) => {
            let one = py
                .detach(|| r::low_latency_dispatch_rank(&ins, &args, k))
                .map_err(to_py)?;
            let mut v: Vec<_> = (0..ins.len()).map(|_| None).collect();
            v[k] = Some(one); // k < len: checked by low_latency_dispatch_rank
            v
        }
    };
    let mut dicts = Vec::with_capacity(ranks.len());
    for rank in &ranks {
        let Some(rank) = rank else {
            dicts.push(None);
            continue;
        };
        let d = PyDict::new(py);
        match &rank.recv_x {
            RecvX::Bf16(v) => {
                // bf16 on the wire: half the bytes of f32 (the dense [E_local,
                // R*T, H] block is most of a low-latency check's host time).
                d.set_item(
                    "recv_x",
                    encode(py, v, |x| f32_to_bf16_bits(x).to_le_bytes())?,
                )?;
                d.set_item("scales", py.None())?;
            }
            RecvX::Fp8 { x, scales } => {
                d.set_item("recv_x", raw_bytes(py, x)?)?;
                match scales {
                    RecvScales::F32(s) => d.set_item("scales", encode(py, s, f32::to_le_bytes)?)?,
                    RecvScales::Ue8m0(s) => {
                        d.set_item("scales", encode(py, s, i32::to_le_bytes)?)?
                    }
                }
            }
        }
        d.set_item(
            "recv_count",
            encode(py, &rank.recv_count, i32::to_le_bytes)?,
        )?;
        d.set_item("src_info", encode(py, &rank.src_info, i32::to_le_bytes)?)?;
        d.set_item(
            "layout_range",
            encode(py, &rank.layout_range, i64::to_le_bytes)?,
        )?;
        dicts.push(Some(d));
    }
    Ok(dicts)
}

/// `low_latency_combine` over all ranks. `inputs[r] = (y bf16 bytes
/// [E_local, R*T, H] (only the rows the handle's blocks cover are read), topk_idx int64 [T_r, K], topk_weights f32
/// [T_r, K], src_info int32 [E_local, R*T], layout_range int64 [E_local, R])`.
/// Returns per rank `(combined_x f32 bytes [T_r, H], abs_sum f32 bytes)`.
#[pyfunction]
pub fn ref_ll_combine<'py>(
    py: Python<'py>,
    inputs: Vec<(Bytes<'py>, Bytes<'py>, Bytes<'py>, Bytes<'py>, Bytes<'py>)>,
    max_tokens: usize,
    hidden: usize,
    num_experts: usize,
    num_topk: usize,
) -> PyResult<Vec<(Bytes<'py>, Bytes<'py>)>> {
    let args = LowLatencyArgs::new(max_tokens, hidden, num_experts, num_topk).bf16();
    let num_ranks = inputs.len();
    let mut dec = Vec::with_capacity(num_ranks);
    for (y, t, w, s, l) in &inputs {
        let layout_range = decode("layout_range", l.as_bytes(), i64::from_le_bytes)?;
        let rows = RowsInUse {
            layout_range: &layout_range,
            num_ranks,
            rows_per_expert: num_ranks.saturating_mul(max_tokens),
            hidden,
        };
        dec.push((
            rows.decode_y(y.as_bytes())?,
            decode("topk_idx", t.as_bytes(), i64::from_le_bytes)?,
            decode("topk_weights", w.as_bytes(), f32::from_le_bytes)?,
            decode("src_info", s.as_bytes(), i32::from_le_bytes)?,
            layout_range,
        ));
    }
    let ins: Vec<LlCombineInput<'_>> = dec
        .iter()
        .map(|(y, t, w, s, l)| LlCombineInput::new(y, t, w, s, l))
        .collect();
    let out = py
        .detach(|| r::low_latency_combine(&ins, &args))
        .map_err(to_py)?;
    out.iter()
        .map(|o| {
            Ok((
                encode(py, &o.combined_x, f32::to_le_bytes)?,
                encode(py, &o.abs_sum, f32::to_le_bytes)?,
            ))
        })
        .collect()
}

/// The rows of one rank's `[E_local, R*T, H]` combine input that its handle's
/// blocks cover: local expert `j`'s first `sum of its blocks' counts` rows
/// (the blocks tile them; `ep_reference::low_latency` checks that and reads no
/// other row).
struct RowsInUse<'a> {
    layout_range: &'a [i64],
    num_ranks: usize,
    rows_per_expert: usize,
    hidden: usize,
}

impl RowsInUse<'_> {
    /// `y`'s bf16 bytes as f32 values, the rows in use decoded and every other
    /// value 0 (a zeroed allocation the rest of which is never touched: the
    /// dense block is mostly unused rows, and decoding all of it was most of a
    /// low-latency check's host time).
    fn decode_y(&self, y: &[u8]) -> PyResult<Vec<f32>> {
        if y.len() % 2 != 0 || self.num_ranks == 0 || self.hidden == 0 {
            // Malformed: decode it all and let ep-reference name what is wrong.
            return decode("y", y, |b| bf16_bits_to_f32(u16::from_le_bytes(b)));
        }
        let n = y.len() / 2;
        let mut v = vec![0.0f32; n];
        let row = self.rows_per_expert.saturating_mul(self.hidden);
        for (j, ranges) in self.layout_range.chunks_exact(self.num_ranks).enumerate() {
            let used: usize = ranges
                .iter()
                .map(|&p| usize::try_from(unpack_layout_range(p).1).unwrap_or(0))
                .sum();
            let begin = j.saturating_mul(row).min(n);
            let end = begin
                .saturating_add(used.min(self.rows_per_expert).saturating_mul(self.hidden))
                .min(n);
            for (dst, b) in v[begin..end]
                .iter_mut()
                .zip(y[2 * begin..2 * end].chunks_exact(2))
            {
                *dst = bf16_bits_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        Ok(v)
    }
}
