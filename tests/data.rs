//! Real text as training data: corpus reading, the BPE tokenizer, token files and their cache,
//! packing into rows, the split, the per-epoch shuffle, and every bad input giving a clear error.
//! Every test writes its own small files under the temp dir; none uses the network.

use graphtrain::checkpoint::RunIdentity;
use graphtrain::data::corpus::Corpus;
use graphtrain::data::prepare::{encode_corpus, prepare_tokens, PrepareOptions};
use graphtrain::data::tokenizer::TextTokenizer;
use graphtrain::data::tokens::{write_token_file, TokenFile, TokenHeader, HEADER_BYTES};
use graphtrain::data::{DataMode, DataSource, TextData};
use graphtrain::lr_schedule::LrSchedule;
use graphtrain::trainer::{TrainConfig, Trainer};
use graphtrain_ir::optim::OptimConfig;
use graphtrain_models::Llama3Config;
use graphtrain_passes::Pipeline;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Arc;

/// A fresh folder of its own for each test.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("graphtrain-data-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write(path: &Path, body: impl AsRef<[u8]>) -> PathBuf {
    std::fs::create_dir_all(path.parent().unwrap()).unwrap();
    std::fs::write(path, body).unwrap();
    path.to_path_buf()
}

/// Text with enough repeated words for BPE merges.
fn sample_text(lines: usize) -> String {
    let words = [
        "the", "quick", "brown", "fox", "jumps", "over", "lazy", "dog",
    ];
    (0..lines)
        .map(|i| {
            let w: Vec<&str> = (0..6)
                .map(|j| words[(i * 3 + j * 5) % words.len()])
                .collect();
            format!("{}.\n", w.join(" "))
        })
        .collect()
}

fn header(vocab: u32, eot: u32) -> TokenHeader {
    TokenHeader {
        vocab_size: vocab,
        eot,
        tokenizer_fingerprint: 0xAB,
        source_fingerprint: 0xCD,
        count: 0,
    }
}

/// Tokens 0, 1, 2, ... (mod 1000): row `r` of length `row` starts with `r * row`.
fn counting(n: usize) -> TokenFile {
    TokenFile::from_ids(header(1000, 999), (0..n as u32).map(|i| i % 1000).collect()).unwrap()
}

fn tiny_with_vocab(vocab: usize) -> Llama3Config {
    Llama3Config {
        vocab_size: vocab,
        ..Llama3Config::builtin("tiny").unwrap()
    }
}

#[test]
fn documents_are_joined_with_eot_and_round_trip() {
    let dir = temp_dir("packing");
    let a = sample_text(30);
    let b = "A second document, with other words.\n".repeat(5);
    let c = "Third: ünïcödé and emoji 🦀 survive.\n".repeat(5);
    write(&dir.join("corpus/a.txt"), &a);
    write(&dir.join("corpus/sub/c.txt"), &c);
    write(&dir.join("corpus/b.txt"), &b);
    write(&dir.join("corpus/empty.txt"), "");
    write(&dir.join("corpus/.hidden"), [0u8, 1, 2]);
    let corpus = Corpus::read(&dir.join("corpus")).unwrap();
    let names: Vec<_> = corpus
        .documents
        .iter()
        .map(|d| d.path.strip_prefix(&corpus.root).unwrap().to_path_buf())
        .collect();
    assert_eq!(
        names,
        [PathBuf::from("a.txt"), "b.txt".into(), "sub/c.txt".into()],
        "sorted paths, empty and hidden files skipped"
    );
    let tok =
        TextTokenizer::train_bpe(corpus.documents.iter().map(|d| d.text.as_str()), 300).unwrap();
    assert!(tok.vocab_size() <= 300 && tok.vocab_size() > 257, "{tok:?}");
    let ids = encode_corpus(&corpus, &tok).unwrap();
    let (ea, eb, ec) = (
        tok.encode(&a).unwrap(),
        tok.encode(&b).unwrap(),
        tok.encode(&c).unwrap(),
    );
    let mut want = ea.clone();
    want.push(tok.eot());
    want.extend(&eb);
    want.push(tok.eot());
    want.extend(&ec);
    assert_eq!(ids, want);
    for (text, enc) in [(&a, &ea), (&b, &eb), (&c, &ec)] {
        assert!(!enc.contains(&tok.eot()));
        assert_eq!(&tok.decode(enc).unwrap(), text);
    }
    // Merges happened: the repeated text takes fewer tokens than bytes.
    assert!(
        ea.len() < a.len() / 2,
        "{} tokens for {} bytes",
        ea.len(),
        a.len()
    );
    // Saved and loaded, it is the same tokenizer.
    let path = dir.join("tok.json");
    tok.save(&path).unwrap();
    let loaded = TextTokenizer::load(&path).unwrap();
    assert_eq!(loaded.fingerprint(), tok.fingerprint());
    assert_eq!(loaded.encode(&a).unwrap(), ea);
    // Trained again on the same text it is the same tokenizer; on other text, another one.
    let again =
        TextTokenizer::train_bpe(corpus.documents.iter().map(|d| d.text.as_str()), 300).unwrap();
    assert_eq!(again.fingerprint(), tok.fingerprint());
    let other = TextTokenizer::train_bpe([b.as_str()].into_iter(), 300).unwrap();
    assert_ne!(other.fingerprint(), tok.fingerprint());
}

