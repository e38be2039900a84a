//! `hgca-llm ruler`: a RULER-style long-context task suite on a real model
//! (single needle, multi-key with distractors, multi-value, multi-query,
//! variable tracking, and the shift task), every attention variant on the
//! same documents, scored by exact match and compared with full attention
//! question by question.
//!
//! Each document is prefilled once: the first variant leads (its output
//! feeds the model), the others follow it ([`Llama::follow`]) and so hold
//! the cache their own exact prefill would have built (the hybrid layer's
//! prompt chunks attend every CPU entry). The prefilled sequences are the
//! snapshot; every question runs on a fork of it ([`Llama::fork`]). By
//! default a question's tokens and the answer are decode steps, where the
//! hybrid layer's selection acts (`--prefill-question` prefills the
//! question as a chunk instead).

mod tasks;

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use hgca_kernels::AttnShape;
use hgca_llm::{BoxedAttention, Error, GgufTokenizer, Llama, LlamaWeights, Logits, Result, argmax};
use serde_json::{Value, json};

use crate::cli::Cli;
use crate::factory::{
    SelCount, full_factory, hybrid_config, hybrid_factory, local_kv, parse_recovery,
};
use crate::load::load;
use crate::progress::bar;
use tasks::Doc;
pub(crate) use tasks::Task;

/// Options of the ruler command.
#[derive(clap::Args, Debug)]
pub(crate) struct RulerArgs {
    /// The haystack text (default: Austen's Persuasion).
    #[arg(long, default_value = hgca_llm::DEFAULT_TEXT)]
    text: PathBuf,
    /// Prompt lengths in tokens (document and first question).
    #[arg(long, value_delimiter = ',', default_value = "4096")]
    contexts: Vec<usize>,
    /// Tasks, comma separated.
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "single,multikey,multivalue,multiquery,vartrack,shift"
    )]
    tasks: Vec<Task>,
    /// Documents per task and length (each holds 1-4 questions).
    #[arg(long, default_value_t = 2)]
    docs: usize,
    /// Attention variants, comma separated: `full`, or `RULE@RATIO` for the
    /// hybrid layer with recovery RULE (frozen, rescore:N, bounds:N,
    /// mass:P[:S], mass8:/mass4: for its int8 or int4 (default) key copy,
    /// or oracle:P[:S], the mass rule with exact scores: the bound of its
    /// estimate) and a window of RATIO of the context. The first leads
    /// the prefill; `full` must be one of them (the yardstick). The default:
    /// the mass selector at ratios 0.25 and 0.1, its oracle (its bound) and
    /// the paper's rule; add e.g. `rescore:16@0.25,bounds:8@0.25`.
    #[arg(
        long,
        value_delimiter = ',',
        default_value = "full,mass:0.93@0.25,mass:0.93@0.1,oracle:0.93@0.25,frozen@0.25"
    )]
    variants: Vec<String>,
    /// Prefill each question's turn as a chunk (by default its tokens are
    /// decode steps, where the selection acts).
    #[arg(long)]
    prefill_question: bool,
    /// Prefill chunk.
    #[arg(long, default_value_t = 512)]
    chunk: usize,
    /// Seed of the documents (keys, numbers, depths, haystack offsets).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Also write every answer and the table as JSON to this file.
    #[arg(long)]
    json: Option<PathBuf>,
}

/// An attention variant of the command line.
#[derive(Clone, Debug)]
struct Variant {
    name: String,
    /// `None`: full attention; else the window ratio and the recovery rule.
    hybrid: Option<(f64, String)>,
}

fn parse_variant(s: &str) -> Result<Variant> {
    let bad = |msg: String| Error::Invalid {
        what: "--variants",
        msg,
    };
    if s == "full" {
        return Ok(Variant {
            name: s.into(),
            hybrid: None,
        });
    }
    let (rule, ratio) = s
        .split_once('@')
        .ok_or_else(|| bad(format!("`{s}`: expected full or RULE@RATIO")))?;
    parse_recovery(rule)?;
    let ratio: f64 = ratio
        .parse()
        .ok()
        .filter(|r| *r > 0.0 && *r < 1.0)
        .ok_or_else(|| bad(format!("`{s}`: the ratio must be in (0, 1)")))?;
    Ok(Variant {
        name: s.into(),
        hybrid: Some((ratio, rule.into())),
    })
}

/// A document as tokens: the prefix to prefill, and each question's turns.
struct Prompt {
    doc: Doc,
    prefix: Vec<u32>,
    /// Per question, per turn, the tokens that ask it.
    turns: Vec<Vec<Vec<u32>>>,
}

