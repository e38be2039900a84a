//! Writes one prompt's keys and its last queries, per layer, for offline
//! study of the selector's estimate: `cargo run --release -p hgca-llm
//! --example qk_trace -- MODEL TEXT TOKENS LAST OUTDIR`. Files:
//! `OUTDIR/k{layer}.f32` (`[TOKENS, kv_heads, d]`), `OUTDIR/q{layer}.f32`
//! (`[LAST, q_heads, d]`, the last LAST tokens' queries) and `meta.txt`.
use std::sync::{Arc, Mutex};

use hgca_hybrid::{FullAttention, SequenceAttention};
use hgca_kernels::AttnShape;
use hgca_llm::{
    BoxedAttention, GgufFile, GgufTokenizer, Llama, LlamaWeights, Logits, WeightFormat, cpu_backend,
};

#[derive(Clone)]
struct Rec {
    inner: FullAttention<f32>,
    k: Arc<Mutex<Vec<f32>>>,
    q: Arc<Mutex<Vec<f32>>>,
}

impl SequenceAttention for Rec {
    fn forward(
        &mut self,
        q: &[f32],
        k: &[f32],
        v: &[f32],
        n: usize,
        out: &mut [f32],
    ) -> hgca_kernels::Result<()> {
        self.k.lock().unwrap().extend_from_slice(k);
        self.q.lock().unwrap().extend_from_slice(q);
        self.inner.forward(q, k, v, n, out)
    }
    fn len(&self) -> usize {
        self.inner.len()
    }
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let a: Vec<String> = std::env::args().collect();
    let (model, text, tokens, last, outdir) = (
        &a[1],
        &a[2],
        a[3].parse::<usize>()?,
        a[4].parse::<usize>()?,
        &a[5],
    );
    let mut f = GgufFile::open(model)?;
    let tok = GgufTokenizer::from_gguf(&f)?;
    let w = Arc::new(LlamaWeights::load(&mut f, WeightFormat::Quantized)?);
    let mut ids = tok.encode(&std::fs::read_to_string(text)?, true)?;
    ids.truncate(tokens);
    let recs: Arc<Mutex<Vec<(usize, AttnShape, Rec)>>> = Arc::default();
    let r2 = recs.clone();
    let mut llm = Llama::new(w, move |l, shape| {
        let r = Rec {
            inner: FullAttention::new(shape, cpu_backend())?,
            k: Arc::default(),
            q: Arc::default(),
        };
        r2.lock().unwrap().push((l, shape, r.clone()));
        Ok(Box::new(r) as BoxedAttention)
    })?;
    llm.forward(&ids, Logits::None)?;
    std::fs::create_dir_all(outdir)?;
    let mut meta = String::new();
    for (l, shape, r) in recs.lock().unwrap().iter() {
        let k = r.k.lock().unwrap();
        let q = r.q.lock().unwrap();
        let ql = shape.q_heads() * shape.head_dim();
        let q = &q[q.len() - last * ql..];
        let bytes = |x: &[f32]| x.iter().flat_map(|v| v.to_le_bytes()).collect::<Vec<u8>>();
        std::fs::write(format!("{outdir}/k{l}.f32"), bytes(&k))?;
        std::fs::write(format!("{outdir}/q{l}.f32"), bytes(q))?;
        meta += &format!(
            "{l} {} {} {} {}\n",
            shape.q_heads(),
            shape.kv_heads(),
            shape.head_dim(),
            shape.scale()
        );
    }
    std::fs::write(format!("{outdir}/meta.txt"), meta)?;
    eprintln!(
        "{} tokens, {} layers recorded",
        ids.len(),
        recs.lock().unwrap().len()
    );
    Ok(())
}
