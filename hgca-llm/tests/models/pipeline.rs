//! The whole pipeline on a tiny random GGUF written by the test: loading,
//! tokenizer round trips, forward pass, prefill vs decode agreement, errors.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use hgca_llm::synth::{SynthSpec, write_tiny_llama};
use hgca_llm::{
    Error, GgufFile, GgufTokenizer, Llama, LlamaConfig, LlamaWeights, Logits, PplOptions,
    WeightFormat, perplexity,
};

fn tiny(dir: &Path, spec: &SynthSpec) -> PathBuf {
    let path = dir.join("tiny.gguf");
    write_tiny_llama(&path, spec).expect("write tiny gguf");
    path
}

fn weights(path: &Path, format: WeightFormat) -> Arc<LlamaWeights> {
    Arc::new(LlamaWeights::from_path(path, format).expect("load"))
}

#[test]
fn loads_config_and_tokenizer() {
    let dir = tempfile::tempdir().unwrap();
    let spec = SynthSpec::default();
    let f = GgufFile::open(tiny(dir.path(), &spec)).unwrap();
    let c = LlamaConfig::from_gguf(&f).unwrap();
    assert_eq!((c.dim, c.n_heads, c.n_kv_heads, c.head_dim), (64, 4, 2, 16));
    assert_eq!((c.n_layers, c.ffn_dim), (2, 128));
    assert_eq!(c.vocab_size, 3 + 256 + hgca_llm::synth::MERGES.len());
    let tok = GgufTokenizer::from_gguf(&f).unwrap();
    assert_eq!(tok.vocab_size(), c.vocab_size);
    assert_eq!((tok.bos(), tok.eos()), (Some(1), Some(2)));
}

#[test]
fn tokenizer_round_trips_and_splits() {
    let dir = tempfile::tempdir().unwrap();
    let f = GgufFile::open(tiny(dir.path(), &SynthSpec::default())).unwrap();
    let tok = GgufTokenizer::from_gguf(&f).unwrap();
    for text in [
        "",
        "the theme and the ring",
        "Hello, World!  Two  spaces\nnew line\ttab",
        "digits 2024 and 3.14159",
        "unicode: café, naïve, 日本語, emoji 🦀",
        "<|im_start|>user\nhi<|im_end|>",
        " leading space",
    ] {
        let ids = tok.encode(text, true).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), text, "round trip of {text:?}");
    }
    // Merges apply: " the" is one token, "and" after a space too.
    let the = tok.token_to_id("Ġthe").unwrap();
    let and = tok.token_to_id("Ġand").unwrap();
    assert_eq!(tok.encode("a the and", false).unwrap()[1..], [the, and]);
    // The smollm pre-tokenizer splits digits one by one.
    let ids = tok.encode("2024", false).unwrap();
    assert_eq!(ids.len(), 4);
    // Special tokens are matched whole.
    assert_eq!(tok.encode("<|im_start|>", false).unwrap(), vec![1]);
    // Bad ids are a typed error, not a panic.
    assert!(matches!(
        tok.decode(&[10_000]),
        Err(Error::TokenId { id: 10_000, .. })
    ));
}

fn max_rel_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = a.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-6);
    a.iter().zip(b).fold(0f32, |m, (x, y)| m.max((x - y).abs())) / scale
}

#[test]
fn prefill_equals_decode_steps() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny(dir.path(), &SynthSpec::default());
    let w = weights(&path, WeightFormat::F32);
    let vocab = w.config().vocab_size;
    let ids: Vec<u32> = (0..37u32).map(|i| (i * 7 + 3) % vocab as u32).collect();

    let mut a = Llama::with_full_attention::<f32>(Arc::clone(&w)).unwrap();
    let all = a.forward(&ids, Logits::All).unwrap();
    assert_eq!(all.len(), ids.len() * vocab);
    assert!(all.iter().all(|x| x.is_finite()));
    assert_eq!(a.position(), ids.len());

    // n decode steps.
    let mut b = Llama::with_full_attention::<f32>(Arc::clone(&w)).unwrap();
    let mut steps = Vec::new();
    for &t in &ids {
        steps.extend(b.forward(&[t], Logits::Last).unwrap());
    }
    let d = max_rel_diff(&all, &steps);
    assert!(d < 1e-4, "prefill vs decode: max rel diff {d}");

    // Uneven chunks.
    let mut c = Llama::with_full_attention::<f32>(Arc::clone(&w)).unwrap();
    let mut chunked = Vec::new();
    for ch in [&ids[..5], &ids[5..6], &ids[6..30], &ids[30..]] {
        chunked.extend(c.forward(ch, Logits::All).unwrap());
    }
    let d = max_rel_diff(&all, &chunked);
    assert!(d < 1e-4, "prefill vs chunks: max rel diff {d}");

    // The logits depend on the context (attention is not a no-op).
    let mut e = Llama::with_full_attention::<f32>(Arc::clone(&w)).unwrap();
    let last_alone = e.forward(&ids[36..], Logits::Last).unwrap();
    assert!(max_rel_diff(&all[36 * vocab..], &last_alone) > 1e-3);
}

