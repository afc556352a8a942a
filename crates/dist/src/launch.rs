//! How this process was started, known without MPI: a build without the `mpi` feature can
//! still tell that `mpirun` started it, and say so instead of training alone.

/// Whether this process was started by `mpirun`/`mpiexec` (Open MPI, or a PMI/PMIx launcher
/// such as MPICH's Hydra or Slurm's `srun --mpi`), so a trainer can pick the MPI backend.
pub fn launched_by_mpirun() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}

/// This process's rank in its launcher's world, read from the environment (Open MPI's, PMI's
/// or PMIx's variable), before MPI is initialised: `None` when no launcher started it.
pub fn world_rank_from_env() -> Option<usize> {
    ["OMPI_COMM_WORLD_RANK", "PMI_RANK", "PMIX_RANK"]
        .iter()
        .find_map(|v| std::env::var(v).ok()?.parse().ok())
}
