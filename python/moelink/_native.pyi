"""Type stubs of the Rust extension module ``moelink._native``."""

from collections.abc import Sequence
from typing import Any, type_check_only

__version__: str

class CudaError(RuntimeError): ...
class TimeoutError(TimeoutError): ...  # noqa: A001 - the builtin is its base

def device_count() -> int: ...
def live_recv_pools() -> int: ...
def compiled_archs() -> list[str]: ...
def local_sm_counts(device: int) -> tuple[int, int | None]: ...
def device_share_sms(device_sms: int, context_sms: int | None, ranks_on_device: int) -> int: ...
def pattern_word(seed: int, src: int, dst: int, i: int) -> int: ...
def limits() -> list[tuple[str, int, str]]: ...
def env_switches() -> list[tuple[str, str, str, str]]: ...
def torch_alloc_init(libtorch_cpu: str, steal: Any, borrow: Any = None) -> None: ...
def torch_alloc_ready() -> bool: ...
def tensor_args(
    objs: list[Any],
) -> list[tuple[str, list[int], list[int], int, int] | None] | None: ...

class TorchOutputs:
    def __init__(
        self, specs: Sequence[tuple[Sequence[int], Sequence[int], str, bool] | None]
    ) -> None: ...
    def empty(self, device: int) -> tuple[Any, ...] | None: ...

class NormalCalls:
    def layout(self, topk_idx: Any, num_experts: Any) -> tuple[Any, ...] | None: ...
    def __init__(
        self,
        ep: Any,
        num_ranks: int,
        device: int,
        comm: int,
        order: StreamOrder,
        stream_of: Any,
        event: Any,
    ) -> None: ...
    def combine(
        self, x: Any, handle: Any, topk_weights: Any, bias: Any, num_sms: int
    ) -> tuple[Any, ...] | None: ...
    def dispatch(
        self,
        x: Any,
        handle: Any,
        num_tokens_per_rank: Any,
        num_tokens_per_rdma_rank: Any,
        is_token_in_rank: Any,
        num_tokens_per_expert: Any,
        topk_idx: Any,
        topk_weights: Any,
        expert_alignment: Any,
        num_worst_tokens: Any,
        num_sms: int,
    ) -> tuple[Any, ...] | None: ...

class LlCalls:
    def __init__(
        self, ep: Any, num_ranks: int, device: int, stream_of: Any, event: Any
    ) -> None: ...
    @property
    def pending(self) -> tuple[LlHook, ...]: ...
    def begin(self, async_finish: Any, return_recv_hook: Any) -> None: ...
    def record(self, kind: str, launch: Any | None, keep: Any) -> LlHook | None: ...
    def dispatch(
        self,
        x: Any,
        topk_idx: Any,
        num_max_dispatch_tokens_per_rank: Any,
        num_experts: Any,
        cumulative_local_expert_recv_stats: Any,
        dispatch_wait_recv_cost_stats: Any,
        use_fp8: Any,
        round_scale: Any,
        use_ue8m0: Any,
        return_recv_hook: Any,
    ) -> tuple[Any, ...] | None: ...
    def combine(
        self,
        x: Any,
        topk_idx: Any,
        topk_weights: Any,
        handle: Any,
        use_logfmt: Any,
        zero_copy: Any,
        return_recv_hook: Any,
        out: Any,
        combine_wait_recv_cost_stats: Any,
    ) -> tuple[Any, ...] | None: ...

class LlHook:
    @property
    def name(self) -> str: ...
    @property
    def called(self) -> bool: ...
    def __call__(self) -> None: ...

def reduce_rows_bf16(
    device: int, stream: int, input: int, out: int, rows: int, cols: int
) -> None: ...

class PeerWriteCheck:
    def __init__(self, device: int, rank: int, nranks: int, words: int) -> None: ...
    def export(self) -> bytes: ...
    def connect(self, handles: list[bytes]) -> None: ...
    def write(self, stream: int, seed: int) -> None: ...
    def verify(self, seed: int) -> list[tuple[int, int, int, int, int]]: ...

# CPU reference of dispatch / combine (ep_reference::normal); wrapped by moelink.reference.
# Arrays are raw little-endian row-major bytes; bools are 0 / 1 bytes.

class RefDispatched:
    @property
    def num_ranks(self) -> int: ...
    @property
    def num_topk(self) -> int: ...
    @property
    def hidden_bytes(self) -> int: ...
    @property
    def num_scales(self) -> int: ...
    @property
    def rank_prefix_matrix(self) -> bytes: ...
    def num_tokens(self, rank: int) -> int: ...
    def is_token_in_rank(self, rank: int) -> bytes: ...
    def rank_output(self, rank: int) -> dict[str, Any]: ...

