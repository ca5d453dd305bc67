//! A real Alertmanager (`make tools` builds v0.35.0 from its module) on loopback, routing every
//! alert to a webhook receiver the test owns: what a platform team's pager would get, read back
//! as the JSON Alertmanager posted.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpListener;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use serde_json::Value;

use crate::process::{Proc, free_port, tail};
use crate::tools::tool;

pub struct Alertmanager {
    proc: Proc,
    /// `host:port`, for Prometheus's `alerting.alertmanagers` targets.
    pub addr: String,
    /// Every notification the webhook received, as posted.
    pub received: Arc<Mutex<Vec<Value>>>,
}

impl Alertmanager {
    /// Starts Alertmanager in `dir` with one route: every alert, grouped by alert name and
    /// deployment, to the webhook, with short waits so a test sees it within seconds.
    pub fn start(dir: &Path) -> anyhow::Result<Alertmanager> {
        let bin = tool("alertmanager")?;
        std::fs::create_dir_all(dir)?;
        let (webhook, received) = webhook_receiver()?;
        let (port, cluster) = (free_port(), free_port());
        let config = format!(
            r#"route:
  receiver: platform-pager
  group_by: [alertname, namespace, deployment]
  group_wait: 1s
  group_interval: 2s
  repeat_interval: 1h
receivers:
  - name: platform-pager
    webhook_configs:
      - url: http://{webhook}/alerts
        send_resolved: true
"#
        );
        let path = dir.join("alertmanager.yml");
        std::fs::write(&path, config)?;
        let args = vec![
            format!("--config.file={}", path.display()),
            format!("--storage.path={}", dir.join("alertmanager-data").display()),
            format!("--web.listen-address=127.0.0.1:{port}"),
            format!("--cluster.listen-address=127.0.0.1:{cluster}"),
        ];
        let mut proc = Proc::spawn("alertmanager", &bin, &args, dir)?;
        let addr = format!("127.0.0.1:{port}");
        let deadline = Instant::now() + Duration::from_secs(30);
        while crate::http::get(&format!("http://{addr}/-/ready")).is_none() {
            proc.check_alive().map_err(|e| anyhow::anyhow!("{e:#}\n{}", tail(&proc.log, 30)))?;
            anyhow::ensure!(Instant::now() < deadline, "alertmanager did not start within 30 s:\n{}", tail(&proc.log, 30));
            std::thread::sleep(Duration::from_millis(200));
        }
        Ok(Alertmanager { proc, addr, received })
    }

    /// The alerts (each `{status, labels, annotations, ...}`) of every notification so far.
    pub fn alerts(&self) -> Vec<Value> {
        self.received.lock().unwrap().iter().flat_map(|n| n["alerts"].as_array().cloned().unwrap_or_default()).collect()
    }

    pub fn log(&self) -> String {
        tail(&self.proc.log, 30)
    }
}

/// An HTTP server on loopback that answers 200 to every POST and keeps its JSON body.
fn webhook_receiver() -> anyhow::Result<(String, Arc<Mutex<Vec<Value>>>)> {
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?.to_string();
    let received: Arc<Mutex<Vec<Value>>> = Arc::default();
    let kept = received.clone();
    std::thread::spawn(move || {
        for stream in listener.incoming().map_while(Result::ok) {
            let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
            let mut reader = BufReader::new(stream);
            let mut length = 0usize;
            let mut line = String::new();
            while reader.read_line(&mut line).is_ok_and(|n| n > 0) && line != "\r\n" {
                if let Some(v) = line.to_ascii_lowercase().strip_prefix("content-length:") {
                    length = v.trim().parse().unwrap_or(0);
                }
                line.clear();
            }
            let mut body = vec![0u8; length];
            if reader.read_exact(&mut body).is_ok()
                && let Ok(v) = serde_json::from_slice::<Value>(&body)
            {
                kept.lock().unwrap().push(v);
            }
            let _ = reader.get_mut().write_all(b"HTTP/1.1 200 OK\r\ncontent-length: 0\r\nconnection: close\r\n\r\n");
        }
    });
    Ok((addr, received))
}
