//! zrs-core: every ZeRO-3 decision zrs makes, in plain Rust.
//!
//! The Python layer holds tensors; this crate holds ids, sizes, states and plans.

pub mod eager;
pub mod error;
pub mod plan;
pub mod registry;

pub use error::{Error, Result};
