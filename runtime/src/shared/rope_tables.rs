//! Rotary embedding's angle tables, built as `graphtrain_ir::decompose` builds them (in f64:
//! `freq_i = theta^(i · -2/D)`, `angle = pos · freq`, negated for `inverse`, then `cos` and
//! `sin` cast to f32), so every backend's rope gives the decomposition's bits. The cpu backend
//! keeps them on the host; the device backends write them into the arena's tail at load.

/// The `[S, D/2]` cos and sin tables.
pub struct Tables {
    pub cos: Vec<f32>,
    pub sin: Vec<f32>,
}

/// What tells two steps' tables apart: theta's bits, sequence length, head dim, inverse.
pub type TableKey = (u64, usize, usize, bool);

impl Tables {
    /// The key of the tables `new` builds from the same arguments.
    pub fn key(theta: f64, seq: usize, head_dim: usize, inverse: bool) -> TableKey {
        (theta.to_bits(), seq, head_dim, inverse)
    }

    pub fn new(theta: f64, seq: usize, head_dim: usize, inverse: bool) -> Tables {
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(seq * half);
        let mut sin = Vec::with_capacity(seq * half);
        for pos in 0..seq {
            for i in 0..half {
                let freq = theta.powf(i as f64 * (-2.0 / head_dim as f64));
                let mut angle = pos as f64 * freq;
                if inverse {
                    angle = -angle;
                }
                cos.push(angle.cos() as f32);
                sin.push(angle.sin() as f32);
            }
        }
        Tables { cos, sin }
    }
}
