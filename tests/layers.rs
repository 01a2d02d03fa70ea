//! The engine's modules form layers (docs/ARCHITECTURE.md): each may use only the modules
//! below it, so there is no import cycle and no layer reaches up (an executor into `group`, a
//! plan into an executor). Read from the sources: every `crate::name` a file mentions.

use std::collections::BTreeSet;
use std::path::Path;

/// Top to bottom.
const LAYERS: &[&str] = &[
    "abi",
    "api",
    "group",
    "launch",
    "comm",
    "exec",
    "flight",
    "plan",
    "transport",
    "bootstrap",
    "health",
    "liveness",
    "gpu",
    "reduce",
    "types",
    "error",
    "debug",
    "device",
    "param",
    "registry",
];

fn files(dir: &Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

#[test]
fn modules_only_use_the_layers_below_them() {
    let src = Path::new(env!("CARGO_MANIFEST_DIR")).join("src");
    let mut all = Vec::new();
    files(&src, &mut all);
    let mut bad = BTreeSet::new();
    let mut seen = BTreeSet::new();
    for f in all {
        let rel = f.strip_prefix(&src).unwrap();
        let top = rel
            .components()
            .next()
            .unwrap()
            .as_os_str()
            .to_string_lossy()
            .trim_end_matches(".rs")
            .to_string();
        if top == "lib" {
            continue;
        }
        let at = LAYERS
            .iter()
            .position(|l| *l == top)
            .unwrap_or_else(|| panic!("{} is in no layer: add it to LAYERS", rel.display()));
        let text = std::fs::read_to_string(&f).unwrap();
        for (i, _) in text.match_indices("crate::") {
            let name: String = text[i + 7..]
                .chars()
                .take_while(|c| c.is_ascii_alphanumeric() || *c == '_')
                .collect();
            let Some(to) = LAYERS.iter().position(|l| *l == name) else {
                continue;
            };
            seen.insert((top.clone(), name.clone()));
            if to < at {
                bad.insert(format!("{} uses crate::{name}", rel.display()));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "modules reaching up their layers:\n{bad:#?}"
    );
    // The scan sees the engine's real dependencies (it would pass vacuously otherwise).
    for (a, b) in [
        ("launch", "exec"),
        ("exec", "plan"),
        ("plan", "transport"),
        ("comm", "bootstrap"),
    ] {
        assert!(seen.contains(&(a.into(), b.into())), "{a} -> {b} not seen");
    }
}
