//! Instruction sets: run-time detection, the few operations the kernels
//! need beyond `pulp::Simd` (widening f16/bf16 loads, prefetch, exp), and
//! each ISA's entry into the attention kernel's block work (`Kern::step_*`,
//! compiled once in this crate).
//!
//! ISAs: scalar, V3 (AVX2+FMA+F16C), V4 (AVX-512) in the `x86` module,
//! NEON in `neon`. All unsafe code of the crate lives here, each block with
//! its SAFETY line.

use core::fmt;

use half::{bf16, f16};
use hgca_kernels::{DType, Error, KvElem, Result};
use pulp::Simd;

use crate::kernel::Step;

/// An instruction set the CPU kernels can run on.
#[derive(Clone, Copy)]
pub enum Isa {
    /// Portable scalar code.
    Scalar,
    /// x86-64 AVX2 + FMA + F16C (x86-64-v3). Holds pulp's `V3` token, which
    /// does not check F16C: detection offers this ISA only with F16C.
    #[cfg(target_arch = "x86_64")]
    V3(pulp::x86::V3),
    /// x86-64 AVX-512 F/BW/CD/DQ/VL (x86-64-v4).
    #[cfg(target_arch = "x86_64")]
    V4(pulp::x86::V4),
    /// aarch64 Advanced SIMD.
    #[cfg(target_arch = "aarch64")]
    Neon(pulp::aarch64::Neon),
}

/// The name of an ISA, without the detection token.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum IsaKind {
    /// Scalar.
    Scalar,
    /// AVX2 + FMA + F16C.
    V3,
    /// AVX-512.
    V4,
    /// NEON.
    Neon,
}

impl IsaKind {
    /// Short name used in bench ids and logs.
    pub const fn name(self) -> &'static str {
        match self {
            IsaKind::Scalar => "scalar",
            IsaKind::V3 => "v3",
            IsaKind::V4 => "v4",
            IsaKind::Neon => "neon",
        }
    }
}

impl PartialEq for Isa {
    fn eq(&self, other: &Self) -> bool {
        self.kind() == other.kind()
    }
}
impl Eq for Isa {}

impl fmt::Debug for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind().name())
    }
}

impl fmt::Display for Isa {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.kind().name())
    }
}

impl Isa {
    /// The best ISA of this machine (detected at run time).
    pub fn detect() -> Self {
        *Self::available()
            .last()
            .expect("scalar is always available")
    }

    /// Every ISA this machine can run, worst first (scalar always).
    pub fn available() -> Vec<Isa> {
        let mut v = vec![Isa::Scalar];
        #[cfg(target_arch = "x86_64")]
        {
            // x86-64-v3 includes F16C; pulp's V3 token does not check it.
            if let Some(s) = pulp::x86::V3::try_new()
                && std::is_x86_feature_detected!("f16c")
            {
                v.push(Isa::V3(s));
            }
            if let Some(s) = pulp::x86::V4::try_new() {
                v.push(Isa::V4(s));
            }
        }
        #[cfg(target_arch = "aarch64")]
        if let Some(s) = pulp::aarch64::Neon::try_new() {
            v.push(Isa::Neon(s));
        }
        v
    }

    /// The ISA of that kind, if this machine has it.
    ///
    /// # Errors
    /// [`Error::Unavailable`] when the CPU lacks it.
    pub fn of_kind(kind: IsaKind) -> Result<Isa> {
        Self::available()
            .into_iter()
            .find(|i| i.kind() == kind)
            .ok_or_else(|| {
                Error::unavailable(
                    "cpu",
                    format!("this CPU has no {} instructions", kind.name()),
                )
            })
    }

    /// Its kind.
    pub fn kind(&self) -> IsaKind {
        match self {
            Isa::Scalar => IsaKind::Scalar,
            #[cfg(target_arch = "x86_64")]
            Isa::V3(_) => IsaKind::V3,
            #[cfg(target_arch = "x86_64")]
            Isa::V4(_) => IsaKind::V4,
            #[cfg(target_arch = "aarch64")]
            Isa::Neon(_) => IsaKind::Neon,
        }
    }

    /// f32 lanes of one vector.
    pub fn lanes(&self) -> usize {
        match self {
            Isa::Scalar => 1,
            #[cfg(target_arch = "x86_64")]
            Isa::V3(_) => 8,
            #[cfg(target_arch = "x86_64")]
            Isa::V4(_) => 16,
            #[cfg(target_arch = "aarch64")]
            Isa::Neon(_) => 4,
        }
    }
}

