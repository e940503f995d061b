//! [`AllReduce`]: `moelink.AllReduce` on tch tensors: allreduce and
//! allgather among the GPUs of one host, with the communicator of crate
//! `collectives`, on torch's current stream (inside a CUDA-graph capture
//! too, where the tuned table's graph entries apply, as in Python).
//!
//! Tuning: the communicator loads the tuned table that Python's
//! `moelink.AllReduce.tune()` wrote for this GPU model and world size (the
//! same file, format and variable: `MOELINK_AR_TUNE_FILE`, else
//! `~/.cache/moelink/allreduce-<gpu>-<R>gpu.json`; crate `collectives`'
//! `tune_file` reads it). Rank 0 reads it and every rank takes its entries;
//! a file of another job is ignored with a warning on stderr. The tuner
//! itself is Python's.

use std::path::{Path, PathBuf};
use std::time::Duration;

use collectives::algorithm::{Algorithm, Collective};
use collectives::select::parse_algorithm;
use collectives::tune_file::{self, TunedEntry};
pub use collectives::ReduceOp;
use collectives::{Accum, AllGatherCall, AllReduceCall, AllReduceComm, AllReduceConfig, Choice};
use comm::{Bootstrap, StreamHandle};
use tch::{Device, Tensor};

use crate::buffer::env_device_timeout_ns;
use crate::checks;
use crate::error::{Error, Result};
use crate::group::{timeout_or_env, CudaDevice, Group};
use crate::stream::current_stream;

/// Which tuning file an [`AllReduce`] loads (Python's `tune_file=`).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub enum TuneFile {
    /// `tune_file=None`: `MOELINK_AR_TUNE_FILE`, else
    /// `~/.cache/moelink/allreduce-<gpu>-<R>gpu.json`
    /// (`collectives::tune_file::default_tune_file`).
    #[default]
    Default,
    /// This file (`~` expanded).
    Path(PathBuf),
    /// `tune_file=False`: none (size thresholds until a table is set).
    Disabled,
}

/// How to make an [`AllReduce`] (`moelink.AllReduce`'s keywords).
#[derive(Clone, Debug)]
pub struct AllReduceOptions {
    /// Largest allreduce tensor / allgather output, bytes.
    pub max_bytes: usize,
    pub oneshot_max_bytes: usize,
    pub twoshot_max_bytes: usize,
    pub allgather_ll_max_bytes: usize,
    /// Bound of every device wait (ns of GPU time); None:
    /// `MOELINK_AR_TIMEOUT_S`, else 30 s.
    pub device_timeout_ns: Option<i64>,
    /// Bound of host waits; None: `MOELINK_TIMEOUT_S`, else 60 s.
    pub timeout: Option<Duration>,
    /// The tuned table to load (default: Python's default file).
    pub tune_file: TuneFile,
}

impl Default for AllReduceOptions {
    /// The Python defaults (`moelink.allreduce.DEFAULT_*`, which are
    /// `collectives::AllReduceConfig`'s).
    fn default() -> Self {
        let c = AllReduceConfig::default();
        Self {
            max_bytes: c.max_bytes,
            oneshot_max_bytes: c.oneshot_max_bytes,
            twoshot_max_bytes: c.twoshot_max_bytes,
            allgather_ll_max_bytes: c.allgather_ll_max_bytes,
            device_timeout_ns: None,
            timeout: None,
            tune_file: TuneFile::Default,
        }
    }
}

/// The optional arguments of [`AllReduce::all_reduce`].
#[derive(Clone, Copy, Debug, Default)]
pub struct AllReduceArgs<'a> {
    /// Where the result goes (default: the tensor itself, in place).
    pub out: Option<&'a Tensor>,
    /// Accumulation type of fp8 sums (default fp32).
    pub accum: Option<Accum>,
    /// Pins an algorithm by name (`oneshot_ll`, `twoshot_ll`, `rsag`, ...).
    pub algorithm: Option<&'a str>,
    /// Launch geometry (the same on every rank); None: the algorithm's.
    pub num_blocks: Option<u32>,
    pub num_threads: Option<u32>,
}

