//! hgca-cpu's integration tests, one binary (three before: each built the
//! kernels' generic instantiations and linked again).

#[macro_use]
mod common;

mod conformance;
mod ffn;
mod qdot;
