//! Fuzzes the GGUF loader with mutated files (seeded with tiny random Llama
//! GGUFs): parsing, the config, the tokenizer and the weights either load
//! or give a one-line typed error; never a panic, and never an allocation
//! sized by a header field the file does not back (the run's
//! `-malloc_limit_mb` fails any allocation past the cap).
#![no_main]

use hgca_llm::{GgufFile, GgufTokenizer, LlamaConfig, LlamaWeights, WeightFormat};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|bytes: &[u8]| {
    let Ok(mut f) = GgufFile::from_bytes("fuzz.gguf", bytes.to_vec()) else {
        return;
    };
    let one_line = |e: hgca_llm::Error| assert!(!e.to_string().contains('\n'), "{e}");
    match LlamaConfig::from_gguf(&f) {
        Ok(c) => {
            // Loading reads and converts every tensor: skip configs whose
            // weights would not fit a small file anyway (checked by the loader).
            if c.dim * c.ffn_dim > 1 << 20 || c.vocab_size * c.dim > 1 << 22 {
                return;
            }
        }
        Err(e) => return one_line(e),
    }
    if let Err(e) = GgufTokenizer::from_gguf(&f) {
        one_line(e);
    }
    if let Err(e) = LlamaWeights::load(&mut f, WeightFormat::default()) {
        one_line(e);
    }
});
