//! The kubelet's HTTPS endpoint, as far as `kubectl logs` and `kubectl port-forward` need it:
//! `GET /containerLogs/{ns}/{pod}/{container}` and `/portForward/{ns}/{pod}` (an upgrade to
//! SPDY/3.1, `port_forward`). The API server dials it at the Node's InternalIP and `daemonEndpoints.kubeletEndpoint.Port`,
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
use axum::extract::{Path as UrlPath, Query, Request, State};
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{any, get};
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::mpsc;
use tokio_rustls::TlsAcceptor;
use tokio_rustls::server::TlsStream;

use super::logs::{self, LogError, LogIndex, LogRequest};
use super::port_forward::{self, Dial};

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
        .route("/portForward/{ns}/{pod}", any(port_forward))
        .route("/portForward/{ns}/{pod}/{uid}", any(port_forward_uid))
        .fallback(|| async { (StatusCode::NOT_FOUND, "the kvgate node agent serves only /containerLogs and /portForward\n") })
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

async fn port_forward_uid(index: State<LogIndex>, UrlPath((ns, pod, _uid)): UrlPath<(String, String, String)>, req: Request) -> Response {
    port_forward(index, UrlPath((ns, pod)), req).await
}

/// Upgrades to SPDY/3.1 with `portforward.k8s.io`, as the kubelet does, and forwards the
/// client's streams to the pod's ports on its own loopback.
async fn port_forward(State(index): State<LogIndex>, UrlPath((ns, pod)): UrlPath<(String, String)>, mut req: Request) -> Response {
    let upgrade = req.headers().get(header::UPGRADE).and_then(|v| v.to_str().ok()).unwrap_or_default();
    if !upgrade.eq_ignore_ascii_case("SPDY/3.1") {
        return (StatusCode::BAD_REQUEST, format!("port-forward needs an upgrade to SPDY/3.1, got Upgrade: {upgrade:?}\n")).into_response();
    }
    let offered: Vec<String> = req
        .headers()
        .get_all("X-Stream-Protocol-Version")
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(','))
        .map(|p| p.trim().to_string())
        .collect();
    if !offered.iter().any(|p| p == port_forward::PROTOCOL) {
        let why = format!("unable to upgrade: unable to negotiate protocol: client supports {offered:?}, server supports [{}]\n", port_forward::PROTOCOL);
        return (StatusCode::FORBIDDEN, why).into_response();
    }
    let Some(netns) = index.netns(&ns, &pod) else {
        return (StatusCode::NOT_FOUND, format!("pod {ns}/{pod} is not running on this node\n")).into_response();
    };
    let on_upgrade = hyper::upgrade::on(&mut req);
    tokio::spawn(async move {
        let io = match on_upgrade.await {
            Ok(io) => hyper_util::rt::TokioIo::new(io),
            Err(e) => return tracing::debug!(error = %e, "port-forward: the upgrade did not complete"),
        };
        if let Err(e) = port_forward::serve(io, dial_in(ns, pod, netns)).await {
            tracing::debug!(error = %e, "port-forward session ended");
        }
    });
    let mut resp = Response::new(Body::empty());
    *resp.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    let headers = resp.headers_mut();
    headers.insert(header::CONNECTION, HeaderValue::from_static("Upgrade"));
    headers.insert(header::UPGRADE, HeaderValue::from_static("SPDY/3.1"));
    headers.insert("X-Stream-Protocol-Version", HeaderValue::from_static(port_forward::PROTOCOL));
    resp
}

/// Connects to `localhost:PORT` inside the pod's network namespace, as a container runtime's
/// port forward does (a server listening only on the pod's loopback is reached too).
fn dial_in(ns: String, pod: String, netns: std::path::PathBuf) -> Dial {
    Box::new(move |port| {
        let (ns, pod, netns) = (ns.clone(), pod.clone(), netns.clone());
        Box::pin(async move {
            let (tx, rx) = tokio::sync::oneshot::channel();
            // A thread of its own: setns moves only the calling thread, and this one ends here.
            std::thread::spawn(move || {
                let _ = tx.send(connect_in(&netns, port));
            });
            let fail = |e: String| {
                format!("error forwarding port {port} to pod {ns}/{pod}: failed to connect to localhost:{port} inside the pod's network namespace: {e}")
            };
            let stream = rx.await.map_err(|e| fail(e.to_string()))?.map_err(fail)?;
            stream.set_nonblocking(true).map_err(|e| fail(e.to_string()))?;
            TcpStream::from_std(stream).map_err(|e| fail(e.to_string()))
        })
    })
}

fn connect_in(netns: &Path, port: u16) -> Result<std::net::TcpStream, String> {
    use std::os::fd::AsRawFd;
    let ns = std::fs::File::open(netns).map_err(|e| format!("{}: {e}", netns.display()))?;
    // SAFETY: setns on an open namespace file; it changes only this thread, which ends after the connect.
    if unsafe { libc::setns(ns.as_raw_fd(), libc::CLONE_NEWNET) } != 0 {
        return Err(format!("entering {}: {}", netns.display(), std::io::Error::last_os_error()));
    }
    std::net::TcpStream::connect_timeout(&SocketAddr::from(([127, 0, 0, 1], port)), Duration::from_secs(5)).map_err(|e| e.to_string())
}
