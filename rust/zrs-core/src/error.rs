//! The one error type of zrs-core. Every message says what went wrong and what to do about it,
//! because the Python layer shows it to the user verbatim.

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Error {
    #[error(
        "unknown parameter ds_id {0}: it was never registered; call zrs.compile(model) on the \
         model that owns it before running it"
    )]
    UnknownParam(usize),

    #[error(
        "parameter ds_id {0} is already registered; tied or shared parameters must reuse one \
         ds_id instead of registering twice"
    )]
    AlreadyRegistered(usize),

    #[error(
        "release of parameter {0} that was never gathered; the zero3 pass inserted a release \
         without a matching allgather (please report this as a zrs bug)"
    )]
    ReleaseWithoutGather(usize),

    #[error(
        "wait on parameter {0} that was never gathered: issue allgather_param before \
         wait_allgather (please report this as a zrs bug)"
    )]
    WaitWithoutGather(usize),

    #[error(
        "invalid world size {0}: it must be at least 1; initialize torch.distributed before \
         calling zrs.compile"
    )]
    InvalidWorldSize(usize),

    #[error(
        "memory budget of {budget} bytes is infeasible: the planner's least peak for this graph is \
         {minimal} bytes; raise memory_budget to at least {minimal} or shrink the model or batch"
    )]
    BudgetInfeasible { budget: u64, minimal: u64 },

    #[error("{0}")]
    Invalid(String),
}

pub type Result<T> = std::result::Result<T, Error>;