/// The allreduce / allgather communicator of a [`Group`]'s ranks (one GPU per
/// rank, one host, at most 8 ranks). Every rank makes the same calls in the
/// same order with the same sizes.
pub struct AllReduce {
    inner: Option<AllReduceComm>,
    group: Group,
    cuda: CudaDevice,
    last_choice: Option<Choice>,
    gpu_name: String,
    tune_file: Option<PathBuf>,
    tuning_loaded: bool,
}

impl std::fmt::Debug for AllReduce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AllReduce")
            .field("device", &self.cuda.device)
            .field("inner", &self.inner)
            .finish()
    }
}

impl AllReduce {
    /// *Collective.* The group's next object, on CUDA device `device`: the
    /// scratch buffer every peer maps, and its channels.
    pub fn new(group: &Group, device: Device, opts: &AllReduceOptions) -> Result<Self> {
        let device_timeout_ns = match opts.device_timeout_ns {
            Some(ns) => ns,
            None => env_device_timeout_ns("MOELINK_AR_TIMEOUT_S")?,
        };
        let timeout = timeout_or_env(opts.timeout)?;
        let cuda = CudaDevice::bind(device, "moelink.AllReduce")?;
        let config = AllReduceConfig {
            max_bytes: opts.max_bytes,
            oneshot_max_bytes: opts.oneshot_max_bytes,
            twoshot_max_bytes: opts.twoshot_max_bytes,
            allgather_ll_max_bytes: opts.allgather_ll_max_bytes,
            timeout,
            device_timeout_ns,
        };
        let inner = AllReduceComm::new(group.core(), cuda.core, &config)?;
        let mut ar = Self {
            inner: Some(inner),
            group: group.clone(),
            cuda,
            last_choice: None,
            gpu_name: cuda.core.name()?,
            tune_file: None,
            tuning_loaded: false,
        };
        let path = match &opts.tune_file {
            TuneFile::Disabled => None,
            TuneFile::Default => Some(tune_file::default_tune_file(&ar.gpu_name, group.size())),
            TuneFile::Path(p) => Some(expand_user(p)),
        };
        if let Some(path) = path {
            ar.tune_file = Some(path.clone());
            ar.load_tuning(&path)?;
        }
        Ok(ar)
    }

    /// The GPU model (`torch.cuda.get_device_name`), which a tuning file
    /// must name.
    pub fn gpu_name(&self) -> &str {
        &self.gpu_name
    }

    /// The tuning file this communicator looked for (None with
    /// [`TuneFile::Disabled`]).
    pub fn tune_file(&self) -> Option<&Path> {
        self.tune_file.as_deref()
    }

    /// Whether the latest [`load_tuning`](Self::load_tuning) (the
    /// constructor's included) installed a table.
    pub fn tuning_loaded(&self) -> bool {
        self.tuning_loaded
    }

    /// *Collective.* Rank 0 reads `path` (if it exists and was tuned for this
    /// GPU model and world size: else a warning on stderr) and every rank
    /// installs its entries (Python's `load_tuning`). Returns whether a
    /// table was loaded; an entry naming an unknown algorithm is a
    /// `ValueError`, as Python's `set_tuned` raises it.
    pub fn load_tuning(&mut self, path: &Path) -> Result<bool> {
        let world = self.group.size();
        let payload = if self.group.rank() == 0 {
            encode_tuning(&read_tuning(path, &self.gpu_name, world))
        } else {
            Vec::new()
        };
        // Every rank takes rank 0's answer (one exchange on a scope of the
        // group's bootstrap, as Python broadcasts it over the process group).
        let boot = self.group.core().scope("allreduce tuning")?;
        let all = boot.all_gather(&payload)?;
        let answer = decode_tuning(all.first().map_or(&[][..], Vec::as_slice))?;
        self.tuning_loaded = false;
        match answer {
            Tuning::Absent => Ok(false),
            Tuning::Ignored(why) => {
                eprintln!("moelink.AllReduce: ignoring tuning file {why}");
                Ok(false)
            }
            Tuning::Entries(entries) => {
                let table = tune_file::table_from_entries(&entries)?;
                self.get()?.set_table(table);
                self.tuning_loaded = true;
                Ok(true)
            }
        }
    }

