//! The module's shape, checked on its source: the files of
//! `client/io` import one another without a circle, and `impl Io` is in
//! at most two of them.
//!
//! The graph's nodes are the module's files other than `mod.rs` (the
//! module's root: it declares and re-exports the parts and holds `Io`);
//! an edge is a path to a sibling, `super::x::...` or
//! `crate::client::io::x::...`, in a `use` declaration (groups such as
//! `use super::{x::A, y};` included) or written out in code.

use std::collections::{BTreeMap, BTreeSet};

/// The module's files, by module name (`mod.rs` as "mod"), this test's own left out.
fn sources() -> Vec<(String, String)> {
    let dir = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("src/client/io");
    let mut files = Vec::new();
    for entry in std::fs::read_dir(&dir).expect("src/client/io") {
        let path = entry.expect("a directory entry").path();
        if path.extension().is_none_or(|e| e != "rs") {
            continue;
        }
        let name = path.file_stem().expect("a file name").to_string_lossy().into_owned();
        if name != "structure_tests" {
            files.push((name, std::fs::read_to_string(&path).expect("a source file")));
        }
    }
    files.sort();
    files
}

/// `src` without its `//` comments (doc comments name other files freely).
fn code(src: &str) -> String {
    src.lines().map(|l| l.find("//").map_or(l, |i| &l[..i])).collect::<Vec<_>>().join("\n")
}

/// The flat paths of one use tree (`a::{b, c::{d, e}}` -> a::b, a::c::d, a::c::e).
fn flatten(prefix: &str, tree: &str, out: &mut Vec<String>) {
    let tree = tree.trim();
    let Some(open) = tree.find('{') else {
        out.push(format!("{prefix}{tree}"));
        return;
    };
    let head = format!("{prefix}{}", &tree[..open]);
    let inner = &tree[open + 1..tree.rfind('}').expect("a closing brace")];
    let (mut depth, mut start) = (0, 0);
    for (i, ch) in inner.char_indices() {
        match ch {
            '{' => depth += 1,
            '}' => depth -= 1,
            ',' if depth == 0 => {
                flatten(&head, &inner[start..i], out);
                start = i + 1;
            }
            _ => {}
        }
    }
    if !inner[start..].trim().is_empty() {
        flatten(&head, &inner[start..], out);
    }
}

/// Which of `siblings` the file `src` imports or names a path into.
fn imports(src: &str, siblings: &BTreeSet<String>) -> BTreeSet<String> {
    let code = code(src);
    let mut paths = Vec::new();
    // `use` declarations, over as many lines as they take.
    let mut rest = code.as_str();
    while let Some(at) = rest.find("use ") {
        let after = &rest[at + 4..];
        if at > 0 && rest[..at].ends_with(|c: char| c.is_alphanumeric() || c == '_') {
            rest = after; // `because `, not a declaration
            continue;
        }
        let Some(end) = after.find(';') else { break };
        flatten("", &after[..end].split_whitespace().collect::<String>(), &mut paths);
        rest = &after[end..];
    }
    // Paths written out in code (`super::mend::Again::No`).
    for prefix in ["super::", "crate::client::io::"] {
        let mut rest = code.as_str();
        while let Some(at) = rest.find(prefix) {
            paths.push(rest[at..].chars().take_while(|&c| c.is_alphanumeric() || c == '_' || c == ':').collect());
            rest = &rest[at + prefix.len()..];
        }
    }
    let mut found = BTreeSet::new();
    for path in paths {
        let segs: Vec<&str> = path.trim().split("::").collect();
        let target = match segs.as_slice() {
            ["super", x, ..] => Some(*x),
            ["crate", "client", "io", x, ..] => Some(*x),
            _ => None,
        };
        if let Some(x) = target.filter(|x| siblings.contains(*x)) {
            found.insert(x.to_string());
        }
    }
    found
}

