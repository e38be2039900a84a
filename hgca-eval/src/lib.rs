//! Synthetic long contexts with the structure of real attention, and the
//! accuracy measures of the hybrid layer against full attention.
//!
//! Per KV head the keys carry: attention sinks (the first tokens share a
//! direction every query has), topics (the sequence is cut into segments,
//! each with its own direction; a query is about the current topic, which
//! makes a recency band), rare "needles" (old tokens with a distinct
//! direction that some queries ask for), and noise. The *shift* workload is
//! the failure mode of the paper's frozen MAW: after some decode steps, the
//! queries move to the topic of an old segment whose entries had low MAW
//! when they were evicted.

use hgca_cpu::CpuBackend;
use hgca_kernels::{
    AttnShape, DenseAttention, KvElem, KvStore, Partial, PartialLayout, Result, SparseAttention,
};

use hgca_hybrid::HybridAttention;

/// Shape of a synthetic workload.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SynthSpec {
    /// Tokens per topic segment.
    pub segment: usize,
    /// Attention-sink tokens at the start.
    pub sinks: usize,
    /// One needle every this many tokens (0: none).
    pub needle_every: usize,
    /// Score of a key on its own topic (in units of sqrt(d) · scale, i.e. a logit).
    pub topic_logit: f32,
    /// Logit of the sinks.
    pub sink_logit: f32,
    /// Logit of a needle when asked for.
    pub needle_logit: f32,
    /// Decode step after which queries move to an old topic (`None`: never).
    pub shift_at: Option<usize>,
    /// Scattered needles, the harder shift: with `Some`, the queries after
    /// `shift_at` ask for these tokens alone instead of an old topic.
    pub scattered: Option<Scattered>,
}

/// Old tokens scattered one per `stride` positions (at `stride / 3`,
/// `stride / 3 + stride`, ...), their keys on one shared direction: after
/// the shift nearly all the attention mass is on them, spread over as many
/// store blocks as there are needles, none of which the MAW favoured.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Scattered {
    /// How many.
    pub count: usize,
    /// Positions between two of them.
    pub stride: usize,
    /// Their logit when asked for.
    pub logit: f32,
}

impl Scattered {
    /// Whether position `j` holds one of them.
    pub fn holds(&self, j: usize) -> bool {
        let first = self.stride / 3;
        j >= first
            && (j - first).is_multiple_of(self.stride)
            && (j - first) / self.stride < self.count
    }
}

impl Default for SynthSpec {
    fn default() -> Self {
        Self {
            segment: 512,
            sinks: 4,
            needle_every: 4096,
            topic_logit: 10.0,
            sink_logit: 8.0,
            needle_logit: 10.0,
            shift_at: None,
            scattered: None,
        }
    }
}

/// Generator of tokens (q, k, v) with that structure.
#[derive(Debug, Clone)]
pub struct Synth {
    shape: AttnShape,
    spec: SynthSpec,
    rng: u64,
    sink_dir: Vec<f32>,
    topics: Vec<Vec<f32>>,
    needle_dir: Vec<f32>,
    scatter_dir: Vec<f32>,
    pos: usize,
    step: usize,
    old_topic: usize,
}

fn unit(rng: &mut u64, d: usize) -> Vec<f32> {
    let v: Vec<f32> = (0..d).map(|_| gauss(rng)).collect();
    let n = v.iter().map(|x| x * x).sum::<f32>().sqrt().max(1e-12);
    v.into_iter().map(|x| x / n).collect()
}

