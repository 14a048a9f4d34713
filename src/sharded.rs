//! Sharded checkpoints: what the ranks of an MPI job save, each its own parts, so that no rank
//! holds a whole model to write one.
//!
//! Layout: a directory holding `manifest.json` and one folder per saved step,
//! `step-NNNNNNNNN/rank-R.safetensors`: each rank's file is an ordinary checkpoint (see
//! `checkpoint`) of that rank's parts, with their local types. A save writes every rank's file
//! (atomically), the ranks agree that all succeeded, then rank 0 writes the manifest
//! (atomically), which names the folder, the mesh and every tensor's placement: the manifest is
//! the commit. A checkpoint without its manifest is not a checkpoint, and a crash while the
//! ranks write leaves the previous manifest, and the folder it names, untouched; older folders
//! are removed only after the new manifest is in place.
//!
//! Loading whole tensors (`load`) reads every rank's file (each verified as any checkpoint is)
//! and assembles them by their placements, so a sharded checkpoint resumes on any mesh,
//! launcher or one device (resharding on load). A rank of an MPI run reads only what it holds
//! (`load_parts`): the rank files whose blocks meet its own, one copy of each replicated block.

use crate::checkpoint::{self, Checkpoint, TensorEntry};
use graphtrain_ir::mesh::assemble;
use graphtrain_ir::{HostTensor, Mesh, Placement, Placements};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// `manifest.json`'s `format`.
const FORMAT: &str = "graphtrain-sharded-checkpoint";
pub(crate) const MANIFEST: &str = "manifest.json";

/// What commits a sharded checkpoint.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Manifest {
    pub format: String,
    /// The folder of this checkpoint's rank files, relative to the directory.
    pub folder: String,
    /// The mesh the ranks ran on (`dp_shard=2,tp=2`); rank `r` wrote `rank-r.safetensors`.
    pub mesh: String,
    pub steps_done: u64,
    /// Every tensor's placement on the mesh, one per mesh dimension (`shard(0)`, `replicate`).
    pub placements: BTreeMap<String, Vec<String>>,
}

/// The folder a save after `steps_done` steps writes its rank files into.
pub fn folder(steps_done: u64) -> String {
    format!("step-{steps_done:09}")
}

fn rank_file(dir: &Path, folder: &str, rank: usize) -> PathBuf {
    dir.join(folder).join(format!("rank-{rank}.safetensors"))
}

/// Writes rank `rank`'s parts of a save after `part.header.steps_done` steps.
pub fn save_part(dir: &Path, rank: usize, part: &Checkpoint) -> Result<(), String> {
    let folder = folder(part.header.steps_done);
    let path = rank_file(dir, &folder, rank);
    if dir.is_file() {
        return Err(format!(
            "--checkpoint {}: a sharded checkpoint is a directory, and this is a file",
            dir.display()
        ));
    }
    std::fs::create_dir_all(dir.join(&folder))
        .map_err(|e| format!("cannot create `{}`: {e}", dir.join(&folder).display()))?;
    checkpoint::save(&path, part)
}

/// Commits the save the ranks' files hold (rank 0, once every rank's `save_part` succeeded),
/// then removes the folders of older saves.
pub fn commit(dir: &Path, manifest: &Manifest) -> Result<(), String> {
    let json = serde_json::to_vec_pretty(manifest)
        .map_err(|e| format!("cannot encode the manifest: {e}"))?;
    checkpoint::write_atomically(&dir.join(MANIFEST), &json)
        .map_err(|e| format!("sharded checkpoint: {e}"))?;
    if let Ok(entries) = std::fs::read_dir(dir) {
        for entry in entries.flatten() {
            let name = entry.file_name().to_string_lossy().into_owned();
            if name.starts_with("step-") && name != manifest.folder {
                let _ = std::fs::remove_dir_all(entry.path());
            }
        }
    }
    Ok(())
}

/// Whether `path` is a sharded checkpoint's directory (rather than a checkpoint file).
pub fn is_sharded(path: &Path) -> bool {
    path.is_dir()
}

