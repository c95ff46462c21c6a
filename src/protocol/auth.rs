//! Mutual authentication of every connection with the job's secret token
//! (PHub §3.2: a job proves its identity when it connects).
//!
//! Before any other frame, the connecting side and the listener (scheduler
//! or server thread) run a challenge–response with HMAC-SHA-256 keyed by
//! the token, which never crosses the wire:
//!
//! 1. `AuthHello`     connector → listener: a fresh 32-byte nonce `nc`;
//! 2. `AuthChallenge` listener → connector: a fresh nonce `ns` and
//!    `HMAC(token, "listener" ‖ nc ‖ ns)`: the listener holds the token (a
//!    process posing as a server or scheduler cannot answer);
//! 3. `AuthProof`     connector → listener: `HMAC(token, "connector" ‖ nc ‖ ns)`.
//!
//! Each side's proof covers the other side's fresh nonce, so a recorded
//! handshake cannot be replayed, and the two labels keep one side's proof
//! from being reflected as the other's. A failed proof closes the
//! connection with a message that reveals nothing about the job. Nothing is
//! encrypted: whoever is on the path can read gradients (docs/security.md).
//!
//! Without a token (`Secret::none`, single-host jobs or an explicit
//! insecure flag) the same handshake runs with an empty key: one code path,
//! which then proves nothing.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use std::io::{Read, Write};

use super::{read_message, Header, MsgType, ProtocolError, ReadError, MAX_NOTICE_PAYLOAD};

pub const NONCE_LEN: usize = 32;
pub const PROOF_LEN: usize = 32;
/// The largest auth payload (a challenge: nonce and proof).
pub const MAX_AUTH_PAYLOAD: u32 = (NONCE_LEN + PROOF_LEN) as u32;

const LISTENER: &[u8] = b"gradhub-auth-v1 listener";
const CONNECTOR: &[u8] = b"gradhub-auth-v1 connector";

/// The job's secret. Its Debug output never shows it.
#[derive(Clone, Default)]
pub struct Secret(Vec<u8>);

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(if self.0.is_empty() { "Secret(none)" } else { "Secret(..)" })
    }
}

impl Secret {
    pub fn new(token: &[u8]) -> Secret {
        Secret(token.to_vec())
    }
    /// No token: the handshake still runs, and proves nothing.
    pub fn none() -> Secret {
        Secret(Vec::new())
    }
    pub fn is_none(&self) -> bool {
        self.0.is_empty()
    }

    fn mac(&self, label: &[u8], nc: &[u8; NONCE_LEN], ns: &[u8; NONCE_LEN]) -> Hmac<Sha256> {
        // HMAC takes a key of any length: this cannot fail.
        let mut m = <Hmac<Sha256> as Mac>::new_from_slice(&self.0).expect("HMAC accepts any key length");
        m.update(label);
        m.update(nc);
        m.update(ns);
        m
    }

    fn proof(&self, label: &[u8], nc: &[u8; NONCE_LEN], ns: &[u8; NONCE_LEN]) -> [u8; PROOF_LEN] {
        self.mac(label, nc, ns).finalize().into_bytes().into()
    }

    /// Constant-time check of a peer's proof.
    fn verify(&self, label: &[u8], nc: &[u8; NONCE_LEN], ns: &[u8; NONCE_LEN], proof: &[u8]) -> bool {
        self.mac(label, nc, ns).verify_slice(proof).is_ok()
    }
}

#[derive(Debug, thiserror::Error)]
pub enum AuthError {
    #[error("no random numbers from the operating system: {0}")]
    Random(String),
    #[error("authentication failed: {0}")]
    Failed(&'static str),
    #[error("rejected: {0}")]
    Rejected(String),
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error("{0}")]
    Io(std::io::Error),
}

/// A fresh nonce from the operating system's random source.
pub fn nonce() -> Result<[u8; NONCE_LEN], AuthError> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| AuthError::Random(e.to_string()))?;
    Ok(n)
}

fn frame(msg_type: MsgType, parts: &[&[u8]]) -> Vec<u8> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let mut h = Header::new(msg_type);
    h.payload_len = len as u32;
    let mut out = h.encode().to_vec();
    for p in parts {
        out.extend_from_slice(p);
    }
    out
}

fn exact<const N: usize>(what: &'static str, payload: &[u8]) -> Result<[u8; N], ProtocolError> {
    payload.try_into().map_err(|_| ProtocolError::BadPayload(format!("{what} of {} bytes", payload.len())))
}

