//! The kernels of `cuda/`, loaded once per device context: the fatbin nvcc made when the library
//! was built (`build.rs`: cubins for sm_80, sm_90 and sm_100, and PTX the driver compiles for
//! newer devices), or, where there is none or the driver refuses it, the embedded sources
//! compiled at run time by NVRTC for the device's architecture, cached per architecture.
//! `OXCCL_KERNELS=nvrtc` skips the fatbin.

use super::nvrtc;
use crate::error::Result;
use crate::gpu::driver::{self, check};
use once_cell::sync::Lazy;
use parking_lot::Mutex;
use std::collections::HashMap;
use std::sync::Arc;

const RUNNER: &str = include_str!("../../../cuda/runner.cu");
const REDUCE: &str = include_str!("../../../cuda/reduce.cuh");
const DIRECT: &str = include_str!("../../../cuda/direct.cuh");
/// NVRTC has no C library headers: the fixed-width types the kernels use.
const STDINT: &str = "#pragma once\n\
typedef signed char int8_t; typedef unsigned char uint8_t;\n\
typedef short int16_t; typedef unsigned short uint16_t;\n\
typedef int int32_t; typedef unsigned int uint32_t;\n\
typedef long long int64_t; typedef unsigned long long uint64_t;\n\
typedef unsigned long uintptr_t; typedef unsigned long size_t;\n";

/// The library's fatbin (empty when it was built without nvcc), aligned as a fatbin's
/// 8-byte fields want it (and handed to the driver where it is).
#[repr(C, align(64))]
struct Aligned<T: ?Sized>(T);
static FATBIN_ALIGNED: &Aligned<[u8]> =
    &Aligned(*include_bytes!(concat!(env!("OUT_DIR"), "/kernels.fatbin")));
static FATBIN: &[u8] = &FATBIN_ALIGNED.0;

/// What a fatbin holds: (PTX?, architecture) of each image, in order; None when `b` is not one.
/// The layout: a 16-byte header (magic 0xBA55ED50, version, header size, payload size), then
/// images, each a header (kind 1 PTX / 2 ELF at 0, its size at 4, the payload's at 8, the
/// architecture at 28) and its payload.
pub fn fatbin_images(b: &[u8]) -> Option<Vec<(bool, u32)>> {
    let u16_at = |o: usize| Some(u16::from_le_bytes(b.get(o..o + 2)?.try_into().ok()?));
    let u32_at = |o: usize| Some(u32::from_le_bytes(b.get(o..o + 4)?.try_into().ok()?));
    let u64_at = |o: usize| Some(u64::from_le_bytes(b.get(o..o + 8)?.try_into().ok()?));
    if u32_at(0)? != 0xBA55_ED50 {
        return None;
    }
    let start = usize::from(u16_at(6)?);
    let end = start.checked_add(usize::try_from(u64_at(8)?).ok()?)?;
    if end > b.len() {
        return None;
    }
    let mut out = Vec::new();
    let mut at = start;
    while at < end {
        let kind = u16_at(at)?;
        let hs = u32_at(at + 4)? as usize;
        let size = usize::try_from(u64_at(at + 8)?).ok()?;
        if hs < 32 {
            return None; // (not even this header's own fields: and no progress)
        }
        out.push((kind == 1, u32_at(at + 28)?));
        at = at.checked_add(hs)?.checked_add(size)?;
    }
    (at == end).then_some(out)
}

/// The library's fatbin in words ("sm_80 sm_90 sm_100, PTX compute_80").
fn fatbin_what() -> String {
    let images = fatbin_images(FATBIN).unwrap_or_default();
    let names = |ptx: bool, pre: &str| -> Vec<String> {
        images
            .iter()
            .filter(|i| i.0 == ptx)
            .map(|i| format!("{pre}_{}", i.1))
            .collect()
    };
    format!(
        "the library's own: {}, PTX {}",
        names(false, "sm").join(" "),
        names(true, "compute").join(" ")
    )
}

/// The functions of one loaded module (handles valid in their context for the process's life).
#[derive(Clone, Copy)]
pub struct Kernels {
    pub run: usize,
    pub local: usize,
    /// Their twins taking `desc::PARAM_BYTES_LARGE` (drivers of CUDA 12.1 and later).
    pub run_large: Option<usize>,
    pub local_large: Option<usize>,
    /// The runner for launches with board lanes (`super::board`), and its twin (None: a
    /// module without them, then collectives take the ring).
    pub run_board: Option<usize>,
    pub run_board_large: Option<usize>,
    /// The all-reduce over every rank of a communicator in one launch (`direct`), for up to 4
    /// and up to `direct::MAX_RANKS` ranks (None: a module without them, then the ring runs).
    pub direct4: Option<usize>,
    pub direct16: Option<usize>,
    /// Plain copies, one per lane (`OXCCL_CUDA_COPY_KERNEL=1`; None: the wide kernel copies).
    pub copy: Option<usize>,
    /// Streaming multiprocessors of the device (sizes wide launches).
    pub sms: u32,
}