/// The committed manifest of `dir` and the mesh it was written on, or why it is not usable.
fn read_manifest(dir: &Path) -> Result<(Manifest, Mesh), String> {
    let at = |what: String| unusable(dir, what);
    let text = std::fs::read(dir.join(MANIFEST)).map_err(|e| {
        at(format!(
            "no readable {MANIFEST} ({e}); rank files without their manifest are not a checkpoint"
        ))
    })?;
    let manifest: Manifest =
        serde_json::from_slice(&text).map_err(|e| at(format!("{MANIFEST}: {e}")))?;
    if manifest.format != FORMAT {
        return Err(at(format!("{MANIFEST} is a `{}`", manifest.format)));
    }
    let mesh = Mesh::parse(&manifest.mesh).map_err(|e| at(format!("its mesh: {e}")))?;
    Ok((manifest, mesh))
}

fn unusable(dir: &Path, what: String) -> String {
    format!(
        "`{}` is not a usable sharded checkpoint: {what}",
        dir.display()
    )
}

/// The placement the manifest gives `name`.
fn placement_of(dir: &Path, manifest: &Manifest, name: &str) -> Result<Placements, String> {
    let at = |what: String| unusable(dir, what);
    let placement = manifest
        .placements
        .get(name)
        .ok_or_else(|| at(format!("the manifest has no placement for `{name}`")))?;
    Ok(Placements(
        placement
            .iter()
            .map(|p| Placement::parse(p))
            .collect::<Result<_, _>>()
            .map_err(|e| at(format!("`{name}`: {e}")))?,
    ))
}

/// Reads the committed checkpoint of `dir` and assembles its whole tensors.
pub fn load(dir: &Path) -> Result<Checkpoint, String> {
    let at = |what: String| unusable(dir, what);
    let (manifest, mesh) = read_manifest(dir)?;
    let parts: Vec<Checkpoint> = (0..mesh.world_size())
        .map(|r| checkpoint::load(&rank_file(dir, &manifest.folder, r)).map_err(&at))
        .collect::<Result<_, _>>()?;
    let first = &parts[0];
    if let Some((r, _)) = parts
        .iter()
        .enumerate()
        .find(|(_, p)| p.header.steps_done != manifest.steps_done)
    {
        return Err(at(format!(
            "rank {r}'s file is of another step than the manifest's {}",
            manifest.steps_done
        )));
    }
    let mut entries = Vec::with_capacity(first.header.tensors.len());
    let mut tensors = Vec::with_capacity(first.header.tensors.len());
    for (i, entry) in first.header.tensors.iter().enumerate() {
        let placement = placement_of(dir, &manifest, &entry.name)?;
        let pieces: Vec<&HostTensor> = parts
            .iter()
            .map(|p| {
                p.tensors
                    .get(i)
                    .filter(|_| {
                        p.header
                            .tensors
                            .get(i)
                            .is_some_and(|e| e.name == entry.name)
                    })
                    .ok_or_else(|| at(format!("a rank's file lacks `{}`", entry.name)))
            })
            .collect::<Result<_, _>>()?;
        let whole = assemble(&pieces, &placement, &mesh)
            .map_err(|e| at(format!("`{}`: {e}", entry.name)))?;
        entries.push(TensorEntry {
            name: entry.name.clone(),
            ty: whole.ty.clone(),
        });
        tensors.push(whole);
    }
    let mut header = first.header.clone();
    header.tensors = entries;
    Ok(Checkpoint { header, tensors })
}

/// A tensor one rank of a resuming run needs: its name, global shape and placement there.
pub struct Wanted {
    pub name: String,
    pub global: Vec<usize>,
    pub placements: Placements,
}

