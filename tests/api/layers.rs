//! The layers of `docs/architecture.md` (section 1) point one way: each uses only the layers
//! below it. This reads every `crate::` path in the code of `src/` (the `use crate::` lines,
//! and paths written out in code; comments and string literals left out) and fails on a use
//! the table forbids, naming the file, the line and both layers. A new top-level module
//! fails too, until it has its place in the table.
//!
//! Paths that stay inside a module (`super::`, `self::`) cannot cross a layer, so they are
//! not read. The crate roots are not read: `lib.rs` only declares the modules, and `main.rs`
//! uses the library from above every layer.

use std::fmt;
use std::path::{Path, PathBuf};

/// Section 1's table as data: its rows top first, each with its modules. A module may use
/// the modules of any row below its own; never its own row's others, nor a row above.
const ROWS: &[(&str, &[&str])] = &[
    ("the HTTP edge", &["http"]),
    ("the wiring", &["app"]),
    ("the flags", &["config"]),
    (
        "the users of the fold",
        &["write_loop", "reader", "watch", "device", "startup"],
    ),
    ("the projection", &["projection"]),
    ("the account domain", &["account"]),
    ("the store port", &["store"]),
    ("the stall watch", &["stall"]),
    ("the metrics", &["metrics"]),
    (
        "the leaves",
        &["auth", "backoff", "log_limit", "log_writer", "request_note"],
    ),
    ("the flags' parsers", &["flag"]),
];

/// Uses within one row that the section names: the watch hub reads the reader's history
/// types.
const ACROSS: &[(&str, &str)] = &[("watch", "reader")];

/// Uses the rows would allow but the section forbids: a device run talks to the store
/// directly, never through the projection.
const NEVER: &[(&str, &str)] = &[("device", "projection")];

const DOC: &str = "docs/architecture.md";

/// Where a module stands: its row's index (0 at the top) and the row's name.
fn row_of(module: &str) -> Option<(usize, &'static str)> {
    ROWS.iter()
        .enumerate()
        .find(|(_, (_, modules))| modules.contains(&module))
        .map(|(i, (name, _))| (i, *name))
}

/// Why `from` may not use `to`, or `None` when the table allows it.
fn forbidden(from: &str, to: &str) -> Option<String> {
    if from == to || ACROSS.contains(&(from, to)) {
        return None;
    }
    let Some((from_row, from_name)) = row_of(from) else {
        return Some(format!(
            "`{from}` has no place in the layer table ({DOC}, section 1)"
        ));
    };
    let Some((to_row, to_name)) = row_of(to) else {
        return Some(format!(
            "`{to}` has no place in the layer table ({DOC}, section 1)"
        ));
    };
    if NEVER.contains(&(from, to)) {
        return Some(format!(
            "`{from}` ({from_name}) may never use `{to}` ({to_name})"
        ));
    }
    let where_to = match to_row.cmp(&from_row) {
        std::cmp::Ordering::Greater => return None,
        std::cmp::Ordering::Equal => "beside it, in the same row",
        std::cmp::Ordering::Less => "above it",
    };
    Some(format!(
        "`{from}` ({from_name}) uses `{to}` ({to_name}), which stands {where_to}"
    ))
}

/// One use the table forbids.
#[derive(Debug)]
struct Violation {
    file: String,
    line: usize,
    why: String,
}

impl fmt::Display for Violation {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}: {}", self.file, self.line, self.why)
    }
}

