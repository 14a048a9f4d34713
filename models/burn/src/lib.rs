//! graphtrain's burn frontend: a model written with burn (`burn-nn` modules, burn tensor ops)
//! trained by graphtrain's compiled step.
//!
//! burn records a module's forward and loss without running it (`Device::capture`, a
//! `burn_ir::GraphIr`); capture refuses autodiff, so the backward is graphtrain's:
//!
//! 1. `capture::capture_loss` runs the user's loss function on the capture device and returns
//!    the graph, every parameter's data under its module path (burn's own names), and the
//!    runtime inputs it was given.
//! 2. `import::import` translates the graph op by op into graphtrain's IR (`Traced`, whose
//!    parameters are graph inputs named as in burn and whose nodes carry module paths and
//!    layer indices), recognising the patterns graphtrain has composites for
//!    (`patterns.rs`: RMSNorm, RoPE, SiLU, cross-entropy; burn's attention is one op already)
//!    so the lowering's kernels apply. An op it does not know is an error naming it, its
//!    position and the parameter or module it came from.
//! 3. graphtrain then adds backward and optimizer (`build_train_step`), runs its passes,
//!    lowers and trains; `weights::apply` puts trained values back into the burn module,
//!    which the user saves as a record as usual.
//!
//! `llama.rs` is a Llama-style decoder written with burn-nn, the example model and the one the
//! tests import.

pub mod capture;
pub mod import;
pub mod llama;
mod patterns;
pub mod plan;
pub mod weights;

pub use capture::{capture_loss, Captured};
pub use import::{import, ImportError, Imported};