fn next(rng: &mut u64) -> u64 {
    *rng = rng.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *rng;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

fn uniform(rng: &mut u64) -> f32 {
    ((next(rng) >> 40) as f32 + 0.5) / (1u64 << 24) as f32
}

fn gauss(rng: &mut u64) -> f32 {
    let (u, v) = (uniform(rng), uniform(rng));
    (-2.0 * u.ln()).sqrt() * (2.0 * core::f32::consts::PI * v).cos()
}

impl Synth {
    /// A generator for `shape`.
    pub fn new(shape: AttnShape, spec: SynthSpec, seed: u64) -> Self {
        let mut rng = seed ^ 0x5EED;
        let d = shape.head_dim();
        let sink_dir = unit(&mut rng, d);
        let needle_dir = unit(&mut rng, d);
        // From its own stream: the workloads without scattered needles are
        // the ones they were before these existed.
        let scatter_dir = unit(&mut (seed ^ 0x5CA7_7E12), d);
        Self {
            shape,
            spec,
            rng,
            sink_dir,
            topics: Vec::new(),
            needle_dir,
            scatter_dir,
            pos: 0,
            step: 0,
            old_topic: 0,
        }
    }

    fn topic(&mut self, i: usize) -> &[f32] {
        while self.topics.len() <= i {
            let t = unit(&mut self.rng, self.shape.head_dim());
            self.topics.push(t);
        }
        &self.topics[i]
    }

    /// Token-major K and V of the next `n` tokens, `[n, kv_heads, d]` each.
    pub fn kv(&mut self, n: usize) -> (Vec<f32>, Vec<f32>) {
        let (hk, d) = (self.shape.kv_heads(), self.shape.head_dim());
        // A key of norm r on a unit direction u gives logit r*|q|*scale*cos;
        // queries have unit-ish directions with norm sqrt(d), so logit ~ r.
        let mut k = Vec::with_capacity(n * hk * d);
        let mut v = Vec::with_capacity(n * hk * d);
        for _ in 0..n {
            let j = self.pos;
            let seg = j / self.spec.segment;
            let topic = self.topic(seg).to_vec();
            let is_needle = self.spec.needle_every > 0
                && j % self.spec.needle_every == self.spec.needle_every / 2;
            let scattered = self.spec.scattered.filter(|s| s.holds(j));
            for _ in 0..hk {
                let (dir, logit) = if j < self.spec.sinks {
                    (&self.sink_dir, self.spec.sink_logit)
                } else if let Some(s) = scattered {
                    (&self.scatter_dir, s.logit)
                } else if is_needle {
                    (&self.needle_dir, self.spec.needle_logit)
                } else {
                    (&topic, self.spec.topic_logit)
                };
                // Queries have norm about sqrt(d) along their direction and the
                // score scale is 1/sqrt(d): a key `logit * u` scores about `logit`.
                for &u in dir.iter() {
                    k.push(logit * u + 0.3 * gauss(&mut self.rng));
                }
                for _ in 0..d {
                    v.push(gauss(&mut self.rng));
                }
            }
            self.pos += 1;
        }
        (k, v)
    }

    /// The query of the next decode step, `[q_heads, d]`: about the current
    /// topic (or, after the shift, about an old topic), with the sinks'
    /// direction, and now and then asking for the needles.
    pub fn query(&mut self) -> Vec<f32> {
        let d = self.shape.head_dim();
        // The topic of the most recent full segment: a recency band of at
        // least half a segment, all of it in the dense window.
        let cur = self.pos.saturating_sub(self.spec.segment / 2 + 1) / self.spec.segment;
        let shifted = self.spec.shift_at.is_some_and(|s| self.step >= s);
        if shifted && self.step == self.spec.shift_at.unwrap_or(0) {
            // An old topic: far back, long evicted.
            self.old_topic = cur / 4;
        }
        let t = if shifted { self.old_topic } else { cur };
        let topic = self.topic(t).to_vec();
        let ask_needle = self.step % 16 == 7;
        let mut q = Vec::with_capacity(self.shape.q_len());
        let s = (d as f32).sqrt();
        if shifted && self.spec.scattered.is_some() {
            for _ in 0..self.shape.q_heads() {
                for &u in &self.scatter_dir {
                    q.push(s * u + 0.3 * gauss(&mut self.rng));
                }
            }
            self.step += 1;
            return q;
        }
        for _ in 0..self.shape.q_heads() {
            for ((&t, &sk), &nd) in topic.iter().zip(&self.sink_dir).zip(&self.needle_dir) {
                let mut x = s * (t + 0.6 * sk);
                if ask_needle {
                    x += s * nd;
                }
                q.push(x + 0.3 * gauss(&mut self.rng));
            }
        }
        self.step += 1;
        q
    }
}

/// Accuracy of one decode step of the hybrid layer against full attention.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct StepAccuracy {
    /// Mean over query heads of `|o - o_full| / |o_full|` (Euclidean norms).
    pub rel_err: f64,
    /// Mean over query heads of the true attention mass on the tokens the
    /// hybrid layer attended (window plus selected CPU entries).
    pub recall: f64,
    /// Selected fraction of the CPU entries.
    pub selected: f64,
    /// The largest relative error of any one query head (the mean can hide
    /// one head that lost its needle).
    pub worst_rel_err: f64,
    /// The smallest recall of any one query head.
    pub worst_recall: f64,
    /// How far the full-attention output these metrics compare against (the
    /// CPU kernel, f32, over every token) is from hgca-ref (scalar f64) on
    /// query head 0: `|o_f32 - o_ref| / |o_ref|`. The f64 reference for all
    /// heads would cost about a second per step at 128k tokens; one head
    /// each step shows the yardstick is exact to far below the errors it
    /// measures.
    pub reference_rel_diff: f64,
}

