//! [`AllReduceComm`]: a communicator for allreduce / allgather among the
//! ranks of one host, and the launch of every algorithm.
//!
//! Per rank it holds its group's shared comm
//! [`Communicator`](comm::Communicator) (through a [`Member`]: with its own
//! scope, device error record and device-wait bound), one registered scratch buffer
//! mapped by every peer ([`ScratchLayout`]: two halves of LL packet space,
//! then a data region and a result region of `max_bytes` each), a device table of memory channels
//! (one per (block, peer), for the per-block barriers), a device word pair
//! (LL call counter, last-block ticket), the zero-copy registrations and the
//! tuned table. Calls launch one kernel on the caller's stream and return
//! without waiting; every rank must make the same calls in the same order
//! (same sizes, dtypes, algorithm choices), like NCCL.

use std::time::Duration;

use comm::channel::MemoryChannel;
use comm::error::check_device_timeout_ns;
use comm::registered_memory::RegisteredMemory;
use comm::{
    CommError, CommunicatorOptions, Device, DeviceMemory, Group, Member, Result, StreamHandle,
    SymmetricRegion,
};

use crate::algorithm::{Algorithm, Collective, Limits, Request};
use crate::args::{flags, CollArgs, MAX_BLOCKS, MAX_BYTES, MAX_RANKS};
use crate::dtype::{variant, Accum, DType, ReduceOp};
use crate::module::{CollKernels, Kernel};
use crate::registration::{Registration, Registry};
use crate::select::{resolve, Choice, TableKey, TunedTable};

/// Bound of every device wait by default: 30 s of GPU time (below the 60 s
/// host-side `timeout`, so a hang is reported by the device, naming rank and peer).
pub const DEFAULT_DEVICE_TIMEOUT_NS: i64 = comm::error::DEFAULT_DEVICE_TIMEOUT_NS;

/// Sizes of a communicator.
#[derive(Clone, Debug, PartialEq)]
pub struct AllReduceConfig {
    /// Largest allreduce message / allgather output, bytes (the data region).
    pub max_bytes: usize,
    /// Largest one-shot LL message (capped at max_bytes).
    pub oneshot_max_bytes: usize,
    /// Largest two-shot LL message (capped at max_bytes).
    pub twoshot_max_bytes: usize,
    /// Largest per-rank ag_ll input (capped at max_bytes).
    pub allgather_ll_max_bytes: usize,
    /// Bound of every host-side wait (registration; the group's
    /// Communicator's waits when this is the group's first object).
    pub timeout: Duration,
    /// Bound of every device-side wait, nanoseconds of GPU time (positive).
    pub device_timeout_ns: i64,
}

impl Default for AllReduceConfig {
    fn default() -> Self {
        Self {
            max_bytes: 64 << 20,
            oneshot_max_bytes: 512 << 10,
            twoshot_max_bytes: 8 << 20,
            allgather_ll_max_bytes: 512 << 10,
            timeout: Duration::from_secs(60),
            device_timeout_ns: DEFAULT_DEVICE_TIMEOUT_NS,
        }
    }
}

/// Where things live in every rank's scratch buffer (the same on all ranks).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ScratchLayout {
    /// LL packets: two halves of `ll_half_bytes`, used alternately by call parity.
    pub ll_offset: u64,
    pub ll_half_bytes: u64,
    /// Data region (rsag / ag_mesh copy-in, rsag results, rsag_push slots),
    /// `data_bytes` long (at least R x the 16-rounded slice of `max_bytes`).
    pub data_offset: u64,
    pub data_bytes: u64,
    /// Result region, as long as the data region: the rsag family's results
    /// where the output is not registered, which copy-out reads after the
    /// call's last barrier. Apart from the data region, because a rank's next
    /// call stores into data regions before its first barrier (rsag_push into
    /// the peers', rsag / ag_mesh copy-in into its own), i.e. while a peer may
    /// still copy out.
    pub result_offset: u64,
    pub result_bytes: u64,
    pub total: u64,
}

