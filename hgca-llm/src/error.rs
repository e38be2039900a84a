//! The error type of hgca-llm.

use std::path::PathBuf;

/// Everything that can go wrong loading or running a model.
///
/// A variant that wraps another library's error (candle, hgca, I/O) says
/// what hgca-llm was doing and keeps the error as its
/// [`source`](std::error::Error::source); print it whole with
/// [`hgca_kernels::report`].
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An error of candle (tensor ops, quantised matmul), without the
    /// backtrace candle captures under `RUST_BACKTRACE`.
    #[error("candle")]
    Candle(#[source] candle_core::Error),
    /// A GGUF file is malformed or truncated: one line, the file and the cause.
    #[error("{}: not a usable GGUF file: {msg}", path.display())]
    Gguf {
        /// The file.
        path: PathBuf,
        /// What is wrong (and where).
        msg: String,
    },
    /// An error of the attention layer (hgca).
    #[error("attention")]
    Attention(#[from] hgca_kernels::Error),
    /// A file could not be opened or read.
    #[error("{path}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        source: std::io::Error,
    },
    /// The tokenizer could not be built, or failed to encode/decode.
    #[error("tokenizer: {0}")]
    Tokenizer(String),
    /// A GGUF metadata entry is missing or has the wrong type or value.
    #[error("gguf metadata `{key}`: {msg}")]
    Metadata {
        /// The metadata key.
        key: String,
        /// What is wrong.
        msg: String,
    },
    /// A GGUF tensor is missing or has an unexpected shape.
    #[error("gguf tensor `{name}`: expected {expected}, found {found}")]
    Tensor {
        /// The tensor name.
        name: String,
        /// What was expected (shape), in words.
        expected: String,
        /// What was found.
        found: String,
    },
    /// A token id is not in the vocabulary.
    #[error("token id {id} out of range for a vocabulary of {vocab}")]
    TokenId {
        /// The id found.
        id: u32,
        /// The vocabulary size.
        vocab: usize,
    },
    /// A parameter or input is invalid.
    #[error("{what}: {msg}")]
    Invalid {
        /// Which parameter.
        what: &'static str,
        /// What is wrong.
        msg: String,
    },
}

impl From<candle_core::Error> for Error {
    fn from(e: candle_core::Error) -> Self {
        // candle wraps errors in a backtrace (20 frames of its internals)
        // when RUST_BACKTRACE is set: a user needs the cause.
        let mut e = e;
        while let candle_core::Error::WithBacktrace { inner, .. } = e {
            e = *inner;
        }
        Self::Candle(e)
    }
}

impl Error {
    /// A parse error of `path`'s bytes as [`Error::Gguf`] naming the file.
    pub(crate) fn in_file(self, path: &std::path::Path) -> Self {
        match self {
            Self::Gguf { msg, .. } => Self::Gguf {
                path: path.to_path_buf(),
                msg,
            },
            Self::Candle(e) => Self::Gguf {
                path: path.to_path_buf(),
                msg: one_line(&e.to_string()),
            },
            e => e,
        }
    }

    pub(crate) fn invalid(what: &'static str, msg: impl Into<String>) -> Self {
        Self::Invalid {
            what,
            msg: msg.into(),
        }
    }

    /// `msg` may quote the file's own strings: control characters (a
    /// newline in a merge rule) are escaped so an error stays one line.
    pub(crate) fn meta(key: &str, msg: impl Into<String>) -> Self {
        Self::Metadata {
            key: one_line(key),
            msg: one_line(&msg.into()),
        }
    }
}

/// `s` with control characters escaped (`\n` for a newline).
pub(crate) fn one_line(s: &str) -> String {
    s.chars()
        .map(|c| {
            if c.is_control() {
                c.escape_default().to_string()
            } else {
                c.to_string()
            }
        })
        .collect()
}

/// `Result` with [`Error`].
pub type Result<T, E = Error> = std::result::Result<T, E>;
