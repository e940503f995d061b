//! [`AllReduce`]: `moelink.AllReduce` on tch tensors: allreduce and
//! allgather among the GPUs of one host, with the communicator of crate
//! `collectives`, on torch's current stream.

use std::time::Duration;

use collectives::algorithm::Collective;
use collectives::select::parse_algorithm;
pub use collectives::ReduceOp;
use collectives::{Accum, AllGatherCall, AllReduceCall, AllReduceComm, AllReduceConfig, Choice};
use comm::Device as CoreDevice;
use tch::{Device, Tensor};

use crate::buffer::env_device_timeout_ns;
use crate::checks;
use crate::error::{Error, Result};
use crate::group::{env_timeout, Group};
use crate::stream::current_stream;

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
    device: Device,
    dev: i32,
    core_device: CoreDevice,
    last_choice: Option<Choice>,
}

impl std::fmt::Debug for AllReduce {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AllReduce")
            .field("device", &self.device)
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
        let timeout = match opts.timeout {
            Some(t) => t,
            None => env_timeout()?,
        };
        let Device::Cuda(index) = device else {
            return Err(Error::state(format!(
                "moelink.AllReduce needs a CUDA device, got {device:?}"
            )));
        };
        let dev = index as i32;
        let core_device = CoreDevice::bind(dev)?;
        let config = AllReduceConfig {
            max_bytes: opts.max_bytes,
            oneshot_max_bytes: opts.oneshot_max_bytes,
            twoshot_max_bytes: opts.twoshot_max_bytes,
            allgather_ll_max_bytes: opts.allgather_ll_max_bytes,
            timeout,
            device_timeout_ns,
        };
        let inner = AllReduceComm::new(group.core(), core_device, &config)?;
        Ok(Self {
            inner: Some(inner),
            device,
            dev,
            core_device,
            last_choice: None,
        })
    }

    fn get(&mut self) -> Result<&mut AllReduceComm> {
        self.inner
            .as_mut()
            .ok_or_else(|| Error::state("this AllReduce was destroyed"))
    }

    pub fn device(&self) -> Device {
        self.device
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

    /// Reduces `tensor` over every rank with `op` into `args.out` (default:
    /// `tensor`, in place) on the current stream; returns the result tensor.
    pub fn all_reduce(
        &mut self,
        tensor: &Tensor,
        op: ReduceOp,
        args: &AllReduceArgs<'_>,
    ) -> Result<Tensor> {
        let max_bytes = self.get()?.limits().max_bytes as usize;
        let dtype = checks::all_reduce(tensor, args.out, self.device, max_bytes)?;
        let out = args.out.unwrap_or(tensor);
        let algorithm = args
            .algorithm
            .map(|a| parse_algorithm(a, Collective::AllReduce))
            .transpose()?;
        let stream = current_stream(self.dev)?;
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
            capturing: false,
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
        let nbytes = checks::all_gather(out, inp, world, self.device, max_bytes)?;
        let algorithm = algorithm
            .map(|a| parse_algorithm(a, Collective::AllGather))
            .transpose()?;
        let stream = current_stream(self.dev)?;
        let call = AllGatherCall {
            input: inp.data_ptr() as u64,
            output: out.data_ptr() as u64,
            nbytes,
            algorithm,
            num_blocks: num_blocks.unwrap_or(0),
            num_threads: num_threads.unwrap_or(0),
            capturing: false,
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
        self.core_device.synchronize()?;
        inner.barrier()?;
        drop(inner);
        Ok(())
    }
}

impl Drop for AllReduce {
    fn drop(&mut self) {
        if self.inner.is_some() {
            let _ = self.core_device.synchronize();
        }
    }
}