#[test]
fn gpt2_bpe_encodes_as_tiktoken_does() {
    let t = TextTokenizer::gpt2().unwrap();
    assert_eq!((t.vocab_size(), t.eot()), (50257, 50256));
    // GPT-2's ids for "Hello world", as every GPT-2 tokenizer gives them.
    assert_eq!(t.encode("Hello world").unwrap(), vec![15496, 995]);
    // Contractions, digits, punctuation runs, whitespace runs, newlines, accents, CJK, emoji
    // (bytes split across tokens) and the special token: the same ids as tiktoken's own
    // encoder, and decoded back to the text.
    let text = "ROMEO: I'll've it, won't they? 12345 + 0.5e-3 = x;  \n\n\tindented   spaces\n\
Café naïve — déjà vu. 東京タワー 🤖🚀 <|endoftext|>Next document's start!!!";
    let reference = tiktoken_rs::r50k_base().unwrap();
    let ours = t.encode(text).unwrap();
    assert_eq!(ours, reference.encode_with_special_tokens(text));
    assert!(ours.contains(&50256), "the special token is one id");
    assert_eq!(t.decode(&ours).unwrap(), text);
    // `--tokenizer gpt2` names it.
    let by_name = TextTokenizer::load(Path::new("gpt2")).unwrap();
    assert_eq!(by_name.fingerprint(), t.fingerprint());
}

#[test]
fn rows_hold_seq_plus_one_tokens_without_overlap() {
    // 10 rows of 4 tokens plus a 3-token tail that is dropped.
    let t = TextData::new(counting(43), 3, 0.2).unwrap();
    assert_eq!((t.train_rows(), t.val_rows()), (8, 2));
    let val = t.val_batches(1).unwrap();
    assert_eq!(val.len(), 2);
    assert_eq!(val[0].tokens, [32, 33, 34]);
    assert_eq!(val[0].targets, [33, 34, 35]);
    assert_eq!(val[1].tokens, [36, 37, 38]);
    assert_eq!(val[1].targets, [37, 38, 39]);
    // Every training row is some row r: tokens 4r..4r+3, targets shifted by one.
    let b = t.train_batch(0, 0, 8, 3).unwrap();
    for (row, targets) in b.tokens.chunks(3).zip(b.targets.chunks(3)) {
        assert_eq!(row[0] % 4, 0, "{row:?}");
        assert!(
            row[0] < 32,
            "a training batch holds a validation row: {row:?}"
        );
        assert_eq!(row, [row[0], row[0] + 1, row[0] + 2]);
        assert_eq!(targets, [row[0] + 1, row[0] + 2, row[0] + 3]);
    }
}

