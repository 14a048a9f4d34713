//! Device meshes and placements: how the values of an SPMD graph, which every rank runs on its
//! own (local) tensors, relate to the global tensors they are parts of.
//!
//! A [`Mesh`] names its dimensions (torchtitan's `dp_replicate`, `dp_shard`, `tp`; `cp`, `pp` and
//! `ep` are accepted names for later) with sizes. Ranks are numbered row-major: the last mesh
//! dimension varies fastest, so on `dp_shard=2,tp=2` ranks 0 and 1 form a `tp` group.
//!
//! A [`Placement`] per mesh dimension says how the ranks along it hold a global tensor:
//! - `shard(d)`: split into equal contiguous blocks along tensor dimension `d`, the block of
//!   coordinate `i` on the rank at `i`; when several mesh dimensions shard the same tensor
//!   dimension, the earlier mesh dimension splits first (its blocks are the outer ones);
//! - `replicate`: every rank holds the whole tensor;
//! - `partial(sum)` / `partial(avg)`: the global tensor is the sum (mean) of the ranks' tensors.
//!
//! Local shapes follow from the global shape and the placements: a tensor dimension sharded over
//! mesh dimensions of sizes `a` and `b` is `a * b` times smaller on each rank.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Mesh dimension names graphtrain knows (torchtitan's).
pub const MESH_DIM_NAMES: [&str; 6] = ["dp_replicate", "dp_shard", "tp", "cp", "pp", "ep"];

#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct MeshDim {
    pub name: String,
    pub size: usize,
}

/// Named dimensions with sizes; the world size is their product.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Mesh {
    pub dims: Vec<MeshDim>,
}

/// How the ranks' partial values combine.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Reduce {
    Sum,
    Avg,
}

impl Reduce {
    pub fn name(self) -> &'static str {
        match self {
            Reduce::Sum => "sum",
            Reduce::Avg => "avg",
        }
    }

    pub fn from_name(s: &str) -> Option<Reduce> {
        match s {
            "sum" => Some(Reduce::Sum),
            "avg" => Some(Reduce::Avg),
            _ => None,
        }
    }
}

/// How the ranks along one mesh dimension hold a global tensor.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum Placement {
    Shard(usize),
    Replicate,
    Partial(Reduce),
}

impl fmt::Display for Placement {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Placement::Shard(d) => write!(f, "shard({d})"),
            Placement::Replicate => f.write_str("replicate"),
            Placement::Partial(r) => write!(f, "partial({})", r.name()),
        }
    }
}

impl Placement {
    /// Reads `shard(D)`, `replicate`, `partial(sum)` or `partial(avg)`.
    pub fn parse(s: &str) -> Result<Placement, String> {
        let s = s.trim();
        let inner = |prefix: &str| {
            s.strip_prefix(prefix)
                .and_then(|r| r.strip_prefix('('))
                .and_then(|r| r.strip_suffix(')'))
                .map(str::trim)
        };
        if s == "replicate" {
            Ok(Placement::Replicate)
        } else if let Some(d) = inner("shard") {
            d.parse()
                .map(Placement::Shard)
                .map_err(|_| format!("`{s}`: shard needs a tensor dimension, as in shard(0)"))
        } else if let Some(r) = inner("partial") {
            Reduce::from_name(r)
                .map(Placement::Partial)
                .ok_or_else(|| format!("`{s}`: partial takes `sum` or `avg`, as in partial(sum)"))
        } else {
            Err(format!(
                "unknown placement `{s}`: expected shard(D), replicate, partial(sum) or partial(avg)"
            ))
        }
    }
}

/// A value's placement on every mesh dimension, in mesh order.
#[derive(Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct Placements(pub Vec<Placement>);

impl fmt::Display for Placements {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("[")?;
        for (i, p) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str(", ")?;
            }
            write!(f, "{p}")?;
        }
        f.write_str("]")
    }
}

impl Placements {
    pub fn replicated(mesh: &Mesh) -> Self {
        Placements(vec![Placement::Replicate; mesh.dims.len()])
    }

    /// How many ways tensor dimension `d` is split (the product of the sizes of the mesh
    /// dimensions that shard it).
    pub fn shard_factor(&self, mesh: &Mesh, d: usize) -> usize {
        self.0
            .iter()
            .zip(&mesh.dims)
            .filter(|(p, _)| **p == Placement::Shard(d))
            .map(|(_, m)| m.size)
            .product()
    }

    /// The local shape of a global tensor of `global` shape, or why it cannot be split so.
    pub fn local_shape(&self, mesh: &Mesh, global: &[usize]) -> Result<Vec<usize>, String> {
        self.check(mesh, global.len())?;
        global
            .iter()
            .enumerate()
            .map(|(d, &n)| {
                let f = self.shard_factor(mesh, d);
                if n.is_multiple_of(f) {
                    Ok(n / f)
                } else {
                    Err(format!(
                        "dimension {d} of size {n} does not split evenly {f} ways ({self} on {mesh})"
                    ))
                }
            })
            .collect()
    }

