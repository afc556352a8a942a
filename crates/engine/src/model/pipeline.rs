//! A pipeline stage's part of the model (Huang et al. 2019; Narayanan et al. 2021): its layers,
//! the embedding on the first stage, the final norm and LM head on the last. The stage's
//! [`ParamTable`] holds only those tensors, under their own names and in the model's order,
//! so a rank allocates and updates only its part; layers keep their index (the stage runs them
//! through the entry points of [`super::stages`]), and [`Part`] maps its flat parameters onto
//! the whole model's for checkpoints and the first weights.
//!
//! With tied embeddings the last stage holds its own copy of the embedding as its LM head:
//! the trainer sums the two copies' gradients over the first and last stages after the
//! backward, so both stay equal (Megatron-LM's `embedding group`).

use super::llama::Llama;
use super::params::{ParamTable, Placement};
use super::tensor_parallel::shard_pieces;
use std::ops::Range;

/// How a rank's flat parameters map onto the whole model's: pieces of (range in the rank's,
/// range in the whole model's).
#[derive(Clone, Debug)]
pub struct Part {
    pub whole: ParamTable,
    pub pieces: Vec<(Range<usize>, Range<usize>)>,
}

/// A [`Part`] borrowed from where it is kept (a pipeline stage's, a tensor-parallel rank's).
#[derive(Clone, Copy, Debug)]
pub struct PartRef<'a> {
    pub whole: &'a ParamTable,
    pub pieces: &'a [(Range<usize>, Range<usize>)],
}

/// This rank's place in the pipeline.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stage {
    pub stage: usize,
    pub stages: usize,
}

impl Stage {
    pub fn is_first(&self) -> bool {
        self.stage == 0
    }
    pub fn is_last(&self) -> bool {
        self.stage + 1 == self.stages
    }
}

impl Llama {
    /// The part of this model (a whole one, or a tensor-parallel rank's slice) that pipeline
    /// stage `stage` holds: the parts `held` selects.
    pub fn pipeline_stage(mut self, stage: Stage, held: &dyn Fn(Placement) -> bool) -> Self {
        if stage.stages <= 1 {
            return self;
        }
        self.params = ParamTable::holding(&self.config, held);
        match &mut self.tp {
            // The tensor-parallel rank's map, now of the stage's part of its slice.
            Some(tp) => tp.pieces = shard_pieces(&tp.whole, &self.params, tp.rank),
            None => {
                let whole = ParamTable::new(&self.config);
                let pieces = shard_pieces(&whole, &self.params, 0);
                self.part = Some(Part { whole, pieces });
            }
        }
        self.stage = Some(stage);
        self
    }

    /// How this rank's parameters map onto the whole model's (`None`: it holds all of them).
    pub fn part(&self) -> Option<PartRef<'_>> {
        match (&self.part, &self.tp) {
            (Some(p), _) => Some(PartRef {
                whole: &p.whole,
                pieces: &p.pieces,
            }),
            (None, Some(tp)) => Some(PartRef {
                whole: &tp.whole,
                pieces: &tp.pieces,
            }),
            (None, None) => None,
        }
    }

    /// The whole model's parameter table.
    pub fn whole_table(&self) -> &ParamTable {
        self.part().map_or(&self.params, |p| p.whole)
    }

    /// The range of this rank's parameters that is a copy another stage owns: the last stage's
    /// tied embedding (its LM head), kept equal by summing gradients with the first stage.
    pub fn copied(&self) -> Option<Range<usize>> {
        let s = self.stage.as_ref()?;
        (self.config.tie_embeddings && s.is_last() && !s.is_first())
            .then(|| self.params.embed.clone())
    }
}
