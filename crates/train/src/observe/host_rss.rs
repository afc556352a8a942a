//! The host's resident memory at a run's milestones (the weights on the device, the offload
//! tier built, the first step done), printed at the end of a run on a device: where a GPU
//! run's host memory goes, phase by phase, beside its host plan. The H200's Llama-3.2-1B
//! offload runs held 9 to 12 GB of host memory over their plan with only the peak to go by
//! (issue #33); the milestones say which phase took it.

use std::sync::Mutex;

/// Milestones kept: a run marks a few, before its first step ends.
const KEPT: usize = 8;

/// (milestone, resident bytes then, peak resident bytes so far), in order.
static MARKS: Mutex<Vec<(&'static str, u64, u64)>> = Mutex::new(Vec::new());

/// `(VmRSS, VmHWM)` of this process in bytes, where /proc exists.
pub fn rss() -> Option<(u64, u64)> {
    let s = std::fs::read_to_string("/proc/self/status").ok()?;
    let field = |name: &str| -> Option<u64> {
        let line = s.lines().find(|l| l.starts_with(name))?;
        Some(line.split_whitespace().nth(1)?.parse::<u64>().ok()? * 1024)
    };
    Some((field("VmRSS:")?, field("VmHWM:")?))
}

/// Records the host's memory now as `milestone` (the first time it is reached: ranks on
/// threads share the process, and the first to get there speaks for it).
pub fn mark(milestone: &'static str) {
    let Some((now, peak)) = rss() else {
        return;
    };
    let mut m = MARKS.lock().unwrap_or_else(|e| e.into_inner());
    if m.len() < KEPT && !m.iter().any(|x| x.0 == milestone) {
        m.push((milestone, now, peak));
    }
}

/// One line of the milestones so far: `None` where there are none.
pub fn line() -> Option<String> {
    let m = MARKS.lock().unwrap_or_else(|e| e.into_inner());
    let mib = |b: u64| b as f64 / (1u64 << 20) as f64;
    let each: Vec<String> = (m.iter())
        .map(|(at, now, peak)| format!("{at} {:.0} MiB (peak {:.0})", mib(*now), mib(*peak)))
        .collect();
    (!each.is_empty()).then(|| format!("host memory: {}", each.join(", ")))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_milestone_is_kept_once_with_the_memory_then() {
        let big = std::hint::black_box(vec![1u8; 64 << 20]);
        mark("test: a buffer touched");
        mark("test: a buffer touched");
        let l = line().expect("a milestone");
        assert_eq!(l.matches("test: a buffer touched").count(), 1, "{l}");
        let (now, peak) = rss().unwrap();
        assert!(peak >= now && now >= 64 << 20, "{now} {peak}");
        drop(big);
    }
}
