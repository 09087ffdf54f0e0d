//! Numeric arguments: products that overflow, huge values, NaN, negatives, zeros and values
//! that wrap are refused naming the flag (or run to a clean end), never a panic or a hang.

use crate::support::*;

#[test]
fn model_dimensions_whose_product_overflows_are_refused_not_a_panic() {
    let out = sim(
        &with(&["--layers", "4294967296", "--kv-heads", "4294967296"]),
        30,
    );
    assert_clean_refusal(&out, &["--layers", "--kv-heads"]);
}

#[test]
fn a_huge_tokens_per_block_is_refused_not_a_panic() {
    let out = sim(&with(&["--tokens-per-block", "18446744073709551615"]), 30);
    assert_clean_refusal(&out, &["--tokens-per-block"]);
}

#[test]
fn a_huge_streams_count_is_refused_not_a_panic() {
    // 4 x streams (the default --prefixes) overflows
    let out = sim(
        &[
            "--model",
            "tiny",
            "--no-progress",
            "--streams",
            "4611686018427387904",
        ],
        30,
    );
    assert_clean_refusal(&out, &["--streams"]);
}

#[test]
fn a_huge_prefix_tokens_is_refused_not_a_panic() {
    let out = sim(&with(&["--prefix-tokens", "18446744073709551615"]), 30);
    assert_clean_refusal(&out, &["--prefix-tokens"]);
}

#[test]
fn a_large_prefix_tokens_is_refused_or_finishes_never_hangs() {
    // 8 prefixes of 10^8 tokens: no documented range; either refused up front or done
    // within 20 s (the run stops admitting turns after --duration 2)
    let out = sim(
        &with(&[
            "--prefix-tokens",
            "100000000",
            "--duration",
            "2",
            "--dram-mb",
            "1",
        ]),
        20,
    );
    assert!(!out.timed_out, "hung past 20 s: {}", out.all());
    assert_ne!(out.code, Some(101), "{}", out.all());
}

#[test]
fn a_huge_turns_count_is_refused_or_cut_by_duration_not_a_panic() {
    let out = sim(
        &[
            "--model",
            "tiny",
            "--no-progress",
            "--streams",
            "2",
            "--dram-mb",
            "1",
            "--turns",
            "18446744073709551615",
            "--duration",
            "2",
        ],
        30,
    );
    assert!(!out.timed_out, "{}", out.all());
    assert_ne!(out.code, Some(101), "panicked: {}", out.all());
    assert!(!out.stderr.contains("panicked"), "{}", out.all());
}

#[test]
fn a_huge_gpu_cache_blocks_is_refused_or_works_not_a_panic() {
    let out = sim(&with(&["--gpu-cache-blocks", "18446744073709551615"]), 30);
    assert!(!out.timed_out, "{}", out.all());
    assert_ne!(out.code, Some(101), "panicked: {}", out.all());
    assert!(!out.stderr.contains("panicked"), "{}", out.all());
}

#[test]
fn a_negative_or_nan_prefill_rate_is_refused() {
    // documented: "Simulated prefill speed of missed tokens (0: none)"; a speed of -1 or
    // NaN tokens/s has no meaning and every number has a range checked up front
    for v in ["-1", "NaN", "inf"] {
        let out = sim(&with(&["--dram-mb", "1", "--prefill-tokens-per-s", v]), 30);
        assert_clean_refusal(&out, &["--prefill-tokens-per-s"]);
    }
    // clap takes "-inf" for a flag of its own (not a number): refused, a usage error
    let out = sim(
        &with(&["--dram-mb", "1", "--prefill-tokens-per-s", "-inf"]),
        30,
    );
    assert_clean_refusal(&out, &["unexpected argument"]);
    assert_eq!(out.code, Some(2), "{}", out.all());
}

#[test]
fn a_dram_size_that_wraps_around_is_refused_as_too_large() {
    // 2^44 MiB = 2^64 bytes: `<< 20` wraps to 0; the user asked for a huge size, not 0
    let out = sim(&with(&["--dram-mb", "17592186044416"]), 30);
    assert_clean_refusal(&out, &["--dram-mb"]);
    assert!(
        !out.stderr.contains("must be positive"),
        "a huge --dram-mb is reported as not positive: {}",
        out.all()
    );
}

#[test]
fn a_zero_dram_size_names_the_flag() {
    let out = sim(&with(&["--dram-mb", "0"]), 30);
    assert_clean_refusal(&out, &["--dram-mb"]);
}

#[test]
fn an_out_of_range_fs_cap_names_the_flag() {
    for v in ["1e-12", "1e300"] {
        let out = sim(&with(&["--dram-mb", "1", "--fs-cap-gb", v]), 30);
        assert_clean_refusal(&out, &["--fs-cap-gb"]);
    }
}

#[test]
fn non_numbers_negatives_and_missing_values_are_usage_errors() {
    for args in [
        vec!["--turns", "1.5"],
        vec!["--seed", "x"],
        vec!["--dram-mb", "1e3"],
        vec!["--gpu-cache-blocks", "18446744073709551616"],
        vec!["--fs-cap-gb", "NaN"],
        vec!["--fs-write-budget-mb-per-s", "0"],
        vec!["--fs-write-budget-mb-per-s", "abc"],
        vec!["--duration", "NaN"],
        vec!["--duration", "1e30"],
        vec!["--instances", "0"],
        vec!["--metrics-addr", "not-an-addr"],
        vec!["--json"],
        vec!["--root-dir"],
    ] {
        let out = sim(&args, 30);
        assert_eq!(out.code, Some(2), "{args:?}: {}", out.all());
        assert_clean_refusal(&out, &[args[0]]);
    }
}

#[test]
fn a_negative_count_is_refused_naming_the_flag() {
    // clap reads "-1" as an unknown flag: "unexpected argument '-1' found", naming no flag
    for args in [
        vec!["--turns", "-1"],
        vec!["--seed", "-1"],
        vec!["--dram-mb", "-1"],
        vec!["--gpu-cache-blocks", "-1"],
    ] {
        let out = sim(&args, 30);
        assert_eq!(out.code, Some(2), "{args:?}: {}", out.all());
        assert_clean_refusal(&out, &[args[0]]);
    }
}

#[test]
fn a_zero_token_workload_is_refused_or_reports_without_nan() {
    let out = sim(
        &with(&[
            "--dram-mb",
            "1",
            "--prefix-tokens",
            "0",
            "--prompt-tokens",
            "0",
            "--output-tokens",
            "0",
        ]),
        30,
    );
    assert!(!out.timed_out && out.code != Some(101), "{}", out.all());
    if out.code == Some(0) {
        for bad in ["NaN", "inf"] {
            assert!(!out.stdout.contains(bad), "{bad} printed: {}", out.all());
        }
    }
}