/// One question's answers by one variant.
struct Answer {
    task: Task,
    doc: usize,
    question: usize,
    variant: usize,
    answers: Vec<String>,
    /// Per turn, what of the answer is scored ([`tasks::Expect::extract`]).
    scored: Vec<Vec<String>>,
    right: Vec<bool>,
}

/// The chat format's pieces ([`hgca_llm::ChatFormat`]: ChatML for SmolLM2
/// and Qwen2, Gemma's turns): the user turn's opening, the first and the
/// later turns' question forms (`{ask}`, then the assistant's turn up to the
/// answer's given `{prefix}`), the end token.
struct Chat {
    user: String,
    first: String,
    next: String,
    end: u32,
}

fn chat(tok: &GgufTokenizer) -> Result<Chat> {
    let f = tok.chat_format().ok_or(Error::Invalid {
        what: "--model",
        msg: "the ruler suite asks in a chat format (ChatML's <|im_start|>/<|im_end|> or Gemma's <start_of_turn>/<end_of_turn>), which this model's vocabulary lacks".into(),
    })?;
    Ok(Chat {
        user: f.user.to_owned(),
        first: format!("\n\n{{ask}}{}{}{{prefix}}", f.end_turn, f.assistant),
        next: format!(
            "{}{}{{ask}}{}{}{{prefix}}",
            f.end_turn, f.user, f.end_turn, f.assistant
        ),
        end: f.end,
    })
}

/// Where to hide a sentence near haystack token `at`: after the next token
/// that ends a sentence (within 64 tokens), else at `at`.
fn sentence_end(tok: &GgufTokenizer, hay: &[u32], at: usize, end: usize) -> Result<usize> {
    for p in at..end.min(at + 64) {
        if p > 0
            && tok
                .decode(&hay[p - 1..p])?
                .trim_end()
                .ends_with(['.', '!', '?'])
        {
            return Ok(p);
        }
    }
    Ok(at)
}

fn prompt(
    tok: &GgufTokenizer,
    c: &Chat,
    hay: &[u32],
    doc: Doc,
    context: usize,
    seed: u64,
    i: usize,
) -> Result<Prompt> {
    let mut prefix = tok.encode(&format!("{}{}", c.user, doc.task.preamble()), true)?;
    let needles = doc
        .needles
        .iter()
        .map(|(d, s)| Ok((*d, tok.encode(s, false)?)))
        .collect::<Result<Vec<_>>>()?;
    let turns = doc
        .questions
        .iter()
        .map(|q| {
            q.turns
                .iter()
                .enumerate()
                .map(|(t, turn)| {
                    let form = if t == 0 { &c.first } else { &c.next };
                    let text = form
                        .replace("{ask}", &turn.ask)
                        .replace("{prefix}", &turn.prefix);
                    tok.encode(&text, false)
                })
                .collect::<Result<Vec<_>>>()
        })
        .collect::<Result<Vec<_>>>()?;
    let ask = turns.iter().map(|t| t[0].len()).max().unwrap_or(0);
    let fixed = prefix.len() + needles.iter().map(|n| n.1.len()).sum::<usize>() + ask;
    let fill = context
        .checked_sub(fixed)
        .filter(|&f| f < hay.len())
        .ok_or(Error::Invalid {
            what: "--contexts",
            msg: format!(
                "{context} tokens do not fit the prompt's fixed parts ({fixed}) and the haystack ({} tokens)",
                hay.len()
            ),
        })?;
    let mut r = tasks::Rng::new(seed ^ 0x005E_ED0F_5EED, doc.task, i);
    let start = r.below(hay.len() - fill);
    let hay = &hay[start..start + fill];
    let mut at = 0;
    for (d, n) in &needles {
        let p = sentence_end(tok, hay, ((d * fill as f64) as usize).max(at), fill)?;
        prefix.extend_from_slice(&hay[at..p]);
        prefix.extend_from_slice(n);
        at = p;
    }
    prefix.extend_from_slice(&hay[at..]);
    Ok(Prompt { doc, prefix, turns })
}

