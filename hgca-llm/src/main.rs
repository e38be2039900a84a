//! `hgca-llm`: perplexity, speed and generation with SmolLM2-135M (or any
//! Llama GGUF) through hgca's attention layers.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use clap::{Parser, Subcommand, ValueEnum};
use std::sync::Mutex;

use hgca_cpu::CpuBackend;
use hgca_hybrid::{HybridAttention, HybridConfig, Recovery, SequenceAttention};
use hgca_kernels::{AttnShape, KvElem, bf16, f16};
use hgca_llm::{
    BoxedAttention, Error, GgufFile, GgufTokenizer, Llama, LlamaWeights, Logits, PplOptions,
    Result, WeightFormat, argmax, perplexity,
};
use indicatif::{ProgressBar, ProgressStyle};

mod ffn_cmd;
mod needle;

#[derive(Parser, Debug)]
#[command(version, about = "A real model end to end through hgca's attention")]
struct Cli {
    /// The GGUF model (fetch it with `bash scripts/fetch-model.sh`).
    #[arg(long, global = true, default_value = hgca_llm::DEFAULT_MODEL)]
    model: PathBuf,
    /// Weight format of the projections.
    #[arg(long, global = true, value_enum, default_value_t = Weights::Auto)]
    weights: Weights,
    /// Compute threads of candle's matmuls and hgca's attention, which run
    /// on the same (candle's) threads; 0: every core this process may use.
    #[arg(long, global = true, default_value_t = 0)]
    threads: usize,
    /// Storage type of the KV cache.
    #[arg(long, global = true, value_enum, default_value_t = Kv::F16)]
    kv: Kv,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Perplexity over N tokens of a text, for each attention variant: a table.
    Ppl(PplArgs),
    /// Prefill throughput and decode speed at a given context.
    Speed {
        /// Text for the prompt tokens.
        #[arg(long, default_value = hgca_llm::DEFAULT_TEXT)]
        text: PathBuf,
        /// Context tokens to prefill before decoding.
        #[arg(long, default_value_t = 2048)]
        context: usize,
        /// Prefill chunk.
        #[arg(long, default_value_t = 512)]
        chunk: usize,
        /// Tokens to decode after the prefill.
        #[arg(long, default_value_t = 64)]
        decode: usize,
        /// Attention: full (exact) or hybrid (window + sparse CPU store).
        #[arg(long, value_enum, default_value = "full")]
        attn: AttnKind,
        /// Hybrid: window size as a fraction of the context.
        #[arg(long, default_value_t = 0.25)]
        window_ratio: f64,
        /// Hybrid: recovery rule (frozen, rescore:N, bounds:N, mass:P[:S]).
        #[arg(long, default_value = "mass:0.9")]
        recovery: String,
    },
    /// Retrieval of a code hidden in a haystack of real text, full
    /// attention against the hybrid layer, answer by answer.
    Needle(needle::NeedleArgs),
    /// Perplexity against FFN sparsity: hgca's sparse FFN with thresholds
    /// calibrated per layer (CATS), exact attention.
    Ffn(ffn_cmd::FfnArgs),
    /// Continue a prompt (greedy unless --temperature) and print the text.
    Generate {
        /// The prompt.
        #[arg(long)]
        prompt: String,
        /// Tokens to generate at most.
        #[arg(long, default_value_t = 64)]
        max_tokens: usize,
        /// Wrap the prompt in the model's chat format (user turn).
        #[arg(long)]
        chat: bool,
        /// Sampling temperature (0 = greedy).
        #[arg(long, default_value_t = 0.0)]
        temperature: f32,
        /// Sampling seed.
        #[arg(long, default_value_t = 1)]
        seed: u64,
    },
}

