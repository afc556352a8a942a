//! What a run reports: per-step metrics, the Chrome trace, the HTML/SVG report and the
//! TensorBoard event files.

pub mod host_rss;
pub mod metrics;
pub mod report;
pub mod tensorboard;
pub mod trace;
