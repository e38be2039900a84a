//! A batch of sequences, and the split of a decode step into append and
//! attend, against single-sequence layers.

use hgca_hybrid::{HybridAttention, HybridBatch, HybridConfig, Recovery, SequenceAttention};
use hgca_kernels::{AttnShape, Error};
use hgca_testkit::Rng;

fn tokens(rng: &mut Rng, n: usize, width: usize) -> Vec<f32> {
    (0..n * width).map(|_| 1.5 * rng.sym()).collect()
}

fn cfg(recovery: Recovery) -> HybridConfig {
    HybridConfig {
        window: 64,
        block: 16,
        beta: 0.5,
        recovery,
        ..HybridConfig::default()
    }
}

fn bits(x: &[f32]) -> Vec<u32> {
    x.iter().map(|v| v.to_bits()).collect()
}

const RECOVERIES: [Recovery; 3] = [
    Recovery::Frozen,
    Recovery::Rescore { every: 3 },
    Recovery::BlockBounds { top: 2 },
];

/// Every sequence of a batch gives, bit for bit, what its own layer gives:
/// through prompts of different lengths, batched decode steps over
/// different subsets of the batch (so the sequences' step counts differ),
/// window evictions, and a sequence removed and another added midway.
#[test]
fn batch_decode_matches_independent_layers() {
    let shape = AttnShape::new(8, 2, 16).unwrap();
    let (ql, kl) = (shape.q_len(), shape.kv_token_len());
    for recovery in RECOVERIES {
        let mut rng = Rng::new(7);
        let mut batch = HybridBatch::<_, _, f32>::cpu(shape, cfg(recovery)).unwrap();
        let mut ids = Vec::new();
        let mut solo = Vec::new();
        for prompt in [150usize, 0, 40] {
            let id = batch.add().unwrap();
            let mut layer = HybridAttention::<_, _, f32>::cpu(shape, cfg(recovery)).unwrap();
            if prompt > 0 {
                let (q, k, v) = (
                    tokens(&mut rng, prompt, ql),
                    tokens(&mut rng, prompt, kl),
                    tokens(&mut rng, prompt, kl),
                );
                let (mut a, mut b) = (vec![0.0; prompt * ql], vec![0.0; prompt * ql]);
                batch.forward(id, &q, &k, &v, prompt, &mut a).unwrap();
                layer.forward(&q, &k, &v, prompt, &mut b).unwrap();
                assert_eq!(bits(&a), bits(&b), "{recovery:?}: prompt outputs differ");
            }
            ids.push(id);
            solo.push(layer);
        }
        let (mut steps, mut most_cpu, mut partial) = (0, 0, 0);
        for step in 0..120 {
            if step == 60 {
                // The first sequence leaves, a new one joins.
                batch.remove(ids.remove(0)).unwrap();
                solo.remove(0);
                ids.push(batch.add().unwrap());
                solo.push(HybridAttention::<_, _, f32>::cpu(shape, cfg(recovery)).unwrap());
            }
            // Every third step leaves out one sequence, in turn.
            let members: Vec<usize> = (0..ids.len())
                .filter(|&i| step % 3 != 0 || i != (step / 3) % ids.len())
                .collect();
            let b = members.len();
            let (q, k, v) = (
                tokens(&mut rng, b, ql),
                tokens(&mut rng, b, kl),
                tokens(&mut rng, b, kl),
            );
            let mut out = vec![f32::NAN; b * ql];
            let step_ids: Vec<_> = members.iter().map(|&i| ids[i]).collect();
            batch.decode(&step_ids, &q, &k, &v, &mut out).unwrap();
            for (r, &i) in members.iter().enumerate() {
                let mut want = vec![f32::NAN; ql];
                solo[i]
                    .forward(
                        &q[r * ql..(r + 1) * ql],
                        &k[r * kl..(r + 1) * kl],
                        &v[r * kl..(r + 1) * kl],
                        1,
                        &mut want,
                    )
                    .unwrap();
                assert_eq!(
                    bits(&out[r * ql..(r + 1) * ql]),
                    bits(&want),
                    "{recovery:?} step {step}: sequence {i} differs from its own layer"
                );
                assert_eq!(batch.len(ids[i]).unwrap(), solo[i].len());
                let (sb, ss) = (batch.stats(ids[i]).unwrap(), solo[i].stats());
                assert_eq!(
                    (sb.selected, sb.cpu_tokens, sb.full_cpu),
                    (ss.selected, ss.cpu_tokens, ss.full_cpu)
                );
                steps += 1;
                most_cpu = most_cpu.max(sb.cpu_tokens);
                partial += usize::from(sb.selected < sb.cpu_tokens * shape.kv_heads());
            }
        }
        // Blocks moved to the CPU stores, and steps selected part of them.
        assert!(
            most_cpu >= 128,
            "{recovery:?}: at most {most_cpu} CPU tokens"
        );
        assert!(partial > 100, "{recovery:?}: {partial} partial selections");
        assert!(steps > 300, "{steps} sequence steps");
        assert!(batch.last_step() > std::time::Duration::ZERO);
    }
}

