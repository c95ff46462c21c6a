//! Every kernel of every level available here (plus the dispatched free functions) against a
//! scalar reference built only on `half` and plain f32 arithmetic.

use super::*;
use half::{bf16, f16};

/// xorshift64*: deterministic, dependency-free test data.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

/// Values that stress rounding and special cases, for f32 sources.
const SPECIAL_F32: &[f32] = &[
    0.0,
    -0.0,
    f32::INFINITY,
    f32::NEG_INFINITY,
    f32::NAN,
    f32::MAX,
    f32::MIN,
    f32::MIN_POSITIVE,
    1e-40,   // f32 subnormal
    6.0e-8,  // f16 smallest subnormal ~5.96e-8
    2.98e-8, // ~half the smallest f16 subnormal: rounds to 0 or min subnormal
    1e-5,    // f16 subnormal range
    65504.0, // f16 max
    65519.0, // rounds down to f16 max
    65520.0, // ties up to f16 inf
    1e10,    // f16 overflow
    -1e10,
    1.0 + 1.0 / 2048.0, // f16 tie, round to even (down)
    1.0 + 3.0 / 2048.0, // f16 tie, round to even (up)
];

/// Raw bit patterns: signalling/negative NaN, bf16 ties, bf16 overflow by rounding.
const SPECIAL_F32_BITS: &[u32] = &[
    0x7f80_0001,
    0xffc0_0000,
    0x7fff_ffff,
    0xffff_ffff,
    0x0000_0001,
    0x8000_0001,
    0x3f80_8000,
    0x3f81_8000,
    0x3f80_8001,
    0x7f7f_ffff,
    0xff7f_ffff,
    0x7f7f_8000,
];

/// Raw f16/bf16 patterns: zeros, subnormals, max, inf, quiet/signalling NaN, both signs.
const SPECIAL_U16: &[u16] = &[
    0x0000, 0x8000, 0x0001, 0x8001, 0x03ff, 0x0400, 0x7bff, 0x7c00, 0xfc00, 0x7e00, 0x7c01, 0xfe00, 0x7f80, 0xff80,
    0x7fc0, 0x7f81, 0x0080, 0x007f, 0x7f7f,
];

fn f32_data(rng: &mut Rng, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| match rng.below(8) {
            0 => SPECIAL_F32[rng.below(SPECIAL_F32.len())],
            1 => f32::from_bits(SPECIAL_F32_BITS[rng.below(SPECIAL_F32_BITS.len())]),
            2 => f32::from_bits(rng.next() as u32), // anything, including NaN payloads
            // Gradient-like magnitudes, where most real sums happen.
            _ => (rng.next() as i32 as f32) * 2f32.powi(-31 - rng.below(20) as i32),
        })
        .collect()
}

fn u16_data(rng: &mut Rng, n: usize) -> Vec<u16> {
    (0..n)
        .map(|_| match rng.below(4) {
            0 => SPECIAL_U16[rng.below(SPECIAL_U16.len())],
            _ => rng.next() as u16,
        })
        .collect()
}

fn lengths() -> impl Iterator<Item = usize> {
    (0..=70).chain([127, 1023, 4097, 100_003])
}

/// Bit equality, except that any NaN matches any NaN (payloads may legitimately differ).
fn same_f32(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = if w.is_nan() { g.is_nan() } else { g.to_bits() == w.to_bits() };
        assert!(ok, "{what}: [{i}] of {}: got {g:e} ({:#x}), want {w:e} ({:#x})", got.len(), g.to_bits(), w.to_bits());
    }
}

fn same_u16(got: &[u16], want: &[u16], is_nan: fn(u16) -> bool, what: &str) {
    assert_eq!(got.len(), want.len());
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let ok = if is_nan(*w) { is_nan(*g) } else { g == w };
        assert!(ok, "{what}: [{i}] of {}: got {g:#06x}, want {w:#06x}", got.len());
    }
}

const SCALES: &[f32] = &[1.0, 0.125, 1.0 / 3.0, 3.0];

