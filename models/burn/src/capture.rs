//! Recording a burn module's loss as a `burn_ir::GraphIr`, with its parameters named.
//!
//! burn's capture device records every op and the data of every tensor that enters it
//! (`CapturedGraph::values`): the module's parameters, the declared inputs' sample data, and
//! constants made inside the scope (RoPE's tables). Parameters are not graph inputs in
//! burn's graph; their tensor ids are found by visiting the module after it moved onto the
//! capture device, which is also where their module paths come from.

use crate::import::ImportError;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::{Device, Int, Tensor, TensorData, TensorId};
use std::collections::BTreeMap;

/// A module's loss as burn recorded it.
#[derive(Debug)]
pub struct Captured {
    pub graph: burn_ir::GraphIr,
    /// Data of every tensor that entered the scope, by tensor id.
    pub values: BTreeMap<TensorId, TensorData>,
    /// Parameter tensor ids and their module paths (`layers.0.attention.wq.weight`), in the
    /// module's visiting order.
    pub params: Vec<(TensorId, String)>,
    /// The runtime inputs, in the order given, with their names.
    pub inputs: Vec<(TensorId, String)>,
}

/// The module paths and capture ids of `module`'s float parameters, in visiting order.
struct ParamIds {
    stack: Vec<String>,
    found: Vec<(TensorId, String)>,
}

impl ModuleVisitor for ParamIds {
    fn enter_module(&mut self, name: &str, _container: &str) {
        self.stack.push(name.to_string());
    }
    fn exit_module(&mut self, _name: &str, _container: &str) {
        self.stack.pop();
    }
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
        if let Ok(t) = param.val().try_into_primitive::<burn::backend::Capture>() {
            self.found.push((t.id(), self.stack.join(".")));
        }
    }
}

/// Runs `loss` on `module` on burn's capture device, with integer inputs `inputs` (name and
/// data, such as `tokens` and `targets`), and returns what burn recorded. `loss` must return
/// the scalar loss (shape `[1]`, as burn's reductions give).
pub fn capture_loss<M: Module>(
    module: &M,
    inputs: &[(&str, TensorData)],
    loss: impl FnOnce(&M, Vec<Tensor<2, Int>>) -> Tensor<1>,
) -> Result<Captured, ImportError> {
    let device = Device::capture();
    let mut params = ParamIds {
        stack: Vec::new(),
        found: Vec::new(),
    };
    let mut named_inputs = Vec::new();
    let mut loss_id = None;
    let captured = device
        .capture_scope(|scope| {
            // Capture refuses autodiff tensors; `valid` is the module without autodiff.
            let moved = module.valid().to_device(&device);
            moved.visit(&mut params);
            // Runtime inputs must enter from outside the scope (else they are constants).
            let tensors: Vec<Tensor<2, Int>> = inputs
                .iter()
                .map(|(_, data)| {
                    Tensor::<2, Int>::from_data(data.clone(), &Device::flex()).to_device(&device)
                })
                .collect();
            let ids: Vec<TensorId> = tensors.iter().filter_map(int_id).collect();
            named_inputs = ids
                .iter()
                .zip(inputs)
                .map(|(id, (name, _))| (*id, name.to_string()))
                .collect();
            let out = loss(&moved, tensors);
            // A loss not on the capture device completes the scope without an output, refused
            // below.
            loss_id = out
                .try_into_primitive::<burn::backend::Capture>()
                .ok()
                .map(|t| t.id());
            scope.complete(ids, loss_id)
        })
        .map_err(|e| ImportError::new(format!("burn's capture failed: {e:?}")))?;
    if loss_id.is_none() {
        return Err(ImportError::new(
            "the loss is not a tensor of the capture device: compute it from the module and \
the tensors capture_loss passes",
        ));
    }
    if named_inputs.len() != inputs.len() {
        return Err(ImportError::new(
            "an input did not reach burn's capture device",
        ));
    }
    let computes = |op: &burn_ir::OperationIr| !matches!(op, burn_ir::OperationIr::Init(_));
    if !captured.graph.operations.iter().any(computes) {
        return Err(ImportError::new(
            "the module's loss captured no operation: the function given to capture_loss \
must compute the loss from the module it is passed, on the tensors it is passed",
        ));
    }
    if params.found.is_empty() {
        return Err(ImportError::new(
            "the module has no float parameter to train (burn's module visitor found none)",
        ));
    }
    Ok(Captured {
        graph: captured.graph,
        values: captured.values,
        params: params.found,
        inputs: named_inputs,
    })
}

fn int_id(t: &Tensor<2, Int>) -> Option<TensorId> {
    t.clone()
        .try_into_primitive::<burn::backend::Capture>()
        .ok()
        .map(|t| t.id())
}
