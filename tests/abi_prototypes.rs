//! Every function libnccl.so exports has the prototype NVIDIA declares for it.
//!
//! For each `nccl*`/`pnccl*` symbol in the dynamic symbol table of the built library, this test
//! takes oxccl's prototype (cbindgen over src/abi, every item included, so also the device-API
//! helpers that include/nccl.h leaves out; a `pnccl*` twin has its `nccl*` function's prototype,
//! build.rs generates it from that signature) and NVIDIA's declaration from NCCL 2.32.3's
//! nccl.h and device-API headers (nccl_device.h, nccl_device/*.h), and has g++ check, symbol by
//! symbol, that the two function types are the same (`std::is_same` of their `decltype`s): any
//! parameter or return type that differs, or a symbol NVIDIA does not declare, fails.
//! NVIDIA declares no `pnccl*` device-API twins (its library exports them all the same): those are
//! compared with the `nccl*` declaration. The `oxccl*` extensions have no NVIDIA counterpart.
//! Needs g++ and nm; fetches NVIDIA's wheel (scripts/fetch-upstream-nccl.sh) when missing.

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn tmp() -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("abi_prototypes");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// NVIDIA's include directory (nccl.h, nccl_device.h, nccl_device/).
fn upstream_include() -> PathBuf {
    let out = tmp().join("upstream");
    let inc = out.join("nvidia/nccl/include");
    if !inc.join("nccl_device/host.h").exists() {
        let st = Command::new("bash")
            .arg(root().join("scripts/fetch-upstream-nccl.sh"))
            .arg(&out)
            .status()
            .expect("run scripts/fetch-upstream-nccl.sh");
        assert!(st.success(), "fetching the upstream NCCL wheel failed");
    }
    inc
}

/// The functions of src/abi as C declarations, by name (cbindgen, nothing excluded).
fn our_prototypes() -> BTreeMap<String, String> {
    let mut config =
        cbindgen::Config::from_file(root().join("cbindgen.toml")).expect("cbindgen.toml");
    config.export.exclude.clear();
    config.cpp_compat = false;
    config.documentation = false;
    config.header = None;
    config.trailer = None;
    config.after_includes = None;
    config.line_length = 10_000;
    let bindings = cbindgen::Builder::new()
        .with_config(config)
        .with_src(root().join("src/abi/mod.rs"))
        .generate()
        .expect("cbindgen failed on src/abi");
    let mut bytes = Vec::new();
    bindings.write(&mut bytes);
    let text = String::from_utf8(bytes).unwrap();
    // Statements at brace depth 0, preprocessor lines left out.
    let mut protos = BTreeMap::new();
    let (mut depth, mut stmt) = (0i32, String::new());
    for line in text.lines().filter(|l| !l.trim_start().starts_with('#')) {
        for ch in line.chars().chain(std::iter::once(' ')) {
            match ch {
                '{' => depth += 1,
                '}' => depth -= 1,
                ';' if depth == 0 => {
                    let s = std::mem::take(&mut stmt).trim().to_string();
                    if s.starts_with("typedef") || s.contains('{') || !s.ends_with(')') {
                        continue;
                    }
                    let open = s.find('(').unwrap();
                    let name = s[..open].trim().rsplit([' ', '*']).next().unwrap();
                    // `struct X` is cbindgen's spelling of our `typedef struct X {..} X`; NVIDIA's
                    // header may name the same type by a typedef of an unnamed struct
                    // (`ncclUniqueId`), so compare by the typedef name.
                    let s = s
                        .replace("struct ", "")
                        .replace("enum ", "")
                        .replace("union ", "");
                    protos.insert(name.to_string(), format!("{s};"));
                    continue;
                }
                _ => {}
            }
            stmt.push(ch);
        }
    }
    protos
}

/// The functions the built library exports.
fn exported_functions() -> BTreeSet<String> {
    let exe = std::env::current_exe().unwrap();
    let lib = exe.parent().unwrap().parent().unwrap().join("libnccl.so");
    assert!(lib.exists(), "{} not built", lib.display());
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&lib)
        .output()
        .expect("nm");
    assert!(out.status.success());
    String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| {
            let mut f = l.split_whitespace().skip(1);
            let (kind, name) = (f.next()?, f.next()?);
            matches!(kind, "T" | "W" | "i").then(|| name.to_string())
        })
        .collect()
}

