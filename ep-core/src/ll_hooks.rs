//! The receive hooks of one Buffer's low-latency calls, as every front end
//! keeps them (ep-python's `LlCalls`, moelink-tch's `Buffer`): which hooks
//! are pending, oldest first, the call count that names them, and the rules
//! of when a call or a hook may run.
//!
//! - Two calls may be in flight: the send of a call with a hook while the
//!   previous call's hook is pending (SGLang's two-batch overlap; the buffer
//!   has two halves). A third, or a call without a hook (its receive would
//!   run at once, before the pending one's), is refused while one is pending.
//! - Hooks run in call order: the kernels number a call's receive from a
//!   device counter advanced by each receive (docs/design-low-latency.md).
//! - A hook runs once.

/// Low-latency calls in flight at once.
pub const MAX_IN_FLIGHT: usize = 2;

/// Why a call or a hook may not run now.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum HookError {
    /// The arguments cannot go together (Python: `ValueError`).
    Arg(String),
    /// A pending hook forbids it, or the hook already ran (Python:
    /// `RuntimeError`).
    State(String),
}

impl std::fmt::Display for HookError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            HookError::Arg(m) | HookError::State(m) => f.write_str(m),
        }
    }
}

impl std::error::Error for HookError {}

/// A hook of the book: its id (the call's number) and name.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hook {
    pub id: u64,
    pub name: String,
}

/// The pending hooks of one Buffer, oldest first, and its call count.
#[derive(Debug, Default)]
pub struct HookBook {
    pending: Vec<Hook>,
    calls: u64,
}

impl HookBook {
    pub fn new() -> Self {
        Self::default()
    }

    /// The hooks not yet run, oldest first.
    pub fn pending(&self) -> &[Hook] {
        &self.pending
    }

    fn names(hooks: &[Hook]) -> String {
        hooks
            .iter()
            .map(|h| h.name.as_str())
            .collect::<Vec<_>>()
            .join(" and ")
    }

    /// Checks that a low-latency call may start now (module docs).
    pub fn begin(&self, async_finish: bool, return_recv_hook: bool) -> Result<(), HookError> {
        if async_finish && return_recv_hook {
            return Err(HookError::Arg(
                "async_finish and return_recv_hook cannot both be True".into(),
            ));
        }
        if self.pending.len() >= MAX_IN_FLIGHT {
            return Err(HookError::State(format!(
                "the receive hooks of {} have not run: at most {MAX_IN_FLIGHT} low-latency calls \
                 may be in flight (the buffer has two halves); call the hook of {} before the \
                 next low-latency call",
                Self::names(&self.pending),
                self.pending[0].name,
            )));
        }
        if let Some(first) = self.pending.first() {
            if !return_recv_hook {
                return Err(HookError::State(format!(
                    "the receive hook of {} has not run: a low-latency call without \
                     return_recv_hook=True cannot overlap it (its receive would run before the \
                     pending one's); call the hook first, or pass return_recv_hook=True",
                    first.name,
                )));
            }
        }
        Ok(())
    }

    /// Counts a `kind` call ("dispatch", "combine") just launched; with
    /// `with_hook`, its hook, pending until [`Self::ran`].
    pub fn launched(&mut self, kind: &str, with_hook: bool) -> Option<Hook> {
        self.calls += 1;
        let hook = with_hook.then(|| Hook {
            id: self.calls,
            name: format!("low-latency {kind} call #{}", self.calls),
        });
        if let Some(h) = &hook {
            self.pending.push(h.clone());
        }
        hook
    }

    /// Checks that `hook` may run now: pending, and the oldest.
    pub fn may_run(&self, hook: &Hook) -> Result<(), HookError> {
        match self.pending.iter().position(|h| h.id == hook.id) {
            None => Err(HookError::State(format!(
                "the low-latency receive hook of {} was already called",
                hook.name
            ))),
            Some(0) => Ok(()),
            Some(_) => Err(HookError::State(format!(
                "low-latency receive hooks run in call order: the hook of {} is pending; call it \
                 before the hook of {}",
                self.pending[0].name, hook.name
            ))),
        }
    }

    /// `hook` ran (its receive half was launched).
    pub fn ran(&mut self, hook: &Hook) {
        self.pending.retain(|h| h.id != hook.id);
    }

    /// Error where a hook is pending (a clean of the buffer waits for none).
    pub fn none_pending(&self) -> Result<(), HookError> {
        if self.pending.is_empty() {
            Ok(())
        } else {
            Err(HookError::State(format!(
                "the low-latency receive hook of {} is pending: call it first",
                Self::names(&self.pending)
            )))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn two_calls_in_flight_and_hooks_in_call_order() {
        let mut b = HookBook::new();
        b.begin(false, true).unwrap();
        let a = b.launched("dispatch", true).unwrap();
        b.begin(false, true).unwrap();
        let c = b.launched("combine", true).unwrap();
        assert_eq!(c.name, "low-latency combine call #2");
        let third = b.begin(false, true).unwrap_err();
        assert!(
            matches!(&third, HookError::State(m) if m.contains("#1 and low-latency combine call #2"))
        );
        let hookless = HookBook::default();
        assert!(hookless.begin(false, false).is_ok());
        let out_of_order = b.may_run(&c).unwrap_err();
        assert!(out_of_order.to_string().contains("run in call order"));
        b.may_run(&a).unwrap();
        b.ran(&a);
        assert!(b
            .may_run(&a)
            .unwrap_err()
            .to_string()
            .contains("already called"));
        let no_hook = b.begin(false, false).unwrap_err();
        assert!(no_hook.to_string().contains("cannot overlap it"));
        assert!(b.none_pending().is_err());
        b.ran(&c);
        assert_eq!(b.pending(), &[]);
        assert!(b.none_pending().is_ok());
        assert!(b.launched("dispatch", false).is_none());
        assert_eq!(b.launched("dispatch", true).unwrap().id, 4);
    }

    #[test]
    fn async_finish_and_a_hook_are_exclusive() {
        let b = HookBook::new();
        assert!(matches!(b.begin(true, true), Err(HookError::Arg(_))));
        assert!(b.begin(true, false).is_ok());
    }
}
