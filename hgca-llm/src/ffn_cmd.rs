//! `hgca-llm ffn`: what each level of FFN sparsity costs in perplexity,
//! with hgca's sparse FFN (CATS thresholds on `|silu(gate)|`, calibrated
//! per layer on a disjoint part of the text) and exact full attention.

use std::sync::Arc;

use crate::cli::Cli;
use crate::factory::full_factory;
use crate::load::{load, read_tokens};
use crate::progress::bar;
use hgca_llm::{PplOptions, Result, SparseFfn, perplexity, perplexity_with};

/// Options of the ffn command.
#[derive(clap::Args, Debug)]
pub(crate) struct FfnArgs {
    /// The text file (default: Austen's Persuasion).
    #[arg(long, default_value = hgca_llm::DEFAULT_TEXT)]
    text: std::path::PathBuf,
    /// Start the text at the first occurrence of this string.
    #[arg(long, default_value = "Chapter 1")]
    from: String,
    /// Tokens to evaluate (one segment, prefilled in chunks, every
    /// prediction scored).
    #[arg(long, default_value_t = 1024)]
    tokens: usize,
    /// Calibration tokens: the ones after the evaluated tokens.
    #[arg(long, default_value_t = 512)]
    calib: usize,
    /// Sparsity levels: the share of neurons each layer's threshold skips
    /// on the calibration text.
    #[arg(long, value_delimiter = ',', default_value = "0,0.3,0.5,0.7,0.9")]
    sparsity: Vec<f32>,
}

pub(crate) fn cmd_ffn(cli: &Cli, a: &FfnArgs) -> Result<()> {
    let (tok, w) = load(cli)?;
    let all = read_tokens(&tok, &a.text, &a.from, a.tokens + a.calib)?;
    let (ids, calib) = all.split_at(a.tokens);
    let opts = PplOptions {
        context: a.tokens,
        chunk: 512,
        score_from: 0,
        decode: false,
    };
    let pb = bar(a.tokens * (a.sparsity.len() + 1));
    pb.set_message("dense (candle)");
    let dense = perplexity(&w, ids, opts, full_factory(cli.kv), |d| {
        pb.set_position(d as u64)
    })?;
    let cpu = hgca_llm::cpu_backend();
    let mut rows = Vec::new();
    let mut zero_ppl = None;
    for (i, &s) in a.sparsity.iter().enumerate() {
        pb.set_message(format!("sparsity {s}"));
        let mut ffn = SparseFfn::new(&w, cpu.clone())?;
        ffn.calibrate(&w, calib, s)?;
        let ffn = Arc::new(ffn);
        let done = (i + 1) * a.tokens;
        let r = perplexity_with(&w, ids, opts, full_factory(cli.kv), Some(&ffn), |d| {
            pb.set_position((done + d) as u64)
        })?;
        if s == 0.0 {
            zero_ppl = Some(r.ppl);
        }
        rows.push((s, r.ppl, ffn.count()));
    }
    pb.finish_and_clear();
    let c = w.config();
    println!(
        "\nFFN sparsity: {} tokens of {} from `{}` (one segment, chunks of 512, every prediction scored), exact attention, thresholds on |silu(gate)| calibrated per layer on the next {} tokens; weights {:?} (hgca's FFN: f16 copies, neuron-major), {} layers x {} neurons",
        a.tokens,
        a.text.display(),
        a.from,
        a.calib,
        cli.weights,
        c.n_layers,
        c.ffn_dim
    );
    println!(
        "dense FFN (candle, the model's weights): PPL {:.3}, {:.1} tok/s",
        dense.ppl,
        dense.tokens_per_sec()
    );
    println!(
        "| sparsity (calibrated) | neurons computed | FFN weight bytes read vs dense | PPL | vs dense candle | vs hgca sparsity 0 | FFN ms per token |"
    );
    println!("|---|---|---|---|---|---|---|");
    for (s, ppl, n) in rows {
        let per_eval = n.evals.max(1) as f64;
        let dense_rows = 3.0 * c.ffn_dim as f64 * per_eval;
        println!(
            "| {s} | {:.1}% | {:.1}% | {ppl:.3} | {:+.2}% | {} | {:.2} |",
            100.0 * n.active as f64 / (c.ffn_dim as f64 * per_eval),
            100.0 * n.rows as f64 / dense_rows,
            100.0 * (ppl / dense.ppl - 1.0),
            zero_ppl.map_or("-".into(), |z| format!("{:+.2}%", 100.0 * (ppl / z - 1.0))),
            1e3 * n.time.as_secs_f64() / (per_eval / c.n_layers as f64),
        );
    }
    Ok(())
}
