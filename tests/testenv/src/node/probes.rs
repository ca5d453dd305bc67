//! HTTP GET and TCP probes against a pod's address.

use std::time::Duration;

use k8s_openapi::api::core::v1::{Container, Probe};
use k8s_openapi::apimachinery::pkg::util::intstr::IntOrString;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// A named port resolves through the container's ports.
fn port(c: &Container, p: &IntOrString) -> Result<u16, String> {
    match p {
        IntOrString::Int(n) => u16::try_from(*n).map_err(|_| format!("port {n} out of range")),
        IntOrString::String(name) => c
            .ports
            .iter()
            .flatten()
            .find(|cp| cp.name.as_deref() == Some(name))
            .map(|cp| cp.container_port as u16)
            .ok_or_else(|| format!("no container port named {name}")),
    }
}

/// Runs `probe` once: Ok(()) on success, Err(reason) on failure.
pub async fn run(probe: &Probe, c: &Container, ip: &str) -> Result<(), String> {
    let timeout = Duration::from_secs(probe.timeout_seconds.unwrap_or(1).max(1) as u64);
    let work = async {
        if let Some(h) = &probe.http_get {
            let port = port(c, &h.port)?;
            let host = h.host.clone().unwrap_or_else(|| ip.to_string());
            let path = h.path.clone().unwrap_or_else(|| "/".into());
            let mut s = TcpStream::connect((host.as_str(), port)).await.map_err(|e| e.to_string())?;
            let req = format!("GET {path} HTTP/1.1\r\nHost: {host}:{port}\r\nUser-Agent: kube-probe/1.37\r\nConnection: close\r\n\r\n");
            s.write_all(req.as_bytes()).await.map_err(|e| e.to_string())?;
            let mut head = vec![0u8; 64];
            let n = s.read(&mut head).await.map_err(|e| e.to_string())?;
            let line = String::from_utf8_lossy(&head[..n]);
            let code: u16 = line.split_whitespace().nth(1).and_then(|c| c.parse().ok()).ok_or("malformed HTTP response")?;
            if (200..400).contains(&code) { Ok(()) } else { Err(format!("HTTP probe failed with statuscode: {code}")) }
        } else if let Some(t) = &probe.tcp_socket {
            let port = port(c, &t.port)?;
            TcpStream::connect((ip, port)).await.map(|_| ()).map_err(|e| e.to_string())
        } else {
            Err("only httpGet and tcpSocket probes are supported".into())
        }
    };
    tokio::time::timeout(timeout, work).await.unwrap_or_else(|_| Err(format!("probe timed out after {timeout:?}")))
}
