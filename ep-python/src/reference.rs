//! Bindings of the CPU reference of intranode and internode layout /
//! dispatch / combine (`ep_reference::normal`), the oracle behind
//! `moelink.reference`.
//!
//! Thin on purpose: every array crosses as raw little-endian bytes, row-major,
//! with its shape passed (or implied) alongside; the checks and all semantics
//! live in ep-reference, whose `InvalidArgument` errors become `ValueError`.

use ep_reference::normal::{
    self as reference, CombineInput, DispatchArgs, Dispatched, RankInput, TokenData,
};
use pyo3::exceptions::{PyIndexError, PyMemoryError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyDict};

use crate::to_py;

type Bytes<'py> = Bound<'py, PyBytes>;
/// One rank's dispatch input: `(topk_idx, topk_weights, x, scales)`.
type DispatchInput<'py> = (
    Bytes<'py>,
    Option<Bytes<'py>>,
    Bytes<'py>,
    Option<Bytes<'py>>,
);
/// One rank's cached-dispatch input: `(x, scales)`.
type CachedInput<'py> = (Bytes<'py>, Option<Bytes<'py>>);
/// One rank's combine input: `(y, topk_weights, bias0, bias1)`.
type CombineIn<'py> = (
    Bytes<'py>,
    Option<Bytes<'py>>,
    Option<Bytes<'py>>,
    Option<Bytes<'py>>,
);
/// A pair of byte strings, the second optional.
type BytesPair<'py> = (Bytes<'py>, Option<Bytes<'py>>);
/// `reference_layout`'s result: per rank, per node (or None), per expert, and
/// `is_token_in_rank`.
type LayoutBytes<'py> = (Bytes<'py>, Option<Bytes<'py>>, Bytes<'py>, Bytes<'py>);

/// Little-endian values of `N` bytes each.
pub(crate) fn decode<const N: usize, T>(
    name: &str,
    b: &[u8],
    f: fn([u8; N]) -> T,
) -> PyResult<Vec<T>> {
    if b.len() % N != 0 {
        return Err(PyValueError::new_err(format!(
            "{name}: {} bytes is not a whole number of {N}-byte values",
            b.len()
        )));
    }
    Ok(b.chunks_exact(N)
        .map(|c| f(c.try_into().expect("chunks_exact gives N bytes")))
        .collect())
}

fn i64s(name: &str, b: &Bytes<'_>) -> PyResult<Vec<i64>> {
    decode(name, b.as_bytes(), i64::from_le_bytes)
}

fn f32s(name: &str, b: Option<&Bytes<'_>>) -> PyResult<Option<Vec<f32>>> {
    b.map(|b| decode(name, b.as_bytes(), f32::from_le_bytes))
        .transpose()
}

/// `v` as little-endian values of `N` bytes each, written straight into a new
/// `bytes` object. An allocation that fails is a `MemoryError`, not a panic.
pub(crate) fn encode<'py, const N: usize, T: Copy>(
    py: Python<'py>,
    v: &[T],
    f: fn(T) -> [u8; N],
) -> PyResult<Bytes<'py>> {
    let len = v
        .len()
        .checked_mul(N)
        .ok_or_else(|| PyMemoryError::new_err(format!("{} values of {N} bytes", v.len())))?;
    PyBytes::new_with(py, len, |buf| {
        for (dst, &x) in buf.chunks_exact_mut(N).zip(v) {
            dst.copy_from_slice(&f(x));
        }
        Ok(())
    })
}

/// A copy of `b` as a new `bytes` object (`MemoryError` when it cannot be
/// allocated).
pub(crate) fn raw_bytes<'py>(py: Python<'py>, b: &[u8]) -> PyResult<Bytes<'py>> {
    encode(py, b, |x| [x])
}

fn i32_bytes<'py>(py: Python<'py>, v: &[i32]) -> PyResult<Bytes<'py>> {
    encode(py, v, i32::to_le_bytes)
}

fn f32_bytes<'py>(py: Python<'py>, v: Option<&[f32]>) -> PyResult<Option<Bytes<'py>>> {
    v.map(|v| encode(py, v, f32::to_le_bytes)).transpose()
}

/// `0` / `1` bytes, the layout of a torch bool tensor.
fn bool_bytes<'py>(py: Python<'py>, v: &[bool]) -> PyResult<Bytes<'py>> {
    encode(py, v, |b| [u8::from(b)])
}