impl ScratchLayout {
    /// Sized so every LL algorithm fits at its limit: one-shot and ag_ll keep
    /// R slots of 2 x pad8(message) (LL16: 16 bytes per 8 data bytes), two-shot
    /// two regions of R slots of 2 x pad8(message / R).
    pub fn new(limits: &Limits) -> Self {
        let r = limits.world_size.max(1) as u64;
        let pad8 = |x: u64| x.div_ceil(8) * 8;
        let oneshot = r * 2 * pad8(limits.oneshot_max_bytes);
        let twoshot = 2 * r * 2 * pad8(limits.twoshot_max_bytes.div_ceil(r));
        let allgather = r * 2 * pad8(limits.allgather_ll_max_bytes);
        let half = oneshot.max(twoshot).max(allgather).max(256).div_ceil(256) * 256;
        // rsag_push keeps R slots of the 16-rounded slice: up to 16 R bytes more.
        let data_bytes = (limits.max_bytes.max(256) + 16 * r).div_ceil(256) * 256;
        let result_bytes = data_bytes;
        Self {
            ll_offset: 0,
            ll_half_bytes: half,
            data_offset: 2 * half,
            data_bytes,
            result_offset: 2 * half + data_bytes,
            result_bytes,
            total: 2 * half + data_bytes + result_bytes,
        }
    }
}

/// One allreduce call (device addresses; the Python layer checked the tensors).
#[derive(Clone, Copy, Debug)]
pub struct AllReduceCall {
    pub input: u64,
    /// == input: in place.
    pub output: u64,
    pub count: u64,
    pub dtype: DType,
    pub op: ReduceOp,
    pub accum: Option<Accum>,
    pub algorithm: Option<Algorithm>,
    /// 0: the choice's default.
    pub num_blocks: u32,
    pub num_threads: u32,
    pub capturing: bool,
}

/// One allgather call: `output` holds R x `nbytes`; `input` is `nbytes` long,
/// disjoint from `output` or exactly its chunk `rank` (in place).
#[derive(Clone, Copy, Debug)]
pub struct AllGatherCall {
    pub input: u64,
    pub output: u64,
    pub nbytes: u64,
    pub algorithm: Option<Algorithm>,
    pub num_blocks: u32,
    pub num_threads: u32,
    pub capturing: bool,
}

/// What selecting and starting a call takes of it, whichever its collective.
trait Call {
    /// (pinned algorithm, blocks, threads, capturing).
    fn pinned(&self) -> (Option<Algorithm>, u32, u32, bool);
    /// (input, output).
    fn tensors(&self) -> (u64, u64);
}

/// `Call` of the call structs (the same fields in each).
macro_rules! impl_call {
    ($($t:ty),*) => {$(
        impl Call for $t {
            fn pinned(&self) -> (Option<Algorithm>, u32, u32, bool) {
                (self.algorithm, self.num_blocks, self.num_threads, self.capturing)
            }
            fn tensors(&self) -> (u64, u64) {
                (self.input, self.output)
            }
        }
    )*};
}
impl_call!(AllReduceCall, AllGatherCall);

pub struct AllReduceComm {
    /// The group's Communicator, this object's scope (registrations and
    /// barriers), device error record and device-wait bound.
    member: Member,
    device: Device,
    kernels: CollKernels,
    scratch: RegisteredMemory,
    peer_scratch: Vec<RegisteredMemory>,
    _channels: Vec<Vec<Option<MemoryChannel>>>,
    channel_table: DeviceMemory,
    /// [0, 8): LL call counter; [8, 12): last-block ticket.
    state: DeviceMemory,
    layout: ScratchLayout,
    limits: Limits,
    table: TunedTable,
    registry: Registry,
    timeout: Duration,
    test_hooks: TestHooks,
}

/// Test-only changes to the rsag family's kernels, to prove that a test of the
/// buffer-reuse protocol can fail (see [`AllReduceComm::set_test_hooks`]).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct TestHooks {
    /// Every rsag block waits this long before its copy-out phase (0: never).
    pub copy_out_delay_us: i32,
    /// The rsag family keeps its results in the data region, as it did before
    /// the result region existed (unsafe: for tests that show the race).
    pub results_in_data_region: bool,
}

/// Largest `TestHooks::copy_out_delay_us`: one second.
pub const MAX_TEST_DELAY_US: i32 = 1_000_000;

