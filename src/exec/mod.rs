//! Executors that run schedules in stream order.
