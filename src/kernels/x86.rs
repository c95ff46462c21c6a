//! x86_64 kernels: AVX2 + F16C (8 lanes) and AVX-512 F/BW/VL (16 lanes).
//!
//! f16 uses the F16C conversion instructions (exact widening, RNE narrowing with inf/NaN
//! preserved). bf16 is integer shifts: widening is `bits << 16`, narrowing is the RNE bias trick
//! of [`portable::f32_to_bf16`] done lane-wise.
//!
//! Buffers may sit at any offset, so loads/stores are the unaligned forms, but every kernel first
//! peels a short head until its f32 stream is vector-aligned: a 16-byte-offset buffer (what glibc
//! returns for large `Vec`s) otherwise splits accesses across cache lines, measured ~25% slower
//! in cache. The other stream usually shares the offset and is aligned by the same peel.
//!
//! The AVX-512 intrinsics need Rust >= 1.89.

use std::arch::x86_64::*;

use super::{portable, Kernels};

/// The AVX2 table, if this CPU has AVX2 and F16C.
pub(super) fn avx2() -> Option<Kernels> {
    if !(is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")) {
        return None;
    }
    // SAFETY (every closure): each wraps a `#[target_feature(enable = "avx2,f16c")]` function,
    // and this table only exists after the detection above succeeded.
    Some(Kernels {
        level: "avx2",
        add_f32: |a, s| unsafe { avx2::add_f32(a, s) },
        widen_f16: |d, s| unsafe { avx2::widen_f16(d, s) },
        add_f16: |a, s| unsafe { avx2::add_f16(a, s) },
        widen_bf16: |d, s| unsafe { avx2::widen_bf16(d, s) },
        add_bf16: |a, s| unsafe { avx2::add_bf16(a, s) },
        narrow_f16: |d, s, k| unsafe { avx2::narrow_f16(d, s, k) },
        narrow_bf16: |d, s, k| unsafe { avx2::narrow_bf16(d, s, k) },
        scale_f32: |b, k| unsafe { avx2::scale_f32(b, k) },
    })
}

