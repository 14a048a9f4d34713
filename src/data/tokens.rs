//! Token files (`*.tokens`): a corpus tokenized once and kept, so a second run (or a resume)
//! maps the ids instead of tokenizing again.
//!
//! Format (version 1), all little-endian: the 8 bytes `GTTOKENS`, version (u32), vocab size (u32),
//! end-of-text id (u32), 4 zero bytes, the tokenizer's fingerprint (u64), the source texts'
//! fingerprint (u64), the token count (u64), then `count` u32 ids: the documents' tokens with the
//! end-of-text id between documents. Written atomically (temporary file, then rename).
//!
//! Reading refuses, naming the file: another magic or version, a length that does not match the
//! count (a truncated or padded file), an id at or above the vocab size, an end-of-text id
//! outside the vocab, and (`expect_tokenizer`) a file made by another tokenizer than the one in
//! use: its ids would mean other tokens.

use super::write_atomically;
use memmap2::Mmap;
use std::path::{Path, PathBuf};

const MAGIC: &[u8; 8] = b"GTTOKENS";
const VERSION: u32 = 1;
pub const HEADER_BYTES: usize = 48;

/// What a token file says about its tokens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TokenHeader {
    pub vocab_size: u32,
    pub eot: u32,
    pub tokenizer_fingerprint: u64,
    pub source_fingerprint: u64,
    pub count: u64,
}

impl TokenHeader {
    fn to_bytes(self) -> [u8; HEADER_BYTES] {
        let mut b = [0u8; HEADER_BYTES];
        b[0..8].copy_from_slice(MAGIC);
        b[8..12].copy_from_slice(&VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.vocab_size.to_le_bytes());
        b[16..20].copy_from_slice(&self.eot.to_le_bytes());
        b[24..32].copy_from_slice(&self.tokenizer_fingerprint.to_le_bytes());
        b[32..40].copy_from_slice(&self.source_fingerprint.to_le_bytes());
        b[40..48].copy_from_slice(&self.count.to_le_bytes());
        b
    }

    fn parse(b: &[u8], path: &Path) -> Result<Self, String> {
        let at = || format!("token file `{}`", path.display());
        if b.len() < HEADER_BYTES || &b[0..8] != MAGIC {
            return Err(format!(
                "{} is not a graphtrain token file (no `GTTOKENS` header)",
                at()
            ));
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        let version = u32_at(8);
        if version != VERSION {
            return Err(format!(
                "{} has format version {version}; this build reads version {VERSION}",
                at()
            ));
        }
        Ok(TokenHeader {
            vocab_size: u32_at(12),
            eot: u32_at(16),
            tokenizer_fingerprint: u64_at(24),
            source_fingerprint: u64_at(32),
            count: u64_at(40),
        })
    }
}

/// Writes `ids` with `header` (its count is taken from `ids`) to `path`, atomically.
pub fn write_token_file(path: &Path, mut header: TokenHeader, ids: &[u32]) -> Result<(), String> {
    if let Some(&bad) = ids.iter().find(|&&id| id >= header.vocab_size) {
        return Err(format!(
            "cannot write `{}`: token id {bad} is not below the vocab size {}",
            path.display(),
            header.vocab_size
        ));
    }
    header.count = ids.len() as u64;
    let mut bytes = Vec::with_capacity(HEADER_BYTES + 4 * ids.len());
    bytes.extend_from_slice(&header.to_bytes());
    for id in ids {
        bytes.extend_from_slice(&id.to_le_bytes());
    }
    write_atomically(path, &bytes)
}

/// A token file's ids, memory-mapped (or held, for tokens that never touched a file).
pub struct TokenFile {
    pub header: TokenHeader,
    pub path: Option<PathBuf>,
    ids: Ids,
}

enum Ids {
    Mapped(Mmap),
    Owned(Vec<u32>),
}

impl std::fmt::Debug for TokenFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TokenFile({:?}, {:?})", self.path, self.header)
    }
}

impl TokenFile {
    /// Opens and validates `path`; with `expect_tokenizer`, refuses a file made by another
    /// tokenizer.
    pub fn open(path: &Path, expect_tokenizer: Option<u64>) -> Result<TokenFile, String> {
        let file = std::fs::File::open(path)
            .map_err(|e| format!("cannot open token file `{}`: {e}", path.display()))?;
        // SAFETY: the map is read-only and graphtrain writes token files only through a rename,
        // never in place; a file truncated by another program underneath would fault, which is
        // the documented hazard of memory maps.
        let map = unsafe { Mmap::map(&file) }
            .map_err(|e| format!("cannot map token file `{}`: {e}", path.display()))?;
        let header = TokenHeader::parse(&map, path)?;
        let want = (header.count as u128) * 4 + HEADER_BYTES as u128;
        if map.len() as u128 != want {
            return Err(format!(
                "token file `{}` is {} bytes but its header promises {} tokens ({want} bytes): it is truncated or damaged",
                path.display(),
                map.len(),
                header.count
            ));
        }
        if let Some(fp) = expect_tokenizer {
            if header.tokenizer_fingerprint != fp {
                return Err(format!(
                    "token file `{}` was made by another tokenizer (fingerprint {:016x}, the tokenizer in use is {fp:016x}): its ids would mean other tokens",
                    path.display(),
                    header.tokenizer_fingerprint
                ));
            }
        }
        let tokens = TokenFile {
            header,
            path: Some(path.to_path_buf()),
            ids: Ids::Mapped(map),
        };
        tokens.check_ids()?;
        Ok(tokens)
    }

    /// Tokens held in memory, checked as a file's would be.
    pub fn from_ids(mut header: TokenHeader, ids: Vec<u32>) -> Result<TokenFile, String> {
        header.count = ids.len() as u64;
        let tokens = TokenFile {
            header,
            path: None,
            ids: Ids::Owned(ids),
        };
        tokens.check_ids()?;
        Ok(tokens)
    }

    fn check_ids(&self) -> Result<(), String> {
        let name = match &self.path {
            Some(p) => format!("token file `{}`", p.display()),
            None => "the tokens".to_string(),
        };
        let vocab = self.header.vocab_size;
        if self.header.eot >= vocab {
            return Err(format!(
                "{name}: the end-of-text id {} is not below the vocab size {vocab}",
                self.header.eot
            ));
        }
        if let Some(i) = (0..self.len()).find(|&i| self.get(i) >= vocab) {
            return Err(format!(
                "{name}: token {i} has id {}, not below the vocab size {vocab}",
                self.get(i)
            ));
        }
        Ok(())
    }

    pub fn len(&self) -> usize {
        self.header.count as usize
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// Id `i` (`i < len()`).
    pub fn get(&self, i: usize) -> u32 {
        match &self.ids {
            Ids::Owned(v) => v[i],
            Ids::Mapped(m) => {
                let at = HEADER_BYTES + 4 * i;
                u32::from_le_bytes(m[at..at + 4].try_into().expect("4 bytes"))
            }
        }
    }
}
