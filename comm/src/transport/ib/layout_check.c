/* The layouts asserted in sys.rs, checked against the verbs.h of the
 * rdma-core installed here (libibverbs-dev / rdma-core-devel):
 *
 *     gcc -fsyntax-only comm/src/transport/ib/layout_check.c
 *
 * compiles without error where every size and offset agrees. Generated from
 * the assertions of sys.rs; keep the two in step. */
#include <stddef.h>
#include <infiniband/verbs.h>

_Static_assert(offsetof(struct ibv_send_wr, wr.rdma.rkey) - offsetof(struct ibv_send_wr, wr) == 8, "rdma.rkey");
_Static_assert(offsetof(struct ibv_send_wr, wr.atomic.compare_add) - offsetof(struct ibv_send_wr, wr) == 8, "compare_add");
_Static_assert(offsetof(struct ibv_send_wr, wr.atomic.swap) - offsetof(struct ibv_send_wr, wr) == 16, "swap");
_Static_assert(sizeof(((struct ibv_send_wr *)0)->wr) == 32, "wr union");
_Static_assert(IBV_WR_RDMA_WRITE == 0 && IBV_WR_RDMA_WRITE_WITH_IMM == 1 && IBV_WR_ATOMIC_FETCH_AND_ADD == 6, "wr opcodes");
_Static_assert(IBV_SEND_SIGNALED == 2 && IBV_WC_WITH_IMM == 2, "flags");
_Static_assert(IBV_WC_RDMA_WRITE == 1 && IBV_WC_FETCH_ADD == 4 && IBV_WC_RECV_RDMA_WITH_IMM == 129, "wc opcodes");
_Static_assert(IBV_QPT_RC == 2 && IBV_PORT_ACTIVE == 4 && IBV_LINK_LAYER_ETHERNET == 2, "enums");
_Static_assert(IBV_QP_PATH_MTU == 0x100 && IBV_QP_DEST_QPN == 0x100000 && IBV_QP_MAX_DEST_RD_ATOMIC == 0x20000, "qp attr mask");
_Static_assert(sizeof(union ibv_gid) == 16, "sizeof ibv_gid");
_Static_assert(sizeof(struct ibv_device_attr) == 232, "sizeof ibv_device_attr");
_Static_assert(offsetof(struct ibv_device_attr, max_qp_wr) == 112, "ibv_device_attr.max_qp_wr");
_Static_assert(offsetof(struct ibv_device_attr, max_cqe) == 132, "ibv_device_attr.max_cqe");
_Static_assert(offsetof(struct ibv_device_attr, atomic_cap) == 164, "ibv_device_attr.atomic_cap");
_Static_assert(offsetof(struct ibv_device_attr, phys_port_cnt) == 227, "ibv_device_attr.phys_port_cnt");
_Static_assert(sizeof(struct ibv_port_attr) <= 56, "ibv_port_attr fits the mirror");
_Static_assert(offsetof(struct ibv_port_attr, active_mtu) == 8, "ibv_port_attr.active_mtu");
_Static_assert(offsetof(struct ibv_port_attr, max_msg_sz) == 20, "ibv_port_attr.max_msg_sz");
_Static_assert(offsetof(struct ibv_port_attr, lid) == 34, "ibv_port_attr.lid");
_Static_assert(offsetof(struct ibv_port_attr, link_layer) == 46, "ibv_port_attr.link_layer");
_Static_assert(sizeof(struct ibv_mr) == 48, "sizeof ibv_mr");
_Static_assert(offsetof(struct ibv_mr, lkey) == 36, "ibv_mr.lkey");
_Static_assert(offsetof(struct ibv_mr, rkey) == 40, "ibv_mr.rkey");
_Static_assert(sizeof(struct ibv_context_ops) == 32 * 8, "sizeof ContextOps");
_Static_assert(offsetof(struct ibv_context_ops, poll_cq) == 11 * 8, "ContextOps.poll_cq");
_Static_assert(offsetof(struct ibv_context_ops, post_send) == 25 * 8, "ContextOps.post_send");
_Static_assert(offsetof(struct ibv_context_ops, post_recv) == 26 * 8, "ContextOps.post_recv");
_Static_assert(offsetof(struct ibv_context, ops) == 8, "ibv_context.ops");
_Static_assert(offsetof(struct ibv_context, cmd_fd) == 264, "ibv_context.cmd_fd");
_Static_assert(offsetof(struct ibv_qp, context) == 0, "ibv_qp.context");
_Static_assert(offsetof(struct ibv_qp, qp_num) == 52, "ibv_qp.qp_num");
_Static_assert(offsetof(struct ibv_qp, state) == 56, "ibv_qp.state");
_Static_assert(offsetof(struct ibv_cq, context) == 0, "ibv_cq.context");
_Static_assert(sizeof(struct ibv_qp_cap) == 20, "sizeof ibv_qp_cap");
_Static_assert(sizeof(struct ibv_qp_init_attr) == 64, "sizeof ibv_qp_init_attr");
_Static_assert(offsetof(struct ibv_qp_init_attr, cap) == 32, "ibv_qp_init_attr.cap");
_Static_assert(offsetof(struct ibv_qp_init_attr, qp_type) == 52, "ibv_qp_init_attr.qp_type");
_Static_assert(offsetof(struct ibv_qp_init_attr, sq_sig_all) == 56, "ibv_qp_init_attr.sq_sig_all");
_Static_assert(sizeof(struct ibv_global_route) == 24, "sizeof ibv_global_route");
_Static_assert(offsetof(struct ibv_global_route, sgid_index) == 20, "ibv_global_route.sgid_index");
_Static_assert(offsetof(struct ibv_global_route, traffic_class) == 22, "ibv_global_route.traffic_class");
_Static_assert(sizeof(struct ibv_ah_attr) == 32, "sizeof ibv_ah_attr");
_Static_assert(offsetof(struct ibv_ah_attr, dlid) == 24, "ibv_ah_attr.dlid");
_Static_assert(offsetof(struct ibv_ah_attr, is_global) == 29, "ibv_ah_attr.is_global");
_Static_assert(offsetof(struct ibv_ah_attr, port_num) == 30, "ibv_ah_attr.port_num");
_Static_assert(sizeof(struct ibv_qp_attr) == 144, "sizeof ibv_qp_attr");
_Static_assert(offsetof(struct ibv_qp_attr, path_mtu) == 8, "ibv_qp_attr.path_mtu");
_Static_assert(offsetof(struct ibv_qp_attr, rq_psn) == 20, "ibv_qp_attr.rq_psn");
_Static_assert(offsetof(struct ibv_qp_attr, sq_psn) == 24, "ibv_qp_attr.sq_psn");
_Static_assert(offsetof(struct ibv_qp_attr, dest_qp_num) == 28, "ibv_qp_attr.dest_qp_num");
_Static_assert(offsetof(struct ibv_qp_attr, qp_access_flags) == 32, "ibv_qp_attr.qp_access_flags");
_Static_assert(offsetof(struct ibv_qp_attr, ah_attr) == 56, "ibv_qp_attr.ah_attr");
_Static_assert(offsetof(struct ibv_qp_attr, pkey_index) == 120, "ibv_qp_attr.pkey_index");
_Static_assert(offsetof(struct ibv_qp_attr, max_rd_atomic) == 126, "ibv_qp_attr.max_rd_atomic");
_Static_assert(offsetof(struct ibv_qp_attr, max_dest_rd_atomic) == 127, "ibv_qp_attr.max_dest_rd_atomic");
_Static_assert(offsetof(struct ibv_qp_attr, min_rnr_timer) == 128, "ibv_qp_attr.min_rnr_timer");
_Static_assert(offsetof(struct ibv_qp_attr, port_num) == 129, "ibv_qp_attr.port_num");
_Static_assert(offsetof(struct ibv_qp_attr, timeout) == 130, "ibv_qp_attr.timeout");
_Static_assert(offsetof(struct ibv_qp_attr, retry_cnt) == 131, "ibv_qp_attr.retry_cnt");
_Static_assert(offsetof(struct ibv_qp_attr, rnr_retry) == 132, "ibv_qp_attr.rnr_retry");
_Static_assert(offsetof(struct ibv_qp_attr, rate_limit) == 136, "ibv_qp_attr.rate_limit");
_Static_assert(sizeof(struct ibv_sge) == 16, "sizeof ibv_sge");
_Static_assert(sizeof(struct ibv_send_wr) == 128, "sizeof ibv_send_wr");
_Static_assert(offsetof(struct ibv_send_wr, num_sge) == 24, "ibv_send_wr.num_sge");
_Static_assert(offsetof(struct ibv_send_wr, opcode) == 28, "ibv_send_wr.opcode");
_Static_assert(offsetof(struct ibv_send_wr, send_flags) == 32, "ibv_send_wr.send_flags");
_Static_assert(offsetof(struct ibv_send_wr, imm_data) == 36, "ibv_send_wr.imm_data");
_Static_assert(offsetof(struct ibv_send_wr, wr) == 40, "ibv_send_wr.wr");
_Static_assert(offsetof(struct ibv_send_wr, wr.atomic.rkey) - offsetof(struct ibv_send_wr, wr) == 24, "atomic.rkey");
_Static_assert(sizeof(struct ibv_recv_wr) == 32, "sizeof ibv_recv_wr");
_Static_assert(offsetof(struct ibv_recv_wr, num_sge) == 24, "ibv_recv_wr.num_sge");
_Static_assert(sizeof(struct ibv_wc) == 48, "sizeof ibv_wc");
_Static_assert(offsetof(struct ibv_wc, status) == 8, "ibv_wc.status");
_Static_assert(offsetof(struct ibv_wc, opcode) == 12, "ibv_wc.opcode");
_Static_assert(offsetof(struct ibv_wc, vendor_err) == 16, "ibv_wc.vendor_err");
_Static_assert(offsetof(struct ibv_wc, byte_len) == 20, "ibv_wc.byte_len");
_Static_assert(offsetof(struct ibv_wc, imm_data) == 24, "ibv_wc.imm_data");
_Static_assert(offsetof(struct ibv_wc, qp_num) == 28, "ibv_wc.qp_num");
_Static_assert(offsetof(struct ibv_wc, wc_flags) == 36, "ibv_wc.wc_flags");