#[test]
fn weight_formats_agree() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny(dir.path(), &SynthSpec::default());
    let ids: Vec<u32> = (0..20u32).map(|i| (i * 13 + 5) % 250).collect();
    let reference = {
        let mut m = Llama::with_full_attention::<f32>(weights(&path, WeightFormat::F32)).unwrap();
        m.forward(&ids, Logits::All).unwrap()
    };
    for (format, tol) in [
        (WeightFormat::Q8, 0.05),
        (WeightFormat::Auto, 0.05),
        (WeightFormat::Quantized, 0.1),
    ] {
        let mut m = Llama::with_full_attention::<f32>(weights(&path, format)).unwrap();
        let mut got = m.forward(&ids[..18], Logits::All).unwrap();
        for &t in &ids[18..] {
            got.extend(m.forward(&[t], Logits::Last).unwrap());
        }
        let d = max_rel_diff(&reference, &got);
        assert!(d < tol, "{format:?}: max rel diff {d}");
    }
}

#[test]
fn kv_half_types_run() {
    let dir = tempfile::tempdir().unwrap();
    let w = weights(&tiny(dir.path(), &SynthSpec::default()), WeightFormat::F32);
    let ids = [5u32, 9, 100, 200, 42];
    let mut a = Llama::with_full_attention::<f32>(Arc::clone(&w)).unwrap();
    let mut b = Llama::with_full_attention::<hgca_kernels::f16>(Arc::clone(&w)).unwrap();
    let mut c = Llama::with_full_attention::<hgca_kernels::bf16>(Arc::clone(&w)).unwrap();
    let la = a.forward(&ids, Logits::All).unwrap();
    let lb = b.forward(&ids, Logits::All).unwrap();
    let lc = c.forward(&ids, Logits::All).unwrap();
    assert!(max_rel_diff(&la, &lb) < 1e-2);
    assert!(max_rel_diff(&la, &lc) < 5e-2);
}

