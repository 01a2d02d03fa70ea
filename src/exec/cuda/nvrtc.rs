//! NVRTC, loaded at run time: compiles the kernels of `cuda/` (embedded in the library as
//! source) for the device's architecture when the library was built without nvcc.
//!
//! Found as `libnvrtc.so.13` / `.12` / `libnvrtc.so` in the loader's paths, under `CUDA_HOME` or
//! `/usr/local/cuda`, in the Python packages `nvidia-cuda-nvrtc` (`nvidia/cuda_nvrtc/lib`,
//! `nvidia/cu13/lib`) of the usual site-packages folders, or at `OXCCL_NVRTC` (a file). The
//! first found that is not newer than the driver (its CUDA major version, `nvrtcVersion`,
//! at most the driver's) is used: a CUDA 12 driver refuses a CUDA 13 NVRTC's images.

use crate::error::{Code, Error, Result};
use std::ffi::{c_char, c_int, CString};
use std::path::PathBuf;

type Prog = *mut std::ffi::c_void;
type NvrtcResult = c_int;

struct Nvrtc {
    _lib: libloading::Library,
    path: String,
    create: unsafe extern "C" fn(
        *mut Prog,
        *const c_char,
        *const c_char,
        c_int,
        *const *const c_char,
        *const *const c_char,
    ) -> NvrtcResult,
    compile: unsafe extern "C" fn(Prog, c_int, *const *const c_char) -> NvrtcResult,
    log_size: unsafe extern "C" fn(Prog, *mut usize) -> NvrtcResult,
    log: unsafe extern "C" fn(Prog, *mut c_char) -> NvrtcResult,
    cubin_size: unsafe extern "C" fn(Prog, *mut usize) -> NvrtcResult,
    cubin: unsafe extern "C" fn(Prog, *mut c_char) -> NvrtcResult,
    ptx_size: unsafe extern "C" fn(Prog, *mut usize) -> NvrtcResult,
    ptx: unsafe extern "C" fn(Prog, *mut c_char) -> NvrtcResult,
    destroy: unsafe extern "C" fn(*mut Prog) -> NvrtcResult,
}

/// Where to look for the library, in order.
fn candidates() -> Vec<PathBuf> {
    let mut v: Vec<PathBuf> = Vec::new();
    if let Ok(p) = std::env::var("OXCCL_NVRTC") {
        v.push(p.into());
    }
    let names = ["libnvrtc.so.13", "libnvrtc.so.12", "libnvrtc.so"];
    v.extend(names.iter().map(PathBuf::from));
    let mut dirs: Vec<PathBuf> = Vec::new();
    for home in [
        std::env::var("CUDA_HOME").ok(),
        Some("/usr/local/cuda".into()),
    ]
    .into_iter()
    .flatten()
    {
        dirs.push(PathBuf::from(&home).join("lib64"));
        dirs.push(PathBuf::from(&home).join("lib"));
    }
    // site-packages of the Python installations one usually finds.
    let roots = [
        "/usr/lib",
        "/usr/local/lib",
        "/opt/conda/lib",
        "/root/.local/lib",
        "/root/.pyenv/versions/*/lib",
    ];
    let mut sites: Vec<PathBuf> = Vec::new();
    if let Ok(venv) = std::env::var("VIRTUAL_ENV") {
        sites.extend(glob_dirs(&format!("{venv}/lib"), "python3"));
    }
    for r in roots {
        for base in expand_star(r) {
            sites.extend(glob_dirs(&base, "python3"));
        }
    }
    for s in sites {
        for sub in ["site-packages", "dist-packages"] {
            for pkg in [
                "nvidia/cuda_nvrtc/lib",
                "nvidia/cu13/lib",
                "nvidia/cu12/lib",
            ] {
                dirs.push(s.join(sub).join(pkg));
            }
        }
    }
    for d in dirs {
        for n in names {
            let p = d.join(n);
            if p.exists() {
                v.push(p);
            }
        }
    }
    v
}

/// `pattern` with one `*` path component expanded to the directories it matches.
fn expand_star(pattern: &str) -> Vec<String> {
    match pattern.split_once('*') {
        None => vec![pattern.to_string()],
        Some((head, tail)) => {
            let dir = head.trim_end_matches('/');
            let mut out = Vec::new();
            if let Ok(rd) = std::fs::read_dir(dir) {
                for e in rd.flatten() {
                    out.push(format!("{}{}", e.path().display(), tail));
                }
            }
            out
        }
    }
}

/// Subdirectories of `dir` whose names start with `prefix`.
fn glob_dirs(dir: &str, prefix: &str) -> Vec<PathBuf> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(dir) {
        for e in rd.flatten() {
            if e.file_name().to_string_lossy().starts_with(prefix) {
                out.push(e.path());
            }
        }
    }
    out
}

