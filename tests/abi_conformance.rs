//! ABI conformance against NVIDIA's NCCL 2.32.3 header (fetched by scripts/fetch-upstream-nccl.sh
//! into ~/.cache/oxccl-wheels when missing). Needs gcc and g++, nm and readelf.
//! 1. every prototype of upstream nccl.h, redeclared after our include/nccl.h, compiles as C and C++;
//! 2. every enumerator value and every struct's size and field offsets are equal;
//! 3. libnccl.so exports every nccl*/pnccl* function of upstream nccl.h, nothing outside
//!    nccl*/pnccl*/oxccl*, and its SONAME is libnccl.so.2.

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

fn root() -> &'static Path {
    Path::new(env!("CARGO_MANIFEST_DIR"))
}

fn tmp() -> PathBuf {
    let d = Path::new(env!("CARGO_TARGET_TMPDIR")).join("abi_conformance");
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Upstream's include directory (fetched once per test binary).
fn upstream_include() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let out = tmp().join("upstream");
        let inc = out.join("nvidia/nccl/include");
        if !inc.join("nccl.h").exists() {
            let st = Command::new("bash")
                .arg(root().join("scripts/fetch-upstream-nccl.sh"))
                .arg(&out)
                .status()
                .expect("run scripts/fetch-upstream-nccl.sh");
            assert!(st.success(), "fetching the upstream NCCL wheel failed");
        }
        inc
    })
}

fn upstream_header() -> String {
    std::fs::read_to_string(upstream_include().join("nccl.h")).unwrap()
}

fn strip_comments(s: &str) -> String {
    let mut out = String::new();
    let mut rest = s;
    loop {
        let a = rest.find("/*");
        let b = rest.find("//");
        match (a, b) {
            (Some(a), b) if b.is_none_or(|b| a < b) => {
                out.push_str(&rest[..a]);
                let end = rest[a..]
                    .find("*/")
                    .map(|e| a + e + 2)
                    .unwrap_or(rest.len());
                rest = &rest[end..];
            }
            (_, Some(b)) => {
                out.push_str(&rest[..b]);
                let end = rest[b..].find('\n').map(|e| b + e).unwrap_or(rest.len());
                rest = &rest[end..];
            }
            _ => {
                out.push_str(rest);
                return out;
            }
        }
    }
}

/// Upstream's function prototypes (outside preprocessor lines), with their names.
fn upstream_prototypes() -> Vec<(String, String)> {
    let text = strip_comments(&upstream_header());
    let mut protos = Vec::new();
    let mut stmt = String::new();
    for line in text.lines() {
        let t = line.trim();
        if t.starts_with('#') || t.starts_with("__attribute__") {
            continue;
        }
        stmt.push_str(t);
        stmt.push(' ');
        if t.ends_with(';') || t.ends_with('{') || t.ends_with('}') {
            let s = stmt.trim().to_string();
            stmt.clear();
            if s.contains('{') || s.starts_with("typedef") || !s.ends_with(");") {
                continue;
            }
            let open = s.find('(').unwrap();
            let name = s[..open]
                .trim()
                .rsplit([' ', '*'])
                .next()
                .unwrap()
                .to_string();
            if name.starts_with("nccl") || name.starts_with("pnccl") {
                protos.push((name, s));
            }
        }
    }
    protos
}