#[test]
fn bad_inputs_are_typed_errors() {
    let dir = tempfile::tempdir().unwrap();
    let path = tiny(dir.path(), &SynthSpec::default());
    let w = weights(&path, WeightFormat::F32);
    let mut m = Llama::with_full_attention::<f32>(Arc::clone(&w)).unwrap();
    assert!(matches!(
        m.forward(&[1, 99_999], Logits::All),
        Err(Error::TokenId { id: 99_999, .. })
    ));
    assert_eq!(m.position(), 0, "a rejected call changes nothing");
    assert!(m.forward(&[], Logits::Last).unwrap().is_empty());
    assert_eq!(
        m.forward(&[3, 4], Logits::Last).unwrap().len(),
        w.config().vocab_size
    );
    assert!(m.forward(&[3], Logits::None).unwrap().is_empty());

    // Missing, empty, garbage and truncated files.
    assert!(matches!(
        LlamaWeights::from_path(dir.path().join("nope.gguf"), WeightFormat::F32),
        Err(Error::Io { .. })
    ));
    let empty = dir.path().join("empty.gguf");
    std::fs::write(&empty, b"").unwrap();
    assert!(
        matches!(GgufFile::open(&empty), Err(Error::Gguf { ref msg, .. }) if msg.contains("magic"))
    );
    let junk = dir.path().join("junk.gguf");
    std::fs::write(&junk, b"GGUF\x03\0\0\0\xff\xff\xff\xff\xff\xff\xff\xff").unwrap();
    assert!(matches!(
        GgufFile::open(&junk),
        Err(Error::Gguf { ref msg, .. }) if msg.contains("tensor count")
    ));
    let bytes = std::fs::read(&path).unwrap();
    let cut = dir.path().join("cut.gguf");
    std::fs::write(&cut, &bytes[..bytes.len() / 2]).unwrap();
    assert!(matches!(
        LlamaWeights::from_path(&cut, WeightFormat::F32),
        Err(Error::Gguf { ref msg, .. }) if msg.contains("does not fit")
    ));

    // Perplexity parameters.
    let ids = [5u32, 6, 7, 8];
    let f = hgca_llm::full_attention::<f32>();
    let bad = PplOptions {
        context: 1,
        chunk: 1,
        ..PplOptions::default()
    };
    assert!(matches!(
        perplexity(&w, &ids, bad, f, |_| {}),
        Err(Error::Invalid { .. })
    ));
    let bad = PplOptions {
        context: 4,
        chunk: 0,
        ..PplOptions::default()
    };
    assert!(matches!(
        perplexity(&w, &ids, bad, f, |_| {}),
        Err(Error::Invalid { what: "chunk", .. })
    ));
    assert!(matches!(
        perplexity(&w, &ids[..1], PplOptions::default(), f, |_| {}),
        Err(Error::Invalid { what: "tokens", .. })
    ));
}

#[test]
fn perplexity_segments_and_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let w = weights(&tiny(dir.path(), &SynthSpec::default()), WeightFormat::F32);
    let ids: Vec<u32> = (0..64u32).map(|i| (i * 31 + 7) % 250).collect();
    let f = hgca_llm::full_attention::<f32>();
    let whole = perplexity(
        &w,
        &ids,
        PplOptions {
            context: 32,
            chunk: 32,
            ..PplOptions::default()
        },
        f,
        |_| {},
    )
    .unwrap();
    assert_eq!((whole.segments, whole.scored, whole.tokens), (2, 62, 64));
    assert!(whole.ppl.is_finite() && whole.ppl > 1.0);
    // Chunked prefill and token-by-token decoding give the same perplexity.
    let chunked = perplexity(
        &w,
        &ids,
        PplOptions {
            context: 32,
            chunk: 7,
            ..PplOptions::default()
        },
        f,
        |_| {},
    )
    .unwrap();
    let decoded = perplexity(
        &w,
        &ids,
        PplOptions {
            context: 32,
            chunk: 1,
            ..PplOptions::default()
        },
        f,
        |_| {},
    )
    .unwrap();
    assert!((whole.ppl / chunked.ppl - 1.0).abs() < 1e-5);
    assert!((whole.ppl / decoded.ppl - 1.0).abs() < 1e-5);
    // Context-only prefix, then decode steps: the scored tokens are the last 32 - 20 of each segment.
    let opts = PplOptions {
        context: 32,
        chunk: 8,
        score_from: 20,
        decode: true,
    };
    let tail = perplexity(&w, &ids, opts, f, |_| {}).unwrap();
    assert_eq!(tail.scored, 2 * 12);
    let opts = PplOptions {
        context: 32,
        chunk: 32,
        score_from: 20,
        decode: false,
    };
    let tail2 = perplexity(&w, &ids, opts, f, |_| {}).unwrap();
    assert!((tail.ppl / tail2.ppl - 1.0).abs() < 1e-5);
    let opts = PplOptions {
        context: 32,
        chunk: 8,
        score_from: 31,
        decode: true,
    };
    assert!(matches!(
        perplexity(&w, &ids, opts, f, |_| {}),
        Err(Error::Invalid {
            what: "score_from",
            ..
        })
    ));
}

#[test]
fn hybrid_selecting_everything_equals_full() {
    for arch in [hgca_llm::Arch::Llama, hgca_llm::Arch::Qwen2] {
        hybrid_equals_full_for(arch);
    }
}