/// The connector's side.
pub struct Connector {
    secret: Secret,
    nc: [u8; NONCE_LEN],
}

impl Connector {
    /// Start: the hello frame to send.
    pub fn start(secret: &Secret) -> Result<(Connector, Vec<u8>), AuthError> {
        let nc = nonce()?;
        Ok((Connector { secret: secret.clone(), nc }, frame(MsgType::AuthHello, &[&nc])))
    }

    /// The listener's challenge (its payload): check the listener's proof,
    /// return the proof frame to send.
    pub fn answer(self, challenge: &[u8]) -> Result<Vec<u8>, AuthError> {
        let c: [u8; NONCE_LEN + PROOF_LEN] = exact("AuthChallenge", challenge)?;
        let ns: [u8; NONCE_LEN] = exact("nonce", &c[..NONCE_LEN])?;
        if !self.secret.verify(LISTENER, &self.nc, &ns, &c[NONCE_LEN..]) {
            return Err(AuthError::Failed(
                "the peer does not hold this job's token (a wrong GRADHUB_JOB_TOKEN, or not this job's member)",
            ));
        }
        Ok(frame(MsgType::AuthProof, &[&self.secret.proof(CONNECTOR, &self.nc, &ns)]))
    }
}

/// The listener's side: where a connection is in the handshake.
#[derive(Debug, Default)]
pub enum Listener {
    #[default]
    AwaitHello,
    AwaitProof {
        nc: [u8; NONCE_LEN],
        ns: [u8; NONCE_LEN],
    },
    Done,
}

impl Listener {
    pub fn is_done(&self) -> bool {
        matches!(self, Listener::Done)
    }

    /// The largest payload the next expected frame may have.
    pub fn payload_limit(&self) -> u32 {
        MAX_AUTH_PAYLOAD
    }

    /// Take the connector's next frame (`hdr`, `payload`); returns the
    /// frame to send back, if any. An error closes the connection.
    pub fn on_frame(&mut self, secret: &Secret, hdr: &Header, payload: &[u8]) -> Result<Option<Vec<u8>>, AuthError> {
        match (std::mem::take(self), hdr.msg_type) {
            (Listener::AwaitHello, MsgType::AuthHello) => {
                let nc: [u8; NONCE_LEN] = exact("AuthHello", payload)?;
                let ns = nonce()?;
                let reply = frame(MsgType::AuthChallenge, &[&ns, &secret.proof(LISTENER, &nc, &ns)]);
                *self = Listener::AwaitProof { nc, ns };
                Ok(Some(reply))
            }
            (Listener::AwaitProof { nc, ns }, MsgType::AuthProof) => {
                if payload.len() != PROOF_LEN || !secret.verify(CONNECTOR, &nc, &ns, payload) {
                    return Err(AuthError::Failed("wrong job token"));
                }
                *self = Listener::Done;
                Ok(None)
            }
            (Listener::Done, _) => Err(AuthError::Failed("internal: handshake already done")),
            (_, other) => {
                Err(ProtocolError::UnexpectedType(format!("{other:?} before the authentication handshake")).into())
            }
        }
    }
}

/// The connector's whole handshake on a blocking stream (`r` reads it
/// under a deadline, `w` writes it).
pub fn connect_blocking<R: Read, W: Write>(r: &mut R, w: &mut W, secret: &Secret) -> Result<(), AuthError> {
    let (c, hello) = Connector::start(secret)?;
    w.write_all(&hello).map_err(AuthError::Io)?;
    let (h, payload) = read_message(r, None, MAX_NOTICE_PAYLOAD)?;
    match h.msg_type {
        MsgType::AuthChallenge => {}
        MsgType::Error => return Err(AuthError::Rejected(String::from_utf8_lossy(&payload).into_owned())),
        other => return Err(ProtocolError::UnexpectedType(format!("{other:?} instead of AuthChallenge")).into()),
    }
    let proof = c.answer(&payload)?;
    w.write_all(&proof).map_err(AuthError::Io)
}

