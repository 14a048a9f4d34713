//! The tokenizer: a wrapper over the `tokenizers` crate that loads a `tokenizer.json`, or trains a
//! byte-level BPE (GPT-2's scheme: any UTF-8 text encodes, nothing is unknown) with one special
//! end-of-text token, `<|endoftext|>`, that separates documents.
//!
//! Guarantees: `decode(encode(text)) == text` for a tokenizer trained here (no prefix space is
//! added, no normalizer runs); the fingerprint is FNV-1a 64 of the tokenizer's serialized JSON,
//! so two tokenizers that encode differently have different fingerprints and token files and
//! checkpoints can name the one they were made with. GPT-2's own BPE (`gpt2`) is built from the
//! ranks the tiktoken-rs crate carries, so it needs no download. Refuses: a tokenizer without
//! `<|endoftext|>` (documents could not be separated), a vocab size below 257 for training (256
//! byte symbols plus the special token: BPE cannot go below its alphabet).

use super::fingerprint::fnv1a64;
use std::path::Path;
use tokenizers::models::bpe::{BpeTrainerBuilder, BPE};
use tokenizers::models::TrainerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::{
    AddedToken, DecoderWrapper, ModelWrapper, NormalizerWrapper, PostProcessorWrapper,
    PreTokenizerWrapper, Tokenizer, TokenizerImpl,
};

type Impl = TokenizerImpl<
    ModelWrapper,
    NormalizerWrapper,
    PreTokenizerWrapper,
    PostProcessorWrapper,
    DecoderWrapper,
>;

pub const END_OF_TEXT: &str = "<|endoftext|>";
/// The name `--tokenizer` takes for GPT-2's BPE.
pub const GPT2: &str = "gpt2";
/// Default vocab size of a trained BPE.
pub const DEFAULT_VOCAB_SIZE: usize = 2048;
/// The smallest vocab a byte-level BPE can have: 256 byte symbols and `<|endoftext|>`.
pub const MIN_BPE_VOCAB: usize = 257;

#[derive(Clone)]
pub struct TextTokenizer {
    inner: Tokenizer,
    eot: u32,
    fingerprint: u64,
    vocab_size: usize,
}

impl std::fmt::Debug for TextTokenizer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "TextTokenizer(vocab {}, eot {}, fp {:016x})",
            self.vocab_size, self.eot, self.fingerprint
        )
    }
}

impl TextTokenizer {
    fn wrap(inner: Tokenizer, origin: &str) -> Result<Self, String> {
        let eot = inner.token_to_id(END_OF_TEXT).ok_or_else(|| {
            format!("{origin} has no `{END_OF_TEXT}` token, which separates documents")
        })?;
        let json = inner
            .to_string(false)
            .map_err(|e| format!("{origin}: cannot serialize: {e}"))?;
        // The largest id + 1, not the number of entries: ids must index the embedding.
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .map(|&id| id as usize + 1)
            .max()
            .unwrap_or(0);
        Ok(TextTokenizer {
            fingerprint: fnv1a64(json.as_bytes()),
            inner,
            eot,
            vocab_size,
        })
    }

    /// Loads a `tokenizer.json` (the `tokenizers` library format), or GPT-2's BPE for the name
    /// `gpt2` when no file of that name exists (`./gpt2` names the file).
    pub fn load(path: &Path) -> Result<Self, String> {
        if path.as_os_str() == GPT2 && !path.exists() {
            return Self::gpt2();
        }
        let inner = Tokenizer::from_file(path)
            .map_err(|e| format!("cannot load tokenizer `{}`: {e}", path.display()))?;
        Self::wrap(inner, &format!("tokenizer `{}`", path.display()))
    }

    /// GPT-2's byte-level BPE: 50,257 tokens, `<|endoftext|>` = 50256. Built from the ranks of
    /// tiktoken's `r50k_base`, which the tiktoken-rs crate carries: each token's bytes become
    /// its vocab entry, spelled in GPT-2's byte-to-character alphabet (the one `ByteLevel`
    /// uses), and the merges are recovered from the ranks: the token of rank r is the merge of
    /// the two parts that byte-pair encoding its bytes with the ranks below r leaves. The
    /// result is GPT-2's `tokenizer.json`, run by the same library as every other tokenizer.
    pub fn gpt2() -> Result<Self, String> {
        let origin = "GPT-2's BPE (tiktoken's r50k_base)";
        let bpe = tiktoken_rs::r50k_base().map_err(|e| format!("{origin}: {e}"))?;
        const EOT: u32 = 50256;
        let mut tokens: Vec<Vec<u8>> = Vec::with_capacity(EOT as usize);
        let mut ranks: std::collections::HashMap<Vec<u8>, u32> = Default::default();
        for id in 0..EOT {
            let bytes = bpe
                .decode_bytes(&[id])
                .map_err(|e| format!("{origin}: token {id}: {e:?}"))?;
            ranks.insert(bytes.clone(), id);
            tokens.push(bytes);
        }
        let alphabet = gpt2_byte_alphabet();
        let spell =
            |bytes: &[u8]| -> String { bytes.iter().map(|&b| alphabet[b as usize]).collect() };
        let vocab: tokenizers::models::bpe::Vocab = tokens
            .iter()
            .enumerate()
            .map(|(id, bytes)| (spell(bytes), id as u32))
            .collect();
        let mut merges = Vec::with_capacity(tokens.len());
        for (rank, bytes) in tokens.iter().enumerate().filter(|(_, b)| b.len() > 1) {
            match byte_pair_parts(bytes, &ranks, rank as u32).as_slice() {
                [a, b] => merges.push((spell(a), spell(b))),
                parts => {
                    return Err(format!(
                    "{origin}: token {rank} is not the merge of two lower-ranked tokens ({} parts)",
                    parts.len()
                ))
                }
            }
        }
        let model = BPE::builder()
            .vocab_and_merges(vocab, merges)
            .build()
            .map_err(|e| format!("{origin}: {e}"))?;
        let byte_level = ByteLevel::default().add_prefix_space(false);
        let mut tok: Impl = TokenizerImpl::new(model.into());
        tok.with_pre_tokenizer(Some(byte_level))
            .with_post_processor(Some(byte_level))
            .with_decoder(Some(byte_level));
        let mut tok = Tokenizer::from(tok);
        tok.add_special_tokens(&[AddedToken::from(END_OF_TEXT, true)]);
        let t = Self::wrap(tok, origin)?;
        if t.eot != EOT {
            return Err(format!(
                "{origin}: `{END_OF_TEXT}` became id {}, not {EOT}",
                t.eot
            ));
        }
        Ok(t)
    }

