//! Bad input at the public boundary gives typed errors, never a panic.

use hgca_kernels::{
    Alpha, AttnShape, Beta, DType, Error, KvSlices, KvSource, KvStore, Selection, WindowSpec,
};
use proptest::prelude::*;

#[test]
fn shapes_are_validated() {
    assert!(matches!(
        AttnShape::new(0, 1, 8),
        Err(Error::Zero { what: "q_heads" })
    ));
    assert!(matches!(
        AttnShape::new(4, 0, 8),
        Err(Error::Zero { what: "kv_heads" })
    ));
    assert!(matches!(
        AttnShape::new(4, 2, 0),
        Err(Error::Zero { what: "head_dim" })
    ));
    assert!(matches!(
        AttnShape::new(6, 4, 8),
        Err(Error::GroupMismatch {
            q_heads: 6,
            kv_heads: 4
        })
    ));
    let s = AttnShape::new(8, 2, 64).unwrap();
    assert_eq!((s.group(), s.q_len(), s.kv_token_len()), (4, 512, 128));
    assert!(
        s.with_scale(f32::NAN)
            .is_err_and(|e| matches!(e, Error::Param { what: "scale", .. }))
    );
    assert_eq!(s.with_scale(0.5).unwrap().scale(), 0.5);
    assert!(WindowSpec::new(s, 0, DType::F16).is_err_and(|e| matches!(
        e,
        Error::Zero {
            what: "window capacity"
        }
    )));
    assert_eq!(
        WindowSpec::new(s, 10, DType::F16).unwrap().bytes(),
        2 * 10 * 128 * 2
    );
}

#[test]
fn beta_alpha_and_selection_validate() {
    for bad in [f32::NAN, -0.1, f32::INFINITY] {
        let e = Beta::uniform(2, bad).unwrap_err();
        assert!(matches!(e, Error::Param { what: "beta", .. }), "{e}");
    }
    assert!(Beta::new(vec![]).is_err_and(|e| matches!(e, Error::Zero { what: "beta heads" })));
    assert!(
        Alpha::new(1.5).is_err_and(|e| matches!(e, Error::Param { what: "alpha", .. }))
            && Alpha::new(f32::NAN).is_err_and(|e| matches!(e, Error::Param { what: "alpha", .. }))
    );
    let sel = Selection::from_heads(&[vec![0u32, 3], vec![]]);
    assert!(matches!(
        sel.validate(3, 4),
        Err(Error::ShapeMismatch { .. })
    ));
    assert!(matches!(
        sel.validate(2, 3),
        Err(Error::Index {
            index: 3,
            len: 3,
            ..
        })
    ));
    assert_eq!(sel.total(), 2);
}

#[test]
fn kv_store_layouts_agree() {
    let (hk, d, n) = (3, 5, 70);
    let k: Vec<f32> = (0..hk * n * d).map(|x| x as f32).collect();
    let v: Vec<f32> = k.iter().map(|x| -x).collect();
    let slices = KvSlices::new(hk, d, n, &k, &v).unwrap();
    let mut head_major = KvStore::<f32>::new(hk, d, 16).unwrap();
    head_major.push_head_major(n, &k, &v).unwrap();
    // The same tokens, pushed token-major in uneven pieces, with blocks of
    // 1 token (70 blocks: chunks of 1, 2, .., 64 blocks) and of 8.
    for bt in [1, 8] {
        token_major_agrees(&slices, bt);
    }
    for h in 0..hk {
        for t in 0..n {
            assert_eq!(head_major.k_row(h, t), slices.k_row(h, t));
            assert_eq!(head_major.v_row(h, t), slices.v_row(h, t));
        }
    }
    assert_eq!(head_major.bytes(), 2 * 5 * 16 * hk * d * 4);
    assert!(KvStore::<f32>::new(1, 1, 12).is_err_and(|e| matches!(
        e,
        Error::Param {
            what: "block_tokens",
            ..
        }
    )));
    assert!(
        head_major
            .push_head_major(2, &k[..3], &v[..3])
            .is_err_and(|e| matches!(
                e,
                Error::Length {
                    what: "k",
                    expected: 30,
                    found: 3
                }
            ))
    );
    assert_eq!(head_major.tokens(), n, "a refused push keeps the store");
    assert!(
        KvSlices::new(hk, d, n + 1, &k, &v)
            .is_err_and(|e| matches!(e, Error::Length { what: "k", .. }))
    );
}

fn token_major_agrees(slices: &KvSlices<'_, f32>, bt: usize) {
    let (hk, d, n) = (slices.kv_heads(), slices.head_dim(), slices.tokens());
    let mut token_major = KvStore::<f32>::new(hk, d, bt).unwrap();
    let mut j = 0;
    for piece in [1usize, 7, 8, 9, 45] {
        let mut kt = Vec::new();
        let mut vt = Vec::new();
        for t in j..j + piece {
            for h in 0..hk {
                kt.extend_from_slice(slices.k_row(h, t));
                vt.extend_from_slice(slices.v_row(h, t));
            }
        }
        token_major.push_token_major(piece, &kt, &vt).unwrap();
        j += piece;
    }
    assert_eq!(j, n);
    let copy = token_major.clone();
    for h in 0..hk {
        for t in 0..n {
            assert_eq!(token_major.k_row(h, t), slices.k_row(h, t), "bt {bt}");
            assert_eq!(token_major.v_row(h, t), slices.v_row(h, t), "bt {bt}");
            assert_eq!(copy.k_row(h, t), slices.k_row(h, t), "bt {bt}");
            assert_eq!(copy.v_row(h, t), slices.v_row(h, t), "bt {bt}");
        }
    }
    assert_eq!(token_major.bytes(), 2 * n.div_ceil(bt) * bt * hk * d * 4);
}

proptest! {
    /// No panic for any shape numbers.
    #[test]
    fn any_shape_numbers_never_panic(q in 0usize..40, kv in 0usize..40, d in 0usize..300) {
        match AttnShape::new(q, kv, d) {
            Ok(s) => prop_assert!(s.q_heads() % s.kv_heads() == 0 && s.head_dim() > 0),
            Err(_) => prop_assert!(q == 0 || kv == 0 || d == 0 || q % kv != 0),
        }
    }
}

/// Accessors given a head past the last answer with an empty list, an empty
/// slice or a threshold nothing passes, never a panic (the contract: no
/// panic reachable from the public API).
#[test]
fn accessors_past_the_last_head_do_not_panic() {
    let sel = Selection::from_heads(&[vec![1u32, 4], vec![2]]);
    assert_eq!(sel.head(1), [2]);
    assert_eq!(sel.offset(1), 2);
    for h in [2, 3, usize::MAX] {
        assert!(sel.head(h).is_empty());
        assert_eq!(sel.offset(h), sel.total());
    }
    let (k, v) = (vec![0.5f32; 2 * 3 * 4], vec![1.0f32; 2 * 3 * 4]);
    let kv = KvSlices::new(2, 4, 3, &k, &v).unwrap();
    assert_eq!(kv.k_head(1).len(), 12);
    for h in [2, usize::MAX / 4, usize::MAX] {
        assert!(kv.k_head(h).is_empty() && kv.v_head(h).is_empty());
    }
    let beta = Beta::new(vec![2.0, 4.0]).unwrap();
    assert_eq!(beta.threshold(1, 8), 0.5);
    assert_eq!(beta.threshold(2, 8), f32::INFINITY);
    assert_eq!(beta.threshold(usize::MAX, 0), f32::INFINITY);
}
