//! What a communicator of device views leaves to the host communicator it wraps
//! ([`crate::staged::Staged`] and, with the `cuda` feature, `crate::nccl::Nccl`): the
//! overlapped collectives, which run on host regions (`*_start`), written here once.

/// The `Communicator` methods that run on the wrapped host communicator `self.$host` as they
/// are: the overlapped all-reduce, reduce-scatter and all-gather on a host region (a region
/// of device memory is refused there, by its memory).
macro_rules! overlapped_on_host {
    ($host:ident) => {
        fn all_reduce_start(&self, buf: $crate::communicator::Region<f32>) -> $crate::Pending {
            self.$host.all_reduce_start(buf)
        }

        fn reduce_scatter_start(&self, buf: $crate::communicator::Region<f32>) -> $crate::Pending {
            self.$host.reduce_scatter_start(buf)
        }

        fn all_gather_start(&self, buf: $crate::communicator::Region<f32>) -> $crate::Pending {
            self.$host.all_gather_start(buf)
        }
    };
}
pub(crate) use overlapped_on_host;