/// Measures a decode step: `out` is what the hybrid layer returned for `q`,
/// `all` holds every token of the sequence (the reference cache).
///
/// # Errors
/// Shape errors from the reference computation.
pub fn measure<D: DenseAttention, S: SparseAttention, T: KvElem>(
    layer: &HybridAttention<D, S, T>,
    cpu: &CpuBackend,
    all: &KvStore<T>,
    q: &[f32],
    out: &[f32],
) -> Result<StepAccuracy> {
    use hgca_kernels::KvSource;
    let s = *layer.shape();
    let n = all.tokens();
    let mut full = Partial::empty(PartialLayout::decode(&s));
    let mut w = vec![0.0f32; s.q_heads() * n];
    cpu.dense_decode(&s, q, all, full.as_mut(), Some(&mut w))?;
    let d = s.head_dim();
    let reference_rel_diff = reference_check(&s, all, q, full.out());
    let n_cpu = layer.cpu_tokens();
    let sel = layer.last_selection();
    let (mut err, mut rec) = (0.0f64, 0.0f64);
    let (mut worst_err, mut worst_rec) = (0.0f64, f64::INFINITY);
    for h in 0..s.q_heads() {
        let (a, b) = (&out[h * d..(h + 1) * d], &full.out()[h * d..(h + 1) * d]);
        let num: f64 = a.iter().zip(b).map(|(x, y)| ((x - y) as f64).powi(2)).sum();
        let den: f64 = b.iter().map(|y| (*y as f64).powi(2)).sum();
        let e = (num / den.max(1e-30)).sqrt();
        err += e;
        worst_err = worst_err.max(e);
        let wh = &w[h * n..(h + 1) * n];
        let mut mass: f64 = wh[n_cpu..].iter().map(|&x| x as f64).sum();
        if sel.kv_heads() == s.kv_heads() {
            mass += sel
                .head(h / s.group())
                .iter()
                .map(|&j| wh[j as usize] as f64)
                .sum::<f64>();
        }
        rec += mass;
        worst_rec = worst_rec.min(mass);
    }
    let qh = s.q_heads() as f64;
    Ok(StepAccuracy {
        rel_err: err / qh,
        recall: rec / qh,
        selected: layer.stats().selected_fraction(s.kv_heads()),
        worst_rel_err: worst_err,
        worst_recall: if s.q_heads() == 0 { 1.0 } else { worst_rec },
        reference_rel_diff,
    })
}