/// Runs `$body` with `$s` bound to the concrete SIMD token of `$isa`,
/// inside that ISA's `vectorize` (V3: [`run_f16c`], which adds F16C), so
/// the target features are enabled and the `#[inline(always)]` kernels are
/// compiled for them. The form `dispatch!(isa, s, x => body)` also binds
/// `x` to the ISA's proof ([`Kern::Extra`]: on V3 the [`F16c`] of the one
/// detection made here), which the f16 loads take. The attention kernel's
/// work on a block of rows is entered again, non-generically, through
/// [`Kern`]'s `step_*` (with that proof); `$body` there only locates the
/// rows.
///
/// Each closure takes a [`Once`] by value, so it is `FnOnce` only. A
/// closure that is also `Fn` reaches `vectorize` through the compiler's
/// `FnOnce::call_once` shim, which is not always inlined: LLVM left the
/// AVX2 block bounds (its body inlined into the shim) outside the
/// target-feature function, every intrinsic became a call, and the bounds
/// ran at ~4900 ns per block instead of ~110. `scripts/check-inlined.sh`
/// checks the built binaries for such calls.
macro_rules! dispatch {
    ($isa:expr, $s:ident => $body:expr) => {
        $crate::isa::dispatch!($isa, $s, _ => $body)
    };
    ($isa:expr, $s:ident, $x:pat => $body:expr) => {{
        let once = $crate::isa::Once;
        match $isa {
            $crate::isa::Isa::Scalar => {
                let $s = pulp::Scalar::new();
                pulp::Simd::vectorize(
                    $s,
                    #[inline(always)]
                    || {
                        let _once = once;
                        let $x = ();
                        $body
                    },
                )
            }
            #[cfg(target_arch = "x86_64")]
            $crate::isa::Isa::V3($s) => match $crate::isa::F16c::detect() {
                Some(proof) => $crate::isa::run_f16c(
                    $s,
                    proof,
                    #[inline(always)]
                    |$x| {
                        let _once = once;
                        $body
                    },
                ),
                None => {
                    // A V3 token made by hand on a CPU without F16C
                    // (detection never offers one there): scalar code.
                    let $s = pulp::Scalar::new();
                    pulp::Simd::vectorize(
                        $s,
                        #[inline(always)]
                        || {
                            let _once = once;
                            let $x = ();
                            $body
                        },
                    )
                }
            },
            #[cfg(target_arch = "x86_64")]
            $crate::isa::Isa::V4($s) => pulp::Simd::vectorize(
                $s,
                #[inline(always)]
                || {
                    let _once = once;
                    let $x = ();
                    $body
                },
            ),
            #[cfg(target_arch = "aarch64")]
            $crate::isa::Isa::Neon($s) => pulp::Simd::vectorize(
                $s,
                #[inline(always)]
                || {
                    let _once = once;
                    let $x = ();
                    $body
                },
            ),
        }
    }};
}
pub(crate) use dispatch;

/// A value [`dispatch`]'s closures consume, which makes them `FnOnce` only.
pub(crate) struct Once;

/// Runs `f` (inlined) with x86-64-v3's features enabled, F16C included,
/// which pulp's `V3` leaves out, and hands it `proof`: the AVX2 kernels
/// then widen f16 with `vcvtph2ps` instead of eleven integer operations
/// per vector, and check nothing per vector.
#[cfg(target_arch = "x86_64")]
#[inline(always)]
pub(crate) fn run_f16c<R>(v3: pulp::x86::V3, proof: F16c, f: impl FnOnce(F16c) -> R) -> R {
    let _ = v3;
    // SAFETY: the V3 token proves x86-64-v3's features but F16C, which
    // `proof` proves (it is made only where F16C was detected).
    unsafe { with_f16c(proof, f) }
}

/// Proof that the CPU has F16C: made only by `F16c::detect` (the field
/// is private to this module). `dispatch!` detects once per call and
/// hands it down; V3's kernels widen f16 with it and check nothing more.
#[derive(Debug, Clone, Copy)]
pub struct F16c(());

