//! The layering the design rests on, checked on the source.
//!
//! The crate is three layers and the plumbing under them:
//! - `rules`: the pure rules (device vocabulary, usage model, matching),
//!   naming nothing above them, so the node daemon and the extender decide
//!   through the same code without depending on each other;
//! - `node`: the daemon, and `extender`: the scheduler extender, side by
//!   side, neither naming the other;
//! - `config`: the schema and its errors, a leaf every subsystem reads.
//!
//! The units checked are the subsystems: `config`, `extender`, each folder
//! or file under `rules`, `node` and `net`. Among them the graph of
//! `crate::` paths in non-test code has no cycle, so each subsystem can be
//! read (and changed) knowing only what it names.
//!
//! Every `crate::<path>` counts, in a `use`, an expression or a doc link,
//! and so does each path of a `crate::{…}` group.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

/// The layers whose children are subsystems of their own.
const LAYERS: [&str; 3] = ["rules", "node", "net"];

/// Every `.rs` file under `src`, sorted, with the files that only tests
/// compile (declared under `#[cfg(test)]`) left out.
fn product_sources() -> Vec<PathBuf> {
    fn walk(dir: &Path, out: &mut Vec<PathBuf>) {
        let entries = std::fs::read_dir(dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        for entry in entries {
            let path = entry.expect("a readable directory entry").path();
            if path.is_dir() {
                walk(&path, out);
            } else if path.extension().is_some_and(|x| x == "rs") {
                out.push(path);
            }
        }
    }
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    walk(&src, &mut all);
    all.sort();
    let mut tests = BTreeSet::new();
    for path in &all {
        let text = std::fs::read_to_string(path).unwrap();
        let dir = match path.file_name().and_then(|n| n.to_str()) {
            Some("mod.rs" | "lib.rs") => path.parent().unwrap().to_owned(),
            _ => path.with_extension(""),
        };
        for name in test_modules(&text) {
            tests.insert(dir.join(format!("{name}.rs")));
            tests.insert(dir.join(&name).join("mod.rs"));
        }
    }
    all.retain(|p| !tests.contains(p) && !p.ends_with("layering.rs") && !p.ends_with("main.rs"));
    all
}

/// The modules `text` declares as `#[cfg(test)] mod name;`.
fn test_modules(text: &str) -> Vec<String> {
    let mut names = Vec::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        if line.trim() != "#[cfg(test)]" {
            continue;
        }
        let Some(next) = lines.next() else { break };
        let decl = next
            .trim()
            .trim_start_matches("pub(crate) ")
            .trim_start_matches("pub ");
        if let Some(name) = decl.strip_prefix("mod ").and_then(|r| r.strip_suffix(';')) {
            names.push(name.to_owned());
        }
    }
    names
}

/// `text` without its `#[cfg(test)]` items (a `mod tests { … }`, a test
/// helper): what the product compiles.
fn without_tests(text: &str) -> String {
    let mut out = String::new();
    let mut lines = text.lines();
    while let Some(line) = lines.next() {
        if line.trim() != "#[cfg(test)]" {
            out.push_str(line);
            out.push('\n');
            continue;
        }
        // Skip the item: up to its `;` or its braces' close.
        let mut depth = 0i64;
        let mut opened = false;
        for item in lines.by_ref() {
            depth += item.matches('{').count() as i64 - item.matches('}').count() as i64;
            opened |= item.contains('{');
            if (opened && depth <= 0) || (!opened && item.trim_end().ends_with(';')) {
                break;
            }
        }
    }
    out
}

