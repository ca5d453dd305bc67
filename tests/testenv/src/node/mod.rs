//! The node agent: plays the kubelet's part (with runc as its container runtime) for a control
//! plane without nodes.

pub mod agent;
pub mod bundle;
pub mod cgroups;
pub mod dns;
pub mod env;
pub mod images;
pub mod kubelet_api;
pub mod logs;
pub mod network;
pub mod oci_image;
pub mod pod;
pub mod port_forward;
pub mod probes;
pub mod pull;
pub mod rootfs;
pub mod runc;
pub mod spdy;
pub mod volumes;

pub use agent::{AgentConfig, NodeAgent};
pub use images::{Image, ImageTable};
