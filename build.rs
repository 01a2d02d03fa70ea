//! Build script: the SONAME of the shared object, the `libnccl.so.2` link next to it, the
//! `pnccl*` twins of every `nccl*` C entry point (NCCL exports each public function under both
//! names), and the CUDA kernels compiled by nvcc when one is found.

use std::fmt::Write as _;
use std::path::{Path, PathBuf};

/// The theme files whose `nccl*` functions get a `pnccl*` twin (the oxccl extensions have none).
const TWINNED: &[&str] = &[
    "src/abi/comm.rs",
    "src/abi/coll.rs",
    "src/abi/group.rs",
    "src/abi/misc.rs",
    "src/abi/device_api.rs",
];

const MARK: &str = "pub unsafe extern \"C\" fn nccl";

fn twins(src: &str, out: &mut String) {
    let mut rest = src;
    while let Some(at) = rest.find(MARK) {
        let after = &rest[at + MARK.len() - "nccl".len()..];
        let open = after.find('(').expect("fn name then (");
        let name = after[..open].trim().to_string();
        // Parameters: up to the matching ')'.
        let mut depth = 0usize;
        let mut close = open;
        for (i, ch) in after[open..].char_indices() {
            match ch {
                '(' => depth += 1,
                ')' => {
                    depth -= 1;
                    if depth == 0 {
                        close = open + i;
                        break;
                    }
                }
                _ => {}
            }
        }
        let params = &after[open + 1..close];
        let body_at = after[close..].find('{').expect("fn body") + close;
        let ret = after[close + 1..body_at].trim();
        let params: Vec<(&str, &str)> = params
            .split(',')
            .map(str::trim)
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (n, t) = p.split_once(':').expect("name: type");
                (n.trim(), t.trim())
            })
            .collect();
        let decl: Vec<String> = params.iter().map(|(n, t)| format!("{n}: {t}")).collect();
        let names: Vec<&str> = params.iter().map(|(n, _)| *n).collect();
        writeln!(
            out,
            "#[no_mangle]\npub unsafe extern \"C\" fn p{name}({}) {ret} {{\n    \
             // SAFETY: the same contract as `{name}`, which this twin forwards to.\n    \
             unsafe {{ {name}({}) }}\n}}\n",
            decl.join(", "),
            names.join(", ")
        )
        .unwrap();
        rest = &after[body_at..];
    }
}

/// `<profile dir>/libnccl.so.2 -> libnccl.so`: programs linked with `-lnccl` ask the loader for
/// the SONAME, so `LD_LIBRARY_PATH=target/release` only finds the library under that name.
/// Cargo names the cdylib `libnccl.so` (in the profile directory, `OUT_DIR/../../..`); the link
/// is relative and may be made before the library exists (this script runs first). It is made
/// whenever this script runs: on every build after `cargo clean`, and when build.rs or a
/// `TWINNED` file changes.
fn soname_link() {
    let out = std::env::var("OUT_DIR").expect("OUT_DIR");
    let Some(profile) = Path::new(&out).ancestors().nth(3) else {
        return;
    };
    let link = profile.join("libnccl.so.2");
    match std::fs::symlink_metadata(&link) {
        Ok(m) if m.file_type().is_symlink() => {
            if std::fs::read_link(&link).is_ok_and(|t| t == Path::new("libnccl.so")) {
                return;
            }
            let _ = std::fs::remove_file(&link);
        }
        Ok(_) => {
            println!(
                "cargo:warning={} is not a link to libnccl.so: left alone",
                link.display()
            );
            return;
        }
        Err(_) => {}
    }
    if let Err(e) = std::os::unix::fs::symlink("libnccl.so", &link) {
        println!("cargo:warning=cannot create {}: {e}", link.display());
    }
}

