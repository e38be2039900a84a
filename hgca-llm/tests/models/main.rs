//! hgca-llm's integration tests, one binary: each module was a test target
//! of its own, and each linked candle, tokenizers and the model code again
//! (most of their build time).

mod gemma3;
mod ggml_blocks;
mod pipeline;
mod qwen2;
mod reference_forward;
mod ruler_cli;
mod smollm2;
