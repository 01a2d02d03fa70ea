//! Communicators made from another one: `ncclCommSplit` (every rank takes part and says which
//! part it joins) and `ncclCommShrink` (the ranks that stay make a new communicator without the
//! excluded ones, which may be dead: nothing waits for them).

use super::{new_comm, Comm, Core};
use crate::bootstrap::{UniqueId, ID_BYTES as UNIQUE_ID_BYTES};
use crate::error::{Error, Result};
use crate::types::CommConfig;
use std::sync::Arc;

/// Tag of the bootstrap message carrying a split's new unique id.
const SPLIT_TAG: u32 = 0x5eed;
/// Tag of the bootstrap message carrying a shrink's new unique id.
const SHRINK_TAG: u32 = 0x5eee;

/// The new communicator's unique id, made by its first member (`members`: old ranks in new rank
/// order) and sent to the others over the old communicator's bootstrap (point to point: only
/// members take part).
fn share_id(core: &Core, members: &[usize], tag: u32) -> Result<UniqueId> {
    let leader = members[0];
    if leader == core.rank {
        let id = UniqueId::generate()?;
        for &r in &members[1..] {
            core.with_bootstrap(|b| b.send(r, tag, &id.to_bytes()))?;
        }
        return Ok(id);
    }
    let b = core.with_bootstrap(|b| b.recv(leader, tag))?;
    let arr: [u8; UNIQUE_ID_BYTES] = b
        .try_into()
        .map_err(|_| Error::internal("a malformed unique id message"))?;
    UniqueId::from_bytes(&arr)
}

/// Makes this rank's end of the new communicator (non-blocking ones init in the background).
fn make(
    core: &Core,
    members: &[usize],
    id: UniqueId,
    config: Option<CommConfig>,
) -> Result<Arc<Comm>> {
    let (nranks, rank, id) = seat(core, members, id)
        .ok_or_else(|| Error::internal("this rank is not a member of its new communicator"))?;
    let c = new_comm(
        nranks as i32,
        rank as i32,
        vec![id],
        config.unwrap_or_else(|| core.config.clone()),
        Some(core.cuda_dev),
    )?;
    c.start_init()?;
    core.add_child(&c);
    Ok(c)
}

/// `ncclCommSplit`: ranks with the same color form a new comm ordered by (key, old rank).
pub fn split(
    comm: &Arc<Comm>,
    color: i32,
    key: i32,
    config: Option<CommConfig>,
) -> Result<Option<Arc<Comm>>> {
    let core = comm.core()?.clone();
    match place(&core, color, key)? {
        None => Ok(None),
        Some(members) => {
            let id = share_id(&core, &members, SPLIT_TAG)?;
            make(&core, &members, id, config).map(Some)
        }
    }
}

/// `ncclCommSplit` inside a group: as NCCL's, it runs at the group's end (one thread may split
/// several of its ranks' communicators in one group: each exchange needs the others). The
/// handle is out at once (None for `NCCL_SPLIT_NOCOLOR`); the exchange and the init run at
/// the group's end (`group`: where to queue it), a non-blocking one in the background.
pub fn split_at_group_end(
    comm: &Arc<Comm>,
    color: i32,
    key: i32,
    config: Option<CommConfig>,
    group: impl FnOnce(&Arc<Comm>),
) -> Result<Option<Arc<Comm>>> {
    let core = comm.core()?.clone();
    let placed = core.clone();
    // (A rank that joins none still takes part in the exchange: its hidden communicator,
    // which never inits, so the parent does not wait on it.)
    let c = deferred(&core, config, color != -1, group, move || {
        let Some(members) = place(&placed, color, key)? else {
            return Ok(None);
        };
        let id = share_id(&placed, &members, SPLIT_TAG)?;
        Ok(seat(&placed, &members, id))
    })?;
    Ok((color != -1).then_some(c))
}

/// A communicator made at the end of the caller's group from `core`'s (`group` queues its
/// init there), whose place `placement` learns then; listed as the parent's child where
/// `listed` (one that inits).
fn deferred(
    core: &Core,
    config: Option<CommConfig>,
    listed: bool,
    group: impl FnOnce(&Arc<Comm>),
    placement: impl FnOnce() -> Result<Option<(usize, usize, UniqueId)>> + Send + 'static,
) -> Result<Arc<Comm>> {
    let config = config.unwrap_or_else(|| core.config.clone());
    let c = super::new_placed(config, Some(core.cuda_dev), Box::new(placement))?;
    if listed {
        core.add_deferred_child(&c);
    }
    group(&c);
    Ok(c)
}

/// This rank's place among `members` (old ranks, in new rank order) of the communicator `id`
/// names: (ranks, rank, id), or None where it is not one of them.
fn seat(core: &Core, members: &[usize], id: UniqueId) -> Option<(usize, usize, UniqueId)> {
    let rank = members.iter().position(|&r| r == core.rank)?;
    Some((members.len(), rank, id))
}

