//! `autoresearch`: the pass-search loop. It knows no model, backend or runtime: a search space of
//! pipelines (`space`), proposers (`propose`), the paired keep rule (`stats`), the log a search
//! resumes from (`journal`), and the loop (`search`) driving an `Objective` that the caller
//! implements (graphtrain's CLI measures tokens/s on this machine; a simulator can predict a
//! cluster's step time behind the same interface).

pub mod journal;
pub mod propose;
pub mod rng;
pub mod search;
pub mod space;
pub mod stats;
pub mod synthetic;
