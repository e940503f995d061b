//! [`super::device`] on libibverbs loaded at run time ([`Verbs`]): devices,
//! protection domains, memory regions, completion queues and queue pairs,
//! released in reverse order by RAII. Never run against a real NIC (none
//! here): docs/ib.md lists what that leaves unverified.

use std::ffi::{c_int, c_void, CStr};
use std::sync::{Arc, OnceLock};

use crate::error::{CommError, Result};

use super::device::{
    Completion, DeviceCaps, MrSource, PortAttr, QpInit, RdmaCq, RdmaDevice, RdmaMr, RdmaProvider,
    RdmaQp, SendOp, SendWr,
};
use super::qp::{LinkLayer, Transition};
use super::sys;
use super::verbs::{Fns, Verbs};

/// `call` on `device` failed with the thread's errno (verbs set it), or with
/// `rc` where a call returns the error number itself.
fn verbs_error(call: &str, device: &str, rc: c_int) -> CommError {
    let source = if rc > 0 {
        std::io::Error::from_raw_os_error(rc)
    } else {
        std::io::Error::last_os_error()
    };
    CommError::Io {
        context: format!("{call} on RDMA device {device}"),
        source,
    }
}

impl RdmaProvider for Verbs {
    fn device_names(&self) -> Result<Vec<String>> {
        Verbs::device_names(self)
    }

    fn open(&self, name: &str) -> Result<Arc<dyn RdmaDevice>> {
        let f = self.fns;
        let mut n: c_int = 0;
        // SAFETY: an out-parameter; the list is freed below, after the open
        // (verbs.h: devices must be opened before the list is freed).
        let list = unsafe { (f.get_device_list)(&mut n) };
        if list.is_null() {
            return Err(verbs_error("ibv_get_device_list", name, 0));
        }
        let mut ctx = std::ptr::null_mut();
        for i in 0..n.max(0) as usize {
            // SAFETY: i < n entries of the list.
            let dev = unsafe { *list.add(i) };
            // SAFETY: a device of the list; its name is a C string.
            let p = unsafe { (f.get_device_name)(dev) };
            // SAFETY: non-null, NUL-terminated.
            if !p.is_null() && unsafe { CStr::from_ptr(p) }.to_bytes() == name.as_bytes() {
                // SAFETY: a device of the live list.
                ctx = unsafe { (f.open_device)(dev) };
                if ctx.is_null() {
                    let e = verbs_error("ibv_open_device", name, 0);
                    // SAFETY: freed once.
                    unsafe { (f.free_device_list)(list) };
                    return Err(e);
                }
                break;
            }
        }
        // SAFETY: the list came from get_device_list and is freed once.
        unsafe { (f.free_device_list)(list) };
        if ctx.is_null() {
            return Err(CommError::NoRdma {
                reason: format!("no RDMA device named {name}"),
            });
        }
        let mut dev = NativeDevice {
            fns: f,
            name: name.to_string(),
            ctx,
            pd: std::ptr::null_mut(),
            caps: DeviceCaps {
                atomics: false,
                max_qp_wr: 0,
                max_cqe: 0,
                ports: 0,
            },
        };
        // SAFETY: all-zero is a valid ibv_device_attr (integers and arrays).
        let mut attr: sys::ibv_device_attr = unsafe { std::mem::zeroed() };
        // SAFETY: an open context and an out-parameter of the right type.
        let rc = unsafe { (f.query_device)(ctx, &mut attr) };
        if rc != 0 {
            return Err(verbs_error("ibv_query_device", name, rc));
        }
        dev.caps = DeviceCaps {
            atomics: attr.atomic_cap != sys::ATOMIC_NONE,
            max_qp_wr: attr.max_qp_wr.max(0) as u32,
            max_cqe: attr.max_cqe.max(0) as u32,
            ports: attr.phys_port_cnt,
        };
        // SAFETY: an open context.
        dev.pd = unsafe { (f.alloc_pd)(ctx) };
        if dev.pd.is_null() {
            return Err(verbs_error("ibv_alloc_pd", name, 0));
        }
        Ok(Arc::new(Arc::new(dev)))
    }
}

