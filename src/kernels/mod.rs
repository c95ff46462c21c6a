//! Element-wise summation kernels of the summation server.
//!
//! f16/bf16 values travel as raw `u16` bit patterns and are accumulated in f32. Every function
//! requires all its slices to have equal length and panics otherwise (an internal invariant:
//! callers validate network input before it gets here).
//!
//! The implementation is picked once per process by runtime CPU detection (see [`selected`]);
//! `GRADHUB_KERNELS=portable|avx2|avx512` overrides the choice, mainly so tests and benchmarks
//! can exercise every path. All paths produce bit-identical results (NaN payloads aside):
//! f32 adds are a single IEEE rounding whatever the vector width, conversions are exact or RNE.

use std::sync::OnceLock;

pub mod portable;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod x86;

/// acc[i] += src[i]
pub fn add_f32(acc: &mut [f32], src: &[f32]) {
    selected().add_f32(acc, src)
}

/// dst[i] = f16 -> f32 (src[i]); exact.
pub fn widen_f16(dst: &mut [f32], src: &[u16]) {
    selected().widen_f16(dst, src)
}

/// acc[i] += f16 -> f32 (src[i])
pub fn add_f16(acc: &mut [f32], src: &[u16]) {
    selected().add_f16(acc, src)
}

/// dst[i] = bf16 -> f32 (src[i]); exact.
pub fn widen_bf16(dst: &mut [f32], src: &[u16]) {
    selected().widen_bf16(dst, src)
}

/// acc[i] += bf16 -> f32 (src[i])
pub fn add_bf16(acc: &mut [f32], src: &[u16]) {
    selected().add_bf16(acc, src)
}

/// dst[i] = f32 -> f16 (src[i] * scale), round to nearest even; overflow gives inf, inf/NaN kept.
pub fn narrow_f16(dst: &mut [u16], src: &[f32], scale: f32) {
    selected().narrow_f16(dst, src, scale)
}

/// dst[i] = f32 -> bf16 (src[i] * scale), round to nearest even; NaN stays (quiet) NaN.
pub fn narrow_bf16(dst: &mut [u16], src: &[f32], scale: f32) {
    selected().narrow_bf16(dst, src, scale)
}

/// buf[i] *= scale
pub fn scale_f32(buf: &mut [f32], scale: f32) {
    selected().scale_f32(buf, scale)
}

/// acc += src for the types summed in place other than f32 (float64 and the
/// integers, which wrap as torch's do), on raw little-endian bytes: `src` may
/// be unaligned (a connection's scratch buffer); `acc` is aligned for `dtype`.
/// Plain loops the compiler vectorizes; these types are rare on the hot path.
pub fn add_exact(dtype: crate::protocol::DType, acc: &mut [u8], src: &[u8]) {
    use crate::protocol::DType;
    assert_eq!(acc.len(), src.len(), "add_exact: lengths differ");
    match dtype {
        DType::F64 => {
            for (a, s) in acc.chunks_exact_mut(8).zip(src.chunks_exact(8)) {
                let v = f64::from_le_bytes(a[..8].try_into().unwrap_or_default())
                    + f64::from_le_bytes(s.try_into().unwrap_or_default());
                a.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::I64 => {
            for (a, s) in acc.chunks_exact_mut(8).zip(src.chunks_exact(8)) {
                let v = i64::from_le_bytes(a[..8].try_into().unwrap_or_default())
                    .wrapping_add(i64::from_le_bytes(s.try_into().unwrap_or_default()));
                a.copy_from_slice(&v.to_le_bytes());
            }
        }
        DType::I32 => {
            for (a, s) in acc.chunks_exact_mut(4).zip(src.chunks_exact(4)) {
                let v = i32::from_le_bytes(a[..4].try_into().unwrap_or_default())
                    .wrapping_add(i32::from_le_bytes(s.try_into().unwrap_or_default()));
                a.copy_from_slice(&v.to_le_bytes());
            }
        }
        other => panic!("add_exact: {other:?} is not summed as raw bytes"),
    }
}

/// buf[i] *= scale, float64 as raw little-endian bytes.
pub fn scale_f64(buf: &mut [u8], scale: f64) {
    for a in buf.chunks_exact_mut(8) {
        let v = f64::from_le_bytes(a[..8].try_into().unwrap_or_default()) * scale;
        a.copy_from_slice(&v.to_le_bytes());
    }
}

/// What dispatch picked: "avx512", "avx2" or "portable".
pub fn simd_level() -> &'static str {
    selected().level()
}

/// One complete set of kernels for one instruction-set level. Public so benchmarks and tests can
/// run every level this CPU supports side by side; servers should use the free functions.
#[derive(Clone, Copy)]
pub struct Kernels {
    level: &'static str,
    add_f32: fn(&mut [f32], &[f32]),
    widen_f16: fn(&mut [f32], &[u16]),
    add_f16: fn(&mut [f32], &[u16]),
    widen_bf16: fn(&mut [f32], &[u16]),
    add_bf16: fn(&mut [f32], &[u16]),
    narrow_f16: fn(&mut [u16], &[f32], f32),
    narrow_bf16: fn(&mut [u16], &[f32], f32),
    scale_f32: fn(&mut [f32], f32),
}

impl Kernels {
    pub const PORTABLE: Kernels = Kernels {
        level: "portable",
        add_f32: portable::add_f32,
        widen_f16: portable::widen_f16,
        add_f16: portable::add_f16,
        widen_bf16: portable::widen_bf16,
        add_bf16: portable::add_bf16,
        narrow_f16: portable::narrow_f16,
        narrow_bf16: portable::narrow_bf16,
        scale_f32: portable::scale_f32,
    };

    pub fn level(&self) -> &'static str {
        self.level
    }
    pub fn add_f32(&self, acc: &mut [f32], src: &[f32]) {
        (self.add_f32)(acc, src)
    }
    pub fn widen_f16(&self, dst: &mut [f32], src: &[u16]) {
        (self.widen_f16)(dst, src)
    }
    pub fn add_f16(&self, acc: &mut [f32], src: &[u16]) {
        (self.add_f16)(acc, src)
    }
    pub fn widen_bf16(&self, dst: &mut [f32], src: &[u16]) {
        (self.widen_bf16)(dst, src)
    }
    pub fn add_bf16(&self, acc: &mut [f32], src: &[u16]) {
        (self.add_bf16)(acc, src)
    }
    pub fn narrow_f16(&self, dst: &mut [u16], src: &[f32], scale: f32) {
        (self.narrow_f16)(dst, src, scale)
    }
    pub fn narrow_bf16(&self, dst: &mut [u16], src: &[f32], scale: f32) {
        (self.narrow_bf16)(dst, src, scale)
    }
    pub fn scale_f32(&self, buf: &mut [f32], scale: f32) {
        (self.scale_f32)(buf, scale)
    }
}