    /// The tuned table as Python's `tuned()` lists it: (collective, graph,
    /// registered, log2 bytes, algorithm, blocks, threads), sorted.
    pub fn tuned(&mut self) -> Result<Vec<TunedEntry>> {
        Ok(self
            .get()?
            .table()
            .entries()
            .into_iter()
            .map(|(k, c)| TunedEntry {
                collective: k.collective.name().into(),
                graph: k.graph,
                registered: k.registered,
                log2_bytes: k.log2_bytes,
                algorithm: c.algorithm.name().into(),
                num_blocks: c.num_blocks,
                num_threads: c.num_threads,
            })
            .collect())
    }

    fn get(&mut self) -> Result<&mut AllReduceComm> {
        self.inner
            .as_mut()
            .ok_or_else(|| Error::state("this AllReduce was destroyed"))
    }

    pub fn device(&self) -> Device {
        self.cuda.device
    }

    /// The communicator of crate `collectives` (limits, tuned table,
    /// registration, selection).
    pub fn core(&mut self) -> Result<&mut AllReduceComm> {
        self.get()
    }

    /// (algorithm, blocks, threads) of the latest call.
    pub fn last_choice(&self) -> Option<Choice> {
        self.last_choice
    }

    /// What a launch of collective `c` takes besides its buffers: the
    /// algorithm `algorithm` names (None: the selection's), the current stream
    /// and whether it is capturing a CUDA graph.
    fn launch_on(
        &self,
        algorithm: Option<&str>,
        c: Collective,
    ) -> Result<(Option<Algorithm>, StreamHandle, bool)> {
        let algorithm = algorithm.map(|a| parse_algorithm(a, c)).transpose()?;
        let stream = current_stream(self.cuda.index)?;
        let capturing = stream.is_capturing()?;
        Ok((algorithm, stream, capturing))
    }

    /// Reduces `tensor` over every rank with `op` into `args.out` (default:
    /// `tensor`, in place) on the current stream; returns the result tensor.
    pub fn all_reduce(
        &mut self,
        tensor: &Tensor,
        op: ReduceOp,
        args: &AllReduceArgs<'_>,
    ) -> Result<Tensor> {
        let max_bytes = self.get()?.limits().max_bytes as usize;
        let dtype = checks::all_reduce(tensor, args.out, self.cuda.device, max_bytes)?;
        let out = args.out.unwrap_or(tensor);
        let (algorithm, stream, capturing) =
            self.launch_on(args.algorithm, Collective::AllReduce)?;
        let call = AllReduceCall {
            input: tensor.data_ptr() as u64,
            output: out.data_ptr() as u64,
            count: tensor.numel() as u64,
            dtype,
            op,
            accum: args.accum,
            algorithm,
            num_blocks: args.num_blocks.unwrap_or(0),
            num_threads: args.num_threads.unwrap_or(0),
            capturing,
        };
        self.last_choice = Some(self.get()?.all_reduce(stream, &call)?);
        Ok(out.shallow_clone())
    }

    /// `out` (world size x `inp.numel()` elements, any dtype) = every rank's
    /// `inp` in rank order, on the current stream; `inp` may be this rank's
    /// chunk of `out`.
    pub fn all_gather(
        &mut self,
        out: &Tensor,
        inp: &Tensor,
        algorithm: Option<&str>,
        num_blocks: Option<u32>,
        num_threads: Option<u32>,
    ) -> Result<Tensor> {
        let (world, max_bytes) = {
            let c = self.get()?;
            (c.num_ranks(), c.limits().max_bytes as usize)
        };
        let nbytes = checks::all_gather(out, inp, world, self.cuda.device, max_bytes)?;
        let (algorithm, stream, capturing) = self.launch_on(algorithm, Collective::AllGather)?;
        let call = AllGatherCall {
            input: inp.data_ptr() as u64,
            output: out.data_ptr() as u64,
            nbytes,
            algorithm,
            num_blocks: num_blocks.unwrap_or(0),
            num_threads: num_threads.unwrap_or(0),
            capturing,
        };
        self.last_choice = Some(self.get()?.all_gather(stream, &call)?);
        Ok(out.shallow_clone())
    }

    /// Raises a device wait of this communicator that ran out.
    pub fn check(&mut self) -> Result<()> {
        Ok(self.get()?.check_device()?)
    }

    /// *Collective.* Waits for the device and the other ranks, then frees the
    /// communicator. Idempotent.
    pub fn destroy(&mut self) -> Result<()> {
        let Some(inner) = self.inner.take() else {
            return Ok(());
        };
        self.cuda.core.synchronize()?;
        inner.barrier()?;
        drop(inner);
        Ok(())
    }
}

