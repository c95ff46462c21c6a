//! The error of any gradhub entry point, so bindings convert errors in one
//! place (`gradhub._core` maps this to Python exceptions).

use crate::client::{ClientError, OpError};
use crate::scheduler::SchedulerError;
use crate::server::ServerError;

#[derive(Debug, thiserror::Error)]
pub enum Error {
    #[error(transparent)]
    Client(#[from] ClientError),
    #[error(transparent)]
    Op(#[from] OpError),
    #[error(transparent)]
    Server(#[from] ServerError),
    #[error(transparent)]
    Scheduler(#[from] SchedulerError),
}
