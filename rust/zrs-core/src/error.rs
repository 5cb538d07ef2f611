//! The one error type of zrs-core. Every message says what went wrong and what to do about it,
//! because the Python layer shows it to the user verbatim.
//!
//! Two ids name a parameter and must not be confused: a registry's *slot* (its place in one
//! model's [`Registry`](crate::registry::Registry)) and the planner IR's *ds_id* (the process-wide
//! id the compiled graph's ops carry).

use thiserror::Error;

#[derive(Debug, Clone, PartialEq, Eq, Error)]
pub enum Error {
    #[error(
        "unknown parameter slot {0}: it was never registered; call zrs.compile(model) on the \
         model that owns it before running it"
    )]
    UnknownSlot(usize),

    #[error(
        "release of parameter slot {0} that was never gathered; the zero3 pass inserted a release \
         without a matching allgather (please report this as a zrs bug)"
    )]
    ReleaseWithoutGather(usize),

    #[error(
        "wait on parameter slot {0} that was never gathered: issue allgather_param before \
         wait_allgather (please report this as a zrs bug)"
    )]
    WaitWithoutGather(usize),

    #[error(
        "planner graph: a {kind} of parameter ds_id {ds_id} has no all-gather of that parameter \
         among its dependencies; every wait and release must depend on its all-gather"
    )]
    UngatheredParam { kind: &'static str, ds_id: u64 },

    #[error(
        "invalid world size {0}: it must be at least 1; initialize torch.distributed before \
         calling zrs.compile"
    )]
    InvalidWorldSize(usize),

    /// No plan fits `budget`; `minimal` is the least peak the planner can reach (feasible as a
    /// budget). Both count from the same zero: `base` bytes live at the graph's start are
    /// included when `base` is 0 and excluded otherwise (the compiled-graph budget, which counts
    /// only what the graph allocates on top of its inputs).
    #[error(
        "memory budget of {budget} bytes is infeasible: the planner's least peak for this graph is \
         {minimal} bytes{}; raise memory_budget to at least {minimal} or shrink the model or batch",
        base_note(*base)
    )]
    BudgetInfeasible {
        budget: u64,
        minimal: u64,
        base: u64,
    },

    #[error(
        "unknown unit {0}: the eager coordinator was built with fewer units; build it again \
         after changing the model's modules"
    )]
    UnknownUnit(usize),

    #[error(
        "unit {0} ran its forward outside the model's forward: the eager path gathers parameters \
         per step, so call the model (its root module) rather than one of its submodules"
    )]
    ForwardOutsideStep(usize),

    #[error(
        "parameter slot {0} was read outside any forward: the eager path gathers a parameter \
         only while a module's forward or backward runs; read it inside the model's forward"
    )]
    ReadOutsideForward(usize),

    #[error(
        "unit {0} ended a forward it never began (no pre_forward of it is open); the module hooks \
         are out of step (please report this as a zrs bug)"
    )]
    UnitNotActive(usize),

    #[error(
        "backward of unit {0} without a training forward before it: run the forward with \
         gradients enabled before calling backward"
    )]
    BackwardOutsideStep(usize),

    #[error(
        "gradient of parameter slot {0} outside a backward: run the forward with gradients \
         enabled before calling backward"
    )]
    GradOutsideBackward(usize),

    #[error(
        "gradient of parameter slot {0}, which was frozen (requires_grad=False) when the eager \
         coordinator was built; build it again after changing requires_grad"
    )]
    GradOfFrozen(usize),

    #[error("{0}")]
    Invalid(String),
}

fn base_note(base: u64) -> String {
    if base == 0 {
        String::new()
    } else {
        format!(
            " on top of the {base} bytes of inputs live at the graph's start (which memory_budget \
             does not count)"
        )
    }
}

pub type Result<T> = std::result::Result<T, Error>;
