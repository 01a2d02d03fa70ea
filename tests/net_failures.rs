//! Failures on the wire, between "hosts" made of network namespaces (tests/common/netns.rs;
//! needs root, skipped otherwise): a peer killed on the other host is an error naming it within
//! seconds; a link taken down mid-collective ends in an error once the peer's heartbeats have
//! been missing for OXCCL_HEARTBEAT_S (well before the timeout), also for a rank that only
//! sends (what it sent waits for an acknowledgement as long: TCP_INFO); every rank process
//! exits either way. A receiver late by several times that limit, its window closed meanwhile,
//! is no failure. Through oxccl's socket transport (also with helper threads moving most of each
//! slot, `NCCL_SOCKET_NTHREADS`), and through its net plugin (`net-plugin/`, where the kernel's
//! TCP keepalive and the same TCP_INFO check stand in for the heartbeats). A split that waits
//! for a rank whose link went down fails as soon (the bootstrap's keepalive); a link down for
//! twice that limit while nobody waits on it is no failure: a split and all-reduces follow. A
//! rank that destroys its communicator with what it sent unacknowledged (its link down) waits
//! for it only as long. A first send's setup that waits for a rank which never connected to
//! the sender, whose host then goes silent, fails as soon (the sender's own connection to it,
//! watched).

use nccl::api::{self, StreamArg};
use nccl::error::Code;
use std::time::{Duration, Instant};

mod common;

const TEST: &str = "failures_on_the_wire_end_in_errors";

