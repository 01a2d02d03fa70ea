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
