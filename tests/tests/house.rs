//! The house's modules import each other one way: no cycle, in the engine, the tools and the
//! operator; and the engine does not carry the tools' dependencies.
//!
//! A ring of imports (config → stuck → metrics → dlq → record → config in the engine, kafka ↔
//! render in the operator, as there were) means no module of the ring can be read, tested or
//! moved without the others. This reads each crate's own sources: a top-level module is a file
//! of `src/` (or a folder of it, all its files together), an edge is a `crate::<module>` path in
//! its non-test code, and the test fails on the first cycle it finds, naming it.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// How deep a module is named: the crate's top-level modules (files and folders of `src/`),
/// or each file of the folders as well (`intake::rebalance`; a folder's `mod.rs` is the folder).
#[derive(Clone, Copy)]
enum Depth {
    Folders,
    Files,
}

/// Module name → the modules its non-test code names.
fn module_graph(src: &Path, depth: Depth) -> BTreeMap<String, BTreeSet<String>> {
    let modules = modules(src, depth);
    let known: BTreeSet<String> = modules.keys().cloned().collect();
    let mut graph: BTreeMap<String, BTreeSet<String>> = BTreeMap::new();
    for (module, files) in modules {
        let edges = graph.entry(module.clone()).or_default();
        for file in files {
            let text = std::fs::read_to_string(&file).expect("read a source file");
            for path in crate_paths(non_test_code(&text)) {
                let Some(target) = resolve(&path, &known) else {
                    continue;
                };
                if target != module {
                    edges.insert(target);
                }
            }
        }
    }
    graph
}

/// The module a `crate::` path (its segments) lands in: the deepest known one.
fn resolve(path: &[String], known: &BTreeSet<String>) -> Option<String> {
    (1..=path.len().min(2))
        .rev()
        .map(|n| path[..n].join("::"))
        .find(|name| known.contains(name))
}

/// Each module of `src` with its files (`lib.rs` and `main.rs` are roots, not modules; a
/// `tests.rs` is test code).
fn modules(src: &Path, depth: Depth) -> BTreeMap<String, Vec<PathBuf>> {
    let mut modules: BTreeMap<String, Vec<PathBuf>> = BTreeMap::new();
    for entry in std::fs::read_dir(src).expect("read src") {
        let path = entry.expect("dir entry").path();
        let name = stem(&path);
        if path.is_dir() {
            // A `tests.rs` is a module's tests (`#[cfg(test)] mod tests;`), not its code.
            for file in rust_files(&path).into_iter().filter(|f| stem(f) != "tests") {
                let module = match depth {
                    Depth::Folders => name.clone(),
                    Depth::Files => {
                        let inner = file.strip_prefix(&path).expect("a file of the folder");
                        let first = inner.iter().next().map(|s| stem(Path::new(s)));
                        match first.as_deref() {
                            None | Some("mod") => name.clone(),
                            Some(file_module) => format!("{name}::{file_module}"),
                        }
                    }
                };
                modules.entry(module).or_default().push(file);
            }
        } else if path.extension().is_some_and(|e| e == "rs") && name != "lib" && name != "main" {
            modules.entry(name).or_default().push(path);
        }
    }
    modules
}

fn stem(path: &Path) -> String {
    path.file_stem()
        .and_then(|n| n.to_str())
        .unwrap_or_default()
        .to_string()
}

fn rust_files(dir: &Path) -> Vec<PathBuf> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).expect("read a module folder") {
        let path = entry.expect("dir entry").path();
        if path.is_dir() {
            files.extend(rust_files(&path));
        } else if path.extension().is_some_and(|e| e == "rs") {
            files.push(path);
        }
    }
    files
}

/// The file up to its test module (`#[cfg(test)]` followed by `mod`), where tests start.
fn non_test_code(text: &str) -> &str {
    let mut at = 0;
    while let Some(i) = text[at..].find("#[cfg(test)]") {
        let after = text[at + i + "#[cfg(test)]".len()..].trim_start();
        if after.starts_with("mod ") {
            return &text[..at + i];
        }
        at += i + 1;
    }
    text
}

/// The lowercase segments of every `crate::` path in `code`, comments left out (a doc link is
/// not an import).
fn crate_paths(code: &str) -> impl Iterator<Item = Vec<String>> + '_ {
    code.lines()
        .filter(|line| !line.trim_start().starts_with("//"))
        .flat_map(|line| {
            line.match_indices("crate::").filter_map(move |(i, _)| {
                let mut segments = Vec::new();
                for s in line[i + "crate::".len()..].split("::") {
                    let name: String = s
                        .chars()
                        .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                        .collect();
                    if !name.starts_with(|c: char| c.is_ascii_lowercase()) {
                        break;
                    }
                    let whole = name.len() == s.len();
                    segments.push(name);
                    if !whole {
                        break;
                    }
                }
                (!segments.is_empty()).then_some(segments)
            })
        })
}