#[test]
fn split_sizes() {
    // 40 rows.
    let split = |f: f64| {
        let t = TextData::new(counting(160), 3, f).unwrap();
        (t.train_rows(), t.val_rows())
    };
    assert_eq!(split(0.05), (38, 2));
    assert_eq!(split(0.25), (30, 10));
    assert_eq!(split(0.001), (39, 1), "at least one validation row");
    for bad in [0.0, 1.0, -0.1, f64::NAN] {
        let e = TextData::new(counting(160), 3, bad).unwrap_err();
        assert!(e.contains("between 0 and 1"), "{e}");
    }
    let t = TextData::new(counting(160), 3, 0.25).unwrap();
    let val = t.val_batches(4).unwrap();
    assert_eq!(
        val.len(),
        2,
        "10 rows in batches of 4: the partial third is dropped"
    );
    assert_eq!(val[0].tokens[..3], [120, 121, 122]);
    assert_eq!(val[1].tokens[9..], [148, 149, 150]);
    let e = t.val_batches(11).unwrap_err();
    assert!(
        e.contains("holds 10 rows") && e.contains("batch of 11"),
        "{e}"
    );
}

#[test]
fn shuffle_is_a_seeded_permutation_per_epoch() {
    let t = TextData::new(counting(4 * 101), 3, 0.01).unwrap();
    let n = t.train_rows();
    assert_eq!(n, 100);
    let p = t.shuffle(7, 0);
    let mut sorted = p.to_vec();
    sorted.sort_unstable();
    assert_eq!(sorted, (0..n as u32).collect::<Vec<_>>());
    assert_ne!(p.to_vec(), sorted, "not shuffled");
    assert_eq!(*t.shuffle(7, 0), *p);
    assert_ne!(*t.shuffle(8, 0), *p, "seeds give the same order");
    assert_ne!(*t.shuffle(7, 1), *p, "epochs give the same order");
    // Through batches: one epoch of 10 batches of 10 visits every training row once.
    let mut seen: Vec<i64> = (0..10)
        .flat_map(|k| t.train_batch(7, k, 10, 3).unwrap().tokens)
        .step_by(3)
        .map(|first| first / 4)
        .collect();
    let order = seen.clone();
    seen.sort_unstable();
    assert_eq!(seen, (0..100).collect::<Vec<i64>>());
    let want: Vec<i64> = p.iter().map(|&r| r as i64).collect();
    assert_eq!(order, want);
}

#[test]
fn batch_k_is_a_function_of_seed_and_k() {
    // 30 training rows, batches of 4: batch 9 spans epochs 1 and 2.
    let make = || TextData::new(counting(4 * 31), 3, 0.01).unwrap();
    let (sequential, direct) = (make(), make());
    let run: Vec<_> = (0..10)
        .map(|k| sequential.train_batch(3, k, 4, 3).unwrap())
        .collect();
    for k in [9u64, 2, 7, 0] {
        let b = direct.train_batch(3, k, 4, 3).unwrap();
        assert_eq!(b.tokens, run[k as usize].tokens, "batch {k}");
        assert_eq!(b.targets, run[k as usize].targets, "batch {k}");
    }
    assert_ne!(
        direct.train_batch(4, 9, 4, 3).unwrap().tokens,
        run[9].tokens,
        "the seed does not change the batch"
    );
    let e = direct.train_batch(3, 0, 4, 5).unwrap_err();
    assert!(e.contains("seq_len 3") && e.contains("5"), "{e}");
}