/// Greedy answer of one turn after its question tokens, which are fed one
/// by one (decode steps) or as one chunk. Returns the answer and the decode
/// steps taken with their time.
fn ask(
    llm: &mut Llama,
    tok: &GgufTokenizer,
    c: &Chat,
    question: &[u32],
    prefill: bool,
    max: usize,
) -> Result<(String, usize, Duration)> {
    let t0 = Instant::now();
    let mut steps = 0;
    let mut logits = if prefill {
        llm.forward(question, Logits::Last)?
    } else {
        let mut l = Vec::new();
        for &t in question {
            l = llm.forward(&[t], Logits::Last)?;
            steps += 1;
        }
        l
    };
    let mut out = Vec::new();
    while out.len() < max {
        let next = argmax(&logits).unwrap_or(0) as u32;
        if Some(next) == tok.eos() || next == c.end {
            break;
        }
        out.push(next);
        logits = llm.forward(&[next], Logits::Last)?;
        steps += 1;
    }
    Ok((tok.decode(&out)?.trim().to_string(), steps, t0.elapsed()))
}

/// A 95% Wilson interval of `k` successes in `n`, in percent.
fn wilson(k: usize, n: usize) -> (f64, f64) {
    if n == 0 {
        return (0.0, 100.0);
    }
    let (n, p, z) = (n as f64, k as f64 / n as f64, 1.96f64);
    let mid = (p + z * z / (2.0 * n)) / (1.0 + z * z / n);
    let half = z * (p * (1.0 - p) / n + z * z / (4.0 * n * n)).sqrt() / (1.0 + z * z / n);
    (100.0 * (mid - half).max(0.0), 100.0 * (mid + half).min(1.0))
}

fn pct(x: u64, of: u64) -> Option<f64> {
    (of > 0).then(|| 100.0 * x as f64 / of as f64)
}

/// Per (task, variant): the selection counters and the decode time.
#[derive(Default)]
struct Cell {
    count: Arc<Mutex<SelCount>>,
    steps: usize,
    time: Duration,
}

pub(crate) fn cmd_ruler(cli: &Cli, a: &RulerArgs) -> Result<()> {
    let variants = a
        .variants
        .iter()
        .map(|s| parse_variant(s))
        .collect::<Result<Vec<_>>>()?;
    let full = variants
        .iter()
        .position(|v| v.hybrid.is_none())
        .ok_or(Error::Invalid {
            what: "--variants",
            msg: "`full` (the yardstick) must be one of them".into(),
        })?;
    if a.docs == 0 || a.tasks.is_empty() {
        return Err(Error::Invalid {
            what: "--docs",
            msg: "no document to run (--docs 0 or no task)".into(),
        });
    }
    let (tok, w) = load(cli)?;
    let c = chat(&tok)?;
    let hay = crate::load::haystack(&tok, &a.text)?;
    let mut report = Vec::new();
    for &context in &a.contexts {
        report.push(run_context(
            cli, a, &tok, &w, &c, &hay, &variants, full, context,
        )?);
    }
    if let Some(path) = &a.json {
        let doc = json!({
            "model": cli.model.display().to_string(),
            "weights": format!("{:?}", cli.weights),
            "kv": format!("{:?}", cli.kv),
            "text": a.text.display().to_string(),
            "seed": a.seed,
            "question": if a.prefill_question { "prefilled" } else { "decode steps" },
            "variants": a.variants,
            "contexts": report,
        });
        let text = serde_json::to_string_pretty(&doc).map_err(|e| Error::Invalid {
            what: "--json",
            msg: e.to_string(),
        })?;
        std::fs::write(path, text).map_err(|e| Error::Io {
            path: path.clone(),
            source: e,
        })?;
        eprintln!("wrote {}", path.display());
    }
    Ok(())
}