/// The listener's whole handshake on a blocking stream. On failure the
/// connector is told only that authentication failed.
pub fn listen_blocking<R: Read, W: Write>(r: &mut R, w: &mut W, secret: &Secret) -> Result<(), AuthError> {
    let mut l = Listener::default();
    let result = (|| {
        while !l.is_done() {
            let (h, payload) = read_message(r, None, l.payload_limit())?;
            if let Some(reply) = l.on_frame(secret, &h, &payload)? {
                w.write_all(&reply).map_err(AuthError::Io)?;
            }
        }
        Ok(())
    })();
    if let Err(e) = &result {
        if !matches!(e, AuthError::Io(_) | AuthError::Read(ReadError::Closed | ReadError::Io(_))) {
            let _ = w.write_all(&rejection());
        }
    }
    result
}

/// The Error frame a failed handshake gets: the same whatever failed.
pub fn rejection() -> Vec<u8> {
    frame(MsgType::Error, &[REJECTION.as_bytes()])
}

pub const REJECTION: &str = "authentication failed: this connection does not hold the job's token";

#[cfg(test)]
mod tests {
    use super::*;

    fn split(frame: &[u8]) -> (Header, Vec<u8>) {
        let hdr = Header::decode(&frame[..super::super::HEADER_LEN], MAX_AUTH_PAYLOAD).unwrap();
        (hdr, frame[super::super::HEADER_LEN..].to_vec())
    }

    fn run(connector: &Secret, listener: &Secret) -> Result<(), AuthError> {
        let (c, hello) = Connector::start(connector)?;
        let mut l = Listener::default();
        let (h, p) = split(&hello);
        let challenge = l.on_frame(listener, &h, &p)?.unwrap();
        let (_, p) = split(&challenge);
        let proof = c.answer(&p)?;
        let (h, p) = split(&proof);
        assert!(l.on_frame(listener, &h, &p)?.is_none());
        assert!(l.is_done());
        Ok(())
    }

    #[test]
    fn same_token_passes_both_ways() {
        run(&Secret::new(b"s3cret"), &Secret::new(b"s3cret")).unwrap();
        run(&Secret::none(), &Secret::none()).unwrap();
    }

    #[test]
    fn a_wrong_token_fails_on_both_sides() {
        // The connector rejects a listener without the token...
        let e = run(&Secret::new(b"a"), &Secret::new(b"b")).unwrap_err();
        assert!(e.to_string().contains("does not hold this job's token"), "{e}");
        // ...and a listener rejects a connector's proof made without it.
        let (c, hello) = Connector::start(&Secret::new(b"a")).unwrap();
        let mut l = Listener::default();
        let (h, p) = split(&hello);
        let challenge = l.on_frame(&Secret::new(b"a"), &h, &p).unwrap().unwrap();
        let (_, cp) = split(&challenge);
        drop(c);
        let forged = Connector { secret: Secret::new(b"b"), nc: p.clone().try_into().unwrap() };
        let proof = forged.secret.proof(CONNECTOR, &forged.nc, &cp[..NONCE_LEN].try_into().unwrap());
        let (h, _) = split(&frame(MsgType::AuthProof, &[&proof]));
        assert!(l.on_frame(&Secret::new(b"a"), &h, &proof).is_err());
    }

    #[test]
    fn a_recorded_proof_does_not_pass_a_new_challenge() {
        let s = Secret::new(b"tok");
        let (c, hello) = Connector::start(&s).unwrap();
        let (h, p) = split(&hello);
        let mut first = Listener::default();
        let ch = first.on_frame(&s, &h, &p).unwrap().unwrap();
        let proof = c.answer(&split(&ch).1).unwrap();
        // Replayed to a new connection: same hello, same proof.
        let mut second = Listener::default();
        second.on_frame(&s, &h, &p).unwrap();
        let (ph, pp) = split(&proof);
        assert!(matches!(second.on_frame(&s, &ph, &pp), Err(AuthError::Failed(_))));
    }

    #[test]
    fn frames_out_of_order_or_malformed_are_errors() {
        let s = Secret::new(b"tok");
        let mut l = Listener::default();
        let (h, p) = split(&frame(MsgType::AuthProof, &[&[0u8; PROOF_LEN]]));
        assert!(l.on_frame(&s, &h, &p).is_err());
        let mut l = Listener::default();
        let (h, _) = split(&frame(MsgType::AuthHello, &[&[0u8; 5]]));
        assert!(l.on_frame(&s, &h, &[0u8; 5]).is_err());
        let mut l = Listener::default();
        let (h, p) = split(&frame(MsgType::Register, &[]));
        assert!(l.on_frame(&s, &h, &p).is_err());
    }
}
