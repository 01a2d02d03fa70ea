//! Which executor runs: the CUDA driver when present (probed with dlopen before anything touches
//! it), else host slots. The CUDA executor is a later step: with a driver present and no
//! `OXCCL_DEVICE=host`, communicator creation says so instead of running host code on GPU memory.

use once_cell::sync::Lazy;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Host,
    Cuda,
}

fn cuda_driver_present() -> bool {
    // SAFETY: loading libcuda runs its initialisers only; we unload it at once.
    unsafe { libloading::Library::new("libcuda.so.1").is_ok() }
}

static KIND: Lazy<DeviceKind> = Lazy::new(|| match std::env::var("OXCCL_DEVICE").ok().as_deref() {
    Some("host") => DeviceKind::Host,
    _ if cuda_driver_present() => DeviceKind::Cuda,
    _ => DeviceKind::Host,
});

pub fn kind() -> DeviceKind {
    *KIND
}

thread_local! {
    static LOG_DEV: std::cell::Cell<i32> = const { std::cell::Cell::new(0) };
}

pub fn set_log_device(dev: i32) {
    LOG_DEV.with(|d| d.set(dev));
}

pub fn current_device_for_log() -> i32 {
    LOG_DEV.with(|d| d.get())
}
