//! The buffer planner: gives every tensor value an offset in one arena so that values alive at the
//! same time never overlap, and reports the arena size (the predicted peak) before anything runs.
//!
//! Lifetimes follow the schedule: a graph input is live for the whole run (a caller writes an
//! input once and may run many times: a forward graph's weights, written before validation and
//! read by every batch, must still be there for the next run); a node's outputs from that node
//! until their last reader, or to the end when they are graph outputs. Parameters and
//! optimizer state are donated: the output that replaces an input takes the input's own bytes
//! (the update happens in place), so the pair is one buffer live for the whole step. A
//! collective's `wait` shares its handle's buffer: the handle reserves the bytes the result
//! arrives in, and the wait computes nothing. Otherwise, reading an operand and writing a result
//! of the same node never share bytes, except through donation, whose ops (AdamW, SGD) read and
//! write each element at the same index.
//!
//! Placement is greedy by size (largest first, lowest offset that fits, as in TFLite's arena
//! planner), aligned. The liveness lower bound (the most bytes live at any node) is reported next
//! to the arena, so fragmentation is visible. Views are not aliased yet: a reshape gets its own
//! buffer, which a real backend would not need.
//!
//! Packs (`packs.rs`): a concat of graph inputs read in place is one buffer holding its parts
//! one after the other (each with the outputs donated into it) and the concat over all of them;
//! a value's offset is its buffer's plus its place in it (`BufferPlan::sub_offset`).

use crate::packs::Pack;
use graphtrain_ir::{Graph, Op, ValueId};
use std::fmt;

/// Where one buffer lives and when.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Placement {
    /// Values stored in this buffer: one, or a donated input and the output that replaces it,
    /// or a pack's parts, their donated outputs and the concat.
    pub values: Vec<ValueId>,
    pub offset: usize,
    pub bytes: usize,
    /// First and last schedule slot the buffer is live in (slot 0 is before node 0, slot i + 1 is
    /// node i).
    pub live: (usize, usize),
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct BufferPlan {
    pub buffers: Vec<Placement>,
    /// For every value, the index of its buffer (`None` for values nothing defines).
    pub buffer_of: Vec<Option<usize>>,
    /// For every value, its bytes from its buffer's start (0 except in packs).
    pub sub_offset: Vec<usize>,
    /// Arena size: the predicted peak of device memory for tensors.
    pub arena_bytes: usize,
    /// The most bytes live at any slot: no plan can use less.
    pub lower_bound: usize,
    pub alignment: usize,
    /// With `Some(w)`, no buffer crosses a multiple of `w` bytes: the arena can be held in
    /// buffers of `w` bytes each (a device whose bindings hold less than the whole arena).
    pub window: Option<usize>,
}

impl BufferPlan {
    pub fn offset_of(&self, v: ValueId) -> Option<usize> {
        self.buffer_of[v.index()].map(|b| self.buffers[b].offset + self.sub_offset[v.index()])
    }
}

impl fmt::Display for BufferPlan {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "arena {} for {} buffers (liveness lower bound {}, +{:.1}%)",
            human(self.arena_bytes),
            self.buffers.len(),
            human(self.lower_bound),
            if self.lower_bound == 0 {
                0.0
            } else {
                100.0 * (self.arena_bytes as f64 / self.lower_bound as f64 - 1.0)
            }
        )?;
        match self.window {
            Some(w) => write!(f, ", in windows of {}", human(w)),
            None => Ok(()),
        }
    }
}

fn human(bytes: usize) -> String {
    const GIB: f64 = 1024.0 * 1024.0 * 1024.0;
    let b = bytes as f64;
    if b >= GIB {
        format!("{:.2} GiB", b / GIB)
    } else {
        format!("{:.2} MiB", b / (1024.0 * 1024.0))
    }
}

fn align_up(x: usize, a: usize) -> usize {
    x.div_ceil(a) * a
}

/// Plans `g`'s buffers with offsets aligned to `alignment` bytes (a power of two), one schedule
/// slot per node, each value stored at its dtype's size.
pub fn plan_buffers(g: &Graph, alignment: usize) -> BufferPlan {
    let slots: Vec<(Vec<ValueId>, Vec<ValueId>)> = g
        .nodes
        .iter()
        .map(|n| (n.inputs.clone(), n.outputs.clone()))
        .collect();
    plan_sized(
        g,
        &slots,
        &|v| g.values[v.index()].size_bytes(),
        alignment,
        None,
        &[],
    )
    .expect("a plan without windows always places every buffer")
}

