//! `KernelCall`: one launch of a shared kernel (`kernels.rs`) with every argument resolved,
//! as `launches.rs` computes it for a step. Every backend can dispatch it through cubecl
//! (`dispatch`); the cpu backend can also bind it once and replay it (`cpu/replay.rs`), for
//! which it hands out the kernel object cubecl would compile (`kernel`) and the key that tells
//! kernels apart (`key`).

use crate::shared::kernels::{
    copy_kernel, map_kernel, reduce_cols_kernel, reduce_kernel, MODE_FULL, REDUCE_MAX,
    REDUCE_OUTER, REDUCE_SUM,
};
use crate::RuntimeError;
use cubecl::prelude::*;
use cubecl::CubeKernel;
use graphtrain_lowering::Expr;

/// The arena's base alignment, which the kernels are compiled for (cubecl-cpu compiles a launch
/// whose buffers start at their allocation for its storage alignment, 64 bytes).
pub(crate) const ARENA_ALIGN: u32 = 64;

/// Calls `f(pre.., args[0], .., args[N - 1], post..)`: the launch and the kernel-object
/// constructors take the scalar arguments one by one, in the kernel's parameter order.
macro_rules! spread {
    ($f:path, [$($pre:expr),*], $args:ident[0..18], [$($post:expr),*]) => {
        spread!(@call $f, [$($pre),*], $args, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [$($post),*])
    };
    ($f:path, [$($pre:expr),*], $args:ident[0..14], [$($post:expr),*]) => {
        spread!(@call $f, [$($pre),*], $args, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13], [$($post),*])
    };
    ($f:path, [$($pre:expr),*], $args:ident[0..12], [$($post:expr),*]) => {
        spread!(@call $f, [$($pre),*], $args, [0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [$($post),*])
    };
    (@call $f:path, [$($pre:expr),*], $args:ident, [$($i:literal),*], [$($post:expr),*]) => {
        $f($($pre,)* $($args[$i],)* $($post),*)
    };
}

/// Cubes and units per cube for a launch of `units` units: one cube of up to 256 units (every
/// cpu launch: a unit is a worker thread), else cubes of 64 (`units` is then a multiple of 64).
pub fn grid(units: u32) -> (CubeCount, CubeDim) {
    if units <= 256 {
        (CubeCount::Static(1, 1, 1), CubeDim::new_1d(units))
    } else {
        (CubeCount::Static(units / 64, 1, 1), CubeDim::new_1d(64))
    }
}

/// A buffer an operand is bound to: its handle, its length in f32 elements, and the arena
/// element its first element holds (0 where one buffer holds the whole arena).
#[derive(Clone)]
pub struct Binding {
    pub handle: cubecl::server::Handle,
    pub elems: usize,
    pub base: usize,
}

/// One kernel launch, fully resolved. The scalar arguments are in the kernel's parameter order
/// (see `kernels.rs`).
#[derive(Clone, Debug)]
pub enum KernelCall {
    Map {
        width: usize,
        units: u32,
        modes: u32,
        expr: Expr,
        args: [usize; 18],
    },
    Copy {
        units: u32,
        args: [usize; 14],
    },
    /// `width` 1: `reduce_kernel`; wider: `reduce_cols_kernel` at that vector width (never
    /// with `rows`), every argument in vectors.
    Reduce {
        width: usize,
        units: u32,
        is_max: bool,
        rows: bool,
        args: [usize; 12],
    },
}

/// What picks a compiled kernel: the comptime arguments, the vector width and the cube dim.
#[derive(Clone, PartialEq, Eq, Hash)]
pub(crate) enum KernelKey {
    Map {
        width: usize,
        units: u32,
        modes: u32,
        expr: Expr,
    },
    Copy {
        units: u32,
    },
    Reduce {
        width: usize,
        units: u32,
        is_max: bool,
        rows: bool,
    },
}

impl KernelCall {
    pub(crate) fn key(&self) -> KernelKey {
        match self {
            KernelCall::Map {
                width,
                units,
                modes,
                expr,
                ..
            } => KernelKey::Map {
                width: *width,
                units: *units,
                modes: *modes,
                expr: expr.clone(),
            },
            KernelCall::Copy { units, .. } => KernelKey::Copy { units: *units },
            KernelCall::Reduce {
                width,
                units,
                is_max,
                rows,
                ..
            } => KernelKey::Reduce {
                width: *width,
                units: *units,
                is_max: *is_max,
                rows: *rows,
            },
        }
    }

