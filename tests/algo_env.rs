//! `NCCL_ALGO` in NCCL's syntax steers the host executor's choice per collective, names NCCL
//! does not know are a WARN listing the known ones, and `NCCL_DEBUG_SUBSYS=TUNING` shows the
//! algorithm each collective got. Each case runs in a child process (settings are read once).

mod common;

/// The child's output under `NCCL_ALGO` / `NCCL_PROTO` (an empty value is unset).
fn child(algo: Option<&str>, proto: Option<&str>) -> String {
    common::in_child(
        "child_entry",
        &[
            ("NCCL_DEBUG", "INFO"),
            ("NCCL_DEBUG_SUBSYS", "INIT,TUNING"),
            ("OXCCL_ALGO", ""),
            ("NCCL_ALGO", algo.unwrap_or("")),
            ("NCCL_PROTO", proto.unwrap_or("")),
        ],
    )
}

/// Two ranks on host slots: an all-reduce and a broadcast of 64 floats, checked.
#[test]
fn child_entry() {
    if !common::is_child() {
        return;
    }
    use nccl::types::{CollArgs, CollKind, DataType};
    let comms = nccl::api::comm_init_all(&[0, 1]).unwrap();
    let n = 64;
    let mut send: Vec<Vec<f32>> = (0..2).map(|r| vec![r as f32 + 1.0; n]).collect();
    let mut recv: Vec<Vec<f32>> = vec![vec![0.0; n]; 2];
    for kind in [CollKind::AllReduce, CollKind::Broadcast] {
        nccl::api::group_start().unwrap();
        for (r, c) in comms.iter().enumerate() {
            let a = CollArgs {
                kind,
                send: send[r].as_mut_ptr() as usize,
                recv: recv[r].as_mut_ptr() as usize,
                count: n,
                dtype: DataType::Float32,
                op: 0,
                root: 0,
            };
            nccl::api::enqueue(c, a, nccl::exec::Stream::Null).unwrap();
        }
        nccl::api::group_end().unwrap();
        let want = if kind == CollKind::AllReduce {
            3.0
        } else {
            1.0
        };
        assert!(
            recv.iter().flatten().all(|&x| x == want),
            "{kind:?}: {recv:?}"
        );
    }
}

fn algo_of<'a>(out: &'a str, coll: &str) -> &'a str {
    let line = out
        .lines()
        .find(|l| l.contains(&format!("{coll}: 256 Bytes -> Algo ")))
        .unwrap_or_else(|| panic!("no TUNING line for {coll}:\n{out}"));
    let at = line.find("Algo ").unwrap() + 5;
    line[at..].split(" proto").next().unwrap()
}

#[test]
fn nccl_algo_steers_each_collective() {
    let out = child(None, None);
    assert_eq!(algo_of(&out, "AllReduce"), "Direct", "{out}");
    let out = child(Some("allreduce:ring"), None);
    assert_eq!(algo_of(&out, "AllReduce"), "Ring", "{out}");
    assert_eq!(algo_of(&out, "Broadcast"), "Direct", "{out}");
    let out = child(Some("^Direct"), None);
    assert_eq!(algo_of(&out, "AllReduce"), "Ring", "{out}");
    assert_eq!(algo_of(&out, "Broadcast"), "Ring", "{out}");
    // Only algorithms oxccl lacks: its own choice.
    let out = child(Some("Tree"), None);
    assert_eq!(algo_of(&out, "AllReduce"), "Direct", "{out}");
}

#[test]
fn unknown_names_and_protocols_oxccl_lacks_are_warned() {
    let out = child(Some("Ring,Bogus"), Some("LL"));
    assert!(
        out.contains("NCCL WARN NCCL_ALGO=Ring,Bogus: unknown name bogus (known: ring, tree"),
        "{out}"
    );
    assert!(
        out.contains("NCCL WARN NCCL_PROTO=LL excludes Simple, the only protocol oxccl has"),
        "{out}"
    );
    assert_eq!(algo_of(&out, "AllReduce"), "Ring", "{out}");
}