/// One rank's part (in a host's namespace): `case` says what happens.
fn rank(case: &str, r: usize, path: &str) {
    let id = common::netns::id_via_file(path, r);
    let c = api::comm_init_rank(2, &id, r as i32, Default::default()).unwrap();
    let count = 1 << 18;
    let send = vec![1f32; count];
    let mut recv = vec![0f32; count];
    let mut ok = 0usize;
    let mut t_fail = None;
    // "link-down-send": rank 0 only sends to rank 1, so once the link is down it waits on
    // bytes the peer never acknowledges, not on heartbeats. "late-recv": the same, the link up,
    // but rank 1 is late by 3 heartbeat limits before its 11th receive (20 MiB wait for it,
    // its socket's window closes meanwhile): no failure, 30 sends and receives.
    let one_way = matches!(case, "link-down-send" | "late-recv" | "destroy-link-down");
    let args = |send: &[f32], recv: &mut [f32]| {
        let mut a = common::all_reduce_f32(send, recv);
        if one_way {
            a.kind = if r == 0 {
                nccl::types::CollKind::Send
            } else {
                nccl::types::CollKind::Recv
            };
            a.root = 1 - r as i32;
        }
        a
    };
    // Operation `i`, which must succeed: the receiving ranks check what came.
    let expect = if one_way { 1.0 } else { 2.0 };
    let ok_op = |i: usize, recv: &mut [f32]| {
        recv.fill(0.0);
        api::enqueue(&c, args(&send, recv), StreamArg::Null)
            .unwrap_or_else(|e| panic!("rank {r}, operation {i}: {e}"));
        assert!(
            one_way && r == 0 || recv.iter().all(|&x| x == expect),
            "rank {r}: wrong result"
        );
    };
    if case == "link-down-split" {
        // 20 all-reduces; then rank 0 splits the communicator while rank 1, alive, does not
        // come, and the test takes its host's link down: rank 0's split waits on a bootstrap
        // message from rank 1 over a connection that no longer answers.
        for i in 0..20 {
            ok_op(i, &mut recv);
        }
        std::fs::write(format!("{path}.running{r}"), b"").unwrap();
        if r == 1 {
            // Until rank 0 is done (or long enough for it to have waited its bound).
            let t0 = Instant::now();
            while !std::path::Path::new(&format!("{path}.done")).exists()
                && t0.elapsed() < Duration::from_secs(40)
            {
                std::thread::sleep(Duration::from_millis(10));
            }
        } else {
            let t0 = Instant::now();
            let e = match api::comm_split(&c, 0, 0, None) {
                Ok(_) => panic!("rank 0: the split succeeded without rank 1"),
                Err(e) => e,
            };
            let took = t0.elapsed();
            std::fs::write(format!("{path}.done"), b"").unwrap();
            eprintln!("rank 0 (link-down-split): error after {took:?}: {e}");
            assert_eq!(e.code, Code::RemoteError, "{e}");
            assert!(e.msg.contains("rank 1"), "{e}");
            // The link goes down once both are running: the keepalive's limit
            // (OXCCL_HEARTBEAT_S=2) ends the wait, long before the bound (300 s).
            assert!(took < Duration::from_secs(10), "detected after {took:?}");
        }
        let _ = api::comm_abort(api::comm_handle(&c));
        return;
    }
    if case == "destroy-link-down" {
        // Rank 0 sends to rank 1 twice; then takes its host's link down itself and sends once
        // more: the call returns with the slots handed over, which then wait unacknowledged.
        // Its destroy waits for them only until the peer has been silent past the heartbeat
        // limit (OXCCL_HEARTBEAT_S=2), not for the setup bound (300 s).
        for i in 0..2 {
            ok_op(i, &mut recv);
        }
        if r == 0 {
            let st = std::process::Command::new("ip")
                .args(["link", "set", "eth0", "down"])
                .status()
                .unwrap();
            assert!(st.success());
            api::enqueue(&c, args(&send, &mut recv), StreamArg::Null)
                .unwrap_or_else(|e| panic!("rank 0, the send after the link went down: {e}"));
            let t0 = Instant::now();
            api::comm_destroy(api::comm_handle(&c)).unwrap();
            let took = t0.elapsed();
            eprintln!("rank 0 (destroy-link-down): destroy took {took:?}");
            assert!(took < Duration::from_secs(8), "destroy took {took:?}");
        } else {
            let e = api::enqueue(&c, args(&send, &mut recv), StreamArg::Null).unwrap_err();
            eprintln!("rank 1 (destroy-link-down): {e}");
            let _ = api::comm_abort(api::comm_handle(&c));
        }
        return;
    }
    if case == "link-blip" {
        // The link goes down for twice the heartbeat limit while neither rank waits on the
        // other: no failure. Then both split the communicator (the bootstrap's connections
        // still work) and all-reduce on the child.
        for i in 0..20 {
            ok_op(i, &mut recv);
        }
        std::fs::write(format!("{path}.running{r}"), b"").unwrap();
        let t0 = Instant::now();
        while !std::path::Path::new(&format!("{path}.up")).exists() {
            assert!(
                t0.elapsed() < Duration::from_secs(30),
                "the link never came back"
            );
            std::thread::sleep(Duration::from_millis(10));
        }
        let child = api::comm_split(&c, 0, r as i32, None)
            .unwrap_or_else(|e| panic!("rank {r}: split after the link came back: {e}"))
            .unwrap();
        for i in 0..5 {
            recv.fill(0.0);
            api::enqueue(&child, args(&send, &mut recv), StreamArg::Null)
                .unwrap_or_else(|e| panic!("rank {r}, child's all-reduce {i}: {e}"));
            assert!(recv.iter().all(|&x| x == 2.0), "rank {r}: wrong result");
        }
        eprintln!("rank {r} (link-blip): split and 5 all-reduces after the link came back");
        api::comm_destroy(api::comm_handle(&child)).unwrap();
        api::comm_destroy(api::comm_handle(&c)).unwrap();
        return;
    }
    if case == "late-recv" {
        for i in 0..30 {
            if i == 10 && r == 1 {
                std::thread::sleep(Duration::from_secs(6));
            }
            ok_op(i, &mut recv);
        }
        eprintln!("rank {r} (late-recv): 30 operations, no failure");
        api::comm_destroy(api::comm_handle(&c)).unwrap();
        return;
    }
    let e = loop {
        match api::enqueue(&c, args(&send, &mut recv), StreamArg::Null) {
            Ok(()) => {
                assert!(
                    r == 0 && one_way || recv.iter().all(|&x| x == expect),
                    "rank {r}: wrong result"
                );
                ok += 1;
                if ok == 20 {
                    // Running: the test may now break things.
                    std::fs::write(format!("{path}.running{r}"), b"").unwrap();
                    t_fail = Some(Instant::now());
                    if case == "kill" && r == 1 {
                        // Its last slots may still be on their way out when its call returns:
                        // let them leave, so that rank 0 completes all-reduce 20 too.
                        std::thread::sleep(Duration::from_millis(200));
                        nix::sys::signal::kill(
                            nix::unistd::getpid(),
                            nix::sys::signal::Signal::SIGKILL,
                        )
                        .unwrap();
                    }
                }
            }
            Err(e) => break e,
        }
    };
    let took = t_fail.map(|t| t.elapsed()).unwrap_or_default();
    eprintln!("rank {r} ({case}): error after {ok} all-reduces, {took:?} after the fault: {e}");
    assert!(ok >= 20, "rank {r}: failed before the fault: {e}");
    match case {
        "kill" => {
            assert_eq!(e.code, Code::RemoteError, "{e}");
            assert!(e.msg.contains("rank 1"), "{e}");
            assert!(took < Duration::from_secs(5), "detected after {took:?}");
        }
        _ => {
            // The timeout is 60 s: the missing heartbeats (OXCCL_HEARTBEAT_S=2) say it first.
            assert_eq!(e.code, Code::RemoteError, "{e}");
            assert!(
                e.msg.contains("not been heard from") || e.msg.contains("failed"),
                "{e}"
            );
            assert!(took < Duration::from_secs(8), "detected after {took:?}");
        }
    }
    let t0 = Instant::now();
    let _ = api::comm_abort(api::comm_handle(&c));
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "abort took {:?}",
        t0.elapsed()
    );
}

