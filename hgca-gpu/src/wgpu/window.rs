//! The GPU KV window: the ring, appends, evictions and their prefetch
//! (copies of the oldest rows into staging buffers, mapped for reading).

use std::fmt;
use std::sync::{Mutex, mpsc};
use std::time::{Duration, Instant};

use hgca_kernels::{DType, Error, KvElem, KvWindow, Result, WindowBackend, WindowSpec, bf16, f16};

use super::MAX_HEAD_DIM;
use super::backend::*;

/// How long a read-back waits for its map callbacks once the GPU work it
/// reads has completed (they need only another poll; this bounds a bug).
const MAP_DEADLINE: Duration = Duration::from_secs(60);

impl WgpuBackend {
    /// Submits the copy of the `n` oldest rows of `w` (K, then V, head-major
    /// `[kv_heads, n]` rows) into two staging buffers, and starts mapping them.
    pub(super) fn copy_oldest(&self, w: &WgpuWindow, n: usize) -> Result<Staged> {
        let (hk, cap) = (w.spec.shape.kv_heads(), w.spec.capacity);
        let row_bytes = w.rw * 4;
        let bytes = (hk * n * row_bytes) as u64;
        let runs = w.runs(w.head, n);
        let usage = wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST;
        self.scoped(|| {
            let ks = self.take(usage, bytes);
            let vs = self.take(usage, bytes);
            let mut enc = self
                .device
                .create_command_encoder(&wgpu::CommandEncoderDescriptor {
                    label: Some("hgca evict"),
                });
            for (src, dst) in [(&w.k, &ks), (&w.v, &vs)] {
                for h in 0..hk {
                    for &(slot, i0, cnt) in &runs {
                        if cnt > 0 {
                            enc.copy_buffer_to_buffer(
                                src,
                                ((h * cap + slot) * row_bytes) as u64,
                                dst,
                                ((h * n + i0) * row_bytes) as u64,
                                (cnt * row_bytes) as u64,
                            );
                        }
                    }
                }
            }
            let index = self.queue.submit([enc.finish()]);
            let rx = start_map(&[(&ks, bytes), (&vs, bytes)]);
            Staged {
                head: w.head,
                n,
                bytes,
                ks,
                vs,
                index,
                rx,
            }
        })
    }

    /// Waits for submission `index`, then for `count` map callbacks on `rx`.
    ///
    /// With several threads on one device, the callbacks run in whichever
    /// thread's poll finds them ready: ours may return with nothing to do
    /// while another thread is still about to call them. So this waits on
    /// the channel itself (polling in between), up to [`MAP_DEADLINE`],
    /// instead of counting polls (64 quick polls lost that race in the
    /// test suite's parallel threads).
    pub(super) fn await_map(
        &self,
        index: wgpu::SubmissionIndex,
        rx: &mpsc::Receiver<Result<(), wgpu::BufferAsyncError>>,
        count: usize,
    ) -> Result<()> {
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: Some(index),
                timeout: None,
            })
            .map_err(wgpu_err("poll"))?;
        let deadline = Instant::now() + MAP_DEADLINE;
        let mut got = 0;
        loop {
            while let Ok(r) = rx.try_recv() {
                self.mapped(r)?;
                got += 1;
            }
            if got >= count {
                return self.take_error();
            }
            self.take_error()?;
            if Instant::now() >= deadline {
                return Err(backend_err(format!(
                    "the staging buffer was not mapped within {MAP_DEADLINE:?} of its submission completing"
                )));
            }
            match rx.recv_timeout(Duration::from_millis(1)) {
                Ok(r) => {
                    self.mapped(r)?;
                    got += 1;
                }
                Err(mpsc::RecvTimeoutError::Timeout) => {}
                Err(mpsc::RecvTimeoutError::Disconnected) => {
                    return Err(backend_err(
                        "a map callback was dropped without being called",
                    ));
                }
            }
            self.device
                .poll(wgpu::PollType::Poll)
                .map_err(wgpu_err("poll"))?;
        }
    }

    /// One map callback's result; a failed mapping reports the device's own
    /// error first when it has one (a lost device or out of memory is the
    /// cause, the mapping only its symptom).
    pub(super) fn mapped(&self, r: std::result::Result<(), wgpu::BufferAsyncError>) -> Result<()> {
        r.or_else(|e| {
            self.take_error()?;
            Err(wgpu_err("mapping the staging buffer")(e))
        })
    }
}
/// Rows `i0..i0 + n` of KV head `h` of token-major `src [tokens, hk, d]`,
/// rounded to `dtype` and laid out as `rw` little-endian 32-bit words per row.
#[allow(clippy::too_many_arguments)]
pub(super) fn encode_rows(
    dtype: DType,
    src: &[f32],
    hk: usize,
    d: usize,
    h: usize,
    i0: usize,
    n: usize,
    out: &mut Vec<u8>,
) {
    out.clear();
    for i in i0..i0 + n {
        let row = &src[(i * hk + h) * d..(i * hk + h + 1) * d];
        match dtype {
            DType::F32 => {
                for &x in row {
                    out.extend_from_slice(&x.to_le_bytes());
                }
            }
            DType::F16 => {
                for &x in row {
                    out.extend_from_slice(&f16::from_f32(x).to_bits().to_le_bytes());
                }
            }
            DType::BF16 => {
                for &x in row {
                    out.extend_from_slice(&bf16::from_f32(x).to_bits().to_le_bytes());
                }
            }
        }
        if dtype != DType::F32 && d % 2 == 1 {
            out.extend_from_slice(&[0, 0]);
        }
    }
}

