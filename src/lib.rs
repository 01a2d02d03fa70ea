//! oxccl: NVIDIA NCCL 2.32.3's C ABI (`libnccl.so.2`) over a Rust runtime.
//!
//! Layers, top to bottom: `abi` (extern "C" entry points) -> `api` (validated calls) ->
//! `group` / `comm` (communicators and deferred work) -> `plan` (a collective becomes a per-rank
//! schedule of steps) -> `exec` (executors that run schedules in stream order) -> `transport`
//! (connections: FIFOs of slots in memory both ends reach) and `bootstrap` (TCP rendezvous).

pub mod abi;
pub mod api;
pub mod bootstrap;
pub mod comm;
pub mod debug;
pub mod device;
pub mod error;
pub mod exec;
pub mod flight;
pub mod gpu;
pub mod group;
pub mod health;
pub mod launch;
pub mod liveness;
pub mod param;
pub mod plan;
pub mod reduce;
pub mod registry;
pub mod transport;
pub mod types;