def reference_layout(
    topk_idx: bytes,
    num_topk: int,
    num_experts: int,
    num_ranks: int,
    ranks_per_node: int | None = None,
) -> tuple[bytes, bytes | None, bytes, bytes]: ...
def reference_dispatch(
    inputs: list[tuple[bytes, bytes | None, bytes, bytes | None]],
    num_experts: int,
    num_topk: int,
    hidden_bytes: int,
    num_scales: int,
    expert_alignment: int,
    num_worst_tokens: int,
) -> RefDispatched: ...
def reference_dispatch_cached(
    handle: RefDispatched,
    inputs: list[tuple[bytes, bytes | None]],
    hidden_bytes: int,
    num_scales: int,
) -> list[tuple[bytes, bytes | None]]: ...
def reference_combine(
    handle: RefDispatched,
    inputs: list[tuple[bytes, bytes | None, bytes | None, bytes | None]],
    hidden: int,
    ranks_per_node: int | None = None,
) -> list[tuple[bytes, bytes | None]]: ...
def bootstrap_unique_id() -> bytes: ...

class Group:
    """The shared bootstrap of one torch process group: every native object
    below is made on one, collectively and in the same order on every rank."""

    def __init__(self, unique_id: bytes, rank: int, size: int, timeout_s: float) -> None: ...
    @property
    def rank(self) -> int: ...
    @property
    def size(self) -> int: ...
    @property
    def objects(self) -> int: ...

@type_check_only
class _GroupMember:
    """What the native objects made on a Group (EpBuffer, AllReduceComm) share."""

    @property
    def rank(self) -> int: ...
    @property
    def num_ranks(self) -> int: ...
    @property
    def destroyed(self) -> bool: ...

def low_latency_size_hint(
    max_tokens: int, hidden: int, num_ranks: int, num_experts: int
) -> int: ...
def ref_ll_dispatch(
    inputs: list, max_tokens: int, hidden: int, num_experts: int, num_topk: int,
    use_fp8: bool, round_scale: bool, use_ue8m0: bool, only_rank: int | None = None,
) -> list: ...  # fmt: skip
def ref_ll_combine(
    inputs: list, max_tokens: int, hidden: int, num_experts: int, num_topk: int
) -> list: ...

# Argument checks and output shapes of the Buffer's calls (ep_core::calls). The
# plans of layout, dispatch and combine, and of the low-latency dispatch and combine,
# are frozen objects holding ep_core's plan, which EpBuffer's calls of that name
# (ll_dispatch, ll_combine) take for every size; the other plans are dicts of the
# call's values. Both have "outputs": (name, dtype name, shape,
# strides, zeroed) per output, RECV_ROWS standing for rows known once the counts
# arrive. Errors: TypeError, moelink.DtypeError, ValueError.
RECV_ROWS: int
CPU_DEVICE: int
OTHER_DEVICE: int
#: (dtype name, shape, strides, device index): moelink.checks.tensor_meta.
_TensorMeta = tuple[str, Sequence[int], Sequence[int], int]
_Plan = dict[str, Any]
#: (name, dtype name, shape, strides, zeroed).
_Output = tuple[str, str, list[int], list[int], bool]

@type_check_only
class _PlanObject:
    """What every plan class has (ep-python's plan_getters)."""

    @property
    def outputs(self) -> list[_Output]: ...

