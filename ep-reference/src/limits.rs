//! The limits of the EP API as the CPU reference applies them: the numbers
//! (defined once, in [`ep_kernels::limits`], and re-exported here) and the
//! checks that apply them.
//!
//! Every function of the reference checks its arguments with the functions
//! below before it allocates anything, so no argument panics or aborts and
//! the error names the argument it rejects. The GPU path checks the same
//! numbers in `ep_core::calls`.
//!
//! Allocations whose size a caller chooses (padding rows, receive buffers)
//! go through [`zeroed`], which fails with an error naming the argument
//! instead of aborting the process, after [`check_budget`] has held the
//! reference's outputs to [`reference_max_bytes`].

pub use ep_kernels::limits::*;

use comm::error::{CommError, Result};

/// Bytes the outputs of one CPU reference call may take:
/// `$MOELINK_REFERENCE_MAX_BYTES` when it is a number, else
/// [`DEFAULT_REFERENCE_MAX_BYTES`]. The reference is a test oracle; a call
/// whose outputs would be larger is refused instead of exhausting memory.
pub fn reference_max_bytes() -> usize {
    comm::env::var(REFERENCE_MAX_BYTES_ENV)
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or(DEFAULT_REFERENCE_MAX_BYTES)
}

/// `value` within `lo..=hi`, or `InvalidArgument` naming `name`; `what`
/// describes the value ("tokens per rank").
pub fn check_range(
    name: &'static str,
    value: usize,
    lo: usize,
    hi: usize,
    what: &str,
) -> Result<usize> {
    if value < lo || value > hi {
        return Err(CommError::invalid(
            name,
            format!("{value} {what}: must be in {lo}..={hi}"),
        ));
    }
    Ok(value)
}

/// `1..=MAX_RANKS` ranks.
pub fn check_ranks(name: &'static str, num_ranks: usize) -> Result<usize> {
    check_range(name, num_ranks, 1, MAX_RANKS, "ranks")
}

/// `1..=MAX_TOPK` columns of `topk_idx`.
pub fn check_topk(name: &'static str, num_topk: usize) -> Result<usize> {
    check_range(name, num_topk, 1, MAX_TOPK, "top-k columns")
}

/// Experts per rank: `num_experts` a positive multiple of `num_ranks`
/// (already checked), at most [`MAX_EXPERTS_PER_RANK`] per rank.
pub fn experts_per_rank(num_experts: usize, num_ranks: usize) -> Result<usize> {
    if num_experts == 0 || num_ranks == 0 || num_experts % num_ranks != 0 {
        return Err(CommError::invalid(
            "num_experts",
            format!("{num_experts} experts is not a positive multiple of {num_ranks} ranks"),
        ));
    }
    let per_rank = num_experts / num_ranks;
    if per_rank > MAX_EXPERTS_PER_RANK {
        let over = if num_ranks == 1 {
            String::new()
        } else {
            format!(" over {num_ranks} ranks is {per_rank}")
        };
        return Err(CommError::invalid(
            "num_experts",
            format!("{num_experts} experts{over} per rank; at most {MAX_EXPERTS_PER_RANK}"),
        ));
    }
    Ok(per_rank)
}

/// `value` (of `what`, e.g. "bytes per row") a positive multiple of `unit`,
/// at most `max`.
pub fn check_multiple(
    name: &'static str,
    value: usize,
    unit: usize,
    max: usize,
    what: &str,
) -> Result<usize> {
    if value == 0 || value % unit != 0 || value > max {
        return Err(CommError::invalid(
            name,
            format!("{value} {what}: must be a positive multiple of {unit}, at most {max}"),
        ));
    }
    Ok(value)
}

/// An intranode row of `bytes`: a positive multiple of
/// [`ROW_BYTES_ALIGNMENT`], at most [`MAX_HIDDEN_BYTES`].
pub fn check_row_bytes(name: &'static str, bytes: usize) -> Result<usize> {
    check_multiple(
        name,
        bytes,
        ROW_BYTES_ALIGNMENT,
        MAX_HIDDEN_BYTES,
        "bytes per row",
    )
}

/// A low-latency `hidden`: a positive multiple of [`FP8_GROUP_SIZE`], at most
/// [`LL_MAX_HIDDEN`].
pub fn check_ll_hidden(name: &'static str, hidden: usize) -> Result<usize> {
    check_multiple(name, hidden, FP8_GROUP_SIZE, LL_MAX_HIDDEN, "channels")
}

/// `a * b`, or `InvalidArgument` naming `name` when it overflows.
pub fn mul(name: &'static str, a: usize, b: usize) -> Result<usize> {
    a.checked_mul(b)
        .ok_or_else(|| CommError::invalid(name, format!("{a} x {b} overflows")))
}

/// Holds `bytes` of reference outputs, sized by `name`, to
/// [`reference_max_bytes`].
pub fn check_budget(name: &'static str, bytes: usize) -> Result<()> {
    let max = reference_max_bytes();
    if bytes > max {
        return Err(CommError::invalid(
            name,
            format!(
                "the outputs would take {bytes} bytes, more than the CPU reference's \
                 {max} (${REFERENCE_MAX_BYTES_ENV})"
            ),
        ));
    }
    Ok(())
}

/// A vector of `len` copies of `value`, allocated fallibly: an allocation
/// that fails is an `InvalidArgument` naming `name` (the argument that chose
/// the size), not an abort.
pub fn zeroed<T: Clone>(name: &'static str, len: usize, value: T) -> Result<Vec<T>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| {
        CommError::invalid(
            name,
            format!(
                "cannot allocate {len} elements of {} bytes",
                std::mem::size_of::<T>()
            ),
        )
    })?;
    v.resize(len, value);
    Ok(v)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn checks_name_the_argument() {
        let e = check_ranks("inputs", 33).unwrap_err().to_string();
        assert!(e.contains("inputs") && e.contains("1..=32"), "{e}");
        assert!(check_ranks("inputs", 0).is_err());
        assert!(experts_per_rank(2048, 1).is_err());
        assert!(experts_per_rank(2048, 2).is_ok());
        assert!(check_row_bytes("hidden_bytes", 100).is_err());
        assert!(check_row_bytes("hidden_bytes", MAX_HIDDEN_BYTES + 128).is_err());
        assert!(check_ll_hidden("hidden", 16384).is_err());
        assert!(mul("x", usize::MAX, 2).is_err());
    }

    #[test]
    fn a_failed_allocation_is_an_error() {
        let e = zeroed("num_worst_tokens", usize::MAX / 2, 0u64).unwrap_err();
        assert!(e.to_string().contains("num_worst_tokens"), "{e}");
        assert_eq!(zeroed("n", 3, 7u8).unwrap(), vec![7, 7, 7]);
    }
}
