//! Reading Prometheus text exposition in tests.

/// The value of one sample, named as printed (`name{label="v",...}`), in a `/metrics` text.
pub fn sample(text: &str, series: &str) -> Option<f64> {
    text.lines().find_map(|l| l.strip_prefix(series).and_then(|rest| rest.strip_prefix(' '))).and_then(|v| v.trim().parse().ok())
}

/// The sum of every sample of one metric family (all label sets).
pub fn family_sum(text: &str, family: &str) -> f64 {
    text.lines()
        .filter(|l| l.strip_prefix(family).is_some_and(|rest| rest.starts_with('{') || rest.starts_with(' ')))
        .filter_map(|l| l.rsplit(' ').next()?.parse::<f64>().ok())
        .sum()
}

#[cfg(test)]
mod tests {
    use super::*;

    const TEXT: &str = "# HELP x_total X.\nx_total{reason=\"a\"} 2\nx_total{reason=\"b\"} 3\nx_total_other 7\ny 1.5\n";

    #[test]
    fn samples_and_families_are_read_exactly() {
        assert_eq!(sample(TEXT, "x_total{reason=\"b\"}"), Some(3.0));
        assert_eq!(sample(TEXT, "y"), Some(1.5));
        assert_eq!(sample(TEXT, "x_total"), None, "a family name is not a sample");
        assert_eq!(family_sum(TEXT, "x_total"), 5.0);
    }
}
