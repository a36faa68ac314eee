//! `docs/architecture.md` stays true: every name it quotes in backticks that looks like code (a
//! function, a test, a type, a module path, a source file) still exists. A rename or a removal
//! that leaves the page naming what is gone fails here, so the page a newcomer reads first
//! cannot drift from the code.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

const DOC: &str = "docs/architecture.md";

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    for entry in entries.flatten() {
        let path = entry.path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The code the page may quote: every Rust source of the crate, its tests and benches, and
/// the manifest (for dependency names).
struct Code {
    files: Vec<String>,
    text: String,
}

impl Code {
    fn load() -> Code {
        // The root package and every workspace member under crates/.
        let mut packages = vec![root().to_path_buf()];
        if let Ok(members) = std::fs::read_dir(root().join("crates")) {
            packages.extend(members.flatten().map(|m| m.path()));
        }
        let mut paths = Vec::new();
        let mut text = String::new();
        for package in &packages {
            for dir in ["src", "tests", "benches"] {
                rust_files(&package.join(dir), &mut paths);
            }
            if let Ok(manifest) = std::fs::read_to_string(package.join("Cargo.toml")) {
                text.push_str(&manifest);
            }
        }
        let mut files = Vec::new();
        let own = file!().rsplit('/').next().unwrap_or(file!());
        for p in &paths {
            // This file quotes missing names on purpose: its text is not the code's.
            if !p.ends_with(own) {
                text.push_str(&std::fs::read_to_string(p).expect("a source file reads"));
                text.push('\n');
            }
            let rel = p.strip_prefix(root()).expect("under the root");
            files.push(rel.to_string_lossy().replace('\\', "/"));
        }
        Code { files, text }
    }

    /// Whether `word` stands in the code as a whole identifier.
    fn has_word(&self, word: &str) -> bool {
        let is_ident = |c: char| c.is_ascii_alphanumeric() || c == '_';
        self.text.match_indices(word).any(|(at, _)| {
            let before = self.text[..at].chars().next_back();
            let after = self.text[at + word.len()..].chars().next();
            !before.is_some_and(is_ident) && !after.is_some_and(is_ident)
        })
    }

    /// Whether a file (or a folder) ends with `suffix`; `*` in it matches any run of
    /// characters within one path segment.
    fn has_file(&self, suffix: &str) -> bool {
        let suffix = suffix.trim_end_matches('/');
        // A file, or any folder above it.
        self.files.iter().any(|f| {
            let segments: Vec<&str> = f.split('/').collect();
            (1..=segments.len()).any(|n| glob_suffix(&segments[..n].join("/"), suffix))
        })
    }

    /// `a::b::c`: a module path of the crate, or a path whose last name is in the code.
    fn has_path(&self, path: &str) -> bool {
        let path = path.split('(').next().unwrap_or(path);
        let segments: Vec<&str> = path.split("::").collect();
        let as_module = segments.join("/");
        self.has_file(&format!("src/{as_module}.rs"))
            || self.has_file(&format!("src/{as_module}/mod.rs"))
            || segments.last().is_some_and(|last| self.has_word(last))
    }
}

/// Whether `path` ends with `pattern`, segment by segment, `*` matching within a segment.
fn glob_suffix(path: &str, pattern: &str) -> bool {
    let (p, q): (Vec<&str>, Vec<&str>) = (path.split('/').collect(), pattern.split('/').collect());
    if q.len() > p.len() {
        return false;
    }
    p[p.len() - q.len()..]
        .iter()
        .zip(&q)
        .all(|(seg, pat)| match pat.split_once('*') {
            Some((head, tail)) => {
                seg.len() >= head.len() + tail.len() && seg.starts_with(head) && seg.ends_with(tail)
            }
            None => seg == pat,
        })
}

/// What a quoted name is, by its form; `None` for what is not code (flags, headers, prose).
enum Quoted<'a> {
    File(&'a str),
    Path(&'a str),
    Ident(&'a str),
}

fn classify(token: &str) -> Option<Quoted<'_>> {
    let ident = |s: &str| {
        !s.is_empty()
            && s.chars().all(|c| c.is_ascii_alphanumeric() || c == '_')
            && !s.starts_with(|c: char| c.is_ascii_digit())
    };
    if token.ends_with(".rs") || (token.ends_with('/') && !token.contains(' ')) {
        Some(Quoted::File(token))
    } else if token.contains("::") && !token.contains(' ') {
        Some(Quoted::Path(token))
    } else if ident(token) {
        Some(Quoted::Ident(token))
    } else {
        None
    }
}

/// The page's quoted names, less the abbreviations it defines (`` `wl` = `tests/...` ``).
fn quoted_names(doc: &str) -> BTreeSet<&str> {
    let mut names = BTreeSet::new();
    let mut aliases = BTreeSet::new();
    let mut rest = doc;
    while let Some(open) = rest.find('`') {
        let after = &rest[open + 1..];
        let Some(close) = after.find('`') else { break };
        let token = &after[..close];
        if after[close + 1..].trim_start().starts_with("= `") {
            aliases.insert(token);
        } else if !token.contains('\n') {
            names.insert(token);
        }
        rest = &after[close + 1..];
    }
    names.retain(|n| !aliases.contains(n));
    names
}

#[test]
fn every_name_the_architecture_page_quotes_still_exists() {
    let doc = std::fs::read_to_string(root().join(DOC)).expect("the page reads");
    let code = Code::load();
    let missing: Vec<&str> = quoted_names(&doc)
        .into_iter()
        .filter(|token| match classify(token) {
            Some(Quoted::File(f)) => !code.has_file(f),
            Some(Quoted::Path(p)) => !code.has_path(p),
            Some(Quoted::Ident(i)) => !code.has_word(i),
            None => false,
        })
        .collect();
    assert!(
        missing.is_empty(),
        "{DOC} quotes names the code no longer has: {missing:?}"
    );
}

#[test]
fn a_name_that_is_not_in_the_code_is_caught() {
    let code = Code::load();
    assert!(code.has_word("record_write"));
    assert!(!code.has_word("record_writ"));
    assert!(code.has_file("run/readback.rs") && code.has_file("tests/device/device_*.rs"));
    assert!(!code.has_file("run/readbacks.rs"));
    assert!(code.has_path("http::console") && code.has_path("Projection::record_write"));
    assert!(!code.has_path("Projection::record_writes"));
    let names = quoted_names("`wl` = `tests/write_loop.rs`; wl `a_test` and `--flag`");
    assert_eq!(
        names.into_iter().collect::<Vec<_>>(),
        ["--flag", "a_test", "tests/write_loop.rs"]
    );
}
