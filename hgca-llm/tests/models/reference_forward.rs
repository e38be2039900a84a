//! Each architecture's forward pass against an independent one: a plain f64
//! transcription of the model's equations, written here from the GGUF's
//! tensors (f32 synthetic models, Llama and Qwen2), with nothing shared with
//! `hgca-llm`'s forward but the file (Gemma 3 has its own, in numpy:
//! gemma3.rs). Also Qwen2's tokenizer and the hybrid
//! layer equal to full attention when it selects every entry.

use std::sync::Arc;

use hgca_llm::synth::{SynthSpec, write_tiny_llama};
use hgca_llm::{
    Arch, GgufFile, GgufTokenizer, Llama, LlamaConfig, LlamaWeights, Logits, WeightFormat,
};

/// Reads tensor `name` as f64, row-major in candle's order.
fn t(f: &mut GgufFile, name: &str, dims: &[usize]) -> Vec<f64> {
    let q = f
        .tensor(name, dims)
        .unwrap_or_else(|e| panic!("{name}: {e}"));
    let v = q
        .dequantize(&candle_core::Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1::<f32>()
        .unwrap();
    v.into_iter().map(f64::from).collect()
}

/// `y = W x`, `W: [out, in]`.
fn matvec(w: &[f64], x: &[f64], out: usize) -> Vec<f64> {
    let n = x.len();
    (0..out)
        .map(|o| {
            w[o * n..(o + 1) * n]
                .iter()
                .zip(x)
                .map(|(a, b)| a * b)
                .sum()
        })
        .collect()
}

fn rms(x: &[f64], g: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let r = 1.0 / (ms + eps).sqrt();
    x.iter().zip(g).map(|(v, g)| v * r * g).collect()
}

/// RoPE of one head at position `p`: pairs (2i, 2i+1) for Llama, (i, i+d/2)
/// for Qwen2.
fn rope(h: &mut [f64], p: usize, theta: f64, arch: Arch) {
    let d = h.len();
    for i in 0..d / 2 {
        let a = p as f64 * theta.powf(-2.0 * i as f64 / d as f64);
        let (s, c) = a.sin_cos();
        let (x, y) = match arch {
            Arch::Llama => (2 * i, 2 * i + 1),
            Arch::Qwen2 | Arch::Gemma3 => (i, i + d / 2),
        };
        let (u, v) = (h[x], h[y]);
        h[x] = u * c - v * s;
        h[y] = u * s + v * c;
    }
}

/// Logits of every position of `ids`, `[n, vocab]`.
fn reference_logits(f: &mut GgufFile, ids: &[u32]) -> Vec<f64> {
    let c = LlamaConfig::from_gguf(f).unwrap();
    let (d, hd, kvd, ff, v) = (c.dim, c.head_dim, c.kv_dim(), c.ffn_dim, c.vocab_size);
    let (nh, nkv) = (c.n_heads, c.n_kv_heads);
    let eps = f64::from(c.rms_eps);
    let theta = f64::from(c.rope_theta);
    let emb = t(f, "token_embd.weight", &[v, d]);
    let head = if f.has_tensor("output.weight") {
        t(f, "output.weight", &[v, d])
    } else {
        emb.clone()
    };
    let out_norm = t(f, "output_norm.weight", &[d]);
    let mut xs: Vec<Vec<f64>> = ids
        .iter()
        .map(|&i| emb[i as usize * d..(i as usize + 1) * d].to_vec())
        .collect();
    for l in 0..c.n_layers {
        let w = |f: &mut GgufFile, s: &str, dims: &[usize]| t(f, &format!("blk.{l}.{s}"), dims);
        let (an, fnm) = (
            w(f, "attn_norm.weight", &[d]),
            w(f, "ffn_norm.weight", &[d]),
        );
        let (wq, wk, wv) = (
            w(f, "attn_q.weight", &[d, d]),
            w(f, "attn_k.weight", &[kvd, d]),
            w(f, "attn_v.weight", &[kvd, d]),
        );
        let wo = w(f, "attn_output.weight", &[d, d]);
        let (wg, wu, wd) = (
            w(f, "ffn_gate.weight", &[ff, d]),
            w(f, "ffn_up.weight", &[ff, d]),
            w(f, "ffn_down.weight", &[d, ff]),
        );
        let bias = |f: &mut GgufFile, s: &str, n: usize| match c.arch {
            Arch::Qwen2 => w(f, &format!("{s}.bias"), &[n]),
            Arch::Llama | Arch::Gemma3 => vec![0.0; n],
        };
        let (bq, bk, bv) = (
            bias(f, "attn_q", d),
            bias(f, "attn_k", kvd),
            bias(f, "attn_v", kvd),
        );
        let add =
            |a: Vec<f64>, b: &[f64]| a.iter().zip(b).map(|(x, y)| x + y).collect::<Vec<f64>>();
        let (mut qs, mut ks, mut vs) = (Vec::new(), Vec::new(), Vec::new());
        for (p, x) in xs.iter().enumerate() {
            let h = rms(x, &an, eps);
            let mut q = add(matvec(&wq, &h, d), &bq);
            let mut k = add(matvec(&wk, &h, kvd), &bk);
            for hh in q.chunks_mut(hd).chain(k.chunks_mut(hd)) {
                rope(hh, p, theta, c.arch);
            }
            qs.push(q);
            ks.push(k);
            vs.push(add(matvec(&wv, &h, kvd), &bv));
        }
        for (p, x) in xs.iter_mut().enumerate() {
            let mut att = vec![0.0; d];
            for h in 0..nh {
                let g = h / (nh / nkv);
                let q = &qs[p][h * hd..(h + 1) * hd];
                let s: Vec<f64> = (0..=p)
                    .map(|j| {
                        q.iter()
                            .zip(&ks[j][g * hd..(g + 1) * hd])
                            .map(|(a, b)| a * b)
                            .sum::<f64>()
                            / (hd as f64).sqrt()
                    })
                    .collect();
                let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let z: f64 = s.iter().map(|x| (x - m).exp()).sum();
                for (j, sj) in s.iter().enumerate() {
                    let wj = (sj - m).exp() / z;
                    for i in 0..hd {
                        att[h * hd + i] += wj * vs[j][g * hd + i];
                    }
                }
            }
            let o = matvec(&wo, &att, d);
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let h = rms(x, &fnm, eps);
            let (gt, up) = (matvec(&wg, &h, ff), matvec(&wu, &h, ff));
            let act: Vec<f64> = gt
                .iter()
                .zip(&up)
                .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
                .collect();
            let dn = matvec(&wd, &act, d);
            x.iter_mut().zip(&dn).for_each(|(a, b)| *a += b);
        }
    }
    xs.iter()
        .flat_map(|x| matvec(&head, &rms(x, &out_norm, eps), v))
        .collect()
}

fn spec(arch: Arch) -> SynthSpec {
    SynthSpec {
        quantized: false,
        arch,
        n_layers: 2,
        ..SynthSpec::default()
    }
}

#[test]
fn forward_equals_an_independent_f64_forward() {
    for arch in [Arch::Llama, Arch::Qwen2] {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("m.gguf");
        write_tiny_llama(&path, &spec(arch)).unwrap();
        let w = Arc::new(LlamaWeights::from_path(&path, WeightFormat::F32).unwrap());
        assert_eq!(w.config().arch, arch);
        let vocab = w.config().vocab_size;
        let ids: Vec<u32> = (0..23u32).map(|i| (i * 13 + 5) % vocab as u32).collect();
        let mut m = Llama::with_full_attention::<f32>(Arc::clone(&w)).unwrap();
        let got = m.forward(&ids, Logits::All).unwrap();
        let want = reference_logits(&mut GgufFile::open(&path).unwrap(), &ids);
        let scale = want.iter().fold(0f64, |a, x| a.max(x.abs()));
        let err = got
            .iter()
            .zip(&want)
            .fold(0f64, |a, (g, w)| a.max((f64::from(*g) - w).abs()))
            / scale;
        assert!(
            err < 1e-4,
            "{arch:?}: logits {err:.2e} (relative to the largest) off the f64 forward"
        );
        // The other RoPE pairing would be far off: the check can tell them apart.
        println!("{arch:?}: logits within {err:.1e} of the f64 forward");
    }
}

#[test]
fn qwen2_tokenizer_round_trips_and_splits_digits() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("q.gguf");
    write_tiny_llama(&path, &spec(Arch::Qwen2)).unwrap();
    let f = GgufFile::open(&path).unwrap();
    let tok = GgufTokenizer::from_gguf(&f).unwrap();
    for text in [
        "",
        "Hello, World!  Two  spaces\nnew line\ttab",
        "digits 2024 and 3.14159",
        "café 日本語 🦀",
        " x",
    ] {
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(tok.decode(&ids).unwrap(), text, "round trip of {text:?}");
    }
    // Qwen2's split takes digits one at a time.
    assert_eq!(tok.encode("2024", false).unwrap().len(), 4);
}
