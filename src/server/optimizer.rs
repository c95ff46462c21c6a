//! The optimizer update a server thread runs per chunk when a tensor has a
//! server-side optimizer (PHub: the update is fused into aggregation, so the
//! server returns new parameters instead of summed gradients). The arithmetic
//! follows torch.optim's single-tensor implementations step by step.

use crate::protocol::{OptConfig, OptKind};

/// Parameters and optimizer state of one chunk.
pub struct OptState {
    pub param: Vec<f32>,
    m: Vec<f32>,
    v: Vec<f32>,
    step: u64,
}

impl OptState {
    pub fn new(initial: &[f32]) -> OptState {
        OptState { param: initial.to_vec(), m: Vec::new(), v: Vec::new(), step: 0 }
    }

    /// One update with gradient `g` (already averaged).
    // Indexing: parameter, gradient and both moments advance in lockstep,
    // as in torch.optim's single-tensor loops.
    #[allow(clippy::needless_range_loop)]
    pub fn update(&mut self, cfg: &OptConfig, g: &[f32]) {
        let n = self.param.len();
        assert_eq!(g.len(), n, "gradient and parameter lengths differ");
        match cfg.kind {
            OptKind::Sgd => {
                let (lr, mom, damp, wd) = (cfg.lr, cfg.momentum, cfg.dampening, cfg.weight_decay);
                let first = self.step == 0;
                if mom != 0.0 && self.m.is_empty() {
                    self.m = vec![0.0; n];
                }
                for i in 0..n {
                    let mut d = g[i];
                    if wd != 0.0 {
                        d += wd * self.param[i];
                    }
                    if mom != 0.0 {
                        let b = if first { d } else { mom * self.m[i] + (1.0 - damp) * d };
                        self.m[i] = b;
                        d = if cfg.nesterov { d + mom * b } else { b };
                    }
                    self.param[i] += -lr * d;
                }
            }
            OptKind::AdamW => {
                if self.m.is_empty() {
                    self.m = vec![0.0; n];
                    self.v = vec![0.0; n];
                }
                let t = (self.step + 1) as f64;
                let (b1, b2) = (cfg.beta1 as f64, cfg.beta2 as f64);
                let step_size = (cfg.lr as f64 / (1.0 - b1.powf(t))) as f32;
                let bc2_sqrt = (1.0 - b2.powf(t)).sqrt() as f32;
                let decay = 1.0 - cfg.lr * cfg.weight_decay;
                let (w1, w2) = (1.0 - cfg.beta1, 1.0 - cfg.beta2);
                for i in 0..n {
                    self.param[i] *= decay;
                    self.m[i] += w1 * (g[i] - self.m[i]);
                    self.v[i] = self.v[i] * cfg.beta2 + w2 * g[i] * g[i];
                    let denom = self.v[i].sqrt() / bc2_sqrt + cfg.eps;
                    self.param[i] += -step_size * (self.m[i] / denom);
                }
            }
        }
        self.step += 1;
    }

    /// How many vectors `encode` writes: parameters and the moments in use.
    pub fn vectors(&self) -> u16 {
        1 + !self.m.is_empty() as u16 + !self.v.is_empty() as u16
    }

    /// The whole state as bytes (a `Snapshot` payload): the step count
    /// (u64 LE), then the parameters and each moment present, f32 LE.
    pub fn encode(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(8 + 4 * (self.param.len() + self.m.len() + self.v.len()));
        out.extend_from_slice(&self.step.to_le_bytes());
        for x in self.param.iter().chain(&self.m).chain(&self.v) {
            out.extend_from_slice(&x.to_le_bytes());
        }
        out
    }

    /// The state `encode` wrote, for a chunk of `elems` elements.
    pub fn decode(b: &[u8], elems: usize) -> Result<OptState, String> {
        let vectors = (b.len().saturating_sub(8)) / 4 / elems.max(1);
        if b.len() < 8 || b.len() != 8 + 4 * elems * vectors || vectors == 0 || vectors > 3 {
            return Err(format!("an optimizer state of {} bytes for {elems} elements", b.len()));
        }
        let step = u64::from_le_bytes(b[..8].try_into().map_err(|_| "short state")?);
        let floats: Vec<f32> = b[8..].chunks_exact(4).map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
        let mut parts = floats.chunks(elems.max(1)).map(<[f32]>::to_vec);
        let param = if elems == 0 { Vec::new() } else { parts.next().unwrap_or_default() };
        Ok(OptState { param, m: parts.next().unwrap_or_default(), v: parts.next().unwrap_or_default(), step })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(kind: OptKind) -> OptConfig {
        OptConfig {
            kind,
            lr: 0.1,
            momentum: 0.9,
            dampening: 0.0,
            weight_decay: 0.01,
            nesterov: false,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
        }
    }

    #[test]
    fn sgd_momentum_matches_hand_computation() {
        let mut s = OptState::new(&[1.0, -2.0]);
        let c = cfg(OptKind::Sgd);
        s.update(&c, &[0.5, 0.5]);
        // d = g + wd*p; first step buf = d; p -= lr*d
        let d0 = [0.5 + 0.01 * 1.0, 0.5 + 0.01 * -2.0];
        let p1 = [1.0 - 0.1 * d0[0], -2.0 - 0.1 * d0[1]];
        assert!((s.param[0] - p1[0]).abs() < 1e-7 && (s.param[1] - p1[1]).abs() < 1e-7);
        s.update(&c, &[0.5, 0.5]);
        let d1 = [0.5 + 0.01 * p1[0], 0.5 + 0.01 * p1[1]];
        let b1 = [0.9 * d0[0] + d1[0], 0.9 * d0[1] + d1[1]];
        assert!((s.param[0] - (p1[0] - 0.1 * b1[0])).abs() < 1e-6);
        assert!((s.param[1] - (p1[1] - 0.1 * b1[1])).abs() < 1e-6);
    }

    #[test]
    fn a_decoded_state_continues_exactly_like_the_original() {
        for kind in [OptKind::Sgd, OptKind::AdamW] {
            let c = cfg(kind);
            let mut a = OptState::new(&[1.0, -2.0, 0.25]);
            a.update(&c, &[0.5, -0.1, 2.0]);
            let mut b = OptState::decode(&a.encode(), 3).unwrap();
            for g in [[0.3, 0.3, -1.0], [-2.0, 0.0, 0.5]] {
                a.update(&c, &g);
                b.update(&c, &g);
            }
            assert_eq!(a.param, b.param);
            assert_eq!((a.m.clone(), a.v.clone(), a.step), (b.m, b.v, b.step));
        }
        let fresh = OptState::new(&[4.0]);
        assert_eq!(OptState::decode(&fresh.encode(), 1).unwrap().param, vec![4.0]);
        for bad in [&[0u8; 7][..], &[0u8; 8][..], &[0u8; 13][..], &[0u8; 8 + 4 * 4][..]] {
            assert!(OptState::decode(bad, 1).is_err(), "{} bytes", bad.len());
        }
    }

    #[test]
    fn adamw_first_step_moves_by_lr() {
        // With zero weight decay, Adam's first step is lr * sign(g) (up to eps).
        let mut s = OptState::new(&[0.0, 0.0]);
        let mut c = cfg(OptKind::AdamW);
        c.weight_decay = 0.0;
        s.update(&c, &[3.0, -0.5]);
        assert!((s.param[0] + 0.1).abs() < 1e-6 && (s.param[1] - 0.1).abs() < 1e-6, "{:?}", s.param);
    }
}
