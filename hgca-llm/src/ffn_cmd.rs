//! `hgca-llm ffn`: what each split and level of FFN sparsity costs in
//! perplexity, with hgca's hybrid FFN (hot neurons dense, cold neurons
//! sparse with CATS thresholds calibrated per layer on a disjoint part of
//! the text) and exact full attention; `hgca-llm ffn-profile`: the neuron
//! profile hot sets are chosen from, as JSON; and the `--ffn` options of
//! `hgca-llm ppl`.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::cli::Cli;
use crate::factory::full_factory;
use crate::load::{load, read_tokens};
use crate::progress::bar;
use hgca_llm::{
    Error, FfnFormat, LlamaWeights, NeuronProfile, PplOptions, Result, SparseFfn, perplexity,
    perplexity_with,
};

/// Options of the ffn command.
#[derive(clap::Args, Debug)]
pub(crate) struct FfnArgs {
    /// The text file (default: Austen's Persuasion).
    #[arg(long, default_value = hgca_llm::DEFAULT_TEXT)]
    text: PathBuf,
    /// Start the text at the first occurrence of this string.
    #[arg(long, default_value = "Chapter 1")]
    from: String,
    /// Tokens to evaluate (one segment, prefilled in chunks, every
    /// prediction scored).
    #[arg(long, default_value_t = 1024)]
    tokens: usize,
    /// Calibration tokens: the ones after the evaluated tokens (thresholds
    /// and, without --hot-sets, the neuron profile).
    #[arg(long, default_value_t = 512)]
    calib: usize,
    /// Sparsity levels: the share of neurons each layer's threshold skips
    /// on the calibration text.
    #[arg(long, value_delimiter = ',', default_value = "0,0.3,0.5,0.7,0.9")]
    sparsity: Vec<f32>,
    /// Hot ratios: the share of all FFN neurons on the dense side, placed
    /// across layers by the planner from the neuron profile.
    #[arg(long, value_delimiter = ',', default_value = "0,0.25,0.5")]
    hot_ratio: Vec<f64>,
    /// The sparsity at which neurons' firing frequencies are counted to
    /// rank them for the hot sets.
    #[arg(long, default_value_t = 0.5)]
    profile_sparsity: f32,
    /// A neuron profile written by `hgca-llm ffn-profile` (instead of
    /// profiling the calibration tokens).
    #[arg(long)]
    hot_sets: Option<PathBuf>,
    /// Format of hgca's FFN weight copies.
    #[arg(long, value_enum, default_value = "f16")]
    ffn_format: FormatArg,
    /// Feed the tokens one per forward call (decode steps, where the FFN
    /// reads every weight row per token) instead of chunks of 512.
    #[arg(long)]
    decode: bool,
    /// Ranks of low-rank gate predictors to run beside each threshold
    /// (sparsity above 0): fitted per layer on the calibration tokens' FFN
    /// inputs, each token's cold side then reads only the rows of the
    /// neurons predicted to pass the threshold.
    #[arg(long, value_delimiter = ',')]
    predictor: Vec<usize>,
    /// The predictors' margin, in residual deviations per neuron.
    #[arg(long, default_value_t = 2.0)]
    predictor_z: f32,
}

/// The format of hgca's FFN weight copies.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FormatArg {
    /// f16.
    F16,
    /// GGUF Q8_0 blocks.
    Q8_0,
    /// GGUF Q8_0 blocks, the cold gate and up rows against the token
    /// quantised to Q8_0 (integer dot products, as llama.cpp).
    #[value(name = "q8-0-int")]
    Q8_0Int,
}

impl From<FormatArg> for FfnFormat {
    fn from(f: FormatArg) -> Self {
        match f {
            FormatArg::F16 => FfnFormat::F16,
            FormatArg::Q8_0 => FfnFormat::Q8_0,
            FormatArg::Q8_0Int => FfnFormat::Q8_0Int,
        }
    }
}

/// Options of the ffn-profile command.
#[derive(clap::Args, Debug)]
pub(crate) struct ProfileArgs {
    /// The text file (default: Austen's Persuasion).
    #[arg(long, default_value = hgca_llm::DEFAULT_TEXT)]
    text: PathBuf,
    /// Start the text at the first occurrence of this string.
    #[arg(long, default_value = "Chapter 1")]
    from: String,
    /// Tokens to skip after `--from` (default: past the ones `ffn` and
    /// `ppl` evaluate by default).
    #[arg(long, default_value_t = 4096)]
    skip: usize,
    /// Tokens to profile.
    #[arg(long, default_value_t = 1024)]
    tokens: usize,
    /// Each layer's threshold is this quantile of its `|silu(gate)|`; a
    /// neuron fires when above it.
    #[arg(long, default_value_t = 0.5)]
    sparsity: f32,
    /// Where to write the profile (JSON).
    #[arg(long)]
    out: PathBuf,
}

