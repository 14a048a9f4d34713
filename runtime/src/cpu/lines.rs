//! Scratch buffers that start on a cache line, for packed GEMM operands (f32 and bf16) and
//! attention's scores.
//!
//! Why: a Vec of u32 or f32 starts where the allocator puts it (16 bytes aligned, in practice),
//! so every 64-byte row of an AMX tile straddled two cache lines. On the Xeon with AMX,
//! `tileloadd` of a 1 KiB tile took 15 ns from such a buffer and 2.3 ns from one that starts
//! on a line, and the GEMM's 32 x 32 block ran at 1.0 against 2.6 TFLOP/s a core (`amx_probe`,
//! docs/benchmarks.md).

/// One cache line: the unit a `LineBuffer` is allocated in.
#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u32; 16]);

/// Elements a line holds (u32 or f32).
const LANES: usize = 16;

/// A growable buffer of 4-byte elements whose first element starts a cache line. Its contents
/// are stale between uses (whatever the last user left): every user writes what it reads.
#[derive(Default)]
pub struct LineBuffer {
    lines: Vec<Line>,
}

impl LineBuffer {
    pub const fn new() -> LineBuffer {
        LineBuffer { lines: Vec::new() }
    }

    /// Grows the buffer to at least `len` elements (new lines zeroed, old ones kept).
    fn reserve(&mut self, len: usize) {
        let lines = len.div_ceil(LANES);
        if self.lines.len() < lines {
            self.lines.resize(lines, Line([0; LANES]));
        }
    }

    /// The first `len` elements as u32, grown where needed.
    pub fn u32s(&mut self, len: usize) -> &mut [u32] {
        self.reserve(len);
        // SAFETY: the lines are `len` or more initialized u32, contiguous (`repr(C)` arrays of
        // u32 with no padding: 64 bytes each, aligned to 64).
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr() as *mut u32, len) }
    }

    /// The first `len` elements as f32 (the bits of what was stored), grown where needed.
    pub fn f32s(&mut self, len: usize) -> &mut [f32] {
        self.reserve(len);
        // SAFETY: as `u32s`: every bit pattern of a u32 is an f32.
        unsafe { std::slice::from_raw_parts_mut(self.lines.as_mut_ptr() as *mut f32, len) }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn buffers_start_on_a_line_and_keep_their_contents_as_they_grow() {
        let mut b = LineBuffer::new();
        for (i, x) in b.u32s(5).iter_mut().enumerate() {
            *x = i as u32 + 1;
        }
        let grown = b.u32s(1000);
        assert_eq!(grown.as_ptr() as usize % 64, 0);
        assert_eq!(&grown[..5], &[1, 2, 3, 4, 5]);
        assert_eq!(b.f32s(17).as_ptr() as usize % 64, 0);
        assert_eq!(b.f32s(3)[1].to_bits(), 2);
    }
}