/// Each file's imports of its siblings (`mod.rs` left out, see above).
fn graph(files: &[(String, String)]) -> BTreeMap<String, BTreeSet<String>> {
    let siblings: BTreeSet<String> = files.iter().map(|(n, _)| n.clone()).filter(|n| n != "mod").collect();
    files
        .iter()
        .filter(|(n, _)| n != "mod")
        .map(|(n, src)| {
            let mut to = imports(src, &siblings);
            to.remove(n);
            (n.clone(), to)
        })
        .collect()
}

/// A circle in `graph` (its files in order, the first again at the end), if any.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    fn visit(
        n: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        done: &mut BTreeSet<String>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        if let Some(at) = path.iter().position(|p| p == n) {
            let mut cycle = path[at..].to_vec();
            cycle.push(n.to_string());
            return Some(cycle);
        }
        if done.contains(n) {
            return None;
        }
        path.push(n.to_string());
        for next in graph.get(n).into_iter().flatten() {
            if let Some(c) = visit(next, graph, done, path) {
                return Some(c);
            }
        }
        path.pop();
        done.insert(n.to_string());
        None
    }
    let mut done = BTreeSet::new();
    graph.keys().find_map(|n| visit(n, graph, &mut done, &mut Vec::new()))
}

/// Whether a line of code opens an `impl` block of `Io` itself (not `IoCore`).
fn impls_io(line: &str) -> bool {
    let words: Vec<&str> = line.split(|c: char| c.is_whitespace() || c == '{').filter(|w| !w.is_empty()).collect();
    words.first() == Some(&"impl") && (words.get(1) == Some(&"Io") || words.windows(2).any(|w| w == ["for", "Io"]))
}

#[test]
fn the_files_of_client_io_import_one_another_without_a_circle() {
    let g = graph(&sources());
    // The parse sees the imports there are (else it would pass on anything).
    let edges: usize = g.values().map(BTreeSet::len).sum();
    assert!(edges >= 10 && g.get("receive").is_some_and(|to| to.contains("thread")), "{g:?}");
    assert_eq!(find_cycle(&g), None, "an import circle in src/client/io: {g:?}");
}

#[test]
fn impl_io_is_in_at_most_two_files() {
    let with: Vec<String> = sources()
        .into_iter()
        .filter(|(_, src)| code(src).lines().any(impls_io))
        .map(|(n, _)| format!("{n}.rs"))
        .collect();
    assert!(with.len() <= 2, "`impl Io` in {with:?}");
    assert!(with.contains(&"mod.rs".to_string()), "{with:?}");
}

#[test]
fn the_checks_find_a_constructed_circle_and_impl_io() {
    let fake = |srcs: &[(&str, &str)]| graph(&srcs.iter().map(|&(n, s)| (n.into(), s.into())).collect::<Vec<_>>());
    let a = ("a", "//! See `super::c`.\nuse super::b::X;\nuse std::sync::Arc;\n");
    let b = ("b", "use super::{\n    c::{Y, Z},\n    Completion,\n};\nfn f(x: super::Io) {}\n");
    let c_back = ("c", "fn g() {\n    let _ = super::a::h();\n}\n");
    let c_leaf = ("c", "use crate::protocol::Header;\n");
    let g = fake(&[a, b, c_back]);
    assert_eq!(g["a"], BTreeSet::from(["b".to_string()]));
    assert_eq!(g["b"], BTreeSet::from(["c".to_string()]));
    assert_eq!(find_cycle(&g), Some(vec!["a".into(), "b".into(), "c".into(), "a".into()]));
    assert_eq!(find_cycle(&fake(&[a, b, c_leaf])), None);
    let d = ("d", "use crate::client::io::d2::W;\n");
    let d2 = ("d2", "use super::{d, b::X};\n");
    assert_eq!(find_cycle(&fake(&[b, c_leaf, d, d2])), Some(vec!["d".into(), "d2".into(), "d".into()]));
    // Only `Io`'s own blocks count.
    assert!(impls_io("impl Io {") && impls_io("impl Drop for Io {"));
    assert!(!impls_io("impl IoCore {") && !impls_io("impl IoThread {") && !impls_io("    let impl_io = 1;"));
}