    pub(crate) fn units(&self) -> u32 {
        match self {
            KernelCall::Map { units, .. }
            | KernelCall::Copy { units, .. }
            | KernelCall::Reduce { units, .. } => *units,
        }
    }

    pub(crate) fn scalars(&self) -> &[usize] {
        match self {
            KernelCall::Map { args, .. } => args,
            KernelCall::Copy { args, .. } => args,
            KernelCall::Reduce { args, .. } => args,
        }
    }

    /// Elements of a bound buffer of `elems` f32, in the kernel's element type (vectors for a
    /// map or a column reduction).
    pub(crate) fn buffer_len(&self, elems: usize) -> usize {
        match self {
            KernelCall::Map { width, .. } | KernelCall::Reduce { width, .. } => elems / width,
            KernelCall::Copy { .. } => elems,
        }
    }

    /// The operands, in the kernel's binding order (a map's six inputs then its output; a copy's
    /// or a reduction's source then its output): the index of the scalar argument holding each
    /// one's offset, and the elements one unit of that offset counts (a vector for a map's full
    /// inputs and output and for a column reduction, else one element). A map's unused inputs
    /// name offset 0.
    pub(crate) fn operands(&self) -> Vec<(usize, usize)> {
        match self {
            KernelCall::Map { width, modes, .. } => {
                let mut ops: Vec<(usize, usize)> = (0..6)
                    .map(|k| {
                        let full = (modes >> (2 * k)) & 3 == MODE_FULL;
                        (k as usize, if full { *width } else { 1 })
                    })
                    .collect();
                ops.push((16, *width));
                ops
            }
            KernelCall::Copy { .. } => vec![(12, 1), (13, 1)],
            KernelCall::Reduce { width, .. } => vec![(10, *width), (11, *width)],
        }
    }

    /// The call's buffers and scalar arguments with every operand bound where `locate` puts it:
    /// `locate(e)` is the buffer holding arena element `e`, and the operand's offset becomes
    /// one inside that buffer.
    fn bind_operands(&self, locate: &dyn Fn(usize) -> Binding) -> (Vec<Binding>, Vec<usize>) {
        let mut args = self.scalars().to_vec();
        let buffers = self
            .operands()
            .into_iter()
            .map(|(arg, unit)| {
                let binding = locate(args[arg] * unit);
                args[arg] -= binding.base / unit;
                binding
            })
            .collect();
        (buffers, args)
    }

    /// At most how many loop trips one unit of this launch takes (every loop of the kernel
    /// counted, as llvmpipe counts them: `kernels::LOOP_BUDGET`). An upper bound, from the
    /// kernels' loops in `kernels.rs`.
    pub fn loop_trips(&self) -> usize {
        let units = self.units().max(1) as usize;
        // A unit's share of `n` items, in whole multiples of `m` (`unit_span`).
        let share = |n: usize, m: usize| n.div_ceil(units).div_ceil(m) * m;
        match self {
            KernelCall::Map {
                width, modes, args, ..
            } => {
                let (l, len) = (args[15], args[17]);
                if modes & (REDUCE_SUM | REDUCE_MAX) == 0 {
                    share(len, 1)
                } else if modes & REDUCE_OUTER != 0 {
                    // Groups of `OUTER_GROUP` output vectors, then one pass per leftover:
                    // a pass over the rows per group and per leftover.
                    let span = share(l / width, 1);
                    (span / 8 + span % 8) * (len + 1) + 1
                } else {
                    // Four blocks of eight per trip, then up to three more.
                    share(len, *width) * (l / 32 + 4)
                }
            }
            KernelCall::Copy { args, .. } => {
                let (len, n3) = (args[0], args[3].max(1));
                share(len / n3, 1) * (n3 + 1)
            }
            KernelCall::Reduce {
                width, rows, args, ..
            } => {
                let (len, m0, m1) = (args[0], args[6], args[7]);
                // Each output's own trip, and its loops'.
                let per_output = if *width == 1 && *rows {
                    1 + m1 / 32 + 3 + 7
                } else {
                    1 + m0 * (m1 + 1)
                };
                share(len, 1) * per_output
            }
        }
    }

    /// Every scalar argument fits the kernels' 32-bit addressing (cubecl would panic on one that
    /// does not).
    pub fn check_addressing(&self) -> Result<(), RuntimeError> {
        self.check_args(self.scalars())
    }

    fn check_args(&self, args: &[usize]) -> Result<(), RuntimeError> {
        match args.iter().find(|&&s| u32::try_from(s).is_err()) {
            None => Ok(()),
            Some(s) => Err(RuntimeError::Backend(format!(
                "kernel argument {s} does not fit the kernels' 32-bit addressing ({self:?})"
            ))),
        }
    }