fn hybrid_equals_full_for(arch: hgca_llm::Arch) {
    use hgca_hybrid::{HybridAttention, HybridConfig, Recovery};
    let dir = tempfile::tempdir().unwrap();
    let spec = SynthSpec {
        arch,
        ..SynthSpec::default()
    };
    let w = weights(&tiny(dir.path(), &spec), WeightFormat::F32);
    let ids: Vec<u32> = (0..80u32).map(|i| (i * 17 + 11) % 250).collect();
    let full = hgca_llm::full_attention::<f32>();
    // Prefill 30 tokens, then 50 decode steps with a 16-token window: most
    // entries live in the CPU store.
    let opts = PplOptions {
        context: 80,
        chunk: 30,
        score_from: 31,
        decode: true,
    };
    let reference = perplexity(&w, &ids, opts, full, |_| {}).unwrap();
    for recovery in [Recovery::Rescore { every: 1 }, Recovery::Frozen] {
        let hybrid = |_: usize, s| -> hgca_llm::Result<hgca_llm::BoxedAttention> {
            let cfg = HybridConfig {
                window: 16,
                block: 8,
                sinks: 0,
                // beta 0: every entry with a positive MAW is selected.
                beta: 0.0,
                recovery,
                ..HybridConfig::default()
            };
            Ok(Box::new(HybridAttention::<_, _, f32>::cpu(s, cfg)?))
        };
        let got = perplexity(&w, &ids, opts, hybrid, |_| {}).unwrap();
        assert_eq!(got.scored, reference.scored);
        let rel = (got.ppl / reference.ppl - 1.0).abs();
        assert!(
            rel < 1e-5,
            "{arch:?} {recovery:?}: {} vs {}",
            got.ppl,
            reference.ppl
        );
    }
}

/// A GGUF is untrusted input: every truncation and a spread of corrupted
/// bytes give a one-line `Error::Gguf` naming the file (or a later typed
/// error), never a panic; an alignment of 0 (a division by zero inside
/// candle) is refused before candle reads the header.
#[test]
fn malformed_gguf_is_one_line_error() {
    let dir = tempfile::tempdir().unwrap();
    let spec = SynthSpec {
        n_layers: 1,
        ..SynthSpec::default()
    };
    let bytes = std::fs::read(tiny(dir.path(), &spec)).unwrap();
    let open = |b: Vec<u8>| -> Result<(), Error> {
        let mut f = GgufFile::from_bytes("t.gguf", b)?;
        let _ = LlamaConfig::from_gguf(&f)?;
        let _ = GgufTokenizer::from_gguf(&f)?;
        let _ = LlamaWeights::load(&mut f, WeightFormat::default())?;
        Ok(())
    };
    open(bytes.clone()).expect("the intact file loads");
    // Every truncation, at a stride through the header and data.
    let mut cuts = 0;
    for n in (0..bytes.len()).step_by(bytes.len() / 400 + 1) {
        let e = open(bytes[..n].to_vec()).expect_err("a truncated file is refused");
        let msg = e.to_string();
        assert!(msg.starts_with("t.gguf: not a usable GGUF file:"), "{msg}");
        assert!(!msg.contains('\n'), "one line: {msg}");
        cuts += 1;
    }
    // Corrupted bytes: deterministic positions and values over the header.
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let header = bytes.len().min(20_000);
    for _ in 0..400 {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        let mut b = bytes.clone();
        for k in 0..3 {
            let at = (rng >> (k * 16)) as usize % header;
            b[at] = (rng >> (48 + k * 5)) as u8;
        }
        if let Err(e) = open(b) {
            assert!(!e.to_string().contains('\n'), "one line: {e}");
        }
    }
    // general.alignment = 0: the value follows its key and type (u32 4).
    let key = b"general.alignment";
    let at = bytes
        .windows(key.len())
        .position(|w| w == key)
        .expect("synth writes the key");
    let v = at + key.len() + 4;
    assert_eq!(bytes[v..v + 4], 32u32.to_le_bytes());
    let mut b = bytes.clone();
    b[v..v + 4].copy_from_slice(&0u32.to_le_bytes());
    let e = open(b).expect_err("alignment 0 is refused");
    assert!(e.to_string().contains("general.alignment"), "{e}");
    println!("{cuts} truncations refused, 400 corruptions, alignment 0 refused");
}

