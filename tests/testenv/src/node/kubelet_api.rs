//! The kubelet's HTTPS endpoint, as far as `kubectl logs` needs it: `GET /containerLogs/{ns}/{pod}/{container}`.
//! The API server dials it at the Node's InternalIP and `daemonEndpoints.kubeletEndpoint.Port`,
//! verifies the serving certificate against the cluster CA (`--kubelet-certificate-authority`)
//! and presents its own client certificate, which must be signed by that CA and name
//! `kube-apiserver-kubelet-client`; nothing else is served.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::Arc;
use std::time::Duration;

use axum::Router;
use axum::body::Body;
use axum::extract::{Path as UrlPath, Query, State};
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use super::logs::{self, LogError, LogIndex, LogRequest};

/// PEM files of the serving certificate and key, and the CA that signs clients.
#[derive(Debug, Clone)]
pub struct KubeletTls<'a> {
    pub cert: &'a Path,
    pub key: &'a Path,
    pub client_ca: &'a Path,
}

/// Serves on `addr` until the runtime stops; returns the bound address.
pub async fn serve(addr: SocketAddr, tls: KubeletTls<'_>, index: LogIndex) -> anyhow::Result<SocketAddr> {
    let acceptor = TlsAcceptor::from(Arc::new(server_config(&tls)?));
    let tcp = TcpListener::bind(addr).await?;
    let local = tcp.local_addr()?;
    let (tx, rx) = mpsc::channel(16);
    tokio::spawn(handshakes(tcp, acceptor, tx));
    let app = Router::new()
        .route("/containerLogs/{ns}/{pod}/{container}", get(container_logs))
        .fallback(|| async { (StatusCode::NOT_FOUND, "the kvgate node agent serves only /containerLogs\n") })
        .with_state(index);
    tokio::spawn(async move {
        if let Err(e) = axum::serve(TlsListener { rx, local }, app).await {
            tracing::warn!(error = %e, "kubelet API stopped");
        }
    });
    Ok(local)
}

fn server_config(tls: &KubeletTls<'_>) -> anyhow::Result<rustls::ServerConfig> {
    let read = |what: &str, p: &Path| anyhow::anyhow!("{what} {}: cannot be read as PEM", p.display());
    let certs: Vec<CertificateDer<'static>> = CertificateDer::pem_file_iter(tls.cert)
        .map_err(|_| read("certificate", tls.cert))?
        .collect::<Result<_, _>>()
        .map_err(|_| read("certificate", tls.cert))?;
    let key = PrivateKeyDer::from_pem_file(tls.key).map_err(|_| read("key", tls.key))?;
    let mut roots = rustls::RootCertStore::empty();
    for ca in CertificateDer::pem_file_iter(tls.client_ca).map_err(|_| read("CA", tls.client_ca))? {
        roots.add(ca.map_err(|_| read("CA", tls.client_ca))?)?;
    }
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let clients = rustls::server::WebPkiClientVerifier::builder_with_provider(Arc::new(roots), provider.clone()).build()?;
    Ok(rustls::ServerConfig::builder_with_provider(provider)
        .with_safe_default_protocol_versions()?
        .with_client_cert_verifier(clients)
        .with_single_cert(certs, key)?)
}

/// TLS handshakes run beside each other (a slow or silent client holds up no one) and only
/// connections from the API server's identity reach the router.
async fn handshakes(tcp: TcpListener, acceptor: TlsAcceptor, tx: mpsc::Sender<(TlsStream<TcpStream>, SocketAddr)>) {
    loop {
        let Ok((stream, peer)) = tcp.accept().await else { continue };
        let (acceptor, tx) = (acceptor.clone(), tx.clone());
        tokio::spawn(async move {
            match tokio::time::timeout(Duration::from_secs(10), acceptor.accept(stream)).await {
                Ok(Ok(tls)) if is_api_server(&tls) => {
                    let _ = tx.send((tls, peer)).await;
                }
                Ok(Ok(_)) => tracing::warn!(%peer, "kubelet API: refused a client certificate that is not the API server's"),
                Ok(Err(e)) => tracing::debug!(%peer, error = %e, "kubelet API: TLS handshake failed"),
                Err(_) => tracing::debug!(%peer, "kubelet API: TLS handshake timed out"),
            }
        });
    }
}

fn is_api_server(tls: &TlsStream<TcpStream>) -> bool {
    // The verifier has checked the chain; here only the subject's common name matters.
    let Some(cert) = tls.get_ref().1.peer_certificates().and_then(|c| c.first()) else { return false };
    let Ok((_, cert)) = x509_parser::parse_x509_certificate(cert.as_ref()) else { return false };
    cert.subject().iter_common_name().any(|cn| cn.as_str() == Ok(crate::certs::KUBELET_CLIENT))
}

struct TlsListener {
    rx: mpsc::Receiver<(TlsStream<TcpStream>, SocketAddr)>,
    local: SocketAddr,
}

impl axum::serve::Listener for TlsListener {
    type Io = TlsStream<TcpStream>;
    type Addr = SocketAddr;

    async fn accept(&mut self) -> (Self::Io, Self::Addr) {
        match self.rx.recv().await {
            Some(conn) => conn,
            // The handshake task never ends while the listener lives.
            None => std::future::pending().await,
        }
    }

    fn local_addr(&self) -> std::io::Result<Self::Addr> {
        Ok(self.local)
    }
}

async fn container_logs(
    State(index): State<LogIndex>,
    UrlPath((ns, pod, container)): UrlPath<(String, String, String)>,
    Query(query): Query<HashMap<String, String>>,
) -> Response {
    let req = match LogRequest::parse(&query) {
        Ok(r) => r,
        Err(e) => return (StatusCode::BAD_REQUEST, e).into_response(),
    };
    match logs::open(&index, &ns, &pod, &container, &req) {
        Ok(stream) => ([("content-type", "text/plain")], Body::from_stream(stream)).into_response(),
        Err(LogError::NotFound(e)) => (StatusCode::NOT_FOUND, e).into_response(),
        Err(LogError::BadRequest(e)) => (StatusCode::BAD_REQUEST, e).into_response(),
    }
}
