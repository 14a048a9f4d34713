//! Parameter values between graphtrain and a burn module: graphtrain's trained values (by
//! name, burn's layouts, as `import` named them) written into the module, which the user then
//! saves as a burn record (burnpack, safetensors) as usual.

use crate::import::ImportError;
use burn::module::Module;
use burn::store::ModuleSnapshot;
use burn::tensor::TensorData;
use graphtrain_ir::HostTensor;

/// `module` with every parameter named in `values` set to it. Refuses a name the module does
/// not have, a parameter of the module that `values` lacks, and a shape that differs, naming
/// the parameter; the module is then unchanged.
pub fn apply<M: Module>(module: M, values: &[(String, HostTensor)]) -> Result<M, ImportError> {
    let shapes: std::collections::HashMap<String, Vec<usize>> = module
        .collect(None, None, false)
        .into_iter()
        .map(|t| (t.name.clone(), t.shape.as_slice().to_vec()))
        .collect();
    for (name, value) in values {
        match shapes.get(name) {
            None => {
                return Err(ImportError::new(format!(
                    "parameter `{name}` is not in the burn module (its parameters: {})",
                    sorted(shapes.keys())
                )))
            }
            Some(shape) if shape.as_slice() != value.shape() => {
                return Err(ImportError::new(format!(
                    "parameter `{name}` has shape {:?} in the burn module and {:?} in the values",
                    shape,
                    value.shape()
                )))
            }
            Some(_) => {}
        }
    }
    let given: std::collections::HashSet<&str> = values.iter().map(|(n, _)| n.as_str()).collect();
    let missing: Vec<&String> = shapes
        .keys()
        .filter(|n| !given.contains(n.as_str()))
        .collect();
    if !missing.is_empty() {
        return Err(ImportError::new(format!(
            "no value for the burn module's parameters {}",
            sorted(missing.into_iter())
        )));
    }
    let tensors = values
        .iter()
        .map(|(name, value)| {
            let data: Vec<f32> = value.data.iter().map(|&x| x as f32).collect();
            burn::store::bridge::from_data(
                TensorData::new(data, value.shape().to_vec()),
                name.clone(),
                None,
            )
        })
        .collect();
    let mut module = module;
    let result = module.apply(tensors, None, None, false);
    if !result.errors.is_empty() {
        return Err(ImportError::new(format!(
            "burn refused the values: {:?}",
            result.errors
        )));
    }
    Ok(module)
}

/// Every float parameter of `module` by name, in f64 (graphtrain's host layout).
pub fn values<M: Module>(module: &M) -> Result<Vec<(String, HostTensor)>, ImportError> {
    module
        .collect(None, None, false)
        .into_iter()
        .map(|t| {
            let name = t.name.clone();
            let data = burn::store::bridge::to_data(&t)
                .map_err(|e| ImportError::new(format!("parameter `{name}`: {e:?}")))?;
            let shape = data.shape().as_slice().to_vec();
            let floats = data
                .convert::<f32>()
                .try_into_vec::<f32>()
                .map_err(|e| ImportError::new(format!("parameter `{name}`: {e:?}")))?;
            let ty = graphtrain_ir::TensorType::new(graphtrain_ir::DType::F32, shape);
            let host = HostTensor::new(ty, floats.iter().map(|&x| x as f64).collect())
                .map_err(|e| ImportError::new(format!("parameter `{name}`: {e}")))?;
            Ok((name, host))
        })
        .collect()
}

fn sorted<'a>(names: impl Iterator<Item = &'a String>) -> String {
    let mut v: Vec<&str> = names.map(String::as_str).collect();
    v.sort_unstable();
    v.join(", ")
}
