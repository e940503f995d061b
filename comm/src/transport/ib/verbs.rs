//! libibverbs, loaded at run time (dlopen), so that moelink builds and runs on
//! machines without rdma-core: where it is missing, or finds no device, the
//! transport says so (`CommError::NoRdma`) and nothing else changes.
//!
//! The exported functions are bound here (`Fns`); the verbs rdma-core
//! implements as static inline calls through a context's ops table (post
//! send, post receive, poll CQ) are called the same way by [`super::native`],
//! which implements [`super::device`] on top of both.

use std::ffi::{c_char, c_int, c_void, CStr, CString};

use crate::error::{CommError, Result};

use super::config::HcaFilter;
use super::device::RdmaProvider;
use super::sys;

/// Library names tried in order (the SONAME first).
pub const LIBRARY_NAMES: [&str; 2] = ["libibverbs.so.1", "libibverbs.so"];

type GetDeviceList = unsafe extern "C" fn(*mut c_int) -> *mut *mut c_void;
type FreeDeviceList = unsafe extern "C" fn(*mut *mut c_void);
type GetDeviceName = unsafe extern "C" fn(*mut c_void) -> *const c_char;

/// The exported functions of libibverbs moelink calls (verbs.h signatures;
/// the default symbol versions, IBVERBS_1.1 and later).
#[derive(Clone, Copy)]
pub(crate) struct Fns {
    pub get_device_list: GetDeviceList,
    pub free_device_list: FreeDeviceList,
    pub get_device_name: GetDeviceName,
    pub open_device: unsafe extern "C" fn(*mut c_void) -> *mut sys::ibv_context,
    pub close_device: unsafe extern "C" fn(*mut sys::ibv_context) -> c_int,
    pub query_device:
        unsafe extern "C" fn(*mut sys::ibv_context, *mut sys::ibv_device_attr) -> c_int,
    pub query_port:
        unsafe extern "C" fn(*mut sys::ibv_context, u8, *mut sys::ibv_port_attr) -> c_int,
    pub query_gid:
        unsafe extern "C" fn(*mut sys::ibv_context, u8, c_int, *mut sys::ibv_gid) -> c_int,
    pub alloc_pd: unsafe extern "C" fn(*mut sys::ibv_context) -> *mut c_void,
    pub dealloc_pd: unsafe extern "C" fn(*mut c_void) -> c_int,
    pub reg_mr: unsafe extern "C" fn(*mut c_void, *mut c_void, usize, c_int) -> *mut sys::ibv_mr,
    /// Absent before rdma-core 34 (IBVERBS_1.12).
    pub reg_dmabuf_mr: Option<
        unsafe extern "C" fn(*mut c_void, u64, usize, u64, c_int, c_int) -> *mut sys::ibv_mr,
    >,
    pub dereg_mr: unsafe extern "C" fn(*mut sys::ibv_mr) -> c_int,
    pub create_cq: unsafe extern "C" fn(
        *mut sys::ibv_context,
        c_int,
        *mut c_void,
        *mut c_void,
        c_int,
    ) -> *mut sys::ibv_cq,
    pub destroy_cq: unsafe extern "C" fn(*mut sys::ibv_cq) -> c_int,
    pub create_qp:
        unsafe extern "C" fn(*mut c_void, *mut sys::ibv_qp_init_attr) -> *mut sys::ibv_qp,
    pub modify_qp: unsafe extern "C" fn(*mut sys::ibv_qp, *mut sys::ibv_qp_attr, c_int) -> c_int,
    pub destroy_qp: unsafe extern "C" fn(*mut sys::ibv_qp) -> c_int,
}

/// An open libibverbs (kept open for the process's life once loaded).
pub struct Verbs {
    handle: *mut c_void,
    pub(crate) fns: Fns,
}

// SAFETY: the handle and function pointers are process-global and libibverbs'
// functions are thread-safe.
unsafe impl Send for Verbs {}
// SAFETY: as above.
unsafe impl Sync for Verbs {}

impl std::fmt::Debug for Verbs {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Verbs")
            .field("handle", &self.handle)
            .finish()
    }
}

/// A symbol's address as the function pointer type `F`.
///
/// # Safety
/// `F` is an `extern "C" fn` type matching the symbol's C signature.
unsafe fn fn_ptr<F: Copy>(p: *mut c_void) -> F {
    assert_eq!(std::mem::size_of::<F>(), std::mem::size_of::<*mut c_void>());
    // SAFETY: same size (checked); the caller's contract makes the bits a
    // valid function pointer of type F.
    unsafe { std::mem::transmute_copy(&p) }
}

fn dlerror_text() -> String {
    // SAFETY: dlerror returns a thread-local C string or null.
    let p = unsafe { libc::dlerror() };
    if p.is_null() {
        "unknown dlopen error".into()
    } else {
        // SAFETY: non-null, NUL-terminated (dlerror's contract).
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }
}

