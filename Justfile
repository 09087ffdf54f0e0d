# The same commands CI runs (.ci/run). Plain cargo forms are in the README.

export CARGO_BUILD_JOBS := "2"

check:
    cargo fmt --all -- --check
    cargo clippy --workspace --all-targets -- -D warnings

test:
    cargo test --workspace

bench:
    cargo bench -p kv-tier-examples
    cargo bench -p kv-tier-fs
    cargo bench -p kv-tier-obj

demo:
    cargo run --release -p kv-tier-examples --bin serve_sim

doc:
    RUSTDOCFLAGS=-Dwarnings cargo doc --workspace --no-deps
