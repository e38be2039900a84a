//! The demo's command line: the command, its options and the recovery rule
//! as the demo takes it.

use hgca_hybrid::Recovery;

#[derive(Debug, Clone)]
pub(crate) struct Args {
    pub(crate) cmd: String,
    pub(crate) context: usize,
    pub(crate) window_ratio: f64,
    pub(crate) block: usize,
    pub(crate) beta: f32,
    pub(crate) steps: usize,
    pub(crate) recovery: Rule,
    pub(crate) shift: bool,
    pub(crate) backend: String,
    pub(crate) json: bool,
    pub(crate) out: String,
    pub(crate) batch: usize,
    pub(crate) gpu_gib: f64,
    pub(crate) layers: usize,
    pub(crate) block_set: bool,
}

pub(crate) fn parse() -> std::result::Result<Args, String> {
    let mut a = Args {
        cmd: "hybrid".into(),
        context: 128 << 10,
        window_ratio: 0.25,
        block: 64,
        beta: 1.0,
        steps: 48,
        recovery: Rule::BoundsShare(0.10),
        shift: false,
        backend: "auto".into(),
        json: false,
        out: "target/hgca-sweep.svg".into(),
        batch: 1,
        gpu_gib: 16.0,
        layers: 32,
        block_set: false,
    };
    let mut it = std::env::args().skip(1).peekable();
    if let Some(c) = it.peek().filter(|c| !c.starts_with("--")).cloned() {
        a.cmd = c;
        it.next();
    }
    while let Some(flag) = it.next() {
        let mut val = || it.next().ok_or(format!("{flag} needs a value"));
        let num = |s: String| s.parse::<f64>().map_err(|e| format!("{flag} {s}: {e}"));
        // Counts are whole and at least 1 (a zero block or context has no
        // meaning here, and `as usize` would turn -5 or 1e30 into nonsense).
        let count = |s: String| match s.parse::<usize>() {
            Ok(0) => Err(format!("{flag} {s}: at least 1")),
            Ok(n) => Ok(n),
            Err(e) => Err(format!("{flag} {s}: a whole number ({e})")),
        };
        let within = |x: f64, lo: f64, hi: f64| {
            if x > lo && x <= hi {
                Ok(x)
            } else if hi == f64::MAX {
                Err(format!("{flag} {x}: expected more than {lo}"))
            } else {
                Err(format!("{flag} {x}: expected more than {lo}, at most {hi}"))
            }
        };
        match flag.as_str() {
            "--context" => {
                // Token indices are u32 (with room for the decode steps).
                a.context = count(val()?)?;
                if a.context > u32::MAX as usize / 2 {
                    return Err(format!("--context {}: at most {}", a.context, u32::MAX / 2));
                }
            }
            "--window-ratio" => a.window_ratio = within(num(val()?)?, 0.0, 1.0)?,
            "--block" => {
                a.block = count(val()?)?;
                a.block_set = true;
            }
            "--batch" => a.batch = count(val()?)?,
            "--gpu-gib" => a.gpu_gib = within(num(val()?)?, 0.0, f64::MAX)?,
            "--layers" => a.layers = count(val()?)?,
            "--beta" => a.beta = num(val()?)? as f32,
            "--steps" => {
                a.steps = count(val()?)?;
                if a.steps > u32::MAX as usize / 2 {
                    return Err(format!("--steps {}: at most {}", a.steps, u32::MAX / 2));
                }
            }
            "--backend" => a.backend = val()?,
            "--out" => a.out = val()?,
            "--json" => a.json = true,
            "--shift" => a.shift = true,
            "--recovery" => a.recovery = parse_recovery(&val()?)?,
            "-h" | "--help" => return Err(include_str!("usage.txt").into()),
            other => {
                return Err(format!(
                    "unknown option {other}\n{}",
                    include_str!("usage.txt")
                ));
            }
        }
    }
    Ok(a)
}

/// A recovery rule as the demo takes it: fixed, or block bounds admitting a
/// share of the CPU store's blocks (the default: 10%, the operating
/// point, where the accuracy targets are met on the synthetic workload).
#[derive(Debug, Clone, Copy)]
pub(crate) enum Rule {
    Fixed(Recovery),
    BoundsShare(f64),
}

fn parse_recovery(s: &str) -> std::result::Result<Rule, String> {
    // A share of the blocks (`bounds:P%`) is the demo's own; the rest is
    // hgca-hybrid's `FromStr`.
    if let Some(p) = s.strip_prefix("bounds:").and_then(|n| n.strip_suffix('%')) {
        return p
            .parse::<f64>()
            .ok()
            .filter(|p| (0.0..=100.0).contains(p))
            .map(|p| Rule::BoundsShare(p / 100.0))
            .ok_or(format!("--recovery {s}: a percentage 0..100"));
    }
    s.parse::<Recovery>().map(Rule::Fixed).map_err(|_| {
        format!("--recovery {s}: expected frozen, rescore:R, bounds:K, bounds:P% or mass:P[:S]")
    })
}
