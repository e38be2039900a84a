#!/usr/bin/env bash
# hgca-llm against llama.cpp on the same machine, GGUF, threads and KV type:
# decode tok/s at a context depth and time to first token for a whole prompt,
# measured in one run, alternating (llama.cpp, hgca full, hgca hybrid, then
# the next context), so a slow or noisy spell of the machine hits all three.
#
#   bash scripts/bench-vs-llamacpp.sh [--model smollm2|qwen2|gemma3] [--contexts 2048,8192]
#        [--threads N] [--decode N] [--reps N] [--rounds N] [--weights auto|native|...]
#        [--build-only]
#
# --rounds N repeats the whole alternation N times (a row per round) and
# adds a row of the medians of each column and of the rounds' ratios: on a
# shared virtual machine one spell of noise moves a single round's ratio by
# tens of percent.
#
# llama.cpp is built once from the llama-cpp-python 0.3.36 sdist (it vendors
# llama.cpp) with cmake and ninja from PyPI, into target/llamacpp (git-ignored).
# The build is portable (GGML_NATIVE=OFF) with the x86 ISA flags this CPU's
# /proc/cpuinfo lists, AMX off: the native build's AMX path segfaulted on an
# AMX machine. llama-bench runs with flash attention on and an f16 KV cache;
# hgca-llm with --kv f16 and the same thread count.
#
# Time to first token: llama.cpp's pp<N> (a prompt of N tokens from an empty
# cache, tokens/s) as N / rate; hgca-llm's `speed` prefill of N tokens.
set -euo pipefail

root="$(cd "$(dirname "$0")/.." && pwd)"
model=smollm2
contexts=""
threads="$(nproc)"
decode=32
reps=1
rounds=1
weights=""
build_only=0
while [[ $# -gt 0 ]]; do
    case "$1" in
        --model) model="$2"; shift 2 ;;
        --contexts) contexts="$2"; shift 2 ;;
        --threads) threads="$2"; shift 2 ;;
        --decode) decode="$2"; shift 2 ;;
        --reps) reps="$2"; shift 2 ;;
        --rounds) rounds="$2"; shift 2 ;;
        --weights) weights="$2"; shift 2 ;;
        --build-only) build_only=1; shift ;;
        *) echo "unknown argument: $1" >&2; exit 2 ;;
    esac
done
case "$model" in
    smollm2) gguf="$root/models/SmolLM2-135M-Instruct.Q4_1.gguf"; fetch=(); contexts="${contexts:-2048,8000}" ;;
    qwen2) gguf="$root/models/Qwen2.5-Coder-0.5B-Instruct.gguf"; fetch=(--qwen2); contexts="${contexts:-2048,8192,16384,32000}" ;;
    gemma3) gguf="$root/models/gemma-3-270m-q4_k_m.gguf"; fetch=(--gemma3); contexts="${contexts:-2048,8192,16384,32000}" ;;
    *) echo "--model is smollm2, qwen2 or gemma3, not $model" >&2; exit 2 ;;
esac

work="$root/target/llamacpp"
bench="$work/build/bin/llama-bench"
mkdir -p "$work"
if [[ ! -x "$bench" ]]; then
    echo "llama.cpp: building llama-bench from the llama-cpp-python 0.3.36 sdist into $work ..."
    python3 -m venv "$work/venv"
    "$work/venv/bin/pip" install --quiet cmake ninja
    if [[ ! -d "$work/src" ]]; then
        "$work/venv/bin/pip" download --quiet --no-deps --no-binary llama-cpp-python \
            --dest "$work/sdist" llama-cpp-python==0.3.36
        tar -xzf "$work"/sdist/llama_cpp_python-0.3.36.tar.gz -C "$work"
        mv "$work/llama_cpp_python-0.3.36/vendor/llama.cpp" "$work/src"
        rm -rf "$work/llama_cpp_python-0.3.36" "$work/sdist"
    fi
    flags=(-DGGML_NATIVE=OFF -DGGML_AMX_TILE=OFF -DGGML_AMX_INT8=OFF -DGGML_AMX_BF16=OFF
           -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF
           -DLLAMA_BUILD_SERVER=OFF -DCMAKE_BUILD_TYPE=Release)
    if [[ "$(uname -m)" == x86_64 ]]; then
        cpu="$(grep -m1 '^flags' /proc/cpuinfo)"
        has() { [[ " $cpu " == *" $1 "* ]] && echo ON || echo OFF; }
        flags+=(-DGGML_SSE42="$(has sse4_2)" -DGGML_AVX="$(has avx)" -DGGML_F16C="$(has f16c)"
                -DGGML_FMA="$(has fma)" -DGGML_AVX2="$(has avx2)" -DGGML_BMI2="$(has bmi2)"
                -DGGML_AVX512="$(has avx512f)" -DGGML_AVX512_VBMI="$(has avx512vbmi)"
                -DGGML_AVX512_VNNI="$(has avx512_vnni)" -DGGML_AVX512_BF16="$(has avx512_bf16)"
                -DGGML_AVX_VNNI="$(has avx_vnni)")
    fi
    PATH="$work/venv/bin:$PATH" cmake -S "$work/src" -B "$work/build" -G Ninja "${flags[@]}" >"$work/configure.log" 2>&1
    PATH="$work/venv/bin:$PATH" cmake --build "$work/build" --target llama-bench -j "$(nproc)" >"$work/build.log" 2>&1 || { tail -30 "$work/build.log" >&2; exit 1; }
    echo "llama.cpp: built $bench"
