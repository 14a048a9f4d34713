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
//! Loading reads every rank's file (each verified as any checkpoint is) and assembles whole
//! tensors by their placements, so a sharded checkpoint resumes on any mesh, launcher or one
//! device (resharding on load).

use crate::checkpoint::{self, Checkpoint, TensorEntry};
use graphtrain_ir::mesh::assemble;
use graphtrain_ir::{HostTensor, Mesh, Placement, Placements};
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// `manifest.json`'s `format`.
const FORMAT: &str = "graphtrain-sharded-checkpoint";
const MANIFEST: &str = "manifest.json";

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

/// Reads the committed checkpoint of `dir` and assembles its whole tensors.
pub fn load(dir: &Path) -> Result<Checkpoint, String> {
    let at = |what: String| {
        format!(
            "`{}` is not a usable sharded checkpoint: {what}",
            dir.display()
        )
    };
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
        let placement = manifest.placements.get(&entry.name).ok_or_else(|| {
            at(format!(
                "the manifest has no placement for `{}`",
                entry.name
            ))
        })?;
        let placement = Placements(
            placement
                .iter()
                .map(|p| Placement::parse(p))
                .collect::<Result<_, _>>()
                .map_err(|e| at(format!("`{}`: {e}", entry.name)))?,
        );
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