#[test]
fn failures_on_the_wire_end_in_errors() {
    if let Ok(path) = std::env::var("OXCCL_TEST_ID_FILE") {
        let r = common::netns::test_rank();
        return rank(&std::env::var("OXCCL_TEST_CASE").unwrap(), r, &path);
    }
    let Some(mut hosts) = common::netns::Hosts::new(2) else {
        return;
    };
    let plugin = common::oxccl_net_plugin().display().to_string();
    for (case, net_plugin, threads) in [
        ("kill", "", "1"),
        ("link-down", "", "1"),
        ("kill", "", "4"),
        ("link-down", "", "4"),
        ("kill", plugin.as_str(), "1"),
        ("link-down", plugin.as_str(), "1"),
        ("link-down-send", "", "1"),
        ("link-down-split", "", "1"),
        ("link-blip", "", "1"),
        ("destroy-link-down", "", "1"),
        ("late-recv", "", "1"),
        ("link-down-send", plugin.as_str(), "1"),
        ("late-recv", plugin.as_str(), "1"),
    ] {
        let path = std::env::temp_dir()
            .join(format!(
                "oxccl-wire-{}-{case}-{threads}",
                std::process::id()
            ))
            .display()
            .to_string();
        let env: Vec<(&str, &str)> = [
            ("OXCCL_TEST_CASE", case),
            ("OXCCL_HEARTBEAT_S", "2"),
            // 4 sockets; a slot of 512 KiB (across hosts) is cut into 4 parts, three of them
            // moved by helpers.
            ("NCCL_SOCKET_NTHREADS", threads),
            ("NCCL_DEBUG", "INFO"),
        ]
        .into_iter()
        .chain(
            [("NCCL_NET_PLUGIN", net_plugin)]
                .into_iter()
                .filter(|_| !net_plugin.is_empty()),
        )
        .collect();
        hosts.start_ranks(TEST, &path, 2, |r| r, &env);
        if case.starts_with("link-") {
            let t0 = Instant::now();
            // (One way, the receiver is the one behind: its 20th receive means the sender's
            // 20th send too.)
            let who = if case == "link-down-send" { 1 } else { 0 };
            while !std::path::Path::new(&format!("{path}.running{who}")).exists()
                || matches!(case, "link-down-split" | "link-blip")
                    && !std::path::Path::new(&format!("{path}.running1")).exists()
            {
                assert!(
                    t0.elapsed() < Duration::from_secs(60),
                    "the ranks never ran"
                );
                std::thread::sleep(Duration::from_millis(2));
            }
            let ns = hosts.ns(1);
            let st = std::process::Command::new("ip")
                .args(["-n", &ns, "link", "set", "eth0", "down"])
                .status()
                .unwrap();
            assert!(st.success());
            if case == "link-blip" {
                std::thread::sleep(Duration::from_secs(4));
                let st = std::process::Command::new("ip")
                    .args(["-n", &ns, "link", "set", "eth0", "up"])
                    .status()
                    .unwrap();
                assert!(st.success());
                std::fs::write(format!("{path}.up"), b"").unwrap();
            }
        }
        let t0 = Instant::now();
        let ok = hosts.wait_for(Duration::from_secs(30));
        let logs = common::netns::joined_logs(&path, 2);
        for f in [
            path.clone(),
            format!("{path}.running0"),
            format!("{path}.running1"),
            format!("{path}.done"),
            format!("{path}.up"),
        ] {
            let _ = std::fs::remove_file(f);
        }
        eprintln!(
            "{case}: ranks ended {:?} after the start of the wait\n{logs}",
            t0.elapsed()
        );
        // The killed rank's own process fails (SIGKILL); rank 0's must pass.
        let want = if case == "kill" {
            [true, false]
        } else {
            [true, true]
        };
        assert_eq!(
            ok,
            Some(want.to_vec()),
            "{case} ({net_plugin}, {threads} threads):\n{logs}"
        );
        if threads != "1" {
            assert!(
                logs.contains("helper thread(s)"),
                "{case}: no helper threads:\n{logs}"
            );
        }
        if !net_plugin.is_empty() {
            assert!(
                logs.contains("via NET/oxsocket"),
                "{case}: not the plugin:\n{logs}"
            );
        }
        if case.starts_with("link-") || case == "destroy-link-down" {
            // (Rank 0 took its own host's link down there.)
            let ns = hosts.ns(if case == "destroy-link-down" { 0 } else { 1 });
            let _ = std::process::Command::new("ip")
                .args(["-n", &ns, "link", "set", "eth0", "up"])
                .status();
        }
    }
}