/// The crate paths `text` names (`a::b::c` for `crate::a::b::c`), with the
/// line of each.
fn crate_paths(text: &str) -> Vec<(usize, String)> {
    let path = |s: &str| -> String {
        let s = s.trim_start();
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_' || *c == ':')
            .collect::<String>()
            .trim_end_matches(':')
            .to_owned()
    };
    let mut found = Vec::new();
    for (at, _) in text.match_indices("crate::") {
        let line = text[..at].matches('\n').count() + 1;
        let rest = &text[at + "crate::".len()..];
        let Some(group) = rest.strip_prefix('{') else {
            found.push((line, path(rest)));
            continue;
        };
        // A group `{a::b, c, d::{e, f}}` names a::b, c and d: the paths at
        // depth 0.
        let mut depth = 0;
        let mut start = true;
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => start = true,
                _ if start && !c.is_whitespace() => {
                    found.push((line, path(&group[i..])));
                    start = false;
                }
                _ => {}
            }
        }
    }
    // `crate::` not followed by a name (in a string, say) names nothing.
    found.retain(|(_, m)| !m.is_empty());
    found
}

/// The subsystem a crate path (or a file's path under `src`) is in.
fn subsystem(path: &str) -> String {
    let mut parts = path.split("::").filter(|p| !p.is_empty());
    let first = parts.next().unwrap_or_default();
    match (LAYERS.contains(&first), parts.next()) {
        (true, Some(second)) => format!("{first}::{second}"),
        _ => first.to_owned(),
    }
}

/// The subsystem of a file under `src`.
fn file_subsystem(file: &Path) -> String {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let rel = file.strip_prefix(&src).unwrap().with_extension("");
    let path: Vec<&str> = rel
        .iter()
        .map(|c| c.to_str().unwrap())
        .filter(|c| *c != "mod")
        .collect();
    subsystem(&path.join("::"))
}

/// Which subsystems each subsystem names in non-test code, each edge with
/// the first place that makes it.
fn graph() -> BTreeMap<String, BTreeMap<String, String>> {
    let mut graph: BTreeMap<String, BTreeMap<String, String>> = BTreeMap::new();
    for file in product_sources() {
        let from = file_subsystem(&file);
        let text = without_tests(&std::fs::read_to_string(&file).unwrap());
        let edges = graph.entry(from.clone()).or_default();
        for (line, path) in crate_paths(&text) {
            let to = subsystem(&path);
            if to != from {
                let at = file.strip_prefix(env!("CARGO_MANIFEST_DIR")).unwrap();
                edges
                    .entry(to)
                    .or_insert_with(|| format!("{}:{line}", at.display()));
            }
        }
    }
    graph
}

/// The places where `from`'s subsystems name one that `refused` refuses.
fn naming(from: impl Fn(&str) -> bool, refused: impl Fn(&str) -> bool) -> Vec<String> {
    let mut bad = Vec::new();
    for (a, edges) in graph() {
        for (b, at) in edges {
            if from(&a) && refused(&b) {
                bad.push(format!("{at}: {a} names {b}"));
            }
        }
    }
    bad
}

fn assert_none(bad: Vec<String>, what: &str) {
    assert!(bad.is_empty(), "{what}:\n{}", bad.join("\n"));
}

