//! The kinds of executor (which one runs is `gpu::kind`'s choice), and the device number log
//! lines of this thread show.

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    Host,
    Cuda,
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
