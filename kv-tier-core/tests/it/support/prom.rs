//! The Prometheus text format, parsed strictly (a second HELP or TYPE of one family, a sample
//! of no declared family, a bad name or label, an unknown escape, a duplicate series all
//! panic), and a scrape of a manager through the facade's `prometheus` module. The recorder is
//! the process's: the tests that read it take turns on [`RECORDER`].

use std::collections::{BTreeMap, HashSet};
use std::sync::Mutex;

use kv_tier_core::TieringManager;

/// The Prometheus recorder is the process's: tests that read it take turns.
pub(crate) static RECORDER: Mutex<()> = Mutex::new(());

/// A parsed exposition: every series with its value, every family with its type.
#[derive(Debug, Default)]
pub(crate) struct Exposition {
    /// (name, sorted labels) -> value
    pub(crate) series: BTreeMap<(String, Vec<(String, String)>), f64>,
    /// family -> type
    pub(crate) types: BTreeMap<String, String>,
}

/// Whether `n` is a valid metric name (`colon`) or label name.
fn valid_name(n: &str, colon: bool) -> bool {
    let mut cs = n.chars();
    let ok_first = |c: char| c.is_ascii_alphabetic() || c == '_' || (colon && c == ':');
    let ok_rest = |c: char| c.is_ascii_alphanumeric() || c == '_' || (colon && c == ':');
    cs.next().is_some_and(ok_first) && cs.all(ok_rest)
}

/// Parses the text format strictly; panics (with the line) on anything invalid: a
/// second HELP or TYPE of one family, a sample of no declared family, a bad name or label,
/// an unknown escape, a duplicate series.
pub(crate) fn parse(text: &str) -> Exposition {
    let mut ex = Exposition::default();
    let mut helps = HashSet::new();
    for line in text.lines() {
        if line.is_empty() {
            continue;
        }
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().unwrap();
            assert!(valid_name(name, true), "bad HELP name: {line:?}");
            assert!(helps.insert(name.to_string()), "HELP twice: {line:?}");
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut p = rest.split(' ');
            let (name, ty) = (p.next().unwrap(), p.next().unwrap_or(""));
            assert!(
                ["counter", "gauge", "histogram", "summary", "untyped"].contains(&ty),
                "bad TYPE: {line:?}"
            );
            assert!(
                ex.types.insert(name.to_string(), ty.to_string()).is_none(),
                "TYPE twice: {line:?}"
            );
            continue;
        }
        assert!(!line.starts_with('#') || line.starts_with("# "), "{line:?}");
        if line.starts_with('#') {
            continue;
        }
        // name{labels} value
        let (name, rest) = match line.find(['{', ' ']) {
            Some(i) => line.split_at(i),
            None => panic!("no value: {line:?}"),
        };
        assert!(valid_name(name, true), "bad metric name: {line:?}");
        let mut labels = Vec::new();
        let mut rest = rest;
        if let Some(r) = rest.strip_prefix('{') {
            let mut chars = r.char_indices().peekable();
            let end;
            loop {
                let mut lname = String::new();
                loop {
                    let (_, c) = chars.next().unwrap_or_else(|| panic!("{line:?}"));
                    if c == '=' {
                        break;
                    }
                    if c == '}' && lname.is_empty() {
                        panic!("empty label in {line:?}");
                    }
                    lname.push(c);
                }
                assert!(
                    valid_name(&lname, false),
                    "bad label name {lname:?}: {line:?}"
                );
                assert_eq!(chars.next().map(|c| c.1), Some('"'), "{line:?}");
                let mut value = String::new();
                loop {
                    let (_, c) = chars.next().unwrap_or_else(|| panic!("{line:?}"));
                    match c {
                        '"' => break,
                        '\\' => match chars.next().map(|c| c.1) {
                            Some('\\') => value.push('\\'),
                            Some('"') => value.push('"'),
                            Some('n') => value.push('\n'),
                            other => panic!("bad escape {other:?} in {line:?}"),
                        },
                        '\n' => panic!("raw newline in {line:?}"),
                        c => value.push(c),
                    }
                }
                labels.push((lname, value));
                match chars.next() {
                    Some((_, ',')) => {
                        if chars.peek().map(|c| c.1) == Some('}') {
                            end = chars.next().unwrap().0;
                            break;
                        }
                    }
                    Some((i, '}')) => {
                        end = i;
                        break;
                    }
                    other => panic!("bad label separator {other:?}: {line:?}"),
                }
            }
            rest = &r[end + 1..];
        }
        let value = rest.trim_start_matches(' ');
        let value: &str = value.split(' ').next().unwrap();
        let v: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            "NaN" => f64::NAN,
            v => v
                .parse()
                .unwrap_or_else(|_| panic!("bad value in {line:?}")),
        };
        let family = [name, name.strip_suffix("_bucket").unwrap_or(name)]
            .into_iter()
            .chain(name.strip_suffix("_sum"))
            .chain(name.strip_suffix("_count"))
            .find(|f| ex.types.contains_key(*f));
        assert!(family.is_some(), "sample of no declared family: {line:?}");
        let mut sorted = labels.clone();
        sorted.sort();
        let n = sorted.len();
        sorted.dedup_by(|a, b| a.0 == b.0);
        assert_eq!(sorted.len(), n, "a label twice: {line:?}");
        assert!(
            ex.series.insert((name.to_string(), sorted), v).is_none(),
            "duplicate series: {line:?}"
        );
    }
    ex
}

/// The value of the series `name` with exactly `labels`, if `ex` has it.
pub(crate) fn value(ex: &Exposition, name: &str, labels: &[(&str, &str)]) -> Option<f64> {
    let mut l: Vec<(String, String)> = labels
        .iter()
        .map(|(a, b)| (a.to_string(), b.to_string()))
        .collect();
    l.sort();
    ex.series.get(&(name.to_string(), l)).copied()
}

/// Publishes `m`'s statistics and renders the process's recorder (installed on first use):
/// the text and its strict parse.
pub(crate) fn scrape(m: &TieringManager) -> (String, Exposition) {
    let handle = kv_tier::prometheus::install_recorder().unwrap();
    let text = kv_tier::prometheus::render(&handle, m);
    let ex = parse(&text);
    (text, ex)
}
