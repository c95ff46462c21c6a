//! Throughput of the summation kernels, every SIMD level this CPU supports, next to a memory
//! bandwidth baseline with the same access pattern.
//!
//!     cargo bench --bench kernels                            # full, < 60 s
//!     GRADHUB_BENCH_QUICK=1 cargo bench --bench kernels      # quick, < 10 s (or pass --quick)
//!
//! Figures are GB/s of memory traffic (bytes read + bytes written per call / best time per
//! call), best of several repetitions, so different ops and levels compare on one scale.

use std::hint::black_box;
use std::time::{Duration, Instant};

use gradhub::kernels::{self, Kernels};

/// Bytes per f32 operand; the f16/bf16 operand of the same element count is half that.
const SIZES: [usize; 4] = [32 << 10, 512 << 10, 4 << 20, 64 << 20];

struct Plan {
    reps: usize,
    rep_time: Duration,
}

/// Best-of-`reps` GB/s. Each repetition runs enough back-to-back calls to last about
/// `rep_time`, calibrated from one timed call, so small buffers are not timer-bound.
fn gbps(plan: &Plan, bytes_per_call: usize, mut f: impl FnMut()) -> f64 {
    f(); // warm-up: page faults, caches, lazy dispatch
    let t = Instant::now();
    f();
    let one = t.elapsed().as_secs_f64().max(1e-9);
    let calls = ((plan.rep_time.as_secs_f64() / one) as usize).max(1);
    let mut best = f64::INFINITY;
    for _ in 0..plan.reps {
        let t = Instant::now();
        for _ in 0..calls {
            f();
        }
        best = best.min(t.elapsed().as_secs_f64() / calls as f64);
    }
    bytes_per_call as f64 / best / 1e9
}

/// Baseline: `a[i] ^= b[i]` on u32. Exactly the access pattern of add_f32 (two read streams,
/// one in-place write stream, 12 B/elem) with an op that is free, so it measures what the
/// memory hierarchy can deliver for this pattern. A separate destination (dst = a ^ b) or a
/// copy would be a different pattern: the write-allocate read of dst adds traffic add_f32 does
/// not have. Compiled for each vector width the CPU has; the bench reports the fastest, so in
/// cache the baseline is not held back by a narrow width either.
fn baselines() -> Vec<fn(&mut [u32], &[u32])> {
    #[inline(always)]
    fn xor(a: &mut [u32], b: &[u32]) {
        for (x, y) in a.iter_mut().zip(b) {
            *x ^= *y;
        }
    }
    #[allow(clippy::type_complexity)]
    let mut all: Vec<fn(&mut [u32], &[u32])> = vec![xor];
    #[cfg(target_arch = "x86_64")]
    {
        #[target_feature(enable = "avx2")]
        unsafe fn xor_avx2(a: &mut [u32], b: &[u32]) {
            xor(a, b)
        }
        #[target_feature(enable = "avx512f")]
        unsafe fn xor_avx512(a: &mut [u32], b: &[u32]) {
            xor(a, b)
        }
        if is_x86_feature_detected!("avx2") {
            // SAFETY: AVX2 was detected just above.
            all.push(|a, b| unsafe { xor_avx2(a, b) });
        }
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: AVX-512F was detected just above.
            all.push(|a, b| unsafe { xor_avx512(a, b) });
        }
    }
    all
}

/// A zero-initialised `len`-element buffer starting on a 64-byte (cache line) boundary, plus
/// slack so a misaligned view can be taken. Large `Vec`s from glibc start 16 bytes past a page
/// boundary, which makes half of all 32-byte and every 64-byte access split a cache line; that
/// costs up to ~30% in cache, so the server should align its buffers and the bench measures the
/// aligned case (plus one misaligned row to show the cost).
struct Buf<T> {
    storage: Vec<T>,
    start: usize,
    len: usize,
}

impl<T: Copy + Default> Buf<T> {
    fn new(len: usize, value: T) -> Self {
        let slack = 128 / std::mem::size_of::<T>();
        let storage = vec![value; len + slack];
        let start = (64 - storage.as_ptr() as usize % 64) % 64 / std::mem::size_of::<T>();
        Buf {
            storage,
            start,
            len,
        }
    }
    /// The first `n` elements, starting `skew` bytes past the cache-line boundary.
    fn at(&mut self, n: usize, skew: usize) -> &mut [T] {
        assert!(n <= self.len);
        let s = self.start + skew / std::mem::size_of::<T>();
        &mut self.storage[s..s + n]
    }
}

fn human(bytes: usize) -> String {
    if bytes >= 1 << 20 {
        format!("{} MiB", bytes >> 20)
    } else {
        format!("{} KiB", bytes >> 10)
    }
}

