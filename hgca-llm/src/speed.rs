//! `hgca-llm speed`: time to first token (prefill) and decode speed at a
//! given context, with the decode time split per token.

use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use hgca_llm::{Error, Llama, Logits, Result, argmax};

use crate::cli::{AttnKind, Cli};
use crate::factory::{SelCount, full_factory, hybrid_config, hybrid_factory, local_kv};
use crate::load::{load, read_tokens};
use crate::progress::bar;

pub(crate) fn cmd_speed(
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
            local_kv(Llama::new(Arc::clone(&w), full_factory(cli.kv))?, cli.kv)?,
            "full attention".to_string(),
        ),
        AttnKind::Hybrid => {
            if !(ratio > 0.0 && ratio <= 1.0) {
                return Err(Error::Invalid {
                    what: "--window-ratio",
                    msg: format!("{ratio} is not in (0, 1]"),
                });
            }
            let spec = hybrid_config(context, ratio, recovery)?;
            let window = spec.0.window;
            let f = hybrid_factory(cli.kv, spec, Arc::clone(&count));
            (
                local_kv(Llama::new(Arc::clone(&w), f)?, cli.kv)?,
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
