//! With the `mpi` feature: compiles the MPI shim (`csrc/ft_mpi.c`) with the flags `mpicc`
//! reports and links the MPI library. Without it: nothing.

fn main() {
    #[cfg(feature = "mpi")]
    mpi::build();
}

#[cfg(feature = "mpi")]
mod mpi {
    use std::process::Command;

    /// `mpicc`'s flags for `what` (Open MPI: `--showme:compile|link`; MPICH: `-compile_info`
    /// / `-link_info`, whose first word is the compiler).
    fn flags(mpicc: &str, what: &str) -> Vec<String> {
        let run = |arg: &str| {
            Command::new(mpicc)
                .arg(arg)
                .output()
                .ok()
                .filter(|o| o.status.success())
                .map(|o| String::from_utf8_lossy(&o.stdout).into_owned())
        };
        if let Some(s) = run(&format!("--showme:{what}")) {
            return s.split_whitespace().map(String::from).collect();
        }
        if let Some(s) = run(&format!("-{what}_info")) {
            return s.split_whitespace().skip(1).map(String::from).collect();
        }
        panic!(
            "the `mpi` feature needs an MPI installation: `{mpicc} --showme:{what}` failed \
             (Debian: apt-get install openmpi-bin libopenmpi-dev; or set MPICC)"
        );
    }

    pub fn build() {
        println!("cargo:rerun-if-changed=csrc/ft_mpi.c");
        println!("cargo:rerun-if-env-changed=MPICC");
        let mpicc = std::env::var("MPICC").unwrap_or_else(|_| "mpicc".into());
        let mut b = cc::Build::new();
        b.file("csrc/ft_mpi.c").warnings(true);
        for f in flags(&mpicc, "compile") {
            if let Some(dir) = f.strip_prefix("-I") {
                b.include(dir);
            } else {
                b.flag(&f);
            }
        }
        b.compile("ft_mpi");
        for f in flags(&mpicc, "link") {
            if let Some(dir) = f.strip_prefix("-L") {
                println!("cargo:rustc-link-search=native={dir}");
                println!("cargo:rustc-link-arg=-Wl,-rpath,{dir}");
            } else if let Some(lib) = f.strip_prefix("-l") {
                println!("cargo:rustc-link-lib={lib}");
            } else {
                println!("cargo:rustc-link-arg={f}");
            }
        }
    }
}