/// Compiles the net plugins' variadic logger (`src/transport/plugin/logger.c`) into a static
/// library linked into oxccl, with the C compiler Rust links with (`CC`, else `cc`; `AR`, else
/// `ar`).
fn plugin_logger() {
    let src = "src/transport/plugin/logger.c";
    println!("cargo:rerun-if-changed={src}");
    let dir = std::path::PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR"));
    let obj = dir.join("oxccl_logger.o");
    // CC and AR as make takes them (a program and its arguments: "ccache gcc").
    println!("cargo:rerun-if-env-changed=CC");
    println!("cargo:rerun-if-env-changed=AR");
    let tool = |var: &str, default: &str| -> Vec<String> {
        let v = std::env::var(var).unwrap_or_default();
        let words: Vec<String> = v.split_whitespace().map(String::from).collect();
        if words.is_empty() {
            vec![default.to_string()]
        } else {
            words
        }
    };
    let cc_words = tool("CC", "cc");
    let cc = cc_words.join(" ");
    let st = std::process::Command::new(&cc_words[0])
        .args(&cc_words[1..])
        .args([
            "-O2",
            "-fPIC",
            "-fvisibility=hidden",
            "-Wall",
            "-Wextra",
            "-c",
            src,
            "-o",
        ])
        .arg(&obj)
        .status()
        .unwrap_or_else(|e| panic!("{cc} (compiling {src}): {e}"));
    assert!(st.success(), "{cc} could not compile {src}");
    let lib = dir.join("liboxccl_logger.a");
    let _ = std::fs::remove_file(&lib);
    let ar = tool("AR", "ar");
    let st = std::process::Command::new(&ar[0])
        .args(&ar[1..])
        .arg("crs")
        .arg(&lib)
        .arg(&obj)
        .status()
        .unwrap_or_else(|e| panic!("ar (archiving {src}): {e}"));
    assert!(st.success(), "ar could not archive {src}");
    println!("cargo:rustc-link-search=native={}", dir.display());
    println!("cargo:rustc-link-lib=static=oxccl_logger");
}

/// The kernels' sources (`cuda/`) and the architectures nvcc compiles them for: a cubin for each
/// (sm_80 also serves sm_86/87/89), and PTX for the first, which the driver compiles for any
/// newer device (sm_120, ...).
const KERNEL_SOURCES: [&str; 3] = ["cuda/runner.cu", "cuda/reduce.cuh", "cuda/direct.cuh"];
const KERNEL_ARCHS: [u32; 3] = [80, 90, 100];

/// nvcc, where one is: `OXCCL_NVCC` (a path; `none`: do not use nvcc), else
/// `$CUDA_HOME/bin/nvcc`, the `PATH`, `/usr/local/cuda/bin/nvcc`, and the PyPI package
/// `nvidia-cuda-nvcc` that `scripts/setup.sh` installs under `target/cuda-nvcc`.
fn find_nvcc() -> Option<PathBuf> {
    println!("cargo:rerun-if-env-changed=OXCCL_NVCC");
    println!("cargo:rerun-if-env-changed=CUDA_HOME");
    if let Some(v) = std::env::var_os("OXCCL_NVCC") {
        return (v != "none" && !v.is_empty()).then(|| PathBuf::from(v));
    }
    let mut dirs: Vec<PathBuf> = Vec::new();
    if let Some(h) = std::env::var_os("CUDA_HOME") {
        dirs.push(Path::new(&h).join("bin"));
    }
    if let Some(p) = std::env::var_os("PATH") {
        dirs.extend(std::env::split_paths(&p));
    }
    dirs.push("/usr/local/cuda/bin".into());
    let root = std::env::var("CARGO_MANIFEST_DIR").expect("CARGO_MANIFEST_DIR");
    dirs.push(Path::new(&root).join("target/cuda-nvcc/nvidia/cu13/bin"));
    dirs.into_iter()
        .map(|d| d.join("nvcc"))
        .find(|f| f.is_file())
}

/// `OUT_DIR/kernels.fatbin`: the kernels compiled by nvcc (see `KERNEL_ARCHS`) into one fatbin,
/// which the library embeds and loads; empty when there is no nvcc or it failed (a warning
/// says why), and the library then compiles the sources at run time with NVRTC. A compile is
/// kept under `<target>/oxccl-kernels`, named for a hash of the sources and of nvcc's version,
/// so the debug and release builds share it.
fn cuda_kernels() {
    let out = PathBuf::from(std::env::var("OUT_DIR").expect("OUT_DIR")).join("kernels.fatbin");
    for f in KERNEL_SOURCES {
        println!("cargo:rerun-if-changed={f}");
    }
    let fatbin = find_nvcc().and_then(|nvcc| match compile_kernels(&nvcc, &out) {
        Ok(f) => Some(f),
        Err(e) => {
            println!(
                "cargo:warning=nvcc ({}) did not compile the CUDA kernels, so the library will \
                 compile them at run time with NVRTC: {e}",
                nvcc.display()
            );
            None
        }
    });
    let bytes = fatbin
        .and_then(|f| std::fs::read(f).ok())
        .unwrap_or_default();
    std::fs::write(&out, bytes).expect("write kernels.fatbin");
}

