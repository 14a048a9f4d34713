//! `HostTensor`, the project's tensor on the host: what the interpreter computes on, what
//! backends are written from and read into, what checkpoints hold. One f64 per element whatever
//! the dtype, always rounded to what the dtype can hold.

use crate::dtype::{DType, TensorType};
use crate::interp::InterpError;
use crate::op::BinaryOp;

/// A tensor on the host: row-major data, one f64 per element whatever the dtype (integers as
/// whole numbers, bool as 0 or 1). Constructors round the data to the dtype, so a tensor only holds
/// values its dtype can represent.
#[derive(Clone, Debug, PartialEq)]
pub struct HostTensor {
    pub ty: TensorType,
    pub data: Vec<f64>,
}

impl HostTensor {
    /// A tensor of type `ty` holding `data` (rounded to the dtype); refuses a length that is not
    /// the type's element count.
    pub fn new(ty: TensorType, mut data: Vec<f64>) -> Result<Self, InterpError> {
        if data.len() != ty.numel() {
            return Err(InterpError::plain(format!(
                "a {ty} tensor has {} elements, got {} values",
                ty.numel(),
                data.len()
            )));
        }
        round_slice(ty.dtype, &mut data);
        Ok(HostTensor { ty, data })
    }

    /// A scalar holding `value` rounded to `dtype`.
    pub fn scalar(dtype: DType, value: f64) -> Self {
        HostTensor {
            ty: TensorType::scalar(dtype),
            data: vec![round_to_dtype(dtype, value)],
        }
    }

    /// A tensor of type `ty` with every element `value` (rounded to the dtype).
    pub fn full(ty: TensorType, value: f64) -> Self {
        let data = vec![round_to_dtype(ty.dtype, value); ty.numel()];
        HostTensor { ty, data }
    }

    pub fn zeros(ty: TensorType) -> Self {
        HostTensor::full(ty, 0.0)
    }

    /// A tensor whose element at row-major position `i` is `f(i)` (rounded to the dtype).
    pub fn from_fn(ty: TensorType, f: impl FnMut(usize) -> f64) -> Self {
        let mut data: Vec<f64> = (0..ty.numel()).map(f).collect();
        round_slice(ty.dtype, &mut data);
        HostTensor { ty, data }
    }

    pub fn shape(&self) -> &[usize] {
        &self.ty.shape
    }

    pub fn dtype(&self) -> DType {
        self.ty.dtype
    }

    /// Logical size at the tensor's dtype, as counted by `RunOutput::peak_bytes`.
    pub fn size_bytes(&self) -> usize {
        self.ty.size_bytes()
    }

    /// The element at multi-index `idx`, or `None` when `idx` has the wrong rank or lies outside
    /// the shape.
    pub fn try_get(&self, idx: &[usize]) -> Option<f64> {
        if idx.len() != self.ty.rank() {
            return None;
        }
        let mut offset = 0;
        for (&i, &d) in idx.iter().zip(&self.ty.shape) {
            if i >= d {
                return None;
            }
            offset = offset * d + i;
        }
        self.data.get(offset).copied()
    }

    /// The element at multi-index `idx`.
    ///
    /// # Panics
    /// When `idx` has the wrong rank or lies outside the shape, like slice indexing.
    pub fn get(&self, idx: &[usize]) -> f64 {
        match self.try_get(idx) {
            Some(v) => v,
            None => panic!("index {idx:?} is out of bounds for {}", self.ty),
        }
    }

    /// The value of a one-element tensor.
    pub fn item(&self) -> Option<f64> {
        match self.data.as_slice() {
            [v] => Some(*v),
            _ => None,
        }
    }

    /// Largest `|a - b|` over the elements (NaN when either side has a NaN at the same place and
    /// the other does not; infinite when the shapes differ).
    pub fn max_abs_diff(&self, other: &HostTensor) -> f64 {
        if self.ty.shape != other.ty.shape {
            return f64::INFINITY;
        }
        self.data.iter().zip(&other.data).fold(0.0, |acc, (a, b)| {
            if a == b || (a.is_nan() && b.is_nan()) {
                acc
            } else {
                BinaryOp::Max.apply(acc, (a - b).abs())
            }
        })
    }
}

/// Rounds `x` to what a `dtype` element can hold: f32 and bf16 round to nearest even (bf16 from
/// the f32 value), integers truncate toward zero (saturating at the type's range, NaN gives 0),
/// bool is `x != 0`.
pub fn round_to_dtype(dtype: DType, x: f64) -> f64 {
    match dtype {
        DType::F64 => x,
        DType::F32 => x as f32 as f64,
        DType::BF16 => round_bf16(x as f32) as f64,
        DType::I64 => x as i64 as f64,
        DType::I32 => x as i32 as f64,
        DType::Bool => {
            if x != 0.0 {
                1.0
            } else {
                0.0
            }
        }
    }
}

/// Rounds an f32 to the nearest bfloat16 (ties to even), returned as the f32 it equals.
#[inline]
pub fn round_bf16(x: f32) -> f32 {
    if x.is_nan() {
        return x;
    }
    let bits = x.to_bits();
    // Adding 0x7FFF plus the lowest kept bit carries into the kept bits exactly when the dropped
    // part is above one half, or exactly one half with an odd kept part. Only NaN bit patterns
    // could wrap around, and they returned above; a carry out of the largest finite values
    // correctly lands on infinity.
    let rounded = bits.wrapping_add(0x7FFF + ((bits >> 16) & 1)) & 0xFFFF_0000;
    f32::from_bits(rounded)
}

pub(crate) fn round_slice(dtype: DType, data: &mut [f64]) {
    if dtype != DType::F64 {
        for x in data {
            *x = round_to_dtype(dtype, *x);
        }
    }
}
