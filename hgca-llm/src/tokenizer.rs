//! The tokenizer stored in a GGUF file (`tokenizer.ggml.*`), rebuilt with the
//! `tokenizers` crate: GPT-2 byte-level BPE from the vocabulary and merges.

use candle_core::quantized::gguf_file::Value;
use tokenizers::SplitDelimiterBehavior;
use tokenizers::decoders::byte_level::ByteLevel as ByteLevelDecoder;
use tokenizers::models::bpe::BPE;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::{AddedToken, PreTokenizerWrapper, Tokenizer};

use crate::gguf::GgufFile;
use crate::{Error, Result};

/// Qwen2's pre-tokenizer split (llama.cpp's `qwen2` pre-type): contractions,
/// letters with one leading non-letter, single digits, punctuation runs,
/// newlines, spaces.
const QWEN2_SPLIT: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizers a GGUF's `tokenizer.ggml.pre` names.
enum Pre {
    /// GPT-2's split (`gpt2`, `default`).
    Gpt2,
    /// GPT-2's split after splitting digits apart (`smollm`).
    Digits,
    /// Qwen2's regex split, then byte-level without GPT-2's regex.
    Qwen2,
}

/// GGUF token type of control (special) tokens.
const TOKEN_TYPE_CONTROL: i32 = 3;

/// A byte-level BPE tokenizer built from GGUF metadata.
///
/// Supported `tokenizer.ggml.model`: `gpt2`. Supported
/// `tokenizer.ggml.pre`: `smollm` (every digit its own piece, then the
/// GPT-2 split regex, no prefix space) and `gpt2`/`default` (the GPT-2 regex
/// only). Control tokens (type 3) are special tokens, matched whole.
#[derive(Debug, Clone)]
pub struct GgufTokenizer {
    inner: Tokenizer,
    bos: Option<u32>,
    eos: Option<u32>,
    add_bos: bool,
    vocab_size: usize,
}

fn strings(f: &GgufFile, key: &str) -> Result<Vec<String>> {
    f.get_array(key)?
        .iter()
        .map(|v| match v {
            Value::String(s) => Ok(s.clone()),
            v => Err(Error::meta(key, format!("expected strings, found {v:?}"))),
        })
        .collect()
}