/// hgca's sparse FFN in the model: at sparsity 0 it is the dense FFN up to
/// the f16 rounding of its weight copies (both architectures); calibrated
/// to a sparsity, it computes about that share fewer neurons on the
/// calibration text itself, and reads fewer weight rows.
#[test]
fn sparse_ffn_matches_the_dense_ffn_at_sparsity_zero() {
    use hgca_llm::SparseFfn;
    for arch in [hgca_llm::Arch::Llama, hgca_llm::Arch::Qwen2] {
        let dir = tempfile::tempdir().unwrap();
        let spec = SynthSpec {
            arch,
            ..SynthSpec::default()
        };
        let w = weights(&tiny(dir.path(), &spec), WeightFormat::F32);
        let ids: Vec<u32> = (0..40u32).map(|i| (i * 13 + 5) % 250).collect();
        let dense = Llama::with_full_attention::<f32>(Arc::clone(&w))
            .unwrap()
            .forward(&ids, Logits::All)
            .unwrap();
        let cpu = hgca_cpu::CpuBackend::new();
        let ffn = Arc::new(SparseFfn::new(&w, cpu.clone()).unwrap());
        let sparse = Llama::with_full_attention::<f32>(Arc::clone(&w))
            .unwrap()
            .with_sparse_ffn(Arc::clone(&ffn))
            .forward(&ids, Logits::All)
            .unwrap();
        let d = max_rel_diff(&sparse, &dense);
        assert!(
            d < 2e-2 && d > 0.0,
            "{arch:?}: sparse FFN at sparsity 0 vs dense: {d}"
        );
        let c = ffn.count();
        let (layers, ff) = (w.config().n_layers as u64, w.config().ffn_dim as u64);
        assert_eq!(c.evals, 40 * layers);
        assert!(c.active as f64 > 0.99 * (40 * layers * ff) as f64, "{c:?}");
        // Calibrated to skip half the neurons, on the same tokens.
        let mut half = SparseFfn::new(&w, cpu.clone()).unwrap();
        half.calibrate(&w, &ids, 0.5).unwrap();
        assert!(half.thresholds().iter().all(|&t| t > 0.0));
        let half = Arc::new(half);
        Llama::with_full_attention::<f32>(Arc::clone(&w))
            .unwrap()
            .with_sparse_ffn(Arc::clone(&half))
            .forward(&ids, Logits::Last)
            .unwrap();
        let c = half.count();
        let share = c.active as f64 / (40 * layers * ff) as f64;
        // The first layer sees the calibration's inputs exactly; later ones
        // drift with the skipped neurons: about half, not exactly.
        assert!(
            (0.35..0.65).contains(&share),
            "{arch:?}: {share} of the neurons computed"
        );
        assert!(c.rows < 3 * 40 * layers * ff, "{c:?}");
        let mut bad = SparseFfn::new(&w, cpu.clone()).unwrap();
        assert!(matches!(
            bad.calibrate(&w, &ids, 1.0),
            Err(Error::Invalid { .. })
        ));
        assert!(matches!(
            bad.calibrate(&w, &[], 0.5),
            Err(Error::Invalid { .. })
        ));
    }
}

