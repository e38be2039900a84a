//! `hgca-demo hybrid`: one long-context decode, its accuracy against full
//! attention and its time per step (text or JSON).

use std::time::Duration;

use hgca_cpu::CpuBackend;
use hgca_kernels::Result;

use crate::args::Args;
use crate::run::{config, run_best};

fn ms(d: Duration, steps: usize) -> f64 {
    d.as_secs_f64() * 1e3 / steps.max(1) as f64
}

pub(crate) fn hybrid(a: &Args) -> Result<()> {
    let cfg = config(a, a.recovery, a.window_ratio, a.beta);
    if !a.json {
        println!(
            "hgca hybrid decode: q_heads 32, kv_heads 8, d 128, f16 KV; context {} tokens, window {} ({}), block {}, beta {}, recovery {:?}{}",
            a.context,
            cfg.window,
            a.window_ratio,
            cfg.block,
            cfg.beta,
            cfg.recovery,
            if a.shift { ", attention shift" } else { "" }
        );
    }
    let s = run_best(a, cfg.clone(), a.json)?;
    let steps = s.acc.len();
    let (dense, sparse, merge, total) = (
        ms(s.dense, steps),
        ms(s.sparse, steps),
        ms(s.merge, steps),
        ms(s.total, steps),
    );
    let submit = ms(s.dense_submit, steps);
    let select = ms(s.select, steps);
    let full = ms(s.full, steps);
    // The overlap bound: a step costs at most 1.1 x the slower side + merge,
    // with the dense side timed alone (a step's own dense time only shows
    // what the CPU side did not hide).
    let dense_alone = s.dense_alone.as_secs_f64() * 1e3;
    let bound = 1.1 * dense_alone.max(sparse) + merge;
    // Overlap: the share of the dense side's own time (timed alone) that the
    // step did not spend on it, i.e. that ran hidden behind the CPU side.
    let overlap = (1.0 - dense / dense_alone.max(1e-12)).clamp(0.0, 1.0);
    if a.json {
        println!(
            "{{\"backend\":\"{}\",\"isa\":\"{}\",\"context\":{},\"window\":{},\"block\":{},\"beta\":{},\"steps\":{steps},\"selected_fraction\":{:.5},\"rel_err_mean\":{:.3e},\"rel_err_max\":{:.3e},\"recall_mean\":{:.5},\"recall_min\":{:.5},\"rel_err_worst_head\":{:.3e},\"recall_worst_head\":{:.5},\"reference_rel_diff_max\":{:.3e},\"ms_dense\":{dense:.3},\"ms_dense_submit\":{submit:.3},\"ms_sparse\":{sparse:.3},\"ms_select\":{select:.3},\"ms_merge\":{merge:.3},\"ms_step\":{total:.3},\"ms_dense_alone\":{dense_alone:.3},\"ms_overlap_bound\":{bound:.3},\"ms_full_dense_cpu\":{full:.3},\"speedup_vs_full\":{:.2},\"overlap\":{overlap:.3},\"shares_cpu\":{}}}",
            s.backend,
            hgca_cpu::Isa::detect(),
            a.context,
            cfg.window,
            cfg.block,
            cfg.beta,
            s.mean(|x| x.selected),
            s.mean(|x| x.rel_err),
            s.max(|x| x.rel_err),
            s.mean(|x| x.recall),
            s.min_recall(),
            s.max(|x| x.worst_rel_err),
            s.min(|x| x.worst_recall),
            s.max(|x| x.reference_rel_diff),
            full / total,
            s.shares_cpu
        );
        return Ok(());
    }
    println!(
        "  backend: {} (CPU ISA {}, {} threads)",
        s.backend,
        hgca_cpu::Isa::detect(),
        CpuBackend::new().threads()
    );
    println!(
        "  tokens: {} in the window, {} in the CPU store",
        s.window, s.cpu_tokens
    );
    println!(
        "  selected: {:.2}% of the CPU entries (mean over {steps} steps)",
        100.0 * s.mean(|x| x.selected)
    );
    println!(
        "  accuracy vs full attention: relative error mean {:.2e}, max {:.2e}; attention-mass recall mean {:.4}%, min {:.4}%",
        s.mean(|x| x.rel_err),
        s.max(|x| x.rel_err),
        100.0 * s.mean(|x| x.recall),
        100.0 * s.min_recall()
    );
    println!(
        "  worst single query head over all steps: relative error {:.2e}, recall {:.4}%",
        s.max(|x| x.worst_rel_err),
        100.0 * s.min(|x| x.worst_recall)
    );
    println!(
        "  yardstick: full attention by the CPU kernel (f32); against hgca-ref (f64) on head 0 it differs by at most {:.1e} (relative)",
        s.max(|x| x.reference_rel_diff)
    );
    println!(
        "  time per step: {total:.2} ms = dense {dense:.2} (submit {submit:.2}, wait + copy-out {:.2}) + sparse {sparse:.2} (select {select:.2}) + merge/MAW {merge:.2} + other {:.2}",
        dense - submit,
        total - dense - sparse - merge
    );
    if s.shares_cpu {
        println!(
            "  overlap: none to measure here (the dense side runs on this CPU too, sharing its cores with the CPU side)"
        );
    } else {
        println!(
            "  overlap: {:.0}% of the dense side's own time ran hidden behind the CPU side",
            100.0 * overlap
        );
        println!(
            "  dense side alone: {dense_alone:.2} ms; bound 1.1 x max(dense alone, sparse) + merge = {bound:.2} ms: step {} it",
            if total <= bound { "meets" } else { "exceeds" }
        );
    }
    println!(
        "  dense CPU attention over all {} tokens: {full:.2} ms per step -> hybrid is {:.2}x faster",
        s.cpu_tokens + s.window,
        full / total
    );
    Ok(())
}