/// `|o - o_ref| / |o_ref|` for query head 0, `o` from `full_out`, `o_ref`
/// from hgca-ref over every token of KV head 0; 0 when there is no token.
fn reference_check<T: KvElem>(s: &AttnShape, all: &KvStore<T>, q: &[f32], full_out: &[f32]) -> f64 {
    use hgca_kernels::KvSource;
    let (n, d) = (all.tokens(), s.head_dim());
    if n == 0 {
        return 0.0;
    }
    let (mut k, mut v) = (Vec::with_capacity(n * d), Vec::with_capacity(n * d));
    for j in 0..n {
        k.extend(all.k_row(0, j).iter().map(|x| x.to_f32()));
        v.extend(all.v_row(0, j).iter().map(|x| x.to_f32()));
    }
    let set: Vec<usize> = (0..n).collect();
    let r = hgca_ref::attend_row(&q[..d], &k, &v, d, s.scale() as f64, &set);
    let num: f64 = full_out[..d]
        .iter()
        .zip(&r.out)
        .map(|(&x, &y)| (x as f64 - y).powi(2))
        .sum();
    let den: f64 = r.out.iter().map(|y| y * y).sum();
    (num / den.max(1e-300)).sqrt()
}

/// A decode run of a hybrid layer on a synthetic workload, with the full
/// sequence kept beside it as the reference.
#[allow(missing_debug_implementations)]
pub struct Harness<D: DenseAttention, S: SparseAttention, T: KvElem> {
    /// The layer under test.
    pub layer: HybridAttention<D, S, T>,
    /// Every token, for the exact reference.
    pub all: KvStore<T>,
    /// The workload.
    pub synth: Synth,
    cpu: CpuBackend,
    out: Vec<f32>,
}

impl<D: DenseAttention, S: SparseAttention, T: KvElem> Harness<D, S, T> {
    /// Loads a context of `context` tokens into `layer` (as prefilled
    /// elsewhere, MAW re-evaluated against a query of the workload).
    ///
    /// # Errors
    /// Errors of the layer.
    pub fn new(
        mut layer: HybridAttention<D, S, T>,
        mut synth: Synth,
        context: usize,
        cpu: CpuBackend,
    ) -> Result<Self> {
        let s = *layer.shape();
        let mut all = KvStore::new(s.kv_heads(), s.head_dim(), 1024)?;
        let mut done = 0;
        while done < context {
            let n = (context - done).min(8192);
            let (k, v) = synth.kv(n);
            let kt: Vec<T> = k.iter().map(|&x| T::from_f32(x)).collect();
            let vt: Vec<T> = v.iter().map(|&x| T::from_f32(x)).collect();
            all.push_token_major(n, &kt, &vt)?;
            done += n;
            let probe = synth.query();
            layer.extend(&k, &v, n, &probe)?;
        }
        Ok(Self {
            layer,
            all,
            synth,
            cpu,
            out: vec![0.0; s.q_len()],
        })
    }

    /// One decode step: a new token enters, its query attends; returns the
    /// step's accuracy against full attention.
    ///
    /// # Errors
    /// Errors of the layer.
    pub fn step(&mut self) -> Result<StepAccuracy> {
        let q = self.synth.query();
        let (k, v) = self.synth.kv(1);
        let kt: Vec<T> = k.iter().map(|&x| T::from_f32(x)).collect();
        let vt: Vec<T> = v.iter().map(|&x| T::from_f32(x)).collect();
        self.all.push_token_major(1, &kt, &vt)?;
        use hgca_hybrid::SequenceAttention;
        self.layer.forward(&q, &k, &v, 1, &mut self.out)?;
        measure(&self.layer, &self.cpu, &self.all, &q, &self.out)
    }

    /// Time of one dense decode over every token (the baseline a hybrid step is compared with).
    ///
    /// # Errors
    /// Shape errors.
    pub fn time_full_decode(&self) -> Result<std::time::Duration> {
        let s = *self.layer.shape();
        let q = vec![0.5f32; s.q_len()];
        let mut full = Partial::empty(PartialLayout::decode(&s));
        let t = std::time::Instant::now();
        self.cpu
            .dense_decode(&s, &q, &self.all, full.as_mut(), None)?;
        Ok(t.elapsed())
    }
}
