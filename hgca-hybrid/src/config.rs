//! The configuration of the hybrid layer: the recovery rule and the
//! window, block, sink and MAW settings, checked once at construction.

use hgca_kernels::{Alpha, AttnShape, Beta, Error, MassTarget, Result, check_len};

/// How CPU entries whose importance rises get back into the selection.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum Recovery {
    /// The paper: MAW of CPU entries changes only when they are attended;
    /// an entry below the threshold never comes back between appends.
    Frozen,
    /// Every `every` decode steps, attend to *all* CPU entries exactly
    /// (that step is full attention) and refresh every entry's MAW.
    Rescore {
        /// Period in decode steps (>= 1).
        every: usize,
    },
    /// Quest-style: per block of the CPU store, elementwise key bounds give
    /// an upper bound of any score in the block; each step admits the `top`
    /// blocks with the highest bound (per KV head) on top of the MAW rule.
    BlockBounds {
        /// Blocks admitted per step and KV head.
        top: usize,
    },
    /// Mass-targeted (top-p): per KV head and step, CPU entries are
    /// admitted in decreasing estimated weight until the estimated share of
    /// the attention mass (window included) they leave out is at most
    /// `1 - target`; a head that would need more than `max_share` of the
    /// CPU entries takes all of them that step (counted in
    /// [`StepStats::dense_heads`](crate::StepStats::dense_heads)). The estimate: block key bounds drop
    /// blocks that cannot matter, a low-bit copy of the keys
    /// ([`HybridConfig::key_codes`]: int4 by default, half a byte per key
    /// element) scores the rest. The MAW rule is not used;
    /// the sinks are always attended.
    Mass(MassTarget),
}

impl std::str::FromStr for Recovery {
    type Err = Error;

    /// `frozen` (or `paper`), `rescore:N`, `bounds:N`, `mass:P` or
    /// `mass:P:S` (target `P`, max share `S`, by default 0.5): the form
    /// command lines take.
    ///
    /// ```
    /// use hgca_hybrid::Recovery;
    /// assert_eq!("bounds:32".parse::<Recovery>()?, Recovery::BlockBounds { top: 32 });
    /// assert!("rescore:x".parse::<Recovery>().is_err());
    /// let m = hgca_kernels::MassTarget::new(0.99, 0.5)?;
    /// assert_eq!("mass:0.99".parse::<Recovery>()?, Recovery::Mass(m));
    /// assert!("mass:1.5".parse::<Recovery>().is_err());
    /// # Ok::<(), hgca_kernels::Error>(())
    /// ```
    fn from_str(s: &str) -> Result<Self> {
        let bad = || Error::Param {
            what: "recovery",
            value: f64::NAN,
            expected: "frozen, rescore:N, bounds:N, mass:P or mass:P:S",
        };
        let (kind, n) = s.split_once(':').unwrap_or((s, ""));
        let int = || n.parse::<usize>().map_err(|_| bad());
        Ok(match kind {
            "frozen" | "paper" => Recovery::Frozen,
            "rescore" => Recovery::Rescore { every: int()? },
            "bounds" => Recovery::BlockBounds { top: int()? },
            "mass" => {
                let (p, share) = n.split_once(':').unwrap_or((n, "0.5"));
                let f = |x: &str| x.parse::<f32>().map_err(|_| bad());
                Recovery::Mass(MassTarget::new(f(p)?, f(share)?)?)
            }
            _ => return Err(bad()),
        })
    }
}

/// The low-bit copy of the CPU keys that the mass-targeted selector
/// ([`Recovery::Mass`]) estimates scores from, one scale per row.
///
/// Int4 is the default: its keys are whitened per channel (a centre and a
/// gain measured on the rows held, the sinks left out, and measured again
/// each time the rows double) and entries are admitted within half a
/// rounding sigma of the threshold. Int8 codes are quantised as they are,
/// with no margin. On Qwen2.5-Coder-0.5B's 4096-token task suite (seed 1,
/// 26 questions, window 0.25, target 0.9) int4 attended 10.2% of the CPU
/// entries and read 25.9% of full attention's CPU bytes with 25 of 26
/// answers the same as full attention's, where int8 attended 8.1% and read
/// 36.2% with 24 of 26 the same. Whitened on the first evicted block alone
/// and with a margin of two sigmas, int4 had attended 32.8% and read 48.4%.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum KeyCodes {
    /// One byte per element (`-127..=127`).
    Int8,
    /// Half a byte per element (`-7..=7`), whitened keys.
    #[default]
    Int4,
}