impl std::fmt::Debug for AllReduceComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("AllReduceComm")
            .field("rank", &self.rank())
            .field("num_ranks", &self.num_ranks())
            .field("limits", &self.limits)
            .field("layout", &self.layout)
            .finish()
    }
}

/// Bytes of one rank's slice in the rsag family (`S` in allreduce.cu): n / R
/// rounded up to 16.
fn rsag_slice(n: u64, ranks: u64) -> u64 {
    n.div_ceil(ranks).div_ceil(16) * 16
}

fn overlaps(a: u64, a_len: u64, b: u64, b_len: u64) -> bool {
    a_len > 0 && b_len > 0 && a < b.saturating_add(b_len) && b < a.saturating_add(a_len)
}

impl AllReduceComm {
    /// *Collective.* The group's next object, on `device`: scratch buffer,
    /// its mappings on every peer, a memory channel per (block, peer), on the
    /// group's Communicator (made now if this is the group's first object).
    /// Every rank must be on this host.
    pub fn new(group: &Group, device: Device, config: &AllReduceConfig) -> Result<Self> {
        let size = group.size();
        if size == 0 || size > MAX_RANKS {
            return Err(CommError::invalid(
                "group",
                format!("{size} ranks; the collectives handle 1 to {MAX_RANKS} (one host)"),
            ));
        }
        if config.max_bytes == 0 || config.max_bytes > MAX_BYTES {
            return Err(CommError::invalid(
                "max_bytes",
                format!("{}: must be in 1..={MAX_BYTES}", config.max_bytes),
            ));
        }
        check_device_timeout_ns(config.device_timeout_ns)?;
        let opts = CommunicatorOptions {
            timeout: config.timeout,
            ..CommunicatorOptions::default()
        };
        let mut member = group.join("allreduce", Some(device), &opts)?;
        member.set_device_timeout_ns(config.device_timeout_ns)?;
        let comm = member.comm().clone();
        comm.device_share().require("allreduce", 1)?;
        let kernels = CollKernels::get(device)?;
        // Every block of every rank must be resident together, and the block
        // count must be the same on every rank (block b talks to block b):
        // the smallest share of any rank (the whole GPU unless ranks share one).
        let sms = comm.device_share().group_sms.max(1);
        let max = config.max_bytes as u64;
        let limits = Limits {
            world_size: size,
            max_bytes: max,
            oneshot_max_bytes: (config.oneshot_max_bytes as u64).min(max),
            twoshot_max_bytes: (config.twoshot_max_bytes as u64).min(max),
            allgather_ll_max_bytes: (config.allgather_ll_max_bytes as u64).min(max),
            max_blocks: sms.min(MAX_BLOCKS as u32),
        };
        let layout = ScratchLayout::new(&limits);
        // The LL region starts zeroed (flags start at 1); the data region need not.
        let region =
            SymmetricRegion::new(&comm, layout.total as usize, layout.data_offset as usize)?;
        let scratch = region.local().clone();
        let peer_scratch = region.peers().to_vec();
        for (p, m) in peer_scratch.iter().enumerate() {
            if !m.is_mapped() {
                return Err(CommError::invalid(
                    "group",
                    format!(
                        "rank {p}'s scratch cannot be mapped here: every rank must share this host"
                    ),
                ));
            }
        }
        let rank = comm.rank();
        // One memory channel per (block, peer) over the scratch: block b of
        // every kernel signals and waits on row b (entry (b, rank) zeroed).
        let (channels, channel_table) =
            region.memory_channel_table(&comm, MAX_BLOCKS, member.device_error())?;
        let state = DeviceMemory::alloc(device, 16)?;
        state.fill(0)?;
        // Everybody has mapped everybody before anyone launches.
        member.ready()?;
        tracing::debug!(
            "allreduce communicator: rank {rank} of {size}, scratch {} bytes ({layout:?})",
            layout.total
        );
        Ok(Self {
            member,
            device,
            kernels,
            scratch,
            peer_scratch,
            _channels: channels,
            channel_table,
            state,
            layout,
            limits,
            table: TunedTable::new(),
            registry: Registry::new(),
            timeout: config.timeout,
            test_hooks: TestHooks::default(),
        })
    }

    pub fn rank(&self) -> usize {
        self.member.rank()
    }

