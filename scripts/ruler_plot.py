#!/usr/bin/env python3
"""Plots `hgca-llm ruler --json` results: accuracy (all tasks, with the 95%
Wilson interval) against the CPU-side bytes read, as a percentage of full
attention's, one point per attention variant and one panel per file and
context. Writes SVG with the standard library only.

Usage: python3 scripts/ruler_plot.py OUT.svg RESULTS.json [RESULTS.json ...]
"""
import json
import sys
from html import escape

W, H, PAD_L, PAD_B, PAD_T, PAD_R = 420, 300, 56, 44, 34, 16
COLORS = ["#1f77b4", "#d62728", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b", "#e377c2", "#17becf"]


def panels(paths):
    for path in paths:
        with open(path) as f:
            doc = json.load(f)
        model = doc["model"].rsplit("/", 1)[-1].replace(".gguf", "")
        for ctx in doc["contexts"]:
            rows = [c for c in ctx["cells"] if c["task"] == "all"]
            yield f"{model}, {ctx['context']} tokens, seed {doc['seed']}", rows


def panel(x0, y0, title, rows):
    pw, ph = W - PAD_L - PAD_R, H - PAD_T - PAD_B
    sx = lambda v: x0 + PAD_L + pw * v / 100.0
    sy = lambda v: y0 + PAD_T + ph * (1 - v / 100.0)
    out = [f'<text x="{x0 + W / 2}" y="{y0 + 20}" text-anchor="middle" font-size="13">{escape(title)}</text>']
    out.append(f'<rect x="{x0 + PAD_L}" y="{y0 + PAD_T}" width="{pw}" height="{ph}" fill="none" stroke="#444"/>')
    for t in range(0, 101, 20):
        out.append(f'<text x="{sx(t)}" y="{y0 + H - PAD_B + 16}" text-anchor="middle" font-size="10">{t}</text>')
        out.append(f'<text x="{x0 + PAD_L - 6}" y="{sy(t) + 3}" text-anchor="end" font-size="10">{t}</text>')
        out.append(f'<line x1="{x0 + PAD_L}" x2="{x0 + PAD_L + pw}" y1="{sy(t)}" y2="{sy(t)}" stroke="#ddd"/>')
    out.append(f'<text x="{x0 + PAD_L + pw / 2}" y="{y0 + H - 8}" text-anchor="middle" font-size="11">CPU-side bytes read, % of full attention</text>')
    out.append(f'<text x="{x0 + 14}" y="{y0 + PAD_T + ph / 2}" text-anchor="middle" font-size="11" transform="rotate(-90 {x0 + 14} {y0 + PAD_T + ph / 2})">accuracy, % (95% CI)</text>')
    for i, r in enumerate(rows):
        bytes_pct = r["cpu_bytes_read_pct"]
        x = 100.0 if bytes_pct is None else bytes_pct
        acc = 100.0 * r["right"] / max(r["questions"], 1)
        lo, hi = r["accuracy_ci95"]
        c = COLORS[i % len(COLORS)]
        out.append(f'<line x1="{sx(x)}" x2="{sx(x)}" y1="{sy(lo)}" y2="{sy(hi)}" stroke="{c}"/>')
        out.append(f'<circle cx="{sx(x)}" cy="{sy(acc)}" r="4" fill="{c}"/>')
        out.append(f'<text x="{x0 + PAD_L + pw - 4}" y="{y0 + PAD_T + 14 + 13 * i}" text-anchor="end" font-size="10" fill="{c}">'
                   f'{escape(r["variant"])}: {acc:.0f}% at {x:.0f}%</text>')
    return out


def main():
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    ps = list(panels(sys.argv[2:]))
    cols = min(len(ps), 2)
    rows = (len(ps) + cols - 1) // cols
    svg = [f'<svg xmlns="http://www.w3.org/2000/svg" width="{W * cols}" height="{H * rows}" font-family="sans-serif">',
           f'<rect width="100%" height="100%" fill="white"/>']
    for k, (title, data) in enumerate(ps):
        svg += panel(W * (k % cols), H * (k // cols), title, data)
    svg.append("</svg>")
    with open(sys.argv[1], "w") as f:
        f.write("\n".join(svg))
    print(f"wrote {sys.argv[1]} ({len(ps)} panels)")


if __name__ == "__main__":
    main()