@type_check_only
class _LlPlanObject(_PlanObject):
    """What both low-latency plans have: the geometry and the token count."""

    @property
    def max_tokens(self) -> int: ...
    @property
    def hidden(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def num_tokens(self) -> int: ...

class LayoutPlan(_PlanObject):
    @property
    def num_experts(self) -> int: ...

class DispatchPlan(_PlanObject):
    @property
    def num_tokens(self) -> int: ...
    @property
    def hidden_bytes(self) -> int: ...
    @property
    def num_scales(self) -> int: ...
    @property
    def scale_strides(self) -> tuple[int, int]: ...
    @property
    def num_topk(self) -> int: ...
    @property
    def num_experts(self) -> int: ...
    @property
    def num_worst_tokens(self) -> int: ...
    @property
    def num_recv_rows(self) -> int: ...

class CombinePlan(_PlanObject): ...

class LlDispatchPlan(_LlPlanObject):
    @property
    def num_topk(self) -> int: ...
    @property
    def use_fp8(self) -> bool: ...

class LlCombinePlan(_LlPlanObject): ...

def layout_plan(
    num_ranks: int, device: int, topk_idx: _TensorMeta, num_experts: int
) -> LayoutPlan: ...
def dispatch_plan(
    num_ranks: int, device: int, x: _TensorMeta, scales: _TensorMeta | None,
    handle: tuple[_TensorMeta, _TensorMeta, _TensorMeta, _TensorMeta] | None,
    num_tokens_per_rank: _TensorMeta | None, num_tokens_per_rdma_rank: bool,
    is_token_in_rank: _TensorMeta | None, num_tokens_per_expert: _TensorMeta | None,
    topk_idx: _TensorMeta | None, topk_weights: _TensorMeta | None,
    expert_alignment: int, num_worst_tokens: int,
) -> DispatchPlan: ...  # fmt: skip
def combine_plan(
    num_ranks: int, device: int, x: _TensorMeta,
    handle: tuple[_TensorMeta, _TensorMeta, _TensorMeta, _TensorMeta],
    topk_weights: _TensorMeta | None,
    bias: _TensorMeta | tuple[_TensorMeta | None, _TensorMeta | None] | None,
) -> CombinePlan: ...  # fmt: skip
def ll_geometry(
    num_ranks: int, max_tokens: int, hidden: int, num_experts: int, ranks_name: str
) -> _Plan: ...
def ll_dispatch_plan(
    num_ranks: int, device: int, x: _TensorMeta, topk_idx: _TensorMeta,
    num_max_dispatch_tokens_per_rank: int, num_experts: int,
    cumulative_local_expert_recv_stats: _TensorMeta | None,
    dispatch_wait_recv_cost_stats: _TensorMeta | None, use_fp8: bool, round_scale: bool,
    use_ue8m0: bool,
) -> LlDispatchPlan: ...  # fmt: skip
def ll_handle_plan(
    num_ranks: int, device: int, handle: tuple[_TensorMeta, _TensorMeta, int, int, int]
) -> _Plan: ...
def ll_combine_plan(
    num_ranks: int, device: int, x: _TensorMeta | None, topk_idx: _TensorMeta,
    topk_weights: _TensorMeta, handle: tuple[_TensorMeta, _TensorMeta, int, int, int],
    use_logfmt: bool, zero_copy: bool, out: _TensorMeta | None,
    combine_wait_recv_cost_stats: _TensorMeta | None,
) -> LlCombinePlan: ...  # fmt: skip

# The Buffer's constructor and a Config's SMs (ep_core::calls::buffer_options,
# num_sms): buffer_options_plan -> {"num_nvl_bytes", "num_ll_bytes", "num_internode_bytes"}.
def buffer_options_plan(
    num_nvl_bytes: int, num_rdma_bytes: int, low_latency_mode: bool, num_qps_per_rank: int,
    enable_shrink: bool,
) -> _Plan: ...  # fmt: skip
def check_num_sms(name: str, num_sms: int) -> int: ...
def default_num_sms(call: str, num_ranks: int) -> int: ...

# The NVLink size hints and record sizes (ep_core::calls, module sizing).
NVL_COUNTER_BYTES: int
COMBINE_RECORD_TOPK: int

def nvl_buffer_size_hint(hidden_bytes: int, num_ranks: int, max_tokens_per_rank: int) -> int: ...
def rdma_buffer_size_hint(
    hidden_bytes: int, num_ranks: int, max_tokens_per_rank: int, ranks_per_node: int
) -> int: ...
def token_record_bytes(hidden_bytes: int, num_topk: int, num_scales: int | None = None) -> int: ...
def combine_record_bytes(hidden_bytes: int, num_topk: int) -> int: ...

# AllReduce's tensor checks (ep_core::calls::all_reduce, all_gather,
# all_reduce_register) on a communicator of device index `device`:
# all_reduce_plan -> {"dtype" (the kernels' name), "count", "nbytes"},
# all_gather_plan -> {"nbytes"} (per rank), all_reduce_register_plan -> bytes.
def all_reduce_plan(
    device: int, tensor: _TensorMeta, out: _TensorMeta | None, max_bytes: int
) -> _Plan: ...
def all_gather_plan(
    device: int, out: _TensorMeta, inp: _TensorMeta, element_size: int, world_size: int,
    max_bytes: int,
) -> _Plan: ...  # fmt: skip
def all_reduce_register_plan(device: int, tensor: _TensorMeta, element_size: int) -> int: ...

class StreamOrder:
    def __init__(self, device: int) -> None: ...
    def after(self, waiter: int, signaler: int) -> None: ...

class EpBuffer(_GroupMember):
    """Rust half of moelink.Buffer: its intranode part and its low-latency part
    (either absent where 0 bytes are asked for). Methods of one part have its
    name; what both parts have takes ``part``: "intranode" or "low_latency".
    Pointers are device addresses (0 = absent), streams raw cudaStream_t
    handles; low-latency phases 1 send, 2 receive, 3 both."""

    def __init__(
        self, group: Group, device: int, num_nvl_bytes: int, num_ll_bytes: int,
        timeout_s: float, device_timeout_ns: int, ll_device_timeout_ns: int,
        allow_nvlink: bool, shrink: bool, num_internode_bytes: int = 0,
    ) -> None: ...  # fmt: skip
    # Both parts (and rank, num_ranks, destroyed).
    def has_part(self, part: str) -> bool: ...
    def local_buffer(self, part: str) -> tuple[int, int]: ...
    def device_share(self) -> tuple[int, int, int | None, int, int]: ...
    def check_device(self, part: str | None = None) -> None: ...
    def check_device_timeout(self, part: str) -> None: ...
    def barrier(self, part: str | None = None) -> None: ...
    def destroy(self, collective: bool = False) -> None: ...
    # Intranode (the internode part where the group spans nodes: `xnode` is the
    # handle's (node_head, xcounts, fwd_meta, fwd_meta.shape[1], recv_rdma_rank_prefix_sum
    # or 0)). Every size comes from the plan; the addresses come in tuples:
    # layout `outputs` (num_tokens_per_rank, num_tokens_per_expert, is_token_in_rank,
    # layout_scratch); dispatch_send `tensors` (x, scales, rank_prefix_matrix,
    # send_head) and, for a full dispatch only, `routing` (topk_idx, topk_weights,
    # is_token_in_rank, num_tokens_per_expert); dispatch_recv `tensors`
    # (rank_prefix_matrix, recv_x, recv_x_scales) and, full only, `routing`
    # (recv_topk_idx, recv_topk_weights, recv_src_idx), `rows` None where the plan
    # knows them; combine `tensors` (x, topk_weights, rank_prefix_matrix, send_head,
    # bias0, bias1, combined_x, combined_topk_weights).
    def nodes(self) -> tuple[int, int] | None: ...
    def internode_capacity(self, hidden_bytes: int, num_scales: int, num_topk: int) -> int: ...
    def layout(
        self, stream: int, plan: LayoutPlan, topk_idx: int, outputs: tuple[int, int, int, int],
        num_tokens_per_node: int = 0,
    ) -> None: ...  # fmt: skip
    def dispatch_send(
        self, stream: int, plan: DispatchPlan, num_sms: int, tensors: tuple[int, int, int, int],
        routing: tuple[int, int, int, int] | None = None,
        xnode: tuple[int, int, int, int, int] | None = None,
    ) -> int: ...  # fmt: skip
    def wait_counts(self, epoch: int, plan: DispatchPlan) -> tuple[int, list[int]]: ...
    def dispatch_recv(
        self, stream: int, plan: DispatchPlan, num_sms: int, tensors: tuple[int, int, int],
        routing: tuple[int, int, int] | None = None, rows: int | None = None,
    ) -> None: ...  # fmt: skip
    def combine(
        self, stream: int, plan: CombinePlan, num_sms: int,
        tensors: tuple[int, int, int, int, int, int, int, int],
        xnode: tuple[int, int, int, int, int] | None = None, recv_src_idx: int = 0,
    ) -> None: ...  # fmt: skip
    # Low-latency.
    @property
    def uses_proxy(self) -> bool: ...
    @property
    def num_blocks(self) -> int: ...
    def set_num_blocks(self, n: int) -> None: ...
    def mask_ptr(self) -> int: ...
    def check_shape(
        self, max_tokens: int, hidden: int, num_experts: int, num_topk: int
    ) -> None: ...
    def zero_copy_buffer(
        self, max_tokens: int, hidden: int, num_experts: int
    ) -> tuple[int, int]: ...
    def profile(self) -> list[int]: ...
    def intranode_profile(self) -> list[int]: ...
    def launch_sms(self, num_sms: int) -> int | None: ...
    def recv_pool_stats(self) -> tuple[int, int, int, int, int, int, int] | None: ...
    def recv_pool_tensor(self, nbytes: int) -> object | None: ...
    def recv_pool_reserve(
        self, hidden_bytes: int, num_scales: int, num_topk: int, rows: int | None = None
    ) -> bool: ...
    def recv_pool_take(self, nbytes: int) -> object | None: ...
    def proxy_progress(
        self,
    ) -> tuple[int, list[tuple[int, bool | None, int | None, int] | None]] | None: ...
    # Every size and flag comes from the plan; the addresses come in a tuple:
    # ll_dispatch `tensors` (x, topk_idx, recv_x, recv_x_scales, recv_count, src_info,
    # layout_range, cumulative_local_expert_recv_stats, dispatch_wait_recv_cost_stats);
    # ll_combine `tensors` (x, layout_range, topk_idx, topk_weights, out,
    # combine_wait_recv_cost_stats); 0 = absent. `phases_`: 1 send, 2 receive, 3 both.
    def ll_dispatch(
        self, stream: int, plan: LlDispatchPlan,
        tensors: tuple[int, int, int, int, int, int, int, int, int], phases_: int,
    ) -> BaseException | None: ...  # fmt: skip
    def ll_combine(
        self, stream: int, plan: LlCombinePlan, tensors: tuple[int, int, int, int, int, int],
        phases_: int,
    ) -> BaseException | None: ...  # fmt: skip
    def clean(self) -> None: ...

# Allreduce / allgather communicator (crate `collectives`); wrapped by moelink.AllReduce.
# Tuned entries: (collective, graph, registered, log2 bytes, algorithm, blocks, threads).
_Tuned = tuple[str, bool, bool, int, str, int, int]

class AllReduceComm(_GroupMember):
    """Rust half of moelink.AllReduce; pointers are device addresses, streams raw
    cudaStream_t handles, dtypes/ops/algorithms names."""

    def __init__(
        self,
        group: Group,
        device: int,
        max_bytes: int,
        oneshot_max_bytes: int,
        twoshot_max_bytes: int,
        allgather_ll_max_bytes: int,
        timeout_s: float,
        device_timeout_ns: int,
    ) -> None: ...
    @property
    def device_timeout_ns(self) -> int: ...
    def limits(self) -> tuple[int, int, int, int, int, int]: ...
    def scratch_bytes(self) -> int: ...
    def all_reduce(
        self,
        stream: int,
        input: int,
        output: int,
        count: int,
        dtype: str,
        op: str,
        accum: str | None,
        algorithm: str | None,
        num_blocks: int,
        num_threads: int,
        capturing: bool,
    ) -> tuple[str, int, int]: ...
    def all_gather(
        self,
        stream: int,
        input: int,
        output: int,
        nbytes: int,
        algorithm: str | None,
        num_blocks: int,
        num_threads: int,
        capturing: bool,
    ) -> tuple[str, int, int]: ...
    def select(
        self,
        collective: str,
        nbytes: int,
        registered: bool,
        capturing: bool,
        algorithm: str | None = None,
        num_blocks: int = 0,
        num_threads: int = 0,
    ) -> tuple[str, int, int]: ...
    def register(self, ptr: int, nbytes: int) -> int: ...
    def deregister(self, id: int) -> None: ...
    def is_registered(self, ptr: int, nbytes: int) -> bool: ...
    def set_tuned(self, entries: list[_Tuned]) -> None: ...
    def tuned(self) -> list[_Tuned]: ...
    def set_device_timeout_ns(self, timeout_ns: int) -> None: ...
    def _set_test_hooks(
        self, copy_out_delay_us: int = 0, results_in_data_region: bool = False
    ) -> None: ...
    def check_device(self) -> None: ...
    def barrier(self) -> None: ...
    def destroy(self) -> None: ...
    @staticmethod
    def algorithm_names() -> list[tuple[str, str]]: ...
    @staticmethod
    def variant(dtype: str, op: str, accum: str | None = None) -> str: ...
    @staticmethod
    def plan(
        collective: str,
        nbytes: int,
        world_size: int,
        max_bytes: int,
        oneshot_max_bytes: int,
        twoshot_max_bytes: int,
        allgather_ll_max_bytes: int,
        max_blocks: int,
        registered: bool = False,
        capturing: bool = False,
        algorithm: str | None = None,
        num_blocks: int = 0,
        num_threads: int = 0,
        tuned: list[_Tuned] = ...,
    ) -> tuple[str, int, int]: ...
