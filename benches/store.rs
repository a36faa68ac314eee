//! Store throughput benchmarks (filled in with the bench commit).
fn main() {}