/// A data-parallel rank reads only its rows of a batch, and they are the batch's rows, for
/// every source (so a run's batches do not depend on how many ranks read them).
#[test]
fn a_ranks_rows_are_the_batchs_rows() {
    let text = Arc::new(TextData::new(counting(4 * 31), 3, 0.01).unwrap());
    for source in [
        DataSource::Random,
        DataSource::Fixed,
        DataSource::Text(text),
    ] {
        for k in [0u64, 5, 9] {
            let whole = source.batch(11, k, 4, 3, 1000).unwrap();
            for rows in [0..4, 1..3, 3..4, 2..2] {
                let part = source.rows(11, k, 4, rows.clone(), 3, 1000).unwrap();
                let cut = |ids: &[i64]| ids[rows.start * 3..rows.end * 3].to_vec();
                assert_eq!(
                    part.tokens,
                    cut(&whole.tokens),
                    "{source:?} batch {k} rows {rows:?}"
                );
                assert_eq!(
                    part.targets,
                    cut(&whole.targets),
                    "{source:?} batch {k} rows {rows:?}"
                );
            }
        }
        let e = source.rows(11, 0, 4, 3..5, 3, 1000).unwrap_err();
        assert!(e.contains("rows 3..5 of a batch of 4"), "{e}");
    }
}

#[test]
fn token_file_round_trip_and_cache_reuse() {
    let dir = temp_dir("cache");
    let ids: Vec<u32> = vec![5, 0, 299, 17, 256, 3];
    let path = dir.join("x.tokens");
    let mut h = header(300, 256);
    write_token_file(&path, h, &ids).unwrap();
    h.count = ids.len() as u64;
    let t = TokenFile::open(&path, Some(0xAB)).unwrap();
    assert_eq!(t.header, h);
    assert_eq!((0..t.len()).map(|i| t.get(i)).collect::<Vec<_>>(), ids);
    assert_eq!(
        std::fs::metadata(&path).unwrap().len(),
        (HEADER_BYTES + 4 * ids.len()) as u64
    );
    assert!(write_token_file(&dir.join("bad.tokens"), h, &[300]).is_err());

    let corpus = write(&dir.join("text.txt"), sample_text(60));
    let opts = PrepareOptions {
        data: corpus.clone(),
        tokenizer: None,
        vocab_size: 320,
        cache_dir: dir.join("cache"),
    };
    let (first, r1) = prepare_tokens(&opts).unwrap();
    assert!(r1.tokenizer.contains("trained now"), "{r1:?}");
    assert!(r1.tokens.contains("tokenized now"), "{r1:?}");
    let cached = first.path.clone().unwrap();
    let written = std::fs::metadata(&cached).unwrap().modified().unwrap();
    let (second, r2) = prepare_tokens(&opts).unwrap();
    assert!(r2.tokenizer.contains("(cached)"), "{r2:?}");
    assert!(r2.tokens.contains("(cached)"), "{r2:?}");
    assert_eq!(second.path.as_ref(), Some(&cached));
    assert_eq!(
        std::fs::metadata(&cached).unwrap().modified().unwrap(),
        written
    );
    assert_eq!(first.header, second.header);
    // The cached file given directly as --data.
    let direct = PrepareOptions {
        data: cached.clone(),
        ..opts.clone()
    };
    let (third, _) = prepare_tokens(&direct).unwrap();
    assert_eq!(third.header, first.header);
    // Changed text: new entries, not the stale ones.
    write(&corpus, sample_text(61));
    let (changed, r3) = prepare_tokens(&opts).unwrap();
    assert!(r3.tokens.contains("tokenized now"), "{r3:?}");
    assert_ne!(
        changed.header.source_fingerprint,
        first.header.source_fingerprint
    );
    // The identity a checkpoint records names the texts, the tokenizer and the split.
    let a = TextData::new(first, 8, 0.05).unwrap();
    let b = TextData::new(changed, 8, 0.05).unwrap();
    assert!(a.identity().starts_with("text:"));
    assert_ne!(a.identity(), b.identity());
    let model = tiny_with_vocab(512);
    let id = |d: DataSource| RunIdentity::new(&model, 0, d, &OptimConfig::default()).data;
    assert_ne!(
        id(DataSource::Text(Arc::new(a))),
        id(DataSource::Text(Arc::new(b)))
    );
    assert_eq!(id(DataMode::Fixed.into()), "fixed");
    assert_eq!(id(DataMode::Random.into()), "random");
}