    /// The global shape of a local tensor of `local` shape.
    pub fn global_shape(&self, mesh: &Mesh, local: &[usize]) -> Vec<usize> {
        (0..local.len())
            .map(|d| local[d] * self.shard_factor(mesh, d))
            .collect()
    }

    /// One placement per mesh dimension, shards within the tensor's rank.
    pub fn check(&self, mesh: &Mesh, rank: usize) -> Result<(), String> {
        if self.0.len() != mesh.dims.len() {
            return Err(format!(
                "{self} has {} placement(s) but the mesh {mesh} has {} dimension(s)",
                self.0.len(),
                mesh.dims.len()
            ));
        }
        for p in &self.0 {
            if let Placement::Shard(d) = p {
                if *d >= rank {
                    return Err(format!("{self}: shard({d}) of a tensor of rank {rank}"));
                }
            }
        }
        Ok(())
    }

    /// The element range along each tensor dimension that `rank` holds of a global tensor of
    /// `global` shape (for `partial` and `replicate` dimensions, all of it).
    pub fn local_block(
        &self,
        mesh: &Mesh,
        global: &[usize],
        rank: usize,
    ) -> Result<Vec<std::ops::Range<usize>>, String> {
        let local = self.local_shape(mesh, global)?;
        let coords = mesh.coords(rank);
        Ok((0..global.len())
            .map(|d| {
                // Earlier mesh dims split first: the block index is row-major over the mesh
                // dims that shard `d`, in mesh order.
                let mut block = 0;
                for (m, p) in self.0.iter().enumerate() {
                    if *p == Placement::Shard(d) {
                        block = block * mesh.dims[m].size + coords[m];
                    }
                }
                block * local[d]..(block + 1) * local[d]
            })
            .collect())
    }
}

impl fmt::Display for Mesh {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, d) in self.dims.iter().enumerate() {
            if i > 0 {
                f.write_str(",")?;
            }
            write!(f, "{}={}", d.name, d.size)?;
        }
        Ok(())
    }
}

impl Mesh {
    /// Reads `dp_shard=2,tp=2`: known dimension names, each once, sizes of at least 1.
    pub fn parse(s: &str) -> Result<Mesh, String> {
        let mut dims: Vec<MeshDim> = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (name, size) = part
                .split_once('=')
                .ok_or_else(|| format!("mesh `{s}`: `{part}` is not NAME=SIZE"))?;
            let (name, size) = (name.trim(), size.trim());
            if !MESH_DIM_NAMES.contains(&name) {
                return Err(format!(
                    "mesh `{s}`: unknown mesh dimension `{name}` (known: {})",
                    MESH_DIM_NAMES.join(", ")
                ));
            }
            if dims.iter().any(|d| d.name == name) {
                return Err(format!("mesh `{s}`: `{name}` is given twice"));
            }
            let size: usize = size.parse().ok().filter(|n| *n >= 1).ok_or_else(|| {
                format!("mesh `{s}`: `{name}` needs a size of at least 1, got `{size}`")
            })?;
            dims.push(MeshDim {
                name: name.to_string(),
                size,
            });
        }
        if dims.is_empty() {
            return Err(format!(
                "mesh `{s}`: no dimensions (write e.g. dp_shard=2,tp=2)"
            ));
        }
        Ok(Mesh { dims })
    }

    pub fn world_size(&self) -> usize {
        self.dims.iter().map(|d| d.size).product()
    }

    /// The index of the dimension called `name`.
    pub fn dim(&self, name: &str) -> Option<usize> {
        self.dims.iter().position(|d| d.name == name)
    }

    /// The size of the dimension called `name`, 1 when the mesh has none.
    pub fn size_of(&self, name: &str) -> usize {
        self.dim(name).map_or(1, |i| self.dims[i].size)
    }

    /// The coordinates of `rank` (row-major: the last dimension varies fastest).
    pub fn coords(&self, rank: usize) -> Vec<usize> {
        let mut coords = vec![0; self.dims.len()];
        let mut r = rank;
        for (i, d) in self.dims.iter().enumerate().rev() {
            coords[i] = r % d.size;
            r /= d.size;
        }
        coords
    }

    pub fn rank_of(&self, coords: &[usize]) -> usize {
        coords
            .iter()
            .zip(&self.dims)
            .fold(0, |r, (c, d)| r * d.size + c)
    }

    /// The ranks that differ from `rank` only along `dims`, ordered by their coordinates there
    /// (row-major in mesh order): the group a collective over `dims` combines. `rank` is at
    /// position `group_index(rank, dims)`.
    pub fn group(&self, rank: usize, dims: &[usize]) -> Vec<usize> {
        let base = self.coords(rank);
        let mut dims = dims.to_vec();
        dims.sort_unstable();
        let size: usize = dims.iter().map(|&d| self.dims[d].size).product();
        (0..size)
            .map(|mut i| {
                let mut c = base.clone();
                for &d in dims.iter().rev() {
                    c[d] = i % self.dims[d].size;
                    i /= self.dims[d].size;
                }
                self.rank_of(&c)
            })
            .collect()
    }

    pub fn group_index(&self, rank: usize, dims: &[usize]) -> usize {
        let coords = self.coords(rank);
        let mut dims = dims.to_vec();
        dims.sort_unstable();
        dims.iter()
            .fold(0, |i, &d| i * self.dims[d].size + coords[d])
    }

    /// The product of the sizes of `dims`.
    pub fn group_size(&self, dims: &[usize]) -> usize {
        dims.iter().map(|&d| self.dims[d].size).product()
    }
}

