//! zrs-core: every ZeRO-3 decision zrs makes, in plain Rust.
//!
//! The Python layer holds tensors; this crate holds ids, sizes, states and plans, and updates
//! offloaded shards in host memory (`optim`).

pub mod eager;
pub mod error;
pub mod optim;
pub mod plan;
pub mod registry;

pub use error::{Error, Result};