#[test]
fn the_subsystems_form_no_cycle() {
    let graph = graph();
    // Tarjan's strongly connected components; any with two or more
    // subsystems is a cycle.
    struct Walk<'g> {
        graph: &'g BTreeMap<String, BTreeMap<String, String>>,
        index: BTreeMap<&'g str, usize>,
        low: BTreeMap<&'g str, usize>,
        stack: Vec<&'g str>,
        cycles: Vec<Vec<&'g str>>,
    }
    impl<'g> Walk<'g> {
        fn visit(&mut self, v: &'g str) {
            let i = self.index.len();
            self.index.insert(v, i);
            self.low.insert(v, i);
            self.stack.push(v);
            for w in self.graph.get(v).into_iter().flat_map(|e| e.keys()) {
                if !self.index.contains_key(w.as_str()) {
                    self.visit(w);
                    let low = self.low[v].min(self.low[w.as_str()]);
                    self.low.insert(v, low);
                } else if self.stack.contains(&w.as_str()) {
                    let low = self.low[v].min(self.index[w.as_str()]);
                    self.low.insert(v, low);
                }
            }
            if self.low[v] == self.index[v] {
                let at = self.stack.iter().position(|s| *s == v).unwrap();
                let component = self.stack.split_off(at);
                if component.len() > 1 {
                    self.cycles.push(component);
                }
            }
        }
    }
    let mut walk = Walk {
        graph: &graph,
        index: BTreeMap::new(),
        low: BTreeMap::new(),
        stack: Vec::new(),
        cycles: Vec::new(),
    };
    for v in graph.keys() {
        if !walk.index.contains_key(v.as_str()) {
            walk.visit(v);
        }
    }
    let described: Vec<String> = walk
        .cycles
        .iter()
        .map(|c| {
            let mut edges = Vec::new();
            for a in c {
                for (b, at) in &graph[*a] {
                    if c.contains(&b.as_str()) {
                        edges.push(format!("  {at}: {a} -> {b}"));
                    }
                }
            }
            format!("{}:\n{}", c.join(", "), edges.join("\n"))
        })
        .collect();
    assert_none(described, "subsystems in a cycle");
}

#[test]
fn the_rules_name_nothing_above_them() {
    // `api` is the generated kubelet wire types (a leaf), which the device
    // model encodes to measure message sizes.
    assert_none(
        naming(
            |a| a.starts_with("rules::"),
            |b| !b.starts_with("rules::") && b != "api",
        ),
        "the rules reach above themselves",
    );
}

#[test]
fn the_config_schema_is_a_leaf() {
    // It names the device vocabulary its keys are in and the plumbing whose
    // bounds it checks (a socket path's length, an HTTP server's limits),
    // and nothing else.
    assert_none(
        naming(
            |a| a == "config",
            |b| b != "rules::device" && !b.starts_with("net::"),
        ),
        "the config schema names a subsystem",
    );
}

#[test]
fn the_extender_and_the_daemon_name_each_other_nowhere() {
    assert_none(
        naming(|a| a == "extender", |b| b.starts_with("node::")),
        "the extender names the daemon",
    );
    assert_none(
        naming(|a| a.starts_with("node::"), |b| b == "extender"),
        "the daemon names the extender",
    );
}

#[test]
fn each_frontend_stops_at_the_grant_pipeline() {
    // DRA and the device plugin both reach enforcement through the grant
    // pipeline, and the pod matcher decides without it.
    assert_none(
        naming(|a| a == "node::dra", |b| b == "node::plugin"),
        "DRA names the device-plugin frontend",
    );
    assert_none(
        naming(|a| a == "node::matcher", |b| b == "node::enforcement"),
        "the pod matcher names enforcement",
    );
}

#[test]
fn every_form_of_a_crate_path_is_seen() {
    // Spelt `krate` here, or the check on this very file would see it.
    let text = "use krate::rules::device::Resource;\n\
                use krate::{\n    rules::usage::{Keys, Ledger},\n    node::matcher, config::Config,\n};\n\
                /// [`krate::node::plugin::Grant`]\n\
                let s = \"krate::\";"
        .replace("krate", "crate");
    let found: Vec<(usize, String)> = crate_paths(&text)
        .into_iter()
        .map(|(l, p)| (l, subsystem(&p)))
        .collect();
    let names: Vec<(usize, &str)> = found.iter().map(|(l, m)| (*l, m.as_str())).collect();
    assert_eq!(
        names,
        [
            (1, "rules::device"),
            (2, "rules::usage"),
            (2, "node::matcher"),
            (2, "config"),
            (6, "node::plugin")
        ]
    );
    let code = "use a;\n#[cfg(test)]\nmod tests {\n    use crate::node;\n}\nfn b() {}\n";
    assert_eq!(without_tests(code), "use a;\nfn b() {}\n");
    assert_eq!(
        test_modules("#[cfg(test)]\nmod actor_tests;\n"),
        ["actor_tests"]
    );
}