/// The process's libibverbs, loaded at the first call (None when it is
/// missing: the error says so again at every call).
pub fn shared_verbs() -> Result<Arc<Verbs>> {
    static VERBS: OnceLock<Arc<Verbs>> = OnceLock::new();
    if let Some(v) = VERBS.get() {
        return Ok(v.clone());
    }
    let v = Arc::new(Verbs::load()?);
    Ok(VERBS.get_or_init(|| v).clone())
}

/// An open device with its protection domain.
struct NativeDevice {
    fns: Fns,
    name: String,
    ctx: *mut sys::ibv_context,
    pd: *mut c_void,
    caps: DeviceCaps,
}

// SAFETY: verbs objects may be used from any thread (libibverbs and its
// providers lock internally); moelink serializes posts per queue pair.
unsafe impl Send for NativeDevice {}
// SAFETY: as above.
unsafe impl Sync for NativeDevice {}

impl std::fmt::Debug for NativeDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NativeDevice")
            .field("name", &self.name)
            .field("caps", &self.caps)
            .finish()
    }
}

impl Drop for NativeDevice {
    fn drop(&mut self) {
        // Everything made on the PD holds an Arc to this device, so it is gone.
        if !self.pd.is_null() {
            // SAFETY: allocated by alloc_pd, freed once.
            self.warn_failed("ibv_dealloc_pd", unsafe { (self.fns.dealloc_pd)(self.pd) });
        }
        // SAFETY: opened by open_device, closed once.
        self.warn_failed("ibv_close_device", unsafe {
            (self.fns.close_device)(self.ctx)
        });
    }
}

/// `self` as an `Arc` the objects made on it keep.
struct DeviceRef(Arc<NativeDevice>);

impl NativeDevice {
    fn arc(self: &Arc<Self>) -> DeviceRef {
        DeviceRef(self.clone())
    }

    /// Logs a failed release (`rc`, the return code of verbs call `call`):
    /// a drop has no caller to return it to.
    fn warn_failed(&self, call: &str, rc: c_int) {
        if rc != 0 {
            tracing::warn!("{}", verbs_error(call, &self.name, rc));
        }
    }
}

impl RdmaDevice for Arc<NativeDevice> {
    fn name(&self) -> &str {
        &self.name
    }

    fn caps(&self) -> DeviceCaps {
        self.caps
    }

    fn port(&self, port: u8) -> Result<PortAttr> {
        let mut a = sys::ibv_port_attr::default();
        // SAFETY: an open context; `a` is zeroed and at least as large as
        // what the exported ibv_query_port writes.
        let rc = unsafe { (self.fns.query_port)(self.ctx, port, &mut a) };
        if rc != 0 {
            return Err(verbs_error("ibv_query_port", &self.name, rc));
        }
        Ok(PortAttr {
            active: a.state == sys::PORT_ACTIVE,
            lid: a.lid,
            active_mtu: a.active_mtu,
            link_layer: if a.link_layer == sys::LINK_LAYER_ETHERNET {
                LinkLayer::Ethernet
            } else {
                LinkLayer::InfiniBand
            },
            max_msg_size: a.max_msg_sz,
        })
    }

    fn gid(&self, port: u8, index: u8) -> Result<[u8; 16]> {
        let mut g = sys::ibv_gid::default();
        // SAFETY: an open context and an out-parameter of the right type.
        let rc = unsafe { (self.fns.query_gid)(self.ctx, port, index as c_int, &mut g) };
        if rc != 0 {
            return Err(verbs_error("ibv_query_gid", &self.name, rc));
        }
        Ok(g.raw)
    }

