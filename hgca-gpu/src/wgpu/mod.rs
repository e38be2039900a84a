//! The wgpu backend (cargo feature `wgpu`).