impl Verbs {
    /// Opens the first of `names` that loads; `NoRdma` naming them otherwise.
    pub fn load_from(names: &[&str]) -> Result<Self> {
        let mut tried = Vec::new();
        for name in names {
            let c =
                CString::new(*name).map_err(|_| CommError::invalid("library", "NUL in name"))?;
            // SAFETY: a valid C string; RTLD_NOW resolves everything up front.
            let handle = unsafe { libc::dlopen(c.as_ptr(), libc::RTLD_NOW | libc::RTLD_LOCAL) };
            if handle.is_null() {
                tried.push(format!("{name}: {}", dlerror_text()));
                continue;
            }
            let sym = |s: &str| -> Option<*mut c_void> {
                let cs = CString::new(s).expect("symbol names have no NUL");
                // SAFETY: handle is open; cs is a valid C string.
                let p = unsafe { libc::dlsym(handle, cs.as_ptr()) };
                (!p.is_null()).then_some(p)
            };
            let need = |s: &str| -> Result<*mut c_void> {
                sym(s).ok_or_else(|| CommError::NoRdma {
                    reason: format!("{name} lacks {s} ({})", dlerror_text()),
                })
            };
            // Each field of `Fns` is bound to the symbol of its name with the
            // `ibv_` prefix.
            macro_rules! bind {
                ($($field:ident),* ; optional: $($opt:ident),*) => {
                    Fns {
                        $($field: {
                            let p = need(concat!("ibv_", stringify!($field)))?;
                            // SAFETY: the symbol has the C signature of the
                            // field it is stored in (verbs.h).
                            unsafe { fn_ptr(p) }
                        },)*
                        $($opt: sym(concat!("ibv_", stringify!($opt))).map(|p| {
                            // SAFETY: as above, where the symbol exists.
                            unsafe { fn_ptr(p) }
                        }),)*
                    }
                };
            }
            let fns = bind!(
                get_device_list,
                free_device_list,
                get_device_name,
                open_device,
                close_device,
                query_device,
                query_port,
                query_gid,
                alloc_pd,
                dealloc_pd,
                reg_mr,
                dereg_mr,
                create_cq,
                destroy_cq,
                create_qp,
                modify_qp,
                destroy_qp;
                optional: reg_dmabuf_mr
            );
            return Ok(Verbs { handle, fns });
        }
        Err(CommError::NoRdma {
            reason: format!(
                "libibverbs (rdma-core) is not installed: {}",
                tried.join("; ")
            ),
        })
    }

    pub fn load() -> Result<Self> {
        Self::load_from(&LIBRARY_NAMES)
    }

    /// The names of every RDMA device libibverbs finds.
    pub fn device_names(&self) -> Result<Vec<String>> {
        let mut n: c_int = 0;
        // SAFETY: an out-parameter; the list is freed below.
        let list = unsafe { (self.fns.get_device_list)(&mut n) };
        if list.is_null() {
            return Err(CommError::NoRdma {
                reason: format!(
                    "ibv_get_device_list failed ({})",
                    std::io::Error::last_os_error()
                ),
            });
        }
        let names = (0..n.max(0) as usize)
            .map(|i| {
                // SAFETY: i < n entries of a list libibverbs returned.
                let dev = unsafe { *list.add(i) };
                // SAFETY: dev is a device of the list; the name is a C string.
                let p = unsafe { (self.fns.get_device_name)(dev) };
                if p.is_null() {
                    String::new()
                } else {
                    // SAFETY: non-null, NUL-terminated.
                    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
                }
            })
            .collect();
        // SAFETY: the list came from get_device_list and is freed once.
        unsafe { (self.fns.free_device_list)(list) };
        Ok(names)
    }
}

/// The RDMA devices this process may use under `filter` (by name; ports are
/// chosen when queue pairs are built), or `NoRdma` saying why there are none.
pub fn usable_devices(provider: &dyn RdmaProvider, filter: &HcaFilter) -> Result<Vec<String>> {
    let found = provider.device_names()?;
    if found.is_empty() {
        return Err(CommError::NoRdma {
            reason: "libibverbs finds no RDMA device on this machine".into(),
        });
    }
    let allowed: Vec<String> = found
        .iter()
        .filter(|d| filter.specs.is_empty() || filter.allows(d, any_port(filter, d)))
        .cloned()
        .collect();
    if allowed.is_empty() {
        return Err(CommError::NoRdma {
            reason: format!("MOELINK_IB_HCA allows none of the devices found: {found:?}"),
        });
    }
    Ok(allowed)
}

/// A port `filter` names for `device` (so that a name match with a port still
/// counts at device level), else port 1.
fn any_port(filter: &HcaFilter, device: &str) -> u8 {
    filter
        .specs
        .iter()
        .filter(|s| device.starts_with(&s.name))
        .find_map(|s| s.port)
        .unwrap_or(1)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_missing_library_is_no_rdma_naming_what_was_tried() {
        let e = Verbs::load_from(&["libmoelink-no-such-verbs.so.1"]).unwrap_err();
        assert!(matches!(e, CommError::NoRdma { .. }), "{e:?}");
        let s = e.to_string();
        assert!(
            s.starts_with("no RDMA device available: libibverbs (rdma-core) is not installed"),
            "{s}"
        );
        assert!(s.contains("libmoelink-no-such-verbs.so.1"), "{s}");
    }

    #[test]
    fn the_real_library_loads_or_says_why_not() {
        // Either way the answer is clean: no panic, no crash, a NoRdma error
        // or a device list (machines here have no RDMA device).
        match Verbs::load().and_then(|v| usable_devices(&v, &HcaFilter::default())) {
            Ok(devs) => assert!(devs.iter().all(|d| !d.is_empty())),
            Err(e) => assert!(matches!(e, CommError::NoRdma { .. }), "{e:?}"),
        }
    }

    #[test]
    fn device_level_filtering_honours_ports_in_the_list() {
        let f = HcaFilter::parse("V", "=mlx5_1:2").unwrap();
        assert_eq!(any_port(&f, "mlx5_1"), 2);
        assert!(f.allows("mlx5_1", any_port(&f, "mlx5_1")));
        assert!(!f.allows("mlx5_0", any_port(&f, "mlx5_0")));
    }
}
