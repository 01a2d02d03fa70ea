//! Without a CUDA driver: the host executor runs by default, and `OXCCL_DEVICE=cuda` fails
//! cleanly (an error code and a message naming what is missing, never a panic) at communicator
//! creation and `ncclMemAlloc`. Each case runs in a child process (the executor is chosen once
//! per process).

mod common;

/// The child's output for `case`, with `OXCCL_DEVICE` set to `device` (empty: unset).
fn child(case: &str, device: &str) -> String {
    common::in_child(
        "child_entry",
        &[("OXCCL_ABSENT_CASE", case), ("OXCCL_DEVICE", device)],
    )
}

fn driver_present() -> bool {
    // SAFETY: loading libcuda runs its initialisers only.
    unsafe { libloading::Library::new("libcuda.so.1").is_ok() }
}

/// The child's side: prints what happened, for the parent to check.
#[test]
fn child_entry() {
    if !common::is_child() {
        return;
    }
    let Ok(case) = std::env::var("OXCCL_ABSENT_CASE") else {
        return;
    };
    match case.as_str() {
        "init" => match nccl::api::comm_init_all(&[0, 1]) {
            Ok(_) => println!("RESULT ok kind={:?}", nccl::gpu::kind()),
            Err(e) => println!("RESULT err code={:?} msg={}", e.code, e.msg),
        },
        "memalloc" => match nccl::exec::mem_alloc(4096) {
            Ok(p) => {
                println!("RESULT ok");
                let _ = nccl::exec::mem_free(p);
            }
            Err(e) => println!("RESULT err code={:?} msg={}", e.code, e.msg),
        },
        _ => unreachable!(),
    }
}

#[test]
fn no_driver_means_the_host_executor() {
    if driver_present() {
        eprintln!("skipped: this machine has a CUDA driver");
        return;
    }
    let out = child("init", "");
    assert!(out.contains("RESULT ok kind=Host"), "{out}");
}

#[test]
fn oxccl_device_cuda_without_a_driver_is_a_clear_error() {
    if driver_present() {
        eprintln!("skipped: this machine has a CUDA driver");
        return;
    }
    for case in ["init", "memalloc"] {
        let out = child(case, "cuda");
        assert!(
            out.contains("RESULT err code=UnhandledCudaError") && out.contains("libcuda.so.1"),
            "{case}: {out}"
        );
    }
}

/// A stand-in `libcuda.so.1` in a folder of its own (the folder): `cuInit` returns `init`,
/// `cuDeviceGetCount` says one device, and nothing else is there, as in a driver too old for
/// the CUDA executor.
fn old_driver(init: i32) -> std::path::PathBuf {
    let dir = std::path::Path::new(env!("CARGO_TARGET_TMPDIR")).join(format!("old-libcuda-{init}"));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("cuda.c");
    std::fs::write(
        &src,
        format!(
            "int cuInit(unsigned f) {{ (void)f; return {init}; }}\n\
             int cuDeviceGetCount(int* n) {{ *n = 1; return 0; }}\n"
        ),
    )
    .unwrap();
    let so = dir.join("libcuda.so.1");
    let ok = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&so)
        .arg(&src)
        .status()
        .expect("cc");
    assert!(ok.success(), "compiling the stand-in driver");
    dir
}

/// A driver that sees a device but lacks what the CUDA executor calls: the program's buffers
/// are device memory, so not the host executor (it would dereference them) but an error at
/// the first communicator naming what is missing. A driver that sees no device
/// (`CUDA_ERROR_NO_DEVICE` from `cuInit`): the host executor.
#[test]
fn a_driver_too_old_that_sees_a_device_is_an_error_not_the_host_executor() {
    if driver_present() {
        eprintln!("skipped: this machine has a CUDA driver");
        return;
    }
    let dir = old_driver(0);
    let path = dir.to_str().unwrap();
    let out = common::in_child(
        "child_entry",
        &[
            ("OXCCL_ABSENT_CASE", "init"),
            ("OXCCL_DEVICE", ""),
            ("LD_LIBRARY_PATH", path),
        ],
    );
    assert!(
        out.contains("RESULT err code=UnhandledCudaError")
            && out.contains("lacks")
            && out.contains("too old"),
        "{out}"
    );
    let dir = old_driver(100);
    let out = common::in_child(
        "child_entry",
        &[
            ("OXCCL_ABSENT_CASE", "init"),
            ("OXCCL_DEVICE", ""),
            ("LD_LIBRARY_PATH", dir.to_str().unwrap()),
        ],
    );
    assert!(out.contains("RESULT ok kind=Host"), "{out}");
}
