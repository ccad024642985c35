//! The layering the design rests on, checked on the source: the usage model
//! is the bottom of the crate (it names only the device vocabulary, which
//! names nothing above it), so the node daemon and the extender share it
//! without either depending on the other; the extender reads the pods'
//! annotations through it, never through the node's pod matcher.
//!
//! Every `crate::<module>` path counts, in a `use`, an expression or a doc
//! link, and so does each module of a `crate::{…}` group.

use std::path::{Path, PathBuf};

/// Every `.rs` file under `src/<dir>`, sorted.
fn sources(dir: &str) -> Vec<PathBuf> {
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
    let mut out = Vec::new();
    walk(
        &Path::new(env!("CARGO_MANIFEST_DIR")).join("src").join(dir),
        &mut out,
    );
    out.sort();
    assert!(!out.is_empty(), "no sources under src/{dir}");
    out
}

/// The top-level crate modules `text` names, with the line of each.
fn crate_modules(text: &str) -> Vec<(usize, String)> {
    let ident = |s: &str| -> String {
        let s = s.trim_start();
        s.chars()
            .take_while(|c| c.is_alphanumeric() || *c == '_')
            .collect()
    };
    let mut found = Vec::new();
    for (at, _) in text.match_indices("crate::") {
        let line = text[..at].matches('\n').count() + 1;
        let rest = &text[at + "crate::".len()..];
        let Some(group) = rest.strip_prefix('{') else {
            found.push((line, ident(rest)));
            continue;
        };
        // A group `{a::b, c, d::{e, f}}` names a, c and d: the names at depth 0.
        let mut depth = 0;
        let mut start = true;
        for (i, c) in group.char_indices() {
            match c {
                '{' => depth += 1,
                '}' if depth == 0 => break,
                '}' => depth -= 1,
                ',' if depth == 0 => start = true,
                _ if start && !c.is_whitespace() => {
                    found.push((line, ident(&group[i..])));
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

/// `file:line: module` for each crate module named under `src/<dir>` that
/// `allowed` refuses.
fn named(dir: &str, allowed: impl Fn(&str) -> bool) -> Vec<String> {
    let mut bad = Vec::new();
    for path in sources(dir) {
        let text = std::fs::read_to_string(&path).unwrap();
        for (line, module) in crate_modules(&text) {
            if !allowed(&module) {
                let file = path
                    .strip_prefix(env!("CARGO_MANIFEST_DIR"))
                    .unwrap_or(&path);
                bad.push(format!("{}:{line}: {module}", file.display()));
            }
        }
    }
    bad
}

#[test]
fn the_usage_model_names_only_itself_and_the_device_vocabulary() {
    let bad = named("usage", |m| m == "usage" || m == "device");
    assert!(
        bad.is_empty(),
        "usage reaches above itself:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_device_vocabulary_names_nothing_above_it() {
    // `api` is the generated kubelet wire types (a leaf), which the
    // device model's tests encode to measure message sizes.
    let bad = named("device", |m| m == "device" || m == "api");
    assert!(
        bad.is_empty(),
        "device reaches above itself:\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_extender_reads_annotations_through_usage_not_the_matcher() {
    let bad = named("extender", |m| m != "matcher");
    assert!(
        bad.is_empty(),
        "the extender imports the matcher:\n{}",
        bad.join("\n")
    );
}

#[test]
fn every_form_of_a_crate_path_is_seen() {
    // Spelt `krate` here, or the check on this very file would see it.
    let text = "use krate::device::Resource;\n\
                use krate::{\n    usage::{Keys, Ledger},\n    matcher, config::Config,\n};\n\
                /// [`krate::plugin::Grant`]\n\
                let s = \"krate::\";"
        .replace("krate", "crate");
    let found = crate_modules(&text);
    let names: Vec<(usize, &str)> = found.iter().map(|(l, m)| (*l, m.as_str())).collect();
    assert_eq!(
        names,
        [
            (1, "device"),
            (2, "usage"),
            (2, "matcher"),
            (2, "config"),
            (6, "plugin")
        ]
    );
}
