//! A serving pod's integrity counters between scrapes: a pod whose counters grow is in a
//! violation until they have held still for the quiet window. What grew is said from the counts
//! the violation started at, so a message stays the same while nothing more grows (the
//! Degraded condition and its Event are written only when it changes).

use std::time::{Duration, Instant};

use crate::engines::integrity::{self, Counts};

/// One pod's counters as the scrapes saw them.
#[derive(Debug, Clone)]
pub struct CounterWatch {
    last: Counts,
    violation: Option<Violation>,
}

#[derive(Debug, Clone)]
struct Violation {
    /// The counts before the first growth of this violation.
    from: Counts,
    last_growth: Instant,
}

impl CounterWatch {
    /// The first reading of a pod is its baseline: counts from before this process watched
    /// (or before a revision served) are not news.
    pub fn new(first: Counts) -> Self {
        CounterWatch { last: first, violation: None }
    }

    /// Takes a new reading at `now`. A count that fell (the pod's process restarted) is a new
    /// baseline, not growth.
    pub fn read(&mut self, counts: Counts, now: Instant) {
        if !integrity::grown(&self.last, &counts).is_empty() {
            let from = self.violation.take().map_or_else(|| self.last.clone(), |v| v.from);
            self.violation = Some(Violation { from, last_growth: now });
        }
        self.last = counts;
    }

    /// Ends a violation that held still for `quiet` (checked every round, read or not: a pod
    /// that stopped answering keeps no violation forever).
    pub fn expire(&mut self, now: Instant, quiet: Duration) {
        if self.violation.as_ref().is_some_and(|v| now.duration_since(v.last_growth) >= quiet) {
            self.violation = None;
        }
    }

    /// What grew in the violation in progress, as `name was -> now`; empty when there is none.
    pub fn grown(&self) -> Vec<String> {
        self.violation.as_ref().map(|v| integrity::grown(&v.from, &self.last)).unwrap_or_default()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn counts(pairs: &[(&str, u64)]) -> Counts {
        pairs.iter().map(|(k, v)| (k.to_string(), *v)).collect()
    }

    #[test]
    fn growth_opens_a_violation_that_ends_after_the_quiet_window() {
        let (t0, quiet) = (Instant::now(), Duration::from_secs(60));
        let at = |s: u64| t0 + Duration::from_secs(s);
        let mut w = CounterWatch::new(counts(&[("checksum", 3)]));
        w.read(counts(&[("checksum", 3)]), at(1));
        assert!(w.grown().is_empty(), "the baseline is not news");
        w.read(counts(&[("checksum", 4)]), at(2));
        assert_eq!(w.grown(), ["checksum 3 -> 4"]);
        // More growth extends it and is told from where it started.
        w.read(counts(&[("checksum", 6), ("timeout", 1)]), at(30));
        assert_eq!(w.grown(), ["checksum 3 -> 6", "timeout 0 -> 1"]);
        w.read(counts(&[("checksum", 6), ("timeout", 1)]), at(89));
        w.expire(at(89), quiet);
        assert_eq!(w.grown().len(), 2, "59 s still: the window counts from the last growth");
        w.expire(at(90), quiet);
        assert!(w.grown().is_empty());
    }

    #[test]
    fn a_restarted_pods_fall_is_a_new_baseline() {
        let t0 = Instant::now();
        let mut w = CounterWatch::new(counts(&[("vllm:nixl_num_failed_transfers_total", 9)]));
        w.read(Counts::new(), t0);
        assert!(w.grown().is_empty());
        w.read(counts(&[("vllm:nixl_num_failed_transfers_total", 1)]), t0 + Duration::from_secs(1));
        assert_eq!(w.grown(), ["vllm:nixl_num_failed_transfers_total 0 -> 1"]);
    }
}
