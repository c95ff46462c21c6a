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
//! connection with a message that reveals nothing about the job.
//!
//! With encryption on (`GRADHUB_ENCRYPT`, `Secret::encrypted`) the hello
//! and the challenge carry `FLAG_SEALED`, both proofs cover the setting (so
//! no one on the path can turn it off), a listener refuses a connector that
//! disagrees naming the setting, and both sides derive the connection's
//! keys from the token and both nonces (`protocol::seal`): every frame after
//! the handshake is sealed. Without it nothing is encrypted: whoever is on
//! the path can read gradients, and frames are only checksummed
//! (docs/security.md).
//!
//! Without a token (`Secret::none`, single-host jobs or an explicit
//! insecure flag) the same handshake runs with an empty key: one code path,
//! which then proves nothing.
//!
//! A shared service (`scheduler::service`) hosts many jobs, so the hello
//! also names the job (not a secret). The service holds one master secret
//! and derives each job's token from it and the name (`Secret::job_token`):
//! the operator hands a job its token, the service never stores or sends
//! one, and a job's token proves nothing for another job. The empty name is
//! the service itself (its servers and operators), keyed by the master.

use hmac::{Hmac, Mac};
use sha2::Sha256;

use std::io::{Read, Write};

use super::seal::{Keys, Side};
use super::{read_message, Header, MsgType, ProtocolError, ReadError, FLAG_SEALED, MAX_NOTICE_PAYLOAD};

pub const NONCE_LEN: usize = 32;
pub const PROOF_LEN: usize = 32;
/// The longest job name a hello may carry.
pub const MAX_JOB_NAME: usize = 64;
/// The largest auth payload (a hello with the longest job name).
pub const MAX_AUTH_PAYLOAD: u32 = (NONCE_LEN + MAX_JOB_NAME) as u32;

const JOB_TOKEN: &[u8] = b"gradhub-job-token-v1 ";

const LISTENER: &[u8] = b"gradhub-auth-v1 listener";
const CONNECTOR: &[u8] = b"gradhub-auth-v1 connector";

/// The job's secret, and the job name a connector announces with it (empty
/// outside a shared service). Its Debug output never shows the key.
/// With `encrypted`, every connection made with it is sealed.
#[derive(Clone, Default)]
pub struct Secret {
    key: Vec<u8>,
    job: String,
    encrypt: bool,
}

impl std::fmt::Debug for Secret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let key = if self.key.is_empty() { "none" } else { ".." };
        let sealed = if self.encrypt { ", encrypted" } else { "" };
        write!(f, "Secret({key}, job {:?}{sealed})", self.job)
    }
}

/// How the setting is named in messages.
pub const ENCRYPT_SETTING: &str = "GRADHUB_ENCRYPT";

impl Secret {
    pub fn new(token: &[u8]) -> Secret {
        Secret { key: token.to_vec(), job: String::new(), encrypt: false }
    }
    /// No token: the handshake still runs, and proves nothing.
    pub fn none() -> Secret {
        Secret::default()
    }
    pub fn is_none(&self) -> bool {
        self.key.is_empty()
    }
    /// Encrypt every connection (`protocol::seal`), or not. Keys derived
    /// from no token would be anyone's: encryption needs one.
    pub fn encrypted(mut self, on: bool) -> Result<Secret, AuthError> {
        if on && self.key.is_empty() {
            return Err(AuthError::Setting(format!(
                "{ENCRYPT_SETTING}=1 needs a job token (GRADHUB_JOB_TOKEN or GRADHUB_JOB_TOKEN_FILE): keys derived \
                 from no secret protect nothing"
            )));
        }
        self.encrypt = on;
        Ok(self)
    }
    pub fn encrypts(&self) -> bool {
        self.encrypt
    }
    /// The same key, announced as a member of job `name` of a service.
    pub fn for_job(mut self, name: &str) -> Result<Secret, AuthError> {
        check_job_name(name)?;
        self.job = name.to_string();
        Ok(self)
    }
    pub fn job(&self) -> &str {
        &self.job
    }

