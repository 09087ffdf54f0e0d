//! Usage errors: numbers clap refuses and missing arguments, for every command, exit 2.

use crate::support::*;

/// Numbers clap refuses: a usage error (exit 2), for every numeric argument.
#[test]
fn malformed_numeric_arguments_are_usage_errors() {
    let dir = tempfile::tempdir().unwrap();
    write_root(dir.path(), 1);
    let r = arg(dir.path());
    let mut bad = Vec::new();
    let cases: Vec<Vec<&str>> = vec![
        vec!["verify", r, "--block-size", "-1"],
        vec!["verify", r, "--block-size", "1.5"],
        vec!["verify", r, "--block-size", "nan"],
        vec!["verify", r, "--block-size", "18446744073709551616"],
        vec!["verify", r, "--block-size", ""],
        vec!["gc", r, "--max-size-gb", "1e309"],
        vec!["gc", r, "--max-size-gb", "inf"],
        vec!["gc", r, "--max-size-gb", "NaN"],
        vec!["gc", r, "--max-size-gb", "-0"],
        vec!["gc", r, "--max-size-gb", "0x10"],
        vec!["gc", r, "--max-size-gb", ""],
        vec!["gc", r, "--max-size-gb", "1", "--low-watermark", "nan"],
        vec!["gc", r, "--max-size-gb", "1", "--low-watermark", "-0"],
        vec![
            "gc",
            r,
            "--max-size-gb",
            "1",
            "--low-watermark",
            "1.0000001",
        ],
        vec!["gc", r],
        vec!["s3-server", "--root", r, "--port", "70000"],
        vec!["s3-server", "--root", r, "--port", "-1"],
        vec!["s3-server", "--root", r, "--port", "1.5"],
        vec![
            "s3-server",
            "--root",
            r,
            "--port",
            "0",
            "--host",
            "localhost:1",
        ],
        vec!["inspect"],
        vec!["config", "check"],
        vec!["frobnicate"],
    ];
    for args in &cases {
        let out = run(args);
        if out.code != Some(2) || out.panicked() {
            bad.push(format!("{args:?}: {out:?}"));
        }
    }
    assert!(bad.is_empty(), "{}", bad.join("\n----\n"));
}