/// A GPU KV window: a ring of `capacity` tokens, `[kv_heads, capacity, d]`
/// for K and for V in device memory, stored as the spec's dtype (16-bit rows
/// padded to an even length).
pub struct WgpuWindow {
    pub(super) spec: WindowSpec,
    pub(super) owner: u64,
    /// 32-bit words per row.
    pub(super) rw: usize,
    pub(super) k: wgpu::Buffer,
    pub(super) v: wgpu::Buffer,
    /// Ring slot of the oldest token.
    pub(super) head: usize,
    pub(super) len: usize,
    pub(super) start_pos: u64,
    pub(super) scratch: Vec<u8>,
    /// A prefetch of the oldest rows, if one was started (in a mutex only
    /// to keep the window `Sync`: it is reached through `&mut` alone).
    pub(super) staged: Mutex<Option<Staged>>,
    /// Evictions that found their rows prefetched.
    pub(super) prefetched: u64,
}

impl fmt::Debug for WgpuWindow {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("WgpuWindow")
            .field("spec", &self.spec)
            .field("len", &self.len)
            .field("start_pos", &self.start_pos)
            .field("head", &self.head)
            .finish_non_exhaustive()
    }
}

impl KvWindow for WgpuWindow {
    fn spec(&self) -> &WindowSpec {
        &self.spec
    }
    fn len(&self) -> usize {
        self.len
    }
    fn start_pos(&self) -> u64 {
        self.start_pos
    }
}

impl WgpuWindow {
    /// Evictions so far that found their rows already copied out by
    /// [`WindowBackend::prefetch_oldest`].
    pub fn prefetched_evictions(&self) -> u64 {
        self.prefetched
    }

    fn staged_mut(&mut self) -> &mut Option<Staged> {
        self.staged.get_mut().unwrap_or_else(|e| e.into_inner())
    }

    /// Ring runs `(slot, offset in the block, count)` of `n` tokens from `slot`.
    fn runs(&self, slot: usize, n: usize) -> [(usize, usize, usize); 2] {
        let first = n.min(self.spec.capacity - slot);
        [(slot, 0, first), (0, first, n - first)]
    }
}

/// Starts mapping `bufs` for reading; each callback sends its result.
pub(super) fn start_map(bufs: &[(&wgpu::Buffer, u64)]) -> mpsc::Receiver<MapResult> {
    let (tx, rx) = mpsc::channel();
    for &(b, bytes) in bufs {
        let tx = tx.clone();
        b.slice(..bytes).map_async(wgpu::MapMode::Read, move |r| {
            let _ = tx.send(r);
        });
    }
    // Only the callbacks hold senders now: a callback dropped without
    // being called shows as a disconnect, not as the full deadline.
    drop(tx);
    rx
}

pub(super) type MapResult = std::result::Result<(), wgpu::BufferAsyncError>;

/// The oldest rows of a window copied into staging buffers (by an eviction,
/// or ahead of it by [`WindowBackend::prefetch_oldest`], then being mapped).
pub(super) struct Staged {
    /// The window's ring head and token count the copy was made for.
    pub(super) head: usize,
    pub(super) n: usize,
    pub(super) bytes: u64,
    pub(super) ks: wgpu::Buffer,
    pub(super) vs: wgpu::Buffer,
    pub(super) index: wgpu::SubmissionIndex,
    /// The map callbacks' results.
    pub(super) rx: mpsc::Receiver<MapResult>,
}

impl WindowBackend for WgpuBackend {
    type Window = WgpuWindow;

