//! `hgca-demo harness`: the accuracy of each recovery rule on the steady
//! and the shifting workload, as a table.

use hgca_hybrid::{HybridConfig, Recovery};
use hgca_kernels::Result;

use crate::args::{Args, Rule};
use crate::run::{config, run_best};

pub(crate) fn harness(a: &Args) -> Result<()> {
    println!(
        "accuracy harness: context {}, window ratio {}, {} decode steps, beta {}",
        a.context, a.window_ratio, a.steps, a.beta
    );
    println!(
        "{:<8} {:<26} {:>10} {:>12} {:>12} {:>12} {:>10}",
        "workload", "rule", "selected", "recall mean", "recall min", "worst head", "rel err"
    );
    for shift in [false, true] {
        for rule in [
            Rule::Fixed(Recovery::Frozen),
            Rule::Fixed(Recovery::Rescore { every: 16 }),
            Rule::Fixed(Recovery::BlockBounds { top: 32 }),
            Rule::BoundsShare(0.10),
            Rule::Fixed(HybridConfig::default().recovery),
        ] {
            let cfg = config(a, rule, a.window_ratio, a.beta);
            let b = Args { shift, ..a.clone() };
            let s = run_best(
                &Args {
                    backend: "cpu".into(),
                    ..b.clone()
                },
                cfg.clone(),
                true,
            )?;
            println!(
                "{:<8} {:<26} {:>9.2}% {:>11.3}% {:>11.3}% {:>11.3}% {:>10.2e}",
                if shift { "shift" } else { "steady" },
                format!("{:?}", cfg.recovery),
                100.0 * s.mean(|x| x.selected),
                100.0 * s.mean(|x| x.recall),
                100.0 * s.min_recall(),
                100.0 * s.min(|x| x.worst_recall),
                s.mean(|x| x.rel_err)
            );
        }
    }
    Ok(())
}