/// The AVX-512 table, if this CPU has AVX-512 F, BW and VL (BW+VL for 16-bit masked ops).
pub(super) fn avx512() -> Option<Kernels> {
    if !(is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vl"))
    {
        return None;
    }
    // SAFETY (every closure): each wraps a `#[target_feature(enable = "avx512f,avx512bw,
    // avx512vl")]` function, and this table only exists after the detection above succeeded.
    Some(Kernels {
        level: "avx512",
        add_f32: |a, s| unsafe { avx512::add_f32(a, s) },
        widen_f16: |d, s| unsafe { avx512::widen_f16(d, s) },
        add_f16: |a, s| unsafe { avx512::add_f16(a, s) },
        widen_bf16: |d, s| unsafe { avx512::widen_bf16(d, s) },
        add_bf16: |a, s| unsafe { avx512::add_bf16(a, s) },
        narrow_f16: |d, s, k| unsafe { avx512::narrow_f16(d, s, k) },
        narrow_bf16: |d, s, k| unsafe { avx512::narrow_bf16(d, s, k) },
        scale_f32: |b, k| unsafe { avx512::scale_f32(b, k) },
    })
}

/// 8 lanes per step; the alignment head and the short tail run the portable scalar code (same
/// rounding). Pointer arithmetic stays within `0..n`, and every function asserts the lengths it
/// relies on.
mod avx2 {
    use super::*;

    const W: usize = 8;

    /// `lo..hi`: the whole `w`-lane blocks of `0..n` once `p` (the f32 stream) is 32-byte
    /// aligned.
    #[inline(always)]
    fn span(p: *const f32, n: usize, w: usize) -> (usize, usize) {
        let lo = p.align_offset(32).min(n);
        (lo, lo + (n - lo) / w * w)
    }

    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn add_f32(acc: &mut [f32], src: &[f32]) {
        let n = acc.len();
        assert_eq!(src.len(), n, "add_f32: length mismatch");
        let (lo, hi) = span(acc.as_ptr(), n, W);
        portable::add_f32(&mut acc[..lo], &src[..lo]);
        let (a, s) = (acc.as_mut_ptr(), src.as_ptr());
        for i in (lo..hi).step_by(W) {
            let v = _mm256_add_ps(_mm256_loadu_ps(a.add(i)), _mm256_loadu_ps(s.add(i)));
            _mm256_storeu_ps(a.add(i), v);
        }
        portable::add_f32(&mut acc[hi..], &src[hi..]);
    }

    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load_f16(p: *const u16) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i))
    }

    #[target_feature(enable = "avx2,f16c")]
    unsafe fn load_bf16(p: *const u16) -> __m256 {
        let wide = _mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i));
        _mm256_castsi256_ps(_mm256_slli_epi32::<16>(wide))
    }

    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn widen_f16(dst: &mut [f32], src: &[u16]) {
        let n = dst.len();
        assert_eq!(src.len(), n, "widen_f16: length mismatch");
        let (lo, hi) = span(dst.as_ptr(), n, W);
        portable::widen_f16(&mut dst[..lo], &src[..lo]);
        for i in (lo..hi).step_by(W) {
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), load_f16(src.as_ptr().add(i)));
        }
        portable::widen_f16(&mut dst[hi..], &src[hi..]);
    }

    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn add_f16(acc: &mut [f32], src: &[u16]) {
        let n = acc.len();
        assert_eq!(src.len(), n, "add_f16: length mismatch");
        let (lo, hi) = span(acc.as_ptr(), n, W);
        portable::add_f16(&mut acc[..lo], &src[..lo]);
        let a = acc.as_mut_ptr();
        for i in (lo..hi).step_by(W) {
            let v = _mm256_add_ps(_mm256_loadu_ps(a.add(i)), load_f16(src.as_ptr().add(i)));
            _mm256_storeu_ps(a.add(i), v);
        }
        portable::add_f16(&mut acc[hi..], &src[hi..]);
    }

    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn widen_bf16(dst: &mut [f32], src: &[u16]) {
        let n = dst.len();
        assert_eq!(src.len(), n, "widen_bf16: length mismatch");
        let (lo, hi) = span(dst.as_ptr(), n, W);
        portable::widen_bf16(&mut dst[..lo], &src[..lo]);
        for i in (lo..hi).step_by(W) {
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), load_bf16(src.as_ptr().add(i)));
        }
        portable::widen_bf16(&mut dst[hi..], &src[hi..]);
    }

    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn add_bf16(acc: &mut [f32], src: &[u16]) {
        let n = acc.len();
        assert_eq!(src.len(), n, "add_bf16: length mismatch");
        let (lo, hi) = span(acc.as_ptr(), n, W);
        portable::add_bf16(&mut acc[..lo], &src[..lo]);
        let a = acc.as_mut_ptr();
        for i in (lo..hi).step_by(W) {
            let v = _mm256_add_ps(_mm256_loadu_ps(a.add(i)), load_bf16(src.as_ptr().add(i)));
            _mm256_storeu_ps(a.add(i), v);
        }
        portable::add_bf16(&mut acc[hi..], &src[hi..]);
    }

    /// f32 -> bf16 of 8 lanes (scaled), RNE, NaN quieted: [`portable::f32_to_bf16`] lane-wise.
    /// Returns the results zero-extended to 32-bit lanes.
    #[target_feature(enable = "avx2,f16c")]
    unsafe fn to_bf16(p: *const f32, k: __m256) -> __m256i {
        let v = _mm256_mul_ps(_mm256_loadu_ps(p), k);
        let x = _mm256_castps_si256(v);
        let hi = _mm256_srli_epi32::<16>(x);
        let lsb = _mm256_and_si256(hi, _mm256_set1_epi32(1));
        let bias = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), lsb);
        let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(x, bias));
        let quiet = _mm256_or_si256(hi, _mm256_set1_epi32(0x40));
        let nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
        _mm256_blendv_epi8(rounded, quiet, nan)
    }

    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn narrow_f16(dst: &mut [u16], src: &[f32], scale: f32) {
        let n = dst.len();
        assert_eq!(src.len(), n, "narrow_f16: length mismatch");
        let k = _mm256_set1_ps(scale);
        let (lo, hi) = span(src.as_ptr(), n, W);
        portable::narrow_f16(&mut dst[..lo], &src[..lo], scale);
        let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
        for i in (lo..hi).step_by(W) {
            let v = _mm256_mul_ps(_mm256_loadu_ps(s.add(i)), k);
            // F16C: RNE, keeps inf/NaN, overflows to inf.
            let mut h = _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            // Empty asm as an optimization barrier: otherwise LLVM folds the store into
            // VCVTPS2PH's memory form, which is microcoded on Zen 4/5 (measured 2x slower).
            std::arch::asm!("/* {0} */", inout(xmm_reg) h, options(pure, nomem, nostack, preserves_flags));
            _mm_storeu_si128(d.add(i) as *mut __m128i, h);
        }
        portable::narrow_f16(&mut dst[hi..], &src[hi..], scale);
    }

    /// narrow_bf16 does 16 lanes per step so each step ends in one 32-byte store.
    const W2: usize = 2 * W;

    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn narrow_bf16(dst: &mut [u16], src: &[f32], scale: f32) {
        let n = dst.len();
        assert_eq!(src.len(), n, "narrow_bf16: length mismatch");
        let k = _mm256_set1_ps(scale);
        let (lo, hi) = span(src.as_ptr(), n, W2);
        portable::narrow_bf16(&mut dst[..lo], &src[..lo], scale);
        let (d, s) = (dst.as_mut_ptr(), src.as_ptr());
        for i in (lo..hi).step_by(W2) {
            // Lanes are <= 0xffff, so the saturating pack truncates; it interleaves 128-bit
            // halves (a0 b0 a1 b1), which the permute puts back in order.
            let packed = _mm256_packus_epi32(to_bf16(s.add(i), k), to_bf16(s.add(i + W), k));
            let ordered = _mm256_permute4x64_epi64::<0b11_01_10_00>(packed);
            _mm256_storeu_si256(d.add(i) as *mut __m256i, ordered);
        }
        portable::narrow_bf16(&mut dst[hi..], &src[hi..], scale);
    }

    #[target_feature(enable = "avx2,f16c")]
    pub unsafe fn scale_f32(buf: &mut [f32], scale: f32) {
        let n = buf.len();
        let (lo, hi) = span(buf.as_ptr(), n, W);
        portable::scale_f32(&mut buf[..lo], scale);
        let (b, k) = (buf.as_mut_ptr(), _mm256_set1_ps(scale));
        for i in (lo..hi).step_by(W) {
            _mm256_storeu_ps(b.add(i), _mm256_mul_ps(_mm256_loadu_ps(b.add(i)), k));
        }
        portable::scale_f32(&mut buf[hi..], scale);
    }
}

