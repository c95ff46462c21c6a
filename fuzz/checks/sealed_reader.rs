//! Checks of the sealed control reader (`transport::SealedReader` with a
//! key: encrypted jobs' control connections): it must reject hostile bytes
//! with an error, never panic, and never hand on a frame its sender did not
//! seal, in the order sealed. Shared by the `sealed_reader` fuzz target and
//! the test suite's short random run (`tests/integration/fuzz.rs`).
//!
//! Input: a selector byte, then bytes. Even selector: the bytes as they
//! come, read with a key. Odd: the bytes make a few control messages
//! (`control_codec::message`), sealed as a connector would, then changed
//! where the input says; whatever the reader hands on must be the sealed
//! messages, each once, in order (AES-GCM: a changed frame fails its tag).

use std::io::Cursor;

use gradhub::protocol::read_control;
use gradhub::protocol::seal::{Keys, Side};
use gradhub::transport::{SealedReader, SealedWriter};

// A sibling module wherever this one is used (the fuzz target, the test suite's run).
use super::control_codec;

const TOKEN: &[u8] = b"fuzzed job token";
const NS: u32 = 7;

fn keys(side: Side) -> Keys {
    Keys::derive(TOKEN, b"connector nonce.", b"listener nonce..", side)
}

/// Returns how many messages were sealed and how many handed on (for the
/// test suite's run to see both outcomes reached).
pub fn check(data: &[u8]) -> (usize, usize) {
    let Some((&sel, rest)) = data.split_first() else { return (0, 0) };
    if sel % 2 == 0 {
        let mut r = SealedReader::new(Cursor::new(rest), Some(keys(Side::Listener).open));
        for _ in 0..64 {
            if read_control(&mut r, NS).is_err() {
                break;
            }
        }
        return (0, 0);
    }
    // A few sealed messages, then the changes: (offset, xor) pairs.
    let mut s = control_codec::Source::new(rest);
    let sent: Vec<_> = (0..1 + sel as usize % 4).map(|_| control_codec::message(&mut s)).collect();
    let mut wire = Vec::new();
    {
        let mut w = SealedWriter::new(&mut wire, Some(keys(Side::Connector).seal));
        for m in &sent {
            if gradhub::protocol::write_control(&mut w, m, NS).is_err() {
                return (0, 0); // too large to send: nothing to read
            }
        }
    }
    let changes = s.rest();
    let changed = !wire.is_empty() && changes.chunks_exact(3).any(|c| c[2] != 0);
    for c in changes.chunks_exact(3) {
        if wire.is_empty() {
            break;
        }
        let at = u16::from_le_bytes([c[0], c[1]]) as usize % wire.len();
        wire[at] ^= c[2];
    }
    let mut r = SealedReader::new(Cursor::new(&wire), Some(keys(Side::Listener).open));
    let mut got = 0;
    for _ in 0..sent.len() + 1 {
        match read_control(&mut r, NS) {
            Ok(m) => {
                assert!(got < sent.len(), "a frame nobody sealed was handed on: {m:?}");
                assert_eq!(m, sent[got], "message {got} is not the one sealed");
                got += 1;
            }
            Err(_) => break,
        }
    }
    if !changed {
        assert_eq!(got, sent.len(), "sealed messages were lost unchanged");
    }
    (sent.len(), got)
}
