//! Checks of the wire-protocol decoders on raw bytes: the fixed frame
//! header, control-message payloads, the Stall payload, and the blocking
//! `read_control` reader. Shared by the `frame_decoder` fuzz target and the
//! test suite's short random run (`tests/integration/fuzz.rs`). Any panic,
//! overflow (debug assertions are on) or OOM is a bug: all of these must
//! reject hostile input with an error.

use gradhub::protocol::{decode_stall, read_control, Control, Header, MsgType, HEADER_LEN, MAX_CONTROL_PAYLOAD};
use std::io::Cursor;
use std::sync::OnceLock;

pub fn check(data: &[u8]) {
    // 1. Header, then the rest as that message's payload.
    if let Ok(h) = Header::decode(data, MAX_CONTROL_PAYLOAD) {
        let rest = &data[HEADER_LEN..];
        // Exactly payload_len bytes (what read_control would hand over) ...
        if let Some(payload) = rest.get(..h.payload_len as usize) {
            check_control(&h, payload);
        }
        // ... and whatever follows, regardless of the declared length.
        check_control(&h, rest);
        if h.msg_type == MsgType::Stall {
            let _ = decode_stall(rest);
        }
    }

    // 2. The blocking reader over a stream: read frames until the first
    //    error. Use the namespace the first header claims so that payload
    //    decoding is reached, not just the namespace check.
    let ns = data.get(8..12).map(|b| u32::from_le_bytes([b[0], b[1], b[2], b[3]])).unwrap_or(0);
    let mut cur = Cursor::new(data);
    for _ in 0..64 {
        match read_control(&mut cur, ns) {
            Ok(msg) => {
                // A decoded message must re-encode to something that decodes
                // to the same message (Error text is lossy-decoded UTF-8, so
                // it is a fixed point after one round as well).
                let frame = msg.encode(ns);
                let again = read_control(&mut Cursor::new(&frame), ns)
                    .unwrap_or_else(|e| panic!("re-encoded {msg:?} fails to decode: {e}"));
                assert_eq!(again, msg);
            }
            Err(_) => break,
        }
    }

    // 3. Raw bytes as a Stall payload.
    let _ = decode_stall(data);

    // 4. Structure-aware shortcut so the payload decoders get deep coverage
    //    without the fuzzer first having to discover the magic/version/type
    //    bytes: the first byte picks the message type, the rest is its
    //    payload, both directly and as a well-formed frame via read_control.
    if let Some((&t, payload)) = data.split_first() {
        // Every message type, data-plane ones included (they must be
        // rejected cleanly); derived from the decoder so new types are fuzzed.
        static TYPES: OnceLock<Vec<MsgType>> = OnceLock::new();
        let types = TYPES.get_or_init(|| (0..=255).filter_map(MsgType::from_u8).collect());
        let mut h = Header::new(types[t as usize % types.len()]);
        h.namespace = 7;
        h.payload_len = payload.len() as u32;
        check_control(&h, payload);
        let frame = gradhub::protocol::encode_frame(&h, payload);
        if let Ok(msg) = read_control(&mut Cursor::new(&frame), 7) {
            let again = read_control(&mut Cursor::new(&msg.encode(7)), 7)
                .unwrap_or_else(|e| panic!("re-encoded {msg:?} fails to decode: {e}"));
            assert_eq!(again, msg);
        }
    }
}

fn check_control(h: &Header, payload: &[u8]) {
    if let Ok(msg) = Control::decode(h, payload) {
        assert_eq!(msg.msg_type(), h.msg_type);
    }
}
