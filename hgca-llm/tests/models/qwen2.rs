//! Checks against the real Qwen2.5-Coder-0.5B-Instruct GGUF, when
//! `scripts/fetch-model.sh --qwen2` has fetched it (skipped with a message
//! otherwise: 490 MB are not fetched by the test command).

use std::path::PathBuf;
use std::sync::Arc;

use hgca_llm::{Arch, GgufFile, GgufTokenizer, Llama, LlamaWeights, Logits, WeightFormat, argmax};

fn model() -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(hgca_llm::QWEN2_MODEL);
    if p.exists() {
        Some(p)
    } else {
        eprintln!(
            "SKIP: {} missing (run `bash scripts/fetch-model.sh --qwen2`)",
            p.display()
        );
        None
    }
}

/// The tokenizer round-trips, the config is Qwen2's, and a greedy answer to
/// a coding request is a Python function (a wrong RoPE pairing, a missing
/// bias or a broken pre-tokenizer gives text that is not).
#[test]
fn qwen2_answers_a_coding_request() {
    let Some(path) = model() else {
        return;
    };
    let mut f = GgufFile::open(&path).unwrap();
    let tok = GgufTokenizer::from_gguf(&f).unwrap();
    for text in [
        "def add(a, b):\n    return a + b",
        "Sir Walter Elliot, 1760.",
        "café 🦀  x",
    ] {
        assert_eq!(tok.decode(&tok.encode(text, false).unwrap()).unwrap(), text);
    }
    let w = Arc::new(LlamaWeights::load(&mut f, WeightFormat::Auto).unwrap());
    let c = w.config();
    assert_eq!(
        (c.arch, c.n_layers, c.n_heads, c.n_kv_heads, c.head_dim),
        (Arch::Qwen2, 24, 14, 2, 64)
    );
    let prompt = "<|im_start|>user\nWrite a Python function that returns the sum of a list.<|im_end|>\n<|im_start|>assistant\n";
    let mut m = Llama::with_full_attention::<f32>(Arc::clone(&w)).unwrap();
    let mut logits = m
        .forward(&tok.encode(prompt, false).unwrap(), Logits::Last)
        .unwrap();
    let mut out = Vec::new();
    for _ in 0..40 {
        let next = argmax(&logits).unwrap() as u32;
        out.push(next);
        logits = m.forward(&[next], Logits::Last).unwrap();
    }
    let text = tok.decode(&out).unwrap();
    println!("qwen2 answer: {text:?}");
    assert!(text.contains("def "), "not a Python function: {text:?}");
}