/// The part of `global` that `rank` holds under `placements` (a `partial` dimension is given as
/// it is to member 0 of its group and as zeros to the others, so the sum is `global`).
pub fn local_part(
    global: &crate::HostTensor,
    placements: &Placements,
    mesh: &Mesh,
    rank: usize,
) -> Result<crate::HostTensor, String> {
    let shape = &global.ty.shape;
    let block = placements.local_block(mesh, shape, rank)?;
    let local: Vec<usize> = block.iter().map(|r| r.len()).collect();
    let strides: Vec<usize> = (0..shape.len())
        .map(|d| shape[d + 1..].iter().product())
        .collect();
    let mut data = Vec::with_capacity(local.iter().product());
    let mut idx = vec![0usize; local.len()];
    let n: usize = local.iter().product();
    let coords = mesh.coords(rank);
    let zero = placements
        .0
        .iter()
        .enumerate()
        .any(|(m, p)| matches!(p, Placement::Partial(_)) && coords[m] != 0);
    for _ in 0..n {
        let flat: usize = (0..idx.len())
            .map(|d| (block[d].start + idx[d]) * strides[d])
            .sum();
        data.push(if zero { 0.0 } else { global.data[flat] });
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if idx[d] < local[d] {
                break;
            }
            idx[d] = 0;
        }
    }
    crate::HostTensor::new(crate::TensorType::new(global.ty.dtype, local), data)
        .map_err(|e| e.to_string())
}

/// The global tensor from every rank's local part (`locals[rank]`): shards are placed at their
/// blocks, replicated parts taken from the rank holding the block (all ranks must agree, which
/// this does not check), `partial` dimensions summed (or averaged) in rank order.
pub fn assemble(
    locals: &[&crate::HostTensor],
    placements: &Placements,
    mesh: &Mesh,
) -> Result<crate::HostTensor, String> {
    let local_shape = &locals[0].ty.shape;
    let global_shape = placements.global_shape(mesh, local_shape);
    let strides: Vec<usize> = (0..global_shape.len())
        .map(|d| global_shape[d + 1..].iter().product())
        .collect();
    let mut data = vec![0.0; global_shape.iter().product()];
    let mut written = vec![false; data.len()];
    let partial: Vec<usize> = (0..mesh.dims.len())
        .filter(|&m| matches!(placements.0[m], Placement::Partial(_)))
        .collect();
    for (rank, t) in locals.iter().enumerate() {
        let coords = mesh.coords(rank);
        // Ranks that only differ along replicated dims hold the same block: take the first.
        let first_copy = placements
            .0
            .iter()
            .enumerate()
            .all(|(m, p)| *p != Placement::Replicate || coords[m] == 0);
        if !first_copy {
            continue;
        }
        let block = placements.local_block(mesh, &global_shape, rank)?;
        let n = t.data.len();
        let mut idx = vec![0usize; local_shape.len()];
        for &v in t.data.iter().take(n) {
            let flat: usize = (0..idx.len())
                .map(|d| (block[d].start + idx[d]) * strides[d])
                .sum();
            if partial.is_empty() {
                data[flat] = v;
            } else {
                data[flat] = if written[flat] { data[flat] + v } else { v };
            }
            written[flat] = true;
            for d in (0..idx.len()).rev() {
                idx[d] += 1;
                if idx[d] < local_shape[d] {
                    break;
                }
                idx[d] = 0;
            }
        }
    }
    let avg: usize = partial
        .iter()
        .filter(|&&m| placements.0[m] == Placement::Partial(Reduce::Avg))
        .map(|&m| mesh.dims[m].size)
        .product();
    if avg > 1 {
        for v in &mut data {
            *v /= avg as f64;
        }
    }
    crate::HostTensor::new(
        crate::TensorType::new(locals[0].ty.dtype, global_shape),
        data,
    )
    .map_err(|e| e.to_string())
}
