//! What a rank called, as two words that every rank of an operation can compare: peers check
//! each other's calls on the board (direct operations) and in every FIFO slot they receive (step
//! programs), so ranks that called different things get an error before anything is written.
//! Plain data: a CUDA executor carries the same words.

use super::RedSpec;
use crate::types::{CollKind, DataType};

/// (count, kind | datatype << 8 | reduction << 16 | root << 32); point-to-point traffic is
/// (bytes, `P2P`): a send must carry the bytes its receive expects, whatever the datatypes.
pub type Call = [u64; 2];

/// The kind code of point-to-point traffic.
const P2P: u64 = 0xff;

const KINDS: [CollKind; 10] = [
    CollKind::AllReduce,
    CollKind::Broadcast,
    CollKind::Reduce,
    CollKind::AllGather,
    CollKind::ReduceScatter,
    CollKind::AlltoAll,
    CollKind::Gather,
    CollKind::Scatter,
    CollKind::Send,
    CollKind::Recv,
];

fn rooted(kind: CollKind) -> bool {
    matches!(
        kind,
        CollKind::Broadcast | CollKind::Reduce | CollKind::Gather | CollKind::Scatter
    )
}

/// A collective call's words.
#[inline]
pub fn of_coll(
    kind: CollKind,
    count: usize,
    dtype: DataType,
    red: Option<RedSpec>,
    root: usize,
) -> Call {
    #[inline(always)]
    fn code(red: Option<RedSpec>) -> u64 {
        match red {
            None => 0,
            Some(RedSpec::Ready(r)) => {
                1 + r.kind as u64
                    + 4 * u64::from(r.premul.is_some())
                    + 8 * u64::from(r.postdiv.is_some())
            }
            Some(RedSpec::PreMul { .. }) => 16,
        }
    }
    let red = code(red);
    let root = if rooted(kind) { root as u64 } else { 0 };
    // The declaration order, which `KINDS` follows (checked by a test).
    let kind = kind as u64;
    [
        count as u64,
        kind | (dtype as u64) << 8 | red << 16 | root << 32,
    ]
}

/// Point-to-point traffic of `bytes`.
pub fn of_p2p(bytes: usize) -> Call {
    [bytes as u64, P2P]
}

/// Whether the call is an all-gather or a reduce-scatter: its count is one rank's segment of
/// a buffer of a segment per rank.
pub fn segmented(c: Call) -> bool {
    c[1] != P2P
        && matches!(
            KINDS.get((c[1] & 0xff) as usize),
            Some(CollKind::AllGather | CollKind::ReduceScatter)
        )
}

/// A call's words as a user would write it: "AllReduce of 4 x float (sum)", "4096 bytes of
/// Send/Recv".
#[cold]
pub fn describe(c: Call) -> String {
    if c[1] == P2P {
        return format!("Send/Recv of {} bytes", c[0]);
    }
    let kind = KINDS.get((c[1] & 0xff) as usize).copied();
    let name = kind.map_or("?", |k| k.name());
    let dtype = DataType::from_raw(((c[1] >> 8) & 0xff) as i32).map_or("?", |d| d.name());
    let red = match (c[1] >> 16) & 0xff {
        0 => String::new(),
        16 => " (premulsum)".into(),
        r => {
            let k = ["sum", "prod", "max", "min"][((r - 1) & 3) as usize];
            let avg = (r - 1) & 12 != 0;
            format!(" ({})", if avg && k == "sum" { "avg" } else { k })
        }
    };
    let root = if kind.is_some_and(rooted) {
        format!(", root {}", c[1] >> 32)
    } else {
        String::new()
    };
    format!("{name} of {} x {dtype}{red}{root}", c[0])
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::types::{ReduceKind, Reduction};

    #[test]
    fn calls_read_as_written() {
        let sum = Some(RedSpec::Ready(Reduction {
            dtype: DataType::Float32,
            kind: ReduceKind::Sum,
            premul: None,
            postdiv: None,
        }));
        let c = of_coll(CollKind::AllReduce, 4, DataType::Float32, sum, 3);
        assert_eq!(describe(c), "AllReduce of 4 x float (sum)");
        let c = of_coll(CollKind::Gather, 9, DataType::Float64, None, 2);
        assert_eq!(describe(c), "Gather of 9 x double, root 2");
        assert_eq!(describe(of_p2p(4096)), "Send/Recv of 4096 bytes");
        for (i, &k) in KINDS.iter().enumerate() {
            assert_eq!(k as usize, i, "KINDS follows CollKind's order");
        }
        assert_ne!(
            of_coll(CollKind::Broadcast, 8, DataType::Int8, None, 0),
            of_coll(CollKind::Broadcast, 8, DataType::Int8, None, 1)
        );
    }
}
