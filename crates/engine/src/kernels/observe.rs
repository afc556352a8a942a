//! `Observed<K, O>`: a [`Kernels`] backend wrapped so that an observer sees every op call (its
//! name, start and end). The delegation is generated from the kernel interface's list
//! (`kernel_interface!` in the parent module), so no op is written out here; what is done with
//! the calls is the observer's business: per-op totals ([`super::profile::Profiled`]) or an
//! event log for traces ([`super::event_log::Tracing`]).

// The list names argument types unqualified; they resolve here, so a type added to an op
// needs no edit in this file.
use super::*;
use std::time::Instant;

/// Receives every op call of an [`Observed`] backend.
pub trait OpObserver: Send + Sync {
    /// Whether calls are observed now; when false the op runs without reading the clock.
    fn active(&self) -> bool {
        true
    }
    fn record(&self, op: &'static str, start: Instant, end: Instant);
    /// Whether the observer takes a device's own times of the ops (`Kernels::op_begin`, read
    /// back by `Tracing::device_spans`) in place of host spans of a drained device.
    fn device_timed(&self) -> bool {
        false
    }
}

/// A backend and its observer.
#[derive(Debug, Default)]
pub struct Observed<K, O> {
    pub inner: K,
    pub observer: O,
}

impl<K, O: OpObserver> Observed<K, O> {
    fn time<R>(&self, op: &'static str, f: impl FnOnce() -> R) -> R {
        if !self.observer.active() {
            return f();
        }
        let start = Instant::now();
        let r = f();
        self.observer.record(op, start, Instant::now());
        r
    }
}

/// An op is observed under its own name, the string traces and profiles report. (A composite
/// op keeps the trait's default, which calls the wrapper's own methods, so the observer sees
/// its parts: `matmul_backward` shows as its weight and input halves.)
///
/// A GPU's op returns once it is launched. While calls are observed, a backend that times its
/// ops on the device (`Kernels::op_begin`: a GPU, with an event before and after each op) is
/// told where each op begins and ends, and the device keeps running ahead of the host: the
/// trace's device track says where the device's time went (`Tracing::device_spans`). A
/// backend that does not is drained before and after each op instead, so the op's span is its
/// device time (plus one launch's latency), as `CUDA_LAUNCH_BLOCKING=1` makes PyTorch's
/// profiler do. The CPU's `synchronize` does nothing.
macro_rules! observe_op {
    ($s:ident, $name:ident, $($arg:ident),*) => {{
        let observed = $s.observer.active();
        let timed =
            observed && $s.observer.device_timed() && $s.inner.op_begin(stringify!($name));
        if observed && !timed {
            $s.inner.synchronize();
        }
        $s.time(stringify!($name), || {
            let r = $s.inner.$name($($arg),*);
            match (observed, timed) {
                (true, true) => $s.inner.op_end(),
                (true, false) => $s.inner.synchronize(),
                (false, _) => {}
            }
            r
        })
    }};
}

/// `impl Kernels for Observed`, generated from the kernel interface's list.
macro_rules! observed_kernels {
    ($($list:tt)*) => {
        wrapper_kernels!([K: Kernels<S, G>, O: OpObserver] Observed<K, O>, observe_op; $($list)*);
    };
}
kernel_interface!(observed_kernels);

#[cfg(test)]
mod tests {
    use super::*;

    /// The generated forwarding: an op is reported under its method's name, a composite op as
    /// its parts, and hooks reach the inner backend without being reported.
    #[test]
    fn ops_are_reported_by_name_and_hooks_are_not() {
        let k = Profiled::new(CpuKernels::PLAIN);
        let kd: &dyn Kernels = &k;
        kd.warm_up();
        assert_eq!(kd.limits(), Kernels::<f32>::limits(&CpuKernels::PLAIN));
        let s = MatmulShape {
            n: 2,
            in_features: 3,
            out_features: 4,
            ragged: false,
        };
        let (x, w, dy) = (vec![1.0; 6], vec![0.5; 12], vec![0.25; 8]);
        let (mut dx, mut dw) = (vec![0.0; 6], vec![0.0; 12]);
        kd.matmul_backward(
            s,
            dy.view(),
            x.view(),
            w.view(),
            Some((dx.view_mut(), Accum::Overwrite)),
            dw.view_mut(),
            None,
        );
        assert_eq!(kd.sum_squares(dw.view()), 12.0 * 0.25);
        let names: Vec<_> = k.report().iter().map(|(name, _)| *name).collect();
        assert_eq!(
            names,
            [
                "matmul_backward_weight",
                "matmul_backward_input",
                "sum_squares"
            ]
        );
    }
}
