//! The validation loss: each data-parallel rank evaluates its share of the windows,
//! micro-batch by micro-batch (through the pipeline when the model is split into stages), and
//! the losses add up over the groups.

use super::*;

impl Trainer {
    /// Mean validation loss over the fixed validation batches (under ZeRO-3 every rank must
    /// call it: the units are gathered).
    pub fn evaluate(&mut self) -> Result<Option<f64>> {
        if self.val.is_none() {
            return Ok(None);
        }
        let te = Instant::now();
        // The weights and the group leave `self` for the evaluation (moving moves no memory).
        let mut params = std::mem::replace(&mut self.params, Flat::F32(Region::default()));
        let dp = self.mesh.dp.take().map(RefCell::new);
        // Not the step's communication.
        let saved = self.mesh.save_bytes();
        let on_device = self.dev.as_mut().and_then(|d| d.params.take());
        let loss = match (&mut params, on_device) {
            (_, Some(mut p)) => {
                let l = match &mut p {
                    DevFlat::F32(p) => self.eval_forward(p.view_mut(), dp.as_ref()),
                    DevFlat::Bf16(p) => self.eval_forward(p.view_mut(), dp.as_ref()),
                    DevFlat::F16(p) => self.eval_forward(p.view_mut(), dp.as_ref()),
                };
                self.dev.as_mut().expect("on the device").params = Some(p);
                l
            }
            (Flat::F32(p), None) => self.eval_forward(p.view_mut(), dp.as_ref()),
            (Flat::Bf16(p), None) => self.eval_forward(p.view_mut(), dp.as_ref()),
            (Flat::F16(p), None) => self.eval_forward(p.view_mut(), dp.as_ref()),
        };
        // The ranks that share each sequence's tokens evaluated their shares (pipelined or not).
        let loss = loss.and_then(|l| {
            let (sum, count) = self.mesh.sum_over_sequence(l.sum, l.count)?;
            Ok(LossSum { sum, count })
        });
        // Each data-parallel rank evaluated its share of the validation sequences (the set is
        // one rank's at the same global micro-batch, so val losses compare across layouts).
        let loss = match (&dp, loss) {
            (Some(dp), Ok(l)) => dp
                .borrow_mut()
                .sum_loss(l.sum, l.count)
                .map(|(sum, count)| LossSum { sum, count }),
            (_, l) => l,
        };
        self.mesh.dp = dp.map(RefCell::into_inner);
        self.mesh.restore_bytes(saved);
        self.params = params;
        if let Some(a) = &mut self.pool.arena {
            a.trim();
        }
        self.kernels.phase("eval", te, self.step, 0);
        Ok(Some(loss?.mean()))
    }

    /// The validation batches one after the other (the schedule without a pipeline).
    pub(super) fn eval_batches<S: Elem>(
        &mut self,
        params: ViewMut<'_, S>,
        dp: Option<&RefCell<DataParallel>>,
    ) -> Result<LossSum> {
        let Some(val) = &self.val else {
            return Ok(LossSum::default());
        };
        let batch = self.batch();
        // Outside the step: its gathers are not the step's communication.
        let saved = dp.map(|d| d.borrow().counters());
        // Streamed (`--offload params`), the parameters are uploaded into the windows.
        let mut streaming = self.streaming.take();
        let mut src = match streaming.as_mut() {
            Some(s) => s.source(params, self.gather.as_mut(), dp),
            None => Source::new(params, self.gather.as_mut(), dp, self.opt_len),
        };
        let mut batches = || -> Result<LossSum> {
            let mut loss = LossSum::default();
            for i in 0..val.num_batches() {
                val.batch_into(i, &mut self.tokens, &mut self.targets)?;
                let (k, pool) = (&self.kernels, &mut self.pool);
                let (tokens, targets) =
                    batch_views(&self.kernels, &mut self.dev, &self.tokens, &self.targets);
                src.begin(true);
                let l = self
                    .model
                    .forward_eval_from(k, pool, src.get(), batch, &tokens, &targets);
                src.check()?;
                self.mesh.check()?;
                loss.sum += l.sum;
                loss.count += l.count;
            }
            Ok(loss)
        };
        let loss = batches();
        drop(src);
        self.streaming = streaming;
        // With what the device kept of it (`take_loss`).
        let loss = super::update::device_loss(&self.kernels, loss?);
        if let (Some(dp), Some(c)) = (dp, saved) {
            dp.borrow_mut().set_counters(c);
        }
        Ok(loss)
    }
}
