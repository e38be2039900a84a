//! Where the time of forward calls goes: [`Profile`] and the laps of one
//! call that add to it.

#[cfg(doc)]
use crate::Llama;
#[cfg(doc)]
use hgca_hybrid::SequenceAttention;

/// Where the time of [`Llama::forward`] calls went, summed over the calls
/// since [`Llama::set_profile`] turned it on (wall-clock time of the calling
/// thread around each part; the parts' own threads run inside them).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct Profile {
    /// Forward calls and the tokens they took.
    pub calls: u64,
    /// Tokens of those calls.
    pub tokens: u64,
    /// The Q/K/V projection, its biases and RoPE.
    pub qkv: std::time::Duration,
    /// Attention (the layer's [`SequenceAttention::forward`]).
    pub attn: std::time::Duration,
    /// The output projection and its residual.
    pub wo: std::time::Duration,
    /// The FFN (gate/up, activation, down) and its residual.
    pub ffn: std::time::Duration,
    /// The final norm and the LM head.
    pub head: std::time::Duration,
    /// The whole calls.
    pub total: std::time::Duration,
}

impl Profile {
    /// Everything outside the parts (embedding, norms, RoPE tables, copies).
    pub fn other(&self) -> std::time::Duration {
        self.total
            .saturating_sub(self.qkv + self.attn + self.wo + self.ffn + self.head)
    }
}

/// The laps of one forward call, added to parts of a [`Profile`] (nothing
/// when there is none).
pub(crate) struct Laps {
    prof: Option<Profile>,
    lap: std::time::Instant,
}

impl Laps {
    pub(crate) fn new(prof: Option<Profile>) -> Self {
        Self {
            prof,
            lap: std::time::Instant::now(),
        }
    }
    /// Adds the time since the last lap to `part`.
    pub(crate) fn add(&mut self, part: fn(&mut Profile) -> &mut std::time::Duration) {
        if let Some(p) = self.prof.as_mut() {
            let now = std::time::Instant::now();
            *part(p) += now - self.lap;
            self.lap = now;
        }
    }
    /// Starts a new lap without counting the last one in a part.
    pub(crate) fn skip(&mut self) {
        if self.prof.is_some() {
            self.lap = std::time::Instant::now();
        }
    }
    pub(crate) fn done(self) -> Option<Profile> {
        self.prof
    }
}