/// `ep_reference::normal::layout` of one rank's int64 `topk_idx` `[N, num_topk]`
/// (`layout_internode` when `ranks_per_node` is given). Returns
/// `(num_tokens_per_rank int32 [R], num_tokens_per_rdma_rank int32 [R /
/// ranks_per_node] or None without ranks_per_node, num_tokens_per_expert int32
/// [E], is_token_in_rank bool [N, R])` as bytes (bools as 0 / 1 bytes).
#[pyfunction]
#[pyo3(signature = (topk_idx, num_topk, num_experts, num_ranks, ranks_per_node=None))]
fn reference_layout<'py>(
    py: Python<'py>,
    topk_idx: &Bytes<'py>,
    num_topk: usize,
    num_experts: usize,
    num_ranks: usize,
    ranks_per_node: Option<usize>,
) -> PyResult<LayoutBytes<'py>> {
    let idx = i64s("topk_idx", topk_idx)?;
    let l = match ranks_per_node {
        Some(rpn) => reference::layout_internode(&idx, num_topk, num_experts, num_ranks, rpn),
        None => reference::layout(&idx, num_topk, num_experts, num_ranks),
    }
    .map_err(to_py)?;
    Ok((
        i32_bytes(py, &l.num_tokens_per_rank)?,
        l.num_tokens_per_rdma_rank
            .as_deref()
            .map(|v| i32_bytes(py, v))
            .transpose()?,
        i32_bytes(py, &l.num_tokens_per_expert)?,
        bool_bytes(py, &l.is_token_in_rank)?,
    ))
}

/// `ep_reference::normal::dispatch` over all ranks. `inputs[r]` is rank `r`'s
/// `(topk_idx int64 [N, K], topk_weights f32 [N, K] or None, x [N,
/// hidden_bytes] raw bytes, scales f32 [N, num_scales] or None)`.
#[pyfunction]
fn reference_dispatch(
    inputs: Vec<DispatchInput<'_>>,
    num_experts: usize,
    num_topk: usize,
    hidden_bytes: usize,
    num_scales: usize,
    expert_alignment: usize,
    num_worst_tokens: usize,
) -> PyResult<RefDispatched> {
    let decoded = inputs
        .iter()
        .map(|(idx, w, _, s)| {
            Ok((
                i64s("topk_idx", idx)?,
                f32s("topk_weights", w.as_ref())?,
                f32s("scales", s.as_ref())?,
            ))
        })
        .collect::<PyResult<Vec<_>>>()?;
    let rank_inputs: Vec<RankInput<'_>> = inputs
        .iter()
        .zip(&decoded)
        .map(|((_, _, x, _), (idx, w, s))| RankInput {
            topk_idx: idx,
            topk_weights: w.as_deref(),
            x: x.as_bytes(),
            scales: s.as_deref(),
        })
        .collect();
    let args = DispatchArgs {
        num_experts,
        num_topk,
        hidden_bytes,
        num_scales,
        expert_alignment,
        num_worst_tokens,
    };
    let inner = reference::dispatch(&rank_inputs, &args).map_err(to_py)?;
    Ok(RefDispatched { inner })
}

/// `ep_reference::normal::dispatch_cached`: `inputs[r]` is rank `r`'s `(x [N,
/// hidden_bytes] raw bytes, scales f32 [N, num_scales] or None)`. Returns
/// `(recv_x, recv_scales or None)` bytes per destination rank.
#[pyfunction]
fn reference_dispatch_cached<'py>(
    py: Python<'py>,
    handle: &Bound<'py, RefDispatched>,
    inputs: Vec<CachedInput<'py>>,
    hidden_bytes: usize,
    num_scales: usize,
) -> PyResult<Vec<BytesPair<'py>>> {
    let scales = inputs
        .iter()
        .map(|(_, s)| f32s("scales", s.as_ref()))
        .collect::<PyResult<Vec<_>>>()?;
    let data: Vec<TokenData<'_>> = inputs
        .iter()
        .zip(&scales)
        .map(|((x, _), s)| TokenData {
            x: x.as_bytes(),
            scales: s.as_deref(),
        })
        .collect();
    let out = reference::dispatch_cached(&handle.get().inner, &data, hidden_bytes, num_scales)
        .map_err(to_py)?;
    out.iter()
        .map(|o| {
            Ok((
                raw_bytes(py, &o.recv_x)?,
                f32_bytes(py, o.recv_scales.as_deref())?,
            ))
        })
        .collect()
}

