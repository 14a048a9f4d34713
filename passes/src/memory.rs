//! Liveness-based prediction of device memory for a graph run in schedule order.
//!
//! Not a pass: an analysis that activation-memory passes (`ac`, `offload`) use to report what they
//! bought, and that anyone can call on a graph.
//!
//! Model (one buffer per value, no fragmentation, no aliasing except donation):
//! - a node's outputs are allocated when it runs, and every operand it reads is still live then;
//! - a node output lives from its node to its last reader, or to the end when it is a graph
//!   output; an output nothing reads still occupies memory while its node runs;
//! - a graph input lives from the start. The caller owns it, so the step cannot free it: it lives
//!   to the end, unless an output donates it. Then its buffer becomes the donating output's
//!   (written in place), so it is counted up to the node that writes the replacement and the
//!   output is counted from that node on, never both at once;
//! - outputs of `offload` nodes live in host memory: they count in `host_bytes` and never in the
//!   device figures.
//!
//! Bytes are numel × dtype size. The figures are a prediction for a backend that frees a buffer
//! right after its last reader; a caching allocator or fragmentation adds to them.

use graphtrain_ir::{Graph, InputKind, Op, Phase};

/// What [`profile`] predicts for one graph.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct MemoryProfile {
    /// The most device bytes live at once.
    pub peak_bytes: usize,
    /// The node during which the peak is reached (`None` for a graph without nodes, whose peak is
    /// its inputs).
    pub peak_node: Option<usize>,
    /// Device bytes live while each node runs, in schedule order.
    pub live_bytes: Vec<usize>,
    /// Values made by forward/loss nodes that backward/optimizer nodes read (the definition of
    /// `graphtrain_ir::stats`; values on the host count here too).
    pub saved_activation_bytes: usize,
    /// Of `saved_activation_bytes`, the part held on the device (not behind an `offload`).
    pub saved_device_bytes: usize,
    pub param_bytes: usize,
    pub state_bytes: usize,
    /// Data inputs (tokens, targets, scalars).
    pub input_bytes: usize,
    /// Bytes of every value an `offload` node moves to host memory.
    pub host_bytes: usize,
}

/// Predicts the device memory of `g` run in schedule order (see the module docs for the model).
pub fn profile(g: &Graph) -> MemoryProfile {
    let n = g.nodes.len();
    let producers = g.producers();
    let users = g.users();
    let size = |v: usize| g.values[v].size_bytes();
    let on_host: Vec<bool> = (0..g.values.len())
        .map(|v| producers[v].is_some_and(|p| g.nodes[p].op == Op::Offload))
        .collect();

    let mut p = MemoryProfile::default();
    for i in &g.inputs {
        let b = size(i.value.index());
        match i.kind {
            InputKind::Param => p.param_bytes += b,
            InputKind::State => p.state_bytes += b,
            InputKind::Data => p.input_bytes += b,
        }
    }

    // Live range [start, end] of every value, in node steps; `None` for values nothing defines
    // and for host values.
    let last = n.saturating_sub(1);
    let mut range: Vec<Option<(usize, usize)>> = vec![None; g.values.len()];
    let mut is_output = vec![false; g.values.len()];
    for o in &g.outputs {
        is_output[o.value.index()] = true;
    }
    for (v, prod) in producers.iter().enumerate() {
        let Some(def) = *prod else { continue };
        if on_host[v] {
            continue;
        }
        let end = if is_output[v] {
            last
        } else {
            users[v].last().copied().unwrap_or(def).max(def)
        };
        range[v] = Some((def, end));
    }
    let mut static_bytes = 0usize;
    for i in &g.inputs {
        let v = i.value.index();
        let donated_at = g
            .outputs
            .iter()
            .find(|o| o.donates == Some(i.value))
            .and_then(|o| producers[o.value.index()]);
        match donated_at {
            // The replacement takes over the buffer at its node; before that the input holds it.
            Some(0) => {}
            Some(d) => range[v] = Some((0, d - 1)),
            None if n == 0 => static_bytes += size(v),
            None => range[v] = Some((0, last)),
        }
    }

    // Sweep with a difference array: +size at start, -size after end.
    let mut delta = vec![0i64; n + 1];
    for (v, r) in range.iter().enumerate() {
        if let Some((s, e)) = *r {
            delta[s] += size(v) as i64;
            delta[e + 1] -= size(v) as i64;
        }
    }
    let mut live = 0i64;
    p.live_bytes = Vec::with_capacity(n);
    for (i, d) in delta.iter().take(n).enumerate() {
        live += d;
        let bytes = live as usize;
        p.live_bytes.push(bytes);
        if p.peak_node.is_none() || bytes > p.peak_bytes {
            p.peak_bytes = bytes;
            p.peak_node = Some(i);
        }
    }
    if n == 0 {
        p.peak_bytes = static_bytes;
    }

    for (v, prod) in producers.iter().enumerate() {
        let Some(def) = *prod else { continue };
        if on_host[v] {
            p.host_bytes += size(v);
        }
        if g.nodes[def].meta.phase > Phase::Loss {
            continue;
        }
        if users[v]
            .iter()
            .any(|&u| g.nodes[u].meta.phase >= Phase::Backward)
        {
            p.saved_activation_bytes += size(v);
            if !on_host[v] {
                p.saved_device_bytes += size(v);
            }
        }
    }
    p
}