    /// A listener's keys for one job: this secret, whatever name is announced.
    pub fn keys(&self) -> impl Fn(&str) -> Secret + '_ {
        move |_| self.clone()
    }

    /// A service's keys: each job's derived token (`key_for`).
    pub fn service_keys(&self) -> impl Fn(&str) -> Secret + '_ {
        move |job| self.key_for(job)
    }

    /// Job `name`'s token under this service master secret: what the
    /// operator gives the job (hex, so it fits an environment variable).
    pub fn job_token(&self, name: &str) -> String {
        let mut m = self.hmac();
        m.update(JOB_TOKEN);
        m.update(name.as_bytes());
        m.finalize().into_bytes().iter().map(|b| format!("{b:02x}")).collect()
    }

    /// The key a connection announcing `job` must hold, for a listener
    /// keyed by this (master) secret: the master itself for the service's
    /// own members (empty name), else the job's derived token.
    pub fn key_for(&self, job: &str) -> Secret {
        let key = if job.is_empty() { self.key.clone() } else { self.job_token(job).into_bytes() };
        Secret { key, job: String::new(), encrypt: self.encrypt }
    }

    fn hmac(&self) -> Hmac<Sha256> {
        // HMAC takes a key of any length: this cannot fail.
        <Hmac<Sha256> as Mac>::new_from_slice(&self.key).expect("HMAC accepts any key length")
    }

    /// The proofs cover the encryption setting: a connection whose hello
    /// lost its flag on the way fails.
    fn mac(&self, label: &[u8], nc: &[u8; NONCE_LEN], ns: &[u8; NONCE_LEN]) -> Hmac<Sha256> {
        let mut m = self.hmac();
        m.update(label);
        m.update(&[self.encrypt as u8]);
        m.update(nc);
        m.update(ns);
        m
    }

    /// The key, labelled with a job name already checked.
    fn for_job_unchecked(mut self, job: &str) -> Secret {
        self.job = job.to_string();
        self
    }

    fn proof(&self, label: &[u8], nc: &[u8; NONCE_LEN], ns: &[u8; NONCE_LEN]) -> [u8; PROOF_LEN] {
        self.mac(label, nc, ns).finalize().into_bytes().into()
    }

    /// Constant-time check of a peer's proof.
    fn verify(&self, label: &[u8], nc: &[u8; NONCE_LEN], ns: &[u8; NONCE_LEN], proof: &[u8]) -> bool {
        self.mac(label, nc, ns).verify_slice(proof).is_ok()
    }

    /// The connection's keys, if it is encrypted.
    fn keys_of(&self, nc: &[u8; NONCE_LEN], ns: &[u8; NONCE_LEN], side: Side) -> Option<Keys> {
        self.encrypt.then(|| Keys::derive(&self.key, nc, ns, side))
    }

    fn flags(&self) -> u16 {
        if self.encrypt {
            FLAG_SEALED
        } else {
            0
        }
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
    #[error("invalid job name {0:?}: use 1 to 64 letters, digits, '.', '_' or '-'")]
    BadJobName(String),
    /// The two ends disagree on a setting both must share (encryption), or
    /// a setting cannot work: the message names it.
    #[error("{0}")]
    Setting(String),
    #[error(transparent)]
    Protocol(#[from] ProtocolError),
    #[error(transparent)]
    Read(#[from] ReadError),
    #[error("{0}")]
    Io(std::io::Error),
}

/// A job name: 1 to 64 of `A-Z a-z 0-9 . _ -` (it appears in logs and
/// commands, so nothing that could be mistaken for something else).
pub fn check_job_name(name: &str) -> Result<(), AuthError> {
    let ok = !name.is_empty()
        && name.len() <= MAX_JOB_NAME
        && name.bytes().all(|b| b.is_ascii_alphanumeric() || b"._-".contains(&b));
    if ok {
        Ok(())
    } else {
        Err(AuthError::BadJobName(name.chars().take(80).collect()))
    }
}

/// The namespace job `name`'s frames carry on a shared service: derived
/// from the name, so every member knows it before it is told anything.
pub fn job_namespace(name: &str) -> u32 {
    use sha2::Digest;
    let d = Sha256::new().chain_update(b"gradhub-namespace-v1 ").chain_update(name.as_bytes()).finalize();
    u32::from_le_bytes([d[0], d[1], d[2], d[3]]).max(1)
}

/// A fresh nonce from the operating system's random source.
pub fn nonce() -> Result<[u8; NONCE_LEN], AuthError> {
    let mut n = [0u8; NONCE_LEN];
    getrandom::fill(&mut n).map_err(|e| AuthError::Random(e.to_string()))?;
    Ok(n)
}

fn frame(msg_type: MsgType, flags: u16, parts: &[&[u8]]) -> Vec<u8> {
    let len: usize = parts.iter().map(|p| p.len()).sum();
    let mut h = Header::new(msg_type);
    h.flags = flags;
    h.payload_len = len as u32;
    super::encode_frame(&h, &parts.concat())
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
        let hello = frame(MsgType::AuthHello, secret.flags(), &[&nc, secret.job.as_bytes()]);
        Ok((Connector { secret: secret.clone(), nc }, hello))
    }

    /// The listener's challenge (its payload): check the listener's proof,
    /// return the proof frame to send and, if the connection is encrypted,
    /// its keys (every frame after the proof is sealed).
    pub fn answer(self, challenge: &[u8]) -> Result<(Vec<u8>, Option<Keys>), AuthError> {
        let c: [u8; NONCE_LEN + PROOF_LEN] = exact("AuthChallenge", challenge)?;
        let ns: [u8; NONCE_LEN] = exact("nonce", &c[..NONCE_LEN])?;
        if !self.secret.verify(LISTENER, &self.nc, &ns, &c[NONCE_LEN..]) {
            crate::metrics::count(&crate::metrics::AUTH_FAILURES);
            return Err(AuthError::Failed(
                "the peer does not hold this job's token (a wrong GRADHUB_JOB_TOKEN, not this job's member, or \
                 for a shared service's servers and operators a wrong GRADHUB_SERVICE_TOKEN)",
            ));
        }
        let proof = frame(MsgType::AuthProof, 0, &[&self.secret.proof(CONNECTOR, &self.nc, &ns)]);
        Ok((proof, self.secret.keys_of(&self.nc, &ns, Side::Connector)))
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
        key: Secret,
    },
    /// Authenticated, as a member of this job (empty: no name given); the
    /// connection's keys if it is encrypted, until taken.
    Done {
        job: String,
        keys: Option<Keys>,
    },
}

impl Listener {
    pub fn is_done(&self) -> bool {
        matches!(self, Listener::Done { .. })
    }

    /// The largest payload the next expected frame may have.
    pub fn payload_limit(&self) -> u32 {
        MAX_AUTH_PAYLOAD
    }

    /// The connection ended: in the middle of the handshake, after our
    /// challenge, is how a peer without the token leaves (it checks our
    /// proof first and hangs up); counted as an authentication failure (a
    /// wrong proof counts itself).
    pub fn hung_up(&self) {
        if matches!(self, Listener::AwaitProof { .. }) {
            crate::metrics::count(&crate::metrics::AUTH_FAILURES);
        }
    }

    /// Take the connector's next frame (`hdr`, `payload`); returns the
    /// frame to send back, if any. An error closes the connection.
    /// `keys` gives the key a connector announcing a job name must hold.
    pub fn on_frame(
        &mut self,
        keys: &impl Fn(&str) -> Secret,
        hdr: &Header,
        payload: &[u8],
    ) -> Result<Option<Vec<u8>>, AuthError> {
        match (std::mem::take(self), hdr.msg_type) {
            (Listener::AwaitHello, MsgType::AuthHello) => {
                if payload.len() < NONCE_LEN {
                    return Err(ProtocolError::BadPayload(format!("AuthHello of {} bytes", payload.len())).into());
                }
                let nc: [u8; NONCE_LEN] = exact("nonce", &payload[..NONCE_LEN])?;
                let job = std::str::from_utf8(&payload[NONCE_LEN..])
                    .map_err(|_| ProtocolError::BadPayload("a job name that is not UTF-8".into()))?;
                if !job.is_empty() {
                    check_job_name(job)?;
                }
                let key = keys(job);
                let sealed = hdr.flags & FLAG_SEALED != 0;
                if sealed != key.encrypt {
                    let (ours, theirs) = if key.encrypt { ("encrypt", "does not") } else { ("do not encrypt", "does") };
                    return Err(AuthError::Setting(format!(
                        "this job's members {ours} their connections and this one {theirs}: set {ENCRYPT_SETTING} \
                         the same on every member (`--encrypt`)"
                    )));
                }
                let ns = nonce()?;
                let reply = frame(MsgType::AuthChallenge, key.flags(), &[&ns, &key.proof(LISTENER, &nc, &ns)]);
                *self = Listener::AwaitProof { nc, ns, key: key.for_job_unchecked(job) };
                Ok(Some(reply))
            }
            (Listener::AwaitProof { nc, ns, key }, MsgType::AuthProof) => {
                if payload.len() != PROOF_LEN || !key.verify(CONNECTOR, &nc, &ns, payload) {
                    crate::metrics::count(&crate::metrics::AUTH_FAILURES);
                    return Err(AuthError::Failed("wrong job token"));
                }
                let keys = key.keys_of(&nc, &ns, Side::Listener);
                *self = Listener::Done { job: key.job, keys };
                Ok(None)
            }
            (Listener::Done { .. }, _) => Err(AuthError::Failed("internal: handshake already done")),
            (_, other) => {
                Err(ProtocolError::UnexpectedType(format!("{other:?} before the authentication handshake")).into())
            }
        }
    }
}

/// The connector's whole handshake on a blocking stream (`r` reads it
/// under a deadline, `w` writes it); the connection's keys if encrypted.
pub fn connect_blocking<R: Read, W: Write>(r: &mut R, w: &mut W, secret: &Secret) -> Result<Option<Keys>, AuthError> {
    let (c, hello) = Connector::start(secret)?;
    w.write_all(&hello).map_err(AuthError::Io)?;
    let (h, payload) = read_message(r, None, MAX_NOTICE_PAYLOAD)?;
    match h.msg_type {
        MsgType::AuthChallenge => {}
        MsgType::Error => return Err(AuthError::Rejected(String::from_utf8_lossy(&payload).into_owned())),
        other => return Err(ProtocolError::UnexpectedType(format!("{other:?} instead of AuthChallenge")).into()),
    }
    let (proof, keys) = c.answer(&payload)?;
    w.write_all(&proof).map_err(AuthError::Io)?;
    Ok(keys)
}

/// The listener's whole handshake on a blocking stream; returns the job
/// name the connector announced and the connection's keys if encrypted.
/// On failure the connector is told only that authentication failed (or,
/// for a setting the two ends disagree on, which).
pub fn listen_blocking<R: Read, W: Write>(
    r: &mut R,
    w: &mut W,
    keys: &impl Fn(&str) -> Secret,
) -> Result<(String, Option<Keys>), AuthError> {
    let mut l = Listener::default();
    let result = (|| loop {
        if let Listener::Done { job, keys } = &mut l {
            return Ok((std::mem::take(job), keys.take()));
        }
        let (h, payload) = read_message(r, None, l.payload_limit())?;
        if let Some(reply) = l.on_frame(keys, &h, &payload)? {
            w.write_all(&reply).map_err(AuthError::Io)?;
        }
    })();
    if let Err(e) = &result {
        // A peer without the token finds out from our challenge and hangs up
        // before its proof: a failure all the same (a wrong proof counted itself).
        l.hung_up();
        match e {
            AuthError::Io(_) | AuthError::Read(ReadError::Closed | ReadError::Io(_)) => {}
            AuthError::Setting(why) => {
                let _ = w.write_all(&frame(MsgType::Error, 0, &[why.as_bytes()]));
            }
            _ => {
                let _ = w.write_all(&rejection());
            }
        }
    }
    result
}

/// The Error frame a failed handshake gets: the same whatever failed.
pub fn rejection() -> Vec<u8> {
    frame(MsgType::Error, 0, &[REJECTION.as_bytes()])
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
        let challenge = l.on_frame(&listener.keys(), &h, &p)?.unwrap();
        let (_, p) = split(&challenge);
        let (proof, _) = c.answer(&p)?;
        let (h, p) = split(&proof);
        assert!(l.on_frame(&listener.keys(), &h, &p)?.is_none());
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
        let challenge = l.on_frame(&Secret::new(b"a").keys(), &h, &p).unwrap().unwrap();
        let (_, cp) = split(&challenge);
        drop(c);
        let forged = Connector { secret: Secret::new(b"b"), nc: p.clone().try_into().unwrap() };
        let proof = forged.secret.proof(CONNECTOR, &forged.nc, &cp[..NONCE_LEN].try_into().unwrap());
        let (h, _) = split(&frame(MsgType::AuthProof, 0, &[&proof]));
        assert!(l.on_frame(&Secret::new(b"a").keys(), &h, &proof).is_err());
    }

    #[test]
    fn a_recorded_proof_does_not_pass_a_new_challenge() {
        let s = Secret::new(b"tok");
        let (c, hello) = Connector::start(&s).unwrap();
        let (h, p) = split(&hello);
        let mut first = Listener::default();
        let ch = first.on_frame(&s.keys(), &h, &p).unwrap().unwrap();
        let (proof, _) = c.answer(&split(&ch).1).unwrap();
        // Replayed to a new connection: same hello, same proof.
        let mut second = Listener::default();
        second.on_frame(&s.keys(), &h, &p).unwrap();
        let (ph, pp) = split(&proof);
        assert!(matches!(second.on_frame(&s.keys(), &ph, &pp), Err(AuthError::Failed(_))));
    }

    #[test]
    fn frames_out_of_order_or_malformed_are_errors() {
        let s = Secret::new(b"tok");
        let mut l = Listener::default();
        let (h, p) = split(&frame(MsgType::AuthProof, 0, &[&[0u8; PROOF_LEN]]));
        assert!(l.on_frame(&s.keys(), &h, &p).is_err());
        let mut l = Listener::default();
        let (h, _) = split(&frame(MsgType::AuthHello, 0, &[&[0u8; 5]]));
        assert!(l.on_frame(&s.keys(), &h, &[0u8; 5]).is_err());
        let mut l = Listener::default();
        let (h, p) = split(&frame(MsgType::Register, 0, &[]));
        assert!(l.on_frame(&s.keys(), &h, &p).is_err());
    }

    #[test]
    fn a_service_knows_each_job_by_its_derived_token() {
        let master = Secret::new(b"service master");
        let handshake = |connector: &Secret| -> Result<String, AuthError> {
            let (c, hello) = Connector::start(connector)?;
            let mut l = Listener::default();
            let (h, p) = split(&hello);
            let ch = l.on_frame(&master.service_keys(), &h, &p)?.unwrap();
            let (proof, _) = c.answer(&split(&ch).1)?;
            let (h, p) = split(&proof);
            l.on_frame(&master.service_keys(), &h, &p)?;
            match l {
                Listener::Done { job, .. } => Ok(job),
                _ => panic!("not done"),
            }
        };
        let token_a = master.job_token("job-a");
        assert_eq!(token_a.len(), 64);
        assert_ne!(token_a, master.job_token("job-b"));
        let a = Secret::new(token_a.as_bytes()).for_job("job-a").unwrap();
        assert_eq!(handshake(&a).unwrap(), "job-a");
        // Job a's token does not open job b, nor the service itself.
        let posing = Secret::new(token_a.as_bytes()).for_job("job-b").unwrap();
        assert!(handshake(&posing).is_err());
        assert!(handshake(&Secret::new(token_a.as_bytes())).is_err());
        // The master opens the service's own name (servers, operators).
        assert_eq!(handshake(&master).unwrap(), "");
        // Names are checked on both sides.
        assert!(Secret::new(b"x").for_job("a b").is_err());
        assert!(Secret::new(b"x").for_job(&"n".repeat(65)).is_err());
        let mut hello = Connector::start(&Secret::new(b"x")).unwrap().1;
        hello.extend_from_slice(b"bad/name");
        let len = (hello.len() - super::super::HEADER_LEN) as u32;
        let mut h = Header::decode(&hello[..super::super::HEADER_LEN], MAX_AUTH_PAYLOAD).unwrap();
        h.payload_len = len;
        let mut l = Listener::default();
        assert!(l.on_frame(&master.service_keys(), &h, &hello[super::super::HEADER_LEN..]).is_err());
    }

    /// The handshake between `connector` and `listener`, and the keys each ends with.
    fn keys_after(connector: &Secret, listener: &Secret) -> Result<(Option<Keys>, Option<Keys>), AuthError> {
        let (c, hello) = Connector::start(connector)?;
        let mut l = Listener::default();
        let (h, p) = split(&hello);
        let ch = l.on_frame(&listener.keys(), &h, &p)?.unwrap();
        let (proof, ck) = c.answer(&split(&ch).1)?;
        let (h, p) = split(&proof);
        l.on_frame(&listener.keys(), &h, &p)?;
        match l {
            Listener::Done { keys, .. } => Ok((ck, keys)),
            _ => panic!("not done"),
        }
    }

    #[test]
    fn encrypting_members_share_fresh_keys_and_a_member_that_disagrees_is_refused_naming_the_setting() {
        let on = Secret::new(b"tok").encrypted(true).unwrap();
        let off = Secret::new(b"tok");
        let (Some(mut ck), Some(mut lk)) = keys_after(&on, &on).unwrap() else { panic!("no keys") };
        let head = Header::new(MsgType::Heartbeat).encode(&[]);
        let mut data = *b"gradient";
        let tag = ck.seal.seal(&head, &mut data).unwrap();
        lk.open.open(&head, &mut data, &tag).unwrap();
        assert_eq!(&data, b"gradient");
        // Another connection of the same members: other keys.
        let (Some(mut ck2), _) = keys_after(&on, &on).unwrap() else { panic!("no keys") };
        let mut data = *b"gradient";
        let tag = ck2.seal.seal(&head, &mut data).unwrap();
        assert!(pair_open(&mut lk, &head, &mut data, &tag).is_err());
        // Unencrypted: no keys.
        let (ck, lk) = keys_after(&off, &off).unwrap();
        assert!(ck.is_none() && lk.is_none());
        // Either way round, the listener refuses, naming the setting.
        for (c, l) in [(&on, &off), (&off, &on)] {
            let e = keys_after(c, l).unwrap_err();
            assert!(matches!(e, AuthError::Setting(_)) && e.to_string().contains(ENCRYPT_SETTING), "{e}");
        }
        // A hello whose flag was taken off on the way passes the listener's
        // check but not the connector's: the proofs cover the setting.
        let (c, mut hello) = Connector::start(&on).unwrap();
        let mut h = Header::decode(&hello[..super::super::HEADER_LEN], MAX_AUTH_PAYLOAD).unwrap();
        h.flags = 0;
        let head = h.encode(&hello[super::super::HEADER_LEN..]);
        hello[..super::super::HEADER_LEN].copy_from_slice(&head);
        let mut l = Listener::default();
        let (h, p) = split(&hello);
        let ch = l.on_frame(&Secret::new(b"tok").keys(), &h, &p).unwrap().unwrap();
        assert!(matches!(c.answer(&split(&ch).1), Err(AuthError::Failed(_))));
        // No token, no encryption.
        let e = Secret::none().encrypted(true).unwrap_err();
        assert!(e.to_string().contains("needs a job token"), "{e}");
        // A service's jobs inherit the master's setting.
        assert!(on.key_for("job-a").encrypts() && on.key_for("").encrypts());
    }

    fn pair_open(
        k: &mut Keys,
        head: &[u8; 40],
        data: &mut [u8],
        tag: &[u8; 16],
    ) -> Result<(), crate::protocol::seal::TagMismatch> {
        k.open.open(head, data, tag)
    }
}