impl F16c {
    /// The proof, if this CPU has F16C.
    #[inline]
    pub(crate) fn detect() -> Option<F16c> {
        #[cfg(target_arch = "x86_64")]
        if std::is_x86_feature_detected!("f16c") {
            return Some(F16c(()));
        }
        None
    }
}

/// [`run_f16c`]'s target-feature function. It takes the proof and `f`
/// as they are: a closure made in `run_f16c` to pass the proof in was
/// compiled as a function of its own, outside these features, and every
/// intrinsic in the V3 kernel became a call (28x slower;
/// `scripts/check-inlined.sh --release` caught it).
///
/// # Safety
/// The CPU must have every feature enabled here.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fxsr,sse3,ssse3,sse4.1,sse4.2,popcnt,avx,avx2,bmi1,bmi2,fma,lzcnt,f16c")]
#[inline]
unsafe fn with_f16c<R>(proof: F16c, f: impl FnOnce(F16c) -> R) -> R {
    f(proof)
}

/// What the kernels need from an ISA beyond `pulp::Simd`.
///
/// Implemented for `pulp::Scalar`, `V3`, `V4` and `Neon`; no other crate
/// can implement it (its `step_*` take a type only this crate can make).
pub trait Kern: Simd {
    /// What the kernels need to know beyond the token: V3, that the CPU has
    /// F16C ([`F16c`], which only this crate can make); the others, nothing.
    #[doc(hidden)]
    type Extra: Copy;
    /// Runs `f` inside this ISA's target features (`vectorize`; V3 with
    /// F16C added), handing it `extra`.
    #[doc(hidden)]
    fn enter<R>(self, extra: Self::Extra, f: impl FnOnce(Self::Extra) -> R) -> R;
    /// Widens `LANES` f16 values to f32 (exact), given the ISA's proof.
    fn widen_f16(self, extra: Self::Extra, src: &[f16]) -> Self::f32s;
    /// Widens `LANES` bf16 values to f32 (exact).
    fn widen_bf16(self, src: &[bf16]) -> Self::f32s;
    /// Widens `LANES` i8 values to f32 (exact). The default goes through
    /// memory; AVX2 and AVX-512 convert in registers.
    #[inline(always)]
    fn widen_i8(self, src: &[i8]) -> Self::f32s {
        let mut t = [0.0f32; 16];
        for (o, &v) in t.iter_mut().zip(&src[..Self::F32_LANES]) {
            *o = f32::from(v);
        }
        load(self, &t)
    }
    /// Widens `LANES` u8 values to f32 (exact). The default goes through
    /// memory; AVX2 and AVX-512 convert in registers.
    #[inline(always)]
    fn widen_u8(self, src: &[u8]) -> Self::f32s {
        let mut t = [0.0f32; 16];
        for (o, &v) in t.iter_mut().zip(&src[..Self::F32_LANES]) {
            *o = f32::from(v);
        }
        load(self, &t)
    }
    /// An f16 scale as f32 (exact). x86 converts with F16C: `half`'s
    /// conversion checks for F16C at run time on every call, out of line,
    /// which cost more than the rest of a block's work in the FFN's rows.
    #[inline(always)]
    fn scale_f16(self, extra: Self::Extra, h: f16) -> f32 {
        let _ = extra;
        h.to_f32()
    }
    /// GGUF's 32-value nibble layout (Q4_0, Q4_1, Q5_0) as one byte per
    /// value: value `k < 16` is the low nibble of `qs[k]`, value `k + 16`
    /// its high nibble, each plus 16 where bit `k` of `qh` (Q5_0's fifth
    /// bits, little endian) is set. AVX2 and AVX-512 unpack in registers.
    #[inline(always)]
    fn nibbles(self, qs: &[u8; 16], qh: Option<[u8; 4]>) -> [u8; 32] {
        let high = qh.map_or(0, u32::from_le_bytes);
        let mut q = [0u8; 32];
        for (k, &b) in qs.iter().enumerate() {
            q[k] = (b & 0x0F) | ((((high >> k) & 1) as u8) << 4);
            q[k + 16] = (b >> 4) | ((((high >> (k + 16)) & 1) as u8) << 4);
        }
        q
    }
    /// Hints the cache to fetch the line holding `p`. Never faults.
    #[inline(always)]
    fn prefetch(self, p: *const u8) {
        let _ = p;
    }
    /// One block of the attention kernel on f32 rows. Like the two below,
    /// a plain (non-generic) function of each ISA: the kernel's body is
    /// compiled once, in this crate, and entered inside the ISA's target
    /// features (the `kern_steps!` macro writes them). Only the kernel can
    /// make a `Step`: these are not callable from outside the crate.
    #[doc(hidden)]
    fn step_f32(self, extra: Self::Extra, a: Step<'_, f32>);
    /// One block of the attention kernel on f16 rows.
    #[doc(hidden)]
    fn step_f16(self, extra: Self::Extra, a: Step<'_, f16>);
    /// One block of the attention kernel on bf16 rows.
    #[doc(hidden)]
    fn step_bf16(self, extra: Self::Extra, a: Step<'_, bf16>);
    /// The horizontal sums of four vectors. ISAs with wide vectors reduce
    /// them together (a transposed reduction: about a third of the shuffles
    /// of four separate `reduce_sum_f32s`).
    #[inline(always)]
    fn reduce_sum4(self, v: [Self::f32s; 4]) -> [f32; 4] {
        v.map(|x| self.reduce_sum_f32s(x))
    }
}

/// Implements [`Kern`]'s `step_*` for one ISA: [`Kern::enter`] runs the
/// kernel inside the ISA's target features (`vectorize`, or [`run_f16c`]
/// for V3) with the proof the caller had.
/// The closures own their `Step` (it holds `&mut`), so they are `FnOnce`
/// only (see [`dispatch`] for why that matters).
macro_rules! kern_steps {
    () => {
        kern_steps!(@ step_f32: f32, step_f16: half::f16, step_bf16: half::bf16);
    };
    (@ $($name:ident: $t:ty),*) => {$(
        fn $name(self, extra: Self::Extra, a: $crate::kernel::Step<'_, $t>) {
            self.enter(extra, #[inline(always)] move |x| $crate::kernel::step(self, x, a))
        }
    )*};
}

/// [`Kern`]'s `Extra` and `enter` for an ISA whose pulp token is the whole
/// proof: `vectorize`.
macro_rules! kern_enter_vectorize {
    () => {
        type Extra = ();
        #[inline(always)]
        fn enter<R>(self, extra: (), f: impl FnOnce(()) -> R) -> R {
            pulp::Simd::vectorize(
                self,
                #[inline(always)]
                move || f(extra),
            )
        }
    };
}

/// Loads exactly one vector of f32 from the first `LANES` elements of `src`.
#[inline(always)]
pub fn load<S: Simd>(_simd: S, src: &[f32]) -> S::f32s {
    bytemuck::pod_read_unaligned(bytemuck::cast_slice(&src[..S::F32_LANES]))
}

/// Stores one vector into the first `LANES` elements of `dst`.
#[inline(always)]
pub fn store<S: Simd>(_simd: S, dst: &mut [f32], v: S::f32s) {
    bytemuck::cast_slice_mut::<f32, u8>(&mut dst[..S::F32_LANES])
        .copy_from_slice(bytemuck::bytes_of(&v));
}

/// A KV element the kernels can load as a vector of f32: every [`KvElem`]
/// (the match on the dtype constant is resolved at compile time).
pub trait SimdElem: KvElem {
    /// Loads `LANES` elements widened to f32, given the ISA's proof.
    fn load<S: Kern>(simd: S, extra: S::Extra, src: &[Self]) -> S::f32s;
}

impl<T: KvElem> SimdElem for T {
    #[inline(always)]
    fn load<S: Kern>(simd: S, extra: S::Extra, src: &[T]) -> S::f32s {
        match T::DTYPE {
            DType::F32 => load(simd, bytemuck::cast_slice::<T, f32>(src)),
            DType::F16 => simd.widen_f16(extra, bytemuck::cast_slice::<T, f16>(src)),
            DType::BF16 => simd.widen_bf16(bytemuck::cast_slice::<T, bf16>(src)),
        }
    }
}

impl Kern for pulp::Scalar {
    kern_enter_vectorize!();
    kern_steps!();
    #[inline(always)]
    fn widen_f16(self, _: (), src: &[f16]) -> f32 {
        src[0].to_f32()
    }
    #[inline(always)]
    fn widen_bf16(self, src: &[bf16]) -> f32 {
        src[0].to_f32()
    }
}

/// `exp(x)` for `x <= 0` (scores minus their running max), vectorised:
/// `x = n ln2 + r`, a degree-6 polynomial for `exp(r)` on `|r| <= ln2/2`,
/// and `2^n` built in the exponent bits. Inputs below -87 give about 1e-38
/// (the polynomial's floor), which no softmax can tell from 0; -inf gives 0.
/// Relative error about 2e-7.
#[inline(always)]
pub fn exp_neg<S: Simd>(s: S, x: S::f32s) -> S::f32s {
    let is_neg_inf = s.less_than_f32s(x, s.splat_f32s(-1e30));
    let x = s.max_f32s(x, s.splat_f32s(-87.0));
    // Round x*log2(e) to nearest with the 1.5*2^23 trick; keep n + 127 in the low mantissa bits.
    let magic = s.splat_f32s(12_582_912.0 + 127.0);
    let t = s.mul_add_f32s(x, s.splat_f32s(core::f32::consts::LOG2_E), magic);
    let n = s.sub_f32s(t, magic); // round(x log2 e), as f32
    let r = s.mul_add_f32s(n, s.splat_f32s(-0.693_359_4), x);
    let r = s.mul_add_f32s(n, s.splat_f32s(2.121_944_4e-4), r);
    let mut p = s.splat_f32s(1.0 / 720.0);
    for c in [1.0 / 120.0, 1.0 / 24.0, 1.0 / 6.0, 0.5, 1.0, 1.0] {
        p = s.mul_add_f32s(p, r, s.splat_f32s(c));
    }
    let bits = s.wrapping_dyn_shl_u32s(s.transmute_u32s_f32s(t), s.splat_u32s(23));
    let y = s.mul_f32s(p, s.transmute_f32s_u32s(bits));
    s.select_f32s(is_neg_inf, s.splat_f32s(0.0), y)
}

#[cfg(target_arch = "x86_64")]
mod x86 {
    use super::Kern;
    use core::arch::x86_64::*;
    use half::{bf16, f16};
    use pulp::x86::{V3, V4};

    impl Kern for V4 {
        kern_enter_vectorize!();
        kern_steps!();
        #[inline(always)]
        fn reduce_sum4(self, v: [Self::f32s; 4]) -> [f32; 4] {
            // SAFETY: the V4 token proves AVX-512F, which provides every
            // intrinsic below; all operate on registers only.
            unsafe {
                let [a, b, c, d]: [__m512; 4] = pulp::cast(v);
                // 512 -> 256: [a0+a2, a1+a3 | b0+b2, b1+b3] (128-bit blocks).
                let ab = _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0b01_00_01_00>(a, b),
                    _mm512_shuffle_f32x4::<0b11_10_11_10>(a, b),
                );
                let cd = _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0b01_00_01_00>(c, d),
                    _mm512_shuffle_f32x4::<0b11_10_11_10>(c, d),
                );
                // 256 -> 128: one block each for a, b, c, d.
                let x = _mm512_add_ps(
                    _mm512_shuffle_f32x4::<0b10_00_10_00>(ab, cd),
                    _mm512_shuffle_f32x4::<0b11_01_11_01>(ab, cd),
                );
                // 128 -> 64 -> 32 inside each block.
                let x = _mm512_add_ps(x, _mm512_permute_ps::<0b01_00_11_10>(x));
                let x = _mm512_add_ps(x, _mm512_permute_ps::<0b10_11_00_01>(x));
                let l: [f32; 16] = pulp::cast(x);
                [l[0], l[4], l[8], l[12]]
            }
        }
        #[inline(always)]
        fn widen_f16(self, _: (), src: &[f16]) -> Self::f32s {
            let src = &src[..16];
            // SAFETY: `src` holds 16 f16 = 32 bytes (checked above); the V4
            // token proves AVX-512F, which provides vcvtph2ps zmm.
            unsafe { pulp::cast(_mm512_cvtph_ps(_mm256_loadu_si256(src.as_ptr().cast()))) }
        }
        #[inline(always)]
        fn widen_bf16(self, src: &[bf16]) -> Self::f32s {
            let src = &src[..16];
            // SAFETY: 32 readable bytes (checked above); the V4 token proves AVX-512F.
            unsafe {
                let h = _mm512_cvtepu16_epi32(_mm256_loadu_si256(src.as_ptr().cast()));
                pulp::cast(_mm512_slli_epi32::<16>(h))
            }
        }
        #[inline(always)]
        fn widen_i8(self, src: &[i8]) -> Self::f32s {
            let src = &src[..16];
            // SAFETY: 16 readable bytes (checked above); the V4 token proves AVX-512F.
            unsafe {
                let v = _mm512_cvtepi8_epi32(_mm_loadu_si128(src.as_ptr().cast()));
                pulp::cast(_mm512_cvtepi32_ps(v))
            }
        }
        #[inline(always)]
        fn widen_u8(self, src: &[u8]) -> Self::f32s {
            let src = &src[..16];
            // SAFETY: 16 readable bytes (checked above); the V4 token proves AVX-512F.
            unsafe {
                let v = _mm512_cvtepu8_epi32(_mm_loadu_si128(src.as_ptr().cast()));
                pulp::cast(_mm512_cvtepi32_ps(v))
            }
        }
        #[inline(always)]
        fn scale_f16(self, _: (), h: f16) -> f32 {
            // SAFETY: the V4 token proves AVX-512F, which implies F16C.
            unsafe { super::x86_h2f(h) }
        }
        #[inline(always)]
        fn nibbles(self, qs: &[u8; 16], qh: Option<[u8; 4]>) -> [u8; 32] {
            // SAFETY: the V4 token proves AVX2, AVX-512BW and AVX-512VL;
            // registers only past the 16-byte load in `x86_nibbles`.
            unsafe {
                let q = super::x86_nibbles(qs);
                pulp::cast(match qh {
                    // 16 in the bytes whose bit of qh is set.
                    Some(h) => _mm256_or_si256(
                        q,
                        _mm256_maskz_mov_epi8(u32::from_le_bytes(h), _mm256_set1_epi8(0x10)),
                    ),
                    None => q,
                })
            }
        }
        #[inline(always)]
        fn prefetch(self, p: *const u8) {
            // SAFETY: prefetch never dereferences architecturally, any address is allowed.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
        }
    }

    impl Kern for V3 {
        type Extra = super::F16c;
        #[inline(always)]
        fn enter<R>(self, proof: super::F16c, f: impl FnOnce(super::F16c) -> R) -> R {
            super::run_f16c(self, proof, f)
        }
        kern_steps!();
        #[inline(always)]
        fn widen_f16(self, _: super::F16c, src: &[f16]) -> Self::f32s {
            let src = &src[..8];
            // SAFETY: `src` holds 8 f16 = 16 bytes (checked above); the V3
            // token proves AVX, and an `F16c` exists only where F16C was
            // detected. (In the kernels this is inlined into `with_f16c`,
            // whose target features include F16C.)
            unsafe { pulp::cast(_mm256_cvtph_ps(_mm_loadu_si128(src.as_ptr().cast()))) }
        }
        #[inline(always)]
        fn widen_bf16(self, src: &[bf16]) -> Self::f32s {
            let src = &src[..8];
            // SAFETY: 16 readable bytes (checked above); the V3 token proves AVX2.
            unsafe {
                let h = _mm256_cvtepu16_epi32(_mm_loadu_si128(src.as_ptr().cast()));
                pulp::cast(_mm256_slli_epi32::<16>(h))
            }
        }
        #[inline(always)]
        fn widen_i8(self, src: &[i8]) -> Self::f32s {
            let src = &src[..8];
            // SAFETY: 8 readable bytes (checked above); the V3 token proves AVX2.
            unsafe {
                let v = _mm256_cvtepi8_epi32(_mm_loadl_epi64(src.as_ptr().cast()));
                pulp::cast(_mm256_cvtepi32_ps(v))
            }
        }
        #[inline(always)]
        fn widen_u8(self, src: &[u8]) -> Self::f32s {
            let src = &src[..8];
            // SAFETY: 8 readable bytes (checked above); the V3 token proves AVX2.
            unsafe {
                let v = _mm256_cvtepu8_epi32(_mm_loadl_epi64(src.as_ptr().cast()));
                pulp::cast(_mm256_cvtepi32_ps(v))
            }
        }
        #[inline(always)]
        fn scale_f16(self, _: super::F16c, h: f16) -> f32 {
            // SAFETY: an `F16c` exists only where F16C was detected.
            unsafe { super::x86_h2f(h) }
        }
        #[inline(always)]
        fn nibbles(self, qs: &[u8; 16], qh: Option<[u8; 4]>) -> [u8; 32] {
            // SAFETY: the V3 token proves AVX2.
            unsafe {
                let q = super::x86_nibbles(qs);
                pulp::cast(match qh {
                    Some(h) => _mm256_or_si256(q, super::x86_fifth_bits(h)),
                    None => q,
                })
            }
        }
        #[inline(always)]
        fn prefetch(self, p: *const u8) {
            // SAFETY: prefetch never dereferences architecturally, any address is allowed.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(p.cast()) }
        }
    }
}

/// An f16 widened with F16C (`half`'s conversion would check for F16C at
/// run time on every call).
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "f16c")]
#[inline]
pub(crate) fn x86_h2f(h: f16) -> f32 {
    use core::arch::x86_64::*;
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(i32::from(h.to_bits()))))
}

