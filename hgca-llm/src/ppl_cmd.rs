//! `hgca-llm ppl`: perplexity over the first tokens of a text for each
//! attention variant (full, a grid of hybrid settings), as a table.

use std::sync::{Arc, Mutex};

use hgca_hybrid::HybridConfig;
use hgca_llm::{Error, PplOptions, Result, perplexity_with};

use crate::cli::{AttnKind, Cli, PplArgs};
use crate::factory::{SelCount, full_factory, hybrid_factory, parse_recovery};
use crate::load::{load, read_tokens};
use crate::progress::bar;

pub(crate) fn cmd_ppl(cli: &Cli, a: &PplArgs) -> Result<()> {
    let (tok, w) = load(cli)?;
    let extra = crate::ffn_cmd::ppl_calib_tokens(&a.ffn);
    let mut ids = read_tokens(&tok, &a.text, &a.from, a.tokens + extra)?;
    let calib = ids.split_off(a.tokens);
    let ffn = crate::ffn_cmd::ppl_ffn(&w, &a.ffn, &calib)?;
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
    let (recovery, key_codes, oracle) = parse_recovery(&a.recovery)?;
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
                    perplexity_with(&w, &ids, opts, full_factory(cli.kv), ffn.as_ref(), |d| {
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
                    let window = crate::factory::window_for(context, ratio, block);
                    let cfg = HybridConfig {
                        window,
                        block,
                        sinks: a.sinks,
                        refresh_queries: a.refresh_queries,
                        beta,
                        recovery,
                        key_codes,
                        ..HybridConfig::default()
                    };
                    let f = hybrid_factory(cli.kv, (cfg, oracle), Arc::clone(&count));
                    (
                        perplexity_with(&w, &ids, opts, f, ffn.as_ref(), |d| {
                            pb.set_position(d as u64)
                        })?,
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
        "\nPerplexity: the first {} tokens of {} from `{}`, context {context} (non-overlapping segments, each from an empty cache), chunk {}, scored from token {}{}, weights {:?}, KV {:?}, recovery {}, FFN {}",
        ids.len(),
        a.text.display(),
        a.from,
        a.chunk,
        a.score_from,
        if a.decode { " (decode steps)" } else { "" },
        cli.weights,
        cli.kv,
        a.recovery,
        crate::ffn_cmd::describe(ffn.as_deref(), &a.ffn)
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