#[test]
fn bad_corpora_are_refused_naming_the_file() {
    let dir = temp_dir("bad-corpus");
    let empty = write(&dir.join("empty.txt"), "");
    let e = Corpus::read(&empty).unwrap_err();
    assert!(e.contains("empty.txt") && e.contains("empty"), "{e}");
    let blank = write(&dir.join("blank.txt"), " \n\n ");
    let e = Corpus::read(&blank).unwrap_err();
    assert!(e.contains("blank.txt") && e.contains("empty"), "{e}");
    std::fs::create_dir_all(dir.join("nothing")).unwrap();
    let e = Corpus::read(&dir.join("nothing")).unwrap_err();
    assert!(e.contains("nothing") && e.contains("no text files"), "{e}");
    write(&dir.join("only-empty/a.txt"), "");
    let e = Corpus::read(&dir.join("only-empty")).unwrap_err();
    assert!(e.contains("only-empty") && e.contains("no text"), "{e}");
    write(&dir.join("mixed/a.txt"), "fine text");
    write(&dir.join("mixed/b.bin"), b"abc\0def");
    let e = Corpus::read(&dir.join("mixed")).unwrap_err();
    assert!(
        e.contains("b.bin") && e.contains("NUL byte at byte 3"),
        "{e}"
    );
    let latin1 = write(&dir.join("latin1.txt"), b"caf\xe9 au lait");
    let e = Corpus::read(&latin1).unwrap_err();
    assert!(
        e.contains("latin1.txt") && e.contains("invalid UTF-8 at byte 3"),
        "{e}"
    );
    let e = Corpus::read(&dir.join("missing.txt")).unwrap_err();
    assert!(e.contains("missing.txt"), "{e}");
}

#[test]
fn bad_token_files_are_refused() {
    let dir = temp_dir("bad-tokens");
    let path = dir.join("t.tokens");
    write_token_file(&path, header(300, 256), &[1, 2, 3, 4, 5, 6]).unwrap();
    let e = TokenFile::open(&path, Some(0x1234)).unwrap_err();
    assert!(
        e.contains("another tokenizer") && e.contains("t.tokens"),
        "{e}"
    );
    let bytes = std::fs::read(&path).unwrap();
    let short = write(&dir.join("short.tokens"), &bytes[..bytes.len() - 2]);
    let e = TokenFile::open(&short, None).unwrap_err();
    assert!(e.contains("short.tokens") && e.contains("truncated"), "{e}");
    let stub = write(&dir.join("stub.tokens"), &bytes[..20]);
    let e = TokenFile::open(&stub, None).unwrap_err();
    assert!(
        e.contains("stub.tokens") && e.contains("not a graphtrain token file"),
        "{e}"
    );
    let mut big = bytes.clone();
    let last = big.len() - 4;
    big[last..].copy_from_slice(&300u32.to_le_bytes());
    let big = write(&dir.join("big.tokens"), &big);
    let e = TokenFile::open(&big, None).unwrap_err();
    assert!(
        e.contains("token 5 has id 300") && e.contains("vocab size 300"),
        "{e}"
    );
    let mut version = bytes.clone();
    version[8] = 9;
    let version = write(&dir.join("v.tokens"), &version);
    let e = TokenFile::open(&version, None).unwrap_err();
    assert!(e.contains("version 9"), "{e}");
}

#[test]
fn too_little_text_and_too_small_vocab_are_refused() {
    // seq_len 16: rows of 17, one training plus one validation row need 34 tokens.
    let e = TextData::new(counting(33), 16, 0.05).unwrap_err();
    assert!(e.contains("33 tokens") && e.contains("need 34"), "{e}");
    assert!(TextData::new(counting(34), 16, 0.05).is_ok());
    let e = TextTokenizer::train_bpe(["some text"].into_iter(), 64).unwrap_err();
    assert!(e.contains("at least 257") && e.contains("64"), "{e}");
}

