//! The LSE merge: 2-way (in place) and 8-way, q_heads 32, d 128.
//! Throughput counts the bytes of the partials read and written.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use hgca_benches::fill;
use hgca_kernels::{AttnShape, Partial, PartialLayout, PartialRef, merge, merge_into};
use std::hint::black_box;

fn partials(layout: PartialLayout, n: usize) -> Vec<Partial> {
    (0..n)
        .map(|i| {
            let lse = fill(layout.rows(), 100 + i as u64)
                .iter()
                .map(|x| 4.0 * x)
                .collect();
            Partial::from_vecs(layout, fill(layout.out_len(), i as u64), lse).unwrap()
        })
        .collect()
}

fn bench(c: &mut Criterion) {
    let shape = AttnShape::new(32, 8, 128).unwrap();
    let layout = PartialLayout::decode(&shape);
    let bytes_one = ((layout.out_len() + layout.rows()) * 4) as u64;
    let mut g = c.benchmark_group("merge");
    for n in [2usize, 8] {
        let parts = partials(layout, n);
        let refs: Vec<PartialRef<'_>> = parts.iter().map(Partial::as_ref).collect();
        let mut out = Partial::empty(layout);
        g.throughput(Throughput::Bytes(bytes_one * (n as u64 + 1)));
        g.bench_function(format!("merge/scalar/f32/n{n}-q32-d128"), |b| {
            b.iter(|| merge(black_box(&refs), out.as_mut()).unwrap())
        });
    }
    let parts = partials(layout, 2);
    let mut acc = parts[0].clone();
    g.throughput(Throughput::Bytes(bytes_one * 3));
    g.bench_function("merge_into/scalar/f32/n2-q32-d128", |b| {
        b.iter(|| merge_into(acc.as_mut(), black_box(parts[1].as_ref())).unwrap())
    });
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