/// Whether NVIDIA's headers mention `name(` at all (a cheap check for a clearer message).
fn nvidia_mentions(headers: &str, name: &str) -> bool {
    headers.match_indices(name).any(|(at, _)| {
        let before = headers[..at].chars().next_back();
        let after = headers[at + name.len()..].trim_start().chars().next();
        !before.is_some_and(|c| c.is_alphanumeric() || c == '_') && after == Some('(')
    })
}

fn all_headers(dir: &Path, out: &mut String) {
    for e in std::fs::read_dir(dir).unwrap() {
        let p = e.unwrap().path();
        if p.is_dir() {
            all_headers(&p, out);
        } else if p.extension().is_some_and(|x| x == "h") {
            out.push_str(&std::fs::read_to_string(&p).unwrap());
            out.push('\n');
        }
    }
}

#[test]
fn every_export_has_nvidias_prototype() {
    let inc = upstream_include();
    let ours = our_prototypes();
    let exported = exported_functions();
    let mut headers = String::new();
    all_headers(&inc, &mut headers);

    let mut problems = Vec::new();
    // (symbol, NVIDIA's declaration to compare with, our declaration)
    let mut checks: Vec<(String, String, String)> = Vec::new();
    for sym in &exported {
        if sym.starts_with("oxccl") {
            continue;
        }
        let base = sym.strip_prefix('p').unwrap_or(sym);
        if !base.starts_with("nccl") {
            problems.push(format!("{sym}: not an NCCL name"));
            continue;
        }
        let Some(proto) = ours.get(base) else {
            problems.push(format!("{sym}: no `{base}` found in src/abi by cbindgen"));
            continue;
        };
        let theirs = if nvidia_mentions(&headers, sym) {
            sym.as_str()
        } else {
            base
        };
        if !nvidia_mentions(&headers, theirs) {
            problems.push(format!("{sym}: NVIDIA's headers declare no `{theirs}`"));
            continue;
        }
        let decl = if sym == base {
            proto.clone()
        } else {
            proto.replacen(&format!("{base}("), &format!("{sym}("), 1)
        };
        checks.push((sym.clone(), theirs.to_string(), decl));
    }
    assert!(problems.is_empty(), "{problems:#?}");
    assert!(
        checks.len() >= 150,
        "only {} exported functions found",
        checks.len()
    );

    // One translation unit: NVIDIA's headers, our declarations in a namespace of their own (the
    // type names resolve to NVIDIA's), and one static_assert per exported symbol.
    let mut tu = String::from(
        "#include <stddef.h>\n#include <stdint.h>\n#include <type_traits>\n\
         #include <nccl.h>\n#include <nccl_device.h>\nnamespace oxccl_ours {\n",
    );
    for (_, _, decl) in &checks {
        tu += decl;
        tu.push('\n');
    }
    tu += "}\n";
    for (sym, theirs, _) in &checks {
        tu += &format!(
            "static_assert(std::is_same<decltype(::{theirs}), decltype(oxccl_ours::{sym})>::value, \
             \"PROTOTYPE MISMATCH: {sym} (NVIDIA: {theirs})\");\n"
        );
    }
    tu += "int main() { return 0; }\n";
    let src = tmp().join("prototypes.cc");
    std::fs::write(&src, &tu).unwrap();
    let out = Command::new("g++")
        .args(["-std=c++17", "-fsyntax-only", "-DNCCL_OS_LINUX"])
        .arg("-Wno-deprecated-declarations")
        .arg(format!("-I{}", inc.display()))
        .arg(format!(
            "-I{}",
            root().join("tests/abi/cuda-stub").display()
        ))
        .arg(&src)
        .output()
        .expect("g++");
    let stderr = String::from_utf8_lossy(&out.stderr);
    let mismatched: Vec<&str> = stderr
        .lines()
        .filter_map(|l| {
            l.split("static assertion failed: PROTOTYPE MISMATCH: ")
                .nth(1)
        })
        .collect();
    assert!(
        out.status.success(),
        "prototypes differ from NVIDIA's: {mismatched:#?}\n(g++ on {}):\n{stderr}",
        src.display()
    );
}
