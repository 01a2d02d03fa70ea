//! The GPU as the layers below the executors see it: which executor runs (`kind`), the CUDA
//! driver API (`driver`, loaded at run time), and memory the GPU reaches (`memory`).
//!
//! The CUDA executor runs when a CUDA driver is found (loaded with dlopen, every function it
//! needs resolved, at least one device), else the host executor on host slots; but a driver
//! that sees a device and lacks a function the executor needs (too old) is an error at the
//! first communicator, not the host executor, which would dereference device pointers.
//! `OXCCL_DEVICE=host` forces the host executor; `OXCCL_DEVICE=cuda` the CUDA executor (whose
//! first use then fails with a message naming what is missing where there is no usable driver).

pub mod driver;
pub mod memory;
pub mod topo;

pub use crate::device::DeviceKind as Kind;
use once_cell::sync::Lazy;

/// The executor of this process (decided once).
pub fn kind() -> Kind {
    *KIND
}

static KIND: Lazy<Kind> = Lazy::new(|| match std::env::var("OXCCL_DEVICE").ok().as_deref() {
    Some("host") => Kind::Host,
    // Asked for: the first use reports what is missing if the driver cannot be used.
    Some("cuda") => Kind::Cuda,
    _ if usable_driver() => Kind::Cuda,
    _ => Kind::Host,
});

/// A driver that loads, has every function the CUDA executor calls, and sees a device.
fn usable_driver() -> bool {
    if !driver::present() {
        return false;
    }
    match driver::device_count() {
        Ok(n) if n > 0 => true,
        Ok(_) => {
            crate::debug::warn(
                "a CUDA driver is installed but sees no device: using the host executor",
            );
            false
        }
        // A driver too old for the executor (a function it lacks) that sees a device: the
        // process's buffers are device memory, which the host executor would dereference.
        // The CUDA executor then, whose first use fails with this error.
        Err(e) if driver::sees_devices() => {
            crate::debug::warn(&format!(
                "{}: the CUDA executor cannot run, and communicators fail",
                e.msg
            ));
            true
        }
        Err(e) => {
            crate::debug::warn(&format!("{}: using the host executor", e.msg));
            false
        }
    }
}