    fn register(&self, source: MrSource, access: u32) -> Result<Box<dyn RdmaMr>> {
        let f = &self.fns;
        let (mr, call) = match source {
            MrSource::Host { addr, len } | MrSource::DevicePointer { addr, len } => (
                // SAFETY: the caller keeps [addr, addr + len) allocated while
                // the region lives (the registration owns or outlives it).
                unsafe { (f.reg_mr)(self.pd, addr as *mut c_void, len as usize, access as c_int) },
                "ibv_reg_mr",
            ),
            MrSource::DmaBuf {
                fd,
                offset,
                len,
                iova,
            } => {
                let reg = f.reg_dmabuf_mr.ok_or_else(|| CommError::NoRdma {
                    reason: "libibverbs has no ibv_reg_dmabuf_mr (rdma-core older than 34)".into(),
                })?;
                // SAFETY: a dma-buf descriptor of the caller's; the region
                // takes its own reference.
                let mr = unsafe { reg(self.pd, offset, len as usize, iova, fd, access as c_int) };
                (mr, "ibv_reg_dmabuf_mr")
            }
        };
        if mr.is_null() {
            return Err(verbs_error(call, &self.name, 0));
        }
        Ok(Box::new(NativeMr {
            dev: self.arc(),
            mr,
        }))
    }

    fn create_cq(&self, depth: u32) -> Result<Arc<dyn RdmaCq>> {
        let null = std::ptr::null_mut();
        // SAFETY: an open context; no channel, vector 0.
        let cq = unsafe { (self.fns.create_cq)(self.ctx, depth as c_int, null, null, 0) };
        if cq.is_null() {
            return Err(verbs_error("ibv_create_cq", &self.name, 0));
        }
        Ok(Arc::new(NativeCq {
            dev: self.arc(),
            cq,
        }))
    }

    fn create_qp(&self, init: QpInit<'_>) -> Result<Box<dyn RdmaQp>> {
        let raw = |cq: &Arc<dyn RdmaCq>| -> Result<(*mut sys::ibv_cq, Arc<dyn RdmaCq>)> {
            let any: &dyn std::any::Any = cq.as_any();
            let n = any.downcast_ref::<NativeCq>().ok_or_else(|| {
                CommError::invalid("completion queue", "not one of this RDMA device's")
            })?;
            Ok((n.cq, cq.clone()))
        };
        let (scq, keep_s) = raw(init.send_cq)?;
        let (rcq, keep_r) = raw(init.recv_cq)?;
        let mut init = sys::ibv_qp_init_attr {
            qp_context: std::ptr::null_mut(),
            send_cq: scq,
            recv_cq: rcq,
            srq: std::ptr::null_mut(),
            cap: sys::ibv_qp_cap {
                max_send_wr: init.max_send_wr,
                max_recv_wr: init.max_recv_wr,
                max_send_sge: 1,
                max_recv_sge: 1,
                max_inline_data: 0,
            },
            qp_type: sys::QPT_RC,
            sq_sig_all: 0,
        };
        // SAFETY: a PD of this device and CQs of it (checked above).
        let qp = unsafe { (self.fns.create_qp)(self.pd, &mut init) };
        if qp.is_null() {
            return Err(verbs_error("ibv_create_qp", &self.name, 0));
        }
        Ok(Box::new(NativeQp {
            dev: self.arc(),
            qp,
            _cqs: [keep_s, keep_r],
        }))
    }
}

struct NativeMr {
    dev: DeviceRef,
    mr: *mut sys::ibv_mr,
}

/// `Send`, `Sync` and `Drop` of the wrapper `$ty` of one object made on a
/// [`NativeDevice`] (`self.dev`): its pointer `self.$field` is released by
/// the device's `$release` (verbs call `$call`) once, when it is dropped.
macro_rules! made_on_device {
    ($ty:ty, $field:ident, $release:ident, $call:literal) => {
        // SAFETY: see NativeDevice.
        unsafe impl Send for $ty {}
        // SAFETY: see NativeDevice.
        unsafe impl Sync for $ty {}

        impl Drop for $ty {
            fn drop(&mut self) {
                let d = &self.dev.0;
                // SAFETY: the object was made on `d` and is released once, here
                // (see each use for what keeps its order).
                d.warn_failed($call, unsafe { (d.fns.$release)(self.$field) });
            }
        }
    };
}

