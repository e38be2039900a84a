//! `hgca-llm`: perplexity, speed and generation with SmolLM2-135M (or any
//! Llama GGUF) through hgca's attention layers.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use clap::{Parser, Subcommand, ValueEnum};
use hgca_hybrid::FullAttention;
use hgca_kernels::{AttnShape, bf16, f16};
use hgca_llm::{
    BoxedAttention, Error, GgufFile, GgufTokenizer, Llama, LlamaWeights, Logits, PplOptions,
    Result, WeightFormat, argmax, perplexity,
};
use indicatif::{ProgressBar, ProgressStyle};

#[derive(Parser, Debug)]
#[command(version, about = "A real model end to end through hgca's attention")]
struct Cli {
    /// The GGUF model (fetch it with `bash scripts/fetch-model.sh`).
    #[arg(long, global = true, default_value = hgca_llm::DEFAULT_MODEL)]
    model: PathBuf,
    /// Weight format of the projections.
    #[arg(long, global = true, value_enum, default_value_t = Weights::Auto)]
    weights: Weights,
    /// Compute threads of candle's matmuls and hgca's attention (0: all
    /// cores). Default 1: candle's spinning barrier pool collapses when
    /// another process holds a core (decode 30 -> 8 tok/s measured on a
    /// busy 2-core machine).
    #[arg(long, global = true, default_value_t = 1)]
    threads: usize,
    /// Storage type of the KV cache.
    #[arg(long, global = true, value_enum, default_value_t = Kv::F32)]
    kv: Kv,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand, Debug)]
enum Cmd {
    /// Perplexity over N tokens of a text, for each attention variant: a table.
    Ppl {
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
    },
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
    },
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

fn cpu_backend() -> Result<hgca_cpu::CpuBackend> {
    Ok(hgca_cpu::CpuBackend::new())
}

fn full_factory(kv: Kv) -> impl FnMut(usize, AttnShape) -> Result<BoxedAttention> {
    move |_, shape| {
        let cpu = cpu_backend()?;
        Ok(match kv {
            Kv::F32 => Box::new(FullAttention::<f32>::new(shape, cpu)?) as BoxedAttention,
            Kv::F16 => Box::new(FullAttention::<f16>::new(shape, cpu)?),
            Kv::Bf16 => Box::new(FullAttention::<bf16>::new(shape, cpu)?),
        })
    }
}