fi
[[ "$build_only" == 1 ]] && exit 0

[[ -s "$gguf" ]] || bash "$root/scripts/fetch-model.sh" "${fetch[@]}"
cargo build --release --quiet -p hgca-llm
hgca="$root/target/release/hgca-llm"
text="$root/data/persuasion.txt"
log="$work/last-run.log"
: >"$log"

# llama-bench: one test, its average tokens/s from the JSON lines output.
ll_rate() { # args: -p N -n M -d D
    "$bench" -m "$gguf" -t "$threads" -fa 1 -ctk f16 -ctv f16 -r "$reps" -o jsonl "$@" 2>>"$log" \
        | python3 -c 'import sys, json; print(json.loads(sys.stdin.read().strip().splitlines()[-1])["avg_ts"])'
}
# hgca-llm speed: "time to first token: Xs ..." and "decode: ... = Y tok/s".
hg_run() { # args: context attn
    "$hgca" --model "$gguf" --threads "$threads" --kv f16 ${weights:+--weights "$weights"} speed --text "$text" \
        --context "$1" --decode "$decode" --attn "$2" 2>>"$log" | tee -a "$log"
}
hg_ttft() { sed -n 's/^time to first token: \([0-9.]*\)s.*/\1/p'; }
hg_dec() { sed -n 's/^decode: .* = \([0-9.]*\) tok\/s.*/\1/p'; }

raw="$(mktemp)"
IFS=, read -r -a ctxs <<<"$contexts"
for round in $(seq 1 "$rounds"); do
for c in "${ctxs[@]}"; do
    echo "context $c, round $round: llama.cpp decode ..." >&2
    ll_dec="$(ll_rate -p 0 -n "$decode" -d "$c")"
    echo "context $c, round $round: llama.cpp prompt ..." >&2
    ll_pp="$(ll_rate -p "$c" -n 0)"
    echo "context $c, round $round: hgca-llm full ..." >&2
    full="$(hg_run "$c" full)"
    echo "context $c, round $round: hgca-llm hybrid ..." >&2
    hyb="$(hg_run "$c" hybrid)"
    ll_ttft="$(python3 -c "print(f'{$c / $ll_pp:.2f}')")"
    f_dec="$(hg_dec <<<"$full")"; h_dec="$(hg_dec <<<"$hyb")"
    f_ttft="$(hg_ttft <<<"$full")"; h_ttft="$(hg_ttft <<<"$hyb")"
    echo "$c $round $ll_dec $f_dec $h_dec $ll_ttft $f_ttft $h_ttft" >>"$raw"
done
done
table="$(python3 - "$raw" "$rounds" <<'PY'
import statistics as st, sys
rounds = int(sys.argv[2])
runs = {}
for line in open(sys.argv[1]):
    c, r, *v = line.split()
    runs.setdefault(c, []).append((r, list(map(float, v))))
def row(label, ld, fd, hd, lt, ft, ht, ratios=None):
    rf, rh, tf, th = ratios or (fd / ld, hd / ld, ft / lt, ht / lt)
    print(f"| {label} | {ld:.1f} | {fd:.1f} ({rf:.2f}x) | {hd:.1f} ({rh:.2f}x) "
          f"| {lt:.2f} | {ft:.2f} ({tf:.2f}x) | {ht:.2f} ({th:.2f}x) |")
for c, rs in runs.items():
    for r, v in rs:
        row(c if rounds == 1 else f"{c}, round {r}", *v)
    if rounds > 1:
        cols = [st.median(v[i] for _, v in rs) for i in range(6)]
        ratios = [st.median(v[a] / v[b] for _, v in rs) for a, b in ((1, 0), (2, 0), (4, 3), (5, 3))]
        row(f"{c}, median of {len(rs)}", *cols, ratios=ratios)
PY
)"
rm -f "$raw"
echo
echo "$(basename "$gguf"), $threads threads, KV f16, decode $decode tokens, llama-bench -fa 1 -r $reps, $rounds round(s);"
echo "hgca-llm speed (weights ${weights:-default}, hybrid: window ratio 0.25, mass:0.93, the default). Ratios: hgca / llama.cpp."
echo "| context | llama.cpp decode tok/s | hgca full | hgca hybrid | llama.cpp TTFT s | hgca full TTFT s | hgca hybrid TTFT s |"
echo "|---|---|---|---|---|---|---|"
echo "$table"