/// A cycle of `graph`, as the modules along it, if there is one.
fn find_cycle(graph: &BTreeMap<String, BTreeSet<String>>) -> Option<Vec<String>> {
    #[derive(Clone, Copy, PartialEq)]
    enum Mark {
        Open,
        Done,
    }
    fn visit(
        node: &str,
        graph: &BTreeMap<String, BTreeSet<String>>,
        marks: &mut BTreeMap<String, Mark>,
        path: &mut Vec<String>,
    ) -> Option<Vec<String>> {
        match marks.get(node) {
            Some(Mark::Done) => return None,
            Some(Mark::Open) => {
                let start = path.iter().position(|n| n == node).unwrap_or(0);
                let mut cycle = path[start..].to_vec();
                cycle.push(node.to_string());
                return Some(cycle);
            }
            None => {}
        }
        marks.insert(node.to_string(), Mark::Open);
        path.push(node.to_string());
        for next in graph.get(node).into_iter().flatten() {
            if let Some(cycle) = visit(next, graph, marks, path) {
                return Some(cycle);
            }
        }
        path.pop();
        marks.insert(node.to_string(), Mark::Done);
        None
    }
    let mut marks = BTreeMap::new();
    for node in graph.keys() {
        if let Some(cycle) = visit(node, graph, &mut marks, &mut Vec::new()) {
            return Some(cycle);
        }
    }
    None
}

/// Asserts that the crate at `crate_dir` (from the workspace root) has no import cycle.
fn assert_no_cycle(crate_dir: &str, at_least: usize) {
    let src = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(crate_dir)
        .join("src");
    for depth in [Depth::Folders, Depth::Files] {
        let graph = module_graph(&src, depth);
        assert!(
            graph.len() >= at_least,
            "modules not found in {}",
            src.display()
        );
        if let Some(cycle) = find_cycle(&graph) {
            panic!("an import cycle in {crate_dir}: {}", cycle.join(" → "));
        }
    }
}

#[test]
fn the_engine_s_modules_import_each_other_one_way() {
    assert_no_cycle("worker", 12);
}

#[test]
fn the_tools_modules_import_each_other_one_way() {
    assert_no_cycle("tools", 4);
}

/// What only the tools use (the demo's progress bars, loadgen's Zipf law) stays out of the
/// engine's manifest, so a stage's build and image do not carry it.
#[test]
fn the_engine_does_not_depend_on_the_tools_crates() {
    let manifest =
        std::fs::read_to_string(Path::new(env!("CARGO_MANIFEST_DIR")).join("../worker/Cargo.toml"))
            .expect("read worker/Cargo.toml");
    for line in manifest.lines().map(str::trim) {
        for tools_only in ["indicatif", "rand_distr"] {
            assert!(
                !line.starts_with(tools_only),
                "worker/Cargo.toml depends on {tools_only}: it belongs to tools/"
            );
        }
    }
}

#[test]
fn the_operator_s_modules_import_each_other_one_way() {
    assert_no_cycle("operator", 10);
}

#[test]
fn a_cycle_is_found_and_test_code_is_not_counted() {
    let graph: BTreeMap<String, BTreeSet<String>> = [
        ("config", vec!["record"]),
        ("record", vec!["offsets"]),
        ("offsets", vec![]),
    ]
    .into_iter()
    .map(|(m, es)| (m.to_string(), es.into_iter().map(String::from).collect()))
    .collect();
    assert_eq!(find_cycle(&graph), None);
    let mut cyclic = graph.clone();
    cyclic
        .get_mut("offsets")
        .unwrap()
        .insert("config".to_string());
    assert_eq!(
        find_cycle(&cyclic),
        Some(
            vec!["config", "record", "offsets", "config"]
                .into_iter()
                .map(String::from)
                .collect()
        )
    );
    let code = "use crate::record::X;\n/// See [`crate::worker::run`].\nfn f() { crate::offsets::g() }\n#[cfg(test)]\nmod tests {\n    use crate::config::Y;\n}\n";
    let found: Vec<Vec<String>> = crate_paths(non_test_code(code)).collect();
    let path = |p: &str| -> Vec<String> { p.split("::").map(String::from).collect() };
    assert_eq!(found, vec![path("record"), path("offsets::g")]);
    let known: BTreeSet<String> = ["intake", "intake::rebalance", "record"]
        .into_iter()
        .map(String::from)
        .collect();
    assert_eq!(
        resolve(&path("intake::rebalance"), &known).as_deref(),
        Some("intake::rebalance")
    );
    assert_eq!(
        resolve(&path("intake::book"), &known).as_deref(),
        Some("intake")
    );
    assert_eq!(resolve(&path("record"), &known).as_deref(), Some("record"));
    assert_eq!(resolve(&path("stage"), &known), None);
}

/// No engine file is over 800 lines: a file that long holds more than one concept (the consumer
/// loop was 1,640 lines before it was split into the loop, the book, the rebalance and the
/// shutdown). Tests past that size go to a `tests.rs` beside the module.
#[test]
fn no_engine_file_is_over_800_lines() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("../worker/src");
    let long: Vec<String> = rust_files(&src)
        .into_iter()
        .filter_map(|file| {
            let lines = std::fs::read_to_string(&file).ok()?.lines().count();
            (lines > 800).then(|| format!("{} ({lines} lines)", file.display()))
        })
        .collect();
    assert!(rust_files(&src).len() > 20, "engine files not found");
    assert!(long.is_empty(), "engine files over 800 lines: {long:?}");
}
