//! Certificates for one control plane: a CA, the apiserver's serving certificate, the admin
//! client certificate (group `system:masters`), the node agents' kubelet serving certificate and
//! the apiserver's client certificate for it, and the service-account signing key.

use std::path::{Path, PathBuf};

use rcgen::{BasicConstraints, CertificateParams, DnType, IsCa, Issuer, KeyPair, KeyUsagePurpose};

#[derive(Debug, Clone)]
pub struct Certs {
    pub ca: PathBuf,
    pub ca_key: PathBuf,
    pub server_cert: PathBuf,
    pub server_key: PathBuf,
    pub admin_cert: PathBuf,
    pub admin_key: PathBuf,
    /// The node agents' kubelet API (`containerLogs`, `portForward`): served for the node address pods and
    /// the API server dial, and the API server's client identity there.
    pub kubelet_cert: PathBuf,
    pub kubelet_key: PathBuf,
    pub kubelet_client_cert: PathBuf,
    pub kubelet_client_key: PathBuf,
    pub sa_key: PathBuf,
    pub sa_pub: PathBuf,
}

/// The API server's identity towards node agents (kubeadm's name for it).
pub const KUBELET_CLIENT: &str = "kube-apiserver-kubelet-client";

fn write(dir: &Path, name: &str, text: &str) -> anyhow::Result<PathBuf> {
    let p = dir.join(name);
    std::fs::write(&p, text)?;
    Ok(p)
}

pub fn generate(dir: &Path) -> anyhow::Result<Certs> {
    let ca_key = KeyPair::generate()?;
    let mut ca_params = CertificateParams::new(Vec::<String>::new())?;
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.distinguished_name.push(DnType::CommonName, "kvgate-test-ca");
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    let ca_cert = ca_params.self_signed(&ca_key)?;
    let ca_pem = ca_cert.pem();
    let issuer = Issuer::new(ca_params, &ca_key);

    let server_key = KeyPair::generate()?;
    let mut server = CertificateParams::new(vec![
        "localhost".to_string(),
        "127.0.0.1".to_string(),
        // Where nodes and pods reach the API server: the world's address on the fabric.
        crate::fabric::WORLD.to_string(),
        // The kubernetes Service's ClusterIP, first of --service-cluster-ip-range.
        "10.96.0.1".to_string(),
        "kubernetes".to_string(),
        "kubernetes.default".to_string(),
        "kubernetes.default.svc".to_string(),
    ])?;
    server.distinguished_name.push(DnType::CommonName, "kube-apiserver");
    let server_cert = server.signed_by(&server_key, &issuer)?;

    let admin_key = KeyPair::generate()?;
    let mut admin = CertificateParams::new(Vec::<String>::new())?;
    admin.distinguished_name.push(DnType::CommonName, "kvgate-test-admin");
    admin.distinguished_name.push(DnType::OrganizationName, "system:masters");
    let admin_cert = admin.signed_by(&admin_key, &issuer)?;

    let kubelet_key = KeyPair::generate()?;
    // One serving certificate for every node address the fabric can give (a test world's
    // shortcut: a kubelet has its own).
    let mut kubelet = CertificateParams::new(crate::fabric::all_node_ips().map(|ip| ip.to_string()).collect::<Vec<_>>())?;
    kubelet.distinguished_name.push(DnType::CommonName, "kvgate-node-agent");
    let kubelet_cert = kubelet.signed_by(&kubelet_key, &issuer)?;

    let kubelet_client_key = KeyPair::generate()?;
    let mut kubelet_client = CertificateParams::new(Vec::<String>::new())?;
    kubelet_client.distinguished_name.push(DnType::CommonName, KUBELET_CLIENT);
    let kubelet_client_cert = kubelet_client.signed_by(&kubelet_client_key, &issuer)?;

    let sa_key = KeyPair::generate()?;
    Ok(Certs {
        ca: write(dir, "ca.crt", &ca_pem)?,
        ca_key: write(dir, "ca.key", &ca_key.serialize_pem())?,
        server_cert: write(dir, "apiserver.crt", &server_cert.pem())?,
        server_key: write(dir, "apiserver.key", &server_key.serialize_pem())?,
        admin_cert: write(dir, "admin.crt", &admin_cert.pem())?,
        admin_key: write(dir, "admin.key", &admin_key.serialize_pem())?,
        kubelet_cert: write(dir, "kubelet.crt", &kubelet_cert.pem())?,
        kubelet_key: write(dir, "kubelet.key", &kubelet_key.serialize_pem())?,
        kubelet_client_cert: write(dir, "apiserver-kubelet-client.crt", &kubelet_client_cert.pem())?,
        kubelet_client_key: write(dir, "apiserver-kubelet-client.key", &kubelet_client_key.serialize_pem())?,
        sa_key: write(dir, "sa.key", &sa_key.serialize_pem())?,
        sa_pub: write(dir, "sa.pub", &sa_key.public_key_pem())?,
    })
}
