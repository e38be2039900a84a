//! `hgca-llm needle`: single-needle retrieval (RULER's simplest task) on a
//! real model. A five-digit code is hidden at several depths of a haystack
//! of real text; the model is asked for it after the document, in its chat
//! format, and answers greedily. Each variant (full attention, the hybrid
//! layer) reads the same documents; the answers are compared exactly, with
//! the code and with full attention's answer, question by question.
//!
//! The document is prefilled (the hybrid layer's prompt chunks attend every
//! CPU entry exactly); by default the question's tokens and the answer run
//! as decode steps, where the selection acts (`--prefill-question` prefills
//! the question too).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use crate::cli::{AttnKind, Cli};
use crate::factory::{SelCount, full_factory, hybrid_config, hybrid_factory, local_kv};
use crate::load::load;
use crate::progress::bar;
use hgca_llm::{Error, Llama, Logits, Result, argmax};

/// Options of the needle command.
#[derive(clap::Args, Debug)]
pub(crate) struct NeedleArgs {
    /// The haystack text (default: Austen's Persuasion).
    #[arg(long, default_value = hgca_llm::DEFAULT_TEXT)]
    text: std::path::PathBuf,
    /// Tokens of each prompt (document and question).
    #[arg(long, default_value_t = 4096)]
    context: usize,
    /// Depths of the needle, as fractions of the document (one question each).
    #[arg(long, value_delimiter = ',', default_value = "0.1,0.3,0.5,0.7,0.9")]
    depths: Vec<f64>,
    /// Attention variants, comma separated: full, hybrid.
    #[arg(long, value_delimiter = ',', default_value = "full,hybrid")]
    attn: Vec<AttnKind>,
    /// Hybrid: window size as a fraction of the context.
    #[arg(long, default_value_t = 0.25)]
    window_ratio: f64,
    /// Hybrid: recovery rule (frozen, rescore:N, bounds:N, mass:P[:S],
    /// mass8:/mass4: for the int8 or int4 (default) key copy, or oracle:P[:S]: the
    /// mass rule on exact scores, for evaluations).
    #[arg(long, default_value = "mass:0.93")]
    recovery: String,
    /// Prefill the question too (by default its tokens are decode steps).
    #[arg(long)]
    prefill_question: bool,
    /// Prefill chunk.
    #[arg(long, default_value_t = 512)]
    chunk: usize,
    /// Seed of the codes.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

/// The code of question `i`: five digits, from the seed.
fn code(seed: u64, i: usize) -> u32 {
    let mut z = seed
        .wrapping_add(0x9E37_79B9_7F4A_7C15)
        .wrapping_mul(i as u64 + 1);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    10_000 + ((z ^ (z >> 31)) % 90_000) as u32
}

/// The first run of digits in `s` (the answer's number), if any.
fn first_number(s: &str) -> Option<&str> {
    let start = s.find(|c: char| c.is_ascii_digit())?;
    let rest = &s[start..];
    let end = rest
        .find(|c: char| !c.is_ascii_digit())
        .unwrap_or(rest.len());
    Some(&rest[..end])
}

pub(crate) fn cmd_needle(cli: &Cli, a: &NeedleArgs) -> Result<()> {
    let (tok, w) = load(cli)?;
    let hay = crate::load::haystack(&tok, &a.text)?;
    let chat = tok.chat_format().ok_or(Error::Invalid {
        what: "--model",
        msg: "the needle test asks in a chat format (ChatML or Gemma's), which this model's vocabulary lacks".into(),
    })?;
    let head = tok.encode(chat.user, true)?;
    let question = tok.encode(
        &format!(
            "\n\nWhat is the secret code in the text above? Reply with the number only.{}{}",
            chat.end_turn, chat.assistant
        ),
        false,
    )?;
    let im_end = Some(chat.end);
    let mut docs = Vec::new();
    for (i, &depth) in a.depths.iter().enumerate() {
        if !(0.0..=1.0).contains(&depth) {
            return Err(Error::Invalid {
                what: "--depths",
                msg: format!("{depth} is not in [0, 1]"),
            });
        }
        let c = code(a.seed, i);
        let needle = tok.encode(&format!(" The secret code is {c}. Remember it. "), false)?;
        let fill = a
            .context
            .checked_sub(head.len() + needle.len() + question.len())
            .filter(|&f| f <= hay.len())
            .ok_or(Error::Invalid {
                what: "--context",
                msg: format!(
                    "{} tokens do not fit the prompt's fixed parts and {} haystack tokens",
                    a.context,
                    hay.len()
                ),
            })?;
        let at = (depth * fill as f64) as usize;
        let mut doc = head.clone();
        doc.extend_from_slice(&hay[..at]);
        doc.extend_from_slice(&needle);
        doc.extend_from_slice(&hay[at..fill]);
        docs.push((c, depth, doc));
    }
    let total: usize = docs.len() * a.attn.len() * (a.context - question.len());
    let pb = bar(total);
    pb.set_message("prefill");
    let mut table = Vec::new();
    let mut full_answers: Option<Vec<String>> = None;
    for kind in &a.attn {
        let count = Arc::new(Mutex::new(SelCount::default()));
        let mut answers = Vec::new();
        let t0 = Instant::now();
        for (_, _, doc) in &docs {
            let llm = match kind {
                AttnKind::Full => Llama::new(Arc::clone(&w), full_factory(cli.kv))?,
                AttnKind::Hybrid => Llama::new(
                    Arc::clone(&w),
                    hybrid_factory(
                        cli.kv,
                        hybrid_config(a.context, a.window_ratio, &a.recovery)?,
                        Arc::clone(&count),
                    ),
                )?,
            };
            let mut llm = local_kv(llm, cli.kv)?;
            for c in doc.chunks(a.chunk.max(1)) {
                llm.forward(c, Logits::None)?;
                pb.inc(c.len() as u64);
            }
            let mut logits = if a.prefill_question {
                llm.forward(&question, Logits::Last)?
            } else {
                let mut l = Vec::new();
                for &t in &question {
                    l = llm.forward(&[t], Logits::Last)?;
                }
                l
            };
            let mut out = Vec::new();
            for _ in 0..10 {
                let next = argmax(&logits).unwrap_or(0) as u32;
                if Some(next) == tok.eos() || Some(next) == im_end {
                    break;
                }
                out.push(next);
                logits = llm.forward(&[next], Logits::Last)?;
            }
            answers.push(tok.decode(&out)?.trim().to_string());
        }
        let secs = t0.elapsed().as_secs_f64();
        let c = count.lock().unwrap_or_else(|e| e.into_inner());
        let pct = |x: u64, of: u64| {
            if of > 0 {
                format!("{:.1}%", 100.0 * x as f64 / of as f64)
            } else {
                "-".into()
            }
        };
        let right = docs
            .iter()
            .zip(&answers)
            .filter(|((code, _, _), ans)| first_number(ans) == Some(code.to_string().as_str()))
            .count();
        let same = full_answers
            .as_ref()
            .map(|f| f.iter().zip(&answers).filter(|(x, y)| x == y).count());
        table.push((
            *kind,
            right,
            same,
            pct(c.selected, c.candidates),
            pct(c.bytes_read, c.bytes_full),
            secs,
            answers.clone(),
        ));
        if *kind == AttnKind::Full {
            full_answers = Some(answers);
        }
    }
    pb.finish_and_clear();
    println!(
        "\nNeedle: a five-digit code at depths {:?} of a {}-token prompt ({} haystack, chat format), question {}, greedy answer; weights {:?}, KV {:?}; hybrid window {} of the context, recovery {}",
        a.depths,
        a.context,
        a.text.display(),
        if a.prefill_question {
            "prefilled"
        } else {
            "as decode steps"
        },
        cli.weights,
        cli.kv,
        a.window_ratio,
        a.recovery
    );
    println!(
        "| attention | right | same answer as full | CPU entries selected | CPU bytes read vs full | time | answers |"
    );
    println!("|---|---|---|---|---|---|---|");
    let n = docs.len();
    for (kind, right, same, sel, bytes, secs, answers) in table {
        println!(
            "| {kind:?} | {right}/{n} | {} | {sel} | {bytes} | {secs:.0} s | {} |",
            same.map_or("-".into(), |s| format!("{s}/{n}")),
            answers
                .iter()
                .zip(&docs)
                .map(|(ans, (c, _, _))| format!("{ans:?} (code {c})"))
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    Ok(())
}