#[test]
fn tokenizer_larger_than_the_model_vocab_is_refused() {
    let tokens =
        TokenFile::from_ids(header(300, 256), (0..200).map(|i| i % 300).collect()).unwrap();
    let data = DataSource::Text(Arc::new(TextData::new(tokens, 16, 0.2).unwrap()));
    let cfg = || TrainConfig {
        data: data.clone(),
        seed: 0,
        lr: LrSchedule::constant(1e-3),
        optim: OptimConfig::default(),
    };
    let model = tiny_with_vocab(256);
    let e = Trainer::new(&model, cfg(), &Pipeline::new(Vec::new()))
        .err()
        .unwrap()
        .to_string();
    assert!(
        e.contains("vocab size 300") && e.contains("vocab_size 256"),
        "{e}"
    );
    let model = Llama3Config {
        seq_len: 8,
        ..tiny_with_vocab(512)
    };
    let e = Trainer::new(&model, cfg(), &Pipeline::new(Vec::new()))
        .err()
        .unwrap()
        .to_string();
    assert!(e.contains("seq_len 16") && e.contains("seq_len 8"), "{e}");
    // A smaller tokenizer is fine; the trainer hands out the held-out rows.
    let model = tiny_with_vocab(512);
    let t = Trainer::new(&model, cfg(), &Pipeline::new(Vec::new())).unwrap();
    let val = t.val_batches().unwrap();
    assert_eq!(val.len(), 1);
    assert_eq!(val[0].tokens.len(), model.batch * model.seq_len);
}

fn graphtrain(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_graphtrain"))
        .args(args)
        .output()
        .expect("the binary runs")
}

fn losses(stdout: &str) -> Vec<f64> {
    stdout
        .lines()
        .filter(|l| l.starts_with("step:"))
        .map(|l| {
            let after = l.split("loss:").nth(1).unwrap().split_whitespace().next();
            after.unwrap().parse().unwrap()
        })
        .collect()
}

#[test]
fn cli_trains_on_a_text_file() {
    let dir = temp_dir("cli");
    let config = dir.join("text.ron");
    std::fs::write(
        &config,
        graphtrain::config::config_to_ron(&tiny_with_vocab(512)),
    )
    .unwrap();
    let text = write(&dir.join("story.txt"), sample_text(200));
    let cache = dir.join("cache");
    let (config, text, cache) = (
        config.to_str().unwrap(),
        text.to_str().unwrap(),
        cache.to_str().unwrap(),
    );
    let base = [
        "run",
        "--config",
        config,
        "--data",
        text,
        "--data-cache",
        cache,
        "--backend",
        "cpu",
        "--lr",
        "1e-2",
    ];
    let o = graphtrain(&[&base[..], &["--steps", "20"]].concat());
    let (out, err) = (
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr),
    );
    assert!(o.status.success(), "{err}\n{out}");
    assert!(
        out.contains("data: ") && out.contains("trained now"),
        "{out}"
    );
    let l = losses(&out);
    assert_eq!(l.len(), 20, "{out}");
    assert!(l.iter().all(|x| x.is_finite()), "{l:?}");
    let first = l[..3].iter().sum::<f64>() / 3.0;
    let last = l[17..].iter().sum::<f64>() / 3.0;
    assert!(last < first - 0.5, "the loss did not fall: {l:?}");
    // The second run reuses the cached tokenizer and tokens.
    let o = graphtrain(&[&base[..], &["--steps", "3"]].concat());
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(out.matches("(cached)").count(), 2, "{out}");
    assert_eq!(losses(&out).len(), 3);
    // Text flags with synthetic data, and a model vocab too small for a BPE, are refused.
    let o = graphtrain(&[
        "run",
        "--config",
        config,
        "--data",
        "fixed",
        "--val-fraction",
        "0.1",
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("--val-fraction applies to text data"),
        "{err}"
    );
    let o = graphtrain(&[
        "run",
        "--config",
        "tiny",
        "--data",
        text,
        "--data-cache",
        cache,
    ]);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success() && err.contains("at least 257") && !err.contains("panicked"),
        "{err}"
    );
}
