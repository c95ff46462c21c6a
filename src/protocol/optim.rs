//! Payload of an OptConfig frame: the optimizer a server thread runs on a
//! tensor's chunks (PHub's optimizer fused into aggregation).

use super::codec::{Reader, Writer};
use super::ProtocolError;

#[derive(Debug, Clone, Copy, PartialEq)]
pub enum OptKind {
    /// torch.optim.SGD semantics (momentum, dampening, Nesterov, L2 weight decay).
    Sgd,
    /// torch.optim.AdamW semantics (decoupled weight decay).
    AdamW,
}

#[derive(Debug, Clone, Copy, PartialEq)]
pub struct OptConfig {
    pub kind: OptKind,
    pub lr: f32,
    pub momentum: f32,
    pub dampening: f32,
    pub weight_decay: f32,
    pub nesterov: bool,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
}

pub const OPT_CONFIG_LEN: usize = 30;

impl OptConfig {
    pub fn encode(&self) -> Vec<u8> {
        let mut w = Writer::new();
        w.u8(match self.kind {
            OptKind::Sgd => 1,
            OptKind::AdamW => 2,
        });
        for v in [self.lr, self.momentum, self.dampening, self.weight_decay] {
            w.u32(v.to_bits());
        }
        w.u8(self.nesterov as u8);
        for v in [self.beta1, self.beta2, self.eps] {
            w.u32(v.to_bits());
        }
        w.buf
    }

    pub fn decode(b: &[u8]) -> Result<OptConfig, ProtocolError> {
        let mut r = Reader::new(b);
        let kind = match r.u8("optimizer kind")? {
            1 => OptKind::Sgd,
            2 => OptKind::AdamW,
            k => return Err(ProtocolError::BadPayload(format!("unknown optimizer kind {k}"))),
        };
        let mut f = |name| r.u32(name).map(f32::from_bits);
        let (lr, momentum, dampening, weight_decay) = (f("lr")?, f("momentum")?, f("dampening")?, f("weight_decay")?);
        let nesterov = r.u8("nesterov")? != 0;
        let mut f = |name| r.u32(name).map(f32::from_bits);
        let (beta1, beta2, eps) = (f("beta1")?, f("beta2")?, f("eps")?);
        r.finish("OptConfig")?;
        let c = OptConfig { kind, lr, momentum, dampening, weight_decay, nesterov, beta1, beta2, eps };
        let finite = [lr, momentum, dampening, weight_decay, beta1, beta2, eps].iter().all(|v| v.is_finite());
        if !finite || lr < 0.0 || !(0.0..1.0).contains(&beta1) || !(0.0..1.0).contains(&beta2) || eps < 0.0 {
            return Err(ProtocolError::BadPayload(format!("invalid optimizer hyperparameters {c:?}")));
        }
        Ok(c)
    }
}
