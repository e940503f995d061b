//! [`EventOverlap`]: what an intranode or low-latency call returns as its
//! `event` (`moelink.EventOverlap` / DeepEP's `EventOverlap`): a CUDA event
//! recorded where the call's work ends (on the Buffer's communication stream
//! with `async_finish`), plus the tensors the call used, kept alive until it
//! is dropped. An empty one (no event: a call without `async_finish`) waits
//! for nothing. [`StreamArgs`]: a call's `previous_event`, `async_finish` and
//! `allocate_on_comm_stream`.

use comm::cuda::Event;
use comm::{Device as CoreDevice, StreamHandle};
use tch::{Device, Tensor};

use crate::error::Result;
use crate::stream::{current_stream, record_stream};

/// A CUDA event (or none) and the tensors that must stay alive until it
/// completes. `current_stream_wait()` makes torch's current stream (of the
/// event's device) wait for it: Python's `event.current_stream_wait()` and
/// `with event:` (Rust has no implicit wait on drop).
pub struct EventOverlap {
    event: Option<Event>,
    extra_tensors: Vec<Tensor>,
}

impl std::fmt::Debug for EventOverlap {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EventOverlap")
            .field("device", &self.device())
            .field("extra_tensors", &self.extra_tensors.len())
            .finish()
    }
}

impl Default for EventOverlap {
    fn default() -> Self {
        Self::none()
    }
}

impl EventOverlap {
    /// `EventOverlap(None)`: what a call without `async_finish` returns;
    /// as a `previous_event` it orders the call after the current stream.
    pub fn none() -> Self {
        Self {
            event: None,
            extra_tensors: Vec::new(),
        }
    }

    /// An event recorded now on torch's current stream of CUDA device
    /// `device` (`Buffer.capture()`): pass it as a call's `previous_event`.
    pub fn capture(device: Device) -> Result<Self> {
        let Device::Cuda(index) = device else {
            return Err(crate::Error::state(format!(
                "an event needs a CUDA device, got {device:?}"
            )));
        };
        let dev = index as i32;
        let core = CoreDevice::get(dev)?;
        Self::recorded(core, current_stream(dev)?, Vec::new())
    }

    /// A new event recorded on `stream` of `device`, keeping `tensors`.
    pub(crate) fn recorded(
        device: CoreDevice,
        stream: StreamHandle,
        tensors: Vec<Tensor>,
    ) -> Result<Self> {
        let event = Event::new(device)?;
        event.record(stream)?;
        Ok(Self {
            event: Some(event),
            extra_tensors: tensors,
        })
    }

    /// An event recorded on `stream` of `device` (CUDA index `index`) after
    /// `tensors` were marked used there (their memory is not handed out again
    /// before the stream's work so far is done), keeping them: the end of an
    /// `async_finish` call (Python's `finish_async`).
    pub(crate) fn keeping<'t>(
        device: CoreDevice,
        stream: StreamHandle,
        index: i32,
        tensors: impl Iterator<Item = &'t Tensor>,
    ) -> Result<Self> {
        let kept: Vec<Tensor> = tensors.map(Tensor::shallow_clone).collect();
        for t in &kept {
            record_stream(t, stream, index)?;
        }
        Self::recorded(device, stream, kept)
    }

    /// The event, where there is one.
    pub fn event(&self) -> Option<&Event> {
        self.event.as_ref()
    }

    /// Whether this holds an event (false for [`EventOverlap::none`]).
    pub fn has_event(&self) -> bool {
        self.event.is_some()
    }

    /// The CUDA device of the event.
    pub fn device(&self) -> Option<Device> {
        self.event
            .as_ref()
            .map(|e| Device::Cuda(e.device().ordinal as usize))
    }

    /// The tensors kept alive until this is dropped (the call's inputs and
    /// outputs with `async_finish`).
    pub fn extra_tensors(&self) -> &[Tensor] {
        &self.extra_tensors
    }

    /// torch's current stream on the event's device waits for the event
    /// (nothing without one).
    pub fn current_stream_wait(&self) -> Result<()> {
        if let Some(e) = &self.event {
            e.wait(current_stream(e.device().ordinal)?)?;
        }
        Ok(())
    }

    /// `stream` waits for the event (nothing without one).
    pub fn stream_wait(&self, stream: StreamHandle) -> Result<()> {
        if let Some(e) = &self.event {
            e.wait(stream)?;
        }
        Ok(())
    }

    /// Whether the event's work has completed (true without an event).
    pub fn query(&self) -> Result<bool> {
        match &self.event {
            Some(e) => Ok(e.query()?),
            None => Ok(true),
        }
    }

    /// Waits on the host for the event's work.
    pub fn synchronize(&self) -> Result<()> {
        if let Some(e) = &self.event {
            e.synchronize()?;
        }
        Ok(())
    }
}

/// The stream arguments of an intranode call (layout, dispatch, cached
/// dispatch, combine), with Python's defaults (`Default`):
///
/// - `previous_event`: the communication stream waits for this event
///   instead of for torch's current stream (an [`EventOverlap::none`] falls
///   back to the current stream, as `EventOverlap(None)` does in Python).
/// - `async_finish`: the current stream does not wait for the call; the
///   returned event marks its end, and the call's tensors are marked used on
///   the communication stream (`record_stream`) and kept by the event.
/// - `allocate_on_comm_stream`: outputs are allocated while the
///   communication stream is torch's current stream, then marked used on the
///   caller's stream; needs `previous_event` and `async_finish` (a
///   `ValueError` otherwise).
#[derive(Clone, Copy, Debug, Default)]
pub struct StreamArgs<'a> {
    pub previous_event: Option<&'a EventOverlap>,
    pub async_finish: bool,
    pub allocate_on_comm_stream: bool,
}

/// A call's `previous_event` as ep-core's engine waits for it: an
/// [`EventOverlap::none`] holds nothing, so the engine orders the call after
/// the current stream.
impl ep_core::engine::PreviousEvent for EventOverlap {
    fn wait_on(&self, stream: StreamHandle) -> comm::Result<bool> {
        match &self.event {
            Some(e) => e.wait(stream).map(|()| true),
            None => Ok(false),
        }
    }
}

impl<'a> StreamArgs<'a> {
    /// The same arguments as ep-core's engine takes them.
    pub(crate) fn engine(&self) -> ep_core::engine::StreamArgs<'a> {
        ep_core::engine::StreamArgs {
            previous_event: self
                .previous_event
                .map(|e| e as &dyn ep_core::engine::PreviousEvent),
            async_finish: self.async_finish,
            allocate_on_comm_stream: self.allocate_on_comm_stream,
        }
    }

    /// `async_finish=True` after `previous_event` (when given).
    pub fn asynchronous(previous_event: Option<&'a EventOverlap>) -> Self {
        Self {
            previous_event,
            async_finish: true,
            allocate_on_comm_stream: false,
        }
    }
}
