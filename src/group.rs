//! Groups: calls collected until the outermost `ncclGroupEnd`, then planned and launched.

use crate::api::{CollArgs, StreamArg};
use crate::comm::Comm;
use crate::error::{Error, Result};
use std::sync::Arc;

pub fn enqueue(_comm: &Arc<Comm>, _args: CollArgs, _stream: StreamArg) -> Result<()> {
    Err(Error::not_yet("collectives"))
}

pub fn start() -> Result<()> {
    Ok(())
}

pub fn end() -> Result<()> {
    Ok(())
}
