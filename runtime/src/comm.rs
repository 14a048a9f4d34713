//! How an executor reaches the other ranks of its run. Every executor is given one when it
//! loads, so that ranks (threads, then processes) plug in without reshaping the executors.
//!
//! Today every run has one rank: `SingleRank`. No graph has collectives yet, so nothing calls a
//! collective; the interface grows its operations (all-gather, reduce-scatter, all-reduce as
//! start/wait pairs) with the first graph that needs them.

/// This rank's place in its run.
pub trait Communicator: Send {
    /// This rank's index, `0..world_size()`.
    fn rank(&self) -> usize;
    /// How many ranks the run has.
    fn world_size(&self) -> usize;
}

/// The communicator of a run with one rank.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct SingleRank;

impl Communicator for SingleRank {
    fn rank(&self) -> usize {
        0
    }

    fn world_size(&self) -> usize {
        1
    }
}