/// Plans the values a lowered program touches: `slots[i]` is (values read, values written) by
/// launch `i`; every value takes `elem_bytes` per element. Values no slot touches and that are
/// not graph inputs or outputs get no buffer.
pub fn plan_slots(
    g: &Graph,
    slots: &[(Vec<ValueId>, Vec<ValueId>)],
    elem_bytes: usize,
    alignment: usize,
) -> BufferPlan {
    plan_slots_in_windows(g, slots, elem_bytes, alignment, None)
        .expect("a plan without windows always places every buffer")
}

/// As `plan_slots`, with no buffer crossing a multiple of `window` bytes (a multiple of
/// `alignment`) when one is given. Fails, naming the value, when a buffer is larger than a
/// window.
pub fn plan_slots_in_windows(
    g: &Graph,
    slots: &[(Vec<ValueId>, Vec<ValueId>)],
    elem_bytes: usize,
    alignment: usize,
    window: Option<usize>,
) -> Result<BufferPlan, String> {
    plan_sized(
        g,
        slots,
        &|v| g.values[v.index()].numel() * elem_bytes,
        alignment,
        window,
        &[],
    )
}

/// As `plan_slots_in_windows`, with each value's bytes given by `size_of` (a Program whose
/// values are not all 4 bytes an element: `Program::value_bytes`), and each of `packs` one
/// buffer (its parts side by side, the concat over them).
pub fn plan_sized(
    g: &Graph,
    slots: &[(Vec<ValueId>, Vec<ValueId>)],
    size_of: &dyn Fn(ValueId) -> usize,
    alignment: usize,
    window: Option<usize>,
    packs: &[Pack],
) -> Result<BufferPlan, String> {
    assert!(
        alignment.is_power_of_two(),
        "alignment must be a power of two"
    );
    if let Some(w) = window {
        assert!(
            w > 0 && w % alignment == 0,
            "a window must be a positive multiple of the alignment"
        );
    }
    let n_values = g.values.len();
    let end = slots.len() + 1;
    let mut def: Vec<Option<usize>> = vec![None; n_values];
    let mut last: Vec<usize> = vec![0; n_values];
    for i in &g.inputs {
        def[i.value.index()] = Some(0);
    }
    for (k, (reads, writes)) in slots.iter().enumerate() {
        for o in writes {
            // A value written by several launches (the pieces of a concat) lives from the first.
            if def[o.index()].is_none() {
                def[o.index()] = Some(k + 1);
            }
            last[o.index()] = last[o.index()].max(k + 1);
        }
        for v in reads {
            last[v.index()] = last[v.index()].max(k + 1);
        }
    }
    for o in &g.outputs {
        last[o.value.index()] = end;
    }
    for i in &g.inputs {
        last[i.value.index()] = end;
    }

    // One buffer per value, except that a donated output joins its input's buffer and a wait's
    // result its handle's.
    let mut buffer_of: Vec<Option<usize>> = vec![None; n_values];
    let mut buffers: Vec<Placement> = Vec::new();
    for (v, d) in def.iter().enumerate() {
        let Some(d) = d else { continue };
        buffer_of[v] = Some(buffers.len());
        buffers.push(Placement {
            values: vec![ValueId(v as u32)],
            offset: 0,
            bytes: size_of(ValueId(v as u32)),
            live: (*d, last[v].max(*d)),
        });
    }
    // A `wait`'s result is the bytes its collective's handle reserved: the collective writes
    // its result there, and the wait only says when it has arrived.
    let donated = g
        .outputs
        .iter()
        .filter_map(|o| o.donates.map(|d| (d, o.value)));
    let waited = g
        .nodes
        .iter()
        .filter(|n| matches!(n.op, Op::Wait))
        .map(|n| (n.inputs[0], n.outputs[0]));
    for (src, joins) in donated.chain(waited).collect::<Vec<_>>() {
        let (Some(keep), Some(drop)) = (buffer_of[src.index()], buffer_of[joins.index()]) else {
            continue;
        };
        if keep == drop {
            continue;
        }
        let moved = std::mem::take(&mut buffers[drop].values);
        let live = buffers[drop].live;
        let b = &mut buffers[keep];
        b.values.extend(moved.iter().copied());
        b.live = (b.live.0.min(live.0), b.live.1.max(live.1));
        for v in moved {
            buffer_of[v.index()] = Some(keep);
        }
        buffers[drop].bytes = 0;
    }
    // A pack: its first part's buffer takes the other parts' (with what was donated into them)
    // at the bytes after it, and the concat over all of them.
    let mut sub_offset = vec![0usize; n_values];
    for pack in packs {
        let Some(keep) = buffer_of[pack.parts[0].index()] else {
            continue;
        };
        let mut at = buffers[keep].bytes;
        for part in &pack.parts[1..] {
            let Some(drop) = buffer_of[part.index()] else {
                continue;
            };
            let moved = std::mem::take(&mut buffers[drop].values);
            for v in &moved {
                buffer_of[v.index()] = Some(keep);
                sub_offset[v.index()] = at;
            }
            at += buffers[drop].bytes;
            buffers[drop].bytes = 0;
            buffers[keep].values.extend(moved);
        }
        buffers[keep].bytes = at;
        buffers[keep].live = (0, end);
        if let Some(own) = buffer_of[pack.concat.index()].filter(|&b| b != keep) {
            buffers[own].values.clear();
            buffers[own].bytes = 0;
        }
        buffer_of[pack.concat.index()] = Some(keep);
        buffers[keep].values.push(pack.concat);
    }
    // Drop the emptied buffers and renumber.
    let mut renumber = vec![None; buffers.len()];
    let mut kept = Vec::with_capacity(buffers.len());
    for (i, b) in buffers.into_iter().enumerate() {
        if !b.values.is_empty() {
            renumber[i] = Some(kept.len());
            kept.push(b);
        }
    }
    let mut buffers = kept;
    for b in buffer_of.iter_mut() {
        *b = b.and_then(|i| renumber[i]);
    }

    // Greedy by size: the largest buffers claim the lowest offsets first.
    let mut order: Vec<usize> = (0..buffers.len()).collect();
    order.sort_by(|&a, &b| {
        buffers[b]
            .bytes
            .cmp(&buffers[a].bytes)
            .then(buffers[a].live.0.cmp(&buffers[b].live.0))
            .then(a.cmp(&b))
    });
    let mut placed: Vec<usize> = Vec::with_capacity(buffers.len());
    let mut arena = 0;
    for &b in &order {
        let (start, stop) = buffers[b].live;
        let size = align_up(buffers[b].bytes, alignment);
        if let Some(w) = window.filter(|&w| buffers[b].bytes > w) {
            let v = buffers[b].values[0];
            return Err(format!(
                "value {} ({}, {}) is larger than one buffer of {}",
                v.index(),
                g.ty(v),
                human(buffers[b].bytes),
                human(w)
            ));
        }
        // The lowest offset from `at` on where the buffer lies inside one window.
        let within = |at: usize| match window {
            Some(w) if size > 0 && at / w != (at + size - 1) / w => (at / w + 1) * w,
            _ => at,
        };
        // Occupied ranges of placed buffers whose lifetimes intersect this one, by offset.
        let mut busy: Vec<(usize, usize)> = placed
            .iter()
            .map(|&p| &buffers[p])
            .filter(|p| p.live.0 <= stop && start <= p.live.1)
            .map(|p| (p.offset, p.offset + align_up(p.bytes, alignment)))
            .collect();
        busy.sort_unstable();
        // Busy ranges come by start; `offset` only grows, so one pass finds the first fit.
        let mut offset = 0;
        for (lo, hi) in busy {
            if offset + size <= lo {
                break;
            }
            offset = within(offset.max(hi));
        }
        buffers[b].offset = offset;
        arena = arena.max(offset + size);
        placed.push(b);
    }

    let mut delta = vec![0i64; end + 2];
    for b in &buffers {
        delta[b.live.0] += b.bytes as i64;
        delta[b.live.1 + 1] -= b.bytes as i64;
    }
    let mut live = 0i64;
    let mut lower_bound = 0i64;
    for d in delta {
        live += d;
        lower_bound = lower_bound.max(live);
    }

    Ok(BufferPlan {
        buffers,
        buffer_of,
        sub_offset,
        arena_bytes: arena,
        lower_bound: lower_bound as usize,
        alignment,
        window,
    })
}
