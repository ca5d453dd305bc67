//! Certificates for one control plane: a CA, the apiserver's serving certificate, the admin
//! client certificate (group `system:masters`), and the service-account signing key.

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
    pub sa_key: PathBuf,
    pub sa_pub: PathBuf,
}

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
        // Where pods reach the API server: the pod bridge's address in the world's namespace.
        crate::node::network::GATEWAY.to_string(),
        "10.0.0.1".to_string(),
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

    let sa_key = KeyPair::generate()?;
    Ok(Certs {
        ca: write(dir, "ca.crt", &ca_pem)?,
        ca_key: write(dir, "ca.key", &ca_key.serialize_pem())?,
        server_cert: write(dir, "apiserver.crt", &server_cert.pem())?,
        server_key: write(dir, "apiserver.key", &server_key.serialize_pem())?,
        admin_cert: write(dir, "admin.crt", &admin_cert.pem())?,
        admin_key: write(dir, "admin.key", &admin_key.serialize_pem())?,
        sa_key: write(dir, "sa.key", &sa_key.serialize_pem())?,
        sa_pub: write(dir, "sa.pub", &sa_key.public_key_pem())?,
    })
}
