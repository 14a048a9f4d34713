//! A text corpus: one text file, or every file under a folder (recursively, in sorted path
//! order, so the same folder always gives the same documents in the same order). Each file is
//! one document.
//!
//! Refuses, naming the file: a file that is not UTF-8 text (NUL bytes or invalid UTF-8: most
//! likely a binary that would otherwise be trained on as garbage), a corpus with no text at all
//! (an empty file, a folder with no files, or only empty ones). Hidden files and folders (name
//! starting with `.`) are skipped, as are empty files inside a folder (they hold no document).

use super::fingerprint::Fnv64;
use std::path::{Path, PathBuf};

/// One file's text.
#[derive(Clone, Debug)]
pub struct Document {
    pub path: PathBuf,
    pub text: String,
}

#[derive(Clone, Debug)]
pub struct Corpus {
    /// Where it was read from (a file or a folder).
    pub root: PathBuf,
    pub documents: Vec<Document>,
}

impl Corpus {
    /// Reads `path`: a text file, or a folder of them.
    pub fn read(path: &Path) -> Result<Corpus, String> {
        let meta = std::fs::metadata(path)
            .map_err(|e| format!("cannot read corpus `{}`: {e}", path.display()))?;
        let files = if meta.is_dir() {
            let mut files = Vec::new();
            collect_files(path, &mut files)?;
            files.sort();
            if files.is_empty() {
                return Err(format!(
                    "corpus folder `{}` holds no text files",
                    path.display()
                ));
            }
            files
        } else {
            vec![path.to_path_buf()]
        };
        let mut documents = Vec::with_capacity(files.len());
        for file in files {
            let text = read_text(&file)?;
            if !text.is_empty() {
                documents.push(Document { path: file, text });
            }
        }
        if documents.iter().all(|d| d.text.trim().is_empty()) {
            return Err(if meta.is_dir() {
                format!(
                    "corpus folder `{}` holds no text: every file in it is empty or blank",
                    path.display()
                )
            } else {
                format!("corpus `{}` is empty: it holds no text", path.display())
            });
        }
        Ok(Corpus {
            root: path.to_path_buf(),
            documents,
        })
    }

    /// A fingerprint of the texts in order (not of their paths: moving the folder keeps it).
    pub fn fingerprint(&self) -> u64 {
        let mut h = Fnv64::default();
        for d in &self.documents {
            h.update_framed(d.text.as_bytes());
        }
        h.finish()
    }

    pub fn bytes(&self) -> usize {
        self.documents.iter().map(|d| d.text.len()).sum()
    }
}

fn collect_files(dir: &Path, out: &mut Vec<PathBuf>) -> Result<(), String> {
    let entries = std::fs::read_dir(dir)
        .map_err(|e| format!("cannot list corpus folder `{}`: {e}", dir.display()))?;
    for entry in entries {
        let entry =
            entry.map_err(|e| format!("cannot list corpus folder `{}`: {e}", dir.display()))?;
        if entry.file_name().to_string_lossy().starts_with('.') {
            continue;
        }
        let path = entry.path();
        // Follows symlinks, so a linked file or folder counts like a real one.
        let meta = std::fs::metadata(&path)
            .map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
        if meta.is_dir() {
            collect_files(&path, out)?;
        } else if meta.is_file() {
            out.push(path);
        }
    }
    Ok(())
}

/// The file's text; refuses binaries rather than decoding them lossily.
fn read_text(path: &Path) -> Result<String, String> {
    let bytes =
        std::fs::read(path).map_err(|e| format!("cannot read `{}`: {e}", path.display()))?;
    if let Some(at) = bytes.iter().position(|&b| b == 0) {
        return Err(format!(
            "`{}` is not a text file: it has a NUL byte at byte {at}",
            path.display()
        ));
    }
    String::from_utf8(bytes).map_err(|e| {
        format!(
            "`{}` is not a text file: invalid UTF-8 at byte {}",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })
}
