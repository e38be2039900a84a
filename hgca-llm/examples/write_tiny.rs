//! Writes a tiny random Llama GGUF (a real byte-level BPE tokenizer, random
//! weights) for trying the pipeline without a download, or as fuzz seeds:
//! `cargo run -p hgca-llm --example write_tiny -- out.gguf [f32|q]`.

use hgca_llm::synth::{SynthSpec, write_tiny_llama};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let path = args.next().ok_or("usage: write_tiny OUT.gguf [f32|q]")?;
    let quantized = args.next().as_deref() != Some("f32");
    let spec = SynthSpec {
        dim: 32,
        n_heads: 2,
        n_kv_heads: 1,
        n_layers: 1,
        ffn_dim: 32,
        quantized,
        ..SynthSpec::default()
    };
    write_tiny_llama(&path, &spec)?;
    println!("{path}: {} bytes", std::fs::metadata(&path)?.len());
    Ok(())
}
