//! `cargo build` leaves `libnccl.so.2` (the SONAME programs ask the loader for) next to the
//! `libnccl.so` it builds, so `LD_LIBRARY_PATH=target/release` finds oxccl (build.rs makes the
//! link). Checks the link in this test run's profile directory (`target/release` under
//! `--release`) and loads the library through it.

use std::ffi::c_int;
use std::path::PathBuf;

/// `target/<profile>/`: this test binary lives in `target/<profile>/deps/`.
fn profile_dir() -> PathBuf {
    let exe = std::env::current_exe().unwrap();
    exe.parent().unwrap().parent().unwrap().to_path_buf()
}

#[test]
fn libnccl_so_2_is_the_built_library() {
    let dir = profile_dir();
    let (so, so2) = (dir.join("libnccl.so"), dir.join("libnccl.so.2"));
    let meta = std::fs::symlink_metadata(&so2)
        .unwrap_or_else(|e| panic!("{}: {e} (build.rs makes it)", so2.display()));
    assert!(
        meta.file_type().is_symlink(),
        "{} is not a link",
        so2.display()
    );
    assert!(so.exists(), "{} not built", so.display());
    assert_eq!(
        std::fs::canonicalize(&so2).unwrap(),
        std::fs::canonicalize(&so).unwrap(),
        "{} does not resolve to {}",
        so2.display(),
        so.display()
    );
    // SAFETY: loading oxccl's library runs no initialisers with preconditions.
    let lib = unsafe { libloading::Library::new(&so2) }.expect("dlopen libnccl.so.2");
    // SAFETY: the C prototypes of nccl.h and nccl_device/host.h.
    unsafe {
        let get_version: libloading::Symbol<unsafe extern "C" fn(*mut c_int) -> c_int> =
            lib.get(b"ncclGetVersion\0").expect("ncclGetVersion");
        let mut v: c_int = 0;
        assert_eq!(get_version(&mut v), 0);
        assert_eq!(v, 23203);
        // nccl-tests imports these weakly and calls them when they resolve.
        for f in [&b"ncclDevCommCreate\0"[..], b"ncclDevCommDestroy\0"] {
            let s: Result<libloading::Symbol<*const ()>, _> = lib.get(f);
            assert!(s.is_ok(), "{}", String::from_utf8_lossy(f));
        }
    }
}
