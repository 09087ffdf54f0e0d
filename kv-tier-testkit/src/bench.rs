//! Helpers the project's benchmarks share: medians, knobs from the environment, the CPU time
//! a process used.

/// The median of `samples` (the upper one of an even count). Panics if there are none.
///
/// ```
/// use kv_tier_testkit::bench::median;
/// assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
/// assert_eq!(median(vec![std::time::Duration::from_millis(5)]).as_millis(), 5);
/// ```
pub fn median<T: PartialOrd + Copy>(mut samples: Vec<T>) -> T {
    assert!(!samples.is_empty(), "the median of no samples");
    samples.sort_by(|a, b| a.partial_cmp(b).unwrap_or(std::cmp::Ordering::Equal));
    samples[samples.len() / 2]
}

/// The environment variable `name` parsed as a `T`, or `default` when it is unset or does
/// not parse.
pub fn env_or<T: std::str::FromStr>(name: &str, default: T) -> T {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// CPU seconds (user + system) this process has used so far (Linux; 0 elsewhere).
pub fn cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // after the command name's closing parenthesis: fields 14 and 15 are utime and stime
    let rest = stat.rsplit_once(')').map_or("", |(_, r)| r);
    let f: Vec<&str> = rest.split_whitespace().collect();
    let ticks = |i: usize| f.get(i).and_then(|v| v.parse::<f64>().ok()).unwrap_or(0.0);
    (ticks(11) + ticks(12)) / 100.0
}
