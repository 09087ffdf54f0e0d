# The same commands CI runs (.ci/run). Plain cargo forms are in the README.

export CARGO_BUILD_JOBS := "2"

check:
    cargo fmt --all -- --check
    cargo clippy --workspace --all-targets -- -D warnings

test:
    cargo test --workspace --no-fail-fast

# The multi-process soaks of shared roots and buckets at full length (60 s each; `just test`
# runs them for at least 10 s each, on until their bound was tested).
soak:
    KV_TIER_SHARED_SECS=60 cargo test -p kv-tier-fs --test it shared::four_processes -- --nocapture
    KV_TIER_SHARED_SECS=60 cargo test -p kv-tier-obj --test it shared::processes -- --nocapture

bench:
    cargo bench -p kv-tier-examples
    cargo bench -p kv-tier-fs
    cargo bench -p kv-tier-obj

demo:
    cargo run --release -p kv-tier-examples --bin serve_sim

doc:
    RUSTDOCFLAGS=-Dwarnings cargo doc --workspace --no-deps
