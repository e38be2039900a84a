# Sourced by scripts/test.sh and scripts/check-inlined.sh: the crates and
# features of the suite's `cargo test`, written once (another set unifies
# other features and rebuilds most of the workspace). Not the crates with no
# Rust tests: the Python module (pytest over the wheel), the C ABI (the C
# test program) and the benches; an explicit --lib builds a lib's test
# harness even where it says `test = false`, and theirs were 3.5 minutes of
# a core for no test.
test_scope=(--workspace --exclude hgca-py --exclude hgca-capi --exclude hgca-benches --all-features)