impl KeyCodes {
    /// Bytes the estimate reads per key row of `d` elements: the codes
    /// and the row's f32 scale.
    ///
    /// ```
    /// use hgca_hybrid::KeyCodes;
    /// assert_eq!(KeyCodes::Int8.row_bytes(64), 68);
    /// assert_eq!(KeyCodes::Int4.row_bytes(64), 36);
    /// ```
    pub fn row_bytes(self, d: usize) -> usize {
        let codes = match self {
            KeyCodes::Int8 => d,
            KeyCodes::Int4 => d.div_ceil(2),
        };
        codes + 4
    }
}

/// Configuration of a [`HybridAttention`](crate::HybridAttention) layer.
#[derive(Debug, Clone)]
pub struct HybridConfig {
    /// Dense window capacity in tokens (the GPU's share of the cache).
    pub window: usize,
    /// Eviction block in tokens (a power of two, `<= window`).
    pub block: usize,
    /// The first `sinks` tokens of the sequence are always attended.
    pub sinks: usize,
    /// `beta` of the selection rule `maw > beta / n_gpu`, one value for
    /// every KV head (see [`HybridConfig::beta_per_head`] for per-head values).
    pub beta: f32,
    /// Per-head `beta`, overriding `beta` when set (one per KV head).
    pub beta_per_head: Option<Vec<f32>>,
    /// MAW smoothing: `maw <- alpha * maw + (1 - alpha) * weight`.
    pub alpha: f32,
    /// How entries whose importance rises come back.
    pub recovery: Recovery,
    /// Queries a prompt chunk re-evaluates the MAW with: the MAW of every
    /// entry becomes its mean weight over the chunk's last `refresh_queries`
    /// queries (each over every token held, so those before the last also
    /// see the chunk's last few tokens). 1 is the chunk's last query alone;
    /// a chunk shorter than `refresh_queries` uses all its queries.
    pub refresh_queries: usize,
    /// The mass selector's copy of the CPU keys (unused by the other rules).
    pub key_codes: KeyCodes,
}

impl Default for HybridConfig {
    /// Window 1024 tokens, blocks of 64, 4 sinks, beta 1.0, alpha 0.9,
    /// mass-targeted selection of 93% of the estimated attention mass, at
    /// most half the CPU entries per head ([`Recovery::Mass`],
    /// [`MassTarget::DEFAULT`]; 90% before 2026-12-03, when the earlier
    /// figures here were measured). Measured
    /// (perplexity over 2048 tokens of *Persuasion* decoded token by token,
    /// window a quarter of the context, f16 KV): SmolLM2-135M +0.04% over
    /// full attention with 8.6% of the CPU entries, Qwen2.5-0.5B +0.02%
    /// with 19.3%, where the paper's rule costs several percent; and it
    /// follows a shift of the attention to needles scattered over the whole
    /// store, which the MAW rules and the top-32 block bounds lose. The KV
    /// storage type is the layer's type parameter, on both sides.
    fn default() -> Self {
        Self {
            window: 1024,
            block: 64,
            sinks: 4,
            beta: 1.0,
            beta_per_head: None,
            alpha: 0.9,
            recovery: Recovery::Mass(MassTarget::DEFAULT),
            refresh_queries: 1,
            key_codes: KeyCodes::default(),
        }
    }
}

impl HybridConfig {
    pub(crate) fn validate(&self, shape: &AttnShape) -> Result<(Beta, Alpha)> {
        if self.block == 0 {
            return Err(Error::Zero { what: "block" });
        }
        if self.window < self.block {
            return Err(Error::Capacity {
                what: "window smaller than one block",
                capacity: self.window,
                requested: self.block,
            });
        }
        if self.refresh_queries == 0 {
            return Err(Error::Zero {
                what: "refresh queries",
            });
        }
        if !self.block.is_power_of_two() {
            return Err(Error::Param {
                what: "block",
                value: self.block as f64,
                expected: "a power of two",
            });
        }
        match self.recovery {
            Recovery::Rescore { every: 0 } => {
                return Err(Error::Zero {
                    what: "rescore period",
                });
            }
            Recovery::BlockBounds { top: 0 } => {
                return Err(Error::Zero {
                    what: "block bounds top",
                });
            }
            Recovery::Mass(m) => {
                // The fields are public: checked as the constructor does.
                MassTarget::new(m.target, m.max_share)?;
            }
            _ => {}
        }
        let beta = match &self.beta_per_head {
            Some(b) => {
                check_len("beta_per_head", shape.kv_heads(), b.len())?;
                Beta::new(b.clone())?
            }
            None => Beta::uniform(shape.kv_heads(), self.beta)?,
        };
        Ok((beta, Alpha::new(self.alpha)?))
    }
}