#[derive(clap::Args, Debug)]
struct PplArgs {
    /// The text file (default: Austen's Persuasion from the fetch script).
    #[arg(long, default_value = hgca_llm::DEFAULT_TEXT)]
    text: PathBuf,
    /// Start the text at the first occurrence of this string (skips the
    /// title page); empty = from the beginning.
    #[arg(long, default_value = "Chapter 1")]
    from: String,
    /// Tokens to evaluate (the first N tokens after `--from`).
    #[arg(long, default_value_t = 4096)]
    tokens: usize,
    /// Context: non-overlapping segments of this many tokens, each from an
    /// empty KV cache.
    #[arg(long, default_value_t = 4096)]
    context: usize,
    /// Prefill chunk (tokens per forward call; 1 = decode token by token).
    #[arg(long, default_value_t = 512)]
    chunk: usize,
    /// Attention variants, comma separated: full, hybrid.
    #[arg(long, value_delimiter = ',', default_value = "full")]
    attn: Vec<AttnKind>,
    /// Hybrid: GPU-window size as a fraction of the context (grid).
    #[arg(long, value_delimiter = ',', default_value = "0.25,0.5,0.75")]
    window_ratio: Vec<f64>,
    /// Hybrid: per-head selection threshold beta (grid).
    #[arg(long, value_delimiter = ',', default_value = "1.0")]
    beta: Vec<f32>,
    /// Hybrid: recovery rule: frozen (the paper), rescore:N (exact
    /// re-scoring every N steps), bounds:N (Quest-style top N blocks),
    /// mass:P[:S] (the default: per head, CPU entries until an estimated
    /// share P of the attention mass, at most a share S of them, 0.5 by
    /// default, else all).
    #[arg(long, default_value = "mass:0.9")]
    recovery: String,
    /// Hybrid: eviction block (power of two).
    #[arg(long, default_value_t = 64)]
    block: usize,
    /// Hybrid: always-attended first tokens.
    #[arg(long, default_value_t = 4)]
    sinks: usize,
    /// Hybrid: queries of a prompt chunk its MAW re-evaluation averages
    /// over (the chunk's last ones).
    #[arg(long, default_value_t = 1)]
    refresh_queries: usize,
    /// Tokens of each segment that are context only (prefilled in chunks,
    /// not scored); default: 0 (score every prediction).
    #[arg(long, default_value_t = 0)]
    score_from: usize,
    /// Feed the scored tokens one by one (decode steps). The hybrid layer
    /// selects CPU entries only when decoding: its prompt chunks attend
    /// every CPU entry exactly.
    #[arg(long)]
    decode: bool,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Weights {
    /// As stored (Q4_1), candle's quantised matmuls.
    Q,
    /// Dequantised to f32 at load.
    F32,
    /// Re-quantised to Q8_0 at load (AVX2 kernels).
    Q8,
    /// Q8_0 copy for decoding, f32 copy for prefill chunks.
    Auto,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Kv {
    F32,
    F16,
    Bf16,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum AttnKind {
    /// Exact attention over the whole cache (hgca FullAttention).
    Full,
    /// hgca's hybrid layer (window + sparse CPU store).
    Hybrid,
}

fn full_factory(kv: Kv) -> impl FnMut(usize, AttnShape) -> Result<BoxedAttention> {
    move |layer, shape| match kv {
        Kv::F32 => hgca_llm::full_attention::<f32>()(layer, shape),
        Kv::F16 => hgca_llm::full_attention::<f16>()(layer, shape),
        Kv::Bf16 => hgca_llm::full_attention::<bf16>()(layer, shape),
    }
}

/// Selected CPU entries and CPU entries seen, summed over decode steps
/// that selected (not re-score steps or prompt chunks) and layers.
#[derive(Debug, Default)]
struct SelCount {
    selected: u64,
    candidates: u64,
    /// CPU-side bytes the decode steps read (selected K/V rows, the
    /// selector's block bounds and int8 rows) and what full attention over
    /// the same CPU entries reads.
    bytes_read: u64,
    bytes_full: u64,
    /// KV-head steps of the mass selector, and those that fell back to dense.
    head_steps: u64,
    dense_heads: u64,
    /// The layers' decode-step time split (summed over steps and layers):
    /// dense side (the window), selection, sparse side (selection included),
    /// merge and MAW, whole steps.
    t_dense: std::time::Duration,
    t_select: std::time::Duration,
    t_sparse: std::time::Duration,
    t_merge: std::time::Duration,
    t_total: std::time::Duration,
    steps: u64,
}

/// A hybrid layer that adds its selection statistics to a shared counter.
struct Counted<A> {
    inner: A,
    count: Arc<Mutex<SelCount>>,
}

impl<T: KvElem> SequenceAttention for Counted<HybridAttention<CpuBackend, CpuBackend, T>> {
    fn forward(
        &mut self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> hgca_kernels::Result<()> {
        self.inner.forward(q, k, v, n, out)?;
        let st = self.inner.stats();
        if n == 1 && !st.full_cpu && st.cpu_tokens > 0 {
            let kvh = self.inner.shape().kv_heads();
            let d = self.inner.shape().head_dim() as u64;
            let row = 2 * d * core::mem::size_of::<T>() as u64;
            let cfg = self.inner.config();
            let blocks = (st.cpu_tokens.div_ceil(cfg.block) * kvh) as u64;
            let bounds = match cfg.recovery {
                Recovery::BlockBounds { .. } | Recovery::Mass(_) => blocks * row,
                _ => 0,
            };
            let mut c = self.count.lock().unwrap_or_else(|e| e.into_inner());
            c.selected += st.selected as u64;
            c.candidates += (st.cpu_tokens * kvh) as u64;
            c.bytes_read +=
                st.selected as u64 * row + st.estimated_entries as u64 * (d + 4) + bounds;
            c.bytes_full += (st.cpu_tokens * kvh) as u64 * row;
            if st.mass_estimated.is_some() || st.dense_heads > 0 {
                c.head_steps += kvh as u64;
                c.dense_heads += st.dense_heads as u64;
            }
            c.t_dense += st.dense;
            c.t_select += st.select;
            c.t_sparse += st.sparse;
            c.t_merge += st.merge;
            c.t_total += st.total;
            c.steps += 1;
        }
        Ok(())
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
}

fn parse_recovery(s: &str) -> Result<Recovery> {
    s.parse().map_err(|_| Error::Invalid {
        what: "--recovery",
        msg: format!("`{s}`: expected frozen, rescore:N, bounds:N or mass:P[:S]"),
    })
}

fn hybrid_factory(
    kv: Kv,
    cfg: HybridConfig,
    count: Arc<Mutex<SelCount>>,
) -> impl FnMut(usize, AttnShape) -> Result<BoxedAttention> {
    move |_, shape| {
        let count = Arc::clone(&count);
        Ok(match kv {
            Kv::F32 => Box::new(Counted {
                inner: HybridAttention::<_, _, f32>::cpu_on(
                    shape,
                    cfg.clone(),
                    hgca_llm::cpu_backend(),
                )?,
                count,
            }) as BoxedAttention,
            Kv::F16 => Box::new(Counted {
                inner: HybridAttention::<_, _, f16>::cpu_on(
                    shape,
                    cfg.clone(),
                    hgca_llm::cpu_backend(),
                )?,
                count,
            }),
            Kv::Bf16 => Box::new(Counted {
                inner: HybridAttention::<_, _, bf16>::cpu_on(
                    shape,
                    cfg.clone(),
                    hgca_llm::cpu_backend(),
                )?,
                count,
            }),
        })
    }
}

fn missing(path: &Path, what: &str) -> Error {
    Error::Io {
        path: path.to_path_buf(),
        source: std::io::Error::new(
            std::io::ErrorKind::NotFound,
            format!("{what} not found: run `bash scripts/fetch-model.sh` first"),
        ),
    }
}

fn load(cli: &Cli) -> Result<(GgufTokenizer, Arc<LlamaWeights>)> {
    if !cli.model.exists() {
        return Err(missing(&cli.model, "model"));
    }
    let t0 = Instant::now();
    let mut f = GgufFile::open(&cli.model)?;
    let tok = GgufTokenizer::from_gguf(&f)?;
    let format = match cli.weights {
        Weights::Q => WeightFormat::Quantized,
        Weights::F32 => WeightFormat::F32,
        Weights::Q8 => WeightFormat::Q8,
        Weights::Auto => WeightFormat::Auto,
    };
    let w = LlamaWeights::load(&mut f, format)?;
    let c = w.config();
    eprintln!(
        "model: {} ({}, {} layers, d={}, {}q/{}kv heads x {}, ffn {}, vocab {}, rope base {}), weights {:?}, KV {:?}, loaded in {:.1}s",
        cli.model.display(),
        c.arch.name(),
        c.n_layers,
        c.dim,
        c.n_heads,
        c.n_kv_heads,
        c.head_dim,
        c.ffn_dim,
        c.vocab_size,
        c.rope_theta,
        format,
        cli.kv,
        t0.elapsed().as_secs_f64()
    );
    Ok((tok, Arc::new(w)))
}

fn read_tokens(tok: &GgufTokenizer, path: &Path, from: &str, n: usize) -> Result<Vec<u32>> {
    if !path.exists() {
        return Err(missing(path, "text"));
    }
    let text = std::fs::read_to_string(path).map_err(|source| Error::Io {
        path: path.to_path_buf(),
        source,
    })?;
    let start = if from.is_empty() {
        0
    } else {
        text.find(from).ok_or_else(|| Error::Invalid {
            what: "--from",
            msg: format!("`{from}` does not occur in {}", path.display()),
        })?
    };
    // Tokenize a prefix that surely holds n tokens (> 1 byte per token), growing if not.
    let mut len = (n * 8).max(1024);
    loop {
        let mut end = (start + len).min(text.len());
        while !text.is_char_boundary(end) {
            end -= 1;
        }
        let mut ids = tok.encode(&text[start..end], false)?;
        if ids.len() > n || end == text.len() {
            if ids.len() < n {
                return Err(Error::Invalid {
                    what: "--tokens",
                    msg: format!("the text has only {} tokens after `{from}`", ids.len()),
                });
            }
            ids.truncate(n);
            return Ok(ids);
        }
        len *= 2;
    }
}

fn bar(len: usize) -> ProgressBar {
    let pb = ProgressBar::new(len as u64);
    pb.set_style(
        ProgressStyle::with_template("{msg:>24} [{bar:30}] {pos}/{len} tok {per_sec} ETA {eta}")
            .unwrap_or_else(|_| ProgressStyle::default_bar())
            .progress_chars("=> "),
    );
    pb
}

fn cmd_ppl(cli: &Cli, a: &PplArgs) -> Result<()> {
    let (tok, w) = load(cli)?;
    let ids = read_tokens(&tok, &a.text, &a.from, a.tokens)?;
    let preview = tok.decode(&ids[..ids.len().min(12)])?;
    let context = a.context.min(ids.len());
    eprintln!(
        "text: {} - the first {} tokens from `{}` ({:?}...), segments of {context}, chunk {}, scoring from {}{}",
        a.text.display(),
        ids.len(),
        a.from,
        preview,
        a.chunk,
        a.score_from,
        if a.decode { " by decode steps" } else { "" }
    );
    let opts = PplOptions {
        context,
        chunk: a.chunk,
        score_from: a.score_from,
        decode: a.decode,
    };
    let recovery = parse_recovery(&a.recovery)?;
    struct Row {
        kind: &'static str,
        window: String,
        beta: String,
        ppl: f64,
        tps: f64,
        selected: String,
        bytes: String,
        dense: String,
    }
    let mut rows: Vec<Row> = Vec::new();
    let mut full_ppl = None;
    for kind in &a.attn {
        let variants: Vec<(f64, f32)> = match kind {
            AttnKind::Full => vec![(1.0, f32::NAN)],
            AttnKind::Hybrid => a
                .window_ratio
                .iter()
                .flat_map(|&r| a.beta.iter().map(move |&b| (r, b)))
                .collect(),
        };
        for (ratio, beta) in variants {
            let name = match kind {
                AttnKind::Full => "full".to_string(),
                AttnKind::Hybrid => format!("hybrid r={ratio} b={beta}"),
            };
            let pb = bar(ids.len());
            pb.set_message(name.clone());
            let count = Arc::new(Mutex::new(SelCount::default()));
            let (report, window) = match kind {
                AttnKind::Full => (
                    perplexity(&w, &ids, opts, full_factory(cli.kv), |d| {
                        pb.set_position(d as u64)
                    })?,
                    context,
                ),
                AttnKind::Hybrid => {
                    if !(ratio > 0.0 && ratio <= 1.0) {
                        return Err(Error::Invalid {
                            what: "--window-ratio",
                            msg: format!("{ratio} is not in (0, 1]"),
                        });
                    }
                    let block = a.block.max(1);
                    let window =
                        (((ratio * context as f64) / block as f64).round() as usize).max(1) * block;
                    let cfg = HybridConfig {
                        window,
                        block,
                        sinks: a.sinks,
                        refresh_queries: a.refresh_queries,
                        beta,
                        recovery,
                        ..HybridConfig::default()
                    };
                    let f = hybrid_factory(cli.kv, cfg, Arc::clone(&count));
                    (
                        perplexity(&w, &ids, opts, f, |d| pb.set_position(d as u64))?,
                        window,
                    )
                }
            };
            pb.finish_and_clear();
            let c = count.lock().unwrap_or_else(|e| e.into_inner());
            let selected = if c.candidates > 0 {
                format!("{:.1}%", 100.0 * c.selected as f64 / c.candidates as f64)
            } else {
                "-".into()
            };
            let bytes = if c.bytes_full > 0 {
                format!("{:.1}%", 100.0 * c.bytes_read as f64 / c.bytes_full as f64)
            } else {
                "-".into()
            };
            let dense = if c.head_steps > 0 {
                format!("{:.1}%", 100.0 * c.dense_heads as f64 / c.head_steps as f64)
            } else {
                "-".into()
            };
            if *kind == AttnKind::Full {
                full_ppl = Some(report.ppl);
            }
            eprintln!(
                "{name}: ppl {:.4} over {} scored tokens in {} segment(s), {:.1} tok/s, window {window}, selected {selected}",
                report.ppl,
                report.scored,
                report.segments,
                report.tokens_per_sec()
            );
            rows.push(Row {
                kind: match kind {
                    AttnKind::Full => "full",
                    AttnKind::Hybrid => "hybrid",
                },
                window: format!("{window} ({:.2})", window as f64 / context as f64),
                beta: if *kind == AttnKind::Full {
                    "-".into()
                } else {
                    format!("{beta}")
                },
                ppl: report.ppl,
                tps: report.tokens_per_sec(),
                selected,
                bytes,
                dense,
            });
        }
    }
    println!(
        "\nPerplexity: the first {} tokens of {} from `{}`, context {context} (non-overlapping segments, each from an empty cache), chunk {}, scored from token {}{}, weights {:?}, KV {:?}, recovery {}",
        ids.len(),
        a.text.display(),
        a.from,
        a.chunk,
        a.score_from,
        if a.decode { " (decode steps)" } else { "" },
        cli.weights,
        cli.kv,
        a.recovery
    );
    println!(
        "| attention | window (ratio) | beta | PPL | vs full | CPU entries selected | CPU bytes read vs full | heads dense | tok/s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|");
    for r in rows {
        let rel = full_ppl
            .map(|f| format!("{:+.2}%", 100.0 * (r.ppl / f - 1.0)))
            .unwrap_or_else(|| "-".into());
        println!(
            "| {} | {} | {} | {:.3} | {rel} | {} | {} | {} | {:.1} |",
            r.kind, r.window, r.beta, r.ppl, r.selected, r.bytes, r.dense, r.tps
        );
    }
    Ok(())
}

fn cmd_speed(
    cli: &Cli,
    text: &Path,
    (context, chunk, decode): (usize, usize, usize),
    attn: AttnKind,
    ratio: f64,
    recovery: &str,
) -> Result<()> {
    if chunk == 0 || context == 0 {
        return Err(Error::Invalid {
            what: "--context/--chunk",
            msg: "must be at least 1".into(),
        });
    }
    let (tok, w) = load(cli)?;
    let ids = read_tokens(&tok, text, "", context)?;
    let count = Arc::new(Mutex::new(SelCount::default()));
    let (mut llm, what) = match attn {
        AttnKind::Full => (
            Llama::new(Arc::clone(&w), full_factory(cli.kv))?,
            "full attention".to_string(),
        ),
        AttnKind::Hybrid => {
            if !(ratio > 0.0 && ratio <= 1.0) {
                return Err(Error::Invalid {
                    what: "--window-ratio",
                    msg: format!("{ratio} is not in (0, 1]"),
                });
            }
            let block = HybridConfig::default().block;
            let window =
                (((ratio * context as f64) / block as f64).round() as usize).max(1) * block;
            let cfg = HybridConfig {
                window,
                block,
                recovery: parse_recovery(recovery)?,
                ..HybridConfig::default()
            };
            let f = hybrid_factory(cli.kv, cfg, Arc::clone(&count));
            (
                Llama::new(Arc::clone(&w), f)?,
                format!("hybrid, window {window} ({ratio}), {recovery}"),
            )
        }
    };
    let pb = bar(context);
    pb.set_message("prefill");
    let t0 = Instant::now();
    let mut last = Vec::new();
    for c in ids.chunks(chunk) {
        last = llm.forward(c, Logits::Last)?;
        pb.inc(c.len() as u64);
    }
    let prefill = t0.elapsed().as_secs_f64();
    pb.finish_and_clear();
    let mut next = argmax(&last).unwrap_or(0) as u32;
    let pb = bar(decode);
    pb.set_message("decode");
    llm.set_profile(true);
    let t1 = Instant::now();
    for _ in 0..decode {
        let l = llm.forward(&[next], Logits::Last)?;
        next = argmax(&l).unwrap_or(0) as u32;
        pb.inc(1);
    }
    let dec = t1.elapsed().as_secs_f64();
    pb.finish_and_clear();
    let prof = llm.profile();
    println!(
        "time to first token: {prefill:.2}s for a {context}-token prompt = {:.1} tok/s prefill (chunk {chunk})",
        context as f64 / prefill
    );
    let (picked, seen, split) = {
        let c = count.lock().unwrap_or_else(|e| e.into_inner());
        let per = |d: std::time::Duration| 1e3 * d.as_secs_f64() / decode.max(1) as f64;
        let split = (c.steps > 0).then(|| {
            format!(
                "hybrid layers per token: {:.2} ms = dense window {:.2} + sparse {:.2} (selection {:.2}) + merge/MAW {:.2} + other {:.2}",
                per(c.t_total),
                per(c.t_dense),
                per(c.t_sparse),
                per(c.t_select),
                per(c.t_merge),
                per(c.t_total.saturating_sub(c.t_dense + c.t_sparse + c.t_merge))
            )
        });
        (c.selected, c.candidates, split)
    };
    let selected = if seen > 0 {
        format!(
            ", {:.1}% of CPU entries selected",
            100.0 * picked as f64 / seen as f64
        )
    } else {
        String::new()
    };
    println!(
        "decode:  {decode} tokens at context {context}..{} in {dec:.2}s = {:.1} tok/s ({what}{selected}, weights {:?}, KV {:?})",
        context + decode,
        decode as f64 / dec,
        cli.weights,
        cli.kv
    );
    if let Some(split) = split {
        println!("{split}");
    }
    if let Some(p) = prof.filter(|p| p.tokens > 0) {
        let ms = |d: std::time::Duration| 1e3 * d.as_secs_f64() / p.tokens as f64;
        println!(
            "decode time per token: {:.2} ms = Q/K/V projections {:.2} + attention {:.2} + output projection {:.2} + FFN {:.2} + LM head {:.2} + other {:.2}",
            ms(p.total),
            ms(p.qkv),
            ms(p.attn),
            ms(p.wo),
            ms(p.ffn),
            ms(p.head),
            ms(p.other())
        );
    }
    Ok(())
}

fn sample(logits: &[f32], temperature: f32, state: &mut u64) -> u32 {
    if temperature <= 0.0 {
        return argmax(logits).unwrap_or(0) as u32;
    }
    let m = logits.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
    let p: Vec<f64> = logits
        .iter()
        .map(|&l| (((l - m) / temperature) as f64).exp())
        .collect();
    *state = state
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(1_442_695_040_888_963_407);
    let mut u = (*state >> 11) as f64 / (1u64 << 53) as f64 * p.iter().sum::<f64>();
    for (i, &x) in p.iter().enumerate() {
        u -= x;
        if u <= 0.0 {
            return i as u32;
        }
    }
    (p.len() - 1) as u32
}

fn cmd_generate(
    cli: &Cli,
    prompt: &str,
    max_tokens: usize,
    chat: bool,
    temperature: f32,
    seed: u64,
) -> Result<()> {
    let (tok, w) = load(cli)?;
    let text = if chat {
        format!("<|im_start|>user\n{prompt}<|im_end|>\n<|im_start|>assistant\n")
    } else {
        prompt.to_owned()
    };
    let ids = tok.encode(&text, true)?;
    if ids.is_empty() {
        return Err(Error::Invalid {
            what: "--prompt",
            msg: "empty prompt".into(),
        });
    }
    let mut llm = Llama::new(Arc::clone(&w), full_factory(cli.kv))?;
    let t0 = Instant::now();
    let mut logits = llm.forward(&ids, Logits::Last)?;
    let prefill = t0.elapsed().as_secs_f64();
    let pb = bar(max_tokens);
    pb.set_message("generate");
    let mut state = seed;
    let mut out: Vec<u32> = Vec::new();
    let t1 = Instant::now();
    for _ in 0..max_tokens {
        let next = sample(&logits, temperature, &mut state);
        if Some(next) == tok.eos()
            || (chat && tok.id_to_token(next).as_deref() == Some("<|im_end|>"))
        {
            break;
        }
        out.push(next);
        let shown = tok.decode(&out)?;
        let tail: String = shown
            .chars()
            .rev()
            .take(40)
            .collect::<Vec<_>>()
            .into_iter()
            .rev()
            .collect();
        pb.set_message(tail.replace('\n', " "));
        pb.inc(1);
        logits = llm.forward(&[next], Logits::Last)?;
    }
    let dec = t1.elapsed().as_secs_f64();
    pb.finish_and_clear();
    println!("{}{}", if chat { "" } else { prompt }, tok.decode(&out)?);
    eprintln!(
        "prompt {} tokens ({:.1} tok/s prefill), generated {} tokens ({:.1} tok/s)",
        ids.len(),
        ids.len() as f64 / prefill,
        out.len(),
        out.len() as f64 / dec.max(1e-9)
    );
    Ok(())
}

fn main() {
    let cli = Cli::parse();
    // candle sizes its pools from these variables (it would take the
    // physical cores, not the ones this process may use).
    let threads = match cli.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let n = threads.to_string();
    // SAFETY: no other thread exists yet (candle and rayon start their
    // pools lazily, on first use below), so nothing reads the environment
    // concurrently.
    unsafe {
        std::env::set_var("CANDLE_NUM_THREADS", &n);
        std::env::set_var("RAYON_NUM_THREADS", &n);
    }
    let r = match &cli.cmd {
        Cmd::Ppl(a) => cmd_ppl(&cli, a),
        Cmd::Needle(a) => needle::cmd_needle(&cli, a),
        Cmd::Ffn(a) => ffn_cmd::cmd_ffn(&cli, a),
        Cmd::Speed {
            text,
            context,
            chunk,
            decode,
            attn,
            window_ratio,
            recovery,
        } => cmd_speed(
            &cli,
            text,
            (*context, *chunk, *decode),
            *attn,
            *window_ratio,
            recovery,
        ),
        Cmd::Generate {
            prompt,
            max_tokens,
            chat,
            temperature,
            seed,
        } => cmd_generate(&cli, prompt, *max_tokens, *chat, *temperature, *seed),
    };
    if let Err(e) = r {
        eprintln!("error: {e}");
        std::process::exit(1);
    }
}
