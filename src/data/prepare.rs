//! From a `--data PATH` to tokens: reads the corpus, gets a tokenizer (the one given, or a BPE
//! trained on the corpus and cached), tokenizes once and caches the token file.
//!
//! Cache layout under the cache dir: `tokenizers/bpe-<source fp>-<vocab>.json` (a BPE trained on
//! those texts at that vocab size) and `tokens/<source fp>-<tokenizer fp>.tokens`. Both are keyed
//! by content fingerprints, never by path, so editing a corpus file makes new entries instead of
//! reusing stale ones, and a second run reuses both. A token file given directly (`*.tokens`) is
//! used as it is, checked against `--tokenizer` when one is given.

use super::corpus::Corpus;
use super::tokenizer::TextTokenizer;
use super::tokens::{write_token_file, TokenFile, TokenHeader};
use std::path::{Path, PathBuf};

/// Where the tokens come from and how.
#[derive(Clone, Debug)]
pub struct PrepareOptions {
    /// A text file, a folder of them, or a `*.tokens` file.
    pub data: PathBuf,
    /// A `tokenizer.json`; without one a BPE of `vocab_size` is trained on the corpus.
    pub tokenizer: Option<PathBuf>,
    pub vocab_size: usize,
    pub cache_dir: PathBuf,
}

/// What preparing did, for the run's log.
#[derive(Clone, Debug, Default)]
pub struct PrepareReport {
    /// The tokenizer the tokens come from, when it is known (a token file given without
    /// `--tokenizer` names it only by fingerprint).
    pub tokenizer_used: Option<TextTokenizer>,
    pub documents: Option<usize>,
    pub bytes: Option<usize>,
    /// Where the tokenizer came from (a given file, the cache, or trained now).
    pub tokenizer: String,
    /// Where the token file is, and whether it was reused.
    pub tokens: String,
    pub seconds_tokenizer: f64,
    pub seconds_tokenize: f64,
}

/// `$XDG_CACHE_HOME/graphtrain`, else `~/.cache/graphtrain`.
pub fn default_cache_dir() -> Result<PathBuf, String> {
    if let Some(x) = std::env::var_os("XDG_CACHE_HOME").filter(|x| !x.is_empty()) {
        return Ok(PathBuf::from(x).join("graphtrain"));
    }
    std::env::var_os("HOME")
        .filter(|h| !h.is_empty())
        .map(|h| PathBuf::from(h).join(".cache").join("graphtrain"))
        .ok_or_else(|| {
            "neither XDG_CACHE_HOME nor HOME is set: give the cache folder with --data-cache"
                .to_string()
        })
}

/// Whether `path` names a token file rather than text.
pub fn is_token_file(path: &Path) -> bool {
    path.extension().is_some_and(|e| e == "tokens")
}

/// The token ids for `opts.data`, from the cache when it holds them.
pub fn prepare_tokens(opts: &PrepareOptions) -> Result<(TokenFile, PrepareReport), String> {
    let mut report = PrepareReport::default();
    let given = match &opts.tokenizer {
        Some(p) => Some(TextTokenizer::load(p)?),
        None => None,
    };
    if is_token_file(&opts.data) {
        let tokens = TokenFile::open(&opts.data, given.as_ref().map(|t| t.fingerprint()))?;
        report.tokenizer = match &opts.tokenizer {
            Some(p) => format!("{} (matches the token file)", p.display()),
            None => format!(
                "fingerprint {:016x} (from the token file)",
                tokens.header.tokenizer_fingerprint
            ),
        };
        report.tokens = format!("{} (given)", opts.data.display());
        report.tokenizer_used = given;
        return Ok((tokens, report));
    }
    let corpus = Corpus::read(&opts.data)?;
    report.documents = Some(corpus.documents.len());
    report.bytes = Some(corpus.bytes());
    let source_fp = corpus.fingerprint();
    let t = std::time::Instant::now();
    let tokenizer = match given {
        Some(t) => {
            report.tokenizer = opts
                .tokenizer
                .as_ref()
                .map(|p| p.display().to_string())
                .unwrap_or_default();
            t
        }
        None => {
            let path = opts
                .cache_dir
                .join("tokenizers")
                .join(format!("bpe-{source_fp:016x}-{}.json", opts.vocab_size));
            if path.is_file() {
                report.tokenizer = format!("{} (cached)", path.display());
                TextTokenizer::load(&path)?
            } else {
                let t = TextTokenizer::train_bpe(
                    corpus.documents.iter().map(|d| d.text.as_str()),
                    opts.vocab_size,
                )
                .map_err(|e| format!("training a tokenizer on `{}`: {e}", opts.data.display()))?;
                t.save(&path)?;
                report.tokenizer = format!("{} (trained now)", path.display());
                t
            }
        }
    };
    report.seconds_tokenizer = t.elapsed().as_secs_f64();
    let path = opts.cache_dir.join("tokens").join(format!(
        "{source_fp:016x}-{:016x}.tokens",
        tokenizer.fingerprint()
    ));
    if path.is_file() {
        // A damaged cache file is an error, not silently redone: it names the file to delete.
        let tokens = TokenFile::open(&path, Some(tokenizer.fingerprint()))
            .map_err(|e| format!("{e} (a cached file: delete it to tokenize again)"))?;
        report.tokens = format!("{} (cached)", path.display());
        report.tokenizer_used = Some(tokenizer);
        return Ok((tokens, report));
    }
    let t = std::time::Instant::now();
    let ids = encode_corpus(&corpus, &tokenizer)?;
    let header = TokenHeader {
        vocab_size: tokenizer.vocab_size() as u32,
        eot: tokenizer.eot(),
        tokenizer_fingerprint: tokenizer.fingerprint(),
        source_fingerprint: source_fp,
        count: ids.len() as u64,
    };
    write_token_file(&path, header, &ids)?;
    report.seconds_tokenize = t.elapsed().as_secs_f64();
    report.tokens = format!("{} (tokenized now)", path.display());
    let tokens = TokenFile::open(&path, Some(tokenizer.fingerprint()))?;
    report.tokenizer_used = Some(tokenizer);
    Ok((tokens, report))
}

/// The documents' ids with the end-of-text id between documents.
pub fn encode_corpus(corpus: &Corpus, tokenizer: &TextTokenizer) -> Result<Vec<u32>, String> {
    let mut ids = Vec::new();
    for (i, d) in corpus.documents.iter().enumerate() {
        if i > 0 {
            ids.push(tokenizer.eot());
        }
        ids.extend(
            tokenizer
                .encode(&d.text)
                .map_err(|e| format!("`{}`: {e}", d.path.display()))?,
        );
    }
    Ok(ids)
}