    fn new_window(&self, spec: WindowSpec) -> Result<WgpuWindow> {
        let shape = spec.shape;
        let d = shape.head_dim();
        if d > MAX_HEAD_DIM {
            return Err(Error::Capacity {
                what: "wgpu head_dim",
                capacity: MAX_HEAD_DIM,
                requested: d,
            });
        }
        let rw = match spec.dtype {
            DType::F32 => d,
            DType::F16 | DType::BF16 => d.div_ceil(2),
        };
        if spec.capacity > (i32::MAX / 4) as usize {
            return Err(Error::Capacity {
                what: "wgpu window capacity",
                capacity: (i32::MAX / 4) as usize,
                requested: spec.capacity,
            });
        }
        let bytes = self.check_bytes(
            "wgpu window bytes (K or V)",
            shape.kv_heads() as u128 * spec.capacity as u128 * rw as u128 * 4,
        )?;
        let (k, v) = self.scoped(|| {
            let mk = |label| {
                self.device.create_buffer(&wgpu::BufferDescriptor {
                    label: Some(label),
                    size: bytes,
                    usage: wgpu::BufferUsages::STORAGE
                        | wgpu::BufferUsages::COPY_DST
                        | wgpu::BufferUsages::COPY_SRC,
                    mapped_at_creation: false,
                })
            };
            (mk("hgca window K"), mk("hgca window V"))
        })?;
        Ok(WgpuWindow {
            spec,
            owner: self.id,
            rw,
            k,
            v,
            head: 0,
            len: 0,
            start_pos: 0,
            scratch: Vec::new(),
            staged: Mutex::new(None),
            prefetched: 0,
        })
    }

    fn append(&self, w: &mut WgpuWindow, n: usize, k: &[f32], v: &[f32]) -> Result<()> {
        self.own("wgpu window", w.owner)?;
        w.spec.check_append(w.free(), n, k, v)?;
        let (hk, d) = (w.spec.shape.kv_heads(), w.spec.shape.head_dim());
        if n == 0 {
            return Ok(());
        }
        let cap = w.spec.capacity;
        let runs = w.runs((w.head + w.len) % cap, n);
        let row_bytes = (w.rw * 4) as u64;
        let mut scratch = std::mem::take(&mut w.scratch);
        self.scoped(|| {
            for (src, buf) in [(k, &w.k), (v, &w.v)] {
                for h in 0..hk {
                    for &(slot, i0, cnt) in &runs {
                        if cnt == 0 {
                            continue;
                        }
                        encode_rows(w.spec.dtype, src, hk, d, h, i0, cnt, &mut scratch);
                        let off = (h * cap + slot) as u64 * row_bytes;
                        self.queue.write_buffer(buf, off, &scratch);
                    }
                }
            }
        })?;
        w.scratch = scratch;
        w.len += n;
        Ok(())
    }

    fn evict_oldest<T: KvElem>(
        &self,
        w: &mut WgpuWindow,
        n: usize,
        k_out: &mut [T],
        v_out: &mut [T],
    ) -> Result<()> {
        self.own("wgpu window", w.owner)?;
        w.spec.check_evict(BACKEND, w.len, n, k_out, v_out)?;
        let d = w.spec.shape.head_dim();
        if n == 0 {
            return Ok(());
        }
        let (cap, row_bytes) = (w.spec.capacity, w.rw * 4);
        // A prefetch of exactly these rows is used; any other is dropped.
        let head = w.head;
        let staged = w
            .staged_mut()
            .take()
            .filter(|st| st.head == head && st.n == n);
        let prefetched = staged.is_some();
        let st = match staged {
            Some(st) => st,
            None => self.copy_oldest(w, n)?,
        };
        self.await_map(st.index.clone(), &st.rx, 2)?;
        w.prefetched += u64::from(prefetched);
        let Staged { ks, vs, bytes, .. } = st;
        let esz = size_of::<T>();
        for (stage, out) in [(&ks, k_out), (&vs, v_out)] {
            {
                let view = stage
                    .slice(..bytes)
                    .get_mapped_range()
                    .map_err(wgpu_err("reading evicted rows"))?;
                let out: &mut [u8] = bytemuck::cast_slice_mut(out);
                for (src, dst) in view
                    .chunks_exact(row_bytes)
                    .zip(out.chunks_exact_mut(d * esz))
                {
                    dst.copy_from_slice(&src[..d * esz]);
                }
                if cfg!(target_endian = "big") {
                    for e in out.chunks_exact_mut(esz) {
                        e.reverse();
                    }
                }
            }
            stage.unmap();
        }
        self.pool.give([ks, vs]);
        w.head = (w.head + n) % cap;
        w.len -= n;
        w.start_pos += n as u64;
        Ok(())
    }

    fn prefetch_oldest(&self, w: &mut WgpuWindow, n: usize) -> Result<()> {
        self.own("wgpu window", w.owner)?;
        hgca_kernels::check_prefetch(w.len, n)?;
        let head = w.head;
        if n == 0
            || w.staged_mut()
                .as_ref()
                .is_some_and(|st| st.head == head && st.n == n)
        {
            return Ok(());
        }
        *w.staged_mut() = None;
        let st = self.copy_oldest(w, n)?;
        *w.staged_mut() = Some(st);
        Ok(())
    }
}