/// Compiles the kernels with `nvcc` (or finds the compile kept from an earlier build): the
/// fatbin's path.
fn compile_kernels(nvcc: &Path, out: &Path) -> Result<PathBuf, String> {
    use std::hash::{Hash, Hasher};
    use std::process::Command;
    let run = |args: &[&str]| -> Result<String, String> {
        let o = Command::new(nvcc)
            .args(args)
            .output()
            .map_err(|e| e.to_string())?;
        if !o.status.success() {
            let err = String::from_utf8_lossy(&o.stderr);
            let head: Vec<&str> = err.lines().take(20).collect();
            return Err(format!("nvcc {}: {}", args.join(" "), head.join("\n")));
        }
        Ok(String::from_utf8_lossy(&o.stdout).into_owned())
    };
    let codes = run(&["--list-gpu-code"])?;
    let archs: Vec<u32> = KERNEL_ARCHS
        .into_iter()
        .filter(|a| codes.split_whitespace().any(|c| c == format!("sm_{a}")))
        .collect();
    let Some(&ptx) = archs.first() else {
        return Err(format!("it compiles for none of sm_{KERNEL_ARCHS:?}"));
    };
    let mut args: Vec<String> = ["-fatbin", "--std=c++17", "-fmad=false", "-DOX_LARGE"]
        .map(String::from)
        .to_vec();
    for a in &archs {
        args.push(format!("-gencode=arch=compute_{a},code=sm_{a}"));
    }
    args.push(format!("-gencode=arch=compute_{ptx},code=compute_{ptx}"));
    let mut h = std::collections::hash_map::DefaultHasher::new();
    run(&["--version"])?.hash(&mut h);
    args.hash(&mut h);
    for f in KERNEL_SOURCES {
        std::fs::read(f)
            .map_err(|e| format!("{f}: {e}"))?
            .hash(&mut h);
    }
    // OUT_DIR is <target>/<profile>/build/<package>-<hash>/out.
    let dir = out.ancestors().nth(5).map_or_else(
        || out.parent().expect("OUT_DIR").to_path_buf(),
        |t| t.join("oxccl-kernels"),
    );
    let file = dir.join(format!("kernels-{:016x}.fatbin", h.finish()));
    if file.is_file() {
        return Ok(file);
    }
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let tmp = file.with_extension(format!("tmp{}", std::process::id()));
    let mut all: Vec<&str> = args.iter().map(String::as_str).collect();
    let tmp_s = tmp.display().to_string();
    all.extend(["-o", &tmp_s, KERNEL_SOURCES[0]]);
    run(&all)?;
    std::fs::rename(&tmp, &file).map_err(|e| format!("{}: {e}", file.display()))?;
    // Compiles of older sources are not needed again.
    for old in std::fs::read_dir(&dir).into_iter().flatten().flatten() {
        let name = old.file_name().to_string_lossy().into_owned();
        if name.starts_with("kernels-") && name.ends_with(".fatbin") && old.path() != file {
            let _ = std::fs::remove_file(old.path());
        }
    }
    Ok(file)
}

fn main() {
    plugin_logger();
    cuda_kernels();
    // The shared object is what C programs load: give it NCCL's SONAME.
    println!("cargo:rustc-cdylib-link-arg=-Wl,-soname,libnccl.so.2");
    soname_link();
    println!("cargo:rerun-if-changed=build.rs");

    let mut out = String::from("// Generated by build.rs: the pnccl* twins. Do not edit.\n\n");
    for f in TWINNED {
        println!("cargo:rerun-if-changed={f}");
        let src = std::fs::read_to_string(f).unwrap_or_else(|e| panic!("{f}: {e}"));
        twins(&src, &mut out);
    }
    let dir = std::env::var("OUT_DIR").expect("OUT_DIR");
    std::fs::write(Path::new(&dir).join("pnccl_twins.rs"), out).expect("write twins");
}