/// Rank `rank`'s own parts on `mesh` of the committed checkpoint of `dir`, reading only the
/// rank files that hold some of them (one copy of each replicated block), each verified as any
/// checkpoint is; the tensors come back with their local types. Also returns the rank files
/// read. The checkpoint may have been written on any mesh (resharding on load).
pub fn load_parts(
    dir: &Path,
    mesh: &Mesh,
    rank: usize,
    wanted: &[Wanted],
) -> Result<(Checkpoint, Vec<usize>), String> {
    let at = |what: String| unusable(dir, what);
    let (manifest, old) = read_manifest(dir)?;
    if let Some(extra) = manifest
        .placements
        .keys()
        .find(|k| !wanted.iter().any(|w| &w.name == *k))
    {
        return Err(format!(
            "the checkpoint holds `{extra}`, which this train step does not have"
        ));
    }
    // For each tensor: its placement in the checkpoint, the block this rank needs, and the old
    // ranks whose blocks meet it.
    let mut plans = Vec::with_capacity(wanted.len());
    let mut files: Vec<usize> = Vec::new();
    for w in wanted {
        let was = placement_of(dir, &manifest, &w.name)?;
        if was.0.iter().any(|p| matches!(p, Placement::Partial(_))) {
            return Err(at(format!("`{}` is saved as a partial sum", w.name)));
        }
        let need = w.placements.local_block(mesh, &w.global, rank)?;
        let mut sources = Vec::new();
        for q in 0..old.world_size() {
            let coords = old.coords(q);
            // Ranks that differ only along replicated dims hold the same block: read one.
            let first_copy = was
                .0
                .iter()
                .enumerate()
                .all(|(m, p)| *p != Placement::Replicate || coords[m] == 0);
            if !first_copy {
                continue;
            }
            let have = was
                .local_block(&old, &w.global, q)
                .map_err(|e| at(format!("`{}`: {e}", w.name)))?;
            if need
                .iter()
                .zip(&have)
                .all(|(n, h)| n.start < h.end && h.start < n.end)
            {
                sources.push((q, have));
                if !files.contains(&q) {
                    files.push(q);
                }
            }
        }
        plans.push((need, sources));
    }
    files.sort_unstable();
    let mut parts: BTreeMap<usize, Checkpoint> = BTreeMap::new();
    for &q in &files {
        let part = checkpoint::load(&rank_file(dir, &manifest.folder, q)).map_err(&at)?;
        if part.header.steps_done != manifest.steps_done {
            return Err(at(format!(
                "rank {q}'s file is of another step than the manifest's {}",
                manifest.steps_done
            )));
        }
        parts.insert(q, part);
    }
    let header = match parts.values().next() {
        Some(p) => p.header.clone(),
        None => {
            checkpoint::load(&rank_file(dir, &manifest.folder, 0))
                .map_err(&at)?
                .header
        }
    };
    let mut entries = Vec::with_capacity(wanted.len());
    let mut tensors = Vec::with_capacity(wanted.len());
    for (w, (need, sources)) in wanted.iter().zip(plans) {
        let local: Vec<usize> = need.iter().map(|r| r.len()).collect();
        let mut data = vec![0.0; local.iter().product()];
        let mut written = 0usize;
        let mut dtype = None;
        for (q, have) in sources {
            let part = &parts[&q];
            let i = part
                .header
                .tensors
                .iter()
                .position(|e| e.name == w.name)
                .ok_or_else(|| at(format!("rank {q}'s file lacks `{}`", w.name)))?;
            let piece = &part.tensors[i];
            let shape: Vec<usize> = have.iter().map(|r| r.len()).collect();
            if piece.ty.shape != shape {
                return Err(at(format!(
                    "rank {q}'s `{}` is {}, its placement gives {shape:?}",
                    w.name, piece.ty
                )));
            }
            dtype = Some(piece.ty.dtype);
            written += copy_overlap(piece, &have, &mut data, &need);
        }
        if written != data.len() {
            return Err(at(format!(
                "the rank files cover {written} of the {} elements rank {rank} needs of `{}`",
                data.len(),
                w.name
            )));
        }
        let ty = graphtrain_ir::TensorType::new(dtype.unwrap_or(graphtrain_ir::DType::F32), local);
        entries.push(TensorEntry {
            name: w.name.clone(),
            ty: ty.clone(),
        });
        tensors.push(HostTensor::new(ty, data).map_err(|e| at(e.to_string()))?);
    }
    let mut header = header;
    header.tensors = entries;
    Ok((Checkpoint { header, tensors }, files))
}