/// The hybrid FFN in the model: a neuron profile (JSON round trip,
/// frequencies that match its sparsity), hot sets placed by the planner,
/// and the split's identities: threshold 0 is the dense FFN whatever the
/// hot share; every neuron hot computes every neuron and reads no cold row;
/// at one threshold, hot neurons only add to what the sparse FFN computes.
#[test]
fn hybrid_ffn_splits_by_the_profile_and_keeps_the_identities() {
    use hgca_llm::{FfnFormat, NeuronProfile, SparseFfn};
    let dir = tempfile::tempdir().unwrap();
    let spec = SynthSpec {
        arch: hgca_llm::Arch::Qwen2,
        ..SynthSpec::default()
    };
    let w = weights(&tiny(dir.path(), &spec), WeightFormat::F32);
    let (layers, ff) = (w.config().n_layers, w.config().ffn_dim);
    let ids: Vec<u32> = (0..48u32).map(|i| (i * 29 + 3) % 250).collect();
    let p = NeuronProfile::measure(&w, &ids, 0.5).unwrap();
    assert_eq!(
        (p.freq.len(), p.thresholds.len(), p.tokens),
        (layers, layers, 48)
    );
    for f in &p.freq {
        assert_eq!(f.len(), ff);
        assert!(f.iter().all(|&x| (0.0..=1.0).contains(&x)));
        // About half of the (token, neuron) pairs pass the median.
        let mean = f.iter().sum::<f32>() / ff as f32;
        assert!((0.4..0.6).contains(&mean), "mean firing share {mean}");
    }
    let back = NeuronProfile::from_json(&p.to_json()).unwrap();
    assert_eq!(back.freq.len(), layers);
    assert_eq!(back.hot_sets(0.25).unwrap(), p.hot_sets(0.25).unwrap());
    let hot = p.hot_sets(0.25).unwrap();
    let total: usize = hot.iter().map(Vec::len).sum();
    assert_eq!(total, (0.25 * (layers * ff) as f64).round() as usize);
    assert!(matches!(p.hot_sets(1.5), Err(Error::Invalid { .. })));
    assert!(matches!(
        NeuronProfile::from_json("{\"tokens\": 3}"),
        Err(Error::Invalid { .. })
    ));

    let cpu = hgca_cpu::CpuBackend::new();
    let dense = Llama::with_full_attention::<f32>(Arc::clone(&w))
        .unwrap()
        .forward(&ids, Logits::All)
        .unwrap();
    let run = |ffn: &Arc<SparseFfn>| {
        Llama::with_full_attention::<f32>(Arc::clone(&w))
            .unwrap()
            .with_sparse_ffn(Arc::clone(ffn))
            .forward(&ids, Logits::All)
            .unwrap()
    };
    let evals = (48 * layers * ff) as u64;
    // Threshold 0: the dense FFN (f16 or Q8_0 weight copies), whatever the
    // split.
    for (r, fmt) in [
        (0.25, FfnFormat::F16),
        (1.0, FfnFormat::F16),
        (0.25, FfnFormat::Q8_0),
        (0.25, FfnFormat::Q8_0Int),
    ] {
        let ffn =
            Arc::new(SparseFfn::with_hot(&w, cpu.clone(), &p.hot_sets(r).unwrap(), fmt).unwrap());
        let d = max_rel_diff(&run(&ffn), &dense);
        assert!(d < 2e-2 && d > 0.0, "hot {r}: {d}");
        let c = ffn.count();
        assert_eq!(c.hot, (r * evals as f64).round() as u64, "hot {r}");
    }
    // Every neuron hot: a high threshold skips nothing, no cold row is read.
    let mut all =
        SparseFfn::with_hot(&w, cpu.clone(), &p.hot_sets(1.0).unwrap(), FfnFormat::F16).unwrap();
    all.set_thresholds(&vec![1e6; layers]).unwrap();
    let all = Arc::new(all);
    let d = max_rel_diff(&run(&all), &dense);
    assert!(d < 2e-2, "all hot: {d}");
    assert_eq!((all.count().active, all.count().rows), (evals, 0));
    // One threshold (the calibration's): the hybrid computes at least what
    // the sparse FFN does, and all its hot neurons.
    let mut sparse = SparseFfn::new(&w, cpu.clone()).unwrap();
    sparse.calibrate(&w, &ids, 0.5).unwrap();
    let mut hybrid = SparseFfn::with_hot(&w, cpu.clone(), &hot, FfnFormat::F16).unwrap();
    hybrid.set_thresholds(&sparse.thresholds()).unwrap();
    let (sparse, hybrid) = (Arc::new(sparse), Arc::new(hybrid));
    let (ys, yh) = (run(&sparse), run(&hybrid));
    let (cs, ch) = (sparse.count(), hybrid.count());
    assert_eq!(ch.hot, (total * 48) as u64);
    assert!(ch.active > cs.active, "{ch:?} vs {cs:?}");
    assert!(ch.rows < cs.rows, "{ch:?} vs {cs:?}");
    assert!(
        max_rel_diff(&yh, &dense) < max_rel_diff(&ys, &dense),
        "hot neurons bring the output closer to the dense FFN"
    );
    assert!(matches!(
        SparseFfn::with_hot(&w, cpu.clone(), &hot[..1], FfnFormat::F16),
        Err(Error::Invalid { .. })
    ));
    let mut bad = SparseFfn::new(&w, cpu).unwrap();
    assert!(bad.set_thresholds(&[0.1]).is_err());
    assert!(bad.set_thresholds(&vec![f32::NAN; layers]).is_err());
}