// Registered by reg_mr / reg_dmabuf_mr.
made_on_device!(NativeMr, mr, dereg_mr, "ibv_dereg_mr");
// Created by create_cq; every QP using it holds an Arc to it, so it goes last.
made_on_device!(NativeCq, cq, destroy_cq, "ibv_destroy_cq");
// Created by create_qp; destroyed before its CQs (it holds them).
made_on_device!(NativeQp, qp, destroy_qp, "ibv_destroy_qp");

impl std::fmt::Debug for NativeMr {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NativeMr(lkey {:#x})", self.lkey())
    }
}

impl RdmaMr for NativeMr {
    fn lkey(&self) -> u32 {
        // SAFETY: a live MR the library allocated.
        unsafe { (*self.mr).lkey }
    }

    fn rkey(&self) -> u32 {
        // SAFETY: as above.
        unsafe { (*self.mr).rkey }
    }
}

struct NativeCq {
    dev: DeviceRef,
    cq: *mut sys::ibv_cq,
}

impl std::fmt::Debug for NativeCq {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NativeCq({})", self.dev.0.name)
    }
}

impl RdmaCq for NativeCq {
    fn poll(&self, out: &mut Vec<Completion>, max: usize) -> Result<()> {
        let mut wc = [sys::ibv_wc::default(); 32];
        let n = max.min(wc.len()) as c_int;
        // SAFETY: verbs.h's inline ibv_poll_cq: the context's poll_cq op on
        // a live CQ, writing at most n entries of `wc`.
        let got = unsafe {
            let ctx = (*self.cq).context;
            let poll = (*ctx).ops.poll_cq.ok_or_else(|| {
                CommError::invalid("RDMA device", "its context has no poll_cq operation")
            })?;
            poll(self.cq, n, wc.as_mut_ptr())
        };
        if got < 0 {
            return Err(verbs_error("ibv_poll_cq", &self.dev.0.name, -got));
        }
        out.extend(wc[..got as usize].iter().map(|w| Completion {
            wr_id: w.wr_id,
            status: w.status,
            opcode: w.opcode,
            vendor_err: w.vendor_err,
            byte_len: w.byte_len,
            imm: (w.wc_flags & sys::WC_WITH_IMM != 0).then(|| u32::from_be(w.imm_data)),
            qp_num: w.qp_num,
        }));
        Ok(())
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

struct NativeQp {
    dev: DeviceRef,
    qp: *mut sys::ibv_qp,
    _cqs: [Arc<dyn RdmaCq>; 2],
}

impl std::fmt::Debug for NativeQp {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NativeQp({})", self.qp_num())
    }
}

/// The `ibv_qp_attr` of one transition.
pub(crate) fn qp_attr(t: &Transition) -> sys::ibv_qp_attr {
    let mut a = sys::ibv_qp_attr {
        qp_state: t.state as u32,
        path_mtu: t.path_mtu,
        rq_psn: t.rq_psn,
        sq_psn: t.sq_psn,
        dest_qp_num: t.dest_qp_num,
        qp_access_flags: t.access_flags,
        pkey_index: t.pkey_index,
        max_rd_atomic: t.max_rd_atomic,
        max_dest_rd_atomic: t.max_dest_rd_atomic,
        min_rnr_timer: t.min_rnr_timer,
        port_num: t.port_num,
        timeout: t.timeout,
        retry_cnt: t.retry_cnt,
        rnr_retry: t.rnr_retry,
        ..Default::default()
    };
    if let Some(av) = t.av {
        a.ah_attr.dlid = av.dlid;
        a.ah_attr.sl = av.sl;
        a.ah_attr.port_num = av.port_num;
        if let Some(g) = av.grh {
            a.ah_attr.is_global = 1;
            a.ah_attr.grh.dgid.raw = g.dgid;
            a.ah_attr.grh.sgid_index = g.sgid_index;
            a.ah_attr.grh.hop_limit = g.hop_limit;
            a.ah_attr.grh.traffic_class = g.traffic_class;
        }
    }
    a
}

/// The `ibv_send_wr` of one work request (its one SGE at `sge`).
pub(crate) fn send_wr(wr: &SendWr, sge: &mut sys::ibv_sge) -> sys::ibv_send_wr {
    *sge = sys::ibv_sge {
        addr: wr.local.addr,
        length: wr.local.len,
        lkey: wr.local.lkey,
    };
    let (opcode, imm, u) = match wr.op {
        SendOp::Write { remote_addr, rkey } => (
            sys::WR_RDMA_WRITE,
            0,
            sys::WrUnion {
                remote_addr,
                word1: rkey as u64,
                ..Default::default()
            },
        ),
        SendOp::WriteImm {
            remote_addr,
            rkey,
            imm,
        } => (
            sys::WR_RDMA_WRITE_WITH_IMM,
            imm.to_be(),
            sys::WrUnion {
                remote_addr,
                word1: rkey as u64,
                ..Default::default()
            },
        ),
        SendOp::FetchAdd {
            remote_addr,
            rkey,
            add,
        } => (
            sys::WR_ATOMIC_FETCH_AND_ADD,
            0,
            sys::WrUnion {
                remote_addr,
                word1: add,
                swap: 0,
                atomic_rkey: rkey,
                _pad: 0,
            },
        ),
    };
    sys::ibv_send_wr {
        wr_id: wr.wr_id,
        next: std::ptr::null_mut(),
        sg_list: sge,
        num_sge: if wr.local.len == 0 { 0 } else { 1 },
        opcode,
        send_flags: sys::SEND_SIGNALED,
        imm_data: imm,
        wr: u,
        _qp_type: 0,
        _pad: 0,
        _bind_mw_or_tso: [0; 6],
    }
}

impl RdmaQp for NativeQp {
    fn qp_num(&self) -> u32 {
        // SAFETY: a live QP the library allocated.
        unsafe { (*self.qp).qp_num }
    }

