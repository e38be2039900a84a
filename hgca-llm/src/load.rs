//! Reading the commands' inputs: the model (tokenizer and weights) and the
//! first tokens of a text.

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use hgca_llm::{Error, GgufFile, GgufTokenizer, LlamaWeights, Result, WeightFormat};

use crate::cli::{Cli, Weights};

fn missing(path: &Path, what: &str) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        source: std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("{what} not found: run `bash scripts/fetch-model.sh` first"),
        ),
    }
}

pub(crate) fn load(cli: &Cli) -> Result<(GgufTokenizer, Arc<LlamaWeights>)> {
    if !cli.model.exists() {
        return Err(missing(&cli.model, "model"));
    }
    let t0 = Instant::now();
    let mut f = GgufFile::open(&cli.model)?;
    let tok = GgufTokenizer::from_gguf(&f)?;
    let format = match cli.weights {
        Weights::Q => WeightFormat::Quantized,
        Weights::F32 => WeightFormat::F32,
        Weights::Q8 => WeightFormat::Q8,
        Weights::Auto => WeightFormat::Auto,
        Weights::Native => WeightFormat::Native,
    };
    let w = LlamaWeights::load(&mut f, format)?;
    let c = w.config();
    eprintln!(
        "model: {} ({}, {} layers, d={}, {}q/{}kv heads x {}, ffn {}, vocab {}, rope base {}), weights {:?}, KV {:?}, loaded in {:.1}s",
        cli.model.display(),
        c.arch.name(),
        c.n_layers,
        c.dim,
        c.n_heads,
        c.n_kv_heads,
        c.head_dim,
        c.ffn_dim,
        c.vocab_size,
        c.rope_theta,
        format,
        cli.kv,
        t0.elapsed().as_secs_f64()
    );
    Ok((tok, Arc::new(w)))
}

pub(crate) fn read_tokens(
    tok: &GgufTokenizer,
    path: &Path,
    from: &str,
    n: usize,
) -> Result<Vec<u32>> {
    let text = read_text(path)?;
    let start = if from.is_empty() {
        0
    } else {
        text.find(from).ok_or_else(|| Error::Invalid {
            what: "--from",
            msg: format!("`{from}` does not occur in {}", path.display()),
        })?
    };
    // Tokenize a prefix that surely holds n tokens (> 1 byte per token), growing if not.
    let mut len = (n * 8).max(1024);
    loop {
        let mut end = (start + len).min(text.len());
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let mut ids = tok.encode(&text[start..end], false)?;
        if ids.len() > n || end == text.len() {
            if ids.len() < n {
                return Err(Error::Invalid {
                    what: "--tokens",
                    msg: format!("the text has only {} tokens after `{from}`", ids.len()),
                });
            }
            ids.truncate(n);
            return Ok(ids);
        }
        len *= 2;
    }
}

/// A haystack for the retrieval commands: the tokens of the whole text
/// from its first "Chapter 1" (past a title page), or from its start.
pub(crate) fn haystack(tok: &GgufTokenizer, path: &Path) -> Result<Vec<u32>> {
    let raw = read_text(path)?;
    let body = raw.find("Chapter 1").map_or(raw.as_str(), |i| &raw[i..]);
    tok.encode(body, false)
}

/// The whole text file, or an error saying how to fetch it.
fn read_text(path: &Path) -> Result<String> {
    if !path.exists() {
        return Err(missing(path, "text"));
    }
    std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })
}
