//! Connections between two ranks: FIFOs of slots in memory both ends reach.