/// A hybrid layer factory for the tiny model: a 16-token window of 8-token
/// blocks under `recovery`, so that most of a few dozen tokens live in the
/// CPU store.
fn tiny_hybrid(
    recovery: hgca_hybrid::Recovery,
) -> impl FnMut(usize, hgca_kernels::AttnShape) -> hgca_llm::Result<hgca_llm::BoxedAttention> {
    move |_, s| {
        let cfg = hgca_hybrid::HybridConfig {
            window: 16,
            block: 8,
            sinks: 2,
            recovery,
            ..hgca_hybrid::HybridConfig::default()
        };
        Ok(Box::new(hgca_hybrid::HybridAttention::<_, _, f32>::cpu(s, cfg)?) as _)
    }
}

/// Decode steps over `ids`, the logits of each.
fn decode_all(llm: &mut Llama, ids: &[u32]) -> Vec<f32> {
    ids.iter()
        .flat_map(|&t| llm.forward(&[t], Logits::Last).unwrap())
        .collect()
}

/// A fork is a snapshot: it continues bit for bit as the original would,
/// and what the original does afterwards does not reach it (full attention
/// and the hybrid layer under the mass rule, whose low-bit keys, bounds and
/// MAW are copied too).
#[test]
fn fork_continues_bit_for_bit_and_alone() {
    let dir = tempfile::tempdir().unwrap();
    for spec in [SynthSpec::default(), gemma3_spec()] {
        fork_case(&weights(&tiny(dir.path(), &spec), WeightFormat::F32));
    }
}

/// The local layers' KV in f16 or bf16 (`Llama::with_local_kv`) gives
/// logits within those types' rounding of the f32 cache's, not the same
/// bits (the choice reaches the layers), on a prompt longer than the
/// window; chosen once the sequence holds tokens, it is a typed error.
#[test]
fn local_kv_types_run() {
    let dir = tempfile::tempdir().unwrap();
    let w = weights(&tiny(dir.path(), &gemma3_spec()), WeightFormat::F32);
    let ids: Vec<u32> = (0..30u32).map(|i| (i * 17 + 3) % 250).collect();
    let full = || Llama::with_full_attention::<f32>(Arc::clone(&w)).unwrap();
    let la = full().forward(&ids, Logits::All).unwrap();
    let mut b = full().with_local_kv::<hgca_kernels::f16>().unwrap();
    let lb = b.forward(&ids, Logits::All).unwrap();
    let mut c = full().with_local_kv::<hgca_kernels::bf16>().unwrap();
    let lc = c.forward(&ids, Logits::All).unwrap();
    assert!(max_rel_diff(&la, &lb) < 1e-2);
    assert!(max_rel_diff(&la, &lc) < 5e-2);
    assert_ne!(la, lb);
    assert!(matches!(
        b.with_local_kv::<f32>(),
        Err(Error::Invalid { .. })
    ));
}

/// A tiny Gemma 3: five local layers (sliding window of 8) and a global one.
fn gemma3_spec() -> SynthSpec {
    SynthSpec {
        arch: hgca_llm::Arch::Gemma3,
        n_layers: 6,
        ..SynthSpec::default()
    }
}