/// GGUF's 4-bit nibble layout in one register, a byte per value: the low
/// nibbles of `qs` are values 0..16, the high ones 16..32.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn x86_nibbles(qs: &[u8; 16]) -> core::arch::x86_64::__m256i {
    use core::arch::x86_64::*;
    // SAFETY: 16 readable bytes.
    let v = unsafe { _mm_loadu_si128(qs.as_ptr().cast()) };
    let lo = _mm_and_si128(v, _mm_set1_epi8(0x0F));
    let hi = _mm_and_si128(_mm_srli_epi16::<4>(v), _mm_set1_epi8(0x0F));
    _mm256_set_m128i(hi, lo)
}

/// Q5_0's fifth bits with AVX2: byte `k` is 16 where bit `k` of `qh`
/// (little endian) is set, else 0. Byte `k` first takes qh's byte `k / 8`,
/// then every bit but `k % 8` is forced on: all ones exactly where bit
/// `k % 8` was set.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2")]
#[inline]
pub(crate) fn x86_fifth_bits(qh: [u8; 4]) -> core::arch::x86_64::__m256i {
    use core::arch::x86_64::*;
    let qh = _mm256_set1_epi32(i32::from_le_bytes(qh));
    let spread = _mm256_setr_epi8(
        0, 0, 0, 0, 0, 0, 0, 0, 1, 1, 1, 1, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 3, 3, 3, 3,
        3, 3,
    );
    let bytes = _mm256_shuffle_epi8(qh, spread);
    let others = _mm256_set1_epi64x(0x7fbf_dfef_f7fb_fdfe);
    let set = _mm256_cmpeq_epi8(_mm256_or_si256(bytes, others), _mm256_set1_epi8(-1));
    _mm256_and_si256(set, _mm256_set1_epi8(0x10))
}