/// 16 lanes per step. Head and tail are single steps with a lane mask: masked-off lanes are
/// neither read nor written (no fault outside the slice), so no scalar code is needed.
mod avx512 {
    use super::*;

    const W: usize = 16;

    /// Calls `f(i, mask)` over `0..n`: a masked head that brings `p` (the f32 stream) to a
    /// 64-byte boundary, whole blocks with an all-ones mask, then a masked tail. The all-ones mask matters: LLVM turns it into plain
    /// loads/stores, while masked ops in the main loop measured at half speed from DRAM.
    #[inline(always)]
    fn blocks(p: *const f32, n: usize, mut f: impl FnMut(usize, __mmask16)) {
        let lanes = |k: usize| ((1u32 << k) - 1) as __mmask16;
        let lo = p.align_offset(64).min(n);
        let hi = lo + (n - lo) / W * W;
        if lo > 0 {
            f(0, lanes(lo));
        }
        for i in (lo..hi).step_by(W) {
            f(i, !0);
        }
        if hi < n {
            f(hi, lanes(n - hi));
        }
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn add_f32(acc: &mut [f32], src: &[f32]) {
        let n = acc.len();
        assert_eq!(src.len(), n, "add_f32: length mismatch");
        let (a, s) = (acc.as_mut_ptr(), src.as_ptr());
        blocks(a, n, |i, m| {
            let v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, a.add(i)), _mm512_maskz_loadu_ps(m, s.add(i)));
            _mm512_mask_storeu_ps(a.add(i), m, v);
        });
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load_f16(m: __mmask16, p: *const u16) -> __m512 {
        _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p as *const i16))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    unsafe fn load_bf16(m: __mmask16, p: *const u16) -> __m512 {
        let wide = _mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p as *const i16));
        _mm512_castsi512_ps(_mm512_slli_epi32::<16>(wide))
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn widen_f16(dst: &mut [f32], src: &[u16]) {
        let n = dst.len();
        assert_eq!(src.len(), n, "widen_f16: length mismatch");
        blocks(dst.as_ptr(), n, |i, m| {
            _mm512_mask_storeu_ps(dst.as_mut_ptr().add(i), m, load_f16(m, src.as_ptr().add(i)));
        });
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn add_f16(acc: &mut [f32], src: &[u16]) {
        let n = acc.len();
        assert_eq!(src.len(), n, "add_f16: length mismatch");
        let a = acc.as_mut_ptr();
        blocks(a, n, |i, m| {
            let v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, a.add(i)), load_f16(m, src.as_ptr().add(i)));
            _mm512_mask_storeu_ps(a.add(i), m, v);
        });
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn widen_bf16(dst: &mut [f32], src: &[u16]) {
        let n = dst.len();
        assert_eq!(src.len(), n, "widen_bf16: length mismatch");
        blocks(dst.as_ptr(), n, |i, m| {
            _mm512_mask_storeu_ps(dst.as_mut_ptr().add(i), m, load_bf16(m, src.as_ptr().add(i)));
        });
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn add_bf16(acc: &mut [f32], src: &[u16]) {
        let n = acc.len();
        assert_eq!(src.len(), n, "add_bf16: length mismatch");
        let a = acc.as_mut_ptr();
        blocks(a, n, |i, m| {
            let v = _mm512_add_ps(_mm512_maskz_loadu_ps(m, a.add(i)), load_bf16(m, src.as_ptr().add(i)));
            _mm512_mask_storeu_ps(a.add(i), m, v);
        });
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn narrow_f16(dst: &mut [u16], src: &[f32], scale: f32) {
        let n = dst.len();
        assert_eq!(src.len(), n, "narrow_f16: length mismatch");
        let k = _mm512_set1_ps(scale);
        blocks(src.as_ptr(), n, |i, m| {
            let v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, src.as_ptr().add(i)), k);
            let h = _mm512_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v);
            _mm256_mask_storeu_epi16(dst.as_mut_ptr().add(i) as *mut i16, m, h);
        });
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn narrow_bf16(dst: &mut [u16], src: &[f32], scale: f32) {
        let n = dst.len();
        assert_eq!(src.len(), n, "narrow_bf16: length mismatch");
        let k = _mm512_set1_ps(scale);
        let (one, bias, quiet) = (_mm512_set1_epi32(1), _mm512_set1_epi32(0x7fff), _mm512_set1_epi32(0x40));
        blocks(src.as_ptr(), n, |i, m| {
            let v = _mm512_mul_ps(_mm512_maskz_loadu_ps(m, src.as_ptr().add(i)), k);
            let x = _mm512_castps_si512(v);
            let hi = _mm512_srli_epi32::<16>(x);
            let lsb = _mm512_and_si512(hi, one);
            let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(x, _mm512_add_epi32(bias, lsb)));
            let nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
            let r = _mm512_mask_blend_epi32(nan, rounded, _mm512_or_si512(hi, quiet));
            _mm256_mask_storeu_epi16(dst.as_mut_ptr().add(i) as *mut i16, m, _mm512_cvtepi32_epi16(r));
        });
    }

    #[target_feature(enable = "avx512f,avx512bw,avx512vl")]
    pub unsafe fn scale_f32(buf: &mut [f32], scale: f32) {
        let n = buf.len();
        let (b, k) = (buf.as_mut_ptr(), _mm512_set1_ps(scale));
        blocks(b, n, |i, m| {
            _mm512_mask_storeu_ps(b.add(i), m, _mm512_mul_ps(_mm512_maskz_loadu_ps(m, b.add(i)), k));
        });
    }
}