    /// Trains a byte-level BPE of at most `vocab_size` tokens (`<|endoftext|>` included) on
    /// `texts`. A small text may give fewer tokens than asked: merges stop when no pair repeats.
    pub fn train_bpe<S: AsRef<str> + Send>(
        texts: impl Iterator<Item = S> + Send,
        vocab_size: usize,
    ) -> Result<Self, String> {
        if vocab_size < MIN_BPE_VOCAB {
            return Err(format!(
                "a byte-level BPE needs a vocab size of at least {MIN_BPE_VOCAB} (256 byte symbols and {END_OF_TEXT}), got {vocab_size}"
            ));
        }
        let byte_level = ByteLevel::default().add_prefix_space(false);
        let mut trainer = TrainerWrapper::BpeTrainer(
            BpeTrainerBuilder::new()
                .vocab_size(vocab_size)
                .min_frequency(2)
                .show_progress(false)
                .special_tokens(vec![AddedToken::from(END_OF_TEXT, true)])
                .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
                .build(),
        );
        let mut tok: Impl = TokenizerImpl::new(BPE::default().into());
        tok.with_pre_tokenizer(Some(byte_level))
            .with_post_processor(Some(byte_level))
            .with_decoder(Some(byte_level));
        tok.train(&mut trainer, texts)
            .map_err(|e| format!("BPE training failed: {e}"))?;
        Self::wrap(Tokenizer::from(tok), "the trained tokenizer")
    }

    /// The tokenizer as `tokenizer.json` text (what checkpoints carry, so sampling from one
    /// needs nothing else).
    pub fn to_json(&self) -> Result<String, String> {
        self.inner
            .to_string(false)
            .map_err(|e| format!("cannot serialize the tokenizer: {e}"))
    }

    /// A tokenizer from `tokenizer.json` text; `origin` names where it came from in errors.
    pub fn from_json(json: &str, origin: &str) -> Result<Self, String> {
        let inner: Tokenizer = json
            .parse()
            .map_err(|e| format!("{origin}: not a tokenizer: {e}"))?;
        Self::wrap(inner, origin)
    }

    /// Writes the `tokenizer.json` atomically (a crash leaves the old file or none).
    pub fn save(&self, path: &Path) -> Result<(), String> {
        let json = self
            .inner
            .to_string(true)
            .map_err(|e| format!("cannot serialize the tokenizer: {e}"))?;
        super::write_atomically(path, json.as_bytes())
    }

    /// Token ids of `text`. `<|endoftext|>` written in the text is the special token.
    pub fn encode(&self, text: &str) -> Result<Vec<u32>, String> {
        let enc = self
            .inner
            .encode(text, false)
            .map_err(|e| format!("cannot encode: {e}"))?;
        Ok(enc.get_ids().to_vec())
    }

    pub fn decode(&self, ids: &[u32]) -> Result<String, String> {
        if let Some(&bad) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(format!(
                "token id {bad} is outside the tokenizer's vocab (size {})",
                self.vocab_size
            ));
        }
        self.inner
            .decode(ids, false)
            .map_err(|e| format!("cannot decode: {e}"))
    }

    /// One more than the largest token id.
    pub fn vocab_size(&self) -> usize {
        self.vocab_size
    }

    pub fn eot(&self) -> u32 {
        self.eot
    }

    pub fn fingerprint(&self) -> u64 {
        self.fingerprint
    }
}

/// The parts byte-pair encoding leaves of `bytes` when only merges of rank below `below` apply:
/// repeatedly merge the adjacent pair whose concatenation has the lowest rank.
fn byte_pair_parts<'a>(
    bytes: &'a [u8],
    ranks: &std::collections::HashMap<Vec<u8>, u32>,
    below: u32,
) -> Vec<&'a [u8]> {
    let mut parts: Vec<(usize, usize)> = (0..bytes.len()).map(|i| (i, i + 1)).collect();
    while let Some((_, i)) = parts
        .windows(2)
        .enumerate()
        .filter_map(|(i, w)| {
            let rank = *ranks.get(&bytes[w[0].0..w[1].1])?;
            (rank < below).then_some((rank, i))
        })
        .min()
    {
        parts[i].1 = parts[i + 1].1;
        parts.remove(i + 1);
    }
    parts.iter().map(|&(a, b)| &bytes[a..b]).collect()
}

/// GPT-2's byte-to-character map: printable Latin-1 bytes stand for themselves, every other
/// byte for the character 256 + its position among them, so that every byte is a visible
/// character in the vocab's strings.
fn gpt2_byte_alphabet() -> [char; 256] {
    let mut alphabet = ['\0'; 256];
    let mut next = 256u32;
    for b in 0..=255u8 {
        let printable = matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
        alphabet[b as usize] = if printable {
            b as char
        } else {
            next += 1;
            char::from_u32(next - 1).expect("below the surrogates")
        };
    }
    alphabet
}
