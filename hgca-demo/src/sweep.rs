//! `hgca-demo sweep`: recall against CPU entries selected over a grid of
//! window ratios and betas, as a table, a CSV and an SVG plot.

use hgca_kernels::{Error, Result};

use crate::args::Args;
use crate::run::{config, run_best};

pub(crate) fn sweep(a: &Args) -> Result<()> {
    use plotters::prelude::*;
    let err = |e: String| Error::backend("plotters", e);
    // Checked before the runs: the table goes beside the plot, same name, .csv.
    let csv_path = std::path::Path::new(&a.out).with_extension("csv");
    if csv_path == std::path::Path::new(&a.out) {
        return Err(err(format!(
            "--out {}: the table goes to the same name with .csv, so the plot cannot end in .csv",
            a.out
        )));
    }
    let betas = [0.0625f32, 0.25, 1.0, 4.0, 16.0];
    let ratios = [0.125, 0.25, 0.5];
    println!(
        "sweep: context {}, {} steps, recovery {:?}",
        a.context, a.steps, a.recovery
    );
    println!(
        "{:>6} {:>8} {:>10} {:>12} {:>10}",
        "ratio", "beta", "selected", "recall", "rel err"
    );
    let mut series: Vec<(f64, Vec<(f64, f64)>)> = Vec::new();
    // The table again as CSV beside the plot, for a spreadsheet or a script.
    let mut csv = String::from("window_ratio,beta,selected_pct,recall_pct,rel_err\n");
    for &r in &ratios {
        let mut pts = Vec::new();
        for &b in &betas {
            let s = run_best(
                &Args {
                    backend: "cpu".into(),
                    ..a.clone()
                },
                config(a, a.recovery, r, b),
                true,
            )?;
            let (sel, rec, err) = (
                s.mean(|x| x.selected),
                s.mean(|x| x.recall),
                s.mean(|x| x.rel_err),
            );
            println!(
                "{r:>6} {b:>8} {:>9.2}% {:>11.3}% {err:>10.2e}",
                100.0 * sel,
                100.0 * rec
            );
            csv += &format!("{r},{b},{},{},{err:e}\n", 100.0 * sel, 100.0 * rec);
            pts.push((100.0 * sel, 100.0 * rec));
        }
        series.push((r, pts));
    }
    std::fs::write(&csv_path, csv)
        .map_err(|e| err(format!("writing {}: {e}", csv_path.display())))?;
    let root = SVGBackend::new(&a.out, (800, 500)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let ymin = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.1))
        .fold(100.0, f64::min)
        .floor()
        .min(99.0);
    let xmax = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.0))
        .fold(1.0, f64::max);
    let mut chart = ChartBuilder::on(&root)
        .caption(
            "hgca: attention-mass recall vs CPU entries selected",
            ("sans-serif", 22),
        )
        .margin(15)
        .x_label_area_size(40)
        .y_label_area_size(55)
        .build_cartesian_2d(0.0..xmax * 1.1, ymin..100.05)
        .map_err(|e| err(e.to_string()))?;
    chart
        .configure_mesh()
        .x_desc("selected CPU entries (%)")
        .y_desc("recall of the attention mass (%)")
        .draw()
        .map_err(|e| err(e.to_string()))?;
    for (i, (r, pts)) in series.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        chart
            .draw_series(LineSeries::new(pts.iter().copied(), color.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?
            .label(format!("window ratio {r}"))
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color));
        chart
            .draw_series(pts.iter().map(|&p| Circle::new(p, 4, color.filled())))
            .map_err(|e| err(e.to_string()))?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .draw()
        .map_err(|e| err(e.to_string()))?;
    root.present().map_err(|e| err(e.to_string()))?;
    println!(
        "plot written to {} (points: beta {betas:?}, left to right as beta falls), table to {}",
        a.out,
        csv_path.display()
    );
    Ok(())
}
