//! End-to-end tests of the `imgrun` binary: the real binary run as separate processes
//! (daemons, jobs, servers) on loopback, one module per subject, in one test binary so
//! that libtorch is linked once and libtest runs tests of every subject side by side.
//!
//! Every test keeps to its own temporary folder, state folders and ports, and names the
//! processes it waits for or kills by their ids; none sets an environment variable or the
//! current folder of this process. `common` is the fixture they share.

mod azure;
mod cli;
mod cluster;
mod common;
mod dashboard;
mod dashboard_tls;
mod export;
mod faults;
mod jobs;
mod kubernetes;
mod launch;
mod loaders;
mod preload;
mod s3;
mod s3_harness;
mod train;
