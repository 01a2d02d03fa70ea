//! Launching validated calls: each call is checked against its communicator (roots, buffers,
//! counts, the reduction operator resolved), then handed to the communicator's executor, alone
//! or with the rest of its group.

use crate::comm::{Comm, Core};
use crate::error::{Error, Result};
use crate::exec::{self, Call, Stream};
use crate::plan::RedSpec;
use crate::types::{
    CollArgs, CollKind, DataType, ReduceKind, Reduction, NUM_BUILTIN_OPS, OP_AVG, OP_MAX, OP_MIN,
    OP_PROD, OP_SUM,
};
use std::sync::Arc;

/// A validated call kept for its group's end.
pub struct Queued {
    core: Arc<Core>,
    args: CollArgs,
    red: Option<RedSpec>,
    stream: Stream,
}

/// Checks a call; the checked call to keep for the group's end.
pub fn check(comm: &Arc<Comm>, args: CollArgs, stream: Stream) -> Result<Queued> {
    let (core, red) = validate(comm, &args)?;
    Ok(Queued {
        core: core.clone(),
        args,
        red,
        stream,
    })
}

impl Queued {
    /// Whether this call may join a group whose calls so far are `earlier`: its stream and
    /// the stream of its communicator's first call there must go together
    /// (`exec::streams_alike`; only the CUDA executor's streams have a rule, so a host
    /// communicator's group is not searched).
    pub fn fits_group(&self, earlier: &[Queued]) -> Result<()> {
        if matches!(self.core.exec, exec::CommExec::Host(_)) {
            return Ok(());
        }
        match earlier.iter().find(|o| Arc::ptr_eq(&o.core, &self.core)) {
            Some(first) => exec::streams_alike(&self.core.exec, &first.stream, &self.stream),
            None => Ok(()),
        }
    }
}

/// Checks a call and runs it at once (a group of one).
#[inline(always)]
pub fn run_one(comm: &Arc<Comm>, args: CollArgs, stream: Stream) -> Result<()> {
    let (core, red) = validate(comm, &args)?;
    exec::launch_one(Call {
        comm: &core.exec,
        conns: &core.conns,
        args,
        red,
        stream,
    })
}

/// Launches a group's checked calls, all communicators together.
pub fn run_group(ops: Vec<Queued>) -> Result<()> {
    let calls = ops
        .iter()
        .map(|q| Call {
            comm: &q.core.exec,
            conns: &q.core.conns,
            args: q.args,
            red: q.red,
            stream: q.stream.clone(),
        })
        .collect();
    exec::launch(calls)
}

fn bytes_of(count: usize, mult: usize, dtype: DataType, what: &str) -> Result<usize> {
    count
        .checked_mul(mult)
        .and_then(|c| c.checked_mul(dtype.size()))
        .filter(|&b| b <= isize::MAX as usize)
        .ok_or_else(|| {
            Error::invalid_argument(format!("{what}: count {count} overflows the address space"))
        })
}

#[inline(always)]
fn validate<'c>(comm: &'c Arc<Comm>, a: &CollArgs) -> Result<(&'c Arc<Core>, Option<RedSpec>)> {
    let core = comm.core()?;
    if let Some(e) = core.health.error() {
        return Err(e);
    }
    let n = core.nranks;
    let name = a.kind.name();
    let rooted = matches!(
        a.kind,
        CollKind::Broadcast
            | CollKind::Reduce
            | CollKind::Gather
            | CollKind::Scatter
            | CollKind::Send
            | CollKind::Recv
    );
    if rooted && (a.root < 0 || a.root as usize >= n) {
        let what = if a.kind.is_p2p() { "peer" } else { "root" };
        return Err(Error::invalid_argument(format!(
            "{name}: invalid {what} {} (nranks is {n})",
            a.root
        )));
    }
    let (send_mult, recv_mult) = match a.kind {
        CollKind::AllReduce | CollKind::Broadcast | CollKind::Reduce => (1, 1),
        CollKind::AllGather => (1, n),
        CollKind::ReduceScatter => (n, 1),
        CollKind::AlltoAll => (n, n),
        CollKind::Gather => (1, n),
        CollKind::Scatter => (n, 1),
        CollKind::Send => (1, 0),
        CollKind::Recv => (0, 1),
    };
    let (uses_send, uses_recv) = a.buffers_used(core.rank);
    let sb = bytes_of(a.count, send_mult, a.dtype, name)?;
    let rb = bytes_of(a.count, recv_mult, a.dtype, name)?;
    if uses_send && sb > 0 && a.send == 0 {
        return Err(Error::invalid_argument(format!("{name}: sendbuff is NULL")));
    }
    if uses_recv && rb > 0 && a.recv == 0 {
        return Err(Error::invalid_argument(format!("{name}: recvbuff is NULL")));
    }
    let reduces = matches!(
        a.kind,
        CollKind::AllReduce | CollKind::Reduce | CollKind::ReduceScatter
    );
    let red = if reduces {
        Some(resolve_op(comm, a.op, a.dtype, n, name)?)
    } else {
        None
    };
    Ok((core, red))
}

#[inline]
fn resolve_op(comm: &Comm, op: i32, dtype: DataType, n: usize, name: &str) -> Result<RedSpec> {
    let ready = |kind| {
        Ok(RedSpec::Ready(Reduction {
            dtype,
            kind,
            premul: None,
            postdiv: None,
        }))
    };
    match op {
        OP_SUM => ready(ReduceKind::Sum),
        OP_PROD => ready(ReduceKind::Prod),
        OP_MAX => ready(ReduceKind::Max),
        OP_MIN => ready(ReduceKind::Min),
        OP_AVG if dtype.is_float() => Ok(RedSpec::Ready(Reduction {
            dtype,
            kind: ReduceKind::Sum,
            premul: Some(crate::reduce::scalar_from_f64(dtype, 1.0 / n as f64)),
            postdiv: None,
        })),
        OP_AVG => Ok(RedSpec::Ready(Reduction {
            dtype,
            kind: ReduceKind::Sum,
            premul: None,
            postdiv: Some(n as u64),
        })),
        _ if op >= NUM_BUILTIN_OPS => match comm.redops.get(op) {
            Ok((d, scalar)) if d == dtype => Ok(RedSpec::PreMul { dtype, scalar }),
            Ok((d, _)) => Err(Error::invalid_argument(format!(
                "{name}: operator {op} was created for datatype {} but used with {}",
                d.name(),
                dtype.name()
            ))),
            Err(why) => Err(Error::invalid_argument(format!(
                "{name}: invalid reduction operator {op}: it {why}"
            ))),
        },
        _ => Err(Error::invalid_argument(format!(
            "{name}: invalid reduction operator {op}"
        ))),
    }
}