/// Copies the elements `piece` (the block `have` of a global tensor) shares with `out` (the
/// block `need`); returns how many.
fn copy_overlap(
    piece: &HostTensor,
    have: &[std::ops::Range<usize>],
    out: &mut [f64],
    need: &[std::ops::Range<usize>],
) -> usize {
    let common: Vec<std::ops::Range<usize>> = have
        .iter()
        .zip(need)
        .map(|(h, n)| h.start.max(n.start)..h.end.min(n.end))
        .collect();
    let count: usize = common.iter().map(|r| r.len()).product();
    let strides = |block: &[std::ops::Range<usize>]| -> Vec<usize> {
        (0..block.len())
            .map(|d| block[d + 1..].iter().map(|r| r.len()).product())
            .collect()
    };
    let (from, to) = (strides(have), strides(need));
    let mut idx: Vec<usize> = common.iter().map(|r| r.start).collect();
    for _ in 0..count {
        let src: usize = (0..idx.len())
            .map(|d| (idx[d] - have[d].start) * from[d])
            .sum();
        let dst: usize = (0..idx.len())
            .map(|d| (idx[d] - need[d].start) * to[d])
            .sum();
        out[dst] = piece.data[src];
        for d in (0..idx.len()).rev() {
            idx[d] += 1;
            if idx[d] < common[d].end {
                break;
            }
            idx[d] = common[d].start;
        }
    }
    count
}

/// A sharded checkpoint's directory or a checkpoint file, whole.
pub fn load_any(path: &Path) -> Result<Checkpoint, String> {
    if is_sharded(path) {
        load(path)
    } else {
        checkpoint::load(path)
    }
}

