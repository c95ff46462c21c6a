//! Fuzz target: see `checks/control_codec.rs` (shared with the test suite's short run).
#![no_main]

#[path = "../checks/control_codec.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| checks::check(data));
