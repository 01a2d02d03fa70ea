//! The C ABI: `extern "C"` entry points only (filled by the ABI work).
