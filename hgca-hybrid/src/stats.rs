//! What a step of the hybrid layer did and how long each part took.

use std::time::Duration;

/// What the last `forward` did and how long each part took.
#[derive(Debug, Clone, Default)]
pub struct StepStats {
    /// Tokens in the dense window.
    pub window_tokens: usize,
    /// Tokens in the CPU store.
    pub cpu_tokens: usize,
    /// CPU entries attended, summed over KV heads.
    pub selected: usize,
    /// Whether this step attended every CPU entry (a re-score step or a prompt chunk).
    pub full_cpu: bool,
    /// Time the step spent on the dense side: submitting its work plus
    /// waiting for (and copying out) its result; GPU time hidden behind the
    /// CPU side is not in it.
    pub dense: Duration,
    /// The submitting part of [`StepStats::dense`] (uploads and launches).
    pub dense_submit: Duration,
    /// The selection part of [`StepStats::sparse`] (MAW rule, block bounds).
    pub select: Duration,
    /// Time of the CPU side (selection and sparse attention).
    pub sparse: Duration,
    /// Time of the merge and the MAW updates.
    pub merge: Duration,
    /// [`Recovery::Mass`](crate::Recovery::Mass): the estimated share of the attention mass the
    /// step attended, the mean over KV heads (`None` under the other rules
    /// and on steps that attend everything).
    pub mass_estimated: Option<f32>,
    /// [`Recovery::Mass`](crate::Recovery::Mass): KV heads that took every CPU entry this step
    /// because the target needed more than the max share.
    pub dense_heads: usize,
    /// [`Recovery::Mass`](crate::Recovery::Mass): CPU entries whose low-bit estimate was read,
    /// summed over KV heads (the others were dropped by block bounds).
    pub estimated_entries: usize,
    /// [`Recovery::Mass`](crate::Recovery::Mass): store blocks whose key bounds were read,
    /// summed over KV heads (a head skips them for a while after they
    /// dropped nothing).
    pub bounded_blocks: usize,
    /// Wall time of the whole step.
    pub total: Duration,
}

impl StepStats {
    /// Selected fraction of the CPU entries (0 when the store is empty).
    pub fn selected_fraction(&self, kv_heads: usize) -> f64 {
        if self.cpu_tokens == 0 {
            0.0
        } else {
            self.selected as f64 / (self.cpu_tokens * kv_heads) as f64
        }
    }
}
