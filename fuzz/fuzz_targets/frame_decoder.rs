//! Fuzz target: see `checks/frame_decoder.rs` (shared with the test suite's short run).
#![no_main]

#[path = "../checks/frame_decoder.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::check(data));