/// A split's exchange over the parent's bootstrap: the members of this rank's new
/// communicator (old ranks, in new rank order), or None for `NCCL_SPLIT_NOCOLOR`.
fn place(core: &Core, color: i32, key: i32) -> Result<Option<Vec<usize>>> {
    // (No wait for the parent's work, as NCCL's split: the split only talks over the
    // bootstrap, and a peer's matching calls may come after its own split.)
    let mut mine = color.to_le_bytes().to_vec();
    mine.extend_from_slice(&key.to_le_bytes());
    let all = core.with_bootstrap(|b| b.allgather(&mine))?;
    let parse = |b: &Vec<u8>, o: usize| i32::from_le_bytes([b[o], b[o + 1], b[o + 2], b[o + 3]]);
    // A color that is neither >= 0 nor NCCL_SPLIT_NOCOLOR fails every rank's split, after the
    // exchange: refused before it, the others would wait in it for this rank.
    if let Some((r, c)) = (0..all.len())
        .map(|r| (r, parse(&all[r], 0)))
        .find(|&(_, c)| c < -1)
    {
        return Err(Error::invalid_argument(format!(
            "ncclCommSplit: rank {r} gave color {c}, which is neither >= 0 nor \
             NCCL_SPLIT_NOCOLOR (-1)"
        )));
    }
    if color == -1 {
        return Ok(None);
    }
    let mut members: Vec<(i32, usize)> = all
        .iter()
        .enumerate()
        .filter(|(_, b)| parse(b, 0) == color)
        .map(|(r, b)| (parse(b, 4), r))
        .collect();
    members.sort();
    Ok(Some(members.into_iter().map(|(_, r)| r).collect()))
}

/// `ncclCommShrink`: the ranks not in `exclude` form a new communicator, in their old order.
/// Only they call it; the excluded ones may be dead. `abort` (`NCCL_SHRINK_ABORT`) first stops
/// the old communicator's work (as `ncclCommRevoke` does: use it when a peer failed), and once
/// the new one is made, clears the old one's asynchronous error (its calls still fail);
/// without it, the old communicator's work must be able to finish.
pub fn shrink(
    comm: &Arc<Comm>,
    exclude: &[i32],
    config: Option<CommConfig>,
    abort: bool,
) -> Result<Arc<Comm>> {
    let core = comm.core()?.clone();
    let members = stayers(&core, exclude)?;
    let id = shrink_id(comm, &core, &members, abort)?;
    let child = make(&core, &members, id, config)?;
    if abort {
        // Recovered from: as NCCL clears the abort it used, the old communicator's failure is
        // no longer its asynchronous error (PyTorch waits on it after a shrink, and would
        // fail the shrink); its calls still fail.
        core.health.retire();
    }
    Ok(child)
}

/// `ncclCommShrink` inside a group: as NCCL's, it runs at the group's end (one thread may
/// shrink several of its ranks' communicators in one group: each exchange needs the others),
/// as `split_at_group_end` does; the list is checked at once. The old communicator's work is
/// stopped (`abort`) or waited for at the group's end, and its asynchronous error cleared
/// there once the new communicator's id is shared (a non-blocking one inits on in the
/// background, as a shrink outside a group).
pub fn shrink_at_group_end(
    comm: &Arc<Comm>,
    exclude: &[i32],
    config: Option<CommConfig>,
    abort: bool,
    group: impl FnOnce(&Arc<Comm>),
) -> Result<Arc<Comm>> {
    let core = comm.core()?.clone();
    let members = stayers(&core, exclude)?;
    let (old, placed) = (comm.clone(), core.clone());
    deferred(&core, config, true, group, move || {
        let id = shrink_id(&old, &placed, &members, abort)?;
        if abort {
            placed.health.retire();
        }
        Ok(seat(&placed, &members, id))
    })
}

/// The ranks a shrink keeps (old ranks, in order), from its `excludeRanksList`.
fn stayers(core: &Core, exclude: &[i32]) -> Result<Vec<usize>> {
    let n = core.nranks;
    let mut out = vec![false; n];
    for &r in exclude {
        let i = usize::try_from(r).ok().filter(|&i| i < n).ok_or_else(|| {
            Error::invalid_argument(format!("excludeRanksList holds rank {r}, outside 0..{n}"))
        })?;
        if std::mem::replace(&mut out[i], true) {
            return Err(Error::invalid_argument(format!(
                "excludeRanksList holds rank {r} twice"
            )));
        }
    }
    if out[core.rank] {
        return Err(Error::invalid_usage(format!(
            "rank {} is in its own excludeRanksList: excluded ranks do not call ncclCommShrink",
            core.rank
        )));
    }
    Ok((0..n).filter(|&r| !out[r]).collect())
}

/// A shrink's exchange: the old communicator's work stopped (`abort`) or waited for, then the
/// new communicator's id shared among `members`.
fn shrink_id(comm: &Arc<Comm>, core: &Core, members: &[usize], abort: bool) -> Result<UniqueId> {
    if abort {
        comm.stop_work(
            "had its work stopped by ncclCommShrink with NCCL_SHRINK_ABORT: only \
             ncclCommShrink, ncclCommSplit, ncclCommDestroy and ncclCommAbort can use it now",
        )?;
    } else {
        core.wait_idle()?;
    }
    share_id(core, members, SHRINK_TAG)
}
