//! The one way the root tests compare results: a backend's tensors against the interpreter's
//! (within a relative tolerance) or two runs against each other (bit for bit).
//!
//! Rules, the same for every comparison:
//! - a NaN or an infinity on either side fails, in the bitwise check too (two NaNs are not
//!   "equal results", they are two broken runs);
//! - element counts, shapes and dtypes must match, and so must the number of outputs and their
//!   names: nothing is silently truncated by a `zip`;
//! - "relative" means `|got - want| <= tol * max(|want|, floor)`, where the floor is
//!   `SCALE_FLOOR` times the RMS of the reference tensor: each tensor is compared at its own
//!   scale (AdamW's second moment, about 1e-8, against 1e-8, not against 1), and elements near
//!   zero by cancellation are judged against the size of their tensor rather than their own;
//! - a failure names the output, the element (flat and as an index), both values and the error.

#![allow(dead_code)] // each test crate uses part of it

use graphtrain::ir::HostTensor;

/// The floor of the relative error, as a fraction of the reference tensor's RMS: the tensor's
/// typical magnitude. An element that is small by cancellation carries the rounding of the
/// terms it came from, which are of that magnitude: attention's `dv` (a sum over 131 rows) has
/// elements 1.4e-6 of its RMS off the interpreter on cpu, so a floor of 1% of the RMS would
/// fail f32 rounding at 1e-4. Against the old floor (1, absolute), it is 1/RMS times stricter:
/// 1e8 for AdamW's second moments.
pub const SCALE_FLOOR: f64 = 1.0;

/// How two results must agree.
#[derive(Clone, Copy, Debug)]
pub enum Agree {
    /// The same bits in every element, and every element finite.
    Bitwise,
    /// `|got - want| <= tol * max(|want|, SCALE_FLOOR * rms(want))` at every element, and
    /// every element finite.
    Relative(f64),
}

fn rms(xs: &[f64]) -> f64 {
    if xs.is_empty() {
        return 0.0;
    }
    (xs.iter().map(|x| x * x).sum::<f64>() / xs.len() as f64).sqrt()
}

/// The multi-index of flat element `i` in a row-major `shape`.
fn index_of(mut i: usize, shape: &[usize]) -> Vec<usize> {
    let mut idx = vec![0; shape.len()];
    for (slot, &d) in idx.iter_mut().zip(shape).rev() {
        if d > 0 {
            *slot = i % d;
            i /= d;
        }
    }
    idx
}

/// Compares the values of one tensor of `shape` named `name`; `want` is the reference.
pub fn compare_values(
    name: &str,
    shape: &[usize],
    got: &[f64],
    want: &[f64],
    how: Agree,
) -> Result<(), String> {
    if got.len() != want.len() {
        return Err(format!(
            "`{name}`: {} elements, the reference has {}",
            got.len(),
            want.len()
        ));
    }
    let at = |i: usize| format!("`{name}` element {i} {:?}", index_of(i, shape));
    if let Some(i) = (0..got.len()).find(|&i| !got[i].is_finite() || !want[i].is_finite()) {
        return Err(format!(
            "{}: got {:e}, want {:e}: not finite",
            at(i),
            got[i],
            want[i]
        ));
    }
    match how {
        Agree::Bitwise => {
            let bad: Vec<usize> = (0..got.len())
                .filter(|&i| got[i].to_bits() != want[i].to_bits())
                .collect();
            if let Some(&i) = bad.first() {
                return Err(format!(
                    "{}: got {:e}, want {:e}: not bitwise equal ({} of {} elements differ)",
                    at(i),
                    got[i],
                    want[i],
                    bad.len(),
                    got.len()
                ));
            }
        }
        Agree::Relative(tol) => {
            let floor = SCALE_FLOOR * rms(want);
            let err = |i: usize| (got[i] - want[i]).abs() / want[i].abs().max(floor);
            let bad: Vec<usize> = (0..got.len())
                .filter(|&i| (got[i] - want[i]).abs() > tol * want[i].abs().max(floor))
                .collect();
            if !bad.is_empty() {
                let worst = bad
                    .iter()
                    .copied()
                    .max_by(|&a, &b| err(a).total_cmp(&err(b)))
                    .unwrap();
                return Err(format!(
                    "{}: got {:e}, want {:e}: relative error {:e} > {tol:e} (floor {floor:e} = \
{SCALE_FLOOR} x rms of the reference; {} of {} elements over)",
                    at(worst),
                    got[worst],
                    want[worst],
                    err(worst),
                    bad.len(),
                    got.len()
                ));
            }
        }
    }
    Ok(())
}

/// Compares one tensor: dtype and shape, then values.
pub fn compare_tensor(
    name: &str,
    got: &HostTensor,
    want: &HostTensor,
    how: Agree,
) -> Result<(), String> {
    if got.ty != want.ty {
        return Err(format!(
            "`{name}`: got a {} tensor, the reference is {}",
            got.ty, want.ty
        ));
    }
    compare_values(name, &got.ty.shape, &got.data, &want.data, how)
}

/// Compares a run's outputs, named `names` in order, against the reference's: the three lists
/// must have the same length.
pub fn compare_outputs(
    names: &[String],
    got: &[HostTensor],
    want: &[HostTensor],
    how: Agree,
) -> Result<(), String> {
    if got.len() != want.len() || names.len() != want.len() {
        return Err(format!(
            "{} outputs, the reference has {} ({} names)",
            got.len(),
            want.len(),
            names.len()
        ));
    }
    let errors: Vec<String> = names
        .iter()
        .zip(got)
        .zip(want)
        .filter_map(|((name, g), w)| compare_tensor(name, g, w, how).err())
        .collect();
    joined(errors)
}

/// `Ok` when there is no error, else every error, one per line.
fn joined(errors: Vec<String>) -> Result<(), String> {
    if errors.is_empty() {
        Ok(())
    } else {
        Err(errors.join("\n"))
    }
}

/// Compares named tensors (parameters and optimizer state) against the reference's: the same
/// names in the same order, each compared as `compare_tensor` does.
pub fn compare_named(
    got: &[(String, HostTensor)],
    want: &[(String, HostTensor)],
    how: Agree,
) -> Result<(), String> {
    let names = |s: &[(String, HostTensor)]| s.iter().map(|(n, _)| n.clone()).collect::<Vec<_>>();
    if names(got) != names(want) {
        return Err(format!(
            "tensors {:?}, the reference has {:?}",
            names(got),
            names(want)
        ));
    }
    let errors: Vec<String> = got
        .iter()
        .zip(want)
        .filter_map(|((name, g), (_, w))| compare_tensor(name, g, w, how).err())
        .collect();
    joined(errors)
}
