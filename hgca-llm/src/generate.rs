//! `hgca-llm generate`: continue a prompt (greedy or sampled) and print
//! the text.

use std::sync::Arc;
use std::time::Instant;

use hgca_llm::{Error, Llama, Logits, Result, argmax};

use crate::cli::Cli;
use crate::factory::{full_factory, local_kv};
use crate::load::load;
use crate::progress::bar;

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

pub(crate) fn cmd_generate(
    cli: &Cli,
    prompt: &str,
    max_tokens: usize,
    chat: bool,
    temperature: f32,
    seed: u64,
) -> Result<()> {
    let (tok, w) = load(cli)?;
    let format =
        if chat {
            Some(tok.chat_format().ok_or(Error::Invalid {
            what: "--chat",
            msg: "this model's vocabulary has no chat format hgca-llm knows (ChatML, Gemma's)"
                .into(),
        })?)
        } else {
            None
        };
    let text = match format {
        Some(f) => f.prompt(prompt),
        None => prompt.to_owned(),
    };
    let ids = tok.encode(&text, true)?;
    if ids.is_empty() {
        return Err(Error::Invalid {
            what: "--prompt",
            msg: "empty prompt".into(),
        });
    }
    let mut llm = local_kv(Llama::new(Arc::clone(&w), full_factory(cli.kv))?, cli.kv)?;
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
        if Some(next) == tok.eos() || format.is_some_and(|f| f.end == next) {
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