fn fork_case(w: &Arc<LlamaWeights>) {
    let arch = w.config().arch;
    let prompt: Vec<u32> = (0..40u32).map(|i| (i * 13 + 5) % 250).collect();
    let next: Vec<u32> = (0..12u32).map(|i| (i * 29 + 7) % 250).collect();
    let other: Vec<u32> = (0..9u32).map(|i| (i * 31 + 1) % 250).collect();
    let mass = "mass:0.8".parse().unwrap();
    type Make<'a> = Box<dyn Fn() -> Llama + 'a>;
    let variants: [(&str, Make<'_>); 3] = [
        (
            "full",
            Box::new(|| Llama::with_full_attention::<f32>(Arc::clone(w)).unwrap()),
        ),
        (
            "hybrid mass",
            Box::new(|| Llama::new(Arc::clone(w), tiny_hybrid(mass)).unwrap()),
        ),
        (
            "hybrid rescore",
            Box::new(|| {
                Llama::new(
                    Arc::clone(w),
                    tiny_hybrid(hgca_hybrid::Recovery::Rescore { every: 3 }),
                )
                .unwrap()
            }),
        ),
    ];
    for (name, make) in &variants {
        let mut a = make();
        a.forward(&prompt, Logits::None).unwrap();
        // Past the window: the decode steps select from the CPU store.
        decode_all(&mut a, &prompt[..5]);
        let mut b = a.fork();
        assert_eq!(b.position(), a.position());
        let straight = decode_all(&mut a, &next);
        // The original goes elsewhere; the fork then runs `next`.
        decode_all(&mut a, &other);
        let forked = decode_all(&mut b, &next);
        assert!(
            straight == forked,
            "{arch:?} {name}: a fork's continuation differs"
        );
        // A fork of a fork, after the original moved on, still starts
        // from where it was taken.
        let mut fresh = make();
        fresh.forward(&prompt, Logits::None).unwrap();
        decode_all(&mut fresh, &prompt[..5]);
        let mut c = fresh.fork().fork();
        decode_all(&mut fresh, &other);
        assert!(
            decode_all(&mut c, &next) == straight,
            "{arch:?} {name}: fork of a fork"
        );
    }
}

/// Followers of a prefill hold the cache their own prefill would have
/// built: a full-attention follower bit for bit (it sees the same queries,
/// keys and values), a hybrid follower to float rounding (its own prefill
/// runs the residual stream through its own exact, differently rounded
/// outputs); each split sequence then decodes alone.
#[test]
fn followers_hold_their_own_prefill() {
    let dir = tempfile::tempdir().unwrap();
    for arch in [
        hgca_llm::Arch::Llama,
        hgca_llm::Arch::Qwen2,
        hgca_llm::Arch::Gemma3,
    ] {
        let spec = SynthSpec {
            arch,
            // Gemma 3's sixth layer is its first global one.
            n_layers: if arch == hgca_llm::Arch::Gemma3 { 6 } else { 2 },
            ..SynthSpec::default()
        };
        let w = weights(&tiny(dir.path(), &spec), WeightFormat::F32);
        let prompt: Vec<u32> = (0..45u32).map(|i| (i * 11 + 3) % 250).collect();
        let next: Vec<u32> = (0..10u32).map(|i| (i * 17 + 2) % 250).collect();
        let mass = "mass:0.9".parse().unwrap();

        let mut lead = Llama::with_full_attention::<f32>(Arc::clone(&w)).unwrap();
        lead.follow(hgca_llm::full_attention::<f32>()).unwrap();
        lead.follow(tiny_hybrid(mass)).unwrap();
        for ch in prompt.chunks(16) {
            lead.forward(ch, Logits::None).unwrap();
        }
        let mut parts = lead.split();
        assert_eq!(parts.len(), 3);
        assert!(parts.iter().all(|p| p.position() == prompt.len()));

        let alone = |mut llm: Llama| {
            for ch in prompt.chunks(16) {
                llm.forward(ch, Logits::None).unwrap();
            }
            decode_all(&mut llm, &next)
        };
        let full = alone(Llama::with_full_attention::<f32>(Arc::clone(&w)).unwrap());
        let hybrid = alone(Llama::new(Arc::clone(&w), tiny_hybrid(mass)).unwrap());
        let got: Vec<Vec<f32>> = parts.iter_mut().map(|p| decode_all(p, &next)).collect();
        assert!(
            got[0] == full,
            "{arch:?}: the lead is a plain full-attention sequence"
        );
        assert!(got[1] == full, "{arch:?}: a full follower is bit for bit");
        let d = max_rel_diff(&got[2], &hybrid);
        assert!(
            d < 1e-4,
            "{arch:?}: hybrid follower vs its own prefill: {d}"
        );

        // Followers join an empty sequence only.
        let mut late = Llama::with_full_attention::<f32>(Arc::clone(&w)).unwrap();
        late.forward(&prompt[..3], Logits::None).unwrap();
        let e = late
            .follow(hgca_llm::full_attention::<f32>())
            .expect_err("a follower after tokens");
        assert!(matches!(e, Error::Invalid { what: "follow", .. }), "{e}");
    }
}
