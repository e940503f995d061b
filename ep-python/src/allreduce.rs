//! `_native.AllReduceComm`: the Rust half of `moelink.AllReduce` (crate
//! `collectives`). Pointers arrive as ints (`tensor.data_ptr()`) after the
//! Python layer checked every tensor; streams as raw `cudaStream_t` ints;
//! dtypes, ops and algorithms as names. The static methods (`plan`,
//! `variant`, `algorithm_names`) need no GPU: the CPU tests call them.

use collectives::algorithm::{Algorithm, Collective, Limits, Request};
use collectives::args::{MAX_BLOCKS, MAX_BYTES, MAX_RANKS};
use collectives::select::{parse_algorithm, resolve, Choice, TableKey, TunedTable};
use collectives::{
    dtype, Accum, AllGatherCall, AllReduceCall, AllReduceComm as Inner, AllReduceConfig, DType,
    ReduceOp, TestHooks,
};
use comm::{CommError, StreamHandle};
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use crate::group::{timeout_arg, Group};
use crate::{drop_detached, to_py};

/// (collective, graph, registered, log2 bytes, algorithm, blocks, threads).
type TunedTuple = (String, bool, bool, u32, String, u32, u32);
/// (algorithm, blocks, threads).
type ChoiceTuple = (String, u32, u32);

fn choice_tuple(c: Choice) -> ChoiceTuple {
    (c.algorithm.name().to_string(), c.num_blocks, c.num_threads)
}

fn collective(name: &str) -> PyResult<Collective> {
    Collective::parse(name).ok_or_else(|| {
        PyValueError::new_err(format!(
            "collective must be 'allreduce' or 'allgather', got {name:?}"
        ))
    })
}

fn algorithm(name: Option<&str>, c: Collective) -> PyResult<Option<Algorithm>> {
    name.map(|n| parse_algorithm(n, c))
        .transpose()
        .map_err(to_py)
}

fn table(entries: &[TunedTuple]) -> PyResult<TunedTable> {
    let mut t = TunedTable::new();
    for (coll, graph, registered, log2_bytes, alg, blocks, threads) in entries {
        let c = collective(coll)?;
        let a = parse_algorithm(alg, c).map_err(to_py)?;
        t.insert(
            TableKey {
                collective: c,
                graph: *graph,
                registered: *registered,
                log2_bytes: *log2_bytes,
            },
            Choice {
                algorithm: a,
                num_blocks: *blocks,
                num_threads: *threads,
            },
        );
    }
    Ok(t)
}

#[pyclass(module = "moelink._native")]
pub struct AllReduceComm {
    inner: Option<Inner>,
}

impl AllReduceComm {
    fn get(&mut self) -> PyResult<&mut Inner> {
        self.inner
            .as_mut()
            .ok_or_else(|| PyRuntimeError::new_err("the AllReduce communicator was destroyed"))
    }
}