    fn modify(&self, t: &Transition) -> Result<()> {
        let mut a = qp_attr(t);
        let d = &self.dev.0;
        // SAFETY: a live QP; attributes and mask built together.
        let rc = unsafe { (d.fns.modify_qp)(self.qp, &mut a, t.mask as c_int) };
        if rc != 0 {
            return Err(verbs_error(
                &format!("ibv_modify_qp to {:?}", t.state),
                &d.name,
                rc,
            ));
        }
        Ok(())
    }

    fn post_send(&self, wr: &SendWr) -> Result<()> {
        let mut sge = sys::ibv_sge::default();
        let mut w = send_wr(wr, &mut sge);
        let mut bad = std::ptr::null_mut();
        let post = self.op("post_send", |o| o.post_send)?;
        // SAFETY: verbs.h's inline ibv_post_send: the context's post_send op
        // on a live QP; `w` and `sge` outlive the call (the NIC reads the
        // SGE's memory later, which the caller keeps registered).
        let rc = unsafe { post(self.qp, &mut w, &mut bad) };
        self.check(rc, "ibv_post_send")
    }

    fn post_recv(&self, wr_ids: &[u64]) -> Result<()> {
        let post = self.op("post_recv", |o| o.post_recv)?;
        for &wr_id in wr_ids {
            let mut w = sys::ibv_recv_wr {
                wr_id,
                next: std::ptr::null_mut(),
                sg_list: std::ptr::null_mut(),
                num_sge: 0,
            };
            let mut bad = std::ptr::null_mut();
            // SAFETY: verbs.h's inline ibv_post_recv on a live QP; a receive
            // without buffers (what a write with immediate consumes).
            let rc = unsafe { post(self.qp, &mut w, &mut bad) };
            self.check(rc, "ibv_post_recv")?;
        }
        Ok(())
    }
}

impl NativeQp {
    /// Operation `name` of the QP's context ops table (what verbs.h's
    /// inline functions call).
    fn op<F>(&self, name: &str, get: impl Fn(&sys::ContextOps) -> Option<F>) -> Result<F> {
        // SAFETY: a live QP whose context the library keeps alive.
        let ops = unsafe { &(*(*self.qp).context).ops };
        get(ops).ok_or_else(|| {
            CommError::invalid(
                "RDMA device",
                format!("its context has no {name} operation"),
            )
        })
    }