    /// Queues the launch through cubecl's launch path, each operand bound to the buffer
    /// `locate` says holds it; refused where an argument, its offsets inside their buffers,
    /// does not fit the kernels' 32-bit addressing.
    ///
    /// # Safety
    /// Every offset the arguments name must lie inside the buffer holding it, and every
    /// operand must lie wholly in one buffer (the planner places them so).
    pub unsafe fn dispatch(
        &self,
        client: &Client,
        locate: &dyn Fn(usize) -> Binding,
    ) -> Result<(), RuntimeError> {
        let (count, dim) = grid(self.units());
        let (buffers, args) = self.bind_operands(locate);
        self.check_args(&args)?;
        // SAFETY: forwarded from the caller.
        let arg = |k: usize| unsafe {
            BufferArg::from_raw_parts(buffers[k].handle.clone(), self.buffer_len(buffers[k].elems))
        };
        // SAFETY: forwarded from the caller.
        unsafe {
            match self {
                KernelCall::Map {
                    width,
                    units: _,
                    modes,
                    expr,
                    ..
                } => spread!(
                    map_kernel::launch_unchecked,
                    [
                        client,
                        count,
                        dim,
                        *width,
                        arg(0),
                        arg(1),
                        arg(2),
                        arg(3),
                        arg(4),
                        arg(5),
                        arg(6)
                    ],
                    args[0..18],
                    [*modes, expr.clone()]
                ),
                KernelCall::Copy { .. } => spread!(
                    copy_kernel::launch_unchecked,
                    [client, count, dim, arg(0), arg(1)],
                    args[0..14],
                    []
                ),
                KernelCall::Reduce {
                    width: 1,
                    units: _,
                    is_max,
                    rows,
                    ..
                } => spread!(
                    reduce_kernel::launch_unchecked,
                    [client, count, dim, arg(0), arg(1)],
                    args[0..12],
                    [*is_max, *rows]
                ),
                KernelCall::Reduce {
                    width,
                    units: _,
                    is_max,
                    ..
                } => spread!(
                    reduce_cols_kernel::launch_unchecked,
                    [client, count, dim, *width, arg(0), arg(1)],
                    args[0..12],
                    [*is_max]
                ),
            }
        }
        Ok(())
    }

    /// The kernel object the same launch would hand to the server, for compiling it ourselves:
    /// the macro-generated `create_dummy_kernel` registers the arguments exactly as
    /// `launch_unchecked` does.
    pub(crate) fn kernel(
        &self,
        client: &Client,
        arena: &cubecl::server::Handle,
        arena_elems: usize,
    ) -> Box<dyn CubeKernel> {
        let (props, target) = (
            client.properties_shared(),
            client.target_properties_shared(),
        );
        let count = CubeCount::Static(1, 1, 1);
        // SAFETY: the buffers are only used to compile the kernel; nothing is launched with
        // them.
        let buffer =
            || unsafe { BufferArg::from_raw_parts(arena.clone(), self.buffer_len(arena_elems)) };
        match self {
            KernelCall::Map {
                width,
                units,
                modes,
                expr,
                args,
            } => Box::new(spread!(
                map_kernel::create_dummy_kernel,
                [
                    props,
                    target,
                    count,
                    CubeDim::new_1d(*units),
                    *width,
                    buffer(),
                    buffer(),
                    buffer(),
                    buffer(),
                    buffer(),
                    buffer(),
                    buffer()
                ],
                args[0..18],
                [*modes, expr.clone()]
            )),
            KernelCall::Copy { units, args } => Box::new(spread!(
                copy_kernel::create_dummy_kernel,
                [
                    props,
                    target,
                    count,
                    CubeDim::new_1d(*units),
                    buffer(),
                    buffer()
                ],
                args[0..14],
                []
            )),
            KernelCall::Reduce {
                width: 1,
                units,
                is_max,
                rows,
                args,
            } => Box::new(spread!(
                reduce_kernel::create_dummy_kernel,
                [
                    props,
                    target,
                    count,
                    CubeDim::new_1d(*units),
                    buffer(),
                    buffer()
                ],
                args[0..12],
                [*is_max, *rows]
            )),
            KernelCall::Reduce {
                width,
                units,
                is_max,
                args,
                ..
            } => Box::new(spread!(
                reduce_cols_kernel::create_dummy_kernel,
                [
                    props,
                    target,
                    count,
                    CubeDim::new_1d(*units),
                    *width,
                    buffer(),
                    buffer()
                ],
                args[0..12],
                [*is_max]
            )),
        }
    }
}
