//! Full (exact) attention over the whole cache on the CPU: the baseline.

use hgca_cpu::CpuBackend;
use hgca_kernels::{AttnShape, KvElem, KvSource, KvStore, PartialLayout, PartialMut, Result};

use crate::SequenceAttention;

/// Exact attention over every cached token, on the CPU, KV stored as `T`.
/// A clone is a copy of the cache that goes on alone (a snapshot).
///
/// ```
/// use hgca_hybrid::{FullAttention, SequenceAttention};
/// use hgca_kernels::AttnShape;
/// let shape = AttnShape::new(2, 1, 4)?;
/// let mut att = FullAttention::<f32>::new(shape, hgca_cpu::CpuBackend::new())?;
/// let (q, k, v) = (vec![0.1; 8], vec![0.2; 4], vec![1.0, 2.0, 3.0, 4.0]);
/// let mut out = vec![0.0; 8];
/// att.forward(&q, &k, &v, 1, &mut out)?;
/// assert_eq!(&out[..4], &[1.0, 2.0, 3.0, 4.0]); // one token: its value
/// # Ok::<(), hgca_kernels::Error>(())
/// ```
#[derive(Debug, Clone)]
pub struct FullAttention<T: KvElem> {
    shape: AttnShape,
    cpu: CpuBackend,
    store: KvStore<T>,
    lse: Vec<f32>,
    conv: Vec<T>,
}

impl<T: KvElem> FullAttention<T> {
    /// An empty cache.
    ///
    /// # Errors
    /// Never for a valid shape; kept fallible for future stores.
    pub fn new(shape: AttnShape, cpu: CpuBackend) -> Result<Self> {
        Ok(Self {
            shape,
            cpu,
            store: KvStore::new(shape.kv_heads(), shape.head_dim(), 256)?,
            lse: Vec::new(),
            conv: Vec::new(),
        })
    }

    /// The shape.
    pub fn shape(&self) -> &AttnShape {
        &self.shape
    }

    /// The LSE of each (token, head) row of the last `forward`, `[n, q_heads]`.
    pub fn last_lse(&self) -> &[f32] {
        &self.lse
    }
}

impl<T: KvElem> SequenceAttention for FullAttention<T> {
    fn forward(
        &mut self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> Result<()> {
        crate::check_forward(&self.shape, q, k, v, n, out)?;
        let s = self.shape;
        let before = self.store.tokens();
        self.conv.clear();
        self.conv.extend(k.iter().chain(v).map(|&x| T::from_f32(x)));
        let (kc, vc) = self.conv.split_at(k.len());
        self.store.push_token_major(n, kc, vc)?;
        self.lse.resize(n * s.q_heads(), 0.0);
        let layout = PartialLayout::append(&s, n);
        let part = PartialMut::new(layout, out, &mut self.lse)?;
        self.cpu
            .dense_append(&s, q, n, before + 1, &self.store, part)
    }

    fn len(&self) -> usize {
        self.store.tokens()
    }
}
