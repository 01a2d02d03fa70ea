//! Ranks on two "hosts" (processes with different host identities, `OXCCL_HOSTID`, on this
//! machine's loopback): traffic inside a host goes over shared memory, traffic between hosts
//! over the network transport (TCP, moved by each communicator's proxy thread).

use nccl::api::{self, CollArgs, StreamArg};
use nccl::error::Code;
use nccl::types::{CollKind, DataType, OP_SUM};
use std::time::{Duration, Instant};

mod common;

fn f32s(v: &[f32]) -> usize {
    v.as_ptr() as usize
}

#[test]
fn two_hosts_inside_over_shared_memory_across_over_the_network() {
    let Some((id, n, r)) = common::rank_env() else {
        // The timeout is far above what the test allows: failing fast is what is tested.
        return common::run_ranks(
            "two_hosts_inside_over_shared_memory_across_over_the_network",
            4,
            &[],
        );
    };
    // Ranks 0, 1 on host A; 2, 3 on host B.
    std::env::set_var("OXCCL_HOSTID", format!("test-host-{}", r / 2));
    let c = api::comm_init_rank(n as i32, &id, r as i32, Default::default()).unwrap();
    // One load/store team per host, ranks placed host by host.
    assert_eq!(api::comm_lsa(&c).unwrap(), (r, 4, r % 2, 2, 2), "rank {r}");
    let h = api::comm_handle(&c);
    // SAFETY: a live communicator handle.
    let lsa = unsafe { nccl::abi::ncclTeamLsa(h as nccl::abi::ncclComm_t) };
    assert_eq!((lsa.nRanks, lsa.rank, lsa.stride), (2, (r % 2) as i32, 1));
    // SAFETY: as above.
    let rail = unsafe { nccl::abi::ncclTeamRail(h as nccl::abi::ncclComm_t) };
    assert_eq!(
        (rail.nRanks, rail.rank, rail.stride),
        (2, (r / 2) as i32, 2)
    );
    // Send/Recv inside each host: 0 -> 1, 2 -> 3.
    let count = 300_000;
    let peer = r ^ 1;
    let send: Vec<f32> = (0..count).map(|i| (r * count + i) as f32).collect();
    let mut recv = vec![0f32; count];
    let p2p = |kind, buf: usize| CollArgs {
        kind,
        send: buf,
        recv: buf,
        count,
        dtype: DataType::Float32,
        op: OP_SUM,
        root: peer as i32,
    };
    let a = if r % 2 == 0 {
        p2p(CollKind::Send, f32s(&send))
    } else {
        p2p(CollKind::Recv, recv.as_mut_ptr() as usize)
    };
    api::enqueue(&c, a, StreamArg::Null).unwrap();
    if r % 2 == 1 {
        for (i, x) in recv.iter().enumerate() {
            assert_eq!(*x, (peer * count + i) as f32, "rank {r} element {i}");
        }
    }
    // An all-reduce: the ring crosses hosts.
    let t0 = Instant::now();
    api::enqueue(
        &c,
        common::all_reduce_f32(&send, &mut recv),
        StreamArg::Null,
    )
    .unwrap();
    for (i, x) in recv.iter().enumerate() {
        let want: f32 = (0..n).map(|p| (p * count + i) as f32).sum();
        assert_eq!(*x, want, "rank {r} element {i}");
    }
    eprintln!("rank {r}: all-reduce across hosts took {:?}", t0.elapsed());
    assert!(t0.elapsed() < Duration::from_secs(20));
    api::comm_destroy(h).unwrap();
}

/// A rank that finds a failure tells every peer (through the bootstrap), so ranks that only
/// wait on it indirectly stop too: 4 "hosts" in a ring, rank 3 killed mid-loop; ranks 0-2 all
/// get an error within seconds (the timeout is 60 s), whichever of them saw the death first.
#[test]
fn a_death_reaches_every_rank_of_a_ring() {
    const T: &str = "a_death_reaches_every_rank_of_a_ring";
    if let Ok(r) = std::env::var("OXCCL_RING_DEATH_RANK") {
        let r: usize = r.parse().unwrap();
        let hex = std::env::var("OXCCL_RING_DEATH_ID").unwrap();
        let mut id = [0u8; api::UNIQUE_ID_BYTES];
        for (i, b) in id.iter_mut().enumerate() {
            *b = u8::from_str_radix(&hex[2 * i..2 * i + 2], 16).unwrap();
        }
        std::env::set_var("OXCCL_HOSTID", format!("ring-death-host-{r}"));
        let c = api::comm_init_rank(4, &id, r as i32, Default::default()).unwrap();
        let count = 1 << 16;
        let send = vec![1f32; count];
        let mut recv = vec![0f32; count];
        let t0 = Instant::now();
        for i in 0.. {
            if i == 30 && r == 3 {
                nix::sys::signal::kill(nix::unistd::getpid(), nix::sys::signal::Signal::SIGKILL)
                    .unwrap();
            }
            let a = common::all_reduce_f32(&send, &mut recv);
            if let Err(e) = api::enqueue(&c, a, StreamArg::Null) {
                // (The ranks are not in step: rank 3 may die before the others reach 30.)
                let took = t0.elapsed();
                eprintln!("rank {r}: error after {i} all-reduces, {took:?}: {e}");
                assert_eq!(e.code, Code::RemoteError, "rank {r}: {e}");
                assert!(e.msg.contains("rank 3"), "rank {r}: {e}");
                assert!(
                    took < Duration::from_secs(10),
                    "rank {r}: after {took:?}: {e}"
                );
                let _ = api::comm_abort(api::comm_handle(&c));
                return;
            }
        }
    }
    let id = api::get_unique_id().unwrap();
    let hex: String = id.iter().map(|b| format!("{b:02x}")).collect();
    let exe = std::env::current_exe().unwrap();
    let kids: Vec<_> = (0..4)
        .map(|r| {
            std::process::Command::new(&exe)
                .args(["--exact", T, "--nocapture"])
                .env("OXCCL_DEVICE", "host")
                .env("OXCCL_TIMEOUT_S", "60")
                .env("OXCCL_RING_DEATH_ID", &hex)
                .env("OXCCL_RING_DEATH_RANK", r.to_string())
                .stdout(std::process::Stdio::null())
                .spawn()
                .unwrap()
        })
        .collect();
    let t0 = Instant::now();
    for (r, mut k) in kids.into_iter().enumerate() {
        let st = k.wait().unwrap();
        assert_eq!(st.success(), r != 3, "rank {r}: {st:?}");
    }
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "took {:?}",
        t0.elapsed()
    );
}
