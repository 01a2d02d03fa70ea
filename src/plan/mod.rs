//! Planning: a collective becomes a per-rank schedule of steps.
