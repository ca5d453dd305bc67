//! What a KV pod's own `/metrics` says about the KV it moved: the counters whose increase means
//! a handoff went wrong. kvgate's workers count the handoffs they refused, by reason. A
//! disaggregated vLLM counts NIXL transfers that failed and KV blocks read after their lease
//! expired (the incident's failure inside vLLM: decode read blocks prefill had already freed),
//! and kvgate's verifying connector counts blocks that did not verify under kvgate's own name.
//! The canary and the bake judge every KV pod of a revision on its engine's counters.

use std::collections::BTreeMap;

use crate::scrape;

/// A counter family on a pod's `/metrics`, read whole or by one of its labels.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Counter {
    pub family: &'static str,
    /// The label its samples are told apart by (`reason`), or none: one count.
    pub split_by: Option<&'static str>,
}

/// Handoffs refused by kvgate's workers, and KV blocks that did not verify in kvgate's connector
/// inside an engine: by reason.
pub const HANDOFF_MISMATCHES: Counter = Counter { family: scrape::MISMATCHES, split_by: Some("reason") };
/// vLLM (0.32): NIXL transfers that failed (decode counts them).
pub const NIXL_FAILED_TRANSFERS: Counter = Counter { family: "vllm:nixl_num_failed_transfers_total", split_by: None };
/// vLLM (0.32): a decode's read notified after prefill's KV lease expired and its blocks were
/// freed (prefill counts them).
pub const NIXL_READ_AFTER_EXPIRY: Counter = Counter { family: "vllm:nixl_num_notifications_after_expiry_total", split_by: None };

/// One pod's counts: a split counter's samples under their label's value (`checksum`), a whole
/// one's under its family's name.
pub type Counts = BTreeMap<String, u64>;

/// The counts of `counters` in a `/metrics` body. A family the body lacks counts 0: a pod that
/// has not moved KV yet may not export it.
pub fn read(text: &str, counters: &[Counter]) -> Counts {
    let mut out = Counts::new();
    for c in counters {
        let samples = scrape::family_by(text, c.family, c.split_by.unwrap_or(""));
        match c.split_by {
            Some(_) => {
                for (value, n) in samples {
                    *out.entry(value).or_insert(0) += n as u64;
                }
            }
            None => {
                let n: f64 = samples.values().sum();
                if n > 0.0 {
                    *out.entry(c.family.to_string()).or_insert(0) += n as u64;
                }
            }
        }
    }
    out
}

/// The counts of every pod added up.
pub fn total(counts: &Counts) -> u64 {
    counts.values().sum()
}

/// What grew from `before` to `after`, as `name was -> now` (a count that fell, a restarted
/// pod's, is not growth).
pub fn grown(before: &Counts, after: &Counts) -> Vec<String> {
    after
        .iter()
        .filter_map(|(name, &now)| {
            let was = before.get(name).copied().unwrap_or(0);
            (now > was).then(|| format!("{name} {was} -> {now}"))
        })
        .collect()
}

/// The non-zero counts, as `name n, ...`.
pub fn describe(counts: &Counts) -> String {
    counts.iter().filter(|(_, n)| **n > 0).map(|(name, n)| format!("{name} {n}")).collect::<Vec<_>>().join(", ")
}

#[cfg(test)]
mod tests {
    use super::*;

    const VLLM: &[Counter] = &[HANDOFF_MISMATCHES, NIXL_FAILED_TRANSFERS, NIXL_READ_AFTER_EXPIRY];

    #[test]
    fn a_disaggregated_vllm_pods_counters_are_read_by_name_and_reason() {
        // The shape vLLM 0.32's prometheus_client writes (HELP, TYPE, `_total` and `_created`
        // samples, one per engine), with kvgate's connector beside it.
        let decode = include_str!("testdata/vllm-decode-metrics-integrity.txt");
        let counts = read(decode, VLLM);
        assert_eq!(
            counts,
            Counts::from([("checksum".to_string(), 2), ("late".to_string(), 1), ("vllm:nixl_num_failed_transfers_total".to_string(), 3),]),
            "two engines' samples add up, _created is no count"
        );
        assert_eq!(total(&counts), 6);
        // A clean pod, and one that exports none of the families yet, count nothing.
        assert!(read(include_str!("testdata/vllm-metrics-2048.txt"), VLLM).is_empty());
        assert!(read("", VLLM).is_empty());
    }

    #[test]
    fn growth_is_named_and_a_fall_is_none() {
        let before = Counts::from([("checksum".to_string(), 1), ("vllm:nixl_num_failed_transfers_total".to_string(), 5)]);
        let after = Counts::from([("checksum".to_string(), 2), ("late".to_string(), 1), ("vllm:nixl_num_failed_transfers_total".to_string(), 0)]);
        assert_eq!(grown(&before, &after), ["checksum 1 -> 2", "late 0 -> 1"]);
        assert!(grown(&after, &after).is_empty());
        assert_eq!(describe(&after), "checksum 2, late 1");
    }
}
