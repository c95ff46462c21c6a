//! Fuzz target: see `checks/sealed_reader.rs` (shared with the test suite's short run).
#![no_main]

#[path = "../checks/control_codec.rs"]
mod control_codec;
#[path = "../checks/sealed_reader.rs"]
mod checks;

libfuzzer_sys::fuzz_target!(|data: &[u8]| {
    checks::check(data);
});
