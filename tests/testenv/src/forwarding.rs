//! `kubectl port-forward` run as a user runs it: the real kubectl, through the API server, to
//! the node agent's kubelet API (`node::port_forward`), listening on a free local port.

use std::io::{BufRead, BufReader, Read};
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::sync::{Arc, Mutex, mpsc};
use std::time::Duration;

use crate::ControlPlane;

/// A running `kubectl port-forward`; stopped on drop.
pub struct Forwarding {
    child: Child,
    /// Where the forwarded port listens (127.0.0.1 and a port kubectl chose).
    pub local: SocketAddr,
    stderr: Arc<Mutex<String>>,
}

impl ControlPlane {
    /// `kubectl -n NS port-forward TARGET 0:REMOTE` (TARGET: `pod/NAME`, `svc/NAME`...), once
    /// kubectl says where it listens.
    pub fn port_forward(&self, ns: &str, target: &str, remote: u16) -> anyhow::Result<Forwarding> {
        let mut child = Command::new(crate::controlplane::kubectl_path())
            .arg(format!("--kubeconfig={}", self.kubeconfig.display()))
            .args(["-n", ns, "port-forward", target, &format!("0:{remote}")])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        let stderr = Arc::new(Mutex::new(String::new()));
        let mut err = child.stderr.take().expect("piped");
        let kept = stderr.clone();
        std::thread::spawn(move || {
            let mut buf = [0u8; 4096];
            while let Ok(n @ 1..) = err.read(&mut buf) {
                kept.lock().unwrap().push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        let (tx, rx) = mpsc::channel();
        let out = child.stdout.take().expect("piped");
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                // "Forwarding from 127.0.0.1:40123 -> 8000"
                if let Some(addr) = line.strip_prefix("Forwarding from 127.0.0.1:").and_then(|r| r.split(' ').next()) {
                    let _ = tx.send(addr.parse::<u16>().ok());
                }
            }
        });
        let port = rx.recv_timeout(Duration::from_secs(30)).ok().flatten();
        let Some(port) = port else {
            let _ = child.kill();
            let _ = child.wait();
            anyhow::bail!("kubectl port-forward {target} {remote} did not say where it listens within 30 s: {}", stderr.lock().unwrap());
        };
        Ok(Forwarding { child, local: SocketAddr::from(([127, 0, 0, 1], port)), stderr })
    }
}

impl Forwarding {
    /// What kubectl has written to stderr so far (errors the node reported on a connection).
    pub fn stderr(&self) -> String {
        self.stderr.lock().unwrap().clone()
    }
}

impl Drop for Forwarding {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}