/// The manifest of a save after `steps_done` steps on `mesh`, tensors placed as `placements`.
pub fn manifest(
    mesh: &Mesh,
    steps_done: u64,
    placements: impl IntoIterator<Item = (String, Placements)>,
) -> Manifest {
    Manifest {
        format: FORMAT.to_string(),
        folder: folder(steps_done),
        mesh: mesh.to_string(),
        steps_done,
        placements: placements
            .into_iter()
            .map(|(name, p)| (name, p.0.iter().map(|q| q.to_string()).collect()))
            .collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::checkpoint::{Header, RunIdentity};
    use crate::data::DataMode;
    use graphtrain_ir::mesh::local_part;
    use graphtrain_ir::optim::OptimConfig;
    use graphtrain_ir::{DType, TensorType};
    use graphtrain_models::Llama3Config;
    use Placement::{Replicate, Shard};

    fn tensor(shape: &[usize], first: f64) -> HostTensor {
        let n = shape.iter().product::<usize>();
        HostTensor::new(
            TensorType::new(DType::F32, shape.to_vec()),
            (0..n).map(|i| first + i as f64).collect(),
        )
        .unwrap()
    }

    /// `a` [4, 6] split by columns over dp_shard and rows over tp, `b` [8] by dp_shard and
    /// replicated over tp, `c` a scalar everywhere, saved by the four ranks of
    /// `dp_shard=2,tp=2`; the whole tensors beside them.
    fn saved(dir: &Path) -> Vec<(String, HostTensor, Placements)> {
        let whole = vec![
            (
                "a".to_string(),
                tensor(&[4, 6], 0.0),
                Placements(vec![Shard(1), Shard(0)]),
            ),
            (
                "b".to_string(),
                tensor(&[8], 100.0),
                Placements(vec![Shard(0), Replicate]),
            ),
            (
                "c".to_string(),
                tensor(&[], 7.0),
                Placements(vec![Replicate, Replicate]),
            ),
        ];
        let mesh = Mesh::parse("dp_shard=2,tp=2").unwrap();
        let run = RunIdentity::new(
            &Llama3Config::builtin("tiny").unwrap(),
            0,
            DataMode::Fixed,
            &OptimConfig::default(),
        );
        for q in 0..4 {
            let tensors: Vec<HostTensor> = whole
                .iter()
                .map(|(_, t, p)| local_part(t, p, &mesh, q).unwrap())
                .collect();
            let header = Header {
                run: run.clone(),
                steps_done: 3,
                data_batches_consumed: 3,
                fingerprint: "f".into(),
                tensors: whole
                    .iter()
                    .zip(&tensors)
                    .map(|((name, _, _), t)| TensorEntry {
                        name: name.clone(),
                        ty: t.ty.clone(),
                    })
                    .collect(),
                extra: BTreeMap::new(),
            };
            save_part(dir, q, &Checkpoint { header, tensors }).unwrap();
        }
        let placements = whole.iter().map(|(n, _, p)| (n.clone(), p.clone()));
        commit(dir, &manifest(&mesh, 3, placements)).unwrap();
        whole
    }

    fn scratch(name: &str) -> PathBuf {
        let dir =
            std::env::temp_dir().join(format!("graphtrain-sharded-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        dir
    }

    /// Each rank of `mesh` loads its parts (`placements[i]` for tensor i): they equal the parts
    /// of the whole tensors; returns the rank files each read.
    fn check_parts(
        dir: &Path,
        whole: &[(String, HostTensor, Placements)],
        mesh: &str,
        placements: &[Placements],
    ) -> Vec<Vec<usize>> {
        let mesh = Mesh::parse(mesh).unwrap();
        (0..mesh.world_size())
            .map(|r| {
                let wanted: Vec<Wanted> = whole
                    .iter()
                    .zip(placements)
                    .map(|((name, t, _), p)| Wanted {
                        name: name.clone(),
                        global: t.ty.shape.clone(),
                        placements: p.clone(),
                    })
                    .collect();
                let (ckpt, files) = load_parts(dir, &mesh, r, &wanted).unwrap();
                assert_eq!(ckpt.header.steps_done, 3);
                for ((name, t, _), (p, got)) in
                    whole.iter().zip(placements.iter().zip(&ckpt.tensors))
                {
                    assert_eq!(
                        *got,
                        local_part(t, p, &mesh, r).unwrap(),
                        "rank {r}'s `{name}`"
                    );
                }
                files
            })
            .collect()
    }

    #[test]
    fn a_rank_reads_only_the_files_that_hold_its_parts() {
        let dir = scratch("parts");
        let whole = saved(&dir);
        // tp=2: `a` by columns. Rank 0 needs the first three columns (old ranks 0 and 1 hold
        // them), `b` whole (one copy of each half: old ranks 0 and 2), `c` from rank 0.
        let files = check_parts(
            &dir,
            &whole,
            "tp=2",
            &[
                Placements(vec![Shard(1)]),
                Placements(vec![Replicate]),
                Placements(vec![Replicate]),
            ],
        );
        assert_eq!(files, vec![vec![0, 1, 2], vec![0, 2, 3]]);
        // dp_shard=4: `a` by rows; rank 1 needs row 1, which old ranks 0 and 2 hold.
        let files = check_parts(
            &dir,
            &whole,
            "dp_shard=4",
            &[
                Placements(vec![Shard(0)]),
                Placements(vec![Shard(0)]),
                Placements(vec![Replicate]),
            ],
        );
        assert_eq!(files[1], vec![0, 2]);
        // One device reads everything it needs: one copy of every block.
        let files = check_parts(
            &dir,
            &whole,
            "dp_shard=1",
            &[
                Placements(vec![Replicate]),
                Placements(vec![Replicate]),
                Placements(vec![Replicate]),
            ],
        );
        assert_eq!(files, vec![vec![0, 1, 2, 3]]);

        // A damaged file nobody needs is never read; one that is needed is refused.
        let rank3 = dir.join(folder(3)).join("rank-3.safetensors");
        let mut bytes = std::fs::read(&rank3).unwrap();
        let last = bytes.len() - 1;
        bytes[last] ^= 0xff;
        std::fs::write(&rank3, bytes).unwrap();
        let wanted_a = |p: Placements| {
            vec![
                Wanted {
                    name: "a".into(),
                    global: vec![4, 6],
                    placements: p,
                },
                Wanted {
                    name: "b".into(),
                    global: vec![8],
                    placements: Placements(vec![Replicate]),
                },
                Wanted {
                    name: "c".into(),
                    global: vec![],
                    placements: Placements(vec![Replicate]),
                },
            ]
        };
        let tp2 = Mesh::parse("tp=2").unwrap();
        assert!(load_parts(&dir, &tp2, 0, &wanted_a(Placements(vec![Shard(1)]))).is_ok());
        let e = load_parts(&dir, &tp2, 1, &wanted_a(Placements(vec![Shard(1)]))).unwrap_err();
        assert!(e.contains("rank-3.safetensors"), "{e}");
        assert!(load(&dir).is_err());

        // A step without one of the checkpoint's tensors is refused, naming it.
        let e = load_parts(&dir, &tp2, 0, &wanted_a(Placements(vec![Shard(1)]))[..2]).unwrap_err();
        assert!(e.contains("holds `c`"), "{e}");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
