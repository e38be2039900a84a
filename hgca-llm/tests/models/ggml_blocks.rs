//! hgca's GGUF block types read the bytes candle (ggml's layout) writes:
//! random rows quantised by candle to Q8_0, Q4_0, Q4_1, Q5_0, Q4_K and
//! Q6_K, their raw
//! blocks cast to hgca's types and dequantised by hgca, against candle's
//! own dequantisation (an independent implementation).

use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{Device, Tensor};
use hgca_kernels::{BlockQ4_0, BlockQ4_1, BlockQ4K, BlockQ5_0, BlockQ6K, BlockQ8_0, WeightElem};
use hgca_testkit::Rng;

fn check<W: WeightElem>(dtype: GgmlDType) {
    let (rows, cols) = (7, 512);
    let mut rng = Rng::new(42);
    // Values of several magnitudes, and a row of zeros.
    let v: Vec<f32> = (0..rows * cols)
        .map(|i| {
            if i / cols == 3 {
                0.0
            } else {
                rng.sym() * (1 + i % 5) as f32
            }
        })
        .collect();
    let t = Tensor::from_vec(v, (rows, cols), &Device::Cpu).unwrap();
    let q = QTensor::quantize(&t, dtype).unwrap();
    let want: Vec<f32> = q
        .dequantize(&Device::Cpu)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let bytes = q.data().unwrap();
    assert_eq!(
        bytes.len(),
        rows * cols / W::VALUES * size_of::<W>(),
        "{}",
        W::NAME
    );
    let blocks: Vec<W> = bytes
        .chunks_exact(size_of::<W>())
        .map(bytemuck::pod_read_unaligned)
        .collect();
    let mut got = vec![0.0f32; rows * cols];
    W::dequant_slice(&blocks, &mut got);
    for (i, (&g, &w)) in got.iter().zip(&want).enumerate() {
        assert!(
            (g - w).abs() <= 1e-6 * w.abs().max(1.0),
            "{} value {i}: hgca {g}, candle {w}",
            W::NAME
        );
    }
    assert!(want.iter().any(|&x| x != 0.0));
}

#[test]
fn block_types_match_candles_dequantisation() {
    check::<BlockQ8_0>(GgmlDType::Q8_0);
    check::<BlockQ4_0>(GgmlDType::Q4_0);
    check::<BlockQ4_1>(GgmlDType::Q4_1);
    check::<BlockQ5_0>(GgmlDType::Q5_0);
    check::<BlockQ4K>(GgmlDType::Q4K);
    check::<BlockQ6K>(GgmlDType::Q6K);
}