    pub fn num_ranks(&self) -> usize {
        self.member.size()
    }

    pub fn device(&self) -> Device {
        self.device
    }

    pub fn limits(&self) -> &Limits {
        &self.limits
    }

    pub fn layout(&self) -> &ScratchLayout {
        &self.layout
    }

    /// Bound of every device wait of this communicator, nanoseconds of GPU
    /// time (positive; other objects of the group keep theirs).
    pub fn set_device_timeout_ns(&mut self, timeout_ns: i64) -> Result<()> {
        self.member.set_device_timeout_ns(timeout_ns)
    }

    pub fn device_timeout_ns(&self) -> i64 {
        self.member.device_timeout_ns()
    }

    /// Tests only: widens the window in which a peer runs ahead into its next
    /// call, or (`results_in_data_region`) brings back the race that the
    /// result region removes.
    /// Every rank need not set the same hooks.
    pub fn set_test_hooks(&mut self, hooks: TestHooks) -> Result<()> {
        if !(0..=MAX_TEST_DELAY_US).contains(&hooks.copy_out_delay_us) {
            return Err(CommError::invalid(
                "copy_out_delay_us",
                format!(
                    "{}: must be in 0..={MAX_TEST_DELAY_US}",
                    hooks.copy_out_delay_us
                ),
            ));
        }
        self.test_hooks = hooks;
        Ok(())
    }

    /// Error of a device wait of this communicator that ran out (rank, peer,
    /// what), if any. After one, its state is inconsistent across ranks:
    /// destroy it.
    pub fn check_device(&self) -> Result<()> {
        self.member.check_device()
    }

    /// *Collective* host barrier, in this object's own scope of the group's
    /// bootstrap.
    pub fn barrier(&self) -> Result<()> {
        self.member.barrier()
    }

    pub fn table(&self) -> &TunedTable {
        &self.table
    }

    /// Replaces the tuned table (every rank must set the same one).
    pub fn set_table(&mut self, table: TunedTable) {
        self.table = table;
    }

    pub fn insert_tuned(&mut self, key: TableKey, choice: Choice) {
        self.table.insert(key, choice);
    }

    /// *Collective.* Registers `[ptr, ptr + len)` for zero-copy algorithms
    /// (its exchanges in this object's own scope).
    pub fn register(&mut self, ptr: u64, len: u64) -> Result<u64> {
        self.registry
            .register(self.member.bootstrap(), self.device, self.timeout, ptr, len)
    }

    /// *Collective.* Drops registration `id` after a barrier (so no peer
    /// still reads it).
    pub fn deregister(&mut self, id: u64) -> Result<()> {
        self.member.barrier()?;
        self.registry.deregister(id)
    }

    /// The registration holding `[ptr, ptr + len)`, if any.
    pub fn registration(&self, ptr: u64, len: u64) -> Option<&Registration> {
        self.registry.find(ptr, len)
    }

    /// The algorithm and geometry an allreduce / allgather of `nbytes`
    /// (allgather: per-rank input) would use.
    /// `algorithm` pins one (checked), `num_blocks` / `num_threads` override
    /// the geometry when non-zero (see [`resolve`]).
    pub fn select(
        &self,
        req: &Request,
        algorithm: Option<Algorithm>,
        num_blocks: u32,
        num_threads: u32,
    ) -> Result<Choice> {
        resolve(
            req,
            &self.limits,
            &self.table,
            algorithm,
            num_blocks,
            num_threads,
        )
    }

    /// The choice for call `c` of `collective` moving `n` bytes (`registered`:
    /// its memory is registered) and, unless the call is empty (nothing to
    /// launch: `None`), the arguments every algorithm starts from, once this
    /// object's kernels recorded no error.
    fn start(
        &self,
        collective: Collective,
        n: u64,
        registered: bool,
        c: &impl Call,
    ) -> Result<(Choice, Option<CollArgs>)> {
        let (algorithm, num_blocks, num_threads, capturing) = c.pinned();
        let req = Request {
            collective,
            nbytes: n,
            registered,
            capturing,
        };
        let choice = self.select(&req, algorithm, num_blocks, num_threads)?;
        if n == 0 {
            return Ok((choice, None));
        }
        self.member.check_device()?;
        let (input, output) = c.tensors();
        Ok((choice, Some(self.base_args(input, output, n))))
    }

