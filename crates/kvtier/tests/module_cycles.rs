//! No module cycle in any crate of the workspace: within each crate, the
//! top-level modules (a file or folder under `src/`) import one another in
//! one direction only. A cycle means two modules that cannot be read,
//! tested or changed apart; this test names it.
//!
//! Read from the source as text: every `crate::name` a module's files
//! mention (in `use` lines and paths alike, comments skipped) is an arrow
//! to module `name`. Unit tests are left out (a `tests.rs` file, a file
//! from its `#[cfg(test)]` on, a module the crate root declares for tests
//! only): a test harness may reach any part of its crate (the shm
//! connection's tests serve calls through the real service).

use std::collections::{BTreeMap, BTreeSet};
use std::fs;
use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    for entry in fs::read_dir(dir).expect("readable source dir") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            rust_files(&path, out);
        } else if path.extension().is_some_and(|e| e == "rs") {
            out.push(path);
        }
    }
}

/// The top-level module a file belongs to (`None` for the crate root).
fn top_module(src: &Path, file: &Path) -> Option<String> {
    let rel = file.strip_prefix(src).ok()?;
    let first = rel.components().next()?.as_os_str().to_str()?;
    match first {
        "lib.rs" | "main.rs" => None,
        f => Some(f.trim_end_matches(".rs").to_string()),
    }
}

/// The modules the crate root declares under `#[cfg(test)]`.
fn test_only_modules(src: &Path) -> BTreeSet<String> {
    let root = ["lib.rs", "main.rs"]
        .iter()
        .find_map(|r| fs::read_to_string(src.join(r)).ok())
        .unwrap_or_default();
    let lines: Vec<&str> = root.lines().map(str::trim).collect();
    lines
        .windows(2)
        .filter(|w| w[0] == "#[cfg(test)]")
        .filter_map(|w| w[1].strip_prefix("mod ")?.strip_suffix(';').map(String::from))
        .collect()
}

/// Module `name`'s arrows: the other top-level modules its files name.
fn arrows(src: &Path) -> BTreeMap<String, BTreeSet<String>> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let test_only = test_only_modules(src);
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for file in files {
        let Some(from) = top_module(src, &file) else { continue };
        if test_only.contains(&from) || file.file_name().is_some_and(|n| n == "tests.rs") {
            continue;
        }
        let text = fs::read_to_string(&file).expect("readable source");
        let targets = graph.entry(from.clone()).or_default();
        let code = text.lines().take_while(|l| l.trim() != "#[cfg(test)]");
        for line in code.filter(|l| !l.trim_start().starts_with("//")) {
            let mut rest = line;
            while let Some(i) = rest.find("crate::") {
                rest = &rest[i + "crate::".len()..];
                let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
                // `crate::{a, b}` names several: each is an arrow.
                if name.is_empty() && rest.starts_with('{') {
                    let group = &rest[1..rest.find('}').unwrap_or(rest.len())];
                    for part in group.split(',') {
                        let m: String = part
                            .trim()
                            .chars()
                            .take_while(|c| c.is_alphanumeric() || *c == '_')
                            .collect();
                        if !m.is_empty() && m != from {
                            targets.insert(m);
                        }
                    }
                } else if !name.is_empty() && name != from {
                    targets.insert(name);
                }
            }
        }
    }
    // Arrows to names that are no module of the crate (items of the root).
    let modules: BTreeSet<String> = graph.keys().cloned().collect();
    for targets in graph.values_mut() {
        targets.retain(|t| modules.contains(t));
    }
    graph
}

/// Every cycle's modules, found by depth-first search from each module.
fn cycles(graph: &BTreeMap<String, BTreeSet<String>>) -> Vec<Vec<String>> {
    fn visit(
        graph: &BTreeMap<String, BTreeSet<String>>,
        node: &str,
        path: &mut Vec<String>,
        done: &mut BTreeSet<String>,
        found: &mut Vec<Vec<String>>,
    ) {
        if let Some(i) = path.iter().position(|p| p == node) {
            let mut cycle = path[i..].to_vec();
            cycle.push(node.to_string());
            found.push(cycle);
            return;
        }
        if done.contains(node) {
            return;
        }
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            visit(graph, next, path, done, found);
        }
        path.pop();
        done.insert(node.to_string());
    }
    let mut found = Vec::new();
    let mut done = BTreeSet::new();
    for node in graph.keys() {
        visit(graph, node, &mut Vec::new(), &mut done, &mut found);
    }
    found
}

#[test]
fn no_crate_has_a_module_cycle() {
    let crates = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let mut srcs: Vec<PathBuf> = fs::read_dir(&crates)
        .expect("the crates directory")
        .map(|e| e.expect("dir entry").path().join("src"))
        .filter(|p| p.is_dir())
        .collect();
    srcs.push(crates.join("../python/src"));
    srcs.sort();
    assert!(srcs.len() >= 10, "found only {srcs:?}");
    let mut all = Vec::new();
    for src in &srcs {
        for cycle in cycles(&arrows(src)) {
            all.push(format!("{}: {}", src.display(), cycle.join(" -> ")));
        }
    }
    assert!(all.is_empty(), "module cycles:\n{}", all.join("\n"));
}

/// The check sees a cycle when there is one.
#[test]
fn a_cycle_is_found() {
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("page", vec!["accounts"]),
        ("accounts", vec!["page"]),
        ("store", vec!["page"]),
    ]
    .into_iter()
    .map(|(k, v)| (k.to_string(), v.into_iter().map(String::from).collect()))
    .collect();
    assert_eq!(cycles(&graph), vec![vec!["accounts", "page", "accounts"]]);
}