impl Drop for AllReduce {
    fn drop(&mut self) {
        if self.inner.is_some() {
            let _ = self.cuda.core.synchronize();
        }
    }
}

/// `path` with a leading `~` expanded (Python's `Path.expanduser`).
fn expand_user(path: &Path) -> PathBuf {
    match (path.strip_prefix("~"), std::env::var_os("HOME")) {
        (Ok(rest), Some(home)) => PathBuf::from(home).join(rest),
        _ => path.to_path_buf(),
    }
}

/// What rank 0 found at the tuning file's path.
#[derive(Debug, PartialEq)]
enum Tuning {
    /// No such file: nothing loaded, silently.
    Absent,
    /// A file that does not apply (`path: why`): ignored with a warning.
    Ignored(String),
    Entries(Vec<TunedEntry>),
}

/// Rank 0's half of `load_tuning`: the file at `path`, if any, for a job of
/// `world` x `gpu`.
fn read_tuning(path: &Path, gpu: &str, world: usize) -> Tuning {
    if !path.is_file() {
        return Tuning::Absent;
    }
    let text = match std::fs::read_to_string(path) {
        Ok(t) => t,
        Err(e) => return Tuning::Ignored(format!("{}: {e}", path.display())),
    };
    match tune_file::parse_tune_file(&text, gpu, world) {
        Ok(entries) => Tuning::Entries(entries),
        Err(e) => Tuning::Ignored(format!("{}: {e}", path.display())),
    }
}

/// [`Tuning`] as bytes for the exchange: a tag byte, then text (the reason,
/// or one entry per line, fields separated by spaces; names have none).
fn encode_tuning(t: &Tuning) -> Vec<u8> {
    let (tag, body) = match t {
        Tuning::Absent => (b'0', String::new()),
        Tuning::Ignored(why) => (b'1', why.clone()),
        Tuning::Entries(entries) => (
            b'2',
            entries
                .iter()
                .map(|e| {
                    format!(
                        "{} {} {} {} {} {} {}\n",
                        e.collective,
                        u8::from(e.graph),
                        u8::from(e.registered),
                        e.log2_bytes,
                        e.algorithm,
                        e.num_blocks,
                        e.num_threads
                    )
                })
                .collect(),
        ),
    };
    let mut out = vec![tag];
    out.extend_from_slice(body.as_bytes());
    out
}

fn decode_tuning(bytes: &[u8]) -> Result<Tuning> {
    let bad = || Error::state("the tuning exchange carried a malformed message");
    let (&tag, body) = bytes.split_first().ok_or_else(bad)?;
    let body = std::str::from_utf8(body).map_err(|_| bad())?;
    Ok(match tag {
        b'0' => Tuning::Absent,
        b'1' => Tuning::Ignored(body.to_string()),
        b'2' => Tuning::Entries(
            body.lines()
                .map(|line| {
                    let f: Vec<&str> = line.split(' ').collect();
                    let [c, g, r, l, a, b, t] = f.as_slice() else {
                        return Err(bad());
                    };
                    let num = |s: &str| s.parse::<u32>().map_err(|_| bad());
                    Ok(TunedEntry {
                        collective: c.to_string(),
                        graph: *g == "1",
                        registered: *r == "1",
                        log2_bytes: num(l)?,
                        algorithm: a.to_string(),
                        num_blocks: num(b)?,
                        num_threads: num(t)?,
                    })
                })
                .collect::<Result<_>>()?,
        ),
        _ => return Err(bad()),
    })
}

/// Rank 0's reading of a tuning file and the exchange's encoding, without a
/// GPU (the CPU tests call it): `Ok(None)` for no file, `Err(why)` for a
/// file that would be ignored with a warning, else the entries after the
/// round trip every rank gets.
pub fn read_tune_file(
    path: &Path,
    gpu: &str,
    world_size: usize,
) -> Result<std::result::Result<Option<Vec<TunedEntry>>, String>> {
    Ok(
        match decode_tuning(&encode_tuning(&read_tuning(path, gpu, world_size)))? {
            Tuning::Absent => Ok(None),
            Tuning::Ignored(why) => Err(why),
            Tuning::Entries(e) => Ok(Some(e)),
        },
    )
}