impl Kernels {
    /// Whether launches may take the large parameter (both twins are there).
    pub fn large(&self) -> bool {
        self.run_large.is_some() && self.local_large.is_some()
    }
}

/// Images by (architecture, with the large-parameter twins).
type Images = HashMap<(i32, bool), Arc<nvrtc::Image>>;
static IMAGES: Lazy<Mutex<Images>> = Lazy::new(Default::default);
static LOADED: Lazy<Mutex<HashMap<usize, Kernels>>> = Lazy::new(Default::default);

/// The kernel sources as NVRTC compiles them: (main, headers).
pub fn sources() -> (&'static str, [(&'static str, &'static str); 3]) {
    (
        RUNNER,
        [
            ("reduce.cuh", REDUCE),
            ("direct.cuh", DIRECT),
            ("stdint.h", STDINT),
        ],
    )
}

/// Where compiled kernels are kept between processes: `OXCCL_CACHE_DIR`, else
/// `$XDG_CACHE_HOME/oxccl` or `~/.cache/oxccl`; the file name carries a hash of the sources.
fn cache_file(arch: i32, large: bool) -> Option<std::path::PathBuf> {
    let dir = match std::env::var_os("OXCCL_CACHE_DIR") {
        Some(d) => std::path::PathBuf::from(d),
        None => match std::env::var_os("XDG_CACHE_HOME") {
            Some(d) => std::path::PathBuf::from(d).join("oxccl"),
            None => std::path::PathBuf::from(std::env::var_os("HOME")?).join(".cache/oxccl"),
        },
    };
    Some(dir.join(cache_name(arch, large)))
}

/// The cache file name of the kernels for `sm_{arch}`, with the large-parameter kernels or
/// without: a hash of their sources in it.
pub(super) fn cache_name(arch: i32, large: bool) -> String {
    use std::hash::{Hash, Hasher};
    // SipHash with fixed keys: the same name in every process and build of these sources.
    let mut h = std::collections::hash_map::DefaultHasher::new();
    let (main, headers) = sources();
    (main, headers).hash(&mut h);
    let large = if large { "-large" } else { "" };
    format!("kernels-{:016x}-sm{arch}{large}.bin", h.finish())
}

/// The driver version from which kernels take parameters of up to 32764 bytes (CUDA 12.1).
const LARGE_PARAMS_DRIVER: i32 = 12010;

/// The NVRTC options for the kernels with the large-parameter twins (`OX_LARGE`) or without.
fn defines(large: bool) -> &'static [&'static str] {
    if large {
        &["-DOX_LARGE"]
    } else {
        &[]
    }
}

/// The image for `sm_{arch}` (`large`: with the large-parameter twins, where this NVRTC can):
/// made once per process (concurrent first inits wait for one compile), from the disk cache
/// unless `fresh` (a cached image the driver refused).
fn image(arch: i32, large: bool, fresh: bool) -> Result<Arc<nvrtc::Image>> {
    static COMPILING: Mutex<()> = Mutex::new(());
    let _one = COMPILING.lock();
    if let Some(i) = IMAGES.lock().get(&(arch, large)).filter(|_| !fresh) {
        return Ok(i.clone());
    }
    let file = cache_file(arch, large);
    if fresh {
        if let Some(f) = &file {
            let _ = std::fs::remove_file(f);
        }
    }
    if let Some(bytes) = file.as_ref().and_then(|f| std::fs::read(f).ok()) {
        let img = Arc::new(nvrtc::Image {
            bytes,
            what: format!(
                "cached in {}",
                file.as_ref()
                    .map_or(String::new(), |f| f.display().to_string())
            ),
        });
        IMAGES.lock().insert((arch, large), img.clone());
        return Ok(img);
    }
    let (main, headers) = sources();
    let t0 = std::time::Instant::now();
    // An NVRTC older than 12.1 refuses the large parameters: the kernels without them.
    let img = Arc::new(
        nvrtc::compile(main, &headers, arch, defines(large)).or_else(|e| match large {
            true => nvrtc::compile(main, &headers, arch, defines(false)),
            false => Err(e),
        })?,
    );
    if let Some(f) = &file {
        // Best effort: a cache that cannot be written only costs the next process a compile.
        let tmp = f.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::create_dir_all(f.parent().unwrap_or(f)).is_ok()
            && std::fs::write(&tmp, &img.bytes).is_ok()
        {
            let _ = std::fs::rename(&tmp, f);
        }
    }
    crate::debug::info(&format!(
        "CUDA kernels compiled for sm_{arch} in {} ms ({})",
        t0.elapsed().as_millis(),
        img.what
    ));
    IMAGES.lock().insert((arch, large), img.clone());
    Ok(img)
}