fn main() {
    let quick = std::env::var("GRADHUB_BENCH_QUICK").is_ok_and(|v| v != "0")
        || std::env::args().any(|a| a == "--quick");
    // 100 cells (4 sizes x (baseline + 3 levels x 8 ops)); these keep the totals at about
    // 30 s full and 5 s quick on the 2-vCPU dev VM.
    let plan = if quick {
        Plan {
            reps: 3,
            rep_time: Duration::from_millis(12),
        }
    } else {
        Plan {
            reps: 5,
            rep_time: Duration::from_millis(50),
        }
    };
    let started = Instant::now();
    let levels = kernels::available();
    let baselines = baselines();
    let picked = kernels::simd_level();

    println!(
        "gradhub kernels bench ({}: best of {} x ~{} ms per cell)",
        if quick { "quick" } else { "full" },
        plan.reps,
        plan.rep_time.as_millis()
    );
    let names: Vec<_> = levels.iter().map(|k| k.level()).collect();
    println!(
        "levels available: {}; dispatch picked: {picked} (marked *)",
        names.join(", ")
    );
    println!("GB/s of memory traffic; size = bytes per f32 operand (n = size / 4 elements)\n");

    let max = *SIZES.iter().max().unwrap() / 4;
    let mut acc = Buf::new(max, 1.0f32);
    let mut src = Buf::new(max, 0.5f32);
    let mut dst16 = Buf::new(max, 0u16);
    let mut src16 = Buf::new(max, 0x3c00u16); // 1.0 in f16, 1.875 in bf16: no subnormal paths
    let mut xa = Buf::new(max, 1u32);
    let mut xb = Buf::new(max, 3u32);

    let mark = |k: &Kernels| if k.level() == picked { "*" } else { " " };

    // add_f32 table
    print!("add_f32, 12 B/elem (read acc + read src + write acc); (x.xx) = kernel / baseline\n{:>8} {:>9}", "size", "baseline");
    for k in &levels {
        print!(" | {:>9}{} ratio", k.level(), mark(k));
    }
    println!(" | {:>10} ratio", format!("{picked}+16B"));
    for &size in &SIZES {
        let n = size / 4;
        let base = (baselines.iter())
            .map(|f| {
                gbps(&plan, 12 * n, || {
                    f(black_box(xa.at(n, 0)), black_box(xb.at(n, 0)))
                })
            })
            .fold(0.0, f64::max);
        print!("{:>8} {base:>9.1}", human(size));
        for k in &levels {
            let g = gbps(&plan, 12 * n, || {
                k.add_f32(black_box(acc.at(n, 0)), black_box(src.at(n, 0)))
            });
            print!(" | {g:>10.1} ({:.2})", g / base);
        }
        // The dispatched free function on buffers 16 B past a cache line (what a plain large
        // Vec<f32> gives), against the same aligned baseline.
        let g = gbps(&plan, 12 * n, || {
            kernels::add_f32(black_box(acc.at(n, 16)), black_box(src.at(n, 16)))
        });
        println!(" | {g:>10.1} ({:.2})", g / base);
    }

    // Conversions and the other ops: one row per (op, level).
    println!("\nother ops (B/elem: add_f16/bf16 10, widen 6, narrow 6, scale_f32 8)");
    print!("{:<12} {:<10}", "op", "level");
    for &size in &SIZES {
        print!(" {:>8}", human(size));
    }
    println!();
    type Op = (
        &'static str,
        usize,
        fn(&Kernels, &mut [f32], &mut [u16], &[f32], &[u16]),
    );
    let ops: [Op; 7] = [
        ("add_f16", 10, |k, acc, _, _, s16| k.add_f16(acc, s16)),
        ("add_bf16", 10, |k, acc, _, _, s16| k.add_bf16(acc, s16)),
        ("widen_f16", 6, |k, acc, _, _, s16| k.widen_f16(acc, s16)),
        ("widen_bf16", 6, |k, acc, _, _, s16| k.widen_bf16(acc, s16)),
        ("narrow_f16", 6, |k, _, d16, src, _| {
            k.narrow_f16(d16, src, 0.5)
        }),
        ("narrow_bf16", 6, |k, _, d16, src, _| {
            k.narrow_bf16(d16, src, 0.5)
        }),
        ("scale_f32", 8, |k, acc, _, _, _| k.scale_f32(acc, 1.0)),
    ];
    for (name, bytes, op) in ops {
        for k in &levels {
            print!("{name:<12} {:<10}", format!("{}{}", k.level(), mark(k)));
            for &size in &SIZES {
                let n = size / 4;
                let g = gbps(&plan, bytes * n, || {
                    op(
                        k,
                        black_box(acc.at(n, 0)),
                        black_box(dst16.at(n, 0)),
                        black_box(src.at(n, 0)),
                        black_box(src16.at(n, 0)),
                    )
                });
                print!(" {g:>8.1}");
            }
            println!();
        }
    }
    println!(
        "\ntotal bench time {:.1} s",
        started.elapsed().as_secs_f64()
    );
}
