//! Captured regions on the cpu backend: launches bound once to the arena and replayed by direct
//! calls into the JIT-compiled kernels, without cubecl's per-launch dispatch.
//!
//! A `KernelCall` is one launch with every argument resolved. The executor either dispatches it
//! through cubecl (`launch_unchecked`: the server looks the kernel up, stages its bindings, queues
//! it to the dispatcher threads; about 350 us per launch here, docs/cubecl-notes.md), or binds it
//! (`bind`): the same kernel is compiled once through the same cubecl compiler, with the same
//! cube dim, vector width and buffer alignment, and its scalar block is laid out with cubecl's own
//! `InfoBuilder`, exactly as `launch_unchecked` registers it. A bound launch then costs one call
//! per unit on the fork-join pool (`pool.rs`).
//!
//! Guarantee: a bound launch runs the same machine code over the same arguments and the same
//! work split as the dispatched one, so replay is bitwise equal to dispatch (tested in
//! tests/backends.rs and by the pipeline gate).

use super::pool::Pool;
use crate::shared::kernel_call::{KernelCall, KernelKey, ARENA_ALIGN};
use crate::RuntimeError;
use cubecl::cpu::CpuCompiler;
use cubecl::ir::{AddressType, ElemType};
use cubecl::prelude::*;
use cubecl::{Compiler, InfoBuilder};
use cubecl_llvm::{PlironData, PlironEngine, PlironOptions};
use std::collections::HashMap;

/// A launch bound to the arena: its compiled kernel and its argument block, ready to call.
#[derive(Clone)]
pub struct BoundLaunch {
    engine: PlironEngine,
    data: PlironData,
    units: u32,
}

impl BoundLaunch {
    /// Runs every unit of the launch on the pool and returns when all are done.
    pub fn run(&self, pool: &Pool) {
        pool.run(self.units as usize, &|u| {
            let mut data = self.data.clone();
            data.set_unit_pos([u as u32, 0, 0]);
            self.engine.run_kernel(&mut data);
        });
    }
}

/// Compiled kernels by what picks them; one JIT compile per distinct kernel, shared by every
/// launch bound to it.
#[derive(Default)]
pub struct KernelCache {
    engines: HashMap<KernelKey, PlironEngine>,
}

impl KernelCache {
    /// Binds `call` to the arena at `base` (`arena_elems` f32 long).
    pub fn bind(
        &mut self,
        call: &KernelCall,
        client: &Client,
        arena: &cubecl::server::Handle,
        base: *mut f32,
        arena_elems: usize,
    ) -> Result<BoundLaunch, RuntimeError> {
        call.check_addressing()?;
        let key = call.key();
        let engine = match self.engines.get(&key) {
            Some(e) => e.clone(),
            None => {
                let kernel = call.kernel(client, arena, arena_elems);
                let compile_error =
                    |e: cubecl::CompilationError| RuntimeError::Backend(format!("{e:?}"));
                let definition = cubecl::define_kernel(kernel.as_ref()).map_err(compile_error)?;
                let options = PlironOptions {
                    cpu_buffer_alignment: Some(ARENA_ALIGN),
                    ..Default::default()
                };
                let engine = CpuCompiler::default()
                    .compile(definition, &options)
                    .map_err(compile_error)?
                    .expect_jit();
                if engine.requirements().needs_parallelism
                    || !engine.requirements().shared_memories.blocks.is_empty()
                {
                    return Err(RuntimeError::Backend(
                        "a replayed kernel may not use cube barriers or shared memory".into(),
                    ));
                }
                self.engines.insert(key, engine.clone());
                engine
            }
        };
        // The argument block, laid out as `launch_unchecked` registers it: each operand's
        // buffer (the arena, for every one of them) and its length in the static metadata, the
        // index scalars at the kernel's 32-bit address width.
        let mut info = InfoBuilder::default();
        let address = AddressType::U32;
        let operands = call.operands().len();
        for _ in 0..operands {
            info.metadata
                .register_buffer(call.buffer_len(arena_elems) as u64, address);
        }
        for &s in call.scalars() {
            // Checked above.
            info.scalars
                .push_raw(&(s as u32).to_ne_bytes(), ElemType::Index);
        }
        let metadata = info.finish(address).data;
        Ok(BoundLaunch {
            engine,
            data: PlironData::new(vec![base.cast(); operands], metadata, [1, 1, 1], Vec::new()),
            units: call.units(),
        })
    }
}