#[cfg(target_arch = "aarch64")]
mod neon {
    use super::Kern;
    use core::arch::aarch64::*;
    use half::{bf16, f16};
    use pulp::aarch64::Neon;

    impl Kern for Neon {
        kern_enter_vectorize!();
        kern_steps!();
        #[inline(always)]
        fn widen_f16(self, _: (), src: &[f16]) -> Self::f32s {
            let src = &src[..4];
            // FCVTL (half to single, vector) is base ARMv8.0 AdvSIMD:
            // FEAT_FP16 (ARMv8.2) adds half-precision arithmetic, which this
            // does not use, so every AArch64 CPU runs it. FPCR.AHP is 0 under
            // Linux: IEEE half precision.
            // SAFETY: 8 readable bytes (checked above); the Neon token proves AdvSIMD.
            unsafe {
                let h = vld1_u16(src.as_ptr().cast());
                let out: float32x4_t;
                core::arch::asm!("fcvtl {o:v}.4s, {i:v}.4h", o = out(vreg) out, i = in(vreg) h, options(pure, nomem, nostack));
                pulp::cast(out)
            }
        }
        #[inline(always)]
        fn widen_bf16(self, src: &[bf16]) -> Self::f32s {
            let src = &src[..4];
            // SAFETY: 8 readable bytes (checked above); the Neon token proves AdvSIMD.
            unsafe { pulp::cast(vshll_n_u16::<16>(vld1_u16(src.as_ptr().cast()))) }
        }
        #[inline(always)]
        fn prefetch(self, p: *const u8) {
            // SAFETY: prfm never faults, any address is allowed.
            unsafe {
                core::arch::asm!("prfm pldl1keep, [{p}]", p = in(reg) p, options(nostack, readonly, preserves_flags))
            }
        }
    }
}