impl GgufTokenizer {
    /// Builds the tokenizer from the `tokenizer.ggml.*` metadata of `f`.
    ///
    /// # Errors
    /// [`Error::Metadata`] for a missing key or an unsupported model or
    /// pre-tokenizer; [`Error::Tokenizer`] if the `tokenizers` crate rejects
    /// the vocabulary or merges.
    pub fn from_gguf(f: &GgufFile) -> Result<Self> {
        let model = f.get_str("tokenizer.ggml.model")?;
        if model != "gpt2" {
            return Err(Error::meta(
                "tokenizer.ggml.model",
                format!("only byte-level BPE (`gpt2`) is supported, found `{model}`"),
            ));
        }
        let pre = match f.get_str("tokenizer.ggml.pre") {
            Ok(p) => p.to_owned(),
            Err(_) => "default".to_owned(),
        };
        let pre = match pre.as_str() {
            "smollm" => Pre::Digits,
            "gpt2" | "default" => Pre::Gpt2,
            "qwen2" => Pre::Qwen2,
            other => {
                return Err(Error::meta(
                    "tokenizer.ggml.pre",
                    format!(
                        "pre-tokenizer `{other}` is not supported (smollm, qwen2, gpt2, default)"
                    ),
                ));
            }
        };
        let tokens = strings(f, "tokenizer.ggml.tokens")?;
        let merges = strings(f, "tokenizer.ggml.merges")?;
        let types: Vec<i32> = match f.get_array("tokenizer.ggml.token_type") {
            Ok(a) => a
                .iter()
                .map(|v| v.to_i32().map_err(Error::from))
                .collect::<Result<_>>()?,
            Err(_) => vec![1; tokens.len()],
        };
        if types.len() != tokens.len() {
            return Err(Error::meta(
                "tokenizer.ggml.token_type",
                format!("{} types for {} tokens", types.len(), tokens.len()),
            ));
        }
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(i, t)| (t.clone(), i as u32))
            .collect();
        let merges = merges
            .iter()
            .map(|m| {
                m.split_once(' ')
                    .map(|(a, b)| (a.to_owned(), b.to_owned()))
                    .ok_or_else(|| Error::meta("tokenizer.ggml.merges", format!("bad merge `{m}`")))
            })
            .collect::<Result<Vec<_>>>()?;
        let bpe = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| Error::Tokenizer(crate::error::one_line(&e.to_string())))?;
        let mut inner = Tokenizer::new(bpe);
        let byte_level = ByteLevel::new(false, true, true);
        let pre_tok: PreTokenizerWrapper = match pre {
            Pre::Gpt2 => byte_level.into(),
            Pre::Digits => Sequence::new(vec![Digits::new(true).into(), byte_level.into()]).into(),
            Pre::Qwen2 => {
                let split = Split::new(
                    SplitPattern::Regex(QWEN2_SPLIT.into()),
                    SplitDelimiterBehavior::Isolated,
                    false,
                )
                .map_err(|e| Error::Tokenizer(crate::error::one_line(&e.to_string())))?;
                Sequence::new(vec![
                    split.into(),
                    ByteLevel::new(false, true, false).into(),
                ])
                .into()
            }
        };
        inner.with_pre_tokenizer(Some(pre_tok));
        inner.with_decoder(Some(ByteLevelDecoder::default()));
        let specials: Vec<AddedToken> = tokens
            .iter()
            .zip(&types)
            .filter(|(_, t)| **t == TOKEN_TYPE_CONTROL)
            .map(|(s, _)| AddedToken::from(s.clone(), true))
            .collect();
        inner
            .add_special_tokens(specials)
            .map_err(|e| Error::Tokenizer(crate::error::one_line(&e.to_string())))?;
        let id = |key: &str| -> Result<Option<u32>> {
            match f.get_usize(key) {
                Ok(i) if i < tokens.len() => Ok(Some(i as u32)),
                Ok(i) => Err(Error::meta(key, format!("{i} out of vocabulary"))),
                Err(_) => Ok(None),
            }
        };
        Ok(Self {
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            add_bos: f.get_bool_or("tokenizer.ggml.add_bos_token", false)?,
            vocab_size: tokens.len(),
            inner,
        })
    }

    /// Encodes `text` to token ids (special-token strings become their ids;
    /// the BOS token is prepended when the GGUF asks for it and `add_bos`).
    ///
    /// # Errors
    /// [`Error::Tokenizer`] if the tokenizer fails.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| Error::Tokenizer(crate::error::one_line(&e.to_string())))?;
        let mut ids = Vec::with_capacity(enc.len() + 1);
        if add_bos && self.add_bos {
            ids.extend(self.bos);
        }
        ids.extend_from_slice(enc.get_ids());
        Ok(ids)
    }

    /// Decodes ids to text (special tokens included as text).
    ///
    /// # Errors
    /// [`Error::TokenId`] for an id outside the vocabulary;
    /// [`Error::Tokenizer`] if decoding fails.
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some(&id) = ids.iter().find(|&&i| i as usize >= self.vocab_size) {
            return Err(Error::TokenId {
                id,
                vocab: self.vocab_size,
            });
        }
        self.inner
            .decode(ids, false)
            .map_err(|e| Error::Tokenizer(crate::error::one_line(&e.to_string())))
    }

    /// The token string of `id` (byte-level form, e.g. `Ġthe`).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        self.inner.id_to_token(id)
    }

    /// The id of a token string.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    /// Beginning-of-sequence token.
    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    /// End-of-sequence token.
    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// Vocabulary size.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    /// The underlying `tokenizers` tokenizer.
    pub fn inner(&self) -> &Tokenizer {
        &self.inner
    }
}
