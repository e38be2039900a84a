//! Checks against the real SmolLM2-135M GGUF and Austen's text, when
//! `scripts/fetch-model.sh` has fetched them (skipped with a message otherwise).

use std::path::PathBuf;
use std::sync::Arc;

use hgca_llm::{GgufFile, GgufTokenizer, LlamaWeights, PplOptions, WeightFormat, perplexity};

fn repo_file(rel: &str) -> Option<PathBuf> {
    let p = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(rel);
    if p.exists() {
        Some(p)
    } else {
        eprintln!(
            "SKIP: {} missing (run `bash scripts/fetch-model.sh`)",
            p.display()
        );
        None
    }
}

#[test]
fn smollm2_tokenizer_and_short_perplexity() {
    let Some(model) = repo_file(hgca_llm::DEFAULT_MODEL) else {
        return;
    };
    let mut f = GgufFile::open(&model).unwrap();
    let tok = GgufTokenizer::from_gguf(&f).unwrap();
    assert_eq!(tok.vocab_size(), 49152);
    for text in [
        "Hello world",
        "Sir Walter Elliot, of Kellynch Hall, 1760.",
        "café 🦀\n\n  x",
    ] {
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), text);
    }
    assert_eq!(
        tok.encode("1760", false).unwrap().len(),
        4,
        "digits split one by one"
    );
    let hello = tok.encode("Hello world", false).unwrap();
    assert_eq!(hello.len(), 2, "{hello:?}");
    assert_eq!(tok.encode("<|im_start|>", false).unwrap(), vec![1]);

    let Some(text) = repo_file(hgca_llm::DEFAULT_TEXT) else {
        return;
    };
    let text = std::fs::read_to_string(text).unwrap();
    let start = text.find("Chapter 1").unwrap();
    let mut ids = tok.encode(&text[start..start + 2000], false).unwrap();
    ids.truncate(256);
    let w = Arc::new(LlamaWeights::load(&mut f, WeightFormat::F32).unwrap());
    let full = hgca_llm::full_attention::<f32>();
    let opts = PplOptions {
        context: 256,
        chunk: 128,
        ..PplOptions::default()
    };
    let r = perplexity(&w, &ids, opts, full, |_| {}).unwrap();
    // 256 tokens of Persuasion: a real model is far below uniform (49152).
    assert!(r.ppl > 5.0 && r.ppl < 120.0, "ppl {}", r.ppl);
}