fn hybrid_factory(
    _kv: Kv,
    _context: usize,
    _ratio: f64,
    _beta: f32,
) -> Result<impl FnMut(usize, AttnShape) -> Result<BoxedAttention>> {
    Err::<fn(usize, AttnShape) -> Result<BoxedAttention>, _>(Error::Invalid {
        what: "--attn hybrid",
        msg: "hgca_hybrid::HybridAttention has not landed in hgca-hybrid yet; only `full` runs"
            .into(),
    })
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
        "model: {} ({} layers, d={}, {}q/{}kv heads x {}, ffn {}, vocab {}, rope base {}), weights {:?}, KV {:?}, loaded in {:.1}s",
        cli.model.display(),
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

#[allow(clippy::too_many_arguments)]
fn cmd_ppl(
    cli: &Cli,
    text: &Path,
    from: &str,
    tokens: usize,
    context: usize,
    chunk: usize,
    attn: &[AttnKind],
    ratios: &[f64],
    betas: &[f32],
) -> Result<()> {
    let (tok, w) = load(cli)?;
    let ids = read_tokens(&tok, text, from, tokens)?;
    let preview = tok.decode(&ids[..ids.len().min(12)])?;
    eprintln!(
        "text: {} — the first {} tokens from `{from}` ({:?}...), segments of {context}, chunk {chunk}",
        text.display(),
        ids.len(),
        preview
    );
    let opts = PplOptions { context, chunk };
    let mut rows: Vec<(String, String, String, f64, f64)> = Vec::new();
    let mut full_ppl = None;
    for kind in attn {
        let variants: Vec<(f64, f32)> = match kind {
            AttnKind::Full => vec![(1.0, f32::NAN)],
            AttnKind::Hybrid => ratios
                .iter()
                .flat_map(|&r| betas.iter().map(move |&b| (r, b)))
                .collect(),
        };
        for (ratio, beta) in variants {
            let name = match kind {
                AttnKind::Full => "full".to_string(),
                AttnKind::Hybrid => format!("hybrid r={ratio} beta={beta}"),
            };
            let pb = bar(ids.len());
            pb.set_message(name.clone());
            let report = match kind {
                AttnKind::Full => perplexity(&w, &ids, opts, full_factory(cli.kv), |d| {
                    pb.set_position(d as u64)
                })?,
                AttnKind::Hybrid => perplexity(
                    &w,
                    &ids,
                    opts,
                    hybrid_factory(cli.kv, context, ratio, beta)?,
                    |d| pb.set_position(d as u64),
                )?,
            };
            pb.finish_and_clear();
            if *kind == AttnKind::Full {
                full_ppl = Some(report.ppl);
            }
            eprintln!(
                "{name}: ppl {:.4} over {} scored tokens in {} segment(s), {:.1} tok/s",
                report.ppl,
                report.scored,
                report.segments,
                report.tokens_per_sec()
            );
            let (r, b) = match kind {
                AttnKind::Full => ("1.00".to_string(), "-".to_string()),
                AttnKind::Hybrid => (format!("{ratio:.2}"), format!("{beta}")),
            };
            rows.push((
                format!("{kind:?}").to_lowercase(),
                r,
                b,
                report.ppl,
                report.tokens_per_sec(),
            ));
        }
    }
    println!(
        "\nPerplexity, {} tokens of {} from `{from}`, context {context} (non-overlapping segments), chunk {chunk}, weights {:?}, KV {:?}",
        ids.len(),
        text.display(),
        cli.weights,
        cli.kv
    );
    println!("| attention | window ratio | beta | PPL | vs full | tok/s |");
    println!("|---|---|---|---|---|---|");
    for (k, r, b, p, tps) in rows {
        let rel = full_ppl
            .map(|f| format!("{:+.2}%", 100.0 * (p / f - 1.0)))
            .unwrap_or_else(|| "-".into());
        println!("| {k} | {r} | {b} | {p:.3} | {rel} | {tps:.1} |");
    }
    Ok(())
}

fn cmd_speed(cli: &Cli, text: &Path, context: usize, chunk: usize, decode: usize) -> Result<()> {
    if chunk == 0 || context == 0 {
        return Err(Error::Invalid {
            what: "--context/--chunk",
            msg: "must be at least 1".into(),
        });
    }
    let (tok, w) = load(cli)?;
    let ids = read_tokens(&tok, text, "", context)?;
    let mut llm = Llama::new(Arc::clone(&w), full_factory(cli.kv))?;
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
    let t1 = Instant::now();
    for _ in 0..decode {
        let l = llm.forward(&[next], Logits::Last)?;
        next = argmax(&l).unwrap_or(0) as u32;
        pb.inc(1);
    }
    let dec = t1.elapsed().as_secs_f64();
    pb.finish_and_clear();
    println!(
        "prefill: {context} tokens in {prefill:.2}s = {:.1} tok/s (chunk {chunk})",
        context as f64 / prefill
    );
    println!(
        "decode:  {decode} tokens at context {context}..{} in {dec:.2}s = {:.1} tok/s (full attention, weights {:?}, KV {:?})",
        context + decode,
        decode as f64 / dec,
        cli.weights,
        cli.kv
    );
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
    if cli.threads > 0 {
        let n = cli.threads.to_string();
        // SAFETY: no other thread exists yet (candle and rayon start their
        // pools lazily, on first use below), so nothing reads the environment
        // concurrently.
        unsafe {
            std::env::set_var("CANDLE_NUM_THREADS", &n);
            std::env::set_var("RAYON_NUM_THREADS", &n);
        }
    }
    let r = match &cli.cmd {
        Cmd::Ppl {
            text,
            from,
            tokens,
            context,
            chunk,
            attn,
            window_ratio,
            beta,
        } => cmd_ppl(
            &cli,
            text,
            from,
            *tokens,
            *context,
            *chunk,
            attn,
            window_ratio,
            beta,
        ),
        Cmd::Speed {
            text,
            context,
            chunk,
            decode,
        } => cmd_speed(&cli, text, *context, *chunk, *decode),
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