/// `append(k, v, 1)` then `attend(q)` is a decode step, bit for bit, MAW included.
#[test]
fn append_then_attend_is_a_decode_step() {
    let shape = AttnShape::new(4, 2, 24).unwrap();
    let (ql, kl) = (shape.q_len(), shape.kv_token_len());
    for recovery in RECOVERIES {
        let mut rng = Rng::new(11);
        let mut a = HybridAttention::<_, _, f32>::cpu(shape, cfg(recovery)).unwrap();
        let mut b = HybridAttention::<_, _, f32>::cpu(shape, cfg(recovery)).unwrap();
        for n in [
            90usize, 1, 1, 1, 1, 1, 1, 1, 30, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
        ] {
            let (q, k, v) = (
                tokens(&mut rng, n, ql),
                tokens(&mut rng, n, kl),
                tokens(&mut rng, n, kl),
            );
            let (mut x, mut y) = (vec![f32::NAN; n * ql], vec![f32::NAN; n * ql]);
            a.forward(&q, &k, &v, n, &mut x).unwrap();
            if n == 1 {
                b.append(&k, &v, 1).unwrap();
                b.attend(&q, &mut y).unwrap();
            } else {
                b.forward(&q, &k, &v, n, &mut y).unwrap();
            }
            assert_eq!(bits(&x), bits(&y), "{recovery:?}");
            let (ma, mb) = (a.maw_snapshot(), b.maw_snapshot());
            assert_eq!(ma.len(), mb.len());
            for (ga, gb) in ma.iter().zip(&mb) {
                assert_eq!(bits(ga), bits(gb), "{recovery:?}: MAW differs");
            }
        }
        assert!(a.cpu_tokens() > 0);
    }
}

/// Appending several tokens then attending sees all of them: a query that
/// matches one appended key strongly gets (nearly) that token's value.
#[test]
fn attend_sees_every_appended_token() {
    let shape = AttnShape::new(2, 1, 8).unwrap();
    let mut layer = HybridAttention::<_, _, f32>::cpu(shape, cfg(Recovery::Frozen)).unwrap();
    let n = 100;
    // Keys: token j along axis j % 8 scaled small, except token 37: large on axis 3.
    let mut k = vec![0.0f32; n * 8];
    let mut v = vec![0.0f32; n * 8];
    for j in 0..n {
        k[j * 8 + j % 8] = 0.01;
        v[j * 8 + 1] = if j == 37 { 5.0 } else { -1.0 };
    }
    k[37 * 8 + 3] = 40.0;
    layer.append(&k, &v, n).unwrap();
    assert_eq!(layer.len(), n);
    assert_eq!(layer.cpu_tokens(), 48, "evicted three blocks of 16");
    let mut q = vec![0.0f32; 16];
    q[3] = 1.0;
    q[8 + 3] = 1.0;
    let mut out = vec![f32::NAN; 16];
    // Token 37 is in the CPU store, with the MAW it got on append (1/64 or
    // more > beta / n_gpu = 0.5 / 52): selected.
    layer.attend(&q, &mut out).unwrap();
    assert!(out[1] > 4.99 && out[8 + 1] > 4.99, "{out:?}");
    assert!(layer.last_selection().head(0).contains(&37));
}