/// Whether images that NVRTC of CUDA major version `nvrtc` makes load on a driver of CUDA
/// version `driver` (`cuDriverGetVersion`'s, 12040 for 12.4; None where no driver answers):
/// not those of a newer major version (a CUDA 12 driver, R525 to R575, refuses a CUDA 13
/// NVRTC's cubins and PTX); within one major version the driver's minor version compatibility
/// takes a newer NVRTC's cubins.
fn serves(nvrtc: Option<i32>, driver: Option<i32>) -> bool {
    match (nvrtc, driver) {
        (Some(n), Some(d)) => n <= d / 1000,
        _ => true,
    }
}

/// The major version of the NVRTC in `lib` (`nvrtcVersion`; None where it does not say).
fn major_of(lib: &libloading::Library) -> Option<i32> {
    type VersionFn = unsafe extern "C" fn(*mut c_int, *mut c_int) -> NvrtcResult;
    // SAFETY: NVRTC's `nvrtcVersion(int*, int*)` (nvrtc.h, since CUDA 7).
    let f = unsafe { lib.get::<VersionFn>(b"nvrtcVersion\0") }.ok()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: writes two ints.
    (unsafe { f(&mut major, &mut minor) } == 0).then_some(major)
}

fn load() -> Result<Nvrtc> {
    let mut tried = Vec::new();
    let chosen = std::env::var_os("OXCCL_NVRTC").map(PathBuf::from);
    let driver = crate::gpu::driver::version().ok();
    let mut too_new = Vec::new();
    for p in candidates() {
        // SAFETY: loading NVRTC runs its initialisers only.
        let lib = match unsafe { libloading::Library::new(&p) } {
            Ok(l) => l,
            Err(_) => {
                tried.push(p.display().to_string());
                continue;
            }
        };
        // An NVRTC newer than the driver makes images it refuses: the next one found may
        // serve (a CUDA 12 driver with PyTorch's nvidia-cuda-nvrtc-cu12 beside a CUDA 13
        // toolkit). One named by OXCCL_NVRTC is used as it is.
        let major = major_of(&lib);
        if chosen.as_ref() != Some(&p) && !serves(major, driver) {
            too_new.push(format!("{} (CUDA {})", p.display(), major.unwrap_or(0)));
            continue;
        }
        macro_rules! sym {
            ($n:literal) => {
                // SAFETY: NVRTC's C signature (nvrtc.h); the library outlives the table.
                *unsafe { lib.get(concat!($n, "\0").as_bytes()) }.map_err(|e| {
                    Error::new(
                        Code::UnhandledCudaError,
                        format!("{} lacks {}: {e}", p.display(), $n),
                    )
                })?
            };
        }
        return Ok(Nvrtc {
            create: sym!("nvrtcCreateProgram"),
            compile: sym!("nvrtcCompileProgram"),
            log_size: sym!("nvrtcGetProgramLogSize"),
            log: sym!("nvrtcGetProgramLog"),
            cubin_size: sym!("nvrtcGetCUBINSize"),
            cubin: sym!("nvrtcGetCUBIN"),
            ptx_size: sym!("nvrtcGetPTXSize"),
            ptx: sym!("nvrtcGetPTX"),
            destroy: sym!("nvrtcDestroyProgram"),
            path: p.display().to_string(),
            _lib: lib,
        });
    }
    if !too_new.is_empty() {
        let d = driver.unwrap_or(0);
        return Err(Error::new(
            Code::UnhandledCudaError,
            format!(
                "the CUDA kernels must be compiled at run time, but the only NVRTC found is \
                 newer than the driver (CUDA {}.{}), which would refuse what it makes: {}; \
                 install the NVRTC of CUDA {} (the Python package nvidia-cuda-nvrtc-cu{}) or \
                 set OXCCL_NVRTC to one",
                d / 1000,
                d % 1000 / 10,
                too_new.join(", "),
                d / 1000,
                d / 1000
            ),
        ));
    }
    Err(Error::new(
        Code::UnhandledCudaError,
        format!(
            "the CUDA kernels must be compiled at run time (this library was built without \
             nvcc), but NVRTC was not found; install the Python package nvidia-cuda-nvrtc or \
             set OXCCL_NVRTC to libnvrtc.so (tried {} places)",
            tried.len()
        ),
    ))
}

/// The compiled image: a cubin (or PTX, NUL-terminated, where the cubin could not be made).
pub struct Image {
    pub bytes: Vec<u8>,
    pub what: String,
}

