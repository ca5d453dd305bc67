//! kvgate's test environment: a real control plane built from the official Kubernetes Go
//! modules (`make controlplane`), started on loopback, with a kubeconfig for the tests' admin
//! identity, and cleaned up however the test binary ends; and the helpers every test suite
//! shares (a blocking HTTP client, a `/metrics` reader, waiting with diagnostics).

pub mod alertmanager;
pub mod audit;
pub mod certs;
pub mod controlplane;
pub mod fabric;
pub mod forwarding;
pub mod http;
pub mod images;
pub mod jaeger;
pub mod llamacpp;
pub mod metrics;
pub mod models;
pub mod netfault;
pub mod netns;
pub mod node;
pub mod nodes;
pub mod once_dir;
pub mod paths;
pub mod process;
pub mod readme;
pub mod registry;
pub mod relay;
pub mod tools;
pub mod wait;

pub use controlplane::{ControlPlane, Options, bin_dir};