    /// `count * size` bytes of tensor `arg`: `InvalidArgument` naming it where
    /// that overflows or exceeds `max_bytes`.
    fn checked_bytes(&self, arg: &'static str, count: u64, size: u64) -> Result<u64> {
        let n = count
            .checked_mul(size)
            .ok_or_else(|| CommError::invalid(arg, "size overflows"))?;
        if n > self.limits.max_bytes {
            return Err(CommError::invalid(
                arg,
                format!(
                    "{n} bytes exceed max_bytes = {} of this communicator",
                    self.limits.max_bytes
                ),
            ));
        }
        Ok(n)
    }

    fn base_args(&self, input: u64, output: u64, nbytes: u64) -> CollArgs {
        let mut a = CollArgs {
            input,
            output,
            scratch: self.scratch.ptr(),
            channels: self.channel_table.ptr(),
            error: self.member.device_error().device_ptr(),
            counter: self.state.ptr(),
            ticket: self.state.ptr() + 8,
            nbytes,
            ll_offset: self.layout.ll_offset,
            ll_half_bytes: self.layout.ll_half_bytes,
            data_offset: self.layout.data_offset,
            result_offset: self.result_offset(),
            timeout_ns: self.member.device_timeout_ns(),
            test_delay_us: self.test_hooks.copy_out_delay_us,
            rank: self.rank() as i32,
            num_ranks: self.num_ranks() as i32,
            ..CollArgs::default()
        };
        for (p, m) in self.peer_scratch.iter().enumerate() {
            a.peer_scratch[p] = m.ptr();
        }
        a
    }

    /// Rank p's data region, mapped here (ours: our own).
    fn peer_data(&self, p: usize) -> u64 {
        self.peer_scratch[p].ptr() + self.layout.data_offset
    }

    fn result_offset(&self) -> u64 {
        if self.test_hooks.results_in_data_region {
            self.layout.data_offset
        } else {
            self.layout.result_offset
        }
    }

    /// Rank p's result region, mapped here (ours: our own).
    fn peer_result(&self, p: usize) -> u64 {
        self.peer_scratch[p].ptr() + self.result_offset()
    }

    /// `own` for this rank, else rank p's data region ([`Self::peer_data`]).
    fn data_or_own(&self, p: usize, own: u64) -> u64 {
        if p == self.rank() {
            own
        } else {
            self.peer_data(p)
        }
    }

    /// `own` for this rank, else rank p's result region ([`Self::peer_result`]).
    fn result_or_own(&self, p: usize, own: u64) -> u64 {
        if p == self.rank() {
            own
        } else {
            self.peer_result(p)
        }
    }

    fn aligned16(a: &CollArgs) -> bool {
        let r = a.num_ranks as usize;
        [a.input, a.output]
            .iter()
            .chain(&a.peer_in[..r])
            .chain(&a.peer_out[..r])
            .all(|p| p % 16 == 0)
    }