/// Compiles `main` (with `headers`: (name, source), and the options `extra`) for `sm_{arch}`; a
/// cubin when NVRTC knows the architecture, else PTX for the newest virtual architecture it
/// accepts.
pub fn compile(main: &str, headers: &[(&str, &str)], arch: i32, extra: &[&str]) -> Result<Image> {
    let nv = load()?;
    let err = |what: String| Error::new(Code::UnhandledCudaError, what);
    let src = CString::new(main).map_err(|e| err(e.to_string()))?;
    let hsrc: Vec<CString> = headers
        .iter()
        .map(|(_, s)| CString::new(*s).expect("no NUL in kernel sources"))
        .collect();
    let hname: Vec<CString> = headers
        .iter()
        .map(|(n, _)| CString::new(*n).expect("no NUL in header names"))
        .collect();
    let hs: Vec<*const c_char> = hsrc.iter().map(|s| s.as_ptr()).collect();
    let hn: Vec<*const c_char> = hname.iter().map(|s| s.as_ptr()).collect();
    let try_arch = |opt: String, cubin: bool| -> Result<Image> {
        let mut prog: Prog = std::ptr::null_mut();
        // SAFETY: every pointer is a NUL-terminated string that outlives the call.
        let r = unsafe {
            (nv.create)(
                &mut prog,
                src.as_ptr(),
                c"oxccl_kernels.cu".as_ptr(),
                hs.len() as c_int,
                hs.as_ptr(),
                hn.as_ptr(),
            )
        };
        if r != 0 {
            return Err(err(format!("nvrtcCreateProgram failed ({r})")));
        }
        let opts: Vec<CString> = [
            opt.as_str(),
            "--std=c++17",
            "-default-device",
            "-fmad=false",
        ]
        .iter()
        .chain(extra)
        .map(|o| CString::new(*o).expect("option"))
        .collect();
        let op: Vec<*const c_char> = opts.iter().map(|s| s.as_ptr()).collect();
        // SAFETY: a program made above; options as above.
        let r = unsafe { (nv.compile)(prog, op.len() as c_int, op.as_ptr()) };
        let out = if r != 0 {
            let mut n = 0usize;
            // SAFETY: the log of the program just compiled.
            unsafe { (nv.log_size)(prog, &mut n) };
            let mut log = vec![0u8; n.max(1)];
            // SAFETY: `log` holds `n` bytes.
            unsafe { (nv.log)(prog, log.as_mut_ptr() as *mut c_char) };
            Err(err(format!(
                "NVRTC ({}) could not compile the kernels with {opt}: {}",
                nv.path,
                String::from_utf8_lossy(&log).trim_end_matches('\0')
            )))
        } else {
            let (size_fn, get_fn) = if cubin {
                (nv.cubin_size, nv.cubin)
            } else {
                (nv.ptx_size, nv.ptx)
            };
            let mut n = 0usize;
            // SAFETY: the compiled program.
            unsafe { size_fn(prog, &mut n) };
            let mut bytes = vec![0u8; n];
            // SAFETY: `bytes` holds `n`.
            unsafe { get_fn(prog, bytes.as_mut_ptr() as *mut c_char) };
            Ok(Image {
                bytes,
                what: format!("NVRTC {} {opt}", nv.path),
            })
        };
        // SAFETY: the program made above, destroyed once.
        unsafe { (nv.destroy)(&mut prog) };
        out
    };
    try_arch(format!("--gpu-architecture=sm_{arch}"), true)
        .or_else(|e| try_arch("--gpu-architecture=compute_80".into(), false).map_err(|_| e))
}

#[cfg(test)]
mod tests {
    #[test]
    fn an_nvrtc_serves_drivers_of_its_major_version_and_newer() {
        use super::serves;
        assert!(serves(Some(12), Some(12040)));
        assert!(serves(Some(12), Some(12020)), "minor version compatibility");
        assert!(serves(Some(12), Some(13000)));
        assert!(!serves(Some(13), Some(12080)));
        assert!(serves(Some(13), Some(13000)));
        assert!(serves(None, Some(12040)), "an NVRTC that does not say");
        assert!(serves(Some(13), None), "no driver to ask");
    }

    /// The NVRTC of PyPI's wheel (scripts/setup.sh) says its version.
    #[test]
    fn the_wheels_nvrtc_says_its_major_version() {
        let wheel = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/target/cuda-wheels/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
        );
        if !std::path::Path::new(wheel).exists() {
            assert!(std::env::var_os("CI").is_none(), "no NVRTC wheel: {wheel}");
            eprintln!("skipped: no {wheel} (scripts/setup.sh installs it)");
            return;
        }
        // SAFETY: loading NVRTC runs its initialisers only.
        let lib = unsafe { libloading::Library::new(wheel) }.expect("the wheel's NVRTC");
        assert_eq!(super::major_of(&lib), Some(12));
    }
}
