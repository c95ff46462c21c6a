//! Portable fallback kernels: plain loops, for non-x86 targets, CPUs without AVX2+F16C, and
//! `GRADHUB_KERNELS=portable`. The f32 and bf16 loops are written branch-free so LLVM
//! auto-vectorizes them with the baseline ISA (SSE2 on x86_64); f16 goes through `half`
//! one element at a time (slow, but this path only matters on old CPUs).
//!
//! The scalar helpers here are also the tail handlers of the SIMD kernels, so every path rounds
//! identically.

use half::f16;

pub fn add_f32(acc: &mut [f32], src: &[f32]) {
    assert_eq!(acc.len(), src.len(), "add_f32: length mismatch");
    for (a, s) in acc.iter_mut().zip(src) {
        *a += *s;
    }
}

pub fn widen_f16(dst: &mut [f32], src: &[u16]) {
    assert_eq!(dst.len(), src.len(), "widen_f16: length mismatch");
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f16::from_bits(*s).to_f32();
    }
}

pub fn add_f16(acc: &mut [f32], src: &[u16]) {
    assert_eq!(acc.len(), src.len(), "add_f16: length mismatch");
    for (a, s) in acc.iter_mut().zip(src) {
        *a += f16::from_bits(*s).to_f32();
    }
}

pub fn widen_bf16(dst: &mut [f32], src: &[u16]) {
    assert_eq!(dst.len(), src.len(), "widen_bf16: length mismatch");
    for (d, s) in dst.iter_mut().zip(src) {
        *d = bf16_to_f32(*s);
    }
}

pub fn add_bf16(acc: &mut [f32], src: &[u16]) {
    assert_eq!(acc.len(), src.len(), "add_bf16: length mismatch");
    for (a, s) in acc.iter_mut().zip(src) {
        *a += bf16_to_f32(*s);
    }
}

pub fn narrow_f16(dst: &mut [u16], src: &[f32], scale: f32) {
    assert_eq!(dst.len(), src.len(), "narrow_f16: length mismatch");
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f16::from_f32(*s * scale).to_bits();
    }
}

pub fn narrow_bf16(dst: &mut [u16], src: &[f32], scale: f32) {
    assert_eq!(dst.len(), src.len(), "narrow_bf16: length mismatch");
    for (d, s) in dst.iter_mut().zip(src) {
        *d = f32_to_bf16(*s * scale);
    }
}

pub fn scale_f32(buf: &mut [f32], scale: f32) {
    for b in buf.iter_mut() {
        *b *= scale;
    }
}

/// bf16 is the top half of an f32, so widening is exact.
#[inline(always)]
pub(super) fn bf16_to_f32(b: u16) -> f32 {
    f32::from_bits((b as u32) << 16)
}

/// f32 -> bf16, round to nearest even. NaN keeps sign and top payload bits with the quiet bit
/// set (plain rounding could carry a NaN into infinity). Overflow rounds to infinity as RNE must.
#[inline(always)]
pub(super) fn f32_to_bf16(v: f32) -> u16 {
    let x = v.to_bits();
    // No wrap for non-NaN inputs: the largest is -inf (0xff80_0000). Both arms are computed so
    // the select stays branch-free and vectorizable.
    let rounded = (x.wrapping_add(0x7fff + ((x >> 16) & 1)) >> 16) as u16;
    let quiet_nan = ((x >> 16) | 0x0040) as u16;
    if v.is_nan() {
        quiet_nan
    } else {
        rounded
    }
}
