//! The reference interpreter behind the `Executor` interface (`--backend reference`): it runs
//! the optimized graph itself, composites included, with `graphtrain_ir::interp` (f64 math
//! rounded to each dtype), the oracle every backend and pass is checked against. Inputs live on
//! the host; after each run the donated outputs replace their inputs, and the replaced values
//! are kept until the next run so a failed step can be undone.

use crate::{Communicator, Executor, RuntimeError};
use graphtrain_ir::{interp, Graph, HostTensor, ValueId};

pub struct ReferenceExecutor {
    graph: Graph,
    comm: Box<dyn Communicator>,
    values: Vec<Option<HostTensor>>,
    /// The donated inputs as they were before the last run.
    replaced: Vec<(ValueId, Option<HostTensor>)>,
    peak: usize,
}

impl ReferenceExecutor {
    pub fn new(graph: Graph, comm: Box<dyn Communicator>) -> Self {
        let n = graph.values.len();
        ReferenceExecutor {
            graph,
            comm,
            values: vec![None; n],
            replaced: Vec::new(),
            peak: 0,
        }
    }
}

impl Executor for ReferenceExecutor {
    fn graph(&self) -> &Graph {
        &self.graph
    }

    fn communicator(&self) -> &dyn Communicator {
        self.comm.as_ref()
    }

    fn write(&mut self, v: ValueId, t: &HostTensor) -> Result<(), RuntimeError> {
        let slot = self
            .values
            .get_mut(v.index())
            .ok_or_else(|| RuntimeError::Input(format!("value {v:?} is not in the graph")))?;
        *slot = Some(t.clone());
        Ok(())
    }

    fn run(&mut self) -> Result<(), RuntimeError> {
        let g = &self.graph;
        let inputs: Vec<HostTensor> = g
            .inputs
            .iter()
            .map(|i| {
                self.values[i.value.index()].clone().ok_or_else(|| {
                    RuntimeError::Input(format!("input `{}` was never written", i.name))
                })
            })
            .collect::<Result<_, _>>()?;
        let out = interp::run(g, &inputs).map_err(|e| RuntimeError::Backend(e.to_string()))?;
        self.peak = out.peak_bytes;
        self.replaced.clear();
        for (o, t) in g.outputs.iter().zip(out.outputs) {
            if let Some(d) = o.donates {
                let old = self.values[d.index()].replace(t.clone());
                self.replaced.push((d, old));
            }
            self.values[o.value.index()] = Some(t);
        }
        Ok(())
    }

    fn read(&mut self, v: ValueId) -> Result<HostTensor, RuntimeError> {
        self.values
            .get(v.index())
            .cloned()
            .flatten()
            .ok_or_else(|| RuntimeError::Input(format!("value {v:?} has no data yet")))
    }

    fn memory_bytes(&self) -> usize {
        self.peak
    }

    fn undo_last_run(&mut self) -> bool {
        for (v, old) in self.replaced.drain(..).rev() {
            self.values[v.index()] = old;
        }
        true
    }
}
