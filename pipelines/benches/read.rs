//! Read benchmark (being written).
fn main() {}
