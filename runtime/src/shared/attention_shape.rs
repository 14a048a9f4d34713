//! Causal grouped-query attention's sizes, read off its `[B, H, S, D]` views the same way by
//! every backend.

use crate::RuntimeError;
use graphtrain_lowering::View;

/// Shapes shared by forward and backward.
#[derive(Clone, Copy, Debug)]
pub struct Dims {
    pub batch: usize,
    pub heads: usize,
    pub kv_heads: usize,
    pub seq: usize,
    pub head_dim: usize,
    pub causal: bool,
    pub scale: f32,
}

/// Attention's shapes from its `[B, H, S, D]` query and `[B, Hkv, S, D]` key views.
pub fn attention_dims(q: &View, k: &View, causal: bool, scale: f64) -> Result<Dims, RuntimeError> {
    match (q.shape.as_slice(), k.shape.as_slice()) {
        (&[b, h, s, d], &[_, hkv, _, _]) if hkv > 0 && h % hkv == 0 => Ok(Dims {
            batch: b,
            heads: h,
            kv_heads: hkv,
            seq: s,
            head_dim: d,
            causal,
            scale: scale as f32,
        }),
        _ => Err(RuntimeError::Backend(format!(
            "attention needs [B, H, S, D] queries and [B, Hkv, S, D] keys with Hkv dividing H, \
got {:?} and {:?}",
            q.shape, k.shape
        ))),
    }
}
