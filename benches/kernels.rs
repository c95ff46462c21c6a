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
    /// Whole-table passes; each cell reports its best over all passes. Passes spread a cell's
    /// samples over the run, so a burst of load from another process (2 shared vCPUs) spoils
    /// one sample, not the cell.
    passes: usize,
    reps: usize,
    rep_time: Duration,
}

/// Best-of-`reps` GB/s. Each repetition runs enough back-to-back calls to last about
/// `rep_time` (at least one call), calibrated from one timed call, so small buffers are not
/// timer-bound.
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
type XorFn = fn(&mut [u32], &[u32]);

fn baselines() -> Vec<XorFn> {
    #[inline(always)]
    fn xor(a: &mut [u32], b: &[u32]) {
        for (x, y) in a.iter_mut().zip(b) {
            *x ^= *y;
        }
    }
    let mut all: Vec<XorFn> = vec![xor];
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

/// A `len`-element buffer, filled with `value` (so no page faults while timing), starting on a 64-byte (cache line) boundary, plus
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
        Buf { storage, start, len }
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

/// The benchmark buffers, allocated once at the largest size.
struct Bufs {
    acc: Buf<f32>,
    src: Buf<f32>,
    dst16: Buf<u16>,
    src16: Buf<u16>,
    xa: Buf<u32>,
    xb: Buf<u32>,
}

type Op = (&'static str, usize, fn(&Kernels, &mut Bufs, usize));

/// add_f32 aside, one row per (op, level); the usize is traffic in bytes per element.
const OPS: [Op; 7] = [
    ("add_f16", 10, |k, b, n| k.add_f16(b.acc.at(n, 0), b.src16.at(n, 0))),
    ("add_bf16", 10, |k, b, n| k.add_bf16(b.acc.at(n, 0), b.src16.at(n, 0))),
    ("widen_f16", 6, |k, b, n| k.widen_f16(b.acc.at(n, 0), b.src16.at(n, 0))),
    ("widen_bf16", 6, |k, b, n| k.widen_bf16(b.acc.at(n, 0), b.src16.at(n, 0))),
    ("narrow_f16", 6, |k, b, n| k.narrow_f16(b.dst16.at(n, 0), b.src.at(n, 0), 0.5)),
    ("narrow_bf16", 6, |k, b, n| k.narrow_bf16(b.dst16.at(n, 0), b.src.at(n, 0), 0.5)),
    ("scale_f32", 8, |k, b, n| k.scale_f32(b.acc.at(n, 0), 1.0)),
];

/// One pass over every cell, in the order `main` prints them.
fn pass(plan: &Plan, b: &mut Bufs, levels: &[Kernels], baselines: &[XorFn]) -> Vec<f64> {
    let mut out = Vec::new();
    for &size in &SIZES {
        let n = size / 4;
        let base = (baselines.iter())
            .map(|f| gbps(plan, 12 * n, || f(black_box(b.xa.at(n, 0)), black_box(b.xb.at(n, 0)))))
            .fold(0.0, f64::max);
        out.push(base);
        for k in levels {
            out.push(gbps(plan, 12 * n, || k.add_f32(black_box(b.acc.at(n, 0)), black_box(b.src.at(n, 0)))));
        }
        // The dispatched free function on buffers 16 B past a cache line (what a plain large
        // Vec<f32> gives), against the same aligned baseline.
        out.push(gbps(plan, 12 * n, || kernels::add_f32(black_box(b.acc.at(n, 16)), black_box(b.src.at(n, 16)))));
    }
    for (_, bytes, op) in OPS {
        for k in levels {
            for &size in &SIZES {
                let n = size / 4;
                out.push(gbps(plan, bytes * n, || op(k, black_box(&mut *b), n)));
            }
        }
    }
    out
}

fn main() {
    let quick =
        std::env::var("GRADHUB_BENCH_QUICK").is_ok_and(|v| v != "0") || std::env::args().any(|a| a == "--quick");
    // Many short repetitions rather than a few long ones: on 2 shared vCPUs a 30 ms window is
    // rarely free of other processes, a 2 ms one often is, and best-of keeps the free ones.
    // ~110 cells (4 sizes x (3 baselines + 3 levels x 8 ops + 1)); totals are about 25 s full
    // and 3 s quick on the dev VM.
    let plan = if quick {
        Plan { passes: 2, reps: 6, rep_time: Duration::from_millis(1) }
    } else {
        Plan { passes: 3, reps: 30, rep_time: Duration::from_millis(2) }
    };
    let started = Instant::now();
    let levels = kernels::available();
    let baselines = baselines();
    let picked = kernels::simd_level();

    let max = *SIZES.iter().max().unwrap() / 4;
    let mut bufs = Bufs {
        acc: Buf::new(max, 1.0f32),
        src: Buf::new(max, 0.5f32),
        dst16: Buf::new(max, 0u16),
        src16: Buf::new(max, 0x3c00u16), // 1.0 in f16, 2^-7 in bf16: normal numbers
        xa: Buf::new(max, 1u32),
        xb: Buf::new(max, 3u32),
    };
    let mut best = pass(&plan, &mut bufs, &levels, &baselines);
    for _ in 1..plan.passes {
        let again = pass(&plan, &mut bufs, &levels, &baselines);
        best.iter_mut().zip(again).for_each(|(b, a)| *b = b.max(a));
    }
    let mut cells = best.into_iter();
    let mut cell = move || cells.next().unwrap();

    println!(
        "gradhub kernels bench ({}: best of {} passes x {} reps x ~{} ms per cell)",
        if quick { "quick" } else { "full" },
        plan.passes,
        plan.reps,
        plan.rep_time.as_millis()
    );
    let names: Vec<_> = levels.iter().map(|k| k.level()).collect();
    println!("levels available: {}; dispatch picked: {picked} (marked *)", names.join(", "));
    println!("GB/s of memory traffic; size = bytes per f32 operand (n = size / 4 elements)\n");
    let mark = |k: &Kernels| if k.level() == picked { "*" } else { " " };

    println!("add_f32, 12 B/elem (read acc + read src + write acc); (x.xx) = kernel / baseline");
    print!("{:>8} {:>9}", "size", "baseline");
    for k in &levels {
        print!(" | {:>9}{} ratio", k.level(), mark(k));
    }
    println!(" | {:>10} ratio", format!("{picked}+16B"));
    for &size in &SIZES {
        let base = cell();
        print!("{:>8} {base:>9.1}", human(size));
        for _ in 0..=levels.len() {
            let g = cell();
            print!(" | {g:>10.1} ({:.2})", g / base);
        }
        println!();
    }

    println!("\nother ops (B/elem: add_f16/bf16 10, widen 6, narrow 6, scale_f32 8)");
    print!("{:<12} {:<10}", "op", "level");
    for &size in &SIZES {
        print!(" {:>8}", human(size));
    }
    println!();
    for (name, _, _) in OPS {
        for k in &levels {
            print!("{name:<12} {:<10}", format!("{}{}", k.level(), mark(k)));
            for _ in SIZES {
                print!(" {:>8.1}", cell());
            }
            println!();
        }
    }
    println!("\ntotal bench time {:.1} s", started.elapsed().as_secs_f64());
}
