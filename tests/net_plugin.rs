//! NCCL net plugins: one that does not exist, or loads but cannot be used, is a WARN naming it
//! and the reason, and everything still works; one that loads is identified by its
//! ncclNetPlugin_vN symbol and name. (Data through a working plugin: tests/perf_tools.rs,
//! every_collective_through_a_net_plugin.)

mod common;

use std::process::Command;

#[test]
fn a_plugin_that_loads_is_identified() {
    let dir = std::env::temp_dir().join(format!("oxccl-net-plugin-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("fake.c");
    // Only the first field of every ncclNet_vN is read: the plugin's name.
    std::fs::write(
        &src,
        "struct fake { const char* name; void* rest[32]; };\n\
         struct fake ncclNetPlugin_v8 = { \"fake-net\", {0} };\n",
    )
    .unwrap();
    let so = dir.join("libnccl-net-fake.so");
    let st = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&so)
        .arg(&src)
        .status();
    if !st.is_ok_and(|s| s.success()) {
        eprintln!("skipped: no C compiler");
        return;
    }
    let found = nccl::transport::plugin::find(Some(so.to_str().unwrap()));
    match found {
        nccl::transport::plugin::Found::Loaded(file, 8, name, table) => {
            assert_eq!(
                (file, name.as_str()),
                (so.display().to_string(), "fake-net")
            );
            assert_ne!(table, 0);
        }
        f => panic!("{f:?}"),
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// The child: two ranks on host slots, an all-reduce checked.
#[test]
fn child_entry() {
    if !common::is_child() {
        return;
    }
    let comms = nccl::api::comm_init_all(&[0, 1]).unwrap();
    let mut bufs: Vec<Vec<f32>> = (0..2).map(|r| vec![r as f32 + 1.0; 1000]).collect();
    nccl::api::group_start().unwrap();
    for (r, c) in comms.iter().enumerate() {
        let p = bufs[r].as_mut_ptr() as usize;
        let a = nccl::types::CollArgs {
            kind: nccl::types::CollKind::AllReduce,
            send: p,
            recv: p,
            count: 1000,
            dtype: nccl::types::DataType::Float32,
            op: 0,
            root: 0,
        };
        nccl::api::enqueue(c, a, nccl::exec::Stream::Null).unwrap();
    }
    nccl::api::group_end().unwrap();
    assert!(bufs.iter().flatten().all(|&x| x == 3.0));
    println!("RESULT ok");
}

#[test]
fn a_missing_plugin_is_a_warning_and_everything_works() {
    let text = common::in_child(
        "child_entry",
        &[
            ("NCCL_DEBUG", "WARN"),
            ("NCCL_NET_PLUGIN", "oxccl-test-missing"),
            ("NCCL_NET", "IB"),
        ],
    );
    assert!(text.contains("RESULT ok"), "{text}");
    assert!(
        text.contains("NCCL WARN NET/Plugin: NCCL_NET_PLUGIN=oxccl-test-missing could not be loaded (tried libnccl-net-oxccl-test-missing.so"),
        "{text}"
    );
    assert!(
        text.contains(
            "NCCL WARN NCCL_NET=IB: no such network here (oxccl has Socket); using Socket"
        ),
        "{text}"
    );
}

/// A plugin that loads but cannot be used (here: no init function) is a WARN saying why, and
/// the socket transport carries the data.
#[test]
fn an_unusable_plugin_is_a_warning_and_everything_works() {
    let dir = std::env::temp_dir().join(format!("oxccl-net-plugin-bad-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let src = dir.join("bad.c");
    std::fs::write(
        &src,
        "struct bad { const char* name; void* rest[32]; };\n\
         struct bad ncclNetPlugin_v9 = { \"bad-net\", {0} };\n",
    )
    .unwrap();
    let so = dir.join("libnccl-net-bad.so");
    let st = Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(&so)
        .arg(&src)
        .status();
    assert!(st.is_ok_and(|s| s.success()), "cc");
    let text = common::in_child(
        "child_entry",
        &[
            ("NCCL_DEBUG", "WARN"),
            ("NCCL_NET_PLUGIN", so.to_str().unwrap()),
        ],
    );
    let _ = std::fs::remove_dir_all(&dir);
    assert!(text.contains("RESULT ok"), "{text}");
    assert!(
        text.contains("NCCL WARN NET/Plugin: net plugin 'bad-net' (ncclNet_v9) from")
            && text.contains("cannot be used: net plugin 'bad-net' has no init function; using oxccl's socket transport"),
        "{text}"
    );
}