/// Runs the full comparison for one kernel set. `offset` shifts slices off the allocator's
/// alignment so the alignment head/tail paths are exercised too.
fn check(k: &Kernels, offset: usize) {
    let lvl = k.level();
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15 ^ offset as u64);
    for n in lengths() {
        let a = f32_data(&mut rng, n + offset);
        let b = f32_data(&mut rng, n + offset);
        let h = u16_data(&mut rng, n + offset);
        // `b` stays at the allocation start: streams with different misalignments.
        let (a, b, h) = (&a[offset..], &b[..n], &h[offset..]);
        let what = |op: &str| format!("{lvl} {op} n={n} offset={offset}");

        let mut got = a.to_vec();
        k.add_f32(&mut got, b);
        let want: Vec<f32> = a.iter().zip(b).map(|(x, y)| x + y).collect();
        same_f32(&got, &want, &what("add_f32"));

        let mut got = vec![0.0; n];
        k.widen_f16(&mut got, h);
        let want: Vec<f32> = h.iter().map(|&x| f16::from_bits(x).to_f32()).collect();
        same_f32(&got, &want, &what("widen_f16"));

        let mut got = a.to_vec();
        k.add_f16(&mut got, h);
        let want: Vec<f32> = a.iter().zip(h).map(|(x, &y)| x + f16::from_bits(y).to_f32()).collect();
        same_f32(&got, &want, &what("add_f16"));

        let mut got = vec![0.0; n];
        k.widen_bf16(&mut got, h);
        let want: Vec<f32> = h.iter().map(|&x| bf16::from_bits(x).to_f32()).collect();
        same_f32(&got, &want, &what("widen_bf16"));

        let mut got = a.to_vec();
        k.add_bf16(&mut got, h);
        let want: Vec<f32> = a.iter().zip(h).map(|(x, &y)| x + bf16::from_bits(y).to_f32()).collect();
        same_f32(&got, &want, &what("add_bf16"));

        for &s in SCALES {
            let mut got = vec![0; n];
            k.narrow_f16(&mut got, a, s);
            let want: Vec<u16> = a.iter().map(|&x| f16::from_f32(x * s).to_bits()).collect();
            same_u16(&got, &want, |x| f16::from_bits(x).is_nan(), &what(&format!("narrow_f16 x{s}")));

            let mut got = vec![0; n];
            k.narrow_bf16(&mut got, a, s);
            let want: Vec<u16> = a.iter().map(|&x| bf16::from_f32(x * s).to_bits()).collect();
            same_u16(&got, &want, |x| bf16::from_bits(x).is_nan(), &what(&format!("narrow_bf16 x{s}")));

            let mut got = a.to_vec();
            k.scale_f32(&mut got, s);
            let want: Vec<f32> = a.iter().map(|&x| x * s).collect();
            same_f32(&got, &want, &what(&format!("scale_f32 x{s}")));
        }
    }
}

#[test]
fn portable_matches_reference() {
    check(&Kernels::PORTABLE, 0);
    check(&Kernels::PORTABLE, 1);
}

#[test]
fn every_available_level_matches_reference() {
    for k in available() {
        check(&k, 0);
        check(&k, 3);
    }
}

/// The free functions route through whatever dispatch picked (or GRADHUB_KERNELS forced).
#[test]
fn dispatched_free_functions_match_reference() {
    let mut rng = Rng(42);
    for n in lengths() {
        let a = f32_data(&mut rng, n);
        let h = u16_data(&mut rng, n);
        let mut got = a.clone();
        add_f32(&mut got, &a);
        same_f32(&got, &a.iter().map(|x| x + x).collect::<Vec<_>>(), "add_f32");
        let mut got = a.clone();
        add_f16(&mut got, &h);
        same_f32(&got, &a.iter().zip(&h).map(|(x, &y)| x + f16::from_bits(y).to_f32()).collect::<Vec<_>>(), "add_f16");
        let mut got = a.clone();
        add_bf16(&mut got, &h);
        same_f32(
            &got,
            &a.iter().zip(&h).map(|(x, &y)| x + bf16::from_bits(y).to_f32()).collect::<Vec<_>>(),
            "add_bf16",
        );
        let mut got = vec![0.0; n];
        widen_f16(&mut got, &h);
        same_f32(&got, &h.iter().map(|&y| f16::from_bits(y).to_f32()).collect::<Vec<_>>(), "widen_f16");
        widen_bf16(&mut got, &h);
        same_f32(&got, &h.iter().map(|&y| bf16::from_bits(y).to_f32()).collect::<Vec<_>>(), "widen_bf16");
        let mut got = vec![0; n];
        narrow_f16(&mut got, &a, 0.5);
        let want: Vec<u16> = a.iter().map(|&x| f16::from_f32(x * 0.5).to_bits()).collect();
        same_u16(&got, &want, |x| f16::from_bits(x).is_nan(), "narrow_f16");
        narrow_bf16(&mut got, &a, 0.5);
        let want: Vec<u16> = a.iter().map(|&x| bf16::from_f32(x * 0.5).to_bits()).collect();
        same_u16(&got, &want, |x| bf16::from_bits(x).is_nan(), "narrow_bf16");
        let mut got = a.clone();
        scale_f32(&mut got, 0.25);
        same_f32(&got, &a.iter().map(|x| x * 0.25).collect::<Vec<_>>(), "scale_f32");
    }
}

#[test]
fn selection() {
    assert_eq!(select(Some("portable")).level(), "portable");
    assert_eq!(select(Some("no-such-level")).level(), select(None).level());
    assert!(["avx512", "avx2", "portable"].contains(&simd_level()));
    if crate::settings::kernels().as_deref() == Some("portable") {
        assert_eq!(simd_level(), "portable");
    }
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c") {
        assert_ne!(select(None).level(), "portable");
    }
}

#[test]
#[should_panic(expected = "length mismatch")]
fn length_mismatch_panics_dispatched() {
    add_f32(&mut [0.0; 9], &[0.0; 8]);
}

#[test]
fn length_mismatch_panics_every_level() {
    for k in available() {
        let r = std::panic::catch_unwind(|| k.narrow_bf16(&mut [0; 17], &[0.0; 16], 1.0));
        assert!(r.is_err(), "{} accepted mismatched lengths", k.level());
        let r = std::panic::catch_unwind(|| k.add_f16(&mut [0.0; 16], &[0; 17]));
        assert!(r.is_err(), "{} accepted mismatched lengths", k.level());
    }
}