/// `text` with its comments and the insides of its string and char literals blanked out,
/// newlines kept (so offsets keep their lines).
fn code_only(text: &str) -> String {
    let chars: Vec<char> = text.chars().collect();
    let mut out = String::with_capacity(text.len());
    let blank = |c: char| if c == '\n' { '\n' } else { ' ' };
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        let next = chars.get(i + 1).copied();
        if c == '/' && next == Some('/') {
            while i < chars.len() && chars[i] != '\n' {
                out.push(' ');
                i += 1;
            }
        } else if c == '/' && next == Some('*') {
            let mut depth = 0;
            while i < chars.len() {
                if chars[i] == '/' && chars.get(i + 1) == Some(&'*') {
                    depth += 1;
                    out.push_str("  ");
                    i += 2;
                } else if chars[i] == '*' && chars.get(i + 1) == Some(&'/') {
                    depth -= 1;
                    out.push_str("  ");
                    i += 2;
                    if depth == 0 {
                        break;
                    }
                } else {
                    out.push(blank(chars[i]));
                    i += 1;
                }
            }
        } else if c == 'r' && (next == Some('"') || next == Some('#')) && !ident_before(&chars, i) {
            // A raw string: r"..." or r#"..."#, with as many hashes to close as to open.
            let mut j = i + 1;
            while chars.get(j) == Some(&'#') {
                j += 1;
            }
            if chars.get(j) != Some(&'"') {
                out.push(c);
                i += 1;
                continue;
            }
            let hashes = j - i - 1;
            out.extend(std::iter::repeat_n(' ', j + 1 - i));
            i = j + 1;
            while i < chars.len() {
                if chars[i] == '"' && (1..=hashes).all(|k| chars.get(i + k) == Some(&'#')) {
                    out.extend(std::iter::repeat_n(' ', hashes + 1));
                    i += hashes + 1;
                    break;
                }
                out.push(blank(chars[i]));
                i += 1;
            }
        } else if c == '"' {
            out.push(' ');
            i += 1;
            while i < chars.len() && chars[i] != '"' {
                let skip = if chars[i] == '\\' { 2 } else { 1 };
                for k in 0..skip {
                    if let Some(&ch) = chars.get(i + k) {
                        out.push(blank(ch));
                    }
                }
                i += skip;
            }
            out.push(' ');
            i += 1;
        } else if c == '\'' && next == Some('\\') {
            // An escaped char literal: '\n', '\'', '\u{..}'.
            out.push(' ');
            i += 2;
            out.push(' ');
            while i < chars.len() && chars[i] != '\'' {
                out.push(' ');
                i += 1;
            }
            out.push(' ');
            i += 1;
        } else if c == '\'' && chars.get(i + 2) == Some(&'\'') {
            // A one-char literal, such as '"'; anything else after a quote is a lifetime.
            out.push_str("   ");
            i += 3;
        } else {
            out.push(c);
            i += 1;
        }
    }
    out
}

fn is_ident(c: char) -> bool {
    c.is_ascii_alphanumeric() || c == '_'
}

fn ident_before(chars: &[char], at: usize) -> bool {
    at > 0 && is_ident(chars[at - 1])
}

/// The identifier that starts at `at` (after blanks), and where it starts.
fn ident_at(code: &str, at: usize) -> Option<(usize, &str)> {
    let rest = &code[at..];
    let start = at + (rest.len() - rest.trim_start().len());
    let len = code[start..]
        .find(|c: char| !is_ident(c))
        .unwrap_or(code.len() - start);
    (len > 0).then(|| (start, &code[start..start + len]))
}

/// Every module of the crate that `code` names through a `crate::` path, with the byte
/// offset where it is named. A group (`crate::{a::X, b::Y}`) names each of its members.
fn crate_uses(code: &str) -> Vec<(usize, String)> {
    let mut uses = Vec::new();
    for (at, _) in code.match_indices("crate::") {
        if code[..at].chars().next_back().is_some_and(is_ident) {
            continue;
        }
        let after = at + "crate::".len();
        let rest = code[after..].trim_start();
        if let Some(group) = rest.strip_prefix('{') {
            let open = code.len() - group.len();
            let mut depth = 1;
            let mut item_start = open;
            for (k, c) in group.char_indices() {
                let here = open + k;
                match c {
                    '{' => depth += 1,
                    '}' | ',' if depth == 1 => {
                        if let Some((start, name)) = ident_at(code, item_start) {
                            uses.push((start, name.to_owned()));
                        }
                        if c == '}' {
                            break;
                        }
                        item_start = here + 1;
                    }
                    '}' => depth -= 1,
                    _ => {}
                }
            }
        } else if let Some((start, name)) = ident_at(code, after) {
            uses.push((start, name.to_owned()));
        }
    }
    uses
}

/// The top-level module a source file belongs to (`src/http/gate/io.rs` -> `http`), or
/// `None` for the crate roots.
fn module_of(relative: &Path) -> Option<String> {
    let first = relative.components().next()?.as_os_str().to_str()?;
    let module = first.strip_suffix(".rs").unwrap_or(first);
    (!["lib", "main"].contains(&module)).then(|| module.to_owned())
}

/// The uses in one file's text that the table forbids. `file` is the path shown, relative to
/// `src/`.
fn check_file(file: &Path, text: &str) -> Vec<Violation> {
    let Some(from) = module_of(file) else {
        return Vec::new();
    };
    let code = code_only(text);
    crate_uses(&code)
        .into_iter()
        .filter_map(|(at, to)| {
            forbidden(&from, &to).map(|why| Violation {
                file: format!("src/{}", file.display()),
                line: code[..at].matches('\n').count() + 1,
                why,
            })
        })
        .collect()
}

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

/// Every `.rs` file under `dir`, recursively, relative to `base`.
fn rust_files(base: &Path, dir: &Path, out: &mut Vec<PathBuf>) {
    let mut entries: Vec<_> = std::fs::read_dir(dir)
        .expect("a source folder reads")
        .flatten()
        .map(|e| e.path())
        .collect();
    entries.sort();
    for path in entries {
        if path.is_dir() {
            rust_files(base, &path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path.strip_prefix(base).expect("under src").to_path_buf());
        }
    }
}

