//! hgca-hybrid's integration tests, one binary (four before: each built the
//! layers' generic instantiations and linked again).

mod batch;
mod ffn;
mod hybrid;
mod stress;