const SILENT_TEST: &str = "a_first_send_to_a_rank_whose_host_goes_silent_fails_at_the_heartbeat";

/// Rank 0 (host 0) sends for the first time to rank 2 (host 1, with ranks 1 and 3), which has
/// no bootstrap connection to rank 0 (4 ranks: no ring neighbour of it) and is late: the setup
/// waits for its blob, watching it through rank 0's own connection to it. Host 1's link goes
/// down meanwhile: the keepalive (`OXCCL_HEARTBEAT_S=2`) ends the wait with `ncclRemoteError`
/// naming rank 2 and the silent host, long before the setup wait's bound (60 s here).
#[test]
fn a_first_send_to_a_rank_whose_host_goes_silent_fails_at_the_heartbeat() {
    if let Ok(path) = std::env::var("OXCCL_TEST_ID_FILE") {
        let r = common::netns::test_rank();
        let id = common::netns::id_via_file(&path, r);
        let c = api::comm_init_rank(4, &id, r as i32, Default::default()).unwrap();
        if r != 0 {
            // Until rank 0 is done (or long enough for it to have waited its bound).
            let t0 = Instant::now();
            while !std::path::Path::new(&format!("{path}.done")).exists()
                && t0.elapsed() < Duration::from_secs(40)
            {
                std::thread::sleep(Duration::from_millis(10));
            }
            let _ = api::comm_abort(api::comm_handle(&c));
            return;
        }
        let send = vec![1f32; 1000];
        let mut recv = vec![0f32; 1000];
        let a = api::CollArgs {
            kind: nccl::types::CollKind::Send,
            root: 2,
            ..common::all_reduce_f32(&send, &mut recv)
        };
        std::fs::write(format!("{path}.sending"), b"").unwrap();
        let t0 = Instant::now();
        let e = api::enqueue(&c, a, StreamArg::Null).expect_err("a send to a silent host");
        let took = t0.elapsed();
        std::fs::write(format!("{path}.done"), b"").unwrap();
        eprintln!("rank 0: the send failed after {took:?}: {e}");
        assert_eq!(e.code, Code::RemoteError, "{e}");
        assert!(
            e.msg.contains("rank 2 is gone") && e.msg.contains("did not answer"),
            "{e}"
        );
        assert!(took < Duration::from_secs(20), "failed after {took:?}: {e}");
        let _ = api::comm_abort(api::comm_handle(&c));
        return;
    }
    let Some(mut hosts) = common::netns::Hosts::new(2) else {
        return;
    };
    let path = std::env::temp_dir()
        .join(format!("oxccl-silent-{}", std::process::id()))
        .display()
        .to_string();
    let env = [("OXCCL_HEARTBEAT_S", "2"), ("NCCL_DEBUG", "WARN")];
    hosts.start_ranks(SILENT_TEST, &path, 4, |r| usize::from(r != 0), &env);
    let t0 = Instant::now();
    while !std::path::Path::new(&format!("{path}.sending")).exists() {
        assert!(t0.elapsed() < Duration::from_secs(60), "rank 0 never sent");
        std::thread::sleep(Duration::from_millis(2));
    }
    // Past the first second of the wait, when rank 0 watches rank 2.
    std::thread::sleep(Duration::from_millis(1500));
    let ns = hosts.ns(1);
    let down = |how: &str| {
        std::process::Command::new("ip")
            .args(["-n", &ns, "link", "set", "eth0", how])
            .status()
            .unwrap()
    };
    assert!(down("down").success());
    let ok = hosts.wait_for(Duration::from_secs(60));
    let _ = down("up");
    let logs = common::netns::joined_logs(&path, 4);
    for f in [
        path.clone(),
        format!("{path}.sending"),
        format!("{path}.done"),
    ] {
        let _ = std::fs::remove_file(f);
    }
    eprintln!("{logs}");
    assert_eq!(ok, Some(vec![true, true]), "{logs}");
}