#[test]
fn every_crate_path_in_src_follows_the_layer_table() {
    let src = root().join("src");
    let mut files = Vec::new();
    rust_files(&src, &src, &mut files);
    assert!(
        files.len() > 50,
        "src/ holds the crate ({} files)",
        files.len()
    );
    let mut violations = Vec::new();
    let mut uses = 0;
    for file in &files {
        let text = std::fs::read_to_string(src.join(file)).expect("a source file reads");
        uses += crate_uses(&code_only(&text)).len();
        violations.extend(check_file(file, &text));
    }
    // The reading found the crate's imports (over 300 today), not nothing.
    assert!(uses > 100, "only {uses} crate:: paths read in src/");
    let shown: Vec<String> = violations.iter().map(|v| v.to_string()).collect();
    assert!(
        shown.is_empty(),
        "uses the layer table ({DOC}, section 1) forbids:\n{}",
        shown.join("\n")
    );
}

/// Every top-level module of the crate has its row, and every module of the table stands in
/// the section's text: the data above and the page say the same.
#[test]
fn the_layer_table_places_every_module_and_matches_the_doc() {
    let src = root().join("src");
    let mut modules: Vec<String> = std::fs::read_dir(&src)
        .expect("src/ reads")
        .flatten()
        .filter_map(|e| module_of(Path::new(&e.file_name())))
        .collect();
    modules.sort();
    modules.dedup();
    let unplaced: Vec<&String> = modules.iter().filter(|m| row_of(m).is_none()).collect();
    assert!(
        unplaced.is_empty(),
        "modules with no row in the layer table: {unplaced:?}"
    );
    let doc = std::fs::read_to_string(root().join(DOC)).expect("the doc reads");
    let section = doc
        .split("\n## ")
        .find(|s| s.starts_with("1. Layers"))
        .expect("section 1, Layers");
    let missing: Vec<&str> = ROWS
        .iter()
        .flat_map(|(_, modules)| modules.iter().copied())
        .filter(|m| !section.contains(&format!("`{m}`")) && !table_names(section, m))
        .collect();
    assert!(
        missing.is_empty(),
        "modules of the table that section 1 does not name: {missing:?}"
    );
    assert!(
        section.contains("tests/api/layers.rs"),
        "section 1 says which test enforces it"
    );
}

/// Whether the section's drawn table (its code block) names `module` as a word.
fn table_names(section: &str, module: &str) -> bool {
    section
        .split("```")
        .nth(1)
        .is_some_and(|table| table.split(|c: char| !is_ident(c)).any(|w| w == module))
}

/// The check itself: a use up the table, across a row or into a forbidden pair is named with
/// its file, line and layers; a use down the table, inside a module, or in a comment or a
/// string is not.
#[test]
fn the_check_names_a_forbidden_use_with_its_file_line_and_layers() {
    let text = "//! The port.\n\
                use crate::account::AccountId;\n\
                use crate::http::ApiError;\n\
                // crate::app is only named here\n\
                const S: &str = \"crate::app\";\n\
                fn f() { crate::store::memory::x(); crate::app::y(); }\n";
    let found = check_file(Path::new("store/mod.rs"), text);
    let shown: Vec<String> = found.iter().map(|v| v.to_string()).collect();
    assert_eq!(
        shown,
        [
            "src/store/mod.rs:2: `store` (the store port) uses `account` (the account domain), \
             which stands above it",
            "src/store/mod.rs:3: `store` (the store port) uses `http` (the HTTP edge), which \
             stands above it",
            "src/store/mod.rs:6: `store` (the store port) uses `app` (the wiring), which \
             stands above it",
        ]
    );
    let group = "use crate::{\n    projection::Projection,\n    write_loop::WriteService,\n};\n";
    let found = check_file(Path::new("reader/balance.rs"), group);
    let shown: Vec<String> = found.iter().map(|v| v.to_string()).collect();
    assert_eq!(
        shown,
        [
            "src/reader/balance.rs:3: `reader` (the users of the fold) uses `write_loop` (the users \
          of the fold), which stands beside it, in the same row"
        ]
    );
    assert!(check_file(Path::new("watch/mod.rs"), "use crate::reader::History;").is_empty());
    let never = check_file(Path::new("device/run.rs"), "use crate::projection::P;");
    assert_eq!(
        never[0].why,
        "`device` (the users of the fold) may never use `projection` (the projection)"
    );
    let unplaced = check_file(Path::new("newcomer.rs"), "use crate::store::EventLog;");
    assert_eq!(
        unplaced[0].why,
        format!("`newcomer` has no place in the layer table ({DOC}, section 1)")
    );
    assert!(check_file(Path::new("lib.rs"), "use crate::http::X;").is_empty());
}
