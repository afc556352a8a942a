//! The progress bar of `ferrotron data`: input bytes read (as stored, so compressed files
//! count their compressed size) against the inputs' total, bytes/s, tokens/s and ETA. Drawn
//! on stderr, and only when asked for (the command asks when stderr is a terminal).

use std::time::Instant;

use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};

pub(crate) struct Progress {
    bar: ProgressBar,
    start: Instant,
}

impl Progress {
    pub(crate) fn new(total_bytes: u64, shown: bool) -> Self {
        let bar = ProgressBar::with_draw_target(Some(total_bytes), ProgressDrawTarget::hidden());
        if shown {
            let style = ProgressStyle::with_template(
                "{elapsed_precise} {wide_bar} {bytes}/{total_bytes} {binary_bytes_per_sec} {msg} ETA {eta}",
            )
            .expect("the template is valid");
            bar.set_style(style);
            bar.set_draw_target(ProgressDrawTarget::stderr());
        }
        Progress {
            bar,
            start: Instant::now(),
        }
    }

    /// Input bytes read so far and tokens made so far.
    pub(crate) fn update(&self, bytes: u64, tokens: u64) {
        if self.bar.is_hidden() {
            return;
        }
        let secs = self.start.elapsed().as_secs_f64().max(1e-9);
        self.bar.set_position(bytes);
        self.bar
            .set_message(format!("{:.0} tok/s", tokens as f64 / secs));
    }

    pub(crate) fn finish(&self) {
        self.bar.finish_and_clear();
    }
}
