//! The CPU as the dense side: a KV window (ring) in host memory and dense
//! attention over it, so the hybrid pipeline runs end to end without a GPU.

use hgca_kernels::{
    AttnShape, DType, DenseAttention, Error, HostBuf, KvElem, KvSource, KvWindow, Partial,
    PartialLayout, PartialMut, Result, WindowBackend, WindowSpec, bf16, check_len, f16,
};

use crate::CpuBackend;

/// K or V of a window, in its storage dtype, `[kv_heads, capacity, d]`, on
/// transparent huge pages where the OS has them (a window is read whole
/// every step).
#[derive(Debug, Clone)]
enum Buf {
    F32(HostBuf<f32>),
    F16(HostBuf<f16>),
    BF16(HostBuf<bf16>),
}

impl Buf {
    fn new(dtype: DType, n: usize) -> Result<Self> {
        Ok(match dtype {
            DType::F32 => Buf::F32(HostBuf::zeroed(n)?),
            DType::F16 => Buf::F16(HostBuf::zeroed(n)?),
            DType::BF16 => Buf::BF16(HostBuf::zeroed(n)?),
        })
    }
    fn write(&mut self, at: usize, src: &[f32]) {
        fn go<T: KvElem>(dst: &mut [T], src: &[f32]) {
            dst.iter_mut()
                .zip(src)
                .for_each(|(d, &s)| *d = T::from_f32(s));
        }
        match self {
            Buf::F32(b) => go(&mut b[at..at + src.len()], src),
            Buf::F16(b) => go(&mut b[at..at + src.len()], src),
            Buf::BF16(b) => go(&mut b[at..at + src.len()], src),
        }
    }
}

/// A KV window of the CPU backend: a ring of `capacity` tokens in host memory.
#[derive(Debug, Clone)]
pub struct CpuWindow {
    spec: WindowSpec,
    k: Buf,
    v: Buf,
    /// Ring slot of the oldest token.
    head: usize,
    len: usize,
    start: u64,
}

impl KvWindow for CpuWindow {
    fn spec(&self) -> &WindowSpec {
        &self.spec
    }
    fn len(&self) -> usize {
        self.len
    }
    fn start_pos(&self) -> u64 {
        self.start
    }
}

/// The window's tokens, oldest first, as a [`KvSource`].
struct Ring<'a, T> {
    k: &'a [T],
    v: &'a [T],
    kv_heads: usize,
    d: usize,
    cap: usize,
    head: usize,
    len: usize,
}

impl<T: KvElem> Ring<'_, T> {
    #[inline(always)]
    fn offset(&self, h: usize, j: usize) -> usize {
        debug_assert!(
            h < self.kv_heads && j < self.len,
            "row ({h}, {j}) out of range"
        );
        let s = self.head + j;
        let s = if s >= self.cap { s - self.cap } else { s };
        (h * self.cap + s) * self.d
    }
}

impl<T: KvElem> KvSource<T> for Ring<'_, T> {
    fn kv_heads(&self) -> usize {
        self.kv_heads
    }
    fn head_dim(&self) -> usize {
        self.d
    }
    fn tokens(&self) -> usize {
        self.len
    }
    #[inline(always)]
    fn k_row(&self, h: usize, j: usize) -> &[T] {
        let o = self.offset(h, j);
        &self.k[o..o + self.d]
    }
    #[inline(always)]
    fn v_row(&self, h: usize, j: usize) -> &[T] {
        let o = self.offset(h, j);
        &self.v[o..o + self.d]
    }
}

impl CpuWindow {
    fn ring<'a, T: KvElem>(&self, k: &'a [T], v: &'a [T]) -> Ring<'a, T> {
        let s = &self.spec.shape;
        Ring {
            k,
            v,
            kv_heads: s.kv_heads(),
            d: s.head_dim(),
            cap: self.spec.capacity,
            head: self.head,
            len: self.len,
        }
    }
}

/// Runs `$body` with `$ring` bound to the typed ring view of `$w`.
macro_rules! with_ring {
    ($w:expr, $ring:ident => $body:expr) => {
        match (&$w.k, &$w.v) {
            (Buf::F32(k), Buf::F32(v)) => {
                let $ring = $w.ring(k, v);
                $body
            }
            (Buf::F16(k), Buf::F16(v)) => {
                let $ring = $w.ring(k, v);
                $body
            }
            (Buf::BF16(k), Buf::BF16(v)) => {
                let $ring = $w.ring(k, v);
                $body
            }
            _ => unreachable!("K and V of a window share one dtype"),
        }
    };
}

/// Finished dense work of the CPU backend. The CPU computes at submit time:
/// in the hybrid engine the CPU then plays both roles one after the other.
#[derive(Debug)]
pub struct CpuPending {
    partial: Partial,
    weights: Option<Vec<f32>>,
}

impl WindowBackend for CpuBackend {
    type Window = CpuWindow;

    fn new_window(&self, spec: WindowSpec) -> Result<CpuWindow> {
        let n = spec
            .capacity
            .checked_mul(spec.shape.kv_token_len())
            .ok_or(Error::Capacity {
                what: "window elements",
                capacity: usize::MAX,
                requested: spec.capacity,
            })?;
        Ok(CpuWindow {
            spec,
            k: Buf::new(spec.dtype, n)?,
            v: Buf::new(spec.dtype, n)?,
            head: 0,
            len: 0,
            start: 0,
        })
    }