    fn check(&self, rc: c_int, call: &str) -> Result<()> {
        if rc != 0 {
            return Err(verbs_error(call, &self.dev.0.name, rc));
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::transport::ib::config::IbConfig;
    use crate::transport::ib::device::Sge;
    use crate::transport::ib::qp::{transitions, QpEndpoint};

    #[test]
    fn work_requests_fill_verbs_fields() {
        let local = Sge {
            addr: 0x1000,
            len: 64,
            lkey: 7,
        };
        let mut sge = sys::ibv_sge::default();
        let w = send_wr(
            &SendWr {
                wr_id: 9,
                local,
                op: SendOp::WriteImm {
                    remote_addr: 0x2000,
                    rkey: 0x55,
                    imm: 0x0102_0304,
                },
            },
            &mut sge,
        );
        assert_eq!((w.wr_id, w.opcode, w.num_sge), (9, 1, 1));
        assert_eq!(w.send_flags, sys::SEND_SIGNALED);
        assert_eq!(w.imm_data.to_ne_bytes(), [1, 2, 3, 4], "network order");
        assert_eq!((sge.addr, sge.length, sge.lkey), (0x1000, 64, 7));
        // rdma.rkey sits at byte 8 of the union.
        // SAFETY: reading the bytes of a plain struct.
        let bytes: [u8; 32] = unsafe { std::mem::transmute(w.wr) };
        assert_eq!(&bytes[0..8], &0x2000u64.to_le_bytes());
        assert_eq!(&bytes[8..12], &0x55u32.to_le_bytes());
        let w = send_wr(
            &SendWr {
                wr_id: 1,
                local,
                op: SendOp::FetchAdd {
                    remote_addr: 0x3000,
                    rkey: 0x66,
                    add: u64::MAX,
                },
            },
            &mut sge,
        );
        assert_eq!(w.opcode, sys::WR_ATOMIC_FETCH_AND_ADD);
        // SAFETY: as above.
        let bytes: [u8; 32] = unsafe { std::mem::transmute(w.wr) };
        assert_eq!(&bytes[8..16], &u64::MAX.to_le_bytes(), "compare_add");
        assert_eq!(&bytes[24..28], &0x66u32.to_le_bytes(), "atomic.rkey");
    }

    #[test]
    fn transitions_fill_qp_attr() {
        let ep = |qp, ll| QpEndpoint {
            lid: 3,
            qp_num: qp,
            psn: 0x123,
            gid: [9; 16],
            active_mtu: 5,
            link_layer: ll,
        };
        let cfg = IbConfig {
            gid_index: 2,
            traffic_class: 7,
            ..IbConfig::default()
        };
        let (l, r) = (ep(1, LinkLayer::Ethernet), ep(2, LinkLayer::Ethernet));
        let [init, rtr, rts] = transitions(1, &l, &r, &cfg).unwrap();
        let a = qp_attr(&init);
        assert_eq!((a.qp_state, a.port_num), (1, 1));
        assert_eq!(a.qp_access_flags, 0xF);
        let a = qp_attr(&rtr);
        assert_eq!((a.qp_state, a.dest_qp_num, a.path_mtu), (2, 2, 5));
        assert_eq!((a.ah_attr.is_global, a.ah_attr.grh.sgid_index), (1, 2));
        assert_eq!(a.ah_attr.grh.traffic_class, 7);
        assert_eq!(a.ah_attr.grh.dgid.raw, [9; 16]);
        let a = qp_attr(&rts);
        assert_eq!((a.qp_state, a.sq_psn, a.retry_cnt), (3, 0x123, 7));
    }
}
