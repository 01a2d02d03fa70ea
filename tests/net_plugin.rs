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

/// The child of `config_net_name_picks_the_network_between_hosts`: one of two ranks on two
/// "hosts", its `config.netName` from `OXCCL_TEST_NET_NAME_<rank>` (unset: none); an
/// all-reduce checked, or (`OXCCL_TEST_EXPECT=error`) an init that fails.
#[test]
fn net_name_rank() {
    let Some((id, n, r)) = common::rank_env() else {
        return;
    };
    let config = nccl::types::CommConfig {
        net_name: std::env::var(format!("OXCCL_TEST_NET_NAME_{r}")).ok(),
        ..Default::default()
    };
    let res = nccl::api::comm_init_rank(n as i32, &id, r as i32, config);
    if std::env::var("OXCCL_TEST_EXPECT").as_deref() == Ok("error") {
        let e = res.err().expect("the init must fail");
        println!("RESULT {:?}: {}", e.code, e.msg);
        return;
    }
    let comm = res.unwrap();
    let send: Vec<f32> = (0..4096).map(|i| (i * (r + 1)) as f32).collect();
    let mut recv = vec![0f32; send.len()];
    let a = common::all_reduce_f32(&send, &mut recv);
    nccl::api::enqueue(&comm, a, nccl::exec::Stream::Null).unwrap();
    assert!(recv.iter().enumerate().all(|(i, &x)| x == (3 * i) as f32));
    nccl::api::comm_destroy(nccl::api::comm_handle(&comm)).unwrap();
    println!("RESULT ok");
}

/// Runs `net_name_rank` as two ranks on two "hosts" with oxccl's socket transport loaded as a
/// net plugin (name `oxsocket`), rank r's `config.netName` `names[r]`, `env` added: each
/// rank's output.
fn net_name_ranks(names: [Option<&str>; 2], expect: &str, env: &[(&str, &str)]) -> Vec<String> {
    let exe = std::env::current_exe().unwrap();
    let plugin = common::oxccl_net_plugin();
    let id = nccl::api::get_unique_id().unwrap();
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    let kids: Vec<_> = (0..2)
        .map(|r| {
            let mut c = Command::new(&exe);
            c.args(["--exact", "net_name_rank", "--nocapture"])
                .env("OXCCL_DEVICE", "host")
                .env("OXCCL_TEST_ID", &hex)
                .env("OXCCL_TEST_N", "2")
                .env("OXCCL_TEST_RANK", r.to_string())
                .env("OXCCL_TIMEOUT_S", "60")
                .env("OXCCL_HOSTID", format!("net-name-host-{r}"))
                .env("NCCL_NET_PLUGIN", &plugin)
                .env("NCCL_DEBUG", "INFO")
                .env("OXCCL_TEST_EXPECT", expect)
                .env_remove("NCCL_NET")
                .envs(env.iter().copied())
                .stdout(std::process::Stdio::piped())
                .stderr(std::process::Stdio::piped());
            if let Some(name) = names[r] {
                c.env(format!("OXCCL_TEST_NET_NAME_{r}"), name);
            }
            c.spawn().unwrap()
        })
        .collect();
    kids.into_iter()
        .map(|k| {
            let out = k.wait_with_output().unwrap();
            let text = String::from_utf8_lossy(&out.stdout).to_string()
                + &String::from_utf8_lossy(&out.stderr);
            assert!(out.status.success(), "{names:?}:\n{text}");
            text
        })
        .collect()
}

/// `config.netName` picks the network between hosts per communicator, as in NCCL: `Socket`
/// the socket transport although a plugin is loaded, the plugin's name (any case) the plugin,
/// unset the plugin, and `NCCL_NET` overrides it; a name that is neither fails the init with
/// ncclInvalidUsage naming what there is; ranks that pick differently fail their init naming
/// both, where NCCL's would fail their connections.
#[test]
fn config_net_name_picks_the_network_between_hosts() {
    let socket = [("NCCL_NET", "Socket")];
    for (names, env, via) in [
        (
            [Some("Socket"), Some("socket")],
            &[][..],
            "via NET/Socket/0",
        ),
        (
            [Some("OXSOCKET"), Some("oxsocket")],
            &[],
            "via NET/oxsocket/0",
        ),
        ([None, None], &[], "via NET/oxsocket/0"),
        (
            [Some("oxsocket"), Some("oxsocket")],
            &socket,
            "via NET/Socket/0",
        ),
    ] {
        let outs = net_name_ranks(names, "ok", env);
        for t in &outs {
            assert!(t.contains("RESULT ok"), "{names:?}:\n{t}");
        }
        let all = outs.concat();
        assert!(all.contains(via), "{names:?}: no '{via}' in\n{all}");
        assert_eq!(
            all.matches("via NET/").count(),
            all.matches(via).count(),
            "{all}"
        );
        if !env.is_empty() {
            let reset = "NCCL INFO Comm config netName oxsocket reset to NCCL_NET=Socket";
            assert!(all.contains(reset), "{all}");
        }
    }
    let outs = net_name_ranks([Some("IB"), Some("IB")], "error", &[]);
    for t in &outs {
        assert!(
            t.contains(
                "RESULT InvalidUsage: config.netName \"IB\": no such network here \
                 (oxccl has Socket and the net plugin 'oxsocket')"
            ),
            "{t}"
        );
    }
    let outs = net_name_ranks([Some("Socket"), None], "error", &[]);
    for t in &outs {
        assert!(
            t.contains("RESULT InvalidUsage: rank 0 (process ")
                && t.contains("moves data between hosts through the socket transport and rank 1 (process ")
                && t.contains("through the net plugin: config.netName (or NCCL_NET, which overrides it) must name one network on every rank")
                && t.contains("and a net plugin load on every host or none"),
            "{t}"
        );
    }
}