#[allow(clippy::too_many_arguments)]
fn run_context(
    cli: &Cli,
    a: &RulerArgs,
    tok: &GgufTokenizer,
    w: &Arc<LlamaWeights>,
    c: &Chat,
    hay: &[u32],
    variants: &[Variant],
    full: usize,
    context: usize,
) -> Result<Value> {
    let mut prompts = Vec::new();
    for &task in &a.tasks {
        for i in 0..a.docs {
            let doc = tasks::doc(task, a.seed, i);
            prompts.push((i, prompt(tok, c, hay, doc, context, a.seed, i)?));
        }
    }
    let per_question: usize = variants.len();
    let total: usize = prompts
        .iter()
        .map(|(_, p)| {
            p.prefix.len()
                + per_question
                    * p.turns
                        .iter()
                        .flatten()
                        .map(|t| t.len() + p.doc.task.max_answer())
                        .sum::<usize>()
        })
        .sum();
    let pb = bar(total);
    let mut cells: HashMap<(Task, usize), Cell> = HashMap::new();
    let mut answers = Vec::new();
    let t_all = Instant::now();
    let mut prefill_time = Duration::ZERO;
    for (i, p) in &prompts {
        let task = p.doc.task;
        pb.set_message(format!("{context}: {} {i} prefill", task.name()));
        let factory = |v: &Variant, count: &Arc<Mutex<SelCount>>| -> Result<_> {
            Ok(match &v.hybrid {
                None => Box::new(full_factory(cli.kv))
                    as Box<dyn FnMut(usize, AttnShape) -> Result<BoxedAttention>>,
                Some((ratio, rule)) => Box::new(hybrid_factory(
                    cli.kv,
                    hybrid_config(context, *ratio, rule)?,
                    Arc::clone(count),
                )),
            })
        };
        let count_of = |cells: &mut HashMap<(Task, usize), Cell>, vi: usize| {
            Arc::clone(&cells.entry((task, vi)).or_default().count)
        };
        let mut lead = local_kv(
            Llama::new(
                Arc::clone(w),
                factory(&variants[0], &count_of(&mut cells, 0))?,
            )?,
            cli.kv,
        )?;
        for (vi, v) in variants.iter().enumerate().skip(1) {
            lead.follow(factory(v, &count_of(&mut cells, vi))?)?;
        }
        let t0 = Instant::now();
        for ch in p.prefix.chunks(a.chunk.max(1)) {
            lead.forward(ch, Logits::None)?;
            pb.inc(ch.len() as u64);
        }
        prefill_time += t0.elapsed();
        if pb.is_hidden() {
            // No terminal (a log): one line per document instead of the bar.
            eprintln!(
                "{context}: {} document {i}: {} tokens prefilled in {:.1} s",
                task.name(),
                p.prefix.len(),
                t0.elapsed().as_secs_f64()
            );
        }
        let snapshots = lead.split();
        for (qi, (q, qturns)) in p.doc.questions.iter().zip(&p.turns).enumerate() {
            pb.set_message(format!("{context}: {} {i} q{qi}", task.name()));
            for (vi, snap) in snapshots.iter().enumerate() {
                let mut llm = snap.fork();
                let mut got = Vec::new();
                let mut scored = Vec::new();
                let mut right = Vec::new();
                for (turn, toks) in q.turns.iter().zip(qturns) {
                    let (ans, steps, time) = ask(
                        &mut llm,
                        tok,
                        c,
                        toks,
                        a.prefill_question,
                        task.max_answer(),
                    )?;
                    let cell = cells.entry((task, vi)).or_default();
                    cell.steps += steps;
                    cell.time += time;
                    right.push(turn.expect.check(&ans));
                    scored.push(turn.expect.extract(&ans));
                    got.push(ans);
                    pb.inc((toks.len() + task.max_answer()) as u64);
                }
                answers.push(Answer {
                    task,
                    doc: *i,
                    question: qi,
                    variant: vi,
                    answers: got,
                    scored,
                    right,
                });
            }
        }
    }
    pb.finish_and_clear();
    // Paired with full attention: the same answers (what is scored of
    // them), turn by turn.
    let full_of: HashMap<(Task, usize, usize), &Answer> = answers
        .iter()
        .filter(|x| x.variant == full)
        .map(|x| ((x.task, x.doc, x.question), x))
        .collect();
    let same = |x: &Answer| full_of[&(x.task, x.doc, x.question)].scored == x.scored;
    println!(
        "\nRULER-style suite, {context}-token prompts of {} ({}), {} documents per task, seed {}; question {}; weights {:?}, KV {:?}; prefill {:.0} s for {} documents (every variant at once), total {:.0} s",
        a.text.display(),
        cli.model.display(),
        a.docs,
        a.seed,
        if a.prefill_question {
            "prefilled"
        } else {
            "as decode steps"
        },
        cli.weights,
        cli.kv,
        prefill_time.as_secs_f64(),
        prompts.len(),
        t_all.elapsed().as_secs_f64()
    );
    println!(
        "| task | variant | right | accuracy [95% CI] | same answer as full | CPU entries selected | CPU bytes read vs full | estimated mass attended | heads dense | decode tok/s |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|");
    let mut rows = Vec::new();
    let mut tasks_all: Vec<Option<Task>> = a.tasks.iter().copied().map(Some).collect();
    tasks_all.push(None);
    for task in tasks_all {
        for (vi, v) in variants.iter().enumerate() {
            let xs: Vec<&Answer> = answers
                .iter()
                .filter(|x| x.variant == vi && task.is_none_or(|t| t == x.task))
                .collect();
            let n = xs.len();
            let right = xs.iter().filter(|x| x.right.iter().all(|&r| r)).count();
            let same_n = xs.iter().filter(|x| same(x)).count();
            let mut sel = SelCount::default();
            let (mut steps, mut time) = (0, Duration::ZERO);
            for ((t, cvi), cell) in &cells {
                if *cvi == vi && task.is_none_or(|x| x == *t) {
                    sel.add(&cell.count.lock().unwrap_or_else(|e| e.into_inner()));
                    steps += cell.steps;
                    time += cell.time;
                }
            }
            let (lo, hi) = wilson(right, n);
            let acc = 100.0 * right as f64 / n.max(1) as f64;
            let sel_pct = pct(sel.selected, sel.candidates);
            let bytes_pct = pct(sel.bytes_read, sel.bytes_full);
            let mass_pct =
                (sel.mass_steps > 0).then(|| 100.0 * sel.mass_sum / sel.mass_steps as f64);
            let dense_pct = pct(sel.dense_heads, sel.head_steps);
            let tps = steps as f64 / time.as_secs_f64().max(1e-9);
            let show = |x: Option<f64>| x.map_or("-".into(), |x| format!("{x:.1}%"));
            println!(
                "| {} | {} | {right}/{n} | {acc:.0}% [{lo:.0}, {hi:.0}] | {same_n}/{n} | {} | {} | {} | {} | {tps:.1} |",
                task.map_or("all", Task::name),
                v.name,
                show(sel_pct),
                show(bytes_pct),
                show(mass_pct),
                show(dense_pct),
            );
            rows.push(json!({
                "task": task.map_or("all", Task::name),
                "variant": v.name,
                "questions": n,
                "right": right,
                "accuracy_ci95": [lo, hi],
                "same_as_full": same_n,
                "cpu_entries_selected_pct": sel_pct,
                "cpu_bytes_read_pct": bytes_pct,
                "estimated_mass_pct": mass_pct,
                "heads_dense_pct": dense_pct,
                "decode_steps": steps,
                "decode_tok_s": tps,
            }));
        }
    }
    let records: Vec<Value> = answers
        .iter()
        .map(|x| {
            let p = prompts
                .iter()
                .find(|(i, p)| *i == x.doc && p.doc.task == x.task)
                .map(|(_, p)| p);
            let turns: Vec<Value> = p
                .map(|p| &p.doc.questions[x.question].turns)
                .into_iter()
                .flatten()
                .zip(&x.answers)
                .zip(&x.right)
                .map(|((t, ans), r)| json!({"ask": t.ask, "prefix": t.prefix, "expect": t.expect.show(), "answer": ans, "right": r}))
                .collect();
            json!({
                "task": x.task.name(),
                "doc": x.doc,
                "question": x.question,
                "variant": variants[x.variant].name,
                "turns": turns,
                "right": x.right.iter().all(|&r| r),
                "same_as_full": same(x),
            })
        })
        .collect();
    Ok(json!({
        "context": context,
        "prefill_s": prefill_time.as_secs_f64(),
        "needle_depths": prompts.iter().map(|(i, p)| json!({
            "task": p.doc.task.name(), "doc": i,
            "depths": p.doc.needles.iter().map(|n| n.0).collect::<Vec<_>>(),
        })).collect::<Vec<_>>(),
        "cells": rows,
        "answers": records,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn variants_parse_and_refuse() {
        let v = parse_variant("mass:0.9@0.25").unwrap();
        assert_eq!(v.hybrid, Some((0.25, "mass:0.9".to_string())));
        assert!(parse_variant("full").unwrap().hybrid.is_none());
        for bad in [
            "mass:0.9",
            "mass:0.9@1.5",
            "mass:0.9@0",
            "nonsense@0.25",
            "full@0.25",
        ] {
            assert!(
                matches!(
                    parse_variant(bad),
                    Err(Error::Invalid {
                        what: "--variants" | "--recovery",
                        ..
                    })
                ),
                "{bad}"
            );
        }
    }

    #[test]
    fn wilson_interval_brackets_the_rate() {
        let (lo, hi) = wilson(45, 50);
        assert!(
            lo < 90.0 && hi > 90.0 && lo > 75.0 && hi < 97.0,
            "{lo} {hi}"
        );
        assert_eq!(wilson(0, 0), (0.0, 100.0));
        let (lo, hi) = wilson(10, 10);
        assert!(lo > 65.0 && (hi - 100.0).abs() < 1e-9, "{lo} {hi}");
    }
}