/// `ep_reference::normal::combine` (`combine_internode` when `ranks_per_node`
/// is given): `inputs[r]` is rank `r`'s `(y f32 [rows, hidden], topk_weights
/// f32 [rows, K] or None, bias0 f32 [N, hidden] or None, bias1 likewise)`.
/// Returns `(combined_x f32 [N, hidden], combined_topk_weights f32 [N, K] or
/// None)` bytes per source rank.
#[pyfunction]
#[pyo3(signature = (handle, inputs, hidden, ranks_per_node=None))]
fn reference_combine<'py>(
    py: Python<'py>,
    handle: &Bound<'py, RefDispatched>,
    inputs: Vec<CombineIn<'py>>,
    hidden: usize,
    ranks_per_node: Option<usize>,
) -> PyResult<Vec<BytesPair<'py>>> {
    let decoded = inputs
        .iter()
        .map(|(y, w, b0, b1)| {
            Ok((
                decode("y", y.as_bytes(), f32::from_le_bytes)?,
                f32s("topk_weights", w.as_ref())?,
                f32s("bias0", b0.as_ref())?,
                f32s("bias1", b1.as_ref())?,
            ))
        })
        .collect::<PyResult<Vec<_>>>()?;
    let combine_inputs: Vec<CombineInput<'_>> = decoded
        .iter()
        .map(|(y, w, b0, b1)| CombineInput {
            y,
            topk_weights: w.as_deref(),
            bias: [b0.as_deref(), b1.as_deref()],
        })
        .collect();
    let handle = &handle.get().inner;
    let out = match ranks_per_node {
        Some(rpn) => reference::combine_internode(handle, &combine_inputs, hidden, rpn),
        None => reference::combine(handle, &combine_inputs, hidden),
    }
    .map_err(to_py)?;
    out.iter()
        .map(|o| {
            Ok((
                encode(py, &o.combined_x, f32::to_le_bytes)?,
                f32_bytes(py, o.combined_topk_weights.as_deref())?,
            ))
        })
        .collect()
}

/// The result of `reference_dispatch`: every rank's outputs plus the routing,
/// which `reference_dispatch_cached` and `reference_combine` take back.
#[pyclass(frozen, module = "moelink._native")]
struct RefDispatched {
    inner: Dispatched,
}

impl RefDispatched {
    fn check_rank(&self, rank: usize) -> PyResult<()> {
        let n = self.inner.num_ranks();
        if rank >= n {
            return Err(PyIndexError::new_err(format!(
                "rank {rank} out of range for {n} ranks"
            )));
        }
        Ok(())
    }
}

#[pymethods]
impl RefDispatched {
    /// Number of ranks `R`.
    #[getter]
    fn num_ranks(&self) -> usize {
        self.inner.num_ranks()
    }

    /// `K`, the columns of `topk_idx`.
    #[getter]
    fn num_topk(&self) -> usize {
        self.inner.args.num_topk
    }

    /// Bytes of one token row of `x`.
    #[getter]
    fn hidden_bytes(&self) -> usize {
        self.inner.args.hidden_bytes
    }

    /// f32 scales per token (0 without scales).
    #[getter]
    fn num_scales(&self) -> usize {
        self.inner.args.num_scales
    }

    /// int32 `[R, R]`, cumulative over source ranks.
    #[getter]
    fn rank_prefix_matrix<'py>(&self, py: Python<'py>) -> PyResult<Bytes<'py>> {
        i32_bytes(py, &self.inner.rank_prefix_matrix)
    }

    /// `N` of source rank `rank`.
    fn num_tokens(&self, rank: usize) -> PyResult<usize> {
        self.check_rank(rank)?;
        Ok(self.inner.layouts[rank].num_tokens())
    }

    /// bool `[N, R]` of source rank `rank`, as 0 / 1 bytes.
    fn is_token_in_rank<'py>(&self, py: Python<'py>, rank: usize) -> PyResult<Bytes<'py>> {
        self.check_rank(rank)?;
        bool_bytes(py, &self.inner.layouts[rank].is_token_in_rank)
    }

    /// What destination rank `rank` receives, as a dict of the fields of
    /// `ep_reference::normal::RankOutput` (arrays as bytes) plus `num_rows`.
    fn rank_output<'py>(&self, py: Python<'py>, rank: usize) -> PyResult<Bound<'py, PyDict>> {
        self.check_rank(rank)?;
        let o = &self.inner.ranks[rank];
        let d = PyDict::new(py);
        d.set_item("num_recv_tokens", o.num_recv_tokens)?;
        d.set_item("num_rows", o.num_rows())?;
        d.set_item("recv_x", raw_bytes(py, &o.recv_x)?)?;
        d.set_item("recv_scales", f32_bytes(py, o.recv_scales.as_deref())?)?;
        d.set_item(
            "recv_topk_idx",
            encode(py, &o.recv_topk_idx, i64::to_le_bytes)?,
        )?;
        d.set_item(
            "recv_topk_weights",
            f32_bytes(py, o.recv_topk_weights.as_deref())?,
        )?;
        d.set_item("recv_src_idx", i32_bytes(py, &o.recv_src_idx)?)?;
        d.set_item("recv_src_rank", i32_bytes(py, &o.recv_src_rank)?)?;
        d.set_item(
            "num_recv_tokens_per_expert",
            o.num_recv_tokens_per_expert.clone(),
        )?;
        Ok(d)
    }
}

/// Adds the reference functions and `RefDispatched` to `_native`.
pub fn register(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(reference_layout, m)?)?;
    m.add_function(wrap_pyfunction!(reference_dispatch, m)?)?;
    m.add_function(wrap_pyfunction!(reference_dispatch_cached, m)?)?;
    m.add_function(wrap_pyfunction!(reference_combine, m)?)?;
    m.add_class::<RefDispatched>()?;
    Ok(())
}