    fn append(&self, w: &mut CpuWindow, n: usize, k: &[f32], v: &[f32]) -> Result<()> {
        w.spec.check_append(w.free(), n, k, v)?;
        let s = w.spec.shape;
        let (hk, d, cap) = (s.kv_heads(), s.head_dim(), w.spec.capacity);
        for i in 0..n {
            let slot = (w.head + w.len + i) % cap;
            for h in 0..hk {
                let src = (i * hk + h) * d;
                let dst = (h * cap + slot) * d;
                w.k.write(dst, &k[src..src + d]);
                w.v.write(dst, &v[src..src + d]);
            }
        }
        w.len += n;
        Ok(())
    }

    fn evict_oldest<T: KvElem>(
        &self,
        w: &mut CpuWindow,
        n: usize,
        k_out: &mut [T],
        v_out: &mut [T],
    ) -> Result<()> {
        w.spec.check_evict("cpu", w.len, n, k_out, v_out)?;
        let s = w.spec.shape;
        let (hk, d) = (s.kv_heads(), s.head_dim());
        with_ring!(w, ring => {
            for h in 0..hk {
                for i in 0..n {
                    let (kr, vr) = (ring.k_row(h, i), ring.v_row(h, i));
                    let o = (h * n + i) * d;
                    k_out[o..o + d].copy_from_slice(bytemuck::cast_slice(kr));
                    v_out[o..o + d].copy_from_slice(bytemuck::cast_slice(vr));
                }
            }
        });
        w.head = (w.head + n) % w.spec.capacity;
        w.len -= n;
        w.start += n as u64;
        Ok(())
    }
}

impl DenseAttention for CpuBackend {
    type Pending = CpuPending;

    fn name(&self) -> String {
        format!("cpu-{} ({} threads)", self.isa(), self.threads())
    }

    fn submit_decode(&self, w: &CpuWindow, q: &[f32], want_weights: bool) -> Result<CpuPending> {
        let shape = w.spec.shape;
        let mut partial = Partial::empty(PartialLayout::decode(&shape));
        let mut weights = want_weights.then(|| {
            let mut b = std::mem::take(&mut *self.wbuf.lock().unwrap_or_else(|e| e.into_inner()));
            b.resize(shape.q_heads() * w.len, 0.0);
            b
        });
        with_ring!(w, ring => self.dense_decode(&shape, q, &ring, partial.as_mut(), weights.as_deref_mut()))?;
        Ok(CpuPending { partial, weights })
    }

    fn submit_append(&self, w: &CpuWindow, q: &[f32], n_q: usize, p0: u64) -> Result<CpuPending> {
        let shape: AttnShape = w.spec.shape;
        let mut partial = Partial::empty(PartialLayout::append(&shape, n_q));
        let (start, len) = (w.start, w.len);
        // Query i (position p0 + i) sees window tokens at positions <= p0 + i.
        let visible = move |i: usize| ((p0 + i as u64 + 1).saturating_sub(start) as usize).min(len);
        with_ring!(w, ring => self.dense_append_with(&shape, q, n_q, visible, &ring, partial.as_mut()))?;
        Ok(CpuPending {
            partial,
            weights: None,
        })
    }

    fn wait(&self, p: CpuPending, out: PartialMut<'_>, weights: Option<&mut [f32]>) -> Result<()> {
        match (weights, self.take_pending(p, out)?) {
            (None, _) => Ok(()),
            (Some(dst), Some(src)) => {
                check_len("weights", src.len(), dst.len())?;
                dst.copy_from_slice(&src);
                *self.wbuf.lock().unwrap_or_else(|e| e.into_inner()) = src;
                Ok(())
            }
            (Some(_), None) => Err(hgca_kernels::weights_not_requested()),
        }
    }

    fn wait_weights(
        &self,
        p: CpuPending,
        out: PartialMut<'_>,
        weights: &mut Vec<f32>,
    ) -> Result<()> {
        let mut src = self
            .take_pending(p, out)?
            .ok_or_else(hgca_kernels::weights_not_requested)?;
        check_len("weights", src.len(), weights.len())?;
        // Swap, do not copy: the caller's old buffer is reused next step.
        std::mem::swap(weights, &mut src);
        *self.wbuf.lock().unwrap_or_else(|e| e.into_inner()) = src;
        Ok(())
    }
}

impl CpuBackend {
    /// The common part of the waits: the partial into `out`; the weights, if any, back.
    fn take_pending(&self, p: CpuPending, mut out: PartialMut<'_>) -> Result<Option<Vec<f32>>> {
        if out.layout() != p.partial.layout() {
            return Err(Error::ShapeMismatch {
                what: "output partial",
                expected: format!("{:?}", p.partial.layout()),
                found: format!("{:?}", out.layout()),
            });
        }
        let (o, l) = out.parts_mut();
        o.copy_from_slice(p.partial.out());
        l.copy_from_slice(p.partial.lse());
        Ok(p.weights)
    }
}
