//! kvgate's test environment: a real control plane built from the official Kubernetes Go
//! modules (`make controlplane`), started on loopback, with a kubeconfig for the tests' admin
//! identity, and cleaned up however the test binary ends.

pub mod certs;
pub mod controlplane;
pub mod node;
pub mod process;

pub use controlplane::{ControlPlane, bin_dir};