/// Every level this CPU can run, portable first.
pub fn available() -> Vec<Kernels> {
    let mut levels = vec![Kernels::PORTABLE];
    #[cfg(target_arch = "x86_64")]
    levels.extend([x86::avx2(), x86::avx512()].into_iter().flatten());
    levels
}

/// The kernels the free functions use, chosen on first call and cached for the process.
pub fn selected() -> &'static Kernels {
    static SELECTED: OnceLock<Kernels> = OnceLock::new();
    SELECTED.get_or_init(|| select(crate::settings::kernels().as_deref()))
}

fn select(forced: Option<&str>) -> Kernels {
    let levels = available();
    if let Some(name) = forced {
        match levels.iter().find(|k| k.level == name) {
            Some(k) => return *k,
            None => log::warn!(target: "kernels", "GRADHUB_KERNELS={name:?} not available here; using default"),
        }
    }
    // Preference, by measurement (`cargo bench --bench kernels`, 2-vCPU AMD EPYC VM with
    // AVX-512, 64-byte-aligned buffers, several runs): AVX-512 is never slower than AVX2 beyond
    // run-to-run noise. In cache (32 KiB-4 MiB per operand) it gains 1.0-1.4x on add_f32,
    // 1.5-1.8x on add_f16/add_bf16/widen, 2x on narrow_bf16 and scale_f32; from DRAM (64 MiB)
    // every level sits at the ~60-65 GB/s the baseline gets. The earlier finding that 512-bit
    // loses for f32 accumulation reproduced only while the AVX-512 main loop used masked
    // loads/stores (0.5x the bandwidth from DRAM); masks are now confined to head and tail.
    // Not measurable here: Skylake-SP/Cascade Lake lower their clock for 512-bit code, slowing
    // the rest of the server, so AVX-512 is only preferred where VBMI2 marks a newer core
    // (Ice Lake / Zen 4 and later, which barely throttle). GRADHUB_KERNELS overrides this.
    #[cfg(target_arch = "x86_64")]
    let preference: &[&str] =
        if is_x86_feature_detected!("avx512vbmi2") { &["avx512", "avx2"] } else { &["avx2", "avx512"] };
    #[cfg(not(target_arch = "x86_64"))]
    let preference: &[&str] = &[];
    preference.iter().find_map(|name| levels.iter().find(|k| k.level == *name)).copied().unwrap_or(Kernels::PORTABLE)
}
