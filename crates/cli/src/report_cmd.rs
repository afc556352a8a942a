//! `ferrotron report RUN_DIR`: the HTML report of a training run.

use anyhow::Result;
use clap::Args;
use std::path::PathBuf;

#[derive(Args, Debug)]
pub struct ReportArgs {
    /// Output directory of a `ferrotron train` run (its --out-dir, e.g. runs/default).
    pub run_dir: PathBuf,
    /// Where to write the page [default: RUN_DIR/report.html].
    #[arg(long)]
    pub out: Option<PathBuf>,
}

pub fn run(a: ReportArgs) -> Result<()> {
    let path = ferrotron_train::report::write(&a.run_dir, a.out.as_deref())?;
    println!("{}", path.display());
    Ok(())
}
