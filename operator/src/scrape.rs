//! Reading workers' `/metrics` (Prometheus text format): the handoff mismatch counters the
//! canary and the bake watch.

use std::collections::BTreeMap;

/// The counter every decode worker keeps of handoffs it refused, by `reason`.
pub const MISMATCHES: &str = "kvgate_handoff_mismatch_total";

/// The samples of one metric family, summed by the value of `label` (`""` when absent).
pub fn family_by(text: &str, family: &str, label: &str) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    for line in text.lines() {
        let Some(rest) = line.strip_prefix(family) else { continue };
        if !(rest.starts_with('{') || rest.starts_with(' ')) {
            continue;
        }
        let Some(value) = rest.rsplit(' ').next().and_then(|v| v.parse::<f64>().ok()) else { continue };
        let key = format!("{label}=\"");
        let by = rest.split_once(&key).and_then(|(_, v)| v.split('"').next()).unwrap_or("").to_string();
        *out.entry(by).or_insert(0.0) += value;
    }
    out
}

/// A worker's `/metrics`, or why it could not be read.
pub async fn metrics(http: &reqwest::Client, ip: &str, port: u16) -> Result<String, String> {
    let url = format!("http://{ip}:{port}/metrics");
    match http.get(&url).send().await {
        Ok(r) if r.status().is_success() => r.text().await.map_err(|e| format!("GET {url}: {e}")),
        Ok(r) => Err(format!("GET {url}: HTTP {}", r.status())),
        Err(e) => Err(format!("GET {url}: {e}")),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_family_sums_its_samples_by_label_only() {
        let text = "# TYPE kvgate_handoff_mismatch_total counter\nkvgate_handoff_mismatch_total{reason=\"checksum\",role=\"decode\"} 2\nkvgate_handoff_mismatch_total{reason=\"timeout\",role=\"decode\"} 1\nkvgate_handoff_mismatch_total{reason=\"checksum\",role=\"prefill\"} 1\nkvgate_handoff_mismatch_totals 7\n";
        let by = family_by(text, MISMATCHES, "reason");
        assert_eq!(by, BTreeMap::from([("checksum".to_string(), 3.0), ("timeout".to_string(), 1.0)]));
        assert!(family_by("", MISMATCHES, "reason").is_empty());
    }
}
