//! The tokenizer stored in a GGUF file (`tokenizer.ggml.*`): GPT-2
//! byte-level BPE from the vocabulary and merges, rebuilt with the
//! `tokenizers` crate, or SentencePiece BPE from the vocabulary and scores
//! ([`crate::spm`]).

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

/// The two kinds of tokenizer.
#[derive(Debug, Clone)]
enum Inner {
    Bpe(Box<Tokenizer>),
    Spm(Box<crate::spm::Spm>),
}

/// A tokenizer built from GGUF metadata.
///
/// Supported `tokenizer.ggml.model`: `gpt2` (byte-level BPE) and `llama`
/// (SentencePiece BPE with scores and byte fallback, no prefix space: as
/// Gemma ships it). Supported `tokenizer.ggml.pre` for `gpt2`: `smollm`
/// (every digit its own piece, then the GPT-2 split regex, no prefix
/// space), `qwen2` and `gpt2`/`default` (the GPT-2 regex only). Control
/// tokens (type 3) are special tokens, matched whole (and for `llama` the
/// user-defined ones, type 4, as llama.cpp does).
#[derive(Debug, Clone)]
pub struct GgufTokenizer {
    inner: Inner,
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
        if model == "llama" {
            return Self::spm(f);
        }
        if model != "gpt2" {
            return Err(Error::meta(
                "tokenizer.ggml.model",
                format!(
                    "`gpt2` (byte-level BPE) and `llama` (SentencePiece) are supported, found `{model}`"
                ),
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
        let types = token_types(f, tokens.len())?;
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
        Self::with_ids(f, Inner::Bpe(Box::new(inner)), tokens.len())
    }

    /// The SentencePiece tokenizer of `f` (`tokenizer.ggml.model = llama`).
    fn spm(f: &GgufFile) -> Result<Self> {
        let add_prefix = f.get_bool_or("tokenizer.ggml.add_space_prefix", true)?;
        if add_prefix {
            return Err(Error::meta(
                "tokenizer.ggml.add_space_prefix",
                "a SentencePiece vocabulary that adds a prefix space is not supported".to_owned(),
            ));
        }
        let tokens = strings(f, "tokenizer.ggml.tokens")?;
        let scores: Vec<f32> = f
            .get_array("tokenizer.ggml.scores")?
            .iter()
            .map(|v| v.to_f32().map_err(Error::from))
            .collect::<Result<_>>()?;
        if scores.len() != tokens.len() {
            return Err(Error::meta(
                "tokenizer.ggml.scores",
                format!("{} scores for {} tokens", scores.len(), tokens.len()),
            ));
        }
        let types = token_types(f, tokens.len())?;
        let n = tokens.len();
        let unk = match f.get_usize("tokenizer.ggml.unknown_token_id") {
            Ok(i) if i < n => Some(i as u32),
            _ => None,
        };
        let spm = crate::spm::Spm::new(tokens, scores, &types, unk);
        Self::with_ids(f, Inner::Spm(Box::new(spm)), n)
    }

    /// Adds the BOS/EOS settings of `f` to a tokenizer of `n` tokens.
    fn with_ids(f: &GgufFile, inner: Inner, n: usize) -> Result<Self> {
        let id = |key: &str| -> Result<Option<u32>> {
            match f.get_usize(key) {
                Ok(i) if i < n => Ok(Some(i as u32)),
                Ok(i) => Err(Error::meta(key, format!("{i} out of vocabulary"))),
                Err(_) => Ok(None),
            }
        };
        Ok(Self {
            bos: id("tokenizer.ggml.bos_token_id")?,
            eos: id("tokenizer.ggml.eos_token_id")?,
            add_bos: f.get_bool_or("tokenizer.ggml.add_bos_token", false)?,
            vocab_size: n,
            inner,
        })
    }

    /// Encodes `text` to token ids (special-token strings become their ids;
    /// the BOS token is prepended when the GGUF asks for it and `add_bos`).
    ///
    /// # Errors
    /// [`Error::Tokenizer`] if the tokenizer fails.
    pub fn encode(&self, text: &str, add_bos: bool) -> Result<Vec<u32>> {
        let mut ids = Vec::new();
        if add_bos && self.add_bos {
            ids.extend(self.bos);
        }
        match &self.inner {
            Inner::Bpe(t) => {
                let enc = t
                    .encode(text, false)
                    .map_err(|e| Error::Tokenizer(crate::error::one_line(&e.to_string())))?;
                ids.extend_from_slice(enc.get_ids());
            }
            Inner::Spm(s) => s.encode(text, &mut ids),
        }
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
        match &self.inner {
            Inner::Bpe(t) => t
                .decode(ids, false)
                .map_err(|e| Error::Tokenizer(crate::error::one_line(&e.to_string()))),
            Inner::Spm(s) => Ok(s.decode(ids)),
        }
    }

    /// The token string of `id` (the vocabulary's form, e.g. `Ġthe` for
    /// byte-level BPE, `▁the` for SentencePiece).
    pub fn id_to_token(&self, id: u32) -> Option<String> {
        match &self.inner {
            Inner::Bpe(t) => t.id_to_token(id),
            Inner::Spm(s) => s.piece(id).map(str::to_owned),
        }
    }

    /// The id of a token string.
    pub fn token_to_id(&self, token: &str) -> Option<u32> {
        match &self.inner {
            Inner::Bpe(t) => t.token_to_id(token),
            Inner::Spm(s) => s.id(token),
        }
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

    /// The underlying `tokenizers` tokenizer (byte-level BPE only).
    pub fn inner(&self) -> Option<&Tokenizer> {
        match &self.inner {
            Inner::Bpe(t) => Some(t),
            Inner::Spm(_) => None,
        }
    }
}

/// A model's chat format: what opens a user turn and an assistant turn,
/// what closes a turn, and the token that ends the assistant's.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ChatFormat {
    /// Opens a user turn (`<|im_start|>user\n`).
    pub user: &'static str,
    /// Opens the assistant's turn (`<|im_start|>assistant\n`).
    pub assistant: &'static str,
    /// Closes a turn (`<|im_end|>\n`).
    pub end_turn: &'static str,
    /// The token the assistant ends its turn with.
    pub end: u32,
}

impl ChatFormat {
    /// A one-turn prompt: `message` as the user's, then the assistant's turn opened.
    pub fn prompt(&self, message: &str) -> String {
        format!("{}{message}{}{}", self.user, self.end_turn, self.assistant)
    }
}

impl GgufTokenizer {
    /// The chat format the vocabulary's special tokens name: ChatML
    /// (`<|im_start|>`, `<|im_end|>`: SmolLM2, Qwen2) or Gemma's
    /// (`<start_of_turn>`, `<end_of_turn>`, the assistant being `model`);
    /// `None` for another vocabulary.
    pub fn chat_format(&self) -> Option<ChatFormat> {
        if let Some(end) = self.token_to_id("<|im_end|>") {
            return Some(ChatFormat {
                user: "<|im_start|>user\n",
                assistant: "<|im_start|>assistant\n",
                end_turn: "<|im_end|>\n",
                end,
            });
        }
        let end = self.token_to_id("<end_of_turn>")?;
        self.token_to_id("<start_of_turn>")?;
        Some(ChatFormat {
            user: "<start_of_turn>user\n",
            assistant: "<start_of_turn>model\n",
            end_turn: "<end_of_turn>\n",
            end,
        })
    }
}

/// `tokenizer.ggml.token_type`, all normal (1) when absent.
fn token_types(f: &GgufFile, n: usize) -> Result<Vec<i32>> {
    let types: Vec<i32> = match f.get_array("tokenizer.ggml.token_type") {
        Ok(a) => a
            .iter()
            .map(|v| v.to_i32().map_err(Error::from))
            .collect::<Result<_>>()?,
        Err(_) => vec![1; n],
    };
    if types.len() != n {
        return Err(Error::meta(
            "tokenizer.ggml.token_type",
            format!("{} types for {} tokens", types.len(), n),
        ));
    }
    Ok(types)
}