    /// Launches an allreduce on `stream`; returns the choice it launched
    /// (nothing is launched for an empty tensor).
    pub fn all_reduce(&mut self, stream: StreamHandle, c: &AllReduceCall) -> Result<Choice> {
        let n = self.checked_bytes("tensor", c.count, c.dtype.size() as u64)?;
        let v = variant(c.dtype, c.op, c.accum)?;
        if n > 0 && (c.input == 0 || c.output == 0) {
            return Err(CommError::invalid("tensor", "null device pointer"));
        }
        if c.output != c.input && overlaps(c.input, n, c.output, n) {
            return Err(CommError::invalid(
                "out",
                "overlaps the input without being the same tensor",
            ));
        }
        let rank = self.rank();
        let r = self.num_ranks();
        let reg_in = self.registry.find(c.input, n);
        let (choice, a) = self.start(Collective::AllReduce, n, reg_in.is_some(), c)?;
        let Some(mut a) = a else {
            return Ok(choice);
        };
        match choice.algorithm {
            Algorithm::OneShotLl | Algorithm::TwoShotLl => {
                if (c.input | c.output) % 8 == 0 {
                    a.flags |= flags::ALIGNED;
                }
            }
            Algorithm::RsAg => {
                for p in 0..r {
                    a.peer_in[p] = self.data_or_own(p, c.input);
                    a.peer_out[p] = self.result_or_own(p, c.output);
                }
                a.flags |= flags::COPY_IN | flags::COPY_OUT;
            }
            Algorithm::RsAgZeroCopy => {
                let reg_in = reg_in.expect("applicable: the input is registered");
                let reg_out = if c.output == c.input {
                    Some(reg_in)
                } else {
                    self.registry.find(c.output, n)
                };
                for p in 0..r {
                    a.peer_in[p] = reg_in.peer_ptr(p, c.input);
                    a.peer_out[p] = match reg_out {
                        Some(ro) => ro.peer_ptr(p, c.output),
                        None => self.result_or_own(p, c.output),
                    };
                }
                if reg_out.is_none() {
                    a.flags |= flags::COPY_OUT;
                }
            }
            Algorithm::RsAgPush => {
                // Rank p stored its part of our slice into slot [p] of our data
                // region; the kernel reads rank p's part at peer_in[p] + (offset
                // of our slice), so slot p sits at data + (p - rank) x S.
                let s = rsag_slice(n, r as u64);
                let own = self.peer_data(rank);
                let reg_out = self.registry.find(c.output, n);
                for p in 0..r {
                    a.peer_in[p] = if p == rank {
                        c.input
                    } else {
                        own.wrapping_add((p as u64).wrapping_sub(rank as u64).wrapping_mul(s))
                    };
                }
                match reg_out {
                    // All-gather by stores into every rank's registered output.
                    Some(ro) => {
                        for p in 0..r {
                            a.peer_out[p] = ro.peer_ptr(p, c.output);
                        }
                    }
                    // Our result goes to our output and into every peer's
                    // result region (an all-gather by stores), from which each
                    // copies it out locally (COPY_OUT). 4 x H200 (2026-11-28,
                    // graphs): 16 MiB 85.3 us against 89.6 when each rank
                    // loaded the owners' results from their result regions;
                    // 1 MiB 14.0 against 14.6; within 2 % either way from
                    // 64 MiB.
                    None => {
                        for p in 0..r {
                            a.peer_out[p] = self.result_or_own(p, c.output);
                        }
                        a.flags |= flags::COPY_OUT;
                    }
                }
                a.flags |= flags::PUSH;
            }
            Algorithm::AgLl | Algorithm::AgMesh => unreachable!("resolve checked the collective"),
        }
        // The rsag family vectorises over 16 bytes when every pointer allows it.
        if choice.algorithm.uses_barriers() && Self::aligned16(&a) {
            a.flags |= flags::ALIGNED;
        }
        let family = choice.algorithm.family().expect("an allreduce algorithm");
        // SAFETY: the input/output ranges were checked by the caller (Python:
        // device, dtype, size, contiguity) and here (size, overlap); scratch,
        // channels and registrations are owned by self and mapped on every rank.
        unsafe {
            self.kernels.launch(
                Kernel::AllReduce(family, v),
                choice.num_blocks,
                choice.num_threads,
                stream,
                &a,
            )
        }?;
        Ok(choice)
    }

