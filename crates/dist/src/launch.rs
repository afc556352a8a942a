//! How this process was started, known without MPI: a build without the `mpi` feature can
//! still tell that `mpirun` started it, and say so instead of training alone.

/// Whether this process was started by `mpirun`/`mpiexec` (Open MPI, or a PMI/PMIx launcher
/// such as MPICH's Hydra or Slurm's `srun --mpi`), so a trainer can pick the MPI backend.
pub fn launched_by_mpirun() -> bool {
    ["OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_RANK"]
        .iter()
        .any(|v| std::env::var_os(v).is_some())
}