/// `1234567` -> `1.18 MiB`, for reports.
pub fn human_bytes(bytes: usize) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut x = bytes as f64;
    let mut unit = 0;
    while x >= 1024.0 && unit + 1 < UNITS.len() {
        x /= 1024.0;
        unit += 1;
    }
    if unit == 0 {
        format!("{bytes} B")
    } else {
        format!("{x:.2} {}", UNITS[unit])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use graphtrain_ir::text::parse;

    fn prof(src: &str) -> MemoryProfile {
        let g = parse(src).unwrap();
        graphtrain_ir::verify(&g).unwrap();
        profile(&g)
    }

    #[test]
    fn chain_frees_values_after_their_last_reader() {
        // x: 16 B lives throughout (caller-owned). %1 (16 B) dies at node 1, %2 (16 B) at node 2,
        // %3 is the output.
        let p = prof(
            "graph g {
  input %x: f32[4]
  %1: f32[4] = exp(%x)  # fwd
  %2: f32[4] = neg(%1)  # fwd
  %3: f32[4] = mul(%2, %x)  # fwd
  output y = %3
}",
        );
        assert_eq!(p.live_bytes, vec![32, 48, 48]);
        assert_eq!(p.peak_bytes, 48);
        assert_eq!(p.peak_node, Some(1));
        assert_eq!(p.input_bytes, 16);
        assert_eq!(p.saved_activation_bytes, 0);
    }

    #[test]
    fn saved_activations_live_across_the_phase_boundary() {
        // %1 (f32[8] = 32 B) is made in forward and read in backward: a saved activation, live
        // from node 0 to node 3. %2 (32 B) dies at node 2. Node 2 holds x, %1, %2 and %3.
        let p = prof(
            "graph g {
  input %x: f32[8]
  %1: f32[8] = exp(%x)  # fwd
  %2: f32[8] = neg(%1)  # fwd
  %3: f32[] = reduce_sum(%2, axes=[0], keepdim=false)  # loss
  %4: f32[8] = mul(%1, %1)  # bwd
  output loss = %3
  output g = %4
}",
        );
        assert_eq!(p.live_bytes, vec![64, 96, 100, 100]);
        assert_eq!(p.peak_bytes, 100);
        assert_eq!(p.peak_node, Some(2));
        assert_eq!(p.saved_activation_bytes, 32);
        assert_eq!(p.saved_device_bytes, 32);
    }

    #[test]
    fn donated_inputs_share_the_output_buffer() {
        // w (16 B) is donated to %3: counted up to node 1, then %3 takes its buffer. Never 32 B of
        // w and w' together; the grad %2 is freed at node 1.
        let p = prof(
            "graph g {
  param %w: f32[4]
  input %lr: f32[]
  %2: f32[4] = exp(%w)  # bwd
  %3: f32[4] = sgd(%w, %2, %lr, weight_decay=0.0)  # opt
  output w = %3 donates %w
}",
        );
        assert_eq!(p.param_bytes, 16);
        assert_eq!(p.input_bytes, 4);
        // node 0: w + lr + %2; node 1: lr + %2 + %3 (w's buffer).
        assert_eq!(p.live_bytes, vec![36, 36]);
        assert_eq!(p.peak_bytes, 36);
    }

    #[test]
    fn offloaded_values_count_on_the_host() {
        // %1 (64 B) moves to the host after its forward reader; the host copy (%3) is not on the
        // device, and the reload (%5) lives only around its backward reader.
        let p = prof(
            "graph g {
  input %x: f32[16]
  %1: f32[16] = exp(%x)  # fwd
  %2: f32[] = reduce_sum(%1, axes=[0], keepdim=false)  # fwd
  %3: f32[16] = offload(%1)  # fwd
  %4: f32[16] = neg(%x)  # bwd
  %5: f32[16] = reload(%3)  # bwd
  %6: f32[16] = mul(%5, %4)  # bwd
  output loss = %2
  output g = %6
}",
        );
        assert_eq!(p.host_bytes, 64);
        assert_eq!(p.saved_activation_bytes, 64);
        assert_eq!(p.saved_device_bytes, 0);
        // x 64 throughout; %1 64 at nodes 0-2; %2 4 from node 1; %4 64 from node 3; %5 64 from 4;
        // %6 64 at node 5.
        assert_eq!(p.live_bytes, vec![128, 132, 132, 132, 196, 260]);
        assert_eq!(p.peak_node, Some(5));
    }

    #[test]
    fn a_graph_without_nodes_peaks_at_its_inputs() {
        let p = prof(
            "graph g {
  input %x: f32[4]
  output y = %x
}",
        );
        assert_eq!(p.peak_bytes, 16);
        assert_eq!(p.peak_node, None);
    }

    #[test]
    fn human_bytes_picks_a_unit() {
        assert_eq!(human_bytes(512), "512 B");
        assert_eq!(human_bytes(3 * 1024 * 1024), "3.00 MiB");
    }
}