    /// Launches an allgather on `stream`; returns the choice it launched.
    pub fn all_gather(&mut self, stream: StreamHandle, c: &AllGatherCall) -> Result<Choice> {
        let r = self.num_ranks();
        let rank = self.rank();
        let n = c.nbytes;
        let total = self.checked_bytes("out", n, r as u64)?;
        if n > 0 && (c.input == 0 || c.output == 0) {
            return Err(CommError::invalid("tensor", "null device pointer"));
        }
        let own_chunk = c.output + rank as u64 * n;
        let in_place = c.input == own_chunk;
        if !in_place && overlaps(c.input, n, c.output, total) {
            return Err(CommError::invalid(
                "inp",
                "overlaps the output without being this rank's chunk of it",
            ));
        }
        // Zero copy: in place, the registered output holds every rank's input
        // (rank p's at chunk p); else the input itself must be registered.
        let (registered, in_place_reg) = if in_place {
            (self.registry.find(c.output, total).is_some(), true)
        } else {
            (self.registry.find(c.input, n).is_some(), false)
        };
        let (choice, a) = self.start(Collective::AllGather, n, registered, c)?;
        let Some(mut a) = a else {
            return Ok(choice);
        };
        let kernel = match choice.algorithm {
            Algorithm::AgLl => {
                if (c.input | c.output | n) % 8 == 0 {
                    a.flags |= flags::ALIGNED;
                }
                Kernel::AllGatherLl
            }
            Algorithm::AgMesh => {
                if registered {
                    for p in 0..r {
                        a.peer_in[p] = if in_place_reg {
                            let reg = self.registry.find(c.output, total).expect("found above");
                            reg.peer_ptr(p, c.output) + p as u64 * n
                        } else {
                            let reg = self.registry.find(c.input, n).expect("found above");
                            reg.peer_ptr(p, c.input)
                        };
                    }
                } else {
                    for p in 0..r {
                        a.peer_in[p] = self.data_or_own(p, c.input);
                    }
                    a.flags |= flags::COPY_IN;
                }
                Kernel::AllGatherMesh
            }
            _ => unreachable!("resolve checked the collective"),
        };
        // SAFETY: as in all_reduce.
        unsafe {
            self.kernels
                .launch(kernel, choice.num_blocks, choice.num_threads, stream, &a)
        }?;
        Ok(choice)
    }
}

impl Drop for AllReduceComm {
    fn drop(&mut self) {
        // Peers' mappings of registered tensors go before the communicator.
        self.registry.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn limits(r: usize, max: u64) -> Limits {
        Limits {
            world_size: r,
            max_bytes: max,
            oneshot_max_bytes: (512 << 10).min(max),
            twoshot_max_bytes: (8 << 20).min(max),
            allgather_ll_max_bytes: (512 << 10).min(max),
            max_blocks: 128,
        }
    }

    /// The LL region holds every LL algorithm at its limit, with the exact
    /// slot arithmetic of the kernels.
    #[test]
    fn scratch_layout_fits_every_ll_algorithm() {
        for r in 1..=8u64 {
            for max in [1u64, 1000, 64 << 10, 1 << 20, 64 << 20, 1 << 30] {
                let l = limits(r as usize, max);
                let s = ScratchLayout::new(&l);
                let oneshot = |n: u64| r * n.div_ceil(8) * 16;
                let twoshot = |n: u64| {
                    let slice = n.div_ceil(r).div_ceil(8) * 8;
                    2 * r * (slice / 8) * 16
                };
                for n in [1, 7, 8, 9, l.oneshot_max_bytes] {
                    if n <= l.oneshot_max_bytes {
                        assert!(oneshot(n) <= s.ll_half_bytes, "r={r} max={max} n={n}");
                    }
                }
                for n in [1, 9, l.twoshot_max_bytes - 1, l.twoshot_max_bytes] {
                    if n >= 1 && n <= l.twoshot_max_bytes {
                        assert!(twoshot(n) <= s.ll_half_bytes, "r={r} max={max} n={n}");
                    }
                }
                assert!(oneshot(l.allgather_ll_max_bytes) <= s.ll_half_bytes);
                assert_eq!(s.data_offset, 2 * s.ll_half_bytes);
                assert!(s.data_bytes >= max && s.data_offset % 256 == 0);
                // rsag_push: R slots of the 16-rounded slice, for every size.
                for n in [1, 15, max.saturating_sub(1).max(1), max] {
                    let slice = rsag_slice(n, r);
                    assert!(r * slice <= s.data_bytes, "r={r} max={max} n={n}");
                    assert!(r * slice <= s.result_bytes, "r={r} max={max} n={n}");
                }
                assert_eq!(s.result_offset, s.data_offset + s.data_bytes);
                assert_eq!(s.result_offset % 256, 0);
                assert_eq!(s.total, s.result_offset + s.result_bytes);
            }
        }
    }

    #[test]
    fn overlap() {
        assert!(overlaps(0, 10, 9, 10));
        assert!(!overlaps(0, 10, 10, 10));
        assert!(!overlaps(0, 0, 0, 10));
        assert!(overlaps(5, 1, 0, 10));
    }
}
