//! Validated value types shared by every layer: datatypes, reduction operators, collective kinds.

use crate::error::{Error, Result};

/// NCCL's 12 datatypes, with the numeric values of `ncclDataType_t`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
#[repr(i32)]
pub enum DataType {
    Int8 = 0,
    Uint8 = 1,
    Int32 = 2,
    Uint32 = 3,
    Int64 = 4,
    Uint64 = 5,
    Float16 = 6,
    Float32 = 7,
    Float64 = 8,
    Bfloat16 = 9,
    Float8e4m3 = 10,
    Float8e5m2 = 11,
}

impl DataType {
    pub const ALL: [DataType; 12] = [
        DataType::Int8,
        DataType::Uint8,
        DataType::Int32,
        DataType::Uint32,
        DataType::Int64,
        DataType::Uint64,
        DataType::Float16,
        DataType::Float32,
        DataType::Float64,
        DataType::Bfloat16,
        DataType::Float8e4m3,
        DataType::Float8e5m2,
    ];

    pub fn from_raw(v: i32) -> Result<DataType> {
        if (0..12).contains(&v) {
            Ok(Self::ALL[v as usize])
        } else {
            Err(Error::invalid_argument(format!(
                "invalid datatype {v} (valid datatypes are 0..{})",
                12 - 1
            )))
        }
    }

    pub fn size(self) -> usize {
        match self {
            DataType::Int8 | DataType::Uint8 | DataType::Float8e4m3 | DataType::Float8e5m2 => 1,
            DataType::Float16 | DataType::Bfloat16 => 2,
            DataType::Int32 | DataType::Uint32 | DataType::Float32 => 4,
            DataType::Int64 | DataType::Uint64 | DataType::Float64 => 8,
        }
    }

    pub fn is_float(self) -> bool {
        matches!(
            self,
            DataType::Float16
                | DataType::Float32
                | DataType::Float64
                | DataType::Bfloat16
                | DataType::Float8e4m3
                | DataType::Float8e5m2
        )
    }

    pub fn name(self) -> &'static str {
        match self {
            DataType::Int8 => "int8",
            DataType::Uint8 => "uint8",
            DataType::Int32 => "int32",
            DataType::Uint32 => "uint32",
            DataType::Int64 => "int64",
            DataType::Uint64 => "uint64",
            DataType::Float16 => "half",
            DataType::Float32 => "float",
            DataType::Float64 => "double",
            DataType::Bfloat16 => "bfloat16",
            DataType::Float8e4m3 => "f8e4m3",
            DataType::Float8e5m2 => "f8e5m2",
        }
    }
}

/// The arithmetic of a reduction, after `ncclAvg` and `PreMulSum` have been resolved.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ReduceKind {
    Sum,
    Prod,
    Max,
    Min,
}

/// A scalar for PreMulSum / float averages, stored as the bits of the op's datatype
/// (little-endian, `dtype.size()` bytes used).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Scalar {
    pub bits: u64,
}

/// A fully resolved reduction: what each rank's contribution is multiplied by before it enters the
/// reduction (`premul`), the reduction itself, and an integer divisor applied to the final result
/// (`postdiv`, integer `ncclAvg`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Reduction {
    pub dtype: DataType,
    pub kind: ReduceKind,
    pub premul: Option<Scalar>,
    pub postdiv: Option<u64>,
}

/// Builtin `ncclRedOp_t` values.
pub const OP_SUM: i32 = 0;
pub const OP_PROD: i32 = 1;
pub const OP_MAX: i32 = 2;
pub const OP_MIN: i32 = 3;
pub const OP_AVG: i32 = 4;
pub const NUM_BUILTIN_OPS: i32 = 5;

/// What a queued operation does.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum CollKind {
    AllReduce,
    Broadcast,
    Reduce,
    AllGather,
    ReduceScatter,
    AlltoAll,
    Gather,
    Scatter,
    Send,
    Recv,
}

impl CollKind {
    pub fn name(self) -> &'static str {
        match self {
            CollKind::AllReduce => "AllReduce",
            CollKind::Broadcast => "Broadcast",
            CollKind::Reduce => "Reduce",
            CollKind::AllGather => "AllGather",
            CollKind::ReduceScatter => "ReduceScatter",
            CollKind::AlltoAll => "AlltoAll",
            CollKind::Gather => "Gather",
            CollKind::Scatter => "Scatter",
            CollKind::Send => "Send",
            CollKind::Recv => "Recv",
        }
    }
    pub fn is_p2p(self) -> bool {
        matches!(self, CollKind::Send | CollKind::Recv)
    }
}

/// The parsed, size-checked contents of an `ncclConfig_t`.
#[derive(Clone, Debug, Default)]
pub struct CommConfig {
    /// `blocking`: None when the caller left it undefined (then blocking).
    pub blocking: Option<bool>,
    pub comm_name: Option<String>,
    pub net_name: Option<String>,
    pub split_share: Option<bool>,
    pub min_ctas: Option<i32>,
    pub max_ctas: Option<i32>,
    pub cta_policy: Option<i32>,
    /// `graphUsageMode`: 0 (no CUDA graphs), 1 (graphs, not mixed with eager calls), 2 (mixed).
    pub graph_usage_mode: Option<i32>,
}

impl CommConfig {
    /// The graph usage mode in effect: `NCCL_GRAPH_MIXING_SUPPORT` when set to 0 or 1 (1 is
    /// mode 2, 0 is mode 0, as NCCL maps it), else `graphUsageMode`, else 2 (NCCL's default).
    pub fn graph_usage(&self) -> i32 {
        const NAME: &str = "NCCL_GRAPH_MIXING_SUPPORT";
        let config = self.graph_usage_mode.unwrap_or(2);
        if !crate::param::is_set(NAME) {
            return config;
        }
        match crate::param::get_str(NAME).as_deref().map(str::trim) {
            Some("1") => 2,
            Some("0") => 0,
            v => {
                crate::debug::info(&format!(
                    "{NAME} {} is not valid (0 or 1), leaving graphUsageMode at {config}",
                    v.unwrap_or("")
                ));
                config
            }
        }
    }
}

/// One collective or point-to-point call, as the C caller gave it (buffers are addresses).
#[derive(Clone, Copy, Debug)]
pub struct CollArgs {
    pub kind: CollKind,
    pub send: usize,
    pub recv: usize,
    pub count: usize,
    pub dtype: DataType,
    /// Raw `ncclRedOp_t` (builtin or created by `ncclRedOpCreatePreMulSum`); ignored where unused.
    pub op: i32,
    /// Root for rooted collectives, peer for Send/Recv, 0 otherwise.
    pub root: i32,
}

impl CollArgs {
    /// Whether rank `me`'s call reads its send buffer and writes its receive buffer, as NCCL
    /// says: a broadcast's and a scatter's send buffer only at the root, a reduce's and a
    /// gather's receive buffer only at the root; a send has no receive buffer, a receive no
    /// send buffer. (Unused buffers may be anything, NULL included.)
    pub fn buffers_used(&self, me: usize) -> (bool, bool) {
        let root = usize::try_from(self.root).ok() == Some(me);
        let send = match self.kind {
            CollKind::Recv => false,
            CollKind::Broadcast | CollKind::Scatter => root,
            _ => true,
        };
        let recv = match self.kind {
            CollKind::Send => false,
            CollKind::Reduce | CollKind::Gather => root,
            _ => true,
        };
        (send, recv)
    }
}

/// A PreMulSum scalar: read now (host immediate) or at execution time from an address.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ScalarArg {
    Host(Scalar),
    Device(usize),
}
