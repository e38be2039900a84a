//! Gemma 3 against an independent forward pass: `scripts/gemma3_ref.py`
//! (numpy, weights dequantised by gguf-py) over a tiny random Gemma 3 GGUF
//! with five sliding-window layers and a global one, on a sequence longer
//! than the window. The Python with numpy and gguf is `HGCA_REF_PYTHON`, or
//! the project's venv (`.venv/py`, made by `scripts/python.sh --deps`);
//! without one the test skips (capability `gguf-ref`).

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

use hgca_llm::synth::{SYNTH_WINDOW, SynthSpec, write_tiny_llama};
use hgca_llm::{Arch, Llama, LlamaWeights, Logits, WeightFormat};

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// A Python that imports numpy and gguf, or why there is none.
fn ref_python() -> Result<PathBuf, String> {
    let py = match std::env::var_os("HGCA_REF_PYTHON") {
        Some(p) => PathBuf::from(p),
        None => repo().join(".venv/py/bin/python"),
    };
    let ok = Command::new(&py)
        .args(["-c", "import numpy, gguf"])
        .output()
        .map_err(|e| format!("{}: {e}", py.display()))?;
    if ok.status.success() {
        Ok(py)
    } else {
        Err(format!(
            "{} cannot import numpy and gguf: {}",
            py.display(),
            String::from_utf8_lossy(&ok.stderr).trim()
        ))
    }
}

/// Reads a float32 little-endian `.npy` of shape `[rows, cols]`.
fn read_npy(path: &Path) -> (Vec<usize>, Vec<f32>) {
    let b = std::fs::read(path).unwrap();
    assert_eq!(&b[..6], b"\x93NUMPY", "not an npy file");
    let hlen = u16::from_le_bytes([b[8], b[9]]) as usize;
    let header = std::str::from_utf8(&b[10..10 + hlen]).unwrap();
    assert!(header.contains("'<f4'"), "{header}");
    assert!(header.contains("'fortran_order': False"), "{header}");
    let shape: Vec<usize> = header
        .split_once("'shape': (")
        .and_then(|(_, r)| r.split_once(')'))
        .map(|(s, _)| {
            s.split(',')
                .filter(|x| !x.trim().is_empty())
                .map(|x| x.trim().parse().unwrap())
                .collect()
        })
        .unwrap();
    let data = b[10 + hlen..]
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    (shape, data)
}

#[test]
fn gemma3_matches_the_numpy_reference() {
    let py = match ref_python() {
        Ok(p) => p,
        Err(why) => {
            hgca_testkit::require::skip("gguf-ref", why);
            return;
        }
    };
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("tiny-gemma3.gguf");
    let spec = SynthSpec {
        arch: Arch::Gemma3,
        n_layers: 6,
        // Unlike the local layers' 10000, as Gemma 3's.
        rope_theta: 1e6,
        ..SynthSpec::default()
    };
    write_tiny_llama(&path, &spec).unwrap();
    let w = Arc::new(LlamaWeights::from_path(&path, WeightFormat::F32).unwrap());
    assert_eq!(w.config().local_window(0), Some(SYNTH_WINDOW));
    assert_eq!(w.config().local_window(5), None);
    let n = 3 * SYNTH_WINDOW + 5;
    let ids: Vec<u32> = (0..n as u32).map(|i| (i * 37 + 11) % 250).collect();
    compare(&py, &path, &w, &ids, 1e-3);
}

/// The real Gemma 3 270M (`scripts/fetch-model.sh --gemma3`; skipped when
/// absent) on 600-odd tokens of text, its own tokenizer, against the reference:
/// its weights dequantised to f32 on both sides.
#[test]
fn gemma3_270m_matches_the_numpy_reference() {
    let path = repo().join(hgca_llm::GEMMA3_MODEL);
    if !path.exists() {
        eprintln!(
            "SKIP: {} absent (bash scripts/fetch-model.sh --gemma3)",
            path.display()
        );
        return;
    }
    let py = match ref_python() {
        Ok(p) => p,
        Err(why) => {
            hgca_testkit::require::skip("gguf-ref", why);
            return;
        }
    };
    let f = hgca_llm::GgufFile::open(&path).unwrap();
    let tok = hgca_llm::GgufTokenizer::from_gguf(&f).unwrap();
    // Longer than the local layers' 512-token window.
    let text: String = (0..30)
        .map(|i| format!("{i}. Anne Elliot had been forced into prudence in her youth; she learned romance as she grew older.\n"))
        .collect();
    let ids = tok.encode(&text, true).unwrap();
    assert_eq!(ids[0], 2, "<bos>");
    assert!(ids.len() > 600, "{} tokens", ids.len());
    let w = Arc::new(LlamaWeights::from_path(&path, WeightFormat::F32).unwrap());
    compare(&py, &path, &w, &ids, 1e-3);
}

/// hgca-llm's logits of `ids` (a prompt chunk, then the last 6 as decode
/// steps: both paths of the local layers) against `gemma3_ref.py`'s, within
/// `tol` of the largest logit.
fn compare(py: &Path, path: &Path, w: &Arc<LlamaWeights>, ids: &[u32], tol: f32) {
    let n = ids.len();
    let dir = tempfile::tempdir().unwrap();
    let mut m = Llama::with_full_attention::<f32>(Arc::clone(w)).unwrap();
    let mut got = m.forward(&ids[..n - 6], Logits::All).unwrap();
    for &t in &ids[n - 6..] {
        got.extend(m.forward(&[t], Logits::Last).unwrap());
    }
    let out = dir.path().join("ref.npy");
    let list: Vec<String> = ids.iter().map(u32::to_string).collect();
    let run = Command::new(py)
        .arg(repo().join("scripts/gemma3_ref.py"))
        .arg(path)
        .arg(list.join(","))
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        run.status.success(),
        "gemma3_ref.py: {}",
        String::from_utf8_lossy(&run.stderr)
    );
    let (shape, want) = read_npy(&out);
    let vocab = w.config().vocab_size;
    assert_eq!(shape, [n, vocab]);
    let scale = want.iter().fold(0f32, |m, x| m.max(x.abs()));
    let worst = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (a - b).abs())
        .fold(0f32, f32::max);
    eprintln!("gemma3 vs numpy: max |diff| {worst:.2e}, max |logit| {scale:.2}");
    assert!(
        worst <= tol * scale,
        "logits differ from the reference by {worst} (scale {scale})"
    );
}