fn compile(args: &[&str], src_name: &str, src: &str, compiler: &str) -> PathBuf {
    let dir = tmp();
    let src_path = dir.join(src_name);
    std::fs::write(&src_path, src).unwrap();
    let exe = dir.join(format!("{src_name}.out"));
    let out = Command::new(compiler)
        .args(args)
        .arg(&src_path)
        .arg("-o")
        .arg(&exe)
        .output()
        .unwrap_or_else(|e| panic!("{compiler}: {e}"));
    assert!(
        out.status.success(),
        "{compiler} {args:?} {src_name} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    exe
}

#[test]
fn upstream_prototypes_match_ours() {
    let protos = upstream_prototypes();
    assert!(
        protos.len() >= 140,
        "only {} upstream prototypes found",
        protos.len()
    );
    let mut tu = String::from("#include <nccl.h>\n#ifdef __cplusplus\nextern \"C\" {\n#endif\n");
    for (_, p) in &protos {
        tu.push_str(p);
        tu.push('\n');
    }
    tu.push_str("#ifdef __cplusplus\n}\n#endif\nint main(void) { return 0; }\n");
    let ours = root().join("include");
    let stub = root().join("tests/abi/cuda-stub");
    let (o, s) = (
        format!("-I{}", ours.display()),
        format!("-I{}", stub.display()),
    );
    let warn = ["-Wall", "-Wextra", "-Werror"];
    for (compiler, std, name) in [
        ("gcc", "-std=c11", "protos.c"),
        ("g++", "-std=c++17", "protos.cc"),
    ] {
        for with_cuda in [false, true] {
            // NCCL declares ncclResetDebugInit only where NCCL_OS_LINUX is defined.
            let mut args = vec![std, o.as_str(), "-DNCCL_OS_LINUX"];
            args.extend(warn);
            if with_cuda {
                args.push(s.as_str());
            }
            compile(&args, name, &tu, compiler);
        }
    }
}

/// The enumerators of every `typedef enum { ... } name;` of upstream's header.
fn upstream_enums() -> Vec<(String, Vec<String>)> {
    let text = strip_comments(&upstream_header());
    let mut enums = Vec::new();
    let mut rest = text.as_str();
    while let Some(at) = rest.find("typedef enum") {
        let body_start = rest[at..].find('{').unwrap() + at + 1;
        let body_end = rest[body_start..].find('}').unwrap() + body_start;
        let name_end = rest[body_end..].find(';').unwrap() + body_end;
        let name = rest[body_end + 1..name_end].trim().to_string();
        let names = rest[body_start..body_end]
            .split(',')
            .filter_map(|e| e.split('=').next())
            .map(|e| e.trim().to_string())
            .filter(|e| !e.is_empty())
            .collect();
        enums.push((name, names));
        rest = &rest[name_end..];
    }
    enums
}

/// Top-level fields (and one level of nested unnamed struct/union fields) of a typedef'd struct.
fn upstream_fields(typedef: &str) -> Vec<String> {
    let text = strip_comments(&upstream_header());
    let end = text
        .find(&format!("}} {typedef};"))
        .unwrap_or_else(|| panic!("{typedef}"));
    // Walk back to the matching '{'.
    let bytes = text.as_bytes();
    let (mut depth, mut start) = (0i32, end);
    for i in (0..=end).rev() {
        match bytes[i] {
            b'}' => depth += 1,
            b'{' => {
                depth -= 1;
                if depth == 0 {
                    start = i;
                    break;
                }
            }
            _ => {}
        }
    }
    let body = &text[start + 1..end];
    let mut fields = Vec::new();
    let (mut depth, mut stmt, mut inner) = (0, String::new(), Vec::new());
    for ch in body.chars() {
        match ch {
            '{' => {
                depth += 1;
                stmt.clear();
            }
            '}' => depth -= 1,
            ';' => {
                let name = stmt
                    .split('[')
                    .next()
                    .unwrap()
                    .trim()
                    .rsplit([' ', '*'])
                    .next()
                    .unwrap()
                    .to_string();
                if depth == 0 {
                    for f in inner.drain(..) {
                        fields.push(format!("{name}.{f}"));
                    }
                    fields.push(name);
                } else {
                    inner.push(name);
                }
                stmt.clear();
            }
            c => stmt.push(c),
        }
    }
    fields
}

const STRUCTS: &[&str] = &[
    "ncclUniqueId",
    "ncclConfig_t",
    "ncclCollConfig_t",
    "ncclSimInfo_t",
    "ncclConfigExt_t",
    "ncclWaitSignalDesc_t",
    "ncclEncryptionConfig_t",
];

/// A program printing every enumerator and every struct's size and field offsets.
fn layout_program() -> String {
    let mut p = String::from(
        "#include <stdio.h>\n#include <stddef.h>\n#include <nccl.h>\nint main(void) {\n",
    );
    for (ty, names) in upstream_enums() {
        p += &format!("  printf(\"sizeof({ty}) %zu\\n\", sizeof({ty}));\n");
        for n in names {
            p += &format!("  printf(\"{n} %lld\\n\", (long long){n});\n");
        }
    }
    for s in STRUCTS {
        p += &format!("  printf(\"sizeof({s}) %zu\\n\", sizeof({s}));\n");
        p += &format!("  printf(\"alignof({s}) %zu\\n\", _Alignof({s}));\n");
        for f in upstream_fields(s) {
            p += &format!("  printf(\"{s}.{f} %zu\\n\", offsetof({s}, {f}));\n");
        }
    }
    for m in [
        "NCCL_MAJOR",
        "NCCL_MINOR",
        "NCCL_PATCH",
        "NCCL_VERSION_CODE",
        "NCCL_UNIQUE_ID_BYTES",
        "NCCL_CONFIG_UNDEF_INT",
        "NCCL_SPLIT_NOCOLOR",
        "NCCL_API_MAGIC",
        "NCCL_WIN_DEFAULT",
        "NCCL_WIN_COLL_SYMMETRIC",
        "NCCL_WIN_STRICT_ORDERING",
        "NCCL_WIN_GIN_ONLY",
        "NCCL_WIN_CFT_COUNTED",
        "NCCL_WIN_REQUIRED_ALIGNMENT",
        "NCCL_CTA_POLICY_DEFAULT",
        "NCCL_CTA_POLICY_EFFICIENCY",
        "NCCL_CTA_POLICY_ZERO",
        "NCCL_SHRINK_DEFAULT",
        "NCCL_SHRINK_ABORT",
        "NCCL_REVOKE_DEFAULT",
        "NCCL_SUSPEND_MEM",
        "NCCL_VERSION(2,8,4)",
        "NCCL_VERSION(2,32,3)",
    ] {
        p += &format!("  printf(\"{m} %lld\\n\", (long long)({m}));\n");
    }
    p += "  printf(\"NCCL_SUFFIX '%s'\\n\", NCCL_SUFFIX);\n";
    p += "  printf(\"NCCL_UNDEF_FLOAT %f\\n\", (double)NCCL_UNDEF_FLOAT);\n";
    p += "  { ncclConfig_t c = NCCL_CONFIG_INITIALIZER; ncclCollConfig_t cc = NCCL_COLLCONFIG_INITIALIZER;\n";
    p += "    ncclSimInfo_t s = NCCL_SIM_INFO_INITIALIZER; ncclEncryptionConfig_t e = NCCL_ENCRYPTION_CONFIG_INITIALIZER;\n";
    p += "    const unsigned char* b; size_t i; unsigned long h = 5381;\n";
    p += "    c.netName = 0; c.commName = 0; cc.ext = 0; cc.algSelection = 0; cc.launchCompletionEvent = 0; e.psk = 0;\n";
    p += "    for (b = (const unsigned char*)&c, i = 0; i < sizeof c; i++) h = h * 33 + b[i];\n";
    p += "    for (b = (const unsigned char*)&cc, i = 0; i < sizeof cc; i++) h = h * 33 + b[i];\n";
    p += "    for (b = (const unsigned char*)&s, i = 0; i < sizeof s; i++) h = h * 33 + b[i];\n";
    p += "    for (b = (const unsigned char*)&e, i = 0; i < sizeof e; i++) h = h * 33 + b[i];\n";
    p += "    printf(\"initializers-hash %lu\\n\", h); }\n";
    p += "  return 0;\n}\n";
    p
}

fn run(exe: &Path) -> String {
    let out = Command::new(exe).output().unwrap();
    assert!(out.status.success());
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn enum_values_struct_layouts_and_macros_match_upstream() {
    let prog = layout_program();
    let stub = format!("-I{}", root().join("tests/abi/cuda-stub").display());
    let up = format!("-I{}", upstream_include().display());
    let ours = format!("-I{}", root().join("include").display());
    let theirs = run(&compile(
        &["-std=c11", &up, &stub],
        "layout_up.c",
        &prog,
        "gcc",
    ));
    let mine_plain = run(&compile(
        &["-std=c11", &ours],
        "layout_ours.c",
        &prog,
        "gcc",
    ));
    let mine_cuda = run(&compile(
        &["-std=c11", &ours, &stub],
        "layout_ours_cuda.c",
        &prog,
        "gcc",
    ));
    assert!(theirs.lines().count() > 100, "too few checks:\n{theirs}");
    for (what, mine) in [
        ("without cuda_runtime.h", &mine_plain),
        ("with cuda_runtime.h", &mine_cuda),
    ] {
        let a: Vec<&str> = theirs.lines().collect();
        let b: Vec<&str> = mine.lines().collect();
        for (x, y) in a.iter().zip(b.iter()) {
            assert_eq!(x, y, "ours ({what}) differs from NCCL 2.32.3");
        }
        assert_eq!(a.len(), b.len());
    }
}

fn our_library() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    let lib = exe.parent().unwrap().parent().unwrap().join("libnccl.so");
    assert!(lib.exists(), "{} not built", lib.display());
    lib
}

#[test]
fn exports_and_soname() {
    let lib = our_library();
    let out = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&lib)
        .output()
        .expect("nm");
    assert!(out.status.success());
    let exported: BTreeSet<String> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .filter_map(|l| l.split_whitespace().nth(2).map(str::to_string))
        .collect();
    let mut wanted: BTreeSet<String> = upstream_prototypes().into_iter().map(|(n, _)| n).collect();
    // Declared by upstream under #ifdef NCCL_OS_LINUX, exported by libnccl.so.2 all the same.
    wanted.insert("ncclResetDebugInit".into());
    wanted.insert("pncclResetDebugInit".into());
    for f in [
        "ncclCommQueryProperties",
        "ncclTeamWorld",
        "ncclTeamLsa",
        "ncclTeamRail",
        "ncclTeamRankToWorld",
        "ncclTeamRankToLsa",
        "ncclDevCommCreate",
        "ncclDevCommDestroy",
        // Exported only so that programs importing them load (every call says the device
        // API is not built): every nccl* that NVIDIA's libnccl.so.2 exports is here but its
        // internal ncclResetDebugInitInternal, and the two GIN box requirements that its
        // headers declare for Windows only.
        "ncclGetLsaMultimemDevicePointer",
        "ncclGetMultimemDevicePointer",
        "ncclGetLsaDevicePointer",
        "ncclGetPeerDevicePointer",
        "ncclGetMultimemDeviceLeInfo",
        "ncclGetCftDeviceLeInfo",
        "ncclGetPeerDeviceLeInfo",
        "ncclLsaBarrierCreateRequirement",
        "ncclGinBarrierCreateRequirement",
        "ncclLLA2ACreateRequirement",
        "ncclLLA2ACalcSlots",
        "ncclTeamCft",
        "ncclTeamCftMultimem",
    ] {
        wanted.insert(f.into());
        wanted.insert(format!("p{f}"));
    }
    for f in [
        "oxcclHostStreamCreate",
        "oxcclHostStreamSynchronize",
        "oxcclHostStreamQuery",
        "oxcclHostStreamDestroy",
        "oxcclGetExecutor",
    ] {
        wanted.insert(f.into());
    }
    let missing: Vec<_> = wanted.difference(&exported).collect();
    assert!(missing.is_empty(), "libnccl.so lacks {missing:?}");
    let stray: Vec<_> = exported
        .iter()
        .filter(|s| !(s.starts_with("nccl") || s.starts_with("pnccl") || s.starts_with("oxccl")))
        .collect();
    assert!(
        stray.is_empty(),
        "libnccl.so exports more than the NCCL ABI: {stray:?}"
    );
    let extra: Vec<_> = exported.difference(&wanted).collect();
    assert!(extra.is_empty(), "unexpected exports {extra:?}");

    let out = Command::new("readelf")
        .arg("-d")
        .arg(&lib)
        .output()
        .expect("readelf");
    let dynamic = String::from_utf8(out.stdout).unwrap();
    assert!(
        dynamic
            .lines()
            .any(|l| l.contains("(SONAME)") && l.contains("[libnccl.so.2]")),
        "SONAME is not libnccl.so.2:\n{dynamic}"
    );
}