/// The kernels compiled by NVRTC for `sm_{arch}` (or taken from the disk cache), loaded by
/// `load` (which loads them and looks their functions up), and where they came from.
fn nvrtc_module<T>(
    arch: i32,
    large: bool,
    load: &dyn Fn(&nvrtc::Image) -> Result<T>,
) -> Result<(T, String)> {
    let img = image(arch, large, false)?;
    match load(&img) {
        Ok(m) => Ok((m, img.what.clone())),
        // A cached image the driver refuses (damaged, or from an older toolkit): compile afresh.
        Err(e) if img.what.starts_with("cached") => {
            crate::debug::warn(&format!("{}: compiling the kernels again", e.msg));
            let img = image(arch, large, true)?;
            Ok((load(&img)?, img.what.clone()))
        }
        Err(e) => Err(e),
    }
}

/// The kernels in context `ctx` (current on this thread) of device `dev`.
pub fn get(ctx: usize, dev: i32) -> Result<Kernels> {
    if let Some(k) = LOADED.lock().get(&ctx) {
        return Ok(*k);
    }
    let api = driver::api()?;
    let major = driver::attr(dev, driver::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?;
    let minor = driver::attr(dev, driver::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?;
    let sms = driver::attr(dev, driver::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?;
    let arch = major * 10 + minor;
    // Launches with a descriptor past `desc::PARAM_BYTES` need the large-parameter twins.
    let large = driver::version()? >= LARGE_PARAMS_DRIVER && major >= 7;
    let load = |bytes: &[u8], what: &str| -> Result<driver::CUmodule> {
        let mut module: driver::CUmodule = std::ptr::null_mut();
        // SAFETY: a fatbin made by nvcc, or a cubin or NUL-terminated PTX image made by NVRTC.
        check(
            unsafe { (api.module_load_data)(&mut module, bytes.as_ptr() as *const _) },
            || format!("loading the kernels ({what}) on device {dev}"),
        )?;
        Ok(module)
    };
    // A module's kernels. With lazy loading (CUDA 12.2's default) a driver may refuse an image
    // only here, at the first lookup, rather than at the load; the two kernels every launch
    // needs are looked up at once (which also keeps lazy loading from stopping the context
    // while a kernel spins).
    let resolve = |module: driver::CUmodule| -> Result<Kernels> {
        let func = |name: &std::ffi::CStr| -> Result<usize> {
            let mut f: driver::CUfunction = std::ptr::null_mut();
            // SAFETY: a loaded module; a NUL-terminated name.
            check(
                unsafe { (api.module_get_function)(&mut f, module, name.as_ptr()) },
                || format!("kernel {name:?} in the loaded module"),
            )?;
            Ok(f as usize)
        };
        let twin = |name: &std::ffi::CStr| large.then(|| func(name).ok()).flatten();
        Ok(Kernels {
            run: func(c"oxccl_run")?,
            local: func(c"oxccl_local")?,
            run_large: twin(c"oxccl_run_large"),
            local_large: twin(c"oxccl_local_large"),
            run_board: func(c"oxccl_run_board").ok(),
            run_board_large: twin(c"oxccl_run_board_large"),
            direct4: func(c"oxccl_direct4").ok(),
            direct16: func(c"oxccl_direct16").ok(),
            copy: func(c"oxccl_copy").ok(),
            sms: sms.max(1) as u32,
        })
    };
    // The library's fatbin first; NVRTC where there is none, or the driver refuses it (a
    // driver older than the nvcc that made it), at the load or at the first lookup.
    let mut refused = None;
    let own = if !FATBIN.is_empty() && std::env::var("OXCCL_KERNELS").map_or(true, |v| v != "nvrtc")
    {
        let what = fatbin_what();
        match load(FATBIN, &what).and_then(resolve) {
            Ok(k) => Some((k, what)),
            Err(e) => {
                crate::debug::info(&format!("{}: compiling them with NVRTC instead", e.msg));
                refused = Some(e);
                None
            }
        }
    } else {
        None
    };
    let (k, what) = match own {
        Some(k) => k,
        None => nvrtc_module(arch, large, &|img| {
            load(&img.bytes, &img.what).and_then(resolve)
        })
        .map_err(|mut e| {
            if let Some(r) = refused {
                e.msg = format!(
                    "{} (the library's own kernels were refused: {})",
                    e.msg, r.msg
                );
            }
            e
        })?,
    };
    crate::debug::info(&format!(
        "CUDA kernels for sm_{arch} on device {dev}: {what}"
    ));
    LOADED.lock().insert(ctx, k);
    Ok(k)
}

#[cfg(test)]
mod tests {
    /// The library embeds nvcc's cubins for sm_80, sm_90 and sm_100 and PTX for compute_80
    /// (`build.rs`; nvcc from PyPI, installed by `scripts/setup.sh`). In CI a build without
    /// them fails here.
    #[test]
    fn the_library_embeds_kernels_for_every_architecture() {
        if super::FATBIN.is_empty() {
            assert!(
                std::env::var_os("CI").is_none(),
                "the library was built without nvcc's kernels (see build.rs's warning)"
            );
            eprintln!("skipped: built without nvcc (scripts/setup.sh installs it)");
            return;
        }
        let images = super::fatbin_images(super::FATBIN).expect("a fatbin");
        for arch in [80, 90, 100] {
            assert!(images.contains(&(false, arch)), "no sm_{arch}: {images:?}");
        }
        assert!(images.contains(&(true, 80)), "no PTX: {images:?}");
        assert_eq!(
            super::fatbin_what(),
            "the library's own: sm_80 sm_90 sm_100, PTX compute_80"
        );
        // What is not a whole fatbin is refused, not misread.
        for cut in [0, 8, 16, 100, super::FATBIN.len() - 1] {
            assert_eq!(
                super::fatbin_images(&super::FATBIN[..cut]),
                None,
                "cut at {cut}"
            );
        }
        assert_eq!(super::fatbin_images(b"not a fatbin at all"), None);
        // An image header that claims no size would never end the walk.
        let mut zero = 0xBA55_ED50u32.to_le_bytes().to_vec();
        zero.extend_from_slice(&[1, 0, 16, 0]);
        zero.extend_from_slice(&64u64.to_le_bytes());
        zero.extend_from_slice(&[0; 64]);
        assert_eq!(super::fatbin_images(&zero), None);
        assert_eq!(super::FATBIN.as_ptr() as usize % 64, 0);
    }

    /// The embedded kernel sources compile with NVRTC for every architecture the library
    /// supports (NVRTC from PyPI, installed by `scripts/setup.sh`; no GPU needed).
    #[test]
    fn kernels_compile_with_nvrtc() {
        let wheel = concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/target/cuda-wheels/nvidia/cuda_nvrtc/lib/libnvrtc.so.12"
        );
        if std::env::var_os("OXCCL_NVRTC").is_none() && std::path::Path::new(wheel).exists() {
            std::env::set_var("OXCCL_NVRTC", wheel);
        }
        let (main, headers) = super::sources();
        // `scripts/gpu-check.sh --prepare` keeps the images as a kernel cache for the GPU
        // machine (which then needs no NVRTC).
        let export = std::env::var_os("OXCCL_KERNEL_EXPORT").map(std::path::PathBuf::from);
        // The architectures side by side (NVRTC's calls are thread-safe): each takes minutes
        // on one core, the longest part of the test run.
        let images: Vec<_> = std::thread::scope(|s| {
            let compiles: Vec<_> = [80, 90, 100]
                .map(|arch| {
                    let headers = &headers;
                    s.spawn(move || {
                        let img = super::nvrtc::compile(main, headers, arch, super::defines(true));
                        (arch, img)
                    })
                })
                .into_iter()
                .collect();
            compiles
                .into_iter()
                .map(|c| c.join().expect("an NVRTC compile"))
                .collect()
        });
        for (arch, img) in images {
            match img {
                Ok(img) => {
                    assert!(
                        img.what.contains(&format!("sm_{arch}")) && img.bytes.len() > 1000,
                        "sm_{arch}: no cubin ({})",
                        img.what
                    );
                    if let Some(dir) = &export {
                        std::fs::create_dir_all(dir).expect("export dir");
                        std::fs::write(dir.join(super::cache_name(arch, true)), &img.bytes)
                            .expect("export");
                    }
                }
                Err(e)
                    if e.msg.contains("NVRTC was not found")
                        && std::env::var_os("CI").is_none() =>
                {
                    eprintln!("skipped: {} (scripts/setup.sh installs it)", e.msg);
                    return;
                }
                Err(e) => panic!("sm_{arch}: {}", e.msg),
            }
        }
    }
}