#[pymethods]
impl AllReduceComm {
    /// *Collective.* The group's next object: builds the scratch buffer and
    /// channels on CUDA device `device`.
    #[new]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        group: PyRef<'_, Group>,
        device: i32,
        max_bytes: usize,
        oneshot_max_bytes: usize,
        twoshot_max_bytes: usize,
        allgather_ll_max_bytes: usize,
        timeout_s: f64,
        device_timeout_ns: i64,
    ) -> PyResult<Self> {
        let timeout = timeout_arg("timeout_s", timeout_s)?;
        let config = AllReduceConfig {
            max_bytes,
            oneshot_max_bytes,
            twoshot_max_bytes,
            allgather_ll_max_bytes,
            timeout,
            device_timeout_ns,
        };
        let inner = group.make(py, device, |group, dev| Inner::new(group, dev, &config))?;
        Ok(Self { inner: Some(inner) })
    }

    #[getter]
    fn rank(&mut self) -> PyResult<usize> {
        Ok(self.get()?.rank())
    }

    #[getter]
    fn num_ranks(&mut self) -> PyResult<usize> {
        Ok(self.get()?.num_ranks())
    }

    #[getter]
    fn destroyed(&self) -> bool {
        self.inner.is_none()
    }

    /// (world_size, max_bytes, oneshot_max_bytes, twoshot_max_bytes,
    /// allgather_ll_max_bytes, max_blocks) as this communicator applies them.
    fn limits(&mut self) -> PyResult<(usize, u64, u64, u64, u64, u32)> {
        let l = *self.get()?.limits();
        Ok((
            l.world_size,
            l.max_bytes,
            l.oneshot_max_bytes,
            l.twoshot_max_bytes,
            l.allgather_ll_max_bytes,
            l.max_blocks,
        ))
    }

    /// Bytes of the registered scratch buffer (LL halves + data region).
    fn scratch_bytes(&mut self) -> PyResult<u64> {
        Ok(self.get()?.layout().total)
    }

    /// Launches an allreduce of `count` elements on `stream`; returns
    /// (algorithm, blocks, threads) it used.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, input, output, count, dtype, op, accum, algorithm,
        num_blocks, num_threads, capturing))]
    fn all_reduce(
        &mut self,
        stream: usize,
        input: u64,
        output: u64,
        count: u64,
        dtype: &str,
        op: &str,
        accum: Option<&str>,
        algorithm: Option<&str>,
        num_blocks: u32,
        num_threads: u32,
        capturing: bool,
    ) -> PyResult<ChoiceTuple> {
        let call = AllReduceCall {
            input,
            output,
            count,
            dtype: DType::parse(dtype).map_err(to_py)?,
            op: ReduceOp::parse(op).map_err(to_py)?,
            accum: accum.map(Accum::parse).transpose().map_err(to_py)?,
            algorithm: self::algorithm(algorithm, Collective::AllReduce)?,
            num_blocks,
            num_threads,
            capturing,
        };
        self.get()?
            .all_reduce(StreamHandle(stream), &call)
            .map(choice_tuple)
            .map_err(to_py)
    }

    /// Launches an allgather of `nbytes` per rank on `stream`.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (stream, input, output, nbytes, algorithm, num_blocks, num_threads,
        capturing))]
    fn all_gather(
        &mut self,
        stream: usize,
        input: u64,
        output: u64,
        nbytes: u64,
        algorithm: Option<&str>,
        num_blocks: u32,
        num_threads: u32,
        capturing: bool,
    ) -> PyResult<ChoiceTuple> {
        let call = AllGatherCall {
            input,
            output,
            nbytes,
            algorithm: self::algorithm(algorithm, Collective::AllGather)?,
            num_blocks,
            num_threads,
            capturing,
        };
        self.get()?
            .all_gather(StreamHandle(stream), &call)
            .map(choice_tuple)
            .map_err(to_py)
    }

    /// What a call would use: (algorithm, blocks, threads). `nbytes` is the
    /// allreduce message or the allgather per-rank input.
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (collective, nbytes, registered, capturing, algorithm=None,
        num_blocks=0, num_threads=0))]
    fn select(
        &mut self,
        collective: &str,
        nbytes: u64,
        registered: bool,
        capturing: bool,
        algorithm: Option<&str>,
        num_blocks: u32,
        num_threads: u32,
    ) -> PyResult<ChoiceTuple> {
        let c = self::collective(collective)?;
        let pinned = self::algorithm(algorithm, c)?;
        let req = Request {
            collective: c,
            nbytes,
            registered,
            capturing,
        };
        self.get()?
            .select(&req, pinned, num_blocks, num_threads)
            .map(choice_tuple)
            .map_err(to_py)
    }

    /// *Collective.* Registers `[ptr, ptr + nbytes)` for zero-copy
    /// algorithms; returns the registration id.
    fn register(&mut self, py: Python<'_>, ptr: u64, nbytes: u64) -> PyResult<u64> {
        let c = self.get()?;
        py.detach(|| c.register(ptr, nbytes)).map_err(to_py)
    }

    /// *Collective.* Drops registration `id` (after a barrier).
    fn deregister(&mut self, py: Python<'_>, id: u64) -> PyResult<()> {
        let c = self.get()?;
        py.detach(|| c.deregister(id)).map_err(to_py)
    }

    /// Whether `[ptr, ptr + nbytes)` lies in a registered range.
    fn is_registered(&mut self, ptr: u64, nbytes: u64) -> PyResult<bool> {
        Ok(self.get()?.registration(ptr, nbytes).is_some())
    }

    /// Replaces the tuned table; entries are (collective, graph, registered,
    /// log2 bytes, algorithm, blocks, threads). Every rank must set the same.
    fn set_tuned(&mut self, entries: Vec<TunedTuple>) -> PyResult<()> {
        let t = table(&entries)?;
        self.get()?.set_table(t);
        Ok(())
    }

    /// The tuned table, sorted.
    fn tuned(&mut self) -> PyResult<Vec<TunedTuple>> {
        Ok(self
            .get()?
            .table()
            .entries()
            .into_iter()
            .map(|(k, c)| {
                (
                    k.collective.name().to_string(),
                    k.graph,
                    k.registered,
                    k.log2_bytes,
                    c.algorithm.name().to_string(),
                    c.num_blocks,
                    c.num_threads,
                )
            })
            .collect())
    }

    /// Bound of every device wait, nanoseconds of GPU time (positive;
    /// ValueError otherwise).
    fn set_device_timeout_ns(&mut self, timeout_ns: i64) -> PyResult<()> {
        self.get()?.set_device_timeout_ns(timeout_ns).map_err(to_py)
    }

    /// Tests only: every rsag block of this rank waits `copy_out_delay_us`
    /// before copying out; `results_in_data_region` brings back the race the
    /// result region removes (unsafe; every rank must set the same). ValueError
    /// for a delay outside 0..=1 s.
    #[pyo3(signature = (copy_out_delay_us=0, results_in_data_region=false))]
    fn _set_test_hooks(
        &mut self,
        copy_out_delay_us: i32,
        results_in_data_region: bool,
    ) -> PyResult<()> {
        self.get()?
            .set_test_hooks(TestHooks {
                copy_out_delay_us,
                results_in_data_region,
            })
            .map_err(to_py)
    }

    #[getter]
    fn device_timeout_ns(&mut self) -> PyResult<i64> {
        Ok(self.get()?.device_timeout_ns())
    }

    /// Raises moelink.TimeoutError if a device wait of this communicator ran
    /// out (the message names the rank and what it waited for).
    fn check_device(&mut self) -> PyResult<()> {
        self.get()?.check_device().map_err(to_py)
    }

    /// *Collective* host barrier.
    fn barrier(&mut self, py: Python<'_>) -> PyResult<()> {
        let c = self.get()?;
        py.detach(|| c.barrier()).map_err(to_py)
    }

    /// Frees everything (idempotent). The caller synchronised the streams
    /// that used the communicator.
    fn destroy(&mut self, py: Python<'_>) {
        drop_detached(py, self.inner.take());
    }

    /// Every algorithm: (name, collective).
    #[staticmethod]
    fn algorithm_names() -> Vec<(String, String)> {
        Algorithm::ALL
            .iter()
            .map(|a| (a.name().to_string(), a.collective().name().to_string()))
            .collect()
    }

    /// The kernel variant suffix reducing `dtype` with `op` in `accum` (None:
    /// the default); ValueError for an unsupported combination.
    #[staticmethod]
    #[pyo3(signature = (dtype, op, accum=None))]
    fn variant(dtype: &str, op: &str, accum: Option<&str>) -> PyResult<String> {
        let d = DType::parse(dtype).map_err(to_py)?;
        let o = ReduceOp::parse(op).map_err(to_py)?;
        let a = accum.map(Accum::parse).transpose().map_err(to_py)?;
        let v = dtype::variant(d, o, a).map_err(to_py)?;
        Ok(dtype::VARIANT_SUFFIXES[v].to_string())
    }

    /// The selector without a communicator (what `select` computes, for given
    /// limits and tuned entries): (algorithm, blocks, threads).
    #[staticmethod]
    #[allow(clippy::too_many_arguments)]
    #[pyo3(signature = (collective, nbytes, world_size, max_bytes, oneshot_max_bytes,
        twoshot_max_bytes, allgather_ll_max_bytes, max_blocks, registered=false,
        capturing=false, algorithm=None, num_blocks=0, num_threads=0, tuned=Vec::new()))]
    fn plan(
        collective: &str,
        nbytes: u64,
        world_size: usize,
        max_bytes: u64,
        oneshot_max_bytes: u64,
        twoshot_max_bytes: u64,
        allgather_ll_max_bytes: u64,
        max_blocks: u32,
        registered: bool,
        capturing: bool,
        algorithm: Option<&str>,
        num_blocks: u32,
        num_threads: u32,
        tuned: Vec<TunedTuple>,
    ) -> PyResult<ChoiceTuple> {
        let c = self::collective(collective)?;
        let invalid = |name: &'static str, why: String| Err(to_py(CommError::invalid(name, why)));
        if world_size == 0 || world_size > MAX_RANKS {
            return invalid(
                "world_size",
                format!("{world_size} ranks: the collectives handle 1..={MAX_RANKS} (one host)"),
            );
        }
        if max_blocks == 0 || max_blocks as usize > MAX_BLOCKS {
            return invalid(
                "max_blocks",
                format!("{max_blocks}: must be in 1..={MAX_BLOCKS}"),
            );
        }
        if max_bytes == 0 || max_bytes > MAX_BYTES as u64 {
            return invalid(
                "max_bytes",
                format!("{max_bytes}: must be in 1..={MAX_BYTES}"),
            );
        }
        // What the communicator refuses before any launch: an allreduce
        // tensor, or an allgather output, above max_bytes.
        let (total, what) = match c {
            Collective::AllReduce => (Some(nbytes), format!("{nbytes} bytes")),
            Collective::AllGather => (
                nbytes.checked_mul(world_size as u64),
                format!("an allgather output of {world_size} x {nbytes} bytes"),
            ),
        };
        if total.is_none_or(|t| t > max_bytes) {
            return invalid("nbytes", format!("{what}: more than max_bytes={max_bytes}"));
        }
        let limits = Limits {
            world_size,
            max_bytes,
            oneshot_max_bytes: oneshot_max_bytes.min(max_bytes),
            twoshot_max_bytes: twoshot_max_bytes.min(max_bytes),
            allgather_ll_max_bytes: allgather_ll_max_bytes.min(max_bytes),
            max_blocks,
        };
        let req = Request {
            collective: c,
            nbytes,
            registered,
            capturing,
        };
        let pinned = self::algorithm(algorithm, c)?;
        resolve(
            &req,
            &limits,
            &table(&tuned)?,
            pinned,
            num_blocks,
            num_threads,
        )
        .map(choice_tuple)
        .map_err(to_py)
    }
}