/// The FFN options of `hgca-llm ppl`.
#[derive(clap::Args, Debug, Clone)]
pub(crate) struct PplFfnArgs {
    /// The FFN: dense (candle, the model's weights) or hybrid (hgca: hot
    /// neurons dense, cold neurons sparse on the CPU; f16 copies).
    #[arg(long, value_enum, default_value = "dense")]
    ffn: FfnKind,
    /// Hybrid FFN: the share of all neurons that are hot.
    #[arg(long, default_value_t = 0.25)]
    hot_ratio: f64,
    /// Hybrid FFN: each layer's cold threshold is this quantile of its
    /// `|silu(gate)|` on the calibration tokens (after the evaluated ones).
    #[arg(long, default_value_t = 0.3)]
    ffn_sparsity: f32,
    /// Hybrid FFN: one threshold on `|silu(gate)|` for every layer
    /// instead of calibrated ones.
    #[arg(long)]
    threshold: Option<f32>,
    /// Hybrid FFN: calibration tokens.
    #[arg(long, default_value_t = 512)]
    ffn_calib: usize,
    /// Hybrid FFN: a neuron profile from `hgca-llm ffn-profile` to choose
    /// the hot sets from (default: the calibration tokens', at sparsity 0.5).
    #[arg(long)]
    hot_sets: Option<PathBuf>,
    /// Hybrid FFN: format of hgca's weight copies.
    #[arg(long, value_enum, default_value = "f16")]
    ffn_format: FormatArg,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum FfnKind {
    Dense,
    Hybrid,
}

fn read_profile(path: &Path) -> Result<NeuronProfile> {
    let s = std::fs::read_to_string(path).map_err(|e| Error::Io {
        path: path.to_path_buf(),
        source: e,
    })?;
    NeuronProfile::from_json(&s)
}

/// The share of (token, neuron) firings of `p` that the hot sets `hot`
/// hold.
fn coverage(p: &NeuronProfile, hot: &[Vec<u32>]) -> f64 {
    let all: f64 = p.freq.iter().flatten().map(|&f| f64::from(f)).sum();
    let held: f64 = hot
        .iter()
        .zip(&p.freq)
        .map(|(h, f)| h.iter().map(|&i| f64::from(f[i as usize])).sum::<f64>())
        .sum();
    // `+ 0.0`: an empty sum is -0.0.
    if all > 0.0 { held / all + 0.0 } else { 0.0 }
}

pub(crate) fn cmd_profile(cli: &Cli, a: &ProfileArgs) -> Result<()> {
    let (tok, w) = load(cli)?;
    let all = read_tokens(&tok, &a.text, &a.from, a.skip + a.tokens)?;
    let ids = &all[a.skip..];
    let t0 = std::time::Instant::now();
    let p = NeuronProfile::measure(&w, ids, a.sparsity)?;
    std::fs::write(&a.out, p.to_json()).map_err(|e| Error::Io {
        path: a.out.clone(),
        source: e,
    })?;
    println!(
        "neuron profile: {} tokens of {} (after {} from `{}`), sparsity {} ({:.1} s) -> {}",
        ids.len(),
        a.text.display(),
        a.skip,
        a.from,
        a.sparsity,
        t0.elapsed().as_secs_f64(),
        a.out.display()
    );
    println!("| hot ratio | firings held by the hot sets | hot neurons per layer (min .. max) |");
    println!("|---|---|---|");
    for r in [0.1, 0.25, 0.5] {
        let hot = p.hot_sets(r)?;
        let (lo, hi) = hot
            .iter()
            .map(Vec::len)
            .fold((usize::MAX, 0), |(l, h), n| (l.min(n), h.max(n)));
        println!(
            "| {r} | {:.1}% | {lo} .. {hi} |",
            100.0 * coverage(&p, &hot)
        );
    }
    Ok(())
}

/// The hybrid FFN `ppl --ffn hybrid` asks for, calibrated on `calib`.
pub(crate) fn ppl_ffn(
    w: &Arc<LlamaWeights>,
    a: &PplFfnArgs,
    calib: &[u32],
) -> Result<Option<Arc<SparseFfn>>> {
    if a.ffn == FfnKind::Dense {
        return Ok(None);
    }
    // One run over the calibration tokens: the profile (firing above the
    // median) and the cold thresholds at `--ffn-sparsity`.
    let mut m = NeuronProfile::measure_at(w, calib, &[0.5, a.ffn_sparsity])?;
    let calibrated = m.pop().map(|p| p.thresholds).unwrap_or_default();
    let profile = match &a.hot_sets {
        Some(p) => read_profile(p)?,
        None => m.pop().ok_or_else(|| Error::Invalid {
            what: "neuron profile",
            msg: "none measured".into(),
        })?,
    };
    let hot = profile.hot_sets(a.hot_ratio)?;
    let mut ffn = SparseFfn::with_hot(w, hgca_llm::cpu_backend(), &hot, a.ffn_format.into())?;
    match a.threshold {
        Some(t) => ffn.set_thresholds(&vec![t; hot.len()])?,
        None => ffn.set_thresholds(&calibrated)?,
    }
    eprintln!(
        "FFN: hybrid, {:.1}% of the neurons hot ({} .. {} a layer), cold thresholds {}",
        100.0 * a.hot_ratio,
        ffn.hot_counts().iter().min().copied().unwrap_or(0),
        ffn.hot_counts().iter().max().copied().unwrap_or(0),
        match a.threshold {
            Some(t) => format!("{t} (every layer)"),
            None => format!("at sparsity {} (calibrated)", a.ffn_sparsity),
        }
    );
    Ok(Some(Arc::new(ffn)))
}

/// The FFN of a `ppl` run, in words.
pub(crate) fn describe(ffn: Option<&SparseFfn>, a: &PplFfnArgs) -> String {
    match ffn {
        None => "dense (candle)".into(),
        Some(f) => {
            let c = f.count();
            let all = (c.evals.max(1) * f.n_ff() as u64) as f64;
            format!(
                "hybrid ({:?} copies, {:.0}% of the neurons hot, cold thresholds {}): {:.1}% of the neurons computed, the CPU read {:.1}% of the FFN's weight rows",
                f.format(),
                100.0 * a.hot_ratio,
                a.threshold.map_or_else(
                    || format!("at sparsity {}", a.ffn_sparsity),
                    |t| t.to_string()
                ),
                100.0 * c.active as f64 / all,
                100.0 * c.rows as f64 / (3.0 * all)
            )
        }
    }
}

/// Calibration tokens `ppl --ffn hybrid` needs after the evaluated ones.
pub(crate) fn ppl_calib_tokens(a: &PplFfnArgs) -> usize {
    if a.ffn == FfnKind::Dense {
        0
    } else {
        a.ffn_calib
    }
}

pub(crate) fn cmd_ffn(cli: &Cli, a: &FfnArgs) -> Result<()> {
    let (tok, w) = load(cli)?;
    let all = read_tokens(&tok, &a.text, &a.from, a.tokens + a.calib)?;
    let (ids, calib) = all.split_at(a.tokens);
    let opts = PplOptions {
        context: a.tokens,
        chunk: 512,
        score_from: 0,
        decode: a.decode,
    };
    let runs = a.hot_ratio.len()
        * (a.sparsity.len() + a.predictor.len() * a.sparsity.iter().filter(|&&s| s > 0.0).count());
    let pb = bar(a.tokens * (runs + 1));
    pb.set_message("dense (candle)");
    let dense = perplexity(&w, ids, opts, full_factory(cli.kv), |d| {
        pb.set_position(d as u64)
    })?;
    // candle's FFN time per token, the same way (the model's profile).
    pb.set_message("dense FFN time");
    let dense_ffn_ms = {
        let mut llm = hgca_llm::Llama::with_full_attention::<f32>(Arc::clone(&w))?;
        llm.set_profile(true);
        let step = if a.decode { 1 } else { 512 };
        for c in ids.chunks(step) {
            llm.forward(c, hgca_llm::Logits::None)?;
        }
        llm.profile().map_or(f64::NAN, |p| {
            1e3 * p.ffn.as_secs_f64() / p.tokens.max(1) as f64
        })
    };
    pb.set_message("profiles");
    // One run over the calibration tokens: the profile's level first, then
    // the sparsity levels' thresholds.
    let levels: Vec<f32> = std::iter::once(a.profile_sparsity)
        .chain(a.sparsity.iter().copied())
        .collect();
    let mut measured = NeuronProfile::measure_at(&w, calib, &levels)?.into_iter();
    let own = measured.next();
    let thresholds: Vec<Vec<f32>> = measured.map(|p| p.thresholds).collect();
    let profile = match (&a.hot_sets, own) {
        (Some(p), _) => read_profile(p)?,
        (None, Some(p)) => p,
        (None, None) => {
            return Err(Error::Invalid {
                what: "neuron profile",
                msg: "none measured".into(),
            });
        }
    };
    let inputs = if a.predictor.is_empty() {
        Vec::new()
    } else {
        pb.set_message("FFN inputs");
        SparseFfn::record_inputs(&w, calib)?
    };
    let cpu = hgca_llm::cpu_backend();
    let mut rows = Vec::new();
    let mut zero_ppl = None;
    let mut done = 1;
    for &r in &a.hot_ratio {
        let hot = profile.hot_sets(r)?;
        let held = coverage(&profile, &hot);
        let mut ffn = SparseFfn::with_hot(&w, cpu.clone(), &hot, a.ffn_format.into())?;
        for (&s, t) in a.sparsity.iter().zip(&thresholds) {
            ffn.set_thresholds(t)?;
            // The threshold form, then each predictor's (above sparsity 0).
            let preds: &[usize] = if s > 0.0 { &a.predictor } else { &[] };
            for pred in std::iter::once(None).chain(preds.iter().map(Some)) {
                match pred {
                    None => {
                        ffn.clear_predictors();
                        pb.set_message(format!("hot {r} sparsity {s}"));
                    }
                    Some(&rank) => {
                        pb.set_message(format!("hot {r} sparsity {s}: fitting rank {rank}"));
                        ffn.fit_predictors(&inputs, rank, a.predictor_z)?;
                        pb.set_message(format!("hot {r} sparsity {s} predictor {rank}"));
                    }
                }
                let shared = Arc::new(ffn);
                let base = done * a.tokens;
                let rep =
                    perplexity_with(&w, ids, opts, full_factory(cli.kv), Some(&shared), |d| {
                        pb.set_position((base + d) as u64)
                    })?;
                done += 1;
                let count = shared.count();
                ffn = Arc::try_unwrap(shared).map_err(|_| Error::Invalid {
                    what: "sparse FFN",
                    msg: "still shared after a run".into(),
                })?;
                ffn.reset_count();
                if s == 0.0 && r == 0.0 {
                    zero_ppl = Some(rep.ppl);
                }
                rows.push((
                    r,
                    held,
                    s,
                    pred.copied(),
                    rep.ppl,
                    count,
                    rep.tokens_per_sec(),
                ));
            }
        }
    }
    pb.finish_and_clear();
    let c = w.config();
    println!(
        "\nFFN split and sparsity: {} tokens of {} from `{}` (one segment, chunks of 512, every prediction scored), exact attention; hot sets from {} (firing above each layer's {} quantile), placed across layers by the planner; cold thresholds on |silu(gate)| calibrated per layer on the {} tokens after the evaluated ones; weights {:?} (hgca's FFN: {:?} copies, neuron-major; the CPU stands in for the dense side), {} layers x {} neurons",
        a.tokens,
        a.text.display(),
        a.from,
        a.hot_sets.as_ref().map_or_else(
            || "the calibration tokens' profile".to_string(),
            |p| p.display().to_string()
        ),
        profile.sparsity,
        a.calib,
        cli.weights,
        a.ffn_format,
        c.n_layers,
        c.ffn_dim
    );
    println!(
        "dense FFN (candle, the model's weights): PPL {:.3}, {:.1} tok/s; its FFN (with the residual add) {dense_ffn_ms:.2} ms per token ({})",
        dense.ppl,
        dense.tokens_per_sec(),
        if a.decode {
            "decode steps"
        } else {
            "chunks of 512"
        }
    );
    println!(
        "| hot ratio | firings held by the hot sets | sparsity (calibrated) | cold side decides by | neurons computed | of which hot | CPU (cold) bytes read vs dense FFN | of which the predictor's | CPU MB read per token | PPL | vs dense candle | vs hgca hot 0 sparsity 0 | FFN ms per token (both sides) | of which the CPU's cold side | tok/s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|");
    let row_bytes = FfnFormat::from(a.ffn_format).row_bytes(c.dim) as f64;
    for (r, held, s, pred, ppl, n, tps) in rows {
        let per_eval = n.evals.max(1) as f64;
        let all = c.ffn_dim as f64 * per_eval;
        let dense_bytes = 3.0 * all * row_bytes;
        let read = n.rows as f64 * row_bytes + n.predictor_bytes as f64;
        println!(
            "| {r} | {:.1}% | {s} | {} | {:.1}% | {:.1}% | {:.1}% | {:.1}% | {:.2} | {ppl:.3} | {:+.2}% | {} | {:.2} | {:.2} | {tps:.1} |",
            100.0 * held,
            match pred {
                None if s > 0.0 => "threshold (every gate row)".to_string(),
                None => "-".to_string(),
                Some(k) => format!("predictor rank {k}, z {}", a.predictor_z),
            },
            100.0 * n.active as f64 / all,
            100.0 * n.hot as f64 / all,
            100.0 * read / dense_bytes,
            100.0 * n.predictor_bytes as f64 / dense_bytes,
            read / (per_eval / c.n_layers as f64) / 1e6,
            100.0 * (ppl / dense.ppl - 1.0),
            zero_ppl.map_or("-".into(), |z| format!("{:+.2}%", 100.0 * (ppl / z - 1.0))),
            1e3 * n.time.as_secs_f64() / (per_eval / c.n_layers as f64),
            1e3 * n.cold_time.as_secs_f64() / (per_eval / c.n_layers as f64),
        );
    }
    Ok(())
}
