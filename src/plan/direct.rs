//! Direct algorithms: every rank talks to each peer over its own connection (Class::Direct for
//! collectives, Class::P2p for user Send/Recv), one lane per peer and direction so that all
//! transfers progress together.

use super::ring::Links;
use super::{overlaps, Addr, Prim, Program, Stage, Step};
use crate::error::Result;
use crate::transport::Class;
use crate::types::DataType;

fn one(prim: Prim, src: Addr, dst: Addr, len: usize) -> Step {
    Step {
        prim,
        recv: None,
        send: None,
        src,
        dst,
        len,
        prep: false,
    }
}

/// A program sending `count` elements at `src` to `peer`.
pub fn send(
    l: &dyn Links,
    src: Addr,
    count: usize,
    dtype: DataType,
    peer: usize,
    class: Class,
) -> Result<Program> {
    let mut s = one(Prim::Send, src, Addr::None, count);
    s.send = Some(l.conn(peer, true, class)?);
    Ok(Program::new(vec![s], dtype, l.slot_bytes(), None))
}

/// A program receiving `count` elements from `peer` into `dst`.
pub fn recv(
    l: &dyn Links,
    dst: usize,
    count: usize,
    dtype: DataType,
    peer: usize,
    class: Class,
) -> Result<Program> {
    let mut s = one(Prim::Recv, Addr::None, Addr::user(dst), count);
    s.recv = Some(l.conn(peer, false, class)?);
    Ok(Program::new(vec![s], dtype, l.slot_bytes(), None))
}

pub fn local_copy(l: &dyn Links, src: Addr, dst: usize, count: usize, dtype: DataType) -> Program {
    Program::new(
        vec![one(Prim::LocalCopy, src, Addr::user(dst), count)],
        dtype,
        l.slot_bytes(),
        None,
    )
}

pub fn all_to_all(
    l: &dyn Links,
    send: usize,
    recv: usize,
    count: usize,
    dtype: DataType,
) -> Result<Stage> {
    let (r, n, es) = (l.rank(), l.nranks(), dtype.size());
    let mut stage = Stage::default();
    let total = n * count * es;
    // In place, receives would overwrite blocks still to be sent: send from a private copy.
    let src = if overlaps(send, total, recv, total) {
        stage.stash.keep(send, total)
    } else {
        Addr::user(send)
    };
    stage.lanes.push(vec![(local_copy(
        l,
        src + r * count * es,
        recv + r * count * es,
        count,
        dtype,
    ))
    .into()]);
    for p in (0..n).filter(|&p| p != r) {
        stage.lanes.push(vec![
            send_p(l, src + p * count * es, count, dtype, p)?.into()
        ]);
        stage.lanes.push(vec![
            recv_p(l, recv + p * count * es, count, dtype, p)?.into()
        ]);
    }
    Ok(stage)
}

fn send_p(l: &dyn Links, src: Addr, count: usize, dtype: DataType, p: usize) -> Result<Program> {
    send(l, src, count, dtype, p, Class::Direct)
}

fn recv_p(l: &dyn Links, dst: usize, count: usize, dtype: DataType, p: usize) -> Result<Program> {
    recv(l, dst, count, dtype, p, Class::Direct)
}

pub fn gather(
    l: &dyn Links,
    send: usize,
    recv: usize,
    count: usize,
    dtype: DataType,
    root: usize,
) -> Result<Stage> {
    let (r, n, es) = (l.rank(), l.nranks(), dtype.size());
    let mut stage = Stage::default();
    if r != root {
        stage.lanes.push(vec![
            (send_p(l, Addr::user(send), count, dtype, root)?).into()
        ]);
        return Ok(stage);
    }
    stage.lanes.push(vec![(local_copy(
        l,
        Addr::user(send),
        recv + r * count * es,
        count,
        dtype,
    ))
    .into()]);
    for p in (0..n).filter(|&p| p != r) {
        stage.lanes.push(vec![
            recv_p(l, recv + p * count * es, count, dtype, p)?.into()
        ]);
    }
    Ok(stage)
}

pub fn scatter(
    l: &dyn Links,
    send: usize,
    recv: usize,
    count: usize,
    dtype: DataType,
    root: usize,
) -> Result<Stage> {
    let (r, n, es) = (l.rank(), l.nranks(), dtype.size());
    let mut stage = Stage::default();
    if r != root {
        stage
            .lanes
            .push(vec![(recv_p(l, recv, count, dtype, root)?).into()]);
        return Ok(stage);
    }
    for p in (0..n).filter(|&p| p != r) {
        stage.lanes.push(vec![send_p(
            l,
            Addr::user(send) + p * count * es,
            count,
            dtype,
            p,
        )?
        .into()]);
    }
    // Last, so an in-place root does not overwrite blocks before they are sent.
    stage.lanes.push(vec![(local_copy(
        l,
        Addr::user(send) + r * count * es,
        recv,
        count,
        dtype,
    ))
    .into()]);
    Ok(stage)
}
