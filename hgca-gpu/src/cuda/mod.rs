//! The CUDA backend (cargo feature `cuda`).
