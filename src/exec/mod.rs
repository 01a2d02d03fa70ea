//! Executors run planned work in stream order. `host` runs programs on host memory (CPU copies
//! and reductions, polling the connections' counters); the CUDA executor (a later step) runs the
//! same programs with the same counters on a GPU stream.

mod board;
mod copy;
pub mod host;
pub mod lone;
mod steps;
pub mod task;

pub use task::Task;