/// Attending before any token is the empty attention: zeros, no error; the
/// layer still works afterwards.
#[test]
fn attend_before_any_token_is_empty() {
    let shape = AttnShape::new(4, 2, 8).unwrap();
    let mut layer = HybridAttention::<_, _, f32>::cpu(shape, cfg(Recovery::Frozen)).unwrap();
    let mut out = vec![f32::NAN; 32];
    layer.attend(&[0.5; 32], &mut out).unwrap();
    assert!(out.iter().all(|&x| x == 0.0), "{out:?}");
    let mut batch = HybridBatch::<_, _, f32>::cpu(shape, cfg(Recovery::Frozen)).unwrap();
    let id = batch.add().unwrap();
    let mut out = vec![f32::NAN; 32];
    batch.attend(id, &[0.5; 32], &mut out).unwrap();
    assert!(out.iter().all(|&x| x == 0.0), "{out:?}");
    // Then a decode step as usual: one token, its value comes back.
    let v: Vec<f32> = (0..16).map(|i| i as f32).collect();
    layer
        .forward(&[0.5; 32], &[0.1; 16], &v, 1, &mut out)
        .unwrap();
    assert_eq!(&out[..8], &v[..8]);
    assert_eq!(&out[16..24], &v[8..16]);
}

/// Unknown, removed and repeated ids and wrong lengths are typed errors
/// that change nothing.
#[test]
fn batch_bad_input_is_a_typed_error_and_changes_nothing() {
    let shape = AttnShape::new(4, 2, 8).unwrap();
    let (ql, kl) = (shape.q_len(), shape.kv_token_len());
    let mut batch = HybridBatch::<_, _, f32>::cpu(shape, cfg(Recovery::Frozen)).unwrap();
    let a = batch.add().unwrap();
    let b = batch.add().unwrap();
    let gone = batch.add().unwrap();
    batch.remove(gone).unwrap();
    assert!(matches!(batch.remove(gone), Err(Error::Index { .. })));
    let c = batch.add().unwrap();
    assert_ne!(c, gone, "ids are not reused");
    assert_eq!(batch.ids().collect::<Vec<_>>(), [a, b, c]);
    let mut rng = Rng::new(5);
    let (q, k, v) = (
        tokens(&mut rng, 2, ql),
        tokens(&mut rng, 2, kl),
        tokens(&mut rng, 2, kl),
    );
    let mut out = vec![0.0; 2 * ql];
    batch.decode(&[a, b], &q, &k, &v, &mut out).unwrap();
    let lens = |bt: &HybridBatch<_, _, f32>| [a, b, c].map(|i| bt.len(i).unwrap());
    assert_eq!(lens(&batch), [1, 1, 0]);
    let cases: [(&[_], usize, usize, usize); 5] = [
        (&[a, gone], 2, 2, 2),
        (&[a, a], 2, 2, 2),
        (&[a, b], 1, 2, 2),
        (&[a, b], 2, 3, 2),
        (&[a, b], 2, 2, 1),
    ];
    for (ids, nq, nk, nout) in cases {
        let mut o = vec![0.0; nout * ql];
        let e = batch
            .decode(
                ids,
                &tokens(&mut rng, nq, ql),
                &tokens(&mut rng, nk, kl),
                &k,
                &mut o,
            )
            .unwrap_err();
        assert!(
            matches!(e, Error::Index { .. } | Error::Length { .. }),
            "{e}"
        );
        assert_eq!(lens(&batch), [1, 1, 0], "{ids:?}: {e}");
    }
    assert!(matches!(batch.len(gone), Err(Error::Index { .. })));
    assert!(matches!(batch.stats(gone), Err(Error::Index { .. })));
    assert!(matches!(
        batch.forward(gone, &q[..ql], &k[..kl], &v[..kl], 1, &mut out[..ql]),
        Err(Error::Index { .. })
    ));
    assert!(matches!(
        batch.append(gone, &k[..kl], &v[..kl], 1),
        Err(Error::Index { .. })
    ));
    assert!(matches!(
        batch.attend(gone, &q[..ql], &mut out[..ql]),
        Err(Error::Index { .. })
    ));
    assert!(matches!(
        batch.append(a, &k[..kl - 1], &v[..kl], 1),
        Err(Error::Length { .. })
    ));
    assert!(matches!(
        batch.attend(a, &q[..ql - 1], &mut out[..ql]),
        Err(Error::Length { .. })
    ));
    assert_eq!(lens(&batch), [1, 1, 0]);
    // An empty step is fine and changes nothing.
    batch.decode(&[], &[], &[], &[], &mut []).unwrap();
    assert_eq!(lens(&batch), [1, 1, 0]);
}
