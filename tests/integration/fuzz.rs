//! A short random run of the fuzz targets' checks (`fuzz/checks/`), so the
//! test suite exercises them without cargo-fuzz or nightly: pseudo-random
//! inputs, and valid frames with random bytes flipped (random bytes alone
//! rarely get past the header's magic). The long coverage-guided runs are
//! `cargo fuzz run` (fuzz/README.md; figures in docs/reliability.md).

#[path = "../../fuzz/checks/control_codec.rs"]
mod control_codec;
#[path = "../../fuzz/checks/frame_decoder.rs"]
mod frame_decoder;
#[path = "../../fuzz/checks/sealed_reader.rs"]
mod sealed_reader;

/// xorshift64*: reproducible inputs without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn bytes(&mut self, max: usize) -> Vec<u8> {
        let n = (self.next() % max as u64) as usize;
        (0..n).map(|_| self.next() as u8).collect()
    }
}

const RUNS: usize = 30_000;

#[test]
fn control_codec_checks_hold_on_random_inputs() {
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    for _ in 0..RUNS {
        control_codec::check(&rng.bytes(600));
    }
}

#[test]
fn frame_decoder_checks_hold_on_random_and_mutated_frames() {
    let mut rng = Rng(0x1234_5678_9abc_def1);
    for i in 0..RUNS {
        let input = rng.bytes(600);
        if i % 2 == 0 {
            frame_decoder::check(&input);
            continue;
        }
        // A valid frame (any message type) with a few bytes flipped, then random bytes.
        let mut s = control_codec::Source::new(&input);
        let msg = control_codec::message(&mut s);
        let ns = s.u32();
        let mut frame = msg.encode(ns);
        for _ in 0..rng.next() % 4 {
            let at = (rng.next() % frame.len() as u64) as usize;
            frame[at] ^= rng.next() as u8;
        }
        frame.extend_from_slice(s.rest());
        frame_decoder::check(&frame);
    }
}

#[test]
fn sealed_reader_checks_hold_on_random_and_changed_sealed_frames() {
    let mut rng = Rng(0x0bad_5eed_f00d_cafe);
    let (mut whole, mut cut) = (0, 0);
    for i in 0..RUNS {
        let mut input = rng.bytes(600);
        // Half of them sealed messages; a third of those shortened, so that
        // few or no bytes are left to change them.
        if let Some(first) = input.first_mut() {
            *first = (*first & !1) | (i % 2) as u8;
        }
        if i % 6 == 1 {
            input.truncate(input.len().min(1 + rng.next() as usize % 300));
        }
        let (sent, got) = sealed_reader::check(&input);
        whole += usize::from(sent > 0 && got == sent);
        cut += usize::from(got < sent);
    }
    // Both outcomes were reached: all handed on, and a change refused.
    assert!(whole > RUNS / 20 && cut > RUNS / 20, "{whole} delivered whole, {cut} cut short of {RUNS}");
}
