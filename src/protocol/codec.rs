//! A tiny checked binary codec for control-message payloads.
//! Every read is bounds-checked and returns a `ProtocolError` naming the
//! field, so a truncated or hostile payload can never panic the reader.

use super::ProtocolError;

#[derive(Default)]
pub struct Writer {
    pub buf: Vec<u8>,
}

impl Writer {
    pub fn new() -> Writer {
        Writer { buf: Vec::new() }
    }
    pub fn u8(&mut self, v: u8) -> &mut Self {
        self.buf.push(v);
        self
    }
    pub fn u16(&mut self, v: u16) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u32(&mut self, v: u32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn i32(&mut self, v: i32) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn u64(&mut self, v: u64) -> &mut Self {
        self.buf.extend_from_slice(&v.to_le_bytes());
        self
    }
    pub fn str(&mut self, s: &str) -> &mut Self {
        self.u32(s.len() as u32);
        self.buf.extend_from_slice(s.as_bytes());
        self
    }
}

pub struct Reader<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Reader<'a> {
    pub fn new(buf: &'a [u8]) -> Reader<'a> {
        Reader { buf, pos: 0 }
    }
    fn take(&mut self, n: usize, field: &'static str) -> Result<&'a [u8], ProtocolError> {
        let end = self.pos.checked_add(n).filter(|&e| e <= self.buf.len());
        match end {
            Some(end) => {
                let s = &self.buf[self.pos..end];
                self.pos = end;
                Ok(s)
            }
            None => Err(ProtocolError::BadPayload(format!(
                "payload truncated reading {field} ({n} bytes at offset {} of {})",
                self.pos,
                self.buf.len()
            ))),
        }
    }
    pub fn u8(&mut self, field: &'static str) -> Result<u8, ProtocolError> {
        Ok(self.take(1, field)?[0])
    }
    pub fn u16(&mut self, field: &'static str) -> Result<u16, ProtocolError> {
        let b = self.take(2, field)?;
        Ok(u16::from_le_bytes([b[0], b[1]]))
    }
    pub fn u32(&mut self, field: &'static str) -> Result<u32, ProtocolError> {
        let b = self.take(4, field)?;
        Ok(u32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
    pub fn i32(&mut self, field: &'static str) -> Result<i32, ProtocolError> {
        Ok(self.u32(field)? as i32)
    }
    pub fn u64(&mut self, field: &'static str) -> Result<u64, ProtocolError> {
        let b = self.take(8, field)?;
        let mut a = [0u8; 8];
        a.copy_from_slice(b);
        Ok(u64::from_le_bytes(a))
    }
    pub fn str(&mut self, field: &'static str) -> Result<String, ProtocolError> {
        let n = self.u32(field)? as usize;
        let b = self.take(n, field)?;
        String::from_utf8(b.to_vec()).map_err(|_| ProtocolError::BadPayload(format!("{field} is not valid UTF-8")))
    }
    /// A length prefix for a list, bounded so a corrupt count cannot make us
    /// allocate: every element takes at least `min_elem_bytes` on the wire.
    pub fn count(&mut self, field: &'static str, min_elem_bytes: usize) -> Result<usize, ProtocolError> {
        let n = self.u32(field)? as usize;
        if n.saturating_mul(min_elem_bytes.max(1)) > self.buf.len() - self.pos {
            return Err(ProtocolError::BadPayload(format!("{field}: count {n} exceeds the remaining payload")));
        }
        Ok(n)
    }
    pub fn finish(&self, what: &'static str) -> Result<(), ProtocolError> {
        if self.pos != self.buf.len() {
            return Err(ProtocolError::BadPayload(format!("{what}: {} trailing bytes", self.buf.len() - self.pos)));
        }
        Ok(())
    }
}
