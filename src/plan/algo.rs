//! Which algorithms and protocol may serve a collective: `NCCL_ALGO` and `NCCL_PROTO` in NCCL's
//! syntax (`param::Selection`), checked once with a WARN for names NCCL does not know; and the
//! `NCCL_DEBUG_SUBSYS=TUNING` line that says what each collective got.

use crate::param::Selection;

/// The algorithms oxccl has, and NCCL's (which `NCCL_ALGO` may name; those oxccl lacks leave
/// it its own choice).
pub const OUR_ALGOS: [&str; 2] = ["ring", "direct"];
const NCCL_ALGOS: [&str; 8] = [
    "ring",
    "tree",
    "collnetdirect",
    "collnetchain",
    "nvls",
    "nvlstree",
    "pat",
    "direct",
];
const NCCL_PROTOS: [&str; 3] = ["ll", "ll128", "simple"];

/// `NCCL_ALGO` (or `OXCCL_ALGO=ring`, an older spelling of `NCCL_ALGO=Ring`), parsed once;
/// names it does not know are a WARN listing the known ones.
pub fn algo_selection() -> Option<&'static Selection> {
    static S: once_cell::sync::Lazy<Option<Selection>> = once_cell::sync::Lazy::new(|| {
        let v = crate::param::algo_value()?;
        let s = Selection::parse(&v);
        warn_unknown("NCCL_ALGO", &v, s.names(), &NCCL_ALGOS);
        Some(s)
    });
    S.as_ref()
}

/// `NCCL_PROTO`, parsed once: oxccl moves data one way (NCCL's Simple); a value that excludes
/// it is a WARN, as are names NCCL does not know.
pub fn proto_selection() -> Option<&'static Selection> {
    static S: once_cell::sync::Lazy<Option<Selection>> = once_cell::sync::Lazy::new(|| {
        let v = crate::param::proto_value()?;
        let s = Selection::parse(&v);
        warn_unknown("NCCL_PROTO", &v, s.names(), &NCCL_PROTOS);
        if !s.allows("allreduce", "simple", &NCCL_PROTOS) {
            crate::debug::warn(&format!(
                "NCCL_PROTO={v} excludes Simple, the only protocol oxccl has: using Simple"
            ));
        }
        Some(s)
    });
    S.as_ref()
}

fn warn_unknown<'a>(var: &str, v: &str, names: impl Iterator<Item = &'a str>, known: &[&str]) {
    let bad: Vec<&str> = names.filter(|n| !known.contains(n)).collect();
    if !bad.is_empty() {
        crate::debug::warn(&format!(
            "{var}={v}: unknown {} {} (known: {}); ignored",
            if bad.len() == 1 { "name" } else { "names" },
            bad.join(", "),
            known.join(", ")
        ));
    }
}

/// Whether algorithm `algo` ("ring", "direct") may serve collective `coll` (e.g. "AllReduce")
/// under `NCCL_ALGO`.
#[inline]
pub fn algo_allows(coll: &str, algo: &str) -> bool {
    algo_allows_among(coll, algo, &OUR_ALGOS)
}

/// `algo_allows` where the collective's candidates are `candidates` (a selection naming none
/// of them leaves oxccl its choice).
pub fn algo_allows_among(coll: &str, algo: &str, candidates: &[&str]) -> bool {
    match algo_selection() {
        None => true,
        Some(s) => s.allows(&coll.to_ascii_lowercase(), algo, candidates),
    }
}

/// Whether direct (board) algorithms may serve collective `kind` under `NCCL_ALGO`: a table
/// made once (the check sits on the small operations' launch path).
#[inline]
pub fn direct_allowed(kind: crate::types::CollKind) -> bool {
    use crate::types::CollKind as K;
    static T: once_cell::sync::Lazy<[bool; 10]> = once_cell::sync::Lazy::new(|| {
        let kinds = [
            K::AllReduce,
            K::Broadcast,
            K::Reduce,
            K::AllGather,
            K::ReduceScatter,
            K::AlltoAll,
            K::Gather,
            K::Scatter,
            K::Send,
            K::Recv,
        ];
        kinds.map(|k| algo_allows(k.name(), "direct"))
    });
    T[kind as usize]
}

/// Whether direct (board, zero-copy) algorithms may serve some collective (`NCCL_ALGO`).
pub fn direct_algorithms() -> bool {
    static D: once_cell::sync::Lazy<bool> = once_cell::sync::Lazy::new(|| {
        [
            "AllReduce",
            "Broadcast",
            "Reduce",
            "AllGather",
            "ReduceScatter",
        ]
        .iter()
        .any(|c| algo_allows(c, "direct"))
    });
    *D
}

/// Reads `NCCL_ALGO` and `NCCL_PROTO` (at the first communicator's init), so that a value with
/// names NCCL does not know is warned about at once.
pub fn check_env() {
    let _ = algo_selection();
    let _ = proto_selection();
}

/// With `NCCL_DEBUG=INFO` and `NCCL_DEBUG_SUBSYS` naming TUNING: the algorithm and protocol a
/// collective got, in words.
#[inline]
pub fn log_choice(coll: &str, bytes: usize, nranks: usize, algo: &str) {
    log_choice_with(coll, bytes, nranks, || algo.to_string());
}

/// `log_choice` where naming the algorithm takes work: `algo` runs only when the line prints.
#[inline]
pub fn log_choice_with(coll: &str, bytes: usize, nranks: usize, algo: impl FnOnce() -> String) {
    if crate::debug::subsys_enabled(crate::debug::Subsys::Tuning) {
        crate::debug::info(&format!(
            "{coll}: {bytes} Bytes -> Algo {} proto Simple nranks {nranks}",
            algo()
        ));
    }
}
